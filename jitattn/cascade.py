"""Cascade attention: a prefix shared by many requests is read once for all of them.

When R requests share a P-token prefix (a system prompt), plain attention reads the prefix R times.
Cascade attention splits each request's keys into levels: the shared prefix (level 0), each request's
own suffix (the last level), and optionally more shared levels in between. Attention over one level
is a batch whose "sequences" are the level's key segments, each with the queries of every request
that shares it, computed on tensor cores by the prefill kernel; the per-level states (output, lse)
of each query are then merged by log-sum-exp (:func:`jitattn.merge.merge_states`). Reads go from
``R x (P + s)`` to ``P + sum(s_i)`` keys. (Ye et al. 2024, "Cascade Inference: Memory Bandwidth
Efficient Shared Prefix Batch Decoding", FlashInfer blog; the merge is FlashDecoding's.)

Positions continue across the levels: every spec feature sees each query and key at its absolute
position in the request's sequence (levels in order), through a spec with explicit query positions
(``AttentionSpec(query_positions="explicit")``): causal and window bounds, ALiBi, soft-cap, and the
variant's hooks, which see the request's index as ``batch``. Sinks join the denominator once (they
are folded in after the merge). A long shared level is cut into chunks, which run as separate
sequences of the same launch, so a few hundred prefix-reading blocks fill the GPU.

:func:`cascade_attention` is the entry point; :func:`cascade_pays` is the measured rule it uses to
choose between the cascade and the plain paged call when ``use_cascade`` is left to it.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
import operator
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from jitattn.checks import (check_flag, check_kv_cache, check_out, check_params, check_scales, check_spec,
                            check_tensor, check_vector, fail, kv_num_pages)
from jitattn.planning import capturing, choose_mode
from jitattn.spec import AttentionSpec

#: Keys per chunk of a shared level at least (shorter chunks cost more in merging than they gain).
MIN_CHUNK_KEYS = 256
#: Blocks the cascade launch aims at per SM (chunks of the shared levels are added until it is reached).
BLOCKS_PER_SM = 2


@dataclass(frozen=True)
class CascadeLevel:
    """One level of a cascade batch: key segments, each shared by a contiguous run of query tokens.

    Args:
        block_table: int32 ``(num_segments, max_pages)``: the pages of each segment's keys, in order.
        kv_lens: int32 ``(num_segments,)``: keys in each segment (the last page may be partial: a
            shared prefix may end mid-page; the next level's keys start on their own pages).
        query_start_loc: int32 ``(num_segments + 1,)``: segment ``j`` is shared by query tokens
            ``query_start_loc[j] : query_start_loc[j + 1]`` of ``q`` (0 first, ``total_q`` last; with
            a q padded past the last request, the last level may end before ``total_q`` and the others
            where it ends or at ``total_q``). The last level's segments are the requests; every level's
            boundaries must be boundaries of the next level (segments nest).
    """

    block_table: torch.Tensor
    kv_lens: torch.Tensor
    query_start_loc: torch.Tensor


def two_level(prefix_block_table: torch.Tensor, prefix_lens: torch.Tensor, prefix_start_loc: torch.Tensor,
              suffix_block_table: torch.Tensor, suffix_lens: torch.Tensor, query_start_loc: torch.Tensor
              ) -> list[CascadeLevel]:
    """The common case: shared prefixes (level 0), then each request's own suffix (level 1).

    Args:
        prefix_block_table, prefix_lens: int32 ``(num_prefixes, pages)``, ``(num_prefixes,)``.
        prefix_start_loc: int32 ``(num_prefixes + 1,)``: the query tokens sharing each prefix (the
            requests sharing a prefix are consecutive in the batch): 0 first, non-decreasing, ending
            where ``query_start_loc`` ends (``total_q``; with a padded q, there or at ``total_q``),
            every entry also an entry of ``query_start_loc`` (each prefix's queries are whole
            requests). Checked when read on the host: :func:`check_level_starts`.
        suffix_block_table, suffix_lens: int32 ``(batch, pages)``, ``(batch,)``; a suffix may be empty.
        query_start_loc: int32 ``(batch + 1,)``: each request's query tokens.
    """
    return [CascadeLevel(prefix_block_table, prefix_lens, prefix_start_loc),
            CascadeLevel(suffix_block_table, suffix_lens, query_start_loc)]


def cascade_pays(num_requests: int, prefix_len: int, suffix_len: float, *, mode: str = "graph") -> bool:
    """The measured rule: whether the cascade beats the plain paged call for R decode requests sharing a
    P-key prefix, each with about s keys of its own, run as ``mode`` runs them.

    ``mode="graph"`` (CUDA-graph replay, what the rule was measured on) is the rule below.
    ``mode="eager"``: never. Eager, the cascade pays its host work per layer on top (the bench's
    R50 / P1000 / s100 case took 0.174 ms eager against 0.080 ms for the plain call, a rule fitted on
    graph times choosing the slower path); no eager sweep of the planned cascade (plan once, run per
    layer) exists yet, so an eager caller takes the cascade only by asking for it (``use_cascade=True``
    or a ``plan``). The bench's cascade and host cases are where an eager rule would be fitted.

    Measured on the H200 (2026-11-29, hd128 32/8 heads bf16 page 16, both by CUDA-graph replay, the
    plain call reading the shared prefix pages from every request's table; BENCHMARKS.md "Cascade rule sweep",
    ``results/cascade-rule.json``): the cascade pays from R = 8 with a prefix
    of 1000+ keys that is at least 4x each suffix (1.06-4.75x), and from R = 32 with a prefix of 4096+
    keys at least 2x each suffix (1.05-2.21x). Below R = 8 the plain call reads the shared pages from L2
    and the cascade's fixed costs (its launch over chunks, the merge) win (0.26-0.92x); P = 256 never
    paid (0.47-0.79x). Of the 84 measured shapes the rule errs on three: R = 8, P = 8192, s = 2048
    (taken, 0.92x) and P = 1024, s = 512 at R = 8 and 128 (not taken, 1.12x and 1.05x).
    """
    if choose_mode(mode) == "eager":
        return False
    r, p, s = num_requests, prefix_len, suffix_len
    return r >= 8 and p >= 1000 and (p >= 4 * s or (r >= 32 and p >= 4096 and p >= 2 * s))


def _check_cascade_spec(spec: Any, call: str) -> None:
    """A spec the cascade's split preserves (:func:`cascade_attention`'s Raises)."""
    check_spec(spec, call)
    if spec.kv_storage != "paged" or spec.explicit_positions:  # latent too: its levels would need a latent twin
        fail(f"spec: cascade attention takes a paged spec with implicit query positions (kv_storage='paged', "
             f"query_positions='implicit'), got kv_storage={spec.kv_storage!r}, "
             f"query_positions={spec.query_positions!r}")
    v = spec.variant
    if v is not None and not v.softmax:
        fail(f"spec.variant={v.name!r} has no softmax: its levels' weighted sums have no lse to merge by")
    if v is not None and "output_transform" in v.cuda:
        fail(f"spec.variant={v.name!r} has an output_transform: it applies to the finished output, which a "
             f"cascade only has after the merge; run the plain paged_attention")
    if v is not None and any(isinstance(v.cuda.get(h), str) and re.search(r"\b(qo_len|kv_len)\b", v.cuda[h])
                             for h in v.cuda):  # the names, not a parameter such as max_kv_len
        fail(f"spec.variant={v.name!r}: a CUDA hook reads qo_len / kv_len, which a cascade level does not know "
             f"for the whole request; write it with positions only, or run the plain paged_attention")


def _check_levels(levels: Sequence[CascadeLevel], dev: torch.device | None) -> None:
    """Types, dtypes, devices and shapes of the levels (no host read); ``dev`` None: the first level's."""
    if not isinstance(levels, (list, tuple)) or len(levels) < 1 or not all(isinstance(v, CascadeLevel) for v in levels):
        fail(f"levels: expected a non-empty list of CascadeLevel, got {levels!r:.120}")
    if dev is None and isinstance(levels[0].query_start_loc, torch.Tensor):
        dev = levels[0].query_start_loc.device
    for i, lv in enumerate(levels):
        starts = _starts_name(i, len(levels))
        check_tensor(starts, lv.query_start_loc, dtype=torch.int32, ndim=1, device=dev)
        n = lv.query_start_loc.shape[0] - 1
        if n < 1:
            fail(f"{starts}: expected shape (num_segments + 1,) with num_segments >= 1, "
                 f"got {tuple(lv.query_start_loc.shape)}")
        check_tensor(f"levels[{i}].kv_lens", lv.kv_lens, dtype=torch.int32, ndim=1, device=dev)
        if lv.kv_lens.shape[0] != n:
            fail(f"levels[{i}].kv_lens: expected shape ({n},) (num_segments, from query_start_loc), "
                 f"got {tuple(lv.kv_lens.shape)}")
        check_tensor(f"levels[{i}].block_table", lv.block_table, dtype=torch.int32, ndim=2, device=dev)
        if lv.block_table.shape[0] != n or lv.block_table.shape[1] < 1:
            fail(f"levels[{i}].block_table: expected shape ({n}, max_pages >= 1), got {tuple(lv.block_table.shape)}")


def _check_validate(validate: Any) -> bool:
    """``validate`` checked (a bool), and refused under CUDA graph capture, as :func:`jitattn.plan` does.

    Raises:
        ValueError: not a bool; True while the current stream captures a graph.
    """
    if check_flag("validate", validate) and capturing():
        fail("validate=True: the cascade's checks read the levels on the host (a device sync), which CUDA graph "
             "capture does not allow; check the batch outside the capture and pass validate=False inside it")
    return bool(validate)


def _starts_name(i: int, num_levels: int) -> str:
    """How messages name level ``i``'s start locations; of two levels, as :func:`two_level`'s arguments too."""
    alias = ("prefix_start_loc", "query_start_loc")[i] if num_levels == 2 else None
    return f"levels[{i}].query_start_loc" + (f" (two_level's {alias})" if alias else "")


def _show(values: list[int], limit: int = 16) -> str:
    """A list for a message, its middle left out past ``limit`` entries."""
    if len(values) <= limit:
        return str(values)
    return f"[{', '.join(map(str, values[:limit - 1]))}, ..., {values[-1]}] ({len(values)} entries)"


def _host_lists(tensors: Sequence[torch.Tensor]) -> list[list[int]]:
    """1-D int32 tensors as host lists, in one transfer (a device sync for CUDA tensors)."""
    flat = torch.cat(list(tensors)).tolist()
    bounds = list(itertools.accumulate((t.shape[0] for t in tensors), initial=0))
    return [flat[a:b] for a, b in zip(bounds, bounds[1:])]


def _on_host(levels: Sequence[CascadeLevel]) -> bool:
    """Whether the levels are CPU tensors, whose values a check reads without a device sync (the
    reference path); checked levels share one device."""
    return levels[-1].query_start_loc.device.type == "cpu"


def _allowed_starts(i: int, num_levels: int, total_q: int, end: int, exact: bool) -> str:
    """What level ``i``'s start locations may be, for a message."""
    what = ("num_requests" if i == num_levels - 1 else "num_prefixes" if num_levels == 2 else "num_segments")
    text = f"expected int32 ({what} + 1,): 0 first, non-decreasing, "
    if i == num_levels - 1:
        return text + f"ending at total_q={total_q}" + ("" if exact else " (or before it: rows of q past it are "
                                                          "padding)")
    nxt = "query_start_loc" if num_levels == 2 else f"levels[{i + 1}].query_start_loc"
    why = "each prefix's queries are whole requests" if num_levels == 2 else "segments nest"
    ends = f"total_q={total_q}" if end == total_q else str(end)
    padded = "" if exact or end == total_q else f" (or at total_q={total_q}: rows of q past {end} are padding)"
    return text + f"ending at {ends} as {nxt} does{padded}, every entry also an entry of {nxt} ({why})"


def _starts_problem(starts: list[list[int]], i: int, total_q: int, exact: bool) -> str | None:
    """What is wrong with level ``i``'s start locations (the later levels' already checked), or None."""
    s, end = starts[i], starts[-1][-1]
    if s[0] != 0:
        return f"starts at {s[0]}"
    down = next((j for j in range(1, len(s)) if s[j] < s[j - 1]), None)
    if down is not None:
        return f"decreases at entry {down} ({s[down - 1]} -> {s[down]})"
    if i == len(starts) - 1:
        return None if s[-1] == total_q or (not exact and s[-1] < total_q) else f"ends at {s[-1]}"
    ends = {end} if exact else {end, total_q}  # a padded q: a shared level may cover the padding rows too
    if s[-1] not in ends:
        return f"ends at {s[-1]}"
    nxt = starts[i + 1]
    known = set(nxt) | ends
    stray = next((b for b in s if b not in known), None)
    if stray is None:
        return None
    if stray > end:
        return f"its boundary {stray} falls among q's padding rows (past the last request's end, {end})"
    j = bisect.bisect_right(nxt, stray) - 1
    seg = "request" if i + 1 == len(starts) - 1 else f"levels[{i + 1}] segment"
    return f"its boundary {stray} splits {seg} {j} (queries [{nxt[j]}, {nxt[j + 1]}))"


def check_level_starts(levels: Sequence[CascadeLevel], total_q: int, starts: list[list[int]] | None = None, *,
                       exact: bool = True) -> None:
    """The levels' start locations (``starts``: already read, else read here, a device sync for CUDA
    tensors): each 0 first and never decreasing; the last level's (the requests') ending at ``total_q``
    (``exact=False``: or before it, the rows of a padded q), every other level's where the requests'
    do (``exact=False``: or at ``total_q``, its last segment then holding the padding rows too), with
    each of its entries an entry of the next level's (segments nest: with :func:`two_level`, each
    prefix's queries are whole requests).

    Raises:
        ValueError: naming the level (of two, also as ``prefix_start_loc`` / ``query_start_loc``), its
            values and what is allowed; the last level is checked first.
    """
    starts = _host_lists([lv.query_start_loc for lv in levels]) if starts is None else starts
    for i in reversed(range(len(starts))):
        problem = _starts_problem(starts, i, total_q, exact)
        if problem is not None:
            end = starts[-1][-1]
            fail(f"{_starts_name(i, len(starts))} = {_show(starts[i])}: {problem}; "
                 f"{_allowed_starts(i, len(starts), total_q, end, exact)}")


def check_level_values(spec: AttentionSpec, levels: Sequence[CascadeLevel], total_q: int, num_pages: int) -> None:
    """Host checks of the levels' values (a device sync): the start locations
    (:func:`check_level_starts`, ending exactly at ``total_q``); lengths >= 0 and within each block
    table row; page ids of the used pages inside the cache; no request with more queries than keys.

    Raises:
        ValueError: the first problem, naming the level, the tensor and the entry.
    """
    check_level_starts(levels, total_q)
    for i, lv in enumerate(levels):
        capacity = lv.block_table.shape[1] * spec.page_size
        table = lv.block_table.cpu()
        for j, n in enumerate(lv.kv_lens.tolist()):
            if n < 0 or n > capacity:
                fail(f"levels[{i}].kv_lens[{j}]={n}: expected 0 <= kv_len <= block_table capacity "
                     f"{lv.block_table.shape[1]} pages x {spec.page_size} = {capacity}")
            used = table[j, : -(-n // spec.page_size)]
            if used.numel() and (int(used.min()) < 0 or int(used.max()) >= num_pages):
                fail(f"levels[{i}].block_table[{j}]: page ids must be in [0, {num_pages}), got {used.tolist()}")
    if levels and levels[-1].query_start_loc.shape[0] - 1 < 1:
        fail("levels[-1]: the last level's segments are the requests; expected at least one")
    # each request's queries are the last positions of its whole sequence (every level's segment): as the
    # plain call, a request may not bring more queries than it has keys
    req = levels[-1].query_start_loc.tolist() if levels else []
    lens = [(lv.query_start_loc.tolist(), lv.kv_lens.tolist()) for lv in levels]
    for r, (a, b) in enumerate(zip(req, req[1:])):
        if b > a:
            kv = sum(n[bisect.bisect_right(s, a) - 1] for s, n in lens)
            if b - a > kv:
                fail(f"levels: request {r} has qo_len={b - a} queries but {kv} keys over all levels; "
                     f"expected qo_len <= kv_len (its queries are the last positions of its sequence)")


@dataclass
class CascadePlan:
    """The pseudo-batch of one cascade call (device tensors, built without a host sync).

    ``num_states`` states per query token (one per chunk of every level); the launch's query rows are
    ``num_states`` copies of q, state-major.
    """

    num_states: int
    block_table: torch.Tensor      # (pseudo_batch, pages)
    seq_lens: torch.Tensor         # (pseudo_batch,)
    query_start_loc: torch.Tensor  # (pseudo_batch + 1,)
    query_positions: torch.Tensor  # (num_states * total_q,)
    functor_batch: torch.Tensor    # (num_states * total_q,)
    position_offset: torch.Tensor  # (pseudo_batch,)
    layout: tuple = ()             # _layout(spec, levels) it was made for (checked when it is run)
    mode: str = "graph"            # what it was planned for: "eager" or "graph" (jitattn.planning.MODES)
    attention_plan: Any = None     # the jit kernels' plan of the pseudo-batch, made at its first run


@functools.lru_cache(maxsize=256)
def explicit_twin(spec: AttentionSpec) -> AttentionSpec:
    """``spec.replace(query_positions="explicit")``, the spec a cascade's passes run, made once per spec
    (building a spec costs tens of microseconds of validation and canonical JSON: a cascade call's host
    time on the hot path)."""
    return spec.replace(query_positions="explicit")


def _layout(spec: AttentionSpec, levels: Sequence[CascadeLevel]) -> tuple:
    """What a plan depends on that a call can check without a device sync: the page size and the levels' shapes."""
    return (spec.page_size, tuple((tuple(lv.block_table.shape), lv.query_start_loc.shape[0]) for lv in levels))


def _segment_of(qsl: torch.Tensor, total_q: int) -> torch.Tensor:
    """Segment index of every query token (int64 ``(total_q,)``) from a level's start locations."""
    tokens = torch.arange(total_q, device=qsl.device, dtype=torch.int32)
    return torch.searchsorted(qsl, tokens, right=True).long() - 1


def _request_segments(levels: Sequence[CascadeLevel], total_q: int) -> list[torch.Tensor]:
    """Per level, the segment each request belongs to (int64 ``(num_requests,)``): the segment of its
    first query token (segments nest); a request without queries (or no queries at all) gets one
    clamped into range, which its (empty) rows never use."""
    req_qsl = levels[-1].query_start_loc
    first_tok = req_qsl[:-1].long().clamp(max=max(total_q - 1, 0))
    out = []
    for lv in levels:
        seg = _segment_of(lv.query_start_loc, total_q)[first_tok] if total_q else torch.zeros_like(first_tok)
        out.append(seg.clamp(0, lv.kv_lens.shape[0] - 1))
    return out


def plan_cascade(spec: AttentionSpec, levels: Sequence[CascadeLevel], total_q: int, *, num_sms: int,
                 chunks: Sequence[int] | None = None, mode: str | None = None, validate: bool = False
                 ) -> CascadePlan:
    """Lay a cascade batch out as one explicit-position batch (shapes only decide the layout).

    Level ``l`` is cut into ``C_l`` chunks of ``L_l`` keys (``L_l`` a multiple of the page size); chunk
    ``c`` of segment ``j`` becomes a sequence with the pages ``block_table[j, c L_l / page : ...]``,
    ``clamp(kv_len - c L_l, 0, L_l)`` keys, the queries of the tokens sharing the segment, their
    positions relative to the chunk's first key and that key's absolute position as the offset.

    Args:
        spec: the (implicit-position) spec the cascade runs.
        levels: the batch's :class:`CascadeLevel` list; total_q: rows of q.
        num_sms: the GPU's SM count (the default chunk counts aim at :data:`BLOCKS_PER_SM` per SM).
        chunks: ``C_l`` per level (default: :data:`BLOCKS_PER_SM` blocks per SM for the shared levels,
            chunks of at least :data:`MIN_CHUNK_KEYS` keys; 1 for the last level).
        mode: what the plan will be run as, "eager" or "graph" (None: graph while the current stream
            captures, else eager), kept as ``plan.mode``: whether to plan the cascade at all is
            ``cascade_pays(*rule_shape(...), mode=mode)``, and the rule differs by mode. The
            pseudo-batch depends only on shapes, and its jit plan (made at the first run, reused by
            every later layer) reads nothing on the host, so one plan serves a captured graph too.
        validate: also check the levels' start locations on the host (a device sync; not under graph
            capture): :func:`check_level_starts`, ending exactly at ``total_q``. Levels on the CPU
            have them checked always (no sync; a padded q allowed); CUDA ones otherwise not: bad
            start locations then give an undefined result.

    The levels may be on any one device: a CPU plan runs with ``attention=reference.paged_attention``;
    the jit kernels refuse it when :func:`cascade_attention` makes its jit plan (as :func:`jitattn.plan`
    refuses CPU metadata: the kernels run on CUDA devices), before any launch.

    Returns:
        a :class:`CascadePlan` on the levels' device (int32 tensors; ``num_states * total_q`` query rows).

    Raises:
        ValueError: a spec the cascade cannot split (as :func:`cascade_attention`), bad levels (types,
            dtypes, devices, shapes; start locations as :func:`check_level_starts` says, with
            ``validate=True`` or on the CPU), ``total_q`` / ``num_sms`` that are not ints >= 0 / >= 1,
            ``chunks`` that is not one int >= 1 per level, a bad ``mode``, ``validate=True`` under
            graph capture.
    """
    _check_cascade_spec(spec, "plan_cascade(spec, levels, total_q, num_sms=...)")
    _check_levels(levels, None)
    for name, value, least in (("total_q", total_q, 0), ("num_sms", num_sms, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            fail(f"{name}={value!r}: expected an int >= {least}")
    validate = _check_validate(validate)
    if validate or _on_host(levels):
        check_level_starts(levels, total_q, exact=validate)
    mode = choose_mode(mode)
    dev = levels[0].kv_lens.device
    page = spec.page_size
    seg = [_segment_of(lv.query_start_loc, total_q) for lv in levels]
    lens = [lv.kv_lens.long()[s.clamp(max=lv.kv_lens.shape[0] - 1)] for lv, s in zip(levels, seg)]  # per token
    level_start = torch.zeros(len(levels), total_q, dtype=torch.long, device=dev)
    for i in range(1, len(levels)):
        level_start[i] = level_start[i - 1] + lens[i - 1]
    req_qsl = levels[-1].query_start_loc.long()
    req = seg[-1].clamp(0, levels[-1].kv_lens.shape[0] - 1)  # rows past the last request (padding) index none
    total_kv = level_start[-1] + lens[-1]
    qo_len = (req_qsl[1:] - req_qsl[:-1])[req]
    tok = torch.arange(total_q, device=dev)
    abs_pos = total_kv - qo_len + (tok - req_qsl[req])
    if chunks is None:
        chunks = []
        for i, lv in enumerate(levels):
            capacity = lv.block_table.shape[1] * page
            if i == len(levels) - 1 or capacity <= MIN_CHUNK_KEYS:
                chunks.append(1)
                continue
            segments = lv.query_start_loc.shape[0] - 1
            blocks = (math.ceil(total_q * spec.group_size / 64) + segments) * spec.num_kv_heads
            want = max(1, math.ceil(BLOCKS_PER_SM * num_sms / max(blocks, 1)))
            chunks.append(max(1, min(want, capacity // MIN_CHUNK_KEYS)))
    try:
        counts = [operator.index(c) for c in chunks if not isinstance(c, bool)]
    except TypeError:
        counts = []
    if isinstance(chunks, (str, bytes)) or len(counts) != len(chunks) or len(counts) != len(levels) or \
            any(c < 1 for c in counts):
        fail(f"chunks={chunks!r}: expected one int >= 1 per level ({len(levels)})")
    chunks = counts
    chunk_pages = [math.ceil(lv.block_table.shape[1] / c) for lv, c in zip(levels, chunks)]
    width = max(chunk_pages)
    tables, kv_lens, qsls, positions, offsets, hook_batch = [], [], [], [], [], []
    state = 0
    for i, (lv, c, cp) in enumerate(zip(levels, chunks, chunk_pages)):
        n = lv.kv_lens.shape[0]
        padded = torch.zeros(n, c * cp, dtype=torch.int32, device=dev)
        padded[:, : lv.block_table.shape[1]] = lv.block_table
        per_chunk = padded.view(n, c, cp).transpose(0, 1)  # (c, n, cp)
        if cp < width:
            per_chunk = torch.nn.functional.pad(per_chunk, (0, width - cp))
        tables.append(per_chunk.reshape(c * n, width))
        keys = cp * page
        first = torch.arange(c, device=dev)[:, None] * keys  # (c, 1): chunk c's first key in the segment
        kv_lens.append((lv.kv_lens.long()[None, :] - first).clamp(0, keys).reshape(-1))
        seg_start = level_start[i][lv.query_start_loc[:-1].long().clamp(max=max(total_q - 1, 0))] if total_q else \
            torch.zeros(n, dtype=torch.long, device=dev)
        offsets.append((seg_start[None, :] + first).reshape(-1))
        qsl = lv.query_start_loc.long()[:-1]
        for k in range(c):
            qsls.append(qsl + (state + k) * total_q)
            positions.append(abs_pos - level_start[i] - k * keys)
            hook_batch.append(req)
        state += c
    qsls.append(torch.tensor([state * total_q], device=dev))
    as32 = lambda t: t.to(torch.int32).contiguous()  # noqa: E731
    return CascadePlan(num_states=state, block_table=as32(torch.cat(tables)), seq_lens=as32(torch.cat(kv_lens)),
                       query_start_loc=as32(torch.cat(qsls)), query_positions=as32(torch.cat(positions)),
                       functor_batch=as32(torch.cat(hook_batch)), position_offset=as32(torch.cat(offsets)),
                       layout=_layout(spec, levels), mode=mode)


def _fold_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Add each head's sink logit to the merged denominator once: ``lse' = logaddexp(lse, sink)``,
    ``out' = out * exp(lse - lse')`` (a row that saw no key keeps output 0, lse = sink)."""
    new = torch.logaddexp(lse, sinks.float()[None, :])
    w = torch.exp(torch.where(torch.isinf(lse), torch.full_like(lse, -math.inf), lse - new))
    return (out.float() * w[..., None]).to(out.dtype), new


def cascade_attention(spec: AttentionSpec, q: torch.Tensor, kv_cache: Any, levels: Sequence[CascadeLevel], *,
                      sinks: torch.Tensor | None = None, alibi_slopes: torch.Tensor | None = None,
                      params: Mapping[str, Any] | None = None, return_lse: bool = False,
                      k_scale: float = 1.0, v_scale: float = 1.0, use_cascade: bool | None = None,
                      validate: bool = False, chunks: Sequence[int] | None = None,
                      plan: CascadePlan | None = None, attention: Callable[..., Any] | None = None,
                      out: torch.Tensor | None = None, mode: str | None = None
                      ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of a batch whose requests share key prefixes, reading each shared level once.

    Request ``r`` (segment ``r`` of the last level) attends to the concatenation, in level order, of
    the segments its query tokens belong to; its ``qo_len`` queries are the last positions of that
    sequence, exactly as :func:`jitattn.paged_attention` on the un-split batch, whose result it equals
    (within the output dtype's rounding: per-level states are merged in fp32 from outputs rounded to
    ``spec.o_dtype``).

    Args:
        spec: a paged spec (implicit query positions) with softmax and no output hook.
        q: ``(total_q, num_qo_heads, head_dim_qk)``.
        kv_cache: the paged cache all levels' pages index (NHD or HND, as the spec): one tensor or a
            ``(k_cache, v_cache)`` pair, as :func:`jitattn.paged_attention`.
        levels: :class:`CascadeLevel` list (:func:`two_level` builds the usual two).
        sinks, alibi_slopes, params, k_scale, v_scale: as :func:`jitattn.paged_attention`; ``params``
            indexed by batch are indexed by the request (the last level's segment).
        return_lse: also return the natural-log lse, float32 ``(total_q, num_qo_heads)``.
        use_cascade: None (default): :func:`cascade_pays` decides for ``mode`` from :func:`rule_shape`
            (the lengths: a host read; under CUDA graph capture the block tables' capacities); a batch
            the plain call cannot express (a shared level that ends mid-page) always runs the cascade. True: always
            the cascade. False: the plain paged call on the concatenated block tables (ValueError when
            a shared level ends mid-page).
        validate: check the levels' values on the host first (a device sync; not under graph
            capture): :func:`check_level_values`. Without it the levels' types, dtypes, devices and
            shapes are checked, and their start locations (:func:`check_level_starts`, a padded q
            allowed) only where they are read without a sync or read anyway: levels on the CPU, and
            the path that may take the plain call (``use_cascade`` False, or None and the rule saying
            no), which reads the lengths. Other bad values (start locations on the cascade's CUDA
            path, lengths past a table, a request with more queries than keys) give an undefined result.
        chunks: per-level chunk counts (default: :func:`plan_cascade`'s).
        plan: the batch's :func:`plan_cascade` layout, made once per step and given to every layer:
            a layer then only copies q per state, runs the prefill kernel on the plan's jit plan (made
            at the first layer's run: :func:`jitattn.plan`) and merges (planning is some forty small
            torch operations). Given, the cascade runs (``use_cascade`` and ``chunks`` are ignored). A
            plan whose page size or level shapes differ from the call's is refused; one made from other
            level values of the same shapes is not detected (its lengths are baked in).
        attention: the paged-attention function to run the passes with (default: the jit kernels,
            :func:`jitattn.paged_attention`; :func:`jitattn.reference.paged_attention` runs it in torch).
        out: optional contiguous ``(total_q, num_qo_heads, head_dim_vo)`` of ``spec.o_dtype`` on q's
            device: written in place and returned (so it may not require grad, unless under ``torch.no_grad()``).
        mode: what :func:`cascade_pays` assumes ("eager" / "graph"; None: graph while the current
            stream captures, else eager).

    Returns:
        ``out`` ``(total_q, num_qo_heads, head_dim_vo)`` in ``spec.o_dtype`` and, if asked, the lse.

    Raises:
        ValueError: a spec the split cannot preserve (explicit positions already, ragged or latent K/V, no softmax,
            an output hook, a CUDA-string hook reading ``qo_len`` / ``kv_len``), bad levels (their
            shapes always; their start locations as ``validate`` says, naming them, with two levels
            also as :func:`two_level`'s ``prefix_start_loc`` / ``query_start_loc``; their other values
            with ``validate=True``), ``validate=True`` under graph capture, bad ``chunks``, a ``plan``
            for another layout or device, an ``out`` that requires grad, or an argument the plain call
            refuses (before any launch). The jit kernels (``attention`` None) refuse CPU tensors, as
            :func:`jitattn.plan` does.
    """
    _check_cascade_spec(spec, "cascade_attention(spec, q, kv_cache, levels, ...)")
    check_flag("return_lse", return_lse)
    validate = _check_validate(validate)
    if use_cascade is not None:
        check_flag("use_cascade", use_cascade)
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        fail(f"q: expected a (total_q, num_qo_heads, head_dim_qk) tensor, got {type(q).__name__}"
             f"{tuple(q.shape) if isinstance(q, torch.Tensor) else ''}")
    total_q = q.shape[0]
    if out is not None:
        check_out(spec, out, total_q, q.device)
        if out.requires_grad and torch.is_grad_enabled():  # out.copy_(result) at the end would raise
            fail("out: requires_grad=True; cascade_attention writes its result into out in place, which autograd "
                 "refuses for a tensor that requires grad: pass out.detach() (or no out), or call it under "
                 "torch.no_grad()")
    _check_levels(levels, q.device)
    if validate:
        check_kv_cache(spec, kv_cache, q.device)
        check_level_values(spec, levels, total_q, kv_num_pages(kv_cache))
    elif _on_host(levels):  # no device sync to read them
        check_level_starts(levels, total_q, exact=False)
    check_scales(spec, k_scale, v_scale)
    jit = attention is None  # the jit kernels: the cascade then runs through jitattn.plan / run
    if jit:
        from jitattn.runtime import paged_attention as attention
    mode = choose_mode(mode)
    # sinks are folded in after the merge (the passes get -inf ones): check them here, as the plain call does
    check_vector("sinks", sinks, spec.sinks, spec.num_qo_heads, q.device, "spec.sinks")
    shared = levels[:-1]
    num_requests = levels[-1].query_start_loc.shape[0] - 1
    check_params(spec, dict(params or {}), batch=num_requests, total_q=total_q, device=q.device)
    kw = dict(sinks=sinks, alibi_slopes=alibi_slopes, params=params, k_scale=k_scale, v_scale=v_scale)
    if plan is not None:
        if not isinstance(plan, CascadePlan):
            fail(f"plan: expected a CascadePlan from plan_cascade, got {type(plan).__name__}")
        if plan.layout and plan.layout != _layout(spec, levels):
            fail(f"plan: made for page_size and level shapes (block_table, query_start_loc) {plan.layout}, this call "
                 f"has {_layout(spec, levels)}; plan this batch with plan_cascade(spec, levels, ...)")
        if plan.block_table.device != q.device:
            fail(f"plan: made on {plan.block_table.device} (its levels' device), q is on {q.device}; plan the "
                 f"levels on q's device")
        return _cascade(spec, q, kv_cache, plan, total_q, attention if not jit else None, return_lse, out, kw)
    forced_plain = use_cascade is False  # the rule's "no" below falls back to the cascade on a mid-page level
    if use_cascade is None:
        use_cascade = bool(shared) and cascade_pays(*rule_shape(spec, levels, total_q), mode=mode)
    if not use_cascade or not shared:
        aligned = not shared or _pages_aligned(spec, levels, total_q)
        if not aligned and forced_plain and shared:
            fail("use_cascade=False: a shared level ends mid-page (a kv_lens entry not a multiple of page_size="
                 f"{spec.page_size}), so the requests' keys are not one page list each; use the cascade")
        if aligned:
            return _plain(spec, q, kv_cache, levels, total_q, attention, return_lse, out, kw)
    num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 132
    plan = plan_cascade(spec, levels, total_q, num_sms=num_sms, chunks=chunks, mode=mode)
    return _cascade(spec, q, kv_cache, plan, total_q, attention if not jit else None, return_lse, out, kw)


def _pages_aligned(spec: AttentionSpec, levels: Sequence[CascadeLevel], total_q: int) -> bool:
    """Whether every shared segment fills whole pages: a value, read on the host (only on the path that
    may take the plain call) with the start locations in one transfer, which are checked while there
    (:func:`check_level_starts`)."""
    lists = _host_lists([*(lv.query_start_loc for lv in levels), *(lv.kv_lens % spec.page_size for lv in levels[:-1])])
    check_level_starts(levels, total_q, lists[:len(levels)], exact=False)
    return not any(any(rest) for rest in lists[len(levels):])


def plain_metadata(spec: AttentionSpec, levels: Sequence[CascadeLevel], total_q: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The un-split batch of page-aligned levels: ``(block_table, seq_lens, query_start_loc)`` for
    :func:`jitattn.paged_attention`, each request's table the concatenation of its segments' pages
    (every shared level's segments must fill whole pages; not checked here)."""
    dev = levels[-1].query_start_loc.device
    segs = _request_segments(levels, total_q)
    rows = [lv.block_table[seg] for lv, seg in zip(levels, segs)]
    lens = [lv.kv_lens[seg].long() for lv, seg in zip(levels, segs)]
    # pages of level l start after the previous levels' pages (their lengths are whole pages): column c of
    # request r's table is column c - cum[r, l] of its level-l row, l the level whose pages hold c
    wide = torch.cat(rows, dim=1)
    base = torch.tensor([0, *[r.shape[1] for r in rows]], device=dev).cumsum(0)[:-1]  # level l's first column
    pages = torch.stack([-(-n // spec.page_size) for n in lens], dim=1)  # (R, L)
    cum = torch.cat([torch.zeros_like(pages[:, :1]), pages.cumsum(1)], dim=1)  # (R, L + 1)
    width = wide.shape[1]
    cols = torch.arange(width, device=dev)[None, :]
    level = (cols[:, :, None] >= cum[:, None, 1:-1]).sum(-1) if len(rows) > 1 else \
        torch.zeros(len(segs[0]), width, dtype=torch.long, device=dev)
    src = (cols - cum.gather(1, level) + base[level]).clamp(0, width - 1)
    table = torch.where(cols < cum[:, -1:], wide.gather(1, src), torch.zeros_like(wide)).to(torch.int32)
    return table.contiguous(), sum(lens).to(torch.int32), levels[-1].query_start_loc


def rule_shape(spec: AttentionSpec, levels: Sequence[CascadeLevel], total_q: int) -> tuple[float, float, float]:
    """``(R, P, s)`` for :func:`cascade_pays`: requests per segment of the first level, the mean of the
    requests' shared keys (every level but the last) and of their own keys (the last level).

    Reads the lengths on the host (a device sync); while the current stream captures a CUDA graph,
    which forbids that, it takes the block tables' capacities (pages x page size) instead.
    """
    requests = levels[-1].query_start_loc.shape[0] - 1
    per_segment = requests / max(levels[0].query_start_loc.shape[0] - 1, 1)
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        shared = sum(lv.block_table.shape[1] for lv in levels[:-1]) * spec.page_size
        return per_segment, shared, levels[-1].block_table.shape[1] * spec.page_size
    lens = [lv.kv_lens.long()[seg].float().mean() for lv, seg in zip(levels, _request_segments(levels, total_q))]
    values = torch.stack(lens).tolist()
    return per_segment, sum(values[:-1]), values[-1]


def _plain(spec, q, kv_cache, levels, total_q, attention, return_lse, out, kw):
    """The un-split batch, one plain paged call."""
    table, seq_lens, qsl = plain_metadata(spec, levels, total_q)
    res = attention(spec, q, kv_cache, table, seq_lens, qsl, return_lse=return_lse, **kw)
    return _into(out, res, return_lse)


def _into(out, res, return_lse):
    """``res`` with its output written into ``out`` when one is given."""
    if out is None:
        return res
    out.copy_(res[0] if return_lse else res)
    return (out, res[1]) if return_lse else out


def _run_planned(espec, qq, kv_cache, plan, kw):
    """The pseudo-batch on the jit kernels through the cascade plan's own jit plan (made once)."""
    from jitattn import runtime

    if plan.attention_plan is None:  # graph mode: the pseudo-batch's launches depend on shapes alone
        plan.attention_plan = runtime.plan(espec, plan.block_table, plan.seq_lens, plan.query_start_loc,
                                           total_q=qq.shape[0], query_positions=plan.query_positions,
                                           functor_batch=plan.functor_batch, position_offset=plan.position_offset,
                                           mode="graph")
    return runtime.run(qq, kv_cache, plan.attention_plan, spec=espec, return_lse=True, **kw)


def _cascade(spec, q, kv_cache, plan, total_q, attention, return_lse, out, kw):
    """The planned cascade: q per state, one pass over every level's chunks, the merge (``attention``
    None: the jit kernels through :func:`jitattn.run`)."""
    from jitattn.merge import merge_states

    if plan.query_positions.shape[0] != plan.num_states * total_q:
        fail(f"plan: made for {plan.query_positions.shape[0] // max(plan.num_states, 1)} query tokens, "
             f"q has {total_q}")
    espec = explicit_twin(spec)
    sinks = kw.pop("sinks")
    if spec.sinks:  # sinks join the denominator once: after the merge, not in every level
        kw["sinks"] = torch.full_like(sinks, -math.inf)
    n = plan.num_states
    qq = q.unsqueeze(0).expand(n, *q.shape).reshape(n * total_q, *q.shape[1:])
    if attention is None:
        states, lse = _run_planned(espec, qq, kv_cache, plan, kw)
    else:
        states, lse = attention(espec, qq, kv_cache, plan.block_table, plan.seq_lens, plan.query_start_loc,
                                return_lse=True, query_positions=plan.query_positions,
                                functor_batch=plan.functor_batch, position_offset=plan.position_offset, **kw)
    v = states.view(n, total_q, *states.shape[1:]).transpose(0, 1)
    s = lse.view(n, total_q, lse.shape[1]).transpose(0, 1)
    merged, merged_lse = merge_states(v, s)
    if spec.sinks:
        merged, merged_lse = _fold_sinks(merged, merged_lse, sinks)
    return _into(out, (merged, merged_lse) if return_lse else merged, return_lse)
