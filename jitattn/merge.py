"""merge_state: combine attention states of the same queries over disjoint key sets.

An attention *state* of one query row and head is its normalised output ``v`` (``head_dim``
values) and its lse ``s = log(sum_j exp(score_j))`` (natural log, float32) over some set of keys.
Two states over disjoint key sets A and B give the state over A u B exactly:

    s = logaddexp(s_a, s_b),   v = v_a * exp(s_a - s) + v_b * exp(s_b - s)

computed as ``m = max(s_a, s_b)``, ``w_i = exp(s_i - m)``, ``s = m + log(w_a + w_b)``,
``v = (w_a v_a + w_b v_b) / (w_a + w_b)``: the online-softmax rescaling of Milakov & Gimelshein
2018 ("Online normalizer calculation for softmax"), applied to whole partial states as
FlashDecoding (Dao, Haziza, Massa, Sizov 2023) merges its split-KV partials; many states merge the
same way with ``m = max_i s_i``. This is the building block of split-KV decoding and of cascade
attention (a shared prefix's state merged with each request's own suffix).

Rules (the conventions of ``shared/DESIGN.md``: a row that sees no key has output 0 and lse -inf):

- every state has lse -inf (no key anywhere): ``v = 0``, ``s = -inf``, never NaN;
- a state with lse -inf is the identity: merging it gives the other state bit for bit (its ``v``
  is never read, so whatever it holds, NaN included, does not leak);
- a NaN lse makes that row's ``v`` and ``s`` NaN (it is not silently dropped); an lse of +inf
  is not a finite state and gives NaN as well.

Two implementations with the same arithmetic (fp32; the output rounded once to the input dtype):

- a torch path that runs on any device (CPU included), without host syncs or data-dependent
  Python branches, so ``torch.compile(fullgraph=True)`` traces it;
- for CUDA tensors, a fused kernel (``templates/merge.cu.j2``: one pass over the values with
  16-byte vector loads and stores, fp32 accumulation) that goes through jitattn's own pipeline:
  rendered, compiled by nvcc, cached by content, loaded through the CUDA driver API and launched on
  torch's current stream (:mod:`jitattn.merge_module`). ``JITATTN_DISABLE_JIT=1`` deployments
  find it in the cache, and ``jitattn warmup --model`` builds it for each model's output dtype.

``impl="auto"`` (the default) takes the kernel for CUDA tensors, except while ``torch.compile``
traces the call (the torch path is traced, and inductor fuses it) or when autograd needs the
graph (a value requires grad: only the torch path is differentiable); ``impl="torch"`` /
``impl="cuda"`` force one.
"""

from __future__ import annotations

import struct
from typing import Any

import torch

from jitattn import merge_module as _mm
from jitattn.checks import fail
from jitattn.runtime import LoadedOnce, cuda_device

__all__ = ["merge_state", "merge_state_in_place", "merge_states"]

_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
_IMPLS = ("auto", "torch", "cuda")
_NEG_INF = float("-inf")


# ---- checks --------------------------------------------------------------------------------------
def _tensor(name: str, t: Any) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        fail(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    return t


def _check_values(name: str, v: Any, ndim: int, layout: str) -> torch.Tensor:
    v = _tensor(name, v)
    if v.dim() != ndim:
        fail(f"{name}: expected {ndim} dims {layout}, got shape {tuple(v.shape)}")
    if v.dtype not in _DTYPES:
        fail(f"{name}: dtype {v.dtype} not supported; expected torch.float16, torch.bfloat16 or torch.float32")
    if v.shape[-1] > 1 and v.stride(-1) != 1:
        fail(f"{name}: the last (head_dim) dimension must be contiguous (stride 1), got strides {v.stride()}; "
              f"call .contiguous() first")
    return v


def _check_lse(name: str, s: Any, shape: tuple[int, ...], layout: str, device: torch.device) -> torch.Tensor:
    s = _tensor(name, s)
    if s.dtype != torch.float32:
        fail(f"{name}: lse must be torch.float32 (natural log), got {s.dtype}")
    if tuple(s.shape) != shape:
        fail(f"{name}: expected shape {shape} {layout}, got {tuple(s.shape)}")
    if s.device != device:
        fail(f"{name}: on {s.device}, but the values are on {device}; all tensors must be on one device")
    return s


def _check_same(name: str, other: torch.Tensor, first: str, ref: torch.Tensor) -> None:
    if tuple(other.shape) != tuple(ref.shape):
        fail(f"{name}: shape {tuple(other.shape)} differs from {first}'s {tuple(ref.shape)}")
    if other.dtype != ref.dtype:
        fail(f"{name}: dtype {other.dtype} differs from {first}'s {ref.dtype}; both states must share a dtype")
    if other.device != ref.device:
        fail(f"{name}: on {other.device}, but {first} is on {ref.device}; all tensors must be on one device")


def _check_pair(v_a: Any, s_a: Any, v_b: Any, s_b: Any, names: tuple[str, str, str, str]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    layout = "(seq, num_heads, head_dim)"
    va = _check_values(names[0], v_a, 3, layout)
    vb = _check_values(names[2], v_b, 3, layout)
    _check_same(names[2], vb, names[0], va)
    shape = tuple(va.shape[:2])
    sa = _check_lse(names[1], s_a, shape, "(seq, num_heads)", va.device)
    sb = _check_lse(names[3], s_b, shape, "(seq, num_heads)", va.device)
    return va, sa, vb, sb


def _check_impl(impl: Any, device: torch.device) -> None:
    if impl not in _IMPLS:
        fail(f"impl={impl!r}: expected one of {_IMPLS}")
    if impl == "cuda" and device.type != "cuda":
        fail(f"impl='cuda': the tensors are on {device}; the CUDA kernel needs CUDA tensors (use impl='torch' "
              f"or 'auto')")


def _use_kernel(impl: str, tensors: tuple[torch.Tensor, ...]) -> bool:
    if impl != "auto":
        return impl == "cuda"
    if not tensors[0].is_cuda or torch.compiler.is_compiling():
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


# ---- the torch path ------------------------------------------------------------------------------
def _weighted(v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``w * v`` in fp32, 0 where the weight is not positive (an empty state is never read)."""
    w = w.unsqueeze(-1)
    return torch.where(w > 0, v.float() * w, 0.0)


def _finish(acc: torch.Tensor, d: torch.Tensor, m_safe: torch.Tensor, empty: torch.Tensor, dtype: torch.dtype
            ) -> tuple[torch.Tensor, torch.Tensor]:
    v = torch.where(empty.unsqueeze(-1), 0.0, acc / d.unsqueeze(-1)).to(dtype)
    s = torch.where(empty, _NEG_INF, m_safe + torch.log(d))
    return v, s


def _merge_pair_torch(v_a, s_a, v_b, s_b) -> tuple[torch.Tensor, torch.Tensor]:
    m = torch.maximum(s_a, s_b)  # NaN propagates
    empty = m == _NEG_INF
    m_safe = torch.where(empty, 0.0, m)
    w_a, w_b = torch.exp(s_a - m_safe), torch.exp(s_b - m_safe)
    return _finish(_weighted(v_a, w_a) + _weighted(v_b, w_b), w_a + w_b, m_safe, empty, v_a.dtype)


def _merge_many_torch(v, s) -> tuple[torch.Tensor, torch.Tensor]:
    m = s.amax(dim=1)  # (seq, heads); NaN propagates
    empty = m == _NEG_INF
    m_safe = torch.where(empty, 0.0, m)
    w = torch.exp(s - m_safe.unsqueeze(1))  # (seq, states, heads)
    return _finish(_weighted(v, w).sum(dim=1), w.sum(dim=1), m_safe, empty, v.dtype)


# ---- the CUDA kernel -----------------------------------------------------------------------------
_STRUCT_CODE = {"ptr": "Q", "i64": "q", "i32": "i", "f32": "f"}


def params_packer(module: _mm.MergeModule) -> tuple[struct.Struct, tuple[str, ...]]:
    """A ``struct.Struct`` packing ``MergeParams`` (layout of :func:`jitattn.render.params_layout`) and
    the field names in packing order."""
    from jitattn.render import params_layout

    placed, size = params_layout(module.fields)
    fmt, pos = "<", 0
    for f, off in placed:
        fmt += "x" * (off - pos) + _STRUCT_CODE[f.kind]
        pos = off + f.size
    return struct.Struct(fmt + "x" * (size - pos)), tuple(f.name for f, _ in placed)


class MergeKernel:
    """The merge kernels of one dtype, loaded on one CUDA device (:class:`jitattn.merge_module.MergeModule`).

    Raises:
        MissingKernelError: not cached under JITATTN_DISABLE_JIT=1 (names the warm-up command).
        jitattn.build.CompileError / BuildError: nvcc failed or cannot run.
        OSError: no CUDA driver library (:mod:`jitattn.cuda_driver`).
        RuntimeError: the cubin's Params size differs from the host's (a stale entry).
    """

    def __init__(self, dtype: str, device: torch.device):
        from jitattn.runtime import CubinModule, select_entry

        self.module_spec = _mm.MergeModule(dtype)
        self.device = device
        self.entry = select_entry(self.module_spec, torch.cuda.get_device_capability(device))
        kernels = {k: v for k, v in _mm.KERNEL_NAMES.items() if k != "geometry"}
        self._module = CubinModule(str(self.entry.cubin), device.index, kernels,
                                   sha256=self.entry.manifest["artifacts"].get(self.entry.cubin.name))
        raw = self._module.read_global_int32(_mm.KERNEL_NAMES["geometry"], len(_mm.GEOMETRY))
        self.geometry = dict(zip(_mm.GEOMETRY, raw))
        self._packer, self._order = params_packer(self.module_spec)
        size = self._packer.size
        if self.geometry["params_size"] != size or self.geometry["threads"] != _mm.THREADS:
            raise RuntimeError(f"{self.entry.cubin}: geometry {self.geometry} does not match the host (Params "
                               f"{size} bytes, {_mm.THREADS} threads); the cache entry is stale: "
                               f"`jitattn cache prune` and warm up again")
        self.vec_elems = self.geometry["vec_elems"]

    def launch(self, kernel: str, *, v_a, s_a, v_b, s_b, v_out, s_out, mask, num_states: int) -> None:
        """Launch ``merge_state`` or ``merge_states`` on torch's current stream. Checked inputs only."""
        fields, blocks = launch_fields(kernel, self.vec_elems, v_a=v_a, s_a=s_a, v_b=v_b, s_b=s_b, v_out=v_out,
                                       s_out=s_out, mask=mask, num_states=num_states)
        if blocks == 0:
            return
        args = self._packer.pack(*(fields[n] for n in self._order))
        stream = torch.cuda.current_stream(self.device).cuda_stream
        self._module.launch(kernel, (blocks, 1, 1), _mm.THREADS, 0, args, stream)


def launch_fields(kernel: str, vec_elems: int, *, v_a, s_a, v_b, s_b, v_out, s_out, mask, num_states: int
                  ) -> tuple[dict[str, int], int]:
    """The ``MergeParams`` values (by field name) and the grid size of one launch (0: nothing to do).

    ``vec_elems`` is the elements per 16-byte chunk (8 for 16-bit values, 4 for float32). The
    kernel takes 16-byte vector loads when every value tensor's address is 16-byte aligned and its
    strides (of dims longer than 1) and head_dim are multiples of ``vec_elems``; otherwise
    element-wise loads. Each (row, head) gets the smallest power of two >= its chunk count (at
    most 32) lanes.
    """
    rows, heads, head_dim = v_out.shape
    many = kernel == "merge_states"
    values = [t for t in (v_a, v_b, v_out) if t is not None]
    aligned = head_dim % vec_elems == 0 and all(
        t.data_ptr() % 16 == 0 and all(st % vec_elems == 0 for st, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1)
        for t in values)
    chunks = -(-head_dim // vec_elems)
    group = 1
    while group < min(chunks, 32):
        group *= 2
    zero = (0, 0)
    sb = s_b.stride() if s_b is not None else zero
    vb = v_b.stride() if v_b is not None else zero
    fields = {
        "v_a": v_a.data_ptr(), "s_a": s_a.data_ptr(),
        "v_b": v_b.data_ptr() if v_b is not None else 0, "s_b": s_b.data_ptr() if s_b is not None else 0,
        "v_out": v_out.data_ptr(), "s_out": s_out.data_ptr(), "mask": mask.data_ptr() if mask is not None else 0,
        "v_a_stride_seq": v_a.stride(0), "v_a_stride_state": v_a.stride(1) if many else 0,
        "v_a_stride_head": v_a.stride(2 if many else 1),
        "s_a_stride_seq": s_a.stride(0), "s_a_stride_state": s_a.stride(1) if many else 0,
        "s_a_stride_head": s_a.stride(2 if many else 1),
        "v_b_stride_seq": vb[0], "v_b_stride_head": vb[1], "s_b_stride_seq": sb[0], "s_b_stride_head": sb[1],
        "v_out_stride_seq": v_out.stride(0), "v_out_stride_head": v_out.stride(1),
        "s_out_stride_seq": s_out.stride(0), "s_out_stride_head": s_out.stride(1),
        "mask_stride": mask.stride(0) if mask is not None else 0,
        "num_rows": rows, "num_heads": heads, "head_dim": head_dim, "num_states": num_states,
        "group_threads": group, "vectorized": int(aligned),
    }
    return fields, -(-rows * heads * group // _mm.THREADS)




_KERNELS = LoadedOnce()


def load_merge_kernel(dtype: torch.dtype | str, device: torch.device | str | int | None = None) -> MergeKernel:
    """The :class:`MergeKernel` of ``dtype`` on a CUDA ``device`` (loaded once per process, then reused).

    Raises:
        ValueError: an unsupported dtype or a non-CUDA device.
        MissingKernelError: not cached and JITATTN_DISABLE_JIT=1.
    """
    name = _DTYPES.get(dtype) if isinstance(dtype, torch.dtype) else _mm.normalize_merge_dtype(dtype)
    if name is None:
        fail(f"dtype={dtype}: expected torch.float16, torch.bfloat16 or torch.float32")
    dev = cuda_device(device)
    return _KERNELS.get((name, dev.index), lambda: MergeKernel(name, dev))


# ---- public API ----------------------------------------------------------------------------------
def merge_state(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor, *,
                impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two attention states of the same queries over disjoint key sets into the state of their union.

    ``s = logaddexp(s_a, s_b)``, ``v = v_a * exp(s_a - s) + v_b * exp(s_b - s)``, computed in fp32
    with the max subtracted first (Milakov & Gimelshein 2018, "Online normalizer calculation for
    softmax"; the split-KV merge of FlashDecoding, Dao et al. 2023). Both lse -inf: ``v = 0``,
    ``s = -inf``; one lse -inf: exactly the other state; a NaN lse gives NaN (module docstring).

    Args:
        v_a, v_b: attention outputs ``(seq, num_heads, head_dim)``, float16, bfloat16 or float32 (the
            same dtype); the last dimension contiguous (stride 1), other strides free.
        s_a, s_b: their lse, float32 ``(seq, num_heads)``, natural log; any strides.
        impl: ``"auto"`` (the CUDA kernel for CUDA tensors, the torch path otherwise, under
            ``torch.compile`` and when autograd records), ``"torch"`` or ``"cuda"``.

    Returns:
        ``(v, s)``: new tensors, ``v`` ``(seq, num_heads, head_dim)`` in the input dtype (contiguous),
        ``s`` float32 ``(seq, num_heads)``.

    Raises:
        ValueError: a shape, dtype, device or stride that does not fit, or a bad ``impl`` (before
            any launch).
        MissingKernelError: a CUDA call under ``JITATTN_DISABLE_JIT=1`` whose module is not cached.
    """
    v_a, s_a, v_b, s_b = _check_pair(v_a, s_a, v_b, s_b, ("v_a", "s_a", "v_b", "s_b"))
    _check_impl(impl, v_a.device)
    if not _use_kernel(impl, (v_a, s_a, v_b, s_b)):
        return _merge_pair_torch(v_a, s_a, v_b, s_b)
    v = torch.empty(v_a.shape, dtype=v_a.dtype, device=v_a.device)
    s = torch.empty(s_a.shape, dtype=torch.float32, device=v_a.device)
    load_merge_kernel(v_a.dtype, v_a.device).launch("merge_state", v_a=v_a, s_a=s_a, v_b=v_b, s_b=s_b, v_out=v,
                                                    s_out=s, mask=None, num_states=2)
    return v, s


def merge_state_in_place(v: torch.Tensor, s: torch.Tensor, v_other: torch.Tensor, s_other: torch.Tensor,
                         mask: torch.Tensor | None = None, *, impl: str = "auto") -> None:
    """Merge the state ``(v_other, s_other)`` into ``(v, s)``, in place (see :func:`merge_state`).

    Args:
        v, v_other: ``(seq, num_heads, head_dim)``, float16 / bfloat16 / float32 (one dtype), last
            dimension contiguous; ``v`` is overwritten with the merged values.
        s, s_other: float32 ``(seq, num_heads)`` lse (natural log); ``s`` is overwritten.
        mask: optional bool ``(seq,)`` on the same device: only rows where it is True merge; the
            others keep ``v`` and ``s`` untouched (bit for bit). None merges every row.
        impl: as in :func:`merge_state`.

    ``v_other`` / ``s_other`` must not partially overlap ``v`` / ``s`` in memory (the very same
    tensor is fine: a state merged with itself).

    Raises:
        ValueError: a shape, dtype, device or stride that does not fit, a mask that is not bool
            ``(seq,)``, or a bad ``impl`` (before any launch).
    """
    v, s, v_other, s_other = _check_pair(v, s, v_other, s_other, ("v", "s", "v_other", "s_other"))
    for name, t in (("v", v), ("s", s)):
        if any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape)):
            fail(f"{name}: a broadcast view (stride 0 in shape {tuple(t.shape)}, strides {t.stride()}) cannot be "
                  f"written in place; pass a tensor that owns each element")
    if mask is not None:
        mask = _tensor("mask", mask)
        if mask.dtype != torch.bool:
            fail(f"mask: dtype {mask.dtype}; expected torch.bool (True: merge this row)")
        if tuple(mask.shape) != (v.shape[0],):
            fail(f"mask: expected shape ({v.shape[0]},) (seq,), got {tuple(mask.shape)}")
        if mask.device != v.device:
            fail(f"mask: on {mask.device}, but v is on {v.device}; all tensors must be on one device")
    _check_impl(impl, v.device)
    if _use_kernel(impl, (v, s, v_other, s_other)):
        load_merge_kernel(v.dtype, v.device).launch("merge_state", v_a=v, s_a=s, v_b=v_other, s_b=s_other, v_out=v,
                                                    s_out=s, mask=mask, num_states=2)
        return
    new_v, new_s = _merge_pair_torch(v, s, v_other, s_other)
    if mask is not None:
        new_v = torch.where(mask[:, None, None], new_v, v)
        new_s = torch.where(mask[:, None], new_s, s)
    v.copy_(new_v)
    s.copy_(new_s)


def merge_states(v: torch.Tensor, s: torch.Tensor, *, impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``num_states`` attention states of each row (disjoint key sets) into one state.

    ``m = max_i s_i``, ``s = m + log(sum_i exp(s_i - m))``, ``v = sum_i exp(s_i - m) v_i / sum_i
    exp(s_i - m)`` in fp32 (Milakov & Gimelshein 2018; FlashDecoding, Dao et al. 2023). States with
    lse -inf are skipped (never read); a row whose states are all -inf gives ``v = 0``, ``s = -inf``.
    ``num_states == 0`` is allowed and gives that empty state for every row (the identity of the
    merge: the union of no key sets is empty).

    Args:
        v: ``(seq, num_states, num_heads, head_dim)``, float16 / bfloat16 / float32, last dimension
            contiguous; other strides free.
        s: float32 ``(seq, num_states, num_heads)`` lse, natural log.
        impl: as in :func:`merge_state`.

    Returns:
        ``(v, s)``: ``v`` ``(seq, num_heads, head_dim)`` in ``v``'s dtype, ``s`` float32 ``(seq, num_heads)``.

    Raises:
        ValueError: a shape, dtype, device or stride that does not fit, or a bad ``impl`` (before
            any launch).
    """
    v = _check_values("v", v, 4, "(seq, num_states, num_heads, head_dim)")
    s = _check_lse("s", s, tuple(v.shape[:3]), "(seq, num_states, num_heads)", v.device)
    _check_impl(impl, v.device)
    seq, num_states, heads, head_dim = v.shape
    if num_states == 0:
        return (torch.zeros(seq, heads, head_dim, dtype=v.dtype, device=v.device),
                torch.full((seq, heads), _NEG_INF, dtype=torch.float32, device=v.device))
    if not _use_kernel(impl, (v, s)):
        return _merge_many_torch(v, s)
    out_v = torch.empty(seq, heads, head_dim, dtype=v.dtype, device=v.device)
    out_s = torch.empty(seq, heads, dtype=torch.float32, device=v.device)
    load_merge_kernel(v.dtype, v.device).launch("merge_states", v_a=v, s_a=s, v_b=None, s_b=None, v_out=out_v,
                                                s_out=out_s, mask=None, num_states=num_states)
    return out_v, out_s
