"""Call-time checks of the tensors of a paged or ragged attention call, shared by every backend.

Every check runs on the host, before any launch, from shapes, dtypes, strides and devices alone
(no device sync). Each error names the tensor, the dimension, the value and what was expected.
:func:`check_metadata_values` goes further (sequence lengths against the page table) at the cost
of a device-to-host copy; the kernels also defend themselves against bad metadata by writing NaN
to the affected rows instead of reading out of bounds.
"""

from __future__ import annotations

import math
import numbers
import struct
from dataclasses import dataclass
from typing import Any, Mapping, NoReturn, Sequence

import torch

from jitattn.dtypes import TORCH_DTYPES as _TORCH_DTYPES
from jitattn.spec import AttentionSpec, kv_copy_bytes
from jitattn.variant import Param


@dataclass(frozen=True)
class PagedCall:
    """Sizes derived from a checked call."""

    batch: int
    total_q: int
    num_pages: int
    max_pages_per_seq: int


def fail(msg: str) -> NoReturn:
    """Raise the ValueError every check raises (one place, so a test or a caller can rely on the type)."""
    raise ValueError(msg)


def check_tensor(name: str, t: Any, *, dtype: torch.dtype, ndim: int, device: torch.device | None,
                 device_of: str = "q") -> None:
    """``t`` a tensor of ``dtype`` with ``ndim`` dims on ``device`` (None: any), ``device_of`` naming
    where that device comes from.

    Raises:
        ValueError: naming ``name``, what was expected and what was given.
    """
    if not isinstance(t, torch.Tensor):
        fail(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        fail(f"{name}: expected dtype {dtype}, got {t.dtype}")
    if t.dim() != ndim:
        fail(f"{name}: expected {ndim} dims, got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        fail(f"{name}: expected device {device} (the device of {device_of}), got {t.device}")


def _check_dim(name: str, t: torch.Tensor, dim: int, expected: int, what: str) -> None:
    if t.shape[dim] != expected:
        fail(f"{name}: dim {dim} ({what}) must be {expected}, got {t.shape[dim]} (shape {tuple(t.shape)})")


def kv_cache_shape(spec: AttentionSpec, num_pages: int) -> tuple[int, ...]:
    """The cache shape a spec expects: NHD ``(pages, 2, page_size, H_kv, D)``, HND ``(pages, 2, H_kv, page_size, D)``;
    latent ``(pages, page_size, head_dim_qk)``."""
    if spec.latent:
        return (num_pages, spec.page_size, spec.head_dim_qk)
    if spec.kv_layout == "NHD":
        return (num_pages, 2, spec.page_size, spec.num_kv_heads, spec.head_dim_qk)
    return (num_pages, 2, spec.num_kv_heads, spec.page_size, spec.head_dim_qk)


def _check_extras(spec: AttentionSpec, q: torch.Tensor, sinks: torch.Tensor | None,
                  alibi_slopes: torch.Tensor | None, params: Mapping[str, Any] | None, out: torch.Tensor | None,
                  batch: int, dev: torch.device) -> None:
    """The checks a paged and a ragged call share: sinks, ALiBi slopes, variant params and ``out``."""
    check_vector("sinks", sinks, spec.sinks, spec.num_qo_heads, dev, "spec.sinks")
    check_vector("alibi_slopes", alibi_slopes, spec.alibi, spec.num_qo_heads, dev, "spec.alibi", optional=True)
    check_params(spec, params or {}, batch=batch, total_q=q.shape[0], device=dev)
    if out is not None:
        check_out(spec, out, q.shape[0], dev)


def check_spec(spec: Any, call: str) -> AttentionSpec:
    """``spec`` must be an :class:`AttentionSpec` (the first argument of every attention call).

    Raises:
        ValueError: naming what was given instead, and how the call is written.
    """
    if not isinstance(spec, AttentionSpec):
        hint = {str: " (a JSON text becomes one through AttentionSpec.from_json)",
                dict: " (a dict of fields becomes one through AttentionSpec(**fields))"}.get(type(spec), "")
        fail(f"spec: expected a jitattn.AttentionSpec, got {type(spec).__name__}{hint}; the spec comes first: "
             f"{call}")
    return spec


def check_paged_call(spec: AttentionSpec, q: torch.Tensor, kv_cache: Any, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, query_start_loc: torch.Tensor, *, sinks: torch.Tensor | None = None,
                     alibi_slopes: torch.Tensor | None = None, params: Mapping[str, Any] | None = None,
                     out: torch.Tensor | None = None, for_kernel: bool = False) -> PagedCall:
    """Check a paged call's tensors against the spec (see :func:`jitattn.reference.paged_attention` for shapes).

    Args:
        for_kernel: also require what the CUDA kernels need: a CUDA device, 16-byte aligned rows,
            contiguous inner dims.

    Raises:
        ValueError: the first problem found, naming the tensor, the dimension and the expectation.
    """
    check_paged_spec(spec)
    check_paged_q(spec, q)
    dev = q.device
    check_kv_cache(spec, kv_cache, dev)
    batch, max_pages = check_paged_metadata(spec, block_table, seq_lens, query_start_loc, dev)
    _check_extras(spec, q, sinks, alibi_slopes, params, out, batch, dev)
    if for_kernel:
        if q.device.type != "cuda":
            fail(f"q: the jit backend runs on CUDA devices, got {q.device}; use the reference backend on CPU")
        check_q_layout(spec, q)
        check_kv_cache_layout(spec, kv_cache)
        check_metadata_layout(block_table, seq_lens, query_start_loc)
    return PagedCall(batch=batch, total_q=q.shape[0], num_pages=kv_num_pages(kv_cache), max_pages_per_seq=max_pages)


def check_paged_spec(spec: Any) -> AttentionSpec:
    """``spec`` an :class:`AttentionSpec` that reads the paged cache.

    Raises:
        ValueError: not a spec, or a ragged one (naming the call to use instead).
    """
    check_spec(spec, "paged_attention(spec, q, kv_cache, block_table, seq_lens, query_start_loc, ...)")
    if spec.ragged:
        fail("spec.kv_storage='ragged': a ragged spec takes k, v and kv_start_loc (ragged_attention), "
             "not a paged cache; build the spec with kv_storage='paged' for paged_attention")
    return spec


def check_paged_q(spec: AttentionSpec, q: Any) -> None:
    """``q`` ``(total_q, num_qo_heads, head_dim_qk)`` of ``spec.q_dtype`` (any device).

    Raises:
        ValueError: naming the dim, the value and the expectation.
    """
    check_tensor("q", q, dtype=_TORCH_DTYPES[spec.q_dtype], ndim=3, device=None)
    _check_dim("q", q, 1, spec.num_qo_heads, "num_qo_heads")
    _check_dim("q", q, 2, spec.head_dim_qk, "head_dim_qk")


def is_kv_pair(kv_cache: Any) -> bool:
    """Whether ``kv_cache`` is given as a ``(k_cache, v_cache)`` pair (a tuple or list) rather than one tensor."""
    return isinstance(kv_cache, (tuple, list))


def kv_num_pages(kv_cache: Any) -> int:
    """Pages in a checked cache: one tensor's dim 0, or the pair's (the two have one shape)."""
    return (kv_cache[0] if is_kv_pair(kv_cache) else kv_cache).shape[0]


def kv_pair_shape(spec: AttentionSpec, num_pages: int) -> tuple[int, ...]:
    """Each tensor of a ``(k_cache, v_cache)`` pair: NHD ``(pages, page_size, H_kv, D)``, HND ``(pages, H_kv, page_size, D)``."""
    full = kv_cache_shape(spec, num_pages)
    return (full[0],) + full[2:]


def kv_stride_kv(kv_cache: Any) -> int:
    """Elements from K to V: a pair's ``v_cache.data_ptr() - k_cache.data_ptr()`` over the element size
    (signed: V may sit before K); a tensor's ``stride(1)``. The pair must be checked first."""
    if not is_kv_pair(kv_cache):
        return kv_cache.stride(1)
    k, v = kv_cache
    return (v.data_ptr() - k.data_ptr()) // k.element_size()


def _check_kv_pair(spec: AttentionSpec, kv_cache: Any, device: torch.device | None, device_of: str) -> None:
    if len(kv_cache) != 2:
        fail(f"kv_cache: a pair is (k_cache, v_cache), got a {type(kv_cache).__name__} of {len(kv_cache)}")
    dtype = _TORCH_DTYPES[spec.kv_dtype]
    for name, t in zip(("k_cache", "v_cache"), kv_cache):
        check_tensor(f"kv_cache ({name})", t, dtype=dtype, ndim=4, device=device, device_of=device_of)
    k, v = kv_cache
    expected = kv_pair_shape(spec, k.shape[0])
    if tuple(k.shape) != expected:
        dims = "(num_pages, page_size, num_kv_heads, head_dim)" if spec.kv_layout == "NHD" else \
            "(num_pages, num_kv_heads, page_size, head_dim)"
        fail(f"kv_cache (k_cache): expected {spec.kv_layout} shape {expected} {dims}, got {tuple(k.shape)}")
    if v.shape != k.shape:
        fail(f"kv_cache: k_cache and v_cache must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if v.device != k.device:
        fail(f"kv_cache: k_cache is on {k.device}, v_cache on {v.device}; both must be on one device")


def check_kv_cache(spec: AttentionSpec, kv_cache: Any, device: torch.device | None, device_of: str = "q") -> None:
    """``kv_cache`` of ``spec.kv_dtype`` in the spec's layout (:func:`kv_cache_shape`), any page count;
    or a ``(k_cache, v_cache)`` pair of two tensors of :func:`kv_pair_shape` (one shape, dtype, device).

    Raises:
        ValueError: naming the dim (page_size, num_kv_heads, ...), the value and the layout.
    """
    if spec.latent:
        _check_latent_cache(spec, kv_cache, device, device_of)
        return
    if is_kv_pair(kv_cache):
        _check_kv_pair(spec, kv_cache, device, device_of)
        return
    check_tensor("kv_cache", kv_cache, dtype=_TORCH_DTYPES[spec.kv_dtype], ndim=5, device=device, device_of=device_of)
    expected = kv_cache_shape(spec, kv_cache.shape[0])
    names = ("num_pages", "K/V", "page_size" if spec.kv_layout == "NHD" else "num_kv_heads",
             "num_kv_heads" if spec.kv_layout == "NHD" else "page_size", "head_dim")
    for d in range(1, 5):
        if kv_cache.shape[d] != expected[d]:
            fail(f"kv_cache: dim {d} ({names[d]}) must be {expected[d]} for {spec.kv_layout} layout "
                 f"{expected[1:]} after num_pages, got shape {tuple(kv_cache.shape)}")


def _check_latent_cache(spec: AttentionSpec, kv_cache: Any, device: torch.device | None, device_of: str) -> None:
    """A latent spec's one cache tensor ``(num_pages, page_size, head_dim_qk)``: rows of c_kv then k_pe."""
    if is_kv_pair(kv_cache):
        fail("kv_cache: a latent spec reads one tensor (num_pages, page_size, head_dim_qk) whose rows hold K, V being "
             "their first head_dim_vo values; got a (k_cache, v_cache) pair")
    check_tensor("kv_cache", kv_cache, dtype=_TORCH_DTYPES[spec.kv_dtype], ndim=3, device=device, device_of=device_of)
    for d, (what, want) in enumerate((("page_size", spec.page_size), ("head_dim_qk", spec.head_dim_qk)), start=1):
        _check_dim("kv_cache", kv_cache, d, want, f"{what}; latent cache (num_pages, page_size, head_dim_qk)")


def check_paged_metadata(spec: AttentionSpec, block_table: Any, seq_lens: Any, query_start_loc: Any,
                         device: torch.device | None, device_of: str = "q") -> tuple[int, int]:
    """The paged batch's metadata: int32 ``query_start_loc`` ``(batch + 1,)``, ``seq_lens`` ``(batch,)``,
    ``block_table`` ``(batch, max_pages)`` on ``device``. Returns ``(batch, max_pages)``.

    Raises:
        ValueError: naming the tensor, the dim and the expectation.
    """
    check_tensor("query_start_loc", query_start_loc, dtype=torch.int32, ndim=1, device=device, device_of=device_of)
    batch = query_start_loc.shape[0] - 1
    if batch < 1:
        fail(f"query_start_loc: expected shape (batch + 1,) with batch >= 1, got {tuple(query_start_loc.shape)}")
    check_tensor("seq_lens", seq_lens, dtype=torch.int32, ndim=1, device=device, device_of=device_of)
    _check_dim("seq_lens", seq_lens, 0, batch, "batch, from query_start_loc")
    check_tensor("block_table", block_table, dtype=torch.int32, ndim=2, device=device, device_of=device_of)
    _check_dim("block_table", block_table, 0, batch, "batch, from query_start_loc")
    return batch, block_table.shape[1]


def check_out(spec: AttentionSpec, out: Any, total_q: int, device: torch.device | None, device_of: str = "q") -> None:
    """A preallocated output: contiguous ``(total_q, num_qo_heads, head_dim_vo)`` of ``spec.o_dtype``.

    Raises:
        ValueError: naming what differs.
    """
    check_tensor("out", out, dtype=_TORCH_DTYPES[spec.o_dtype], ndim=3, device=device, device_of=device_of)
    if tuple(out.shape) != (total_q, spec.num_qo_heads, spec.head_dim_vo) or not out.is_contiguous():
        fail(f"out: expected a contiguous ({total_q}, {spec.num_qo_heads}, {spec.head_dim_vo}) tensor, "
             f"got shape {tuple(out.shape)} strides {out.stride()}")


@dataclass(frozen=True)
class RaggedCall:
    """Sizes derived from a checked ragged call."""

    batch: int
    total_q: int
    total_kv: int


def check_ragged_call(spec: AttentionSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      query_start_loc: torch.Tensor, kv_start_loc: torch.Tensor, *, sinks: torch.Tensor | None = None,
                      alibi_slopes: torch.Tensor | None = None, params: Mapping[str, Any] | None = None,
                      out: torch.Tensor | None = None, for_kernel: bool = False) -> RaggedCall:
    """Check a ragged call's tensors against the spec (shapes: :func:`jitattn.reference.ragged_attention`).

    Args:
        for_kernel: also require what the CUDA kernels need: a CUDA device, a contiguous last dim and
            16-byte aligned rows (token and head strides multiples of 16 bytes) for q, k and v.

    Raises:
        ValueError: the spec is not ragged, or the first problem found, naming the tensor, the
            dimension and the expectation.
    """
    check_spec(spec, "ragged_attention(spec, q, k, v, query_start_loc, kv_start_loc, ...)")
    if not spec.ragged:
        fail(f"spec.kv_storage={spec.kv_storage!r}: ragged K/V need a spec with kv_storage='ragged' "
             f"(a paged spec takes kv_cache / block_table / seq_lens: paged_attention)")
    check_paged_q(spec, q)  # q's checks are the paged call's
    dev = q.device
    _check_ragged_kv(spec, k, v, dev)
    check_tensor("query_start_loc", query_start_loc, dtype=torch.int32, ndim=1, device=dev)
    batch = query_start_loc.shape[0] - 1
    if batch < 1:
        fail(f"query_start_loc: expected shape (batch + 1,) with batch >= 1, got {tuple(query_start_loc.shape)}")
    check_tensor("kv_start_loc", kv_start_loc, dtype=torch.int32, ndim=1, device=dev)
    _check_dim("kv_start_loc", kv_start_loc, 0, batch + 1, "batch + 1, from query_start_loc")
    _check_extras(spec, q, sinks, alibi_slopes, params, out, batch, dev)
    if for_kernel:
        if q.device.type != "cuda":
            fail(f"q: the jit backend runs on CUDA devices, got {q.device}; use the reference backend on CPU")
        _check_ragged_layout(q, k, v)
        for name, t in (("query_start_loc", query_start_loc), ("kv_start_loc", kv_start_loc)):
            if not t.is_contiguous():
                fail(f"{name}: must be contiguous")
    return RaggedCall(batch=batch, total_q=q.shape[0], total_kv=k.shape[0])


def _check_ragged_kv(spec: AttentionSpec, k: Any, v: Any, dev: torch.device | None, device_of: str = "q") -> None:
    for name, t, dim, what in (("k", k, spec.head_dim_qk, "head_dim_qk"), ("v", v, spec.head_dim_vo, "head_dim_vo")):
        check_tensor(name, t, dtype=_TORCH_DTYPES[spec.kv_dtype], ndim=3, device=dev, device_of=device_of)
        _check_dim(name, t, 1, spec.num_kv_heads, "num_kv_heads")
        _check_dim(name, t, 2, dim, what)
    if v.shape[0] != k.shape[0]:
        fail(f"v: dim 0 (total_kv) must equal k's, {k.shape[0]}, got shape {tuple(v.shape)}")


def _check_ragged_layout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_rows_16b(name, t)
    if max(k.shape[0], q.shape[0]) >= 2 ** 31:
        fail(f"k / q: at most 2**31 - 1 tokens (int32 start locations), got {k.shape[0]} / {q.shape[0]}")


def check_ragged_tensors(spec: AttentionSpec, q: torch.Tensor, k: Any, v: Any, device: torch.device) -> None:
    """A ragged run's k and v (``(total_kv, num_kv_heads, head_dim)``, the spec's KV dtype, on
    ``device``) and what the kernel needs of q, k and v: contiguous last dims, 16-byte aligned rows.
    (q's dtype and shape are the caller's to check.)

    Raises:
        ValueError: naming the tensor, the dim or stride and the expectation.
    """
    _check_ragged_kv(spec, k, v, device, device_of="the plan")
    _check_ragged_layout(q, k, v)


def _check_rows_16b(name: str, t: torch.Tensor) -> None:
    """A (tokens, heads, dim) tensor the kernels read by 16-byte copies: dim contiguous, rows 16-byte aligned."""
    per16 = 16 // t.element_size()
    if t.stride(2) != 1 and t.shape[2] > 1:
        fail(f"{name}: the last dim (head_dim) must be contiguous (stride 1), got strides {t.stride()}")
    bad = [(d, t.stride(d)) for d in (0, 1) if t.shape[d] > 1 and (t.stride(d) % per16 or t.stride(d) < 0)]
    if bad or t.data_ptr() % 16:
        fail(f"{name}: token and head strides must be non-negative multiples of {per16} elements (16 bytes) and "
             f"the data 16-byte aligned, got strides {t.stride()}, data_ptr % 16 = {t.data_ptr() % 16}; "
              f"pass {name}.contiguous()")


def check_ragged_metadata_values(seq_q: torch.Tensor, seq_kv: torch.Tensor, total_q: int, total_kv: int) -> None:
    """Check ``query_start_loc`` / ``kv_start_loc`` values (a device sync; not during graph capture).

    Raises:
        ValueError: either does not start at 0 and end at its tensor's rows, decreases, or a sequence
            brings more queries than it has keys.
    """
    qsl, ksl = seq_q.tolist(), seq_kv.tolist()
    for name, loc, total in (("query_start_loc", qsl, total_q), ("kv_start_loc", ksl, total_kv)):
        if loc[0] != 0 or loc[-1] != total:
            fail(f"{name}: must start at 0 and end at {total} (rows of {'q' if name[0] == 'q' else 'k and v'}), "
                 f"got {loc[0]} ... {loc[-1]}")
        for b in range(len(loc) - 1):
            if loc[b + 1] < loc[b]:
                fail(f"{name}: decreases at sequence {b} ({loc[b]} -> {loc[b + 1]})")
    for b in range(len(qsl) - 1):
        qo_len, kv_len = qsl[b + 1] - qsl[b], ksl[b + 1] - ksl[b]
        if qo_len > kv_len:
            fail(f"sequence {b}: {qo_len} queries but {kv_len} keys (kv_start_loc[{b + 1}] - kv_start_loc[{b}]); "
                 f"the queries are the last tokens of the keys, so q_len <= kv_len")


def check_vector(name: str, t: torch.Tensor | None, wanted: bool, n: int, dev: torch.device | None, flag: str,
                 optional: bool = False) -> None:
    """A per-head float32 ``(n,)`` vector (``sinks``, ``alibi_slopes``): required when the spec's ``flag``
    is set (unless ``optional``), refused when it is not.

    Raises:
        ValueError: naming the argument, the flag and what was given.
    """
    if t is None:
        if wanted and not optional:
            fail(f"{name}: {flag}=True, so a float32 ({n},) tensor is required")
        return
    if not wanted:
        fail(f"{name}: given, but {flag}=False; build the spec with {flag.split('.')[1]}=True or drop the argument")
    check_tensor(name, t, dtype=torch.float32, ndim=1, device=dev)
    _check_dim(name, t, 0, n, "num_qo_heads")
    if not t.is_contiguous():
        fail(f"{name}: must be contiguous")


def check_q_layout(spec: AttentionSpec, q: torch.Tensor) -> None:
    """What the paged kernels need of q: heads and head_dim contiguous, each token's row 16-byte aligned.

    Raises:
        ValueError: naming the strides or the alignment.
    """
    if q.stride(2) != 1 or q.stride(1) != spec.head_dim_qk:
        fail(f"q: heads and head_dim must be contiguous (strides (*, {spec.head_dim_qk}, 1)), got {q.stride()}")
    if q.stride(0) % 8 or q.data_ptr() % 16:
        fail(f"q: each token's row must start 16-byte aligned (stride(0)={q.stride(0)} elements, "
             f"data_ptr % 16 = {q.data_ptr() % 16}); pass q.contiguous()")


def check_out_layout(out: torch.Tensor) -> None:
    """What the kernels need of a preallocated ``out``: its data 16-byte aligned (they store pairs of
    elements as one 32-bit word; a tensor offset by one element faults with a misaligned address).

    Raises:
        ValueError: naming the alignment.
    """
    if out.data_ptr() % 16:
        fail(f"out: the data must start 16-byte aligned, got data_ptr % 16 = {out.data_ptr() % 16} "
             f"(a view at an odd element offset); pass a tensor of its own, e.g. torch.empty_like(out)")


def check_kv_cache_layout(spec: AttentionSpec, kv_cache: torch.Tensor) -> None:
    """What the kernels need of the cache: contiguous pages (strided between pages), aligned to the kernels'
    copies of a row (16 bytes; 8 for an FP8 row of a head dim that is a multiple of 8 only: kv_copy_bytes).

    Raises:
        ValueError: naming the strides or the alignment.
    """
    if is_kv_pair(kv_cache):
        _check_kv_pair_layout(spec, kv_cache)
        return
    inner = kv_cache_shape(spec, 1)[1:]
    _check_pages(kv_cache, inner, "kv_cache", f"dims 1-{len(inner)}",  # a latent cache has 3 dims, a paged one 5
                 kv_copy_bytes(spec.head_dim_qk, spec.kv_dtype))


def _check_pages(t: torch.Tensor, inner: tuple[int, ...], label: str, dims: str, align: int) -> None:
    """Each page of ``t`` (inner dims ``inner``) contiguous, every page ``align``-byte aligned; pages may be
    strided."""
    want = tuple(math.prod(inner[i + 1:]) for i in range(len(inner)))
    got = t.stride()[1:]
    # The stride of a size-1 dim never moves an address, so torch may report anything there.
    if any(g != w for g, w, n in zip(got, want, inner) if n > 1):
        fail(f"{label}: {dims} must be contiguous (strides {want}), got {got}; "
             f"pages may be strided, nothing inside a page may")
    if t.stride(0) % (align // t.element_size()) or t.data_ptr() % align:
        fail(f"{label}: pages must start {align}-byte aligned (stride(0)={t.stride(0)} elements, "
             f"data_ptr % {align} = {t.data_ptr() % align})")


def _check_kv_pair_layout(spec: AttentionSpec, kv_cache: Sequence[torch.Tensor]) -> None:
    """A pair runs on the single-tensor kernels (V at K's address + ``kv_stride_kv``), so both tensors
    must share their strides: pages strided alike, each page contiguous, aligned as check_kv_cache_layout says."""
    k, v = kv_cache
    inner = kv_pair_shape(spec, 1)[1:]
    for name, t in (("k_cache", k), ("v_cache", v)):
        _check_pages(t, inner, f"kv_cache ({name})", "dims 1-3", kv_copy_bytes(spec.head_dim_qk, spec.kv_dtype))
    if k.shape[0] > 1 and k.stride(0) != v.stride(0):
        fail(f"kv_cache: k_cache's page stride is {k.stride(0)} elements and v_cache's {v.stride(0)}; the kernels "
             f"take a pair whose two tensors have the same strides (V read at K's address + a fixed offset): "
             f"views of one tensor such as (kv[0], kv[1]) or (kv[:, 0], kv[:, 1]), or two caches allocated alike")
    if (v.data_ptr() - k.data_ptr()) % k.element_size():
        fail(f"kv_cache: v_cache starts {v.data_ptr() - k.data_ptr()} bytes from k_cache, not a whole number of "
             f"{k.element_size()}-byte elements")


def check_metadata_layout(block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor) -> None:
    """What the kernels need of the metadata: contiguous block_table rows, contiguous vectors.

    Raises:
        ValueError: naming the tensor.
    """
    if block_table.stride(1) != 1:
        fail(f"block_table: rows must be contiguous (stride(1) == 1), got strides {block_table.stride()}")
    for name, t in (("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):
        if not t.is_contiguous():
            fail(f"{name}: must be contiguous")


def check_positions(spec: AttentionSpec, query_positions: Any, functor_batch: Any, position_offset: Any, *,
                    total_q: int, batch: int, device: torch.device | None) -> None:
    """The explicit-position tensors of a paged call: required (int32, contiguous, on ``device``) for a
    spec with ``query_positions="explicit"``, refused for any other spec.

    Shapes: ``query_positions`` and ``functor_batch`` ``(total_q,)``, ``position_offset`` ``(batch,)``.

    Raises:
        ValueError: naming the argument, what it is and what the spec needs (before any launch).
    """
    given = {"query_positions": query_positions, "functor_batch": functor_batch, "position_offset": position_offset}
    if not spec.explicit_positions:
        for name, t in given.items():
            if t is not None:
                fail(f"{name}: given, but the spec has query_positions='implicit' (each sequence's queries are its "
                     f"last qo_len positions); build the spec with query_positions='explicit' or drop the argument")
        return
    for name, t in given.items():
        n, what = (batch, "batch") if name == "position_offset" else (total_q, "total_q")
        if t is None:
            fail(f"{name}: the spec has query_positions='explicit', so an int32 ({what},) tensor is required")
        check_tensor(name, t, dtype=torch.int32, ndim=1, device=device)
        _check_dim(name, t, 0, n, what)
        if not t.is_contiguous():
            fail(f"{name}: must be contiguous")


def check_position_values(functor_batch: torch.Tensor, spec: AttentionSpec, params: Mapping[str, Any] | None) -> None:
    """Host check of explicit positions (a device sync): the hook batches must be >= 0 and below the size
    of every parameter the variant indexes by batch, which the hooks read at ``functor_batch[t]``. (The
    positions themselves may be anything: negative is before the sequence's first key, which a causal
    spec shows no key.)

    Raises:
        ValueError: the first ``functor_batch`` entry out of range, named with its index.
    """
    if not functor_batch.numel():
        return
    if int(functor_batch.min()) < 0:
        i = int((functor_batch < 0).nonzero()[0, 0])
        fail(f"functor_batch[{i}]={int(functor_batch[i])}: expected a value >= 0")
    for p in spec.params:
        value = (params or {}).get(p.name)
        if p.is_scalar or not isinstance(value, torch.Tensor) or "batch" not in p.shape:
            continue
        d = p.shape.index("batch")
        if int(functor_batch.max()) >= value.shape[d]:
            i = int((functor_batch >= value.shape[d]).nonzero()[0, 0])
            fail(f"functor_batch[{i}]={int(functor_batch[i])}: the hooks read params[{p.name!r}] (dim {d}: batch, "
                 f"size {value.shape[d]}) at it; expected a value < {value.shape[d]}")


def check_flag(name: str, value: Any) -> bool:
    """A boolean call option (``return_lse``, ``validate``): ``True`` or ``False`` (numpy's bool too).

    A truthy stand-in such as ``"yes"`` or ``1`` is refused rather than read: ``"no"`` would be true.

    Raises:
        ValueError: naming the argument and the value.
    """
    if type(value).__name__ not in ("bool", "bool_"):
        fail(f"{name}={value!r}: expected True or False")
    return bool(value)


def check_max_query_len(value: Any) -> int | None:
    """The ``max_query_len`` hint: None or an int >= 0 (numpy's integers and a SymInt too), never a bool.

    It picks the kernels (1 launches only the decode kernel), so ``True`` (equal to 1), ``1.0``,
    ``"1"`` or a tensor are refused rather than read.

    Raises:
        ValueError: naming the value.
    """
    if value is None:
        return None
    # isinstance only (no hasattr): torch.compile traces this with a SymInt when the value varies
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt, numbers.Integral)) or value < 0:
        fail(f"max_query_len={value!r}: expected None or an int >= 0 (the longest query count of the batch)")
    return value if isinstance(value, (int, torch.SymInt)) else int(value)  # numpy's: a plain int for the grids


def check_scale(name: str, value: Any) -> float:
    """An FP8 dequantisation scale (``k_scale`` / ``v_scale``): a positive finite Python number that
    stays positive and finite as the float32 the kernels read.

    Raises:
        ValueError: naming the argument and the value (NaN, inf, <= 0, beyond float32's range or
            rounding to 0 there, a bool or a tensor).
    """
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and _fits_float32(value)
    as_f32 = struct.unpack("<f", struct.pack("<f", value))[0] if ok else math.nan
    if not (math.isfinite(as_f32) and as_f32 > 0):
        fail(f"{name}={value!r}: expected a positive finite Python float (a tensor would need a sync), "
             f"one float32 holds (its positive range is about 1.4e-45 to 3.4e+38)")
    return float(value)


def check_scales(spec: AttentionSpec, k_scale: Any, v_scale: Any) -> tuple[float, float]:
    """A call's ``k_scale`` / ``v_scale``: :func:`check_scale` each, and exactly 1.0 unless the cache is FP8.

    A 16-bit cache holds K and V as they are; a scale other than 1.0 there would be applied by some
    kernel paths and ignored by others (and by the torch backends), so it is refused, never guessed.
    A latent spec takes ``k_scale`` only (``v_scale`` must stay 1.0) and returns it twice: its V is K's row.

    Raises:
        ValueError: naming the argument, the value and the spec's ``kv_dtype``.
    """
    scales = check_scale("k_scale", k_scale), check_scale("v_scale", v_scale)
    if spec.latent:  # V is the first head_dim_vo values of K's row: k_scale dequantises both
        if scales[1] != 1.0:
            fail(f"v_scale={scales[1]!r}: a latent cache has one scale, k_scale (V is the first head_dim_vo values of "
                 f"K's row and is dequantised with it); drop v_scale")
        scales = (scales[0], scales[0])
    if spec.kv_dtype != "float8_e4m3fn":
        for name, value in zip(("k_scale", "v_scale"), scales):
            if value != 1.0:
                fail(f"{name}={value!r}: only an FP8 cache (kv_dtype='float8_e4m3fn') is dequantised by a scale; "
                     f"spec.kv_dtype={spec.kv_dtype!r} holds K and V as they are, so {name} must be 1.0 "
                      f"(drop the argument)")
    return scales


def _resolve_dim(dim: int | str, *, batch: int, total_q: int, spec: AttentionSpec) -> int | None:
    if isinstance(dim, int):
        return dim
    return {"batch": batch, "total_q": total_q, "num_qo_heads": spec.num_qo_heads,
            "num_kv_heads": spec.num_kv_heads}.get(dim)  # "*": any


_FLOAT32_MAX = struct.unpack("<f", b"\xff\xff\x7f\x7f")[0]


def _fits_float32(value: float) -> bool:
    """Whether the kernel's Params packer takes ``value`` as a float32 (it refuses finite values beyond
    float32's range)."""
    try:
        struct.pack("<f", value)
    except (OverflowError, struct.error):  # struct.error: an int too large for a float
        return False
    return True


def check_params(spec: AttentionSpec, params: Mapping[str, Any], *, batch: int, total_q: int,
                 device: torch.device | None) -> None:
    """Every declared variant parameter present with its dtype and shape; nothing undeclared.

    Raises:
        ValueError: naming the parameter, what was expected and what was given.
    """
    declared: dict[str, Param] = {p.name: p for p in spec.params}
    unknown = sorted(set(params) - set(declared))
    if unknown:
        fail(f"params: unknown names {unknown}; the variant declares {sorted(declared) or 'none'}")
    for name, p in declared.items():
        if name not in params:
            fail(f"params[{name!r}]: missing; the variant declares it as {p.dtype} shape {p.shape}")
        value = params[name]
        if p.is_scalar:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if p.dtype == "int32":
                ok = ok and isinstance(value, int) and -(2 ** 31) <= value < 2 ** 31
            elif ok and not _fits_float32(value):
                fail(f"params[{name!r}]: {value!r} is outside float32's range (|x| <= {_FLOAT32_MAX:.7g}); "
                     f"pass a float32 value (inf and nan are taken as they are)")
            if not ok:
                fail(f"params[{name!r}]: expected a Python {'int in [-2**31, 2**31)' if p.dtype == 'int32' else 'float'}"
                     f" scalar ({p.dtype}), got {value!r}")
            continue
        check_tensor(f"params[{name!r}]", value, dtype=_TORCH_DTYPES[p.dtype], ndim=len(p.shape), device=device)
        for d, dim in enumerate(p.shape):
            want = _resolve_dim(dim, batch=batch, total_q=total_q, spec=spec)
            if spec.explicit_positions and dim in ("batch", "total_q"):
                want = None  # hooks index them by functor_batch (a cascade's requests), not by this call's rows
            if want is not None and value.shape[d] != want:
                fail(f"params[{name!r}]: dim {d} ({dim}) must be {want}, got shape {tuple(value.shape)}")
        if not value.is_contiguous():
            fail(f"params[{name!r}]: must be contiguous")


def check_metadata_values(spec: AttentionSpec, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                          block_table: torch.Tensor, num_pages: int, total_q: int) -> None:
    """Check the metadata's values (copies them to the host: a device sync; not during graph capture).

    Raises:
        ValueError: query_start_loc not starting at 0 and ending at ``total_q`` or decreasing, a
            negative seq_lens entry, a sequence with more queries than keys (implicit positions only:
            explicit ones may bring any number), a sequence longer than its block_table row holds, or
            a page id (of the pages the sequence uses) outside ``[0, num_pages)``.
    """
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    if qsl[0] != 0 or qsl[-1] != total_q:
        fail(f"query_start_loc: must start at 0 and end at total_q={total_q}, got {qsl[0]} ... {qsl[-1]}")
    capacity = block_table.shape[1] * spec.page_size
    table = block_table.cpu()
    for b, kv_len in enumerate(lens):
        qo_len = qsl[b + 1] - qsl[b]
        if kv_len < 0:
            fail(f"seq_lens[{b}]={kv_len}: expected a KV length >= 0")
        if qo_len < 0:
            fail(f"query_start_loc: decreases at sequence {b} ({qsl[b]} -> {qsl[b + 1]})")
        if qo_len > kv_len and not spec.explicit_positions:
            fail(f"seq_lens[{b}]={kv_len} but the sequence brings {qo_len} queries; seq_lens counts new tokens too")
        if kv_len > capacity:
            fail(f"seq_lens[{b}]={kv_len} exceeds block_table capacity {block_table.shape[1]} pages x "
                 f"{spec.page_size} = {capacity}")
        used = table[b, : -(-kv_len // spec.page_size)]
        if used.numel() and (int(used.min()) < 0 or int(used.max()) >= num_pages):
            fail(f"block_table[{b}]: page ids must be in [0, {num_pages}), got {used.tolist()}")
