"""Random paged and ragged batches and error metrics, shared by the tests, the benchmark and the examples.

Inputs are always fresh random values (never zeros: zeros hide unwritten outputs and wrong
indexing), pages are placed in random order as a real allocator would place them, and unused
cache slots hold NaN so a kernel that reads past a sequence's end shows it.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any, Callable, Sequence

import torch

from jitattn.checks import check_spec
from jitattn.reference import torch_dtype
from jitattn.spec import AttentionSpec
from jitattn.variant import visible_key_range


@dataclass(kw_only=True)
class CallInputs:
    """What a batch passes by keyword besides its tensors (both batch kinds take the same ones).

    Attributes:
        sinks: float32 ``(num_qo_heads,)`` for a spec with sinks, else None.
        alibi_slopes: float32 ``(num_qo_heads,)``, or None (the standard slopes for an ALiBi spec).
        params: the variant's parameter tensors by name.
    """

    sinks: torch.Tensor | None = None
    alibi_slopes: torch.Tensor | None = None
    params: dict[str, Any] = field(default_factory=dict)

    def kwargs(self) -> dict[str, Any]:
        return {"sinks": self.sinks, "alibi_slopes": self.alibi_slopes, "params": self.params}


@dataclass
class PagedBatch(CallInputs):
    """One batch in the kernels' input format (shapes in :func:`jitattn.reference.paged_attention`)."""

    spec: AttentionSpec
    q: torch.Tensor
    kv_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    q_lens: list[int]
    kv_lens: list[int]
    scales: dict[str, float] = field(default_factory=dict)  # k_scale / v_scale of an FP8 cache

    def args(self) -> tuple[torch.Tensor, ...]:
        return (self.q, self.kv_cache, self.block_table, self.seq_lens, self.query_start_loc)

    def kwargs(self) -> dict[str, Any]:
        return {**super().kwargs(), **self.scales}

    @property
    def kv_bytes_read(self) -> int:
        """Bytes of K and V the batch must read: only keys some query can see (windows applied)."""
        elem = torch.tensor([], dtype=torch_dtype(self.spec.kv_dtype)).element_size()
        dims = self.spec.head_dim_qk + (0 if self.spec.latent else self.spec.head_dim_vo)  # latent: V is in K's row
        row = self.spec.num_kv_heads * dims * elem
        return sum(visible_keys(self.spec, ql, kl) for ql, kl in zip(self.q_lens, self.kv_lens)) * row

    @property
    def flops(self) -> int:
        """4 * head_dim FLOPs per visible (query, key) pair per query head (QK^T and PV)."""
        pairs = sum(visible_pairs(self.spec, ql, kl) for ql, kl in zip(self.q_lens, self.kv_lens))
        return 2 * (self.spec.head_dim_qk + self.spec.head_dim_vo) * pairs * self.spec.num_qo_heads


def visible_pairs(spec: AttentionSpec, q_len: int, kv_len: int) -> int:
    """(query, key) pairs the causal/window bounds leave visible in one sequence."""
    total = 0
    for p in range(kv_len - q_len, kv_len):
        lo, hi = visible_key_range(spec.causal, spec.window_left, spec.window_right, p, p, kv_len)
        total += max(0, hi - lo + 1)
    return total


def visible_keys(spec: AttentionSpec, q_len: int, kv_len: int) -> int:
    """Keys at least one query of the sequence can see (what a kernel must read)."""
    if q_len == 0:
        return 0
    lo, hi = visible_key_range(spec.causal, spec.window_left, spec.window_right, kv_len - q_len, kv_len - 1, kv_len)
    return max(0, hi - lo + 1)


def make_paged_kv(k: torch.Tensor, v: torch.Tensor, kv_lens: Sequence[int], spec: AttentionSpec, *,
                  shuffle_pages: bool = True, extra_pages: int = 0, generator: torch.Generator | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack contiguous per-sequence K/V into a paged cache.

    Args:
        k, v: ``(sum(kv_lens), num_kv_heads, head_dim)``, sequences back to back.
        kv_lens: KV length of each sequence.
        spec: gives page_size and kv_layout.
        shuffle_pages: place pages in random order.
        extra_pages: unused pages added to the pool.

    Returns:
        ``kv_cache`` in the spec's layout (unused slots NaN) and ``block_table`` int32
        ``(batch, max_pages)`` (unused entries point at page 0).
    """
    ps, h, d = spec.page_size, spec.num_kv_heads, spec.head_dim_qk
    pages_per = [math.ceil(n / ps) for n in kv_lens]
    total = sum(pages_per) + extra_pages
    order = torch.randperm(total, generator=generator) if shuffle_pages else torch.arange(total)
    cache = torch.full((total, 2, ps, h, d), float("nan"), dtype=k.dtype, device=k.device)
    table = torch.zeros(len(kv_lens), max(pages_per + [1]), dtype=torch.int32)
    page_ids = order[: sum(pages_per)].to(k.device)
    slots = torch.cat([torch.arange(n, device=k.device) for n in kv_lens]) if sum(kv_lens) else \
        torch.zeros(0, dtype=torch.long, device=k.device)
    seq_of = torch.repeat_interleave(torch.arange(len(kv_lens), device=k.device),
                                     torch.tensor(list(kv_lens), device=k.device))
    first_page = torch.tensor([0, *accumulate(pages_per)][:-1], device=k.device)
    tok_page = page_ids[first_page[seq_of] + slots // ps]
    cache[tok_page, 0, slots % ps] = k
    cache[tok_page, 1, slots % ps] = v
    start = 0
    for b, n in enumerate(pages_per):
        table[b, :n] = order[start:start + n].to(torch.int32)
        start += n
    if spec.kv_layout == "HND":
        cache = cache.transpose(2, 3).contiguous()
    return cache, table.to(k.device)


def _random_source(spec: AttentionSpec, q_lens: Sequence[int], kv_lens: Sequence[int],
                   device: torch.device | str, seed: int, scale: float
                   ) -> tuple[Callable[..., torch.Tensor], torch.Generator]:
    """Check the lengths of a random batch; return ``randn(*shape)`` (standard normal x ``scale`` in
    q's dtype, generated on ``device``) and a CPU generator of the same seed (page order, sinks).

    Values are generated where they are used: the large benchmark batches (billions of values) would
    cost tens of seconds and tens of GB of host memory through the CPU.

    Raises:
        ValueError: lengths of different counts, or a sequence with more queries than keys.
    """
    for name, lens in (("q_lens", q_lens), ("kv_lens", kv_lens)):
        try:
            [operator.index(n) for n in lens]  # noqa: B018 (ints: a float or a bool length is a mistake)
            if any(isinstance(n, bool) for n in lens) or isinstance(lens, str):
                raise TypeError
        except TypeError:
            raise ValueError(f"{name}={lens!r}: expected a list of ints, one per sequence") from None
    if len(q_lens) != len(kv_lens):
        raise ValueError(f"q_lens has {len(q_lens)} entries, kv_lens {len(kv_lens)}")
    for b, (ql, kl) in enumerate(zip(q_lens, kv_lens)):
        if ql < 0 or (ql > kl and not spec.explicit_positions):  # explicit positions: any number of queries
            raise ValueError(f"sequence {b}: q_len={ql} must be in [0, kv_len={kl}]")
    gen = torch.Generator(device=device).manual_seed(seed)
    dt = torch_dtype(spec.q_dtype)

    def randn(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dt)

    return randn, torch.Generator(device="cpu").manual_seed(seed)


def _as_cache_dtype(spec: AttentionSpec, k: torch.Tensor, v: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """K and V in the spec's cache dtype, and the ``k_scale`` / ``v_scale`` keywords of the call: for an
    FP8 cache, per-tensor scales so the largest |value| maps to e4m3's max, 448; else unchanged, no scales."""
    if spec.kv_dtype != "float8_e4m3fn":
        return k, v, {}
    scales = {"k_scale": max(k.float().abs().max().item(), 1e-6) / 448.0,
              "v_scale": max(v.float().abs().max().item(), 1e-6) / 448.0}
    return ((k.float() / scales["k_scale"]).to(torch.float8_e4m3fn),
            (v.float() / scales["v_scale"]).to(torch.float8_e4m3fn), scales)


def random_paged_batch(spec: AttentionSpec, q_lens: Sequence[int], kv_lens: Sequence[int], *,
                       device: torch.device | str = "cpu", seed: int = 0, extra_pages: int = 3,
                       params: dict[str, Any] | None = None, scale: float = 1.0) -> PagedBatch:
    """A random batch: sequence ``b`` brings ``q_lens[b]`` queries and reads ``kv_lens[b]`` keys.

    Values are standard normal times ``scale`` (q, k, v), sinks ~ N(0, 1) + 1, ALiBi slopes standard.
    A latent spec's cache is ``(num_pages, page_size, head_dim_qk)``, one random row per token.

    Raises:
        ValueError: a ragged spec, lengths of different counts, or a sequence with more queries than keys.
    """
    check_spec(spec, "random_paged_batch(spec, q_lens, kv_lens, ...)")
    if spec.ragged:
        raise ValueError("spec.kv_storage='ragged': random_paged_batch needs a paged spec "
                         "(random_ragged_batch builds ragged K/V)")
    randn, cpu_gen = _random_source(spec, q_lens, kv_lens, device, seed, scale)

    q = randn(sum(q_lens), spec.num_qo_heads, spec.head_dim_qk)
    k = randn(sum(kv_lens), spec.num_kv_heads, spec.head_dim_qk)
    v = k if spec.latent else randn(sum(kv_lens), spec.num_kv_heads, spec.head_dim_vo)
    k, v, scales = _as_cache_dtype(spec, k, v)
    kv_cache, block_table = make_paged_kv(k, v, kv_lens, spec, extra_pages=extra_pages, generator=cpu_gen)
    if spec.latent:  # one row per token (c_kv then k_pe), scaled by k_scale alone: V is the row's prefix
        kv_cache, scales = kv_cache[:, 0, :, 0].contiguous(), {k: s for k, s in scales.items() if k == "k_scale"}
    qsl = torch.tensor([0, *accumulate(q_lens)], dtype=torch.int32, device=device)
    sinks = (torch.randn(spec.num_qo_heads, generator=cpu_gen) + 1.0).to(device) if spec.sinks else None
    return PagedBatch(spec, q, kv_cache, block_table, torch.tensor(list(kv_lens), dtype=torch.int32, device=device),
                      qsl, list(q_lens), list(kv_lens), sinks=sinks, params=dict(params or {}), scales=scales)


@dataclass
class RaggedBatch(CallInputs):
    """One ragged batch in the kernels' input format (shapes in :func:`jitattn.reference.ragged_attention`)."""

    spec: AttentionSpec
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    query_start_loc: torch.Tensor
    kv_start_loc: torch.Tensor
    q_lens: list[int]
    kv_lens: list[int]

    def args(self) -> tuple[torch.Tensor, ...]:
        return (self.q, self.k, self.v, self.query_start_loc, self.kv_start_loc)

    def to_paged(self, page_size: int = 16, kv_layout: str = "NHD", seed: int = 0) -> PagedBatch:
        """The same batch through the paged cache (a paged spec with the same features; needs
        head_dim_qk == head_dim_vo). Pages in random order, unused slots NaN."""
        spec = self.spec.replace(kv_storage="paged", page_size=page_size, kv_layout=kv_layout)
        kv_cache, block_table = make_paged_kv(self.k, self.v, self.kv_lens, spec,
                                              generator=torch.Generator().manual_seed(seed))
        seq_lens = torch.tensor(self.kv_lens, dtype=torch.int32, device=self.q.device)
        return PagedBatch(spec, self.q, kv_cache, block_table, seq_lens, self.query_start_loc, list(self.q_lens),
                          list(self.kv_lens), sinks=self.sinks, alibi_slopes=self.alibi_slopes,
                          params=dict(self.params))


def random_ragged_batch(spec: AttentionSpec, q_lens: Sequence[int], kv_lens: Sequence[int], *,
                        device: torch.device | str = "cpu", seed: int = 0, params: dict[str, Any] | None = None,
                        scale: float = 1.0, strided: bool = False) -> RaggedBatch:
    """A random ragged batch: sequence ``b`` brings ``q_lens[b]`` queries and ``kv_lens[b]`` keys.

    Values are standard normal times ``scale``; sinks ~ N(0, 1) + 1. With ``strided=True`` q, k and v
    are views with padded token/head strides (k and v slices of one fused buffer, as an MLA or fused
    KV projection gives them; q with padded heads), and the padding holds NaN, so a kernel that ignores
    the strides or reads past a row shows it.

    Raises:
        ValueError: a paged spec, lengths of different counts, or a sequence with more queries than keys.
    """
    check_spec(spec, "random_ragged_batch(spec, q_lens, kv_lens, ...)")
    if not spec.ragged:
        raise ValueError(f"spec.kv_storage={spec.kv_storage!r}: random_ragged_batch needs a ragged spec")
    randn, cpu_gen = _random_source(spec, q_lens, kv_lens, device, seed, scale)
    dt = torch_dtype(spec.q_dtype)

    nq, nkv = sum(q_lens), sum(kv_lens)
    dqk, dvo = spec.head_dim_qk, spec.head_dim_vo
    if strided:
        qbuf = torch.full((nq, spec.num_qo_heads, dqk + 16), float("nan"), dtype=dt, device=device)
        q = qbuf[:, :, 8:8 + dqk]
        q.copy_(randn(nq, spec.num_qo_heads, dqk))
        kvbuf = torch.full((nkv, spec.num_kv_heads, dqk + dvo + 8), float("nan"), dtype=dt, device=device)
        k, v = kvbuf[:, :, :dqk], kvbuf[:, :, dqk + 8:]
        k.copy_(randn(nkv, spec.num_kv_heads, dqk))
        v.copy_(randn(nkv, spec.num_kv_heads, dvo))
    else:
        q = randn(nq, spec.num_qo_heads, dqk)
        k = randn(nkv, spec.num_kv_heads, dqk)
        v = randn(nkv, spec.num_kv_heads, dvo)
    qsl = torch.tensor([0, *accumulate(q_lens)], dtype=torch.int32, device=device)
    ksl = torch.tensor([0, *accumulate(kv_lens)], dtype=torch.int32, device=device)
    sinks = (torch.randn(spec.num_qo_heads, generator=cpu_gen) + 1.0).to(device) if spec.sinks else None
    return RaggedBatch(spec, q, k, v, qsl, ksl, list(q_lens), list(kv_lens), sinks=sinks, params=dict(params or {}))


def relative_error(out: torch.Tensor, ref: torch.Tensor, *, matching_nonfinite: bool = False) -> float:
    """``||out - ref|| / ||ref||`` (Frobenius norms, in float64); ``||out - ref||`` when ``ref`` is all zeros.

    A NaN or an infinity on either side is a failure: the result is ``inf``, which no tolerance passes,
    so a NaN the oracle produced can never hide one the kernel produced. Only with
    ``matching_nonfinite=True`` (the test says both sides hold NaN / inf at the same places, e.g. rows
    the metadata makes invalid) are those elements left out of the norms, and then only where they match
    exactly (NaN for NaN, ``+inf`` for ``+inf``, ``-inf`` for ``-inf``); any other place is ``inf`` again.

    Args:
        out, ref: tensors of the same shape, any floating dtype (compared in float64).
        matching_nonfinite: allow non-finite elements that are the same on both sides.

    Raises:
        ValueError: the shapes differ.
    """
    if out.shape != ref.shape:
        raise ValueError(f"relative_error: out has shape {tuple(out.shape)}, ref {tuple(ref.shape)}; "
                         f"expected the same shape")
    o, r = out.detach().double(), ref.detach().double()
    finite_o, finite_r = torch.isfinite(o), torch.isfinite(r)
    if not (finite_o.all() and finite_r.all()):
        same = (torch.isnan(o) & torch.isnan(r)) | (torch.isinf(o) & (o == r))
        if not (matching_nonfinite and torch.equal(finite_o, finite_r) and bool(same[~finite_o].all())):
            return float("inf")
        o, r = torch.where(finite_r, o, 0.0), torch.where(finite_r, r, 0.0)
    denom = torch.linalg.vector_norm(r).item()
    num = torch.linalg.vector_norm(o - r).item()
    return num / denom if denom > 0 else num


@dataclass
class CascadeBatch:
    """A random cascade batch (:func:`random_cascade_batch`) and the same batch un-split.

    ``levels`` index ``kv_cache`` (each prefix and each suffix on its own pages); ``plain`` is a
    :class:`PagedBatch` of the same queries over each request's whole key sequence (prefix then
    suffix, copied into a cache of its own), what :func:`jitattn.paged_attention` computes the
    cascade's result from.
    """

    q: torch.Tensor
    kv_cache: torch.Tensor
    levels: list
    plain: PagedBatch
    prefix_lens: list[int]
    suffix_lens: list[int]


def random_cascade_batch(spec: AttentionSpec, prefix_lens: Sequence[int], group_sizes: Sequence[int],
                         suffix_lens: Sequence[int], q_lens: Sequence[int], *, device: torch.device | str = "cpu",
                         seed: int = 0, params: dict[str, Any] | None = None) -> CascadeBatch:
    """Requests in groups sharing a prefix: group ``g`` has ``group_sizes[g]`` consecutive requests
    sharing ``prefix_lens[g]`` keys; request ``r`` adds ``suffix_lens[r]`` keys of its own and brings
    ``q_lens[r]`` queries (its last positions). Two levels (:func:`jitattn.cascade.two_level`).

    Raises:
        ValueError: counts that do not match, or a request with more queries than keys.
    """
    from jitattn.cascade import two_level

    if sum(group_sizes) != len(suffix_lens) or len(prefix_lens) != len(group_sizes):
        raise ValueError(f"group_sizes {list(group_sizes)} must sum to the {len(suffix_lens)} requests and have one "
                         f"entry per prefix ({len(prefix_lens)})")
    owner = [g for g, n in enumerate(group_sizes) for _ in range(n)]
    full = [prefix_lens[g] + s for g, s in zip(owner, suffix_lens)]
    randn, cpu_gen = _random_source(spec, q_lens, full, device, seed, 1.0)
    k_pre = [randn(n, spec.num_kv_heads, spec.head_dim_qk) for n in prefix_lens]
    v_pre = [randn(n, spec.num_kv_heads, spec.head_dim_vo) for n in prefix_lens]
    k_suf = [randn(n, spec.num_kv_heads, spec.head_dim_qk) for n in suffix_lens]
    v_suf = [randn(n, spec.num_kv_heads, spec.head_dim_vo) for n in suffix_lens]
    k_all, v_all, scales = _as_cache_dtype(spec, torch.cat(k_pre + k_suf), torch.cat(v_pre + v_suf))
    lens = [*prefix_lens, *suffix_lens]
    k_parts, v_parts = k_all.split(lens), v_all.split(lens)  # back into segments, in the cache dtype
    k_pre, k_suf = k_parts[: len(prefix_lens)], k_parts[len(prefix_lens):]
    v_pre, v_suf = v_parts[: len(prefix_lens)], v_parts[len(prefix_lens):]
    cache, table = make_paged_kv(k_all, v_all, lens, spec, extra_pages=2, generator=cpu_gen)
    table = table.to(device)
    i32 = lambda x: torch.tensor(list(x), dtype=torch.int32, device=device)  # noqa: E731
    qsl = i32([0, *accumulate(q_lens)])
    pre_qsl = i32([0, *accumulate(sum(q_lens[r] for r in range(len(owner)) if owner[r] == g)
                                  for g in range(len(prefix_lens)))])
    levels = two_level(table[: len(prefix_lens)].contiguous(), i32(prefix_lens), pre_qsl,
                       table[len(prefix_lens):].contiguous(), i32(suffix_lens), qsl)
    q = randn(sum(q_lens), spec.num_qo_heads, spec.head_dim_qk)
    k_full = torch.cat([torch.cat([k_pre[g], k_suf[r]]) for r, g in enumerate(owner)])
    v_full = torch.cat([torch.cat([v_pre[g], v_suf[r]]) for r, g in enumerate(owner)])
    full_cache, full_table = make_paged_kv(k_full, v_full, full, spec, generator=cpu_gen)
    sinks = (torch.randn(spec.num_qo_heads, generator=cpu_gen) + 1.0).to(device) if spec.sinks else None
    plain = PagedBatch(spec, q, full_cache, full_table.to(device), i32(full), qsl, list(q_lens), full, sinks=sinks,
                       params=dict(params or {}), scales=scales)
    return CascadeBatch(q, cache, list(levels), plain, list(prefix_lens), list(suffix_lens))
