"""Benchmark: jitattn against the anchors, side by side, in one process, on the same inputs.

A performance claim counts only as a ratio measured in one run (these machines are noisy). Each
case times jitattn and every anchor installed here on the same random inputs (CUDA events, median
after warm-up), and reports each one's error against the fp32 reference, so a fast wrong answer
shows as wrong.

Anchors: torch SDPA (flash and cuDNN backends; plain causal/full cases only), FlexAttention
(torch.compile'd once per case, the variant written as score_mod / mask_mod) and FlashInfer
(paged prefill / decode wrappers on the same paged cache) when ``import flashinfer`` works. An
anchor that cannot express a case shows as a "skipped" row with the reason; one that raises shows
as a "failed" row with the error. Nothing an anchor does stops the run.

Units: prefill in TFLOP/s with 4 x head_dim FLOPs per visible (query, key) pair per query head;
decode in TB/s of K and V bytes the case must read (keys inside the window only). Times in ms.

``python -m jitattn.bench --list`` works without a GPU; ``--compile`` without a GPU measures the
nvcc figures only; ``--from-json`` re-renders a run's tables (and ``--md`` BENCHMARKS.md) anywhere.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from jitattn.reference import default_alibi_slopes, torch_dtype
from jitattn.spec import AttentionSpec
from jitattn.testing import PagedBatch, random_paged_batch, relative_error, visible_keys

REPO = Path(__file__).resolve().parent.parent
#: Model configs whose layer kinds are benchmarked by default (absent from an installed wheel).
EXAMPLE_MODELS = REPO / "examples" / "models"
#: H200 L2 is 60 MB: a decode case reads at least twice that, so it measures HBM, not L2.
MIN_DECODE_BYTES = 128 * 10**6
#: Model decode batches start at 64 sequences and double (up to this) until they read MIN_DECODE_BYTES.
MAX_DECODE_BATCH = 1024
MODEL_KV_LEN = 4096
MODEL_PREFILL_BATCH = 2
#: Prefill cases with more sequences than this check their error on the first sequence only.
FULL_CHECK_MAX_SEQS = 2
#: An implementation whose relative error exceeds this is marked WRONG and never counts as the best anchor.
MAX_REL_ERR = 2e-2
ANCHORS = ("sdpa", "flex", "flashinfer")


# ---- cases ------------------------------------------------------------------------------------
@dataclass
class BenchCase:
    """One benchmark case: a spec and a batch shape (q_lens[b] queries against kv_lens[b] keys)."""

    name: str
    spec: AttentionSpec
    q_lens: list[int]
    kv_lens: list[int]
    phase: str  # "prefill", "decode" or "mixed" (prefill chunks and decode rows in one call; FLOP units)
    # Also time the same batch from contiguous varlen K/V (a ragged spec): "jitattn-ragged", so the
    # paged row's ratio is paged / contiguous (issue #6: within 10%).
    ragged_twin: bool = False
    # phase "cascade": (R requests, P shared prefix keys, s own suffix keys); q_lens / kv_lens are the
    # un-split batch's (1 query, P + s keys each)
    cascade: tuple[int, int, int] | None = None

    @property
    def is_decode(self) -> bool:
        return self.phase in ("decode", "cascade")

    @property
    def check_seqs(self) -> int:
        """Sequences whose rows the reference checks: all, except prefill cases of > 2 sequences (the first)."""
        if self.phase == "prefill" and len(self.q_lens) > FULL_CHECK_MAX_SEQS:
            return 1
        return len(self.q_lens)

    def describe(self) -> str:
        """``64 x (1 q, 4096 kv), <spec>`` for --list and the JSON."""
        shape = (f"{len(self.q_lens)} x ({self.q_lens[0]} q, {self.kv_lens[0]} kv)"
                 if len(set(self.q_lens)) == 1 and len(set(self.kv_lens)) == 1 else f"{len(self.q_lens)} sequences")
        return f"{self.phase}, {shape}, {self.spec.describe()}"


def design_cases() -> list[BenchCase]:
    """The six cases of the anchor table in DESIGN.md, same shapes."""
    hd128 = AttentionSpec(32, 8, 128)
    gemma = AttentionSpec(16, 8, 256, logits_soft_cap=50.0, window_left=4095, sm_scale=256 ** -0.5)
    phi3 = AttentionSpec(32, 32, 96)
    return [
        BenchCase("prefill-hd128-causal-b4x8192", hd128, [8192] * 4, [8192] * 4, "prefill"),
        BenchCase("prefill-gemma2-9b-b2x8192", gemma, [8192] * 2, [8192] * 2, "prefill"),
        BenchCase("prefill-phi3-hd96-b4x8192", phi3, [8192] * 4, [8192] * 4, "prefill"),
        BenchCase("decode-hd128-b64x4096", hd128, [1] * 64, [4096] * 64, "decode"),
        BenchCase("decode-gemma2-9b-b64x8192", gemma, [1] * 64, [8192] * 64, "decode"),
        BenchCase("decode-hd128-b1x32768", hd128, [1], [32768], "decode"),
    ]


def decode_target_cases() -> list[BenchCase]:
    """Extra decode cases of the fast-decode targets: gpt-oss sliding layer, page sizes 1/16/64, FP8 KV."""
    gpt_oss = AttentionSpec(64, 8, 64, window_left=127, sinks=True)
    out = [BenchCase("decode-gpt-oss-sliding-b256x8192", gpt_oss, [1] * 256, [8192] * 256, "decode")]
    for ps in (1, 16, 64):
        out.append(BenchCase(f"decode-hd128-b64x4096-page{ps}", AttentionSpec(32, 8, 128, page_size=ps),
                             [1] * 64, [4096] * 64, "decode"))
    # FP8 (e4m3) KV with per-tensor k_scale / v_scale: half the bytes of the page16 case above, so
    # the same time would show half the TB/s; the target is a ratio of times against that case.
    out.append(BenchCase("decode-hd128-b64x4096-fp8", AttentionSpec(32, 8, 128, kv_dtype="float8_e4m3fn"),
                         [1] * 64, [4096] * 64, "decode"))
    return out


def ragged_cases() -> list[BenchCase]:
    """The first design case timed from the paged cache (page 16) and from contiguous K/V, one run."""
    return [BenchCase("prefill-hd128-causal-b4x8192-vs-ragged", AttentionSpec(32, 8, 128), [8192] * 4,
                      [8192] * 4, "prefill", ragged_twin=True)]


def mixed_cases() -> list[BenchCase]:
    """Issue #6's mixed batch: 4 prefill chunks of 2048 and 60 decode rows (4096 keys each), one call.

    Prefill sequences come first, so ``jitattn-separate`` (the same batch as one prefill call and
    one decode call, :func:`split_batch`) writes the same output rows.
    """
    hd128 = AttentionSpec(32, 8, 128)
    return [BenchCase("mixed-hd128-4x2048-prefill+60x4096-decode", hd128, [2048] * 4 + [1] * 60,
                      [2048] * 4 + [4096] * 60, "mixed")]


def cascade_cases() -> list[BenchCase]:
    """Issue #9's shared-prefix decode batches: R requests share a P-key prefix and add s keys each.

    ``jitattn`` is the cascade (:func:`jitattn.cascade.cascade_attention`, use_cascade=True); the anchor
    ``jitattn-plain`` is the same batch through the plain decode call (each request's block table
    holding the shared prefix pages, then its own; a prefix that ends mid-page has its last page copied
    per request). TB/s counts the un-split batch's bytes, R (P + s) keys: the cascade's rate is what
    the plain path would need to match it.
    """
    hd128 = AttentionSpec(32, 8, 128)
    out = []
    for r, p, s in ((50, 1000, 100), (64, 8192, 256)):
        out.append(BenchCase(f"cascade-hd128-r{r}-p{p}-s{s}", hd128, [1] * r, [p + s] * r, "cascade", cascade=(r, p, s)))
    return out


def decode_kv_bytes(spec: AttentionSpec, batch: int, kv_len: int) -> int:
    """Bytes of K and V a decode batch of ``batch`` x (1 query, ``kv_len`` keys) must read (window applied)."""
    elem = torch.tensor([], dtype=torch_dtype(spec.kv_dtype)).element_size()
    row = spec.num_kv_heads * (spec.head_dim_qk + spec.head_dim_vo) * elem
    return batch * visible_keys(spec, 1, kv_len) * row


def decode_batch_size(spec: AttentionSpec, kv_len: int = MODEL_KV_LEN) -> int:
    """64 sequences, doubled until the batch reads MIN_DECODE_BYTES (> 2 x L2), at most MAX_DECODE_BATCH.

    A narrow window (gpt-oss: 128 keys) reads little per sequence, so its batch grows: 64 x 4096
    of gpt-oss sliding reads 17 MB and would run from L2.
    """
    batch = 64
    while decode_kv_bytes(spec, batch, kv_len) < MIN_DECODE_BYTES and batch < MAX_DECODE_BATCH:
        batch *= 2
    return batch


def model_cases(config: str | os.PathLike) -> list[BenchCase]:
    """A decode and a prefill case for every layer kind of a Hugging Face config.

    Decode: :func:`decode_batch_size` x (1 query, 4096 keys); prefill: 2 x 4096 queries over 4096
    keys. Names: ``decode-<model>-<kind>-b<B>x4096``, ``prefill-<model>-<kind>-b2x4096`` with
    kind ``full`` or ``sliding``.
    """
    from jitattn.models import load_model_config

    model = load_model_config(config)
    label = Path(model.name).name.lower() or Path(config).stem
    out = []
    for kind in model.layer_kinds:
        short = kind.name.split("_")[0]
        b, n = decode_batch_size(kind.spec), MODEL_KV_LEN
        out.append(BenchCase(f"decode-{label}-{short}-b{b}x{n}", kind.spec, [1] * b, [n] * b, "decode"))
        p = MODEL_PREFILL_BATCH
        out.append(BenchCase(f"prefill-{label}-{short}-b{p}x{n}", kind.spec, [n] * p, [n] * p, "prefill"))
    return out


def example_model_configs() -> list[Path]:
    """The configs in examples/models (empty when jitattn runs from an installed wheel)."""
    return sorted(EXAMPLE_MODELS.glob("*.json")) if EXAMPLE_MODELS.is_dir() else []


def all_cases(models: list[Path] | None = None) -> list[BenchCase]:
    """DESIGN.md's six, the decode targets, then every layer kind of every model (default: examples/models)."""
    out = design_cases() + decode_target_cases() + mixed_cases() + ragged_cases() + cascade_cases()
    for config in example_model_configs() if models is None else models:
        out += model_cases(config)
    return out


class BenchUsageError(SystemExit):
    """A bad argument (``--case``, ``--model``, ``--from-json``): the message names it and the value.

    A SystemExit, so ``python -m jitattn.bench`` prints the message without a traceback; ``jitattn
    bench`` prints it as ``jitattn: error: ...`` and exits 2 (a usage error).
    """


def select_cases(names: list[str] | None, models: list[str] | None) -> list[BenchCase]:
    """Cases whose name contains any ``names`` entry, plus every case of each ``models`` config.

    Neither given: every case of :func:`all_cases`. Duplicates (same name) are dropped.

    Raises:
        BenchUsageError: a ``--case`` that matches nothing, or a ``--model`` config that is missing
            or invalid (the message names it).
    """
    if not names and not models:
        return all_cases()
    chosen: list[BenchCase] = []
    if names:
        pool = all_cases()
        for sel in names:
            hits = [c for c in pool if sel in c.name]
            if not hits:
                raise BenchUsageError(f"--case {sel!r} matches no case; `python -m jitattn.bench --list` shows them")
            chosen += hits
    for config in models or []:
        try:
            chosen += model_cases(config)
        except (OSError, ValueError) as exc:
            raise BenchUsageError(f"--model {config}: {exc}") from exc
    unique: dict[str, BenchCase] = {}
    for c in chosen:
        unique.setdefault(c.name, c)
    return list(unique.values())


# ---- timing -----------------------------------------------------------------------------------
def time_ms(fn: Callable[[], Any], *, warmup: int = 3, rep: int = 10, trials: int = 5) -> float:
    """Milliseconds per call of ``fn``: CUDA events around ``rep`` back-to-back calls, median of ``trials``.

    Back-to-back calls let the host run ahead of the GPU, so launch latency is hidden exactly when
    it would be in a real serving loop, and counted when the host cannot keep up.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(rep):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / rep)
    return statistics.median(times)


def time_graph_ms(fn: Callable[[], Any], *, rep: int = 10, trials: int = 5) -> float:
    """Milliseconds per call of ``fn`` replayed from a CUDA graph of ``rep`` calls: GPU time only,
    no host launch cost (how a serving engine runs decode). Raises if ``fn`` cannot be captured."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up on the capture stream (lazy initialisation must not happen under capture)
        stream.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(rep):
                fn()
    torch.cuda.synchronize()
    return time_ms(graph.replay, warmup=1, rep=1, trials=trials) / rep


# ---- results ----------------------------------------------------------------------------------
@dataclass
class Result:
    """One implementation on one case. Times in ms; ``rate`` in ``unit`` (TFLOP/s or TB/s)."""

    case: str
    impl: str
    ms: float  # eager, back-to-back calls
    graph_ms: float  # CUDA-graph replay (GPU time); nan when the implementation cannot be captured
    rate: float  # from graph_ms when available, else ms
    unit: str
    rel_err: float  # vs the fp32 reference; nan with --no-check, inf when the output holds NaN/inf
    note: str = ""
    status: str = "ok"  # "ok", "skipped" (cannot express the case) or "failed" (raised)

    @classmethod
    def not_run(cls, case: str, impl: str, unit: str, status: str, note: str) -> "Result":
        return cls(case, impl, math.nan, math.nan, math.nan, unit, math.nan, note, status)


def measure(case: str, impl: str, fn: Callable[[], Any], work: float, unit: str, err: float) -> Result:
    """Eager and graph timings of one implementation; the rate uses the graph time when there is one.

    ``work`` is in TFLOP or TB, so work / seconds is TFLOP/s or TB/s.
    """
    ms = time_ms(fn)
    note = ""
    try:
        gms = time_graph_ms(fn)
    except Exception as exc:  # noqa: BLE001 - any capture failure just means "no graph figure"
        gms, note = math.nan, f"no graph: {one_line(exc, 60)}"
    best = gms if not math.isnan(gms) else ms
    return Result(case, impl, ms, gms, work / (best / 1e3), unit, err, note)


def one_line(exc: BaseException | str, limit: int = 160) -> str:
    """``Type: first line of the message``, cut to ``limit`` characters (for a table cell)."""
    text = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
    text = " ".join(text.split()).replace("|", "/")
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---- implementations --------------------------------------------------------------------------
class Skip(Exception):
    """The implementation cannot express this case; the message says why (a "skipped" row)."""


@dataclass
class Runner:
    """One implementation ready to run a case.

    ``call()`` launches it (what is timed); ``rows(out)`` maps its output to the paged layout
    ``(total_q, num_qo_heads, head_dim_vo)`` for the error check; ``note`` goes to the table.
    """

    call: Callable[[], torch.Tensor]
    rows: Callable[[torch.Tensor], torch.Tensor] = lambda out: out
    note: str = ""


@dataclass
class Contiguous:
    """The batch as dense (B, H, N, D) tensors, for anchors that take no paged cache (equal lengths only)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor

    def rows(self, out: torch.Tensor) -> torch.Tensor:
        """(B, H, N, D) output -> (B * N, H, D), the paged row order."""
        b, h, n, d = out.shape
        return out.transpose(1, 2).reshape(b * n, h, d)


def to_contiguous(batch: PagedBatch) -> Contiguous | None:
    """Dense copies of q, K and V (None unless every sequence has the same q_len and kv_len)."""
    from jitattn.reference import gather_kv

    if len(set(batch.q_lens)) != 1 or len(set(batch.kv_lens)) != 1:
        return None
    b, ql = len(batch.q_lens), batch.q_lens[0]
    q = batch.q.view(b, ql, batch.spec.num_qo_heads, -1).transpose(1, 2)
    ks, vs = zip(*(gather_kv(batch.spec, batch.kv_cache, batch.block_table, i, batch.kv_lens[i]) for i in range(b)))
    k = torch.stack(ks).transpose(1, 2).contiguous()  # (B, H_kv, L, D)
    v = torch.stack(vs).transpose(1, 2).contiguous()
    return Contiguous(q.contiguous(), k, v)


def jitattn_runner(case: BenchCase, batch: PagedBatch) -> Runner | dict[str, Runner]:
    """jitattn's kernels on the paged batch (compiled or loaded from the cache on first use)."""
    from jitattn.runtime import load_kernel

    kernel = load_kernel(case.spec)
    hint = 1 if case.is_decode else None
    out = torch.empty(batch.q.shape[0], case.spec.num_qo_heads, case.spec.head_dim_vo,
                      dtype=torch_dtype(case.spec.o_dtype), device=batch.q.device)
    call = lambda: kernel.paged_attention(*batch.args(), **batch.kwargs(), out=out, max_query_len=hint)  # noqa: E731
    if case.ragged_twin:
        return {"jitattn": Runner(call, note=f"{kernel.entry.arch}, paged (page {case.spec.page_size})"),
                "jitattn-ragged": ragged_twin_runner(case, batch)}
    if case.phase != "mixed":
        return Runner(call, note=f"{kernel.entry.arch}")
    # The same batch as two calls, the prefill sequences then the decode rows: what one call must beat.
    n = sum(1 for ql in batch.q_lens if ql > 1)
    first, rest = split_batch(batch, n)
    rows = first.q.shape[0]

    def separate() -> torch.Tensor:
        kernel.paged_attention(*first.args(), **first.kwargs(), out=out[:rows])
        kernel.paged_attention(*rest.args(), **rest.kwargs(), out=out[rows:], max_query_len=1)
        return out

    return {"jitattn": Runner(call, note=f"{kernel.entry.arch}, one call"),
            "jitattn-separate": Runner(separate, note=f"prefill call ({n} seqs) + decode call, same kernels")}


def ragged_twin_inputs(case: BenchCase, batch: PagedBatch
                       ) -> tuple[AttentionSpec, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ragged spec, k, v, kv_start_loc)``: the paged batch's K/V copied out to contiguous varlen tensors."""
    from jitattn.reference import gather_kv

    spec = case.spec.replace(kv_storage="ragged")
    ks, vs = zip(*(gather_kv(case.spec, batch.kv_cache, batch.block_table, i, n) for i, n in enumerate(batch.kv_lens)))
    k, v = torch.cat(ks).contiguous(), torch.cat(vs).contiguous()
    kv_start_loc = torch.tensor([0, *itertools.accumulate(batch.kv_lens)], dtype=torch.int32, device=k.device)
    return spec, k, v, kv_start_loc


def ragged_twin_runner(case: BenchCase, batch: PagedBatch) -> Runner:
    """The paged batch's K/V copied out to contiguous varlen tensors, run by the ragged spec's kernel."""
    from jitattn.runtime import load_kernel

    spec, k, v, kv_start_loc = ragged_twin_inputs(case, batch)
    kernel = load_kernel(spec)
    out = torch.empty(batch.q.shape[0], spec.num_qo_heads, spec.head_dim_vo, dtype=torch_dtype(spec.o_dtype),
                      device=batch.q.device)
    kw = {"sinks": batch.sinks, "alibi_slopes": batch.alibi_slopes, "params": batch.params}
    call = lambda: kernel.ragged_attention(batch.q, k, v, batch.query_start_loc, kv_start_loc, **kw,  # noqa: E731
                                           out=out)
    return Runner(call, note=f"{kernel.entry.arch}, contiguous varlen K/V")


def split_batch(batch: PagedBatch, n: int) -> tuple[PagedBatch, PagedBatch]:
    """Sequences ``[0, n)`` and ``[n, B)`` of ``batch`` as two batches over the same KV cache (views)."""
    import dataclasses

    qsl = batch.query_start_loc
    rows = int(qsl[n])
    first = dataclasses.replace(batch, q=batch.q[:rows], block_table=batch.block_table[:n],
                                seq_lens=batch.seq_lens[:n], query_start_loc=qsl[: n + 1],
                                q_lens=batch.q_lens[:n], kv_lens=batch.kv_lens[:n])
    rest = dataclasses.replace(batch, q=batch.q[rows:], block_table=batch.block_table[n:],
                               seq_lens=batch.seq_lens[n:], query_start_loc=qsl[n:] - rows,
                               q_lens=batch.q_lens[n:], kv_lens=batch.kv_lens[n:])
    return first, rest


def window_masks_nothing(case: BenchCase) -> bool:
    """True when the spec's window hides no (query, key) pair of this case (e.g. window 4096 over 4096 keys)."""
    from jitattn.testing import visible_pairs

    s = case.spec
    plain = s.replace(window_left=-1, window_right=-1)
    return all(visible_pairs(s, q, k) == visible_pairs(plain, q, k) for q, k in set(zip(case.q_lens, case.kv_lens)))


def plain_attention_problem(case: BenchCase) -> str | None:
    """Why torch SDPA's flash/cuDNN backends cannot run the case (None when they can).

    A window that hides nothing in this case (Mistral's 4096 over 4096 keys) does not count.
    """
    s = case.spec
    has_window = (s.window_left >= 0 or s.window_right >= 0) and not window_masks_nothing(case)
    extras = [name for name, on in (("window", has_window), ("soft-cap", bool(s.logits_soft_cap)),
                                    ("ALiBi", s.alibi), ("sinks", s.sinks),
                                    ("custom variant", s.variant is not None),
                                    (f"{s.kv_dtype} KV cache", s.kv_dtype != s.q_dtype)) if on]
    return f"SDPA flash/cuDNN take no {', '.join(extras)}" if extras else None


def sdpa_runners(case: BenchCase, dense: Contiguous | None) -> dict[str, Runner]:
    """torch SDPA's flash and cuDNN backends (plain causal/full attention only).

    Raises:
        Skip: the spec has a window, soft-cap, ALiBi, sinks or a custom variant, or unequal lengths.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    s = case.spec
    problem = plain_attention_problem(case) or (None if dense is not None else "unequal sequence lengths")
    if problem:
        raise Skip(problem)
    # SDPA's is_causal is top-left aligned: right only when every query row's position is its index.
    causal = s.causal and not case.is_decode  # a decode row sees every key: no mask needed
    if causal and case.q_lens[0] != case.kv_lens[0]:
        raise Skip("SDPA's causal mask is top-left aligned; this case has q_len < kv_len")

    def make(backend) -> Runner:
        def call() -> torch.Tensor:
            with sdpa_kernel(backend):
                return sdpa(dense.q, dense.k, dense.v, is_causal=causal, scale=s.sm_scale, enable_gqa=s.group_size > 1)
        return Runner(call, dense.rows)

    return {"sdpa-flash": make(SDPBackend.FLASH_ATTENTION), "sdpa-cudnn": make(SDPBackend.CUDNN_ATTENTION)}


# ---- FlexAttention ----------------------------------------------------------------------------
def flex_mask_mod(spec: AttentionSpec, q_offset: int) -> Callable | None:
    """The spec's structural mask as a FlexAttention ``mask_mod(b, h, q_idx, kv_idx) -> bool``.

    Flex numbers queries from 0; query ``q_idx`` sits at position ``p = q_idx + q_offset``
    (``q_offset = kv_len - q_len``: a decode query is at ``kv_len - 1``). Key ``kv_idx`` is visible
    when ``kv_idx <= p`` (causal), ``p - kv_idx <= window_left``, ``kv_idx - p <= window_right``
    (same rules as :func:`jitattn.reference.visible`). None when nothing is masked.
    """
    causal, left, right = spec.causal, spec.window_left, spec.window_right
    if not causal and left < 0 and right < 0:
        return None

    def mask_mod(b, h, q_idx, kv_idx):
        diff = q_idx + q_offset - kv_idx  # p - j
        conds = ([diff >= 0] if causal else []) + ([diff <= left] if left >= 0 else []) + \
            ([-diff <= right] if right >= 0 else [])
        ok = conds[0]
        for c in conds[1:]:
            ok = ok & c
        return ok

    return mask_mod


def flex_score_mod(spec: AttentionSpec, q_offset: int, alibi_slopes: torch.Tensor | None = None) -> Callable | None:
    """Soft-cap and ALiBi as a FlexAttention ``score_mod(score, b, h, q_idx, kv_idx)``; None when neither.

    Flex's ``score`` is already ``scale * q.k`` (``scale=spec.sm_scale``), the spec's ``s``; the mod
    applies ``cap * tanh(s / cap)`` then adds ``alibi_slopes[h] * (kv_idx - p)`` with
    ``p = q_idx + q_offset``, in the reference's order. ``alibi_slopes``: float32 ``(num_qo_heads,)``,
    required when ``spec.alibi``.
    """
    cap = spec.logits_soft_cap
    if not cap and not spec.alibi:
        return None
    if spec.alibi and alibi_slopes is None:
        raise ValueError("alibi_slopes: the spec has ALiBi, so a float32 (num_qo_heads,) tensor is required")

    def score_mod(score, b, h, q_idx, kv_idx):
        if cap:
            score = cap * torch.tanh(score / cap)
        if alibi_slopes is not None:
            score = score + alibi_slopes[h] * (kv_idx - (q_idx + q_offset))
        return score

    return score_mod


def flex_problem(spec: AttentionSpec) -> str | None:
    """Why the spec has no score_mod/mask_mod form here (None when it has)."""
    if spec.sinks:
        return "sinks (a per-head logit in the softmax denominator only) have no score_mod/mask_mod form"
    if spec.variant is not None:
        return f"custom variant {spec.variant.name!r}: no Flex translation of its functors"
    if spec.kv_dtype != spec.q_dtype:
        return f"{spec.kv_dtype} KV cache: the dense Flex inputs would need dequantising first"
    return None


def flex_call(spec: AttentionSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int, *,
              compiled: bool = True) -> Callable[[], torch.Tensor]:
    """A closure running FlexAttention on dense q ``(B, H_qo, N, D)``, k/v ``(B, H_kv, L, D)``.

    Builds the block mask once (only when the case masks some pair) and, with ``compiled``,
    wraps ``flex_attention`` in ``torch.compile(fullgraph=True, dynamic=False)`` so a graph break
    raises instead of falling back to the unfused path (which materialises every score).
    """
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from jitattn.testing import visible_pairs

    n, kv_len = q.shape[2], k.shape[2]
    slopes = default_alibi_slopes(spec, q.device) if spec.alibi else None
    score_mod = flex_score_mod(spec, q_offset, slopes)
    mask_mod = flex_mask_mod(spec, q_offset) if visible_pairs(spec, n, kv_len) < n * kv_len else None
    block_mask = create_block_mask(mask_mod, None, None, n, kv_len, device=q.device) if mask_mod else None
    fn = torch.compile(flex_attention, fullgraph=True, dynamic=False) if compiled else flex_attention
    gqa = spec.group_size > 1
    return lambda: fn(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=spec.sm_scale, enable_gqa=gqa)


def flex_runner(case: BenchCase, dense: Contiguous | None) -> Runner:
    """FlexAttention, compiled for this case after a dynamo reset; the note has the first-call seconds.

    Raises:
        Skip: sinks, a custom variant, or unequal lengths.
    """
    import torch._dynamo

    problem = flex_problem(case.spec) or (None if dense is not None else "unequal sequence lengths")
    if problem:
        raise Skip(problem)
    torch._dynamo.reset()  # one compile per case; never hit the recompile limit and fall back to eager
    call = flex_call(case.spec, dense.q, dense.k, dense.v, case.kv_lens[0] - case.q_lens[0])
    t0 = time.perf_counter()
    call()
    torch.cuda.synchronize()
    return Runner(call, dense.rows, note=f"compile+1st call {time.perf_counter() - t0:.1f} s")


# ---- FlashInfer -------------------------------------------------------------------------------
_FLASHINFER: dict[str, Any] = {}
FLASHINFER_WORKSPACE_BYTES = 256 << 20


def import_flashinfer() -> Any:
    """The flashinfer module, imported once.

    Raises:
        Skip: ``import flashinfer`` failed (the message is the import error).
    """
    if "module" not in _FLASHINFER:
        try:
            import flashinfer
            _FLASHINFER["module"] = flashinfer
        except Exception as exc:  # noqa: BLE001 - ImportError, or a broken install raising anything
            _FLASHINFER["module"] = None
            _FLASHINFER["error"] = one_line(exc, 200)
    if _FLASHINFER["module"] is None:
        raise Skip(f"import flashinfer failed: {_FLASHINFER['error']}")
    return _FLASHINFER["module"]


def flashinfer_page_metadata(batch: PagedBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's CSR page table of the batch: ``(kv_indptr (B+1,), kv_indices (pages,), last_page_len (B,))``.

    int32, on the batch's device. Sequence ``b`` uses ``block_table[b, :ceil(kv_len / page_size)]``;
    its last page holds ``(kv_len - 1) % page_size + 1`` tokens.
    """
    ps = batch.spec.page_size
    pages = [-(-n // ps) for n in batch.kv_lens]
    indptr = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], dtype=torch.int32)
    table = batch.block_table.cpu()
    indices = torch.cat([table[b, :n] for b, n in enumerate(pages)]).to(torch.int32)
    last = torch.tensor([(n - 1) % ps + 1 if n else 0 for n in batch.kv_lens], dtype=torch.int32)
    dev = batch.q.device
    return indptr.to(dev), indices.to(dev), last.to(dev)


def flashinfer_problem(spec: AttentionSpec) -> str | None:
    """Why FlashInfer's paged wrappers cannot run ``spec`` (None when they can)."""
    if spec.variant is not None:
        return f"custom variant {spec.variant.name!r}: not translated to FlashInfer's JIT variants"
    if spec.window_right >= 0:
        return "window_right: FlashInfer's fa2/fa3 wrappers take a left window only"
    if spec.sinks and (spec.logits_soft_cap or spec.alibi):
        return "sinks with soft-cap or ALiBi: FlashInfer's attention-sink variant has neither"
    return None


def _flashinfer_plain(fi: Any, case: BenchCase, batch: PagedBatch, workspace: torch.Tensor,
                      pages: tuple[torch.Tensor, ...]) -> tuple[Any, tuple]:
    """A planned BatchDecode (fa2; tensor cores for GQA groups > 4, vLLM's rule) or BatchPrefill
    (FlashInfer picks fa3 on Hopper, else fa2) paged wrapper, and the extra run() arguments (none)."""
    s, dtype, kv_dtype = case.spec, torch_dtype(case.spec.q_dtype), torch_dtype(case.spec.kv_dtype)
    kw = dict(pos_encoding_mode="ALIBI" if s.alibi else "NONE", window_left=s.window_left,
              logits_soft_cap=s.logits_soft_cap or None, sm_scale=s.sm_scale, q_data_type=dtype, kv_data_type=kv_dtype)
    heads = (s.num_qo_heads, s.num_kv_heads, s.head_dim_qk, s.page_size)
    if case.is_decode:
        wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(workspace, s.kv_layout, use_tensor_cores=s.group_size > 4,
                                                        backend="fa2")
        wrapper.plan(*pages, *heads, **kw)
    else:
        wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(workspace, s.kv_layout)
        wrapper.plan(batch.query_start_loc, *pages, *heads, causal=s.causal, **kw)
    return wrapper, ()


def _flashinfer_sinks(fi: Any, case: BenchCase, batch: PagedBatch, workspace: torch.Tensor,
                      pages: tuple[torch.Tensor, ...]) -> tuple[Any, tuple]:
    """FlashInfer's attention-sink JIT variant (gpt-oss): planned wrapper, run() extras ``(sinks, sm_scale)``.

    Raises:
        Skip: this FlashInfer has no attention-sink wrapper.
    """
    s, dtype, kv_dtype = case.spec, torch_dtype(case.spec.q_dtype), torch_dtype(case.spec.kv_dtype)
    name = "BatchDecodeWithAttentionSinkWrapper" if case.is_decode else "BatchAttentionWithAttentionSinkWrapper"
    cls = getattr(fi, name, None)
    if cls is None:
        raise Skip(f"flashinfer {getattr(fi, '__version__', '?')} has no {name} (sinks)")
    wrapper = cls(workspace, s.kv_layout, q_data_type=dtype, kv_data_type=kv_dtype, head_dim_qk=s.head_dim_qk,
                  head_dim_vo=s.head_dim_vo, window_left=s.window_left)
    kw = dict(window_left=s.window_left, sm_scale=s.sm_scale, q_data_type=dtype, kv_data_type=kv_dtype)
    heads = (s.num_qo_heads, s.num_kv_heads, s.head_dim_qk, s.page_size)
    if case.is_decode:
        wrapper.plan(*pages, *heads, **kw)
    else:
        wrapper.plan(batch.query_start_loc, *pages, *heads, causal=s.causal, **kw)
    return wrapper, (batch.sinks, s.sm_scale)


def flashinfer_runner(case: BenchCase, batch: PagedBatch) -> Runner:
    """FlashInfer's paged wrappers on the same paged cache: plan once, time ``run`` (as an engine does per step).

    Plain specs use BatchDecode/BatchPrefillWithPagedKVCacheWrapper, specs with sinks the
    attention-sink variant. The first plan may JIT-compile a module: the note has the seconds of
    plan + first call, and FlashInfer's choice of backend.

    Raises:
        Skip: flashinfer does not import, or the spec has a custom variant / a right window /
            sinks with soft-cap or ALiBi.
    """
    fi = import_flashinfer()
    problem = flashinfer_problem(case.spec)
    if problem:
        raise Skip(problem)
    pages = flashinfer_page_metadata(batch)
    workspace = torch.zeros(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=batch.q.device)
    t0 = time.perf_counter()
    wrapper, extra = (_flashinfer_sinks if case.spec.sinks else _flashinfer_plain)(fi, case, batch, workspace, pages)
    scales = batch.scales  # FP8: k_scale, v_scale (empty for a 16-bit cache)
    call = lambda: wrapper.run(batch.q, batch.kv_cache, *extra, **scales)  # noqa: E731
    call()
    torch.cuda.synchronize()
    backend = getattr(wrapper, "_backend", "?")
    return Runner(call, note=f"{backend}, plan+1st call {time.perf_counter() - t0:.1f} s")


# ---- one case ---------------------------------------------------------------------------------
def case_work(case: BenchCase, batch: PagedBatch) -> tuple[float, str]:
    """``(work, unit)``: decode TB of K/V read and "TB/s"; prefill TFLOP and "TFLOP/s"."""
    if case.is_decode:
        return batch.kv_bytes_read / 1e12, "TB/s"
    return batch.flops / 1e12, "TFLOP/s"


def reference_rows(case: BenchCase, batch: PagedBatch) -> torch.Tensor:
    """The fp32 reference for the first ``case.check_seqs`` sequences: ``(rows, H_qo, D)``, rows from row 0."""
    from jitattn import reference

    n = case.check_seqs
    if n == len(batch.q_lens):
        return reference.paged_attention(case.spec, *batch.args(), **batch.kwargs())
    qsl = batch.query_start_loc[: n + 1]
    rows = int(qsl[-1])
    return reference.paged_attention(case.spec, batch.q[:rows], batch.kv_cache, batch.block_table[:n],
                                     batch.seq_lens[:n], qsl, **batch.kwargs())


def check_error(out_rows: torch.Tensor, ref: torch.Tensor | None) -> float:
    """Relative error of the first ``len(ref)`` rows (nan without a reference)."""
    return math.nan if ref is None else relative_error(out_rows[: ref.shape[0]], ref)


def run_impl(case: BenchCase, impl: str, runner: Runner, work: float, unit: str, ref: torch.Tensor | None) -> Result:
    """Check one ready implementation against the reference, then time it. Never raises."""
    try:
        err = check_error(runner.rows(runner.call()), ref)
        result = measure(case.name, impl, runner.call, work, unit, err)
    except Exception as exc:  # noqa: BLE001 - a failing implementation is a row, not a crash
        return Result.not_run(case.name, impl, unit, "failed", one_line(exc))
    if err > MAX_REL_ERR:
        runner.note = f"WRONG (rel err > {MAX_REL_ERR:g}); {runner.note}"
    result.note = "; ".join(n for n in (runner.note, result.note) if n)
    return result


def build_runners(case: BenchCase, family: str, build: Callable[[], Runner | dict[str, Runner]], unit: str
                  ) -> tuple[dict[str, Runner], list[Result]]:
    """Call one implementation family's builder: its runners, or a skipped / failed row named ``family``."""
    try:
        made = build()
    except Skip as why:
        return {}, [Result.not_run(case.name, family, unit, "skipped", one_line(str(why)))]
    except Exception as exc:  # noqa: BLE001
        return {}, [Result.not_run(case.name, family, unit, "failed", one_line(exc))]
    return (made if isinstance(made, dict) else {family: made}), []


def needs_dense(case: BenchCase, anchors: tuple[str, ...]) -> bool:
    """Whether an anchor that takes dense tensors (SDPA, Flex) will run: only then copy K/V out of the pages."""
    return (("sdpa" in anchors and plain_attention_problem(case) is None)
            or ("flex" in anchors and flex_problem(case.spec) is None))


def cascade_runners(case: BenchCase, cb: Any) -> dict[str, Runner]:
    """The cascade and the plain decode call on one :func:`jitattn.testing.random_cascade_batch`."""
    from jitattn.cascade import cascade_attention, plain_metadata, plan_cascade
    from jitattn.runtime import load_kernel

    spec, plain = case.spec, cb.plain
    aligned = all(n % spec.page_size == 0 for n in cb.prefix_lens)
    if aligned:  # the shared prefix pages themselves in every request's table, as prefix caching does
        args = (cb.q, cb.kv_cache, *plain_metadata(spec, cb.levels, cb.q.shape[0]))
        how = "prefix pages shared by every table"
    else:
        args = plain.args()
        how = "prefix ends mid-page: each request's copy"
    kernel = load_kernel(spec)
    out = torch.empty_like(cb.q)
    plan = plan_cascade(spec, cb.levels, cb.q.shape[0],
                        num_sms=torch.cuda.get_device_properties(cb.q.device).multi_processor_count)
    chunks = plan.num_states - 1
    return {"jitattn": Runner(lambda: cascade_attention(spec, cb.q, cb.kv_cache, cb.levels, plan=plan),
                              note=f"{kernel.entry.arch}, cascade, prefix in {chunks} chunks, planned ahead"),
            "jitattn-plain": Runner(lambda: kernel.paged_attention(*args, out=out, max_query_len=1),
                                    note=f"plain decode call, {how}")}


def run_cascade_case(case: BenchCase, *, seed: int, check: bool) -> list[Result]:
    """A cascade case: the cascade against the plain decode call, errors against the un-split reference."""
    from jitattn import reference
    from jitattn.testing import random_cascade_batch

    r, p, s = case.cascade
    cb = random_cascade_batch(case.spec, [p], [r], [s] * r, [1] * r, device="cuda", seed=seed)
    work, unit = cb.plain.kv_bytes_read / 1e12, "TB/s"
    ref = reference.paged_attention(case.spec, *cb.plain.args()) if check else None
    runners, rows = build_runners(case, "jitattn", lambda: cascade_runners(case, cb), unit)
    return rows + [run_impl(case, impl, runner, work, unit, ref) for impl, runner in runners.items()]


def run_case(case: BenchCase, *, seed: int = 0, check: bool = True, anchors: tuple[str, ...] = ANCHORS
             ) -> list[Result]:
    """Time jitattn and every requested anchor on one random batch; errors against the fp32 reference."""
    if case.phase == "cascade":
        return run_cascade_case(case, seed=seed, check=check)
    batch = random_paged_batch(case.spec, case.q_lens, case.kv_lens, device="cuda", seed=seed)
    work, unit = case_work(case, batch)
    ref = reference_rows(case, batch) if check else None
    dense = to_contiguous(batch) if needs_dense(case, anchors) else None
    builders: dict[str, Callable[[], Runner | dict[str, Runner]]] = {
        "jitattn": lambda: jitattn_runner(case, batch),
        "sdpa": lambda: sdpa_runners(case, dense),
        "flex": lambda: flex_runner(case, dense),
        "flashinfer": lambda: flashinfer_runner(case, batch),
    }
    results: list[Result] = []
    for family in ("jitattn", *anchors):
        runners, rows = build_runners(case, family, builders[family], unit)
        results += rows
        for impl, runner in runners.items():
            results.append(run_impl(case, impl, runner, work, unit, ref))
        del runners
        torch.cuda.empty_cache()
    return results


# ---- compile figures --------------------------------------------------------------------------
@dataclass
class CompileFigure:
    """Compile and load costs of one spec's kernel, next to torch.compile of the same Flex variant.

    Seconds (``*_s``) and milliseconds (``*_ms``); nan where not measured (the note says why).
    """

    spec: str  # spec.name
    arch: str
    nvcc_s: float  # wall seconds of a cold KernelCache.get_or_build (render, nvcc, publish)
    build_s: float  # the manifest's build_seconds (nvcc through ninja only)
    warm_total_ms: float  # a fresh `python -c`: interpreter start to kernel loaded and synchronized
    warm_import_ms: float  # inside it: import torch, jitattn and jitattn.runtime
    warm_cuda_init_ms: float  # inside it: CUDA context creation
    warm_load_ms: float  # inside it: load_kernel (cache lookup, checksum, module load) + synchronize
    flex_prefill_s: float = math.nan  # torch.compile'd Flex, first call, dynamo reset, inductor caches off
    flex_decode_s: float = math.nan
    note: str = ""
    warm_jitattn_import_ms: float = math.nan  # of warm_import_ms: import jitattn + jitattn.runtime (torch loaded)
    warm_reload_ms: float = math.nan  # the same kernel loaded again in that process: the per-kernel cost alone


WARM_LOAD_SCRIPT = """\
import json, sys, time
t0 = time.perf_counter()
import torch
tt = time.perf_counter()
import jitattn
from jitattn.runtime import load_kernel
t1 = time.perf_counter()
torch.empty(1, device="cuda")
torch.cuda.synchronize()
t2 = time.perf_counter()
kernel = load_kernel(jitattn.AttentionSpec.from_json(sys.argv[1]))
torch.cuda.synchronize()
t3 = time.perf_counter()
again = type(kernel)(kernel.spec, kernel.device)  # a second module load: the per-kernel part alone
torch.cuda.synchronize()
t4 = time.perf_counter()
print(json.dumps({"import_ms": (t1 - t0) * 1e3, "jitattn_import_ms": (t1 - tt) * 1e3,
                  "cuda_init_ms": (t2 - t1) * 1e3, "load_ms": (t3 - t2) * 1e3, "reload_ms": (t4 - t3) * 1e3,
                  "entry": str(kernel.entry.path)}))
"""


def cold_compile(spec: AttentionSpec, arch: str, root: Path) -> tuple[float, float]:
    """``(wall s, manifest build_seconds)`` of compiling ``spec`` for ``arch`` into the cache at ``root``.

    Raises:
        RuntimeError: the kernel was already in ``root`` (the figure would not be cold).
        jitattn.build.CompileError / BuildError: nvcc failed or cannot run.
    """
    from jitattn.cache import KernelCache

    t0 = time.perf_counter()
    entry, built = KernelCache(root=root, layers=()).get_or_build(spec, arch)
    wall = time.perf_counter() - t0
    if not built:
        raise RuntimeError(f"{spec.name} for {arch} was already cached in {root}: not a cold compile")
    return wall, float(entry.manifest.get("build_seconds", math.nan))


def warm_load(spec: AttentionSpec, root: Path, *, timeout: float = 300) -> dict[str, float]:
    """Load ``spec``'s cached kernel in a fresh Python process (JITATTN_DISABLE_JIT=1: a miss fails).

    Returns ms: ``total_ms`` (process start to exit, measured outside), ``import_ms``,
    ``cuda_init_ms`` and ``load_ms`` (measured inside).

    Raises:
        RuntimeError: the process failed (its stderr's last line in the message).
    """
    env = {**os.environ, "JITATTN_CACHE_DIR": str(root), "JITATTN_DISABLE_JIT": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.pop("JITATTN_CACHE_PATH", None)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", WARM_LOAD_SCRIPT, spec.canonical_json()], capture_output=True,
                          text=True, env=env, timeout=timeout)
    total = (time.perf_counter() - t0) * 1e3
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["(no stderr)"])[-1]
        raise RuntimeError(f"warm load of {spec.name} exited {proc.returncode}: {tail}")
    return {"total_ms": total, **json.loads(proc.stdout.strip().splitlines()[-1])}


@contextlib.contextmanager
def _inductor_caches_off() -> Iterator[None]:
    """Inductor's on-disk caches disabled (a cold torch.compile), where this torch has the switch."""
    import torch._inductor.config as config
    if hasattr(config, "force_disable_caches"):
        with config.patch(force_disable_caches=True):
            yield
    else:
        yield


def flex_compile_seconds(spec: AttentionSpec, phase: str) -> float:
    """Seconds of the first call of torch.compile'd Flex for ``spec`` (compile + one small run).

    After ``torch._dynamo.reset()`` with inductor's caches off. Shapes: prefill 1 x (L q, L kv);
    decode 8 x (1 q, L kv), with L = 1024, or 256 keys past the window so the mask is compiled in
    too: compile time barely depends on the shapes.

    Raises:
        Skip: the spec has no Flex form (sinks, custom variant).
    """
    import torch._dynamo

    problem = flex_problem(spec)
    if problem:
        raise Skip(problem)
    kv_len = max(1024, -(-(spec.window_left + 257) // 128) * 128)
    b, n = (8, 1) if phase == "decode" else (1, kv_len)
    dt, d = torch_dtype(spec.q_dtype), spec.head_dim_qk
    q = torch.randn(b, spec.num_qo_heads, n, d, dtype=dt, device="cuda")
    k, v = (torch.randn(b, spec.num_kv_heads, kv_len, d, dtype=dt, device="cuda") for _ in range(2))
    torch._dynamo.reset()
    with _inductor_caches_off():
        t0 = time.perf_counter()
        flex_call(spec, q, k, v, kv_len - n)()
        torch.cuda.synchronize()
        return time.perf_counter() - t0


def compile_figure(spec: AttentionSpec, phases: set[str], arch: str, root: Path, *, gpu: bool) -> CompileFigure:
    """Every compile figure of one spec; a failing step leaves nan and a note, never raises."""
    fig = CompileFigure(spec.name, arch, *([math.nan] * 6))
    notes = []
    try:
        fig.nvcc_s, fig.build_s = cold_compile(spec, arch, root)
    except Exception as exc:  # noqa: BLE001
        return _with_note(fig, [f"nvcc: {one_line(exc)}"])
    if not gpu:
        return _with_note(fig, ["no CUDA device: warm load and Flex not measured"])
    try:
        warm = warm_load(spec, root)
        fig.warm_total_ms, fig.warm_import_ms = warm["total_ms"], warm["import_ms"]
        fig.warm_cuda_init_ms, fig.warm_load_ms = warm["cuda_init_ms"], warm["load_ms"]
        fig.warm_jitattn_import_ms, fig.warm_reload_ms = warm["jitattn_import_ms"], warm["reload_ms"]
    except Exception as exc:  # noqa: BLE001
        notes.append(f"warm load: {one_line(exc)}")
    for phase in sorted(phases):
        try:
            setattr(fig, f"flex_{phase}_s", flex_compile_seconds(spec, phase))
        except Exception as exc:  # noqa: BLE001
            notes.append(f"flex {phase}: {one_line(exc, 100)}")
    return _with_note(fig, notes)


def _with_note(fig: CompileFigure, notes: list[str]) -> CompileFigure:
    fig.note = "; ".join(notes)
    return fig


def distinct_specs(cases: list[BenchCase]) -> list[tuple[AttentionSpec, set[str]]]:
    """Each distinct spec of ``cases`` (first-seen order) with the phases it is benchmarked in."""
    found: dict[AttentionSpec, set[str]] = {}
    for c in cases:
        found.setdefault(c.spec, set()).add(c.phase)
    return list(found.items())


def device_arch() -> str:
    """The best jitattn arch for the current CUDA device; ``sm_90a`` (the H200's) without one."""
    from jitattn.build import archs_for_capability

    if not torch.cuda.is_available():
        return "sm_90a"
    return archs_for_capability(*torch.cuda.get_device_capability())[0]


# ---- environment and output -------------------------------------------------------------------
def command_line(argv: list[str]) -> str:
    """The command as typed: ``jitattn bench ...`` or ``python -m jitattn.bench ...``."""
    prog = "python -m jitattn.bench" if Path(sys.argv[0]).name == "bench.py" else "jitattn bench"
    return f"{prog} {shlex.join(argv)}".strip()


def _try(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - a missing tool is a fact to record, not an error
        return f"unavailable ({one_line(exc, 120)})"


def environment(argv: list[str], anchors: tuple[str, ...] = ANCHORS) -> dict[str, Any]:
    """Date (UTC), device, versions (torch, CUDA, triton, FlashInfer, nvcc, driver) and the command.

    FlashInfer is imported only when it is among ``anchors``.
    """
    import jitattn
    from jitattn import settings
    from jitattn.build import nvcc_version

    gpu = torch.cuda.is_available()
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": torch.cuda.get_device_name() if gpu else "no CUDA device",
        "capability": ".".join(map(str, torch.cuda.get_device_capability())) if gpu else None,
        "arch": device_arch(),
        "driver": _try(lambda: subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True,
            timeout=30, check=True).stdout.strip().splitlines()[0]),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _try(lambda: __import__("triton").__version__),
        "flashinfer": _try(lambda: import_flashinfer().__version__) if "flashinfer" in anchors else "not requested",
        "nvcc": _try(lambda: nvcc_version(settings.nvcc())),
        "python": platform.python_version(),
        "jitattn": jitattn.__version__,
        "git": _try(lambda: subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                                           capture_output=True, text=True, timeout=30, check=True).stdout.strip()),
        "command": command_line(argv),
    }


def _cell(x: float, fmt: str) -> str:
    return "-" if x is None or math.isnan(x) else format(x, fmt)


REL_ERR_HEADER = f"rel err (prefill > {FULL_CHECK_MAX_SEQS} seqs: 1st seq only)"


def best_anchor_rates(results: list[Result]) -> dict[str, float]:
    """Per case, the best rate among anchors that ran and were not WRONG (nan when none)."""
    best: dict[str, float] = {}
    for r in results:
        ok = (r.impl != "jitattn" and r.status == "ok" and not math.isnan(r.rate)
              and not (r.rel_err > MAX_REL_ERR))
        best.setdefault(r.case, math.nan)
        if ok and not (r.rate <= best[r.case]):
            best[r.case] = r.rate
    return best


def format_table(results: list[Result]) -> str:
    """Markdown table with the ratio of each implementation to the best correct anchor of its case."""
    lines = [f"| case | impl | eager ms | graph ms | rate | vs best anchor | {REL_ERR_HEADER} | note |",
             "|---|---|---|---|---|---|---|---|"]
    best = best_anchor_rates(results)
    for r in results:
        ratio = r.rate / best[r.case] if not math.isnan(best[r.case]) else math.nan
        rate = f"{_cell(r.rate, '.2f')} {r.unit}" if not math.isnan(r.rate) else "-"
        note = f"{r.status}: {r.note}" if r.status != "ok" else r.note
        lines.append(f"| {r.case} | {r.impl} | {_cell(r.ms, '.3f')} | {_cell(r.graph_ms, '.3f')} | {rate} | "
                     f"{'-' if math.isnan(ratio) else f'{ratio:.2f}x'} | {_cell(r.rel_err, '.2e')} | {note} |")
    return "\n".join(lines)


def format_compile_table(figures: list[CompileFigure]) -> str:
    """Markdown table of the compile figures (seconds and milliseconds as the headers say)."""
    lines = ["| kernel | arch | nvcc cold s (build.ninja s) | warm load, fresh process: total ms | "
             "import ms (of which jitattn) | CUDA init ms | load ms (again) | Flex torch.compile prefill s | decode s | "
             "note |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for f in figures:
        lines.append(f"| {f.spec} | {f.arch} | {_cell(f.nvcc_s, '.1f')} ({_cell(f.build_s, '.1f')}) | "
                     f"{_cell(f.warm_total_ms, '.0f')} | {_cell(f.warm_import_ms, '.0f')} "
                     f"({_cell(f.warm_jitattn_import_ms, '.0f')}) | "
                     f"{_cell(f.warm_cuda_init_ms, '.0f')} | {_cell(f.warm_load_ms, '.1f')} ({_cell(f.warm_reload_ms, '.1f')}) | "
                     f"{_cell(f.flex_prefill_s, '.1f')} | {_cell(f.flex_decode_s, '.1f')} | {f.note} |")
    return "\n".join(lines)


def _json_safe(x: Any) -> Any:
    """NaN / inf floats -> None / "inf" (strict JSON has neither), recursively."""
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def case_json(case: BenchCase) -> dict[str, Any]:
    return {"name": case.name, "phase": case.phase, "spec": case.spec.to_json(), "spec_name": case.spec.name,
            "batch": len(case.q_lens), "q_lens": sorted(set(case.q_lens)), "kv_lens": sorted(set(case.kv_lens)),
            "check_seqs": case.check_seqs, "describe": case.describe()}


def write_json(path: str | os.PathLike, env: dict[str, Any], cases: list[BenchCase], results: list[Result],
               figures: list[CompileFigure]) -> None:
    """Everything machine-readable: ``{"environment", "cases", "results", "compile"}`` (NaN as null)."""
    data = {"environment": env, "cases": [case_json(c) for c in cases], "results": [asdict(r) for r in results],
            "compile": [asdict(f) for f in figures]}
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(_json_safe(data), indent=1))
    os.replace(tmp, path)


def _float(x: Any) -> Any:
    if x is None:
        return math.nan
    if x in ("inf", "-inf"):
        return float(x)
    return x


def read_json(path: str | os.PathLike) -> tuple[dict[str, Any], list[Result], list[CompileFigure]]:
    """Inverse of :func:`write_json`: ``(environment, results, compile figures)``.

    Raises:
        BenchUsageError: the file is missing, unreadable, not JSON, or not a ``--json`` output.
    """
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise BenchUsageError(f"--from-json {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise BenchUsageError(f"--from-json {path}: cannot read it ({exc.__class__.__name__}: {exc})") from None
    except json.JSONDecodeError as exc:
        raise BenchUsageError(f"--from-json {path}: not valid JSON ({exc}); expected the file "
                              f"`jitattn bench --json PATH` wrote") from None
    if not isinstance(data, dict) or not isinstance(data.get("environment"), dict) \
            or not isinstance(data.get("results"), list):
        raise BenchUsageError(f"--from-json {path}: not a `jitattn bench --json` file (expected an object with "
                              f"'environment' and 'results')")

    def load(cls, row):
        names = {f.name for f in fields(cls)}
        return cls(**{k: _float(v) for k, v in row.items() if k in names})

    return data["environment"], [load(Result, r) for r in data["results"]], [load(CompileFigure, f) for f in
                                                                             data.get("compile", [])]


def merge_runs(runs: list[tuple[dict[str, Any], list[Result], list[CompileFigure]]]
               ) -> tuple[dict[str, Any], list[Result], list[CompileFigure]]:
    """Several runs' ``(environment, results, figures)`` as one: the first run's environment with
    ``commands`` listing every run's command, results and figures concatenated in order."""
    env = dict(runs[0][0])
    env["commands"] = [r[0].get("command", "?") for r in runs]
    return env, [x for r in runs for x in r[1]], [x for r in runs for x in r[2]]


def anchors_line(results: list[Result]) -> str:
    """Which anchors ran at least once, and why the others never did (first reason)."""
    ran = sorted({r.impl for r in results if r.status == "ok" and r.impl != "jitattn"})
    never: dict[str, str] = {}
    for r in results:
        family = r.impl.split("-")[0]
        if r.status != "ok" and not any(x.split("-")[0] == family for x in ran):
            never.setdefault(family, f"{r.status}: {r.note}")
    parts = [f"ran: {', '.join(ran) or 'none'}"] + [f"{k} never ran ({v})" for k, v in never.items()]
    return "; ".join(parts)


def latest_section(results: list[Result], env: dict[str, Any], figures: list[CompileFigure] | None = None) -> str:
    """BENCHMARKS.md's "Latest" section: date, device, versions, the exact command, the table(s)."""
    lines = [f"## Latest: {env.get('date', '?')}", "",
             f"- Device: {env.get('device')}, driver {env.get('driver')}, torch {env.get('torch')} "
             f"(CUDA {env.get('cuda')}), triton {env.get('triton')}, "
             f"nvcc {env.get('nvcc')}, {env.get('arch')} cubins, jitattn {env.get('jitattn')} ({env.get('git')}).",
             f"- FlashInfer: {env.get('flashinfer')}.",
             *[f"- Command: `{cmd}`." for cmd in env.get("commands", [env.get("command")])],
             f"- Anchors: {anchors_line(results)}.", "", format_table(results), ""]
    if figures:
        lines += ["Compile figures (cold: fresh cache, nvcc; warm: a fresh process loading the cached cubin):", "",
                  format_compile_table(figures), ""]
    return "\n".join(lines)


def write_benchmarks_md(results: list[Result], env: dict[str, Any], path: str | os.PathLike,
                        figures: list[CompileFigure] | None = None) -> None:
    """Replace the "## Latest..." section of ``path`` (up to the next "## " heading) with this run's.

    Everything else (the introduction, "The two numbers", "History") is kept as it is. Without a
    Latest section, the new one goes before the first "## " heading (or at the end).
    """
    p = Path(path)
    text = p.read_text() if p.exists() else "# Benchmarks\n"
    lines = text.splitlines()
    heads = [i for i, ln in enumerate(lines) if ln.startswith("## ")]
    latest = next((i for i in heads if lines[i].startswith("## Latest")), None)
    if latest is None:
        start = end = heads[0] if heads else len(lines)
    else:
        start, end = latest, next((i for i in heads if i > latest), len(lines))
    new = lines[:start] + latest_section(results, env, figures).splitlines() + lines[end:]
    p.write_text("\n".join(new).rstrip("\n") + "\n")


# ---- host profile -----------------------------------------------------------------------------
def profile_host(case: BenchCase, calls: int = 200) -> str:
    """cProfile of ``calls`` eager jitattn calls of ``case`` (host time per call and the top functions)."""
    import cProfile
    import io
    import pstats

    from jitattn.runtime import load_kernel

    batch = random_paged_batch(case.spec, case.q_lens, case.kv_lens, device="cuda")
    kernel = load_kernel(case.spec)
    hint = 1 if case.is_decode else None
    call = lambda: kernel.paged_attention(*batch.args(), **batch.kwargs(), max_query_len=hint)  # noqa: E731
    call()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        call()
    host_us = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        call()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(25)
    return f"{case.name}: host {host_us:.1f} us per call (no sync)\n{buf.getvalue()}"


# ---- command line -----------------------------------------------------------------------------
def parse_args(argv: list[str] | None):
    import argparse

    parser = argparse.ArgumentParser(prog="jitattn bench", description=__doc__.split("\n")[0])
    parser.add_argument("--case", action="append", metavar="NAME", help="case name substring (repeatable)")
    parser.add_argument("--model", action="append", metavar="CONFIG",
                        help="a Hugging Face config.json: add a decode and a prefill case per layer kind (repeatable)")
    parser.add_argument("--anchors", default=",".join(ANCHORS),
                        help=f"comma-separated anchors to run (default: {','.join(ANCHORS)}; '' for jitattn alone)")
    parser.add_argument("--json", metavar="PATH", help="write environment, cases, results and compile figures as JSON "
                        "(rewritten after every case, so a killed run keeps what it measured)")
    parser.add_argument("--md", metavar="PATH", help="replace the 'Latest' section of this BENCHMARKS.md")
    parser.add_argument("--no-check", action="store_true", help="skip the reference error check")
    parser.add_argument("--host-profile", action="store_true", help="cProfile the host side of each jitattn call")
    parser.add_argument("--compile", action="store_true",
                        help="also measure compile figures: cold nvcc s (fresh cache), warm load ms (fresh process), "
                             "torch.compile s of the Flex variant; without a GPU: the nvcc figures only")
    parser.add_argument("--compile-only", action="store_true", help="--compile, and time nothing else")
    parser.add_argument("--list", action="store_true", help="print the selected cases and exit (no GPU needed)")
    parser.add_argument("--from-json", metavar="PATH", action="append",
                        help="run nothing: print the tables of earlier --json files, merged in order (repeatable; "
                             "with --md, write BENCHMARKS.md from them)")
    parser.add_argument("--seed", type=int, default=0, help="input seed (default 0)")
    args = parser.parse_args(argv)
    unknown = set(filter(None, args.anchors.split(","))) - set(ANCHORS)
    if unknown:
        parser.error(f"--anchors: unknown {sorted(unknown)}; expected a subset of {list(ANCHORS)}")
    args.anchors = tuple(a for a in ANCHORS if a in args.anchors.split(","))
    args.compile = args.compile or args.compile_only
    return args


def list_cases(cases: list[BenchCase]) -> str:
    """One line per case: the name, then what it runs."""
    width = max((len(c.name) for c in cases), default=0)
    return "\n".join(f"{c.name:<{width}}  {c.describe()}" for c in cases)


def run_compile_figures(cases: list[BenchCase], root: Path, log: Callable[[str], None]) -> list[CompileFigure]:
    """:func:`compile_figure` for every distinct spec of ``cases``, compiling into the fresh cache ``root``."""
    arch, gpu = device_arch(), torch.cuda.is_available()
    figures = []
    for spec, phases in distinct_specs(cases):
        figures.append(compile_figure(spec, phases, arch, root, gpu=gpu))
        log(f"compile {spec.name}: nvcc {figures[-1].nvcc_s:.1f} s, warm load {figures[-1].warm_load_ms:.1f} ms")
    return figures


def main(argv: list[str] | None = None) -> str:
    """``jitattn bench [--case NAME ...] [--model CONFIG ...] [--json PATH] ...``: print the table(s).

    Returns the printed text. Exits (SystemExit) without a CUDA device unless --list, --from-json
    or --compile-only (nvcc figures) is given.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.from_json:
        return _finish(args, *merge_runs([read_json(p) for p in args.from_json]))
    cases = select_cases(args.case, args.model)
    if args.list:
        print(list_cases(cases))
        return list_cases(cases)
    gpu = torch.cuda.is_available()
    if not gpu and not args.compile_only:
        raise SystemExit("jitattn bench needs a CUDA GPU (torch.cuda.is_available() is False); "
                         "--list and --compile-only work without one")
    if args.host_profile:
        report = "\n".join(profile_host(c) for c in cases)
        print(report)
        return report
    return _run(args, argv, cases)


def _log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def _run(args, argv: list[str], cases: list[BenchCase]) -> str:
    """Compile figures (into a fresh cache the timing then reuses), then every case; JSON after each step."""
    from jitattn import settings

    env = environment(argv, args.anchors)
    results: list[Result] = []
    figures: list[CompileFigure] = []
    save = lambda: args.json and write_json(args.json, env, cases, results, figures)  # noqa: E731
    with contextlib.ExitStack() as stack:
        if args.compile:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="jitattn-bench-cache-")))
            stack.enter_context(settings.scope(JITATTN_CACHE_DIR=str(root), JITATTN_CACHE_PATH=None,
                                               JITATTN_DISABLE_JIT=None))
            figures = run_compile_figures(cases, root, _log)
            save()
        for case in cases if not args.compile_only else []:
            _log(f"{case.name}: {case.describe()}")
            results += run_case_safely(case, seed=args.seed, check=not args.no_check, anchors=args.anchors)
            save()
    return _finish(args, env, results, figures)


def run_case_safely(case: BenchCase, **kwargs: Any) -> list[Result]:
    """:func:`run_case`, with a failure outside any one implementation (inputs, reference) as one row."""
    try:
        return run_case(case, **kwargs)
    except Exception as exc:  # noqa: BLE001
        return [Result.not_run(case.name, "(case)", "TB/s" if case.is_decode else "TFLOP/s", "failed", one_line(exc))]
    finally:
        torch.cuda.empty_cache()


def _finish(args, env: dict[str, Any], results: list[Result], figures: list[CompileFigure]) -> str:
    text = ""
    if results:
        text += format_table(results) + "\n"
    if figures:
        text += ("\n" if text else "") + format_compile_table(figures) + "\n"
    print(text, end="")
    if args.md:
        write_benchmarks_md(results, env, args.md, figures)
    return text


if __name__ == "__main__":
    main()
