"""append_kv: write the new tokens' K and V into a paged KV cache, as engines do every step.

vLLM's ``reshape_and_cache_flash`` and FlashInfer's ``append_paged_kv_cache`` do this job; here it is
:func:`append_kv`, with vLLM's addressing (``slot_mapping[t] = page_id * page_size + offset``, ``-1``
skips a padded token) over every cache :func:`jitattn.paged_attention` reads: one tensor (NHD / HND)
or a ``(k_cache, v_cache)`` pair.

Two implementations with the same result (bit for bit):

- a torch path (advanced-index assignment on the cache's ``(page, offset)`` view) that runs on any
  device: the reference, and what CPU tensors use;
- for CUDA tensors, a small kernel (``templates/append_kv.cu.j2``: one block per token, 16-byte
  loads and stores (8-byte stores into an FP8 cache whose head_dim is a multiple of 8 only), FP8
  conversion in registers) that goes through jitattn's pipeline as the
  ``merge_state`` module does (:mod:`jitattn.append_kv_module`): cached by content, built by
  ``jitattn warmup --model``, shipped by ``jitattn cache export``.

:func:`append_latent_kv` is the same job for a latent (MLA) cache ``(num_pages, page_size,
kv_lora_rank + rope_dim)``: vLLM's ``concat_and_cache_mla``, FlashInfer's
``append_paged_mla_kv_cache``. Torch path only (it runs on CUDA tensors too).
"""

from __future__ import annotations

import math
import struct
from typing import Any, Callable

import torch

from jitattn import append_kv_module as _am
from jitattn.checks import check_scale, fail
from jitattn.planning import StructLayout
from jitattn.runtime import LoadedOnce, cuda_device, stream_handle
from jitattn.spec import AttentionSpec, kv_copy_bytes

__all__ = ["append_kv", "append_latent_kv"]

_SRC = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
_FP8 = torch.float8_e4m3fn
_IMPLS = ("auto", "torch", "cuda")



def _f32(x: float) -> float:
    """``x`` rounded to float32 (what the kernel and torch's float32 arithmetic see)."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def inverse_scale(scale: float) -> float:
    """``float32(1 / float32(scale))``: an FP8 cache holds ``x * inverse_scale(scale)`` saturated to
    e4m3 (a multiply, as torch's CUDA division by a scalar computes it)."""
    return _f32(1.0 / _f32(scale))


# ---- checks --------------------------------------------------------------------------------------
def _check_rows(name: str, t: Any) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        fail(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 3:
        fail(f"{name}: expected 3 dims (num_tokens, num_kv_heads, head_dim), got shape {tuple(t.shape)}")
    if t.dtype not in _SRC:
        fail(f"{name}: dtype {t.dtype} not supported; expected torch.float16 or torch.bfloat16")
    return t


def _cache_views(kv_cache: Any, kv_layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the cache, each ``(num_pages, page_size, num_kv_heads, head_dim)`` (views, any strides)."""
    if kv_layout not in ("NHD", "HND"):
        fail(f"kv_layout={kv_layout!r}: expected 'NHD' or 'HND'")
    dims = "(num_pages, page_size, num_kv_heads, head_dim)" if kv_layout == "NHD" else \
        "(num_pages, num_kv_heads, page_size, head_dim)"
    if isinstance(kv_cache, (tuple, list)):
        if len(kv_cache) != 2:
            fail(f"kv_cache: a pair is (k_cache, v_cache), got a {type(kv_cache).__name__} of {len(kv_cache)}")
        for name, t in zip(("k_cache", "v_cache"), kv_cache):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                fail(f"kv_cache ({name}): expected a 4-dim {kv_layout} tensor {dims}, got "
                      f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        k, v = kv_cache
        if k.shape != v.shape or k.dtype != v.dtype or k.device != v.device:
            fail(f"kv_cache: k_cache and v_cache must share shape, dtype and device, got {tuple(k.shape)} "
                  f"{k.dtype} {k.device} and {tuple(v.shape)} {v.dtype} {v.device}")
    else:
        if not isinstance(kv_cache, torch.Tensor) or kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
            latent = " (a 3-dim latent MLA cache takes append_latent_kv)" \
                if isinstance(kv_cache, torch.Tensor) and kv_cache.dim() == 3 else ""
            full = "(num_pages, 2, page_size, num_kv_heads, head_dim)" if kv_layout == "NHD" else \
                "(num_pages, 2, num_kv_heads, page_size, head_dim)"
            fail(f"kv_cache: expected a {kv_layout} tensor {full} or a (k_cache, v_cache) pair, got "
                  f"{tuple(kv_cache.shape) if isinstance(kv_cache, torch.Tensor) else type(kv_cache).__name__}{latent}")
        k, v = kv_cache[:, 0], kv_cache[:, 1]
    if kv_layout == "HND":
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    return k, v


def _check_not_expanded(name: str, t: torch.Tensor) -> None:
    """An ``expand()``ed cache (stride 0 in a dim of size > 1) shares memory between slots: one write would land
    in several."""
    if any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape)):
        fail(f"{name}: stride 0 in a dim of size > 1 (shape {tuple(t.shape)}, strides {t.stride()}): its slots "
             f"share memory; pass a cache of its own (e.g. torch.zeros, not expand)")


def _check_scale(name: str, value: Any, fp8: bool) -> float:
    """A write's scale: :func:`jitattn.checks.check_scale` (a positive finite float32), 1.0 for a 16-bit
    cache, and for an FP8 cache one whose float32 inverse (what the write multiplies by) is finite too."""
    value = check_scale(name, value)
    if not fp8 and value != 1.0:
        fail(f"{name}={value!r}: only an FP8 (float8_e4m3fn) cache is scaled; a 16-bit cache takes 1.0")
    if fp8 and 1.0 / _f32(value) > _F32_MAX:
        fail(f"{name}={value!r}: an FP8 cache stores x * float32(1 / {name}), and that inverse is beyond float32's "
             f"range; allowed: about 3e-39 .. 3.4e+38")
    return value


_F32_MAX = 3.4028234663852886e38  # float32's largest finite value


def _check_slots(slot_mapping: Any, rows: torch.Tensor, rows_name: str, num_pages: int, page_size: int) -> None:
    """``slot_mapping`` int64 ``(num_tokens,)`` beside ``rows``; on the CPU also its values (-1 or a slot)."""
    if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dtype != torch.int64 or slot_mapping.dim() != 1:
        fail(f"slot_mapping: expected an int64 (num_tokens,) tensor, got "
              f"{(slot_mapping.dtype, tuple(slot_mapping.shape)) if isinstance(slot_mapping, torch.Tensor) else type(slot_mapping).__name__}")
    if slot_mapping.shape[0] != rows.shape[0]:
        fail(f"slot_mapping: {slot_mapping.shape[0]} slots for {rows.shape[0]} tokens of {rows_name}")
    if slot_mapping.device != rows.device:
        fail(f"slot_mapping: on {slot_mapping.device}, but {rows_name} is on {rows.device}")
    if slot_mapping.device.type == "cpu":  # cheap here; on a GPU it would sync
        _check_slot_values(slot_mapping, num_pages, page_size)


def _check_slot_values(slot_mapping: torch.Tensor, num_pages: int, page_size: int) -> None:
    """Every slot is -1 or one of the cache's ``num_pages * page_size`` (reads the values: CPU tensors only)."""
    num_slots = num_pages * page_size
    if slot_mapping.numel():
        lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
        if lo < -1 or hi >= num_slots:
            fail(f"slot_mapping: values in [{lo}, {hi}]; allowed: -1 (skip) or 0 .. {num_slots - 1} "
                  f"(num_pages * page_size = {num_pages} * {page_size})")


def check_append(k: Any, v: Any, kv_cache: Any, slot_mapping: Any, kv_layout: str, k_scale: Any, v_scale: Any
                 ) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """The checks of :func:`append_kv` (no device sync). Returns the cache's K and V ``(page, offset,
    head, dim)`` views and the two scales."""
    k = _check_rows("k", k)
    v = _check_rows("v", v)
    if v.shape != k.shape or v.dtype != k.dtype or v.device != k.device:
        fail(f"v: shape {tuple(v.shape)}, {v.dtype} on {v.device}; must equal k's {tuple(k.shape)}, {k.dtype} "
              f"on {k.device}")
    kc, vc = _cache_views(kv_cache, kv_layout)
    if kc.dtype not in (k.dtype, _FP8):
        fail(f"kv_cache: dtype {kc.dtype}; a cache for {k.dtype} K/V is {k.dtype} or torch.float8_e4m3fn")
    if kc.device != k.device:
        fail(f"kv_cache: on {kc.device}, but k is on {k.device}; all tensors must be on one device")
    _check_not_expanded("kv_cache (k_cache)", kc)
    _check_not_expanded("kv_cache (v_cache)", vc)
    if tuple(kc.shape[2:]) != tuple(k.shape[1:]):
        fail(f"kv_cache: {kc.shape[2]} heads of dim {kc.shape[3]} ({kv_layout}), but k has {k.shape[1]} of "
              f"dim {k.shape[2]}")
    _check_slots(slot_mapping, k, "k", kc.shape[0], kc.shape[1])
    fp8 = kc.dtype == _FP8
    return kc, vc, _check_scale("k_scale", k_scale, fp8), _check_scale("v_scale", v_scale, fp8)


# ---- the torch path ------------------------------------------------------------------------------
def _to_cache(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    if dtype != _FP8:
        return x
    return (x.float() * inverse_scale(scale)).clamp_(-_am.E4M3_MAX, _am.E4M3_MAX).to(_FP8)


def _append_torch(k, v, kc, vc, slot_mapping, k_scale, v_scale) -> None:
    keep = (slot_mapping >= 0) & (slot_mapping < kc.shape[0] * kc.shape[1])
    if not bool(keep.all()):  # a device sync on a GPU: the kernel path has none
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    page, offset = slot_mapping // kc.shape[1], slot_mapping % kc.shape[1]
    kc[page, offset] = _to_cache(k, kc.dtype, k_scale)
    vc[page, offset] = _to_cache(v, vc.dtype, v_scale)


# ---- the CUDA kernel -----------------------------------------------------------------------------
def cache_store_bytes(kv_dtype: torch.dtype, head_dim: int) -> int:
    """Bytes per store of the kernel into the cache: the attention kernels' copy of a row
    (:func:`jitattn.spec.kv_copy_bytes`: 16, or 8 for an FP8 cache whose head_dim is a multiple of 8 only)."""
    return kv_copy_bytes(head_dim, str(kv_dtype).removeprefix("torch."))


def kernel_reasons(k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor) -> list[str]:
    """Why the kernel cannot take these tensors (empty: it can): it reads whole 16-byte chunks of k / v and
    stores whole chunks of the cache (:func:`cache_store_bytes`)."""
    store = cache_store_bytes(kc.dtype, k.shape[2])
    vec = store // kc.element_size()
    out = []
    if k.device.type != "cuda":
        out.append(f"the tensors are on {k.device}; the kernel needs CUDA tensors")
    if k.shape[2] % vec:
        out.append(f"head_dim={k.shape[2]} is not a multiple of {vec} (one {store}-byte store of the cache)")
    for name, t, align in (("k", k, 16), ("v", v, 16), ("k_cache", kc, store), ("v_cache", vc, store)):
        step = align // t.element_size()
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            out.append(f"{name}: head_dim is not contiguous (strides {t.stride()})")
        if t.data_ptr() % align or any(s % step for s, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1):
            out.append(f"{name}: rows are not {align}-byte aligned (data_ptr % {align} = {t.data_ptr() % align}, "
                       f"strides {t.stride()})")
    return out


class AppendKvKernel:
    """The append_kv kernel of one (K/V dtype, cache dtype) pair, loaded on one CUDA device.

    ``layout``: the ``AppendKvParams`` bytes (:class:`jitattn.planning.StructLayout`);
    :meth:`launch_params` launches packed bytes.

    Raises:
        MissingKernelError: not cached under JITATTN_DISABLE_JIT=1 (names the warm-up command).
        jitattn.build.CompileError / BuildError: nvcc failed or cannot run.
        RuntimeError: the cubin's Params size differs from the host's (a stale entry).
    """

    def __init__(self, module: _am.AppendKvModule, device: torch.device):
        from jitattn.runtime import CubinModule, select_entry

        self.entry = select_entry(module, torch.cuda.get_device_capability(device))
        cubin = CubinModule(str(self.entry.cubin), device.index, {"append_kv": _am.KERNEL_NAMES["append_kv"]},
                            sha256=self.entry.manifest["artifacts"].get(self.entry.cubin.name))
        raw = cubin.read_global_int32(_am.KERNEL_NAMES["geometry"], len(_am.GEOMETRY))
        self._setup(module, device, cubin, dict(zip(_am.GEOMETRY, raw)), stream_handle(device))
        if self.geometry["params_size"] != self.layout.size or self.geometry["threads"] != _am.THREADS:
            raise RuntimeError(f"{self.entry.cubin}: geometry {self.geometry} does not match the host (Params "
                               f"{self.layout.size} bytes, {_am.THREADS} threads); the cache entry is stale: "
                               f"`jitattn cache prune` and warm up again")

    @classmethod
    def from_module(cls, module: _am.AppendKvModule, launcher: Any, *, device: torch.device,
                    stream_handle: Callable[[], int]) -> "AppendKvKernel":
        """A kernel over any ``launcher`` with ``launch(kernel, grid, block, smem, params, stream)``: the
        launch boundary, injectable (the CPU tests and tools/host_cost_cpu.py record or drop launches).
        ``stream_handle()``: the raw handle of the stream to launch on."""
        kernel = object.__new__(cls)
        kernel.entry = None
        geometry = {"threads": _am.THREADS, "params_size": StructLayout(module.fields).size,
                    "vec_elems": module.vec_elems}
        kernel._setup(module, torch.device(device), launcher, geometry, stream_handle)
        return kernel

    def _setup(self, module: _am.AppendKvModule, device: torch.device, launcher: Any, geometry: dict[str, int],
               stream_handle: Callable[[], int]) -> None:
        self.module_spec, self.device, self._module, self.geometry = module, device, launcher, geometry
        self.layout = StructLayout(module.fields)
        self.stream_handle = stream_handle

    def launch_params(self, params: bytes | bytearray, num_tokens: int) -> None:
        """One launch of packed ``AppendKvParams`` bytes (one block per token) on torch's current stream."""
        # bytes: the launch boundary's type (a module's launch takes bytes; the CPU recorders assert it)
        self._module.launch("append_kv", (num_tokens, 1, 1), _am.THREADS, 0, bytes(params), self.stream_handle())


def launch_fields(k, v, kc, vc, slot_mapping, k_scale: float, v_scale: float) -> dict[str, Any]:
    """The ``AppendKvParams`` values by field name (``kc`` / ``vc``: ``(page, offset, head, dim)`` views)."""
    return {
        "k": k.data_ptr(), "v": v.data_ptr(), "k_cache": kc.data_ptr(), "v_cache": vc.data_ptr(),
        "slot_mapping": slot_mapping.data_ptr(),
        "k_stride_token": k.stride(0), "k_stride_head": k.stride(1),
        "v_stride_token": v.stride(0), "v_stride_head": v.stride(1),
        "k_cache_stride_page": kc.stride(0), "k_cache_stride_slot": kc.stride(1), "k_cache_stride_head": kc.stride(2),
        "v_cache_stride_page": vc.stride(0), "v_cache_stride_slot": vc.stride(1), "v_cache_stride_head": vc.stride(2),
        "num_slots": kc.shape[0] * kc.shape[1], "num_tokens": k.shape[0], "num_heads": k.shape[1],
        "head_dim": k.shape[2], "page_size": kc.shape[1],
        "k_inv_scale": inverse_scale(k_scale), "v_inv_scale": inverse_scale(v_scale),
    }


_KERNELS = LoadedOnce()


def load_append_kv_kernel(dtype: torch.dtype | str, kv_dtype: torch.dtype | str,
                          device: torch.device | str | int | None = None) -> AppendKvKernel:
    """The :class:`AppendKvKernel` for ``dtype`` K/V into a ``kv_dtype`` cache on a CUDA ``device``
    (loaded once per process, then reused).

    Raises:
        ValueError: unsupported dtypes or a non-CUDA device. MissingKernelError: not cached and
            JITATTN_DISABLE_JIT=1.
    """
    module = _am.AppendKvModule(str(dtype), str(kv_dtype))
    dev = cuda_device(device)
    return _KERNELS.get((module, dev.index), lambda: AppendKvKernel(module, dev))


# ---- the per-layout launch memo ------------------------------------------------------------------
#: The ``AppendKvParams`` fields a call of a memoised layout writes, in the order it gives their values.
CALL_FIELDS = ("k", "v", "k_cache", "v_cache", "slot_mapping", "num_tokens")
#: Layouts remembered at once (an engine has a few: one per cache shape and K/V packing); the oldest goes first.
MEMO_SIZE = 32


class _LayoutLaunch:
    """What every kernel launch of one layout (:func:`_layout_key`) shares, made by its first call after the
    full checks: the kernel, the ``AppendKvParams`` bytes packed but for :data:`CALL_FIELDS`, their
    writers, and where K and V start in a one-tensor cache. Holds no tensor (nor a reference to one)."""

    __slots__ = ("kernel", "params", "writers", "pair", "k_offset", "v_offset", "slots_contiguous", "cpu_slots",
                 "num_pages", "page_size", "cache_misalign")

    def __init__(self, kernel: AppendKvKernel, params: bytes | bytearray, kv_cache: Any, kc: torch.Tensor,
                 vc: torch.Tensor, slot_mapping: torch.Tensor):
        self.kernel = kernel
        self.params = bytes(params)  # the first call's; each later call patches a copy
        self.writers = kernel.layout.writers(CALL_FIELDS)
        self.pair = type(kv_cache) is not torch.Tensor
        base = 0 if self.pair else kv_cache.data_ptr()  # a pair's K and V are its own tensors' first elements
        self.k_offset, self.v_offset = kc.data_ptr() - base, vc.data_ptr() - base
        self.slots_contiguous = slot_mapping.is_contiguous()  # the layout fixes it (its stride; 1 token or more)
        self.cpu_slots = slot_mapping.device.type == "cpu"  # values are checked there (the CPU tests' fake kernel)
        self.num_pages, self.page_size = kc.shape[0], kc.shape[1]
        self.cache_misalign = cache_store_bytes(kc.dtype, kc.shape[-1]) - 1  # the cache's address bits that must be 0

    def __call__(self, k: torch.Tensor, v: torch.Tensor, kv_cache: Any, slot_mapping: torch.Tensor) -> bool:
        """Launch on these tensors of the layout, after the checks that a call can fail while its layout
        passes (token counts, aligned data pointers: k / v 16-byte, the cache :func:`cache_store_bytes`).
        False, with nothing launched, when one fails: the full checks then name it."""
        n = k.shape[0]
        if v.shape[0] != n or slot_mapping.shape[0] != n:
            return False
        if self.pair:
            kc, vc = kv_cache[0].data_ptr(), kv_cache[1].data_ptr()
        else:
            base = kv_cache.data_ptr()
            kc, vc = base + self.k_offset, base + self.v_offset
        kp, vp = k.data_ptr(), v.data_ptr()
        if (kp | vp) & 15 or (kc | vc) & self.cache_misalign:
            return False
        if self.cpu_slots:
            _check_slot_values(slot_mapping, self.num_pages, self.page_size)
        slots = slot_mapping if self.slots_contiguous else slot_mapping.contiguous()
        values = (kp, vp, kc, vc, slots.data_ptr(), n)
        buf = bytearray(self.params)  # a copy per call: calls from two threads never mix their fields
        for write, offset, pick in self.writers:
            write(buf, offset, *pick(values))
        self.kernel.launch_params(buf, n)
        return True


_LAUNCHES: dict[tuple, _LayoutLaunch] = {}


def clear_launch_memo() -> None:
    """Forget every memoised layout (the next call of each runs the full checks again)."""
    _LAUNCHES.clear()


def _layout_key(k: Any, v: Any, kv_cache: Any, slot_mapping: Any, k_scale: Any, v_scale: Any, kv_layout: Any,
                impl: Any) -> tuple | None:
    """What the full checks, :func:`kernel_reasons` and the packed fields read but the pointers and the
    token count: shapes, strides, dtypes, devices, the cache's form, the scales, ``kv_layout``, ``impl``, and
    whether there are 0, 1 or more tokens (a dim of size 1 has its stride unchecked). None for a call the
    memo does not take: only exact tensors (a one-tensor cache or a tuple / list pair), float scales and
    str ``kv_layout`` / ``impl`` (a bool scale equals 1.0 but is refused; an unhashable one cannot be a key)."""
    tensor = torch.Tensor
    if not (type(k) is tensor and type(v) is tensor and type(slot_mapping) is tensor and type(k_scale) is float
            and type(v_scale) is float and type(kv_layout) is str and type(impl) is str):
        return None
    shape = k.shape
    if len(shape) != 3:
        return None
    if type(kv_cache) is tensor:
        cache = (kv_cache.shape, kv_cache.stride(), kv_cache.dtype, kv_cache.device)
    elif type(kv_cache) in (tuple, list) and len(kv_cache) == 2:
        kc, vc = kv_cache
        if type(kc) is not tensor or type(vc) is not tensor:
            return None
        cache = (kc.shape, kc.stride(), kc.dtype, kc.device, vc.shape, vc.stride(), vc.dtype, vc.device)
    else:
        return None
    return (shape[1:], min(shape[0], 2), k.stride(), k.dtype, k.device, v.shape[1:], v.stride(), v.dtype, v.device,
            cache, slot_mapping.dtype, slot_mapping.stride(), slot_mapping.device, k_scale, v_scale, kv_layout, impl)


def _remember(key: tuple, launch: _LayoutLaunch) -> None:
    if len(_LAUNCHES) >= MEMO_SIZE:
        _LAUNCHES.pop(next(iter(_LAUNCHES), None), None)  # the oldest (another thread may have taken it)
    _LAUNCHES[key] = launch


# ---- the entry point -----------------------------------------------------------------------------
def append_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: Any, slot_mapping: torch.Tensor, *,
              k_scale: float = 1.0, v_scale: float = 1.0, kv_layout: str = "NHD", impl: str = "auto") -> None:
    """Write new tokens' K and V into a paged cache, in place: token ``t`` goes to page
    ``slot_mapping[t] // page_size``, offset ``slot_mapping[t] % page_size``.

    Args:
        k, v: ``(num_tokens, num_kv_heads, head_dim)``, float16 or bfloat16, one shape, dtype and device
            (any strides; the CUDA kernel wants head_dim contiguous and 16-byte aligned rows).
        kv_cache: what :func:`jitattn.paged_attention` reads: one tensor, NHD ``(num_pages, 2,
            page_size, num_kv_heads, head_dim)`` or HND ``(num_pages, 2, num_kv_heads, page_size,
            head_dim)``, or a ``(k_cache, v_cache)`` pair of ``(num_pages, page_size, num_kv_heads,
            head_dim)`` (NHD) / ``(num_pages, num_kv_heads, page_size, head_dim)`` (HND) tensors; of
            k's dtype or ``torch.float8_e4m3fn``.
        slot_mapping: int64 ``(num_tokens,)``, ``page_id * page_size + offset`` (vLLM's); ``-1`` skips a
            token (padding). Two tokens with one slot: which one lands is unspecified.
        k_scale, v_scale: an FP8 cache holds ``K * float32(1 / k_scale)`` (and V likewise) computed in
            fp32, rounded to nearest e4m3 and saturated to +-448 (NaN stays NaN); Python floats
            (no device sync); 1.0 for a 16-bit cache.
        kv_layout: ``"NHD"`` or ``"HND"``: the cache's layout (the spec's ``kv_layout``).
        impl: ``"auto"`` (the CUDA kernel for CUDA tensors it can take, else torch), ``"torch"`` or
            ``"cuda"``.

    What is checked, before any write: every shape, dtype and device; the scales; for CPU tensors the
    slot range (``-1`` or ``0 .. num_pages * page_size - 1``). Not checked for CUDA tensors (it would
    be a device sync): the slot values; there the kernel skips any slot below 0 or past the cache, and
    the torch path drops them (with a sync).

    The kernel path remembers each layout it launched (shapes, strides, dtypes, devices, the cache's
    form, scales; :data:`MEMO_SIZE` of them, no tensors): a later call of that layout checks only
    what can differ (token counts, aligned data pointers) and writes only the pointers and
    the token count into the packed ``AppendKvParams``, as :meth:`jitattn.Plan.run` does per layer.

    Raises:
        ValueError: naming the argument, what was given and what is allowed; with ``impl="cuda"``,
            also tensors the kernel cannot take (naming why).
    """
    compiling = impl == "auto" and torch.compiler.is_compiling()  # torch.compile traces the torch path
    key = None if compiling else _layout_key(k, v, kv_cache, slot_mapping, k_scale, v_scale, kv_layout, impl)
    if key is not None:
        launch = _LAUNCHES.get(key)
        if launch is not None and launch(k, v, kv_cache, slot_mapping):
            return
    kc, vc, k_scale, v_scale = check_append(k, v, kv_cache, slot_mapping, kv_layout, k_scale, v_scale)
    if impl not in _IMPLS:
        fail(f"impl={impl!r}: expected one of {_IMPLS}")
    if k.shape[0] == 0:
        return
    reasons = kernel_reasons(k, v, kc, vc) if impl != "torch" else ["impl='torch'"]
    if impl == "cuda" and reasons:
        fail("impl='cuda': the kernel cannot take these tensors: " + "; ".join(reasons))
    if reasons or compiling:
        _append_torch(k, v, kc, vc, slot_mapping, k_scale, v_scale)
        return
    kernel = load_append_kv_kernel(_SRC[k.dtype], str(kc.dtype).removeprefix("torch."), k.device)
    slots = slot_mapping.contiguous()
    params = kernel.layout.pack(launch_fields(k, v, kc, vc, slots, k_scale, v_scale))
    if key is not None:
        _remember(key, _LayoutLaunch(kernel, params, kv_cache, kc, vc, slot_mapping))
    kernel.launch_params(params, k.shape[0])


# ---- the latent (MLA) cache ----------------------------------------------------------------------
def check_append_latent(c_kv: Any, k_pe: Any, latent_cache: Any, slot_mapping: Any, k_scale: Any,
                        spec: AttentionSpec | None = None) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The checks of :func:`append_latent_kv` (no device sync). Returns the cache's c_kv and k_pe views
    ``(num_pages, page_size, kv_lora_rank / rope_dim)`` and the scale."""
    for name, t in (("c_kv", c_kv), ("k_pe", k_pe)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype not in _SRC:
            fail(f"{name}: expected a float16 or bfloat16 (num_tokens, dim) tensor, got "
                 f"{(t.dtype, tuple(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if k_pe.shape[0] != c_kv.shape[0] or k_pe.dtype != c_kv.dtype or k_pe.device != c_kv.device:
        fail(f"k_pe: {k_pe.shape[0]} tokens, {k_pe.dtype} on {k_pe.device}; must match c_kv's {c_kv.shape[0]}, "
             f"{c_kv.dtype} on {c_kv.device}")
    if spec is not None:
        _check_latent_against_spec(c_kv, k_pe, latent_cache, spec)
    rank, width = c_kv.shape[1], c_kv.shape[1] + k_pe.shape[1]
    if not isinstance(latent_cache, torch.Tensor) or latent_cache.dim() != 3 or latent_cache.shape[2] != width:
        got = tuple(latent_cache.shape) if isinstance(latent_cache, torch.Tensor) else type(latent_cache).__name__
        fail(f"latent_cache: expected (num_pages, page_size, {width}) (kv_lora_rank {rank} + rope dim "
             f"{k_pe.shape[1]}), got {got}")
    if latent_cache.dtype not in (c_kv.dtype, _FP8):
        fail(f"latent_cache: dtype {latent_cache.dtype}; a cache for {c_kv.dtype} rows is {c_kv.dtype} or "
             f"torch.float8_e4m3fn")
    if latent_cache.device != c_kv.device:
        fail(f"latent_cache: on {latent_cache.device}, but c_kv is on {c_kv.device}; all tensors must be on one device")
    _check_not_expanded("latent_cache", latent_cache)
    _check_slots(slot_mapping, c_kv, "c_kv", latent_cache.shape[0], latent_cache.shape[1])
    scale = _check_scale("k_scale", k_scale, latent_cache.dtype == _FP8)
    return latent_cache[..., :rank], latent_cache[..., rank:], scale


def _check_latent_against_spec(c_kv: torch.Tensor, k_pe: torch.Tensor, latent_cache: Any, spec: Any) -> None:
    """Each part's width, and the cache's page size and dtype, against the latent spec that reads them:
    only these tell a c_kv / k_pe split of 448 / 128 from 512 / 64 in a 576-wide row."""
    if not isinstance(spec, AttentionSpec) or not spec.latent:
        fail(f"spec: expected the latent AttentionSpec (kv_storage='latent') that reads the cache, got "
             f"{spec.describe() if isinstance(spec, AttentionSpec) else type(spec).__name__}")
    rope = spec.head_dim_qk - spec.head_dim_vo
    if c_kv.shape[1] != spec.head_dim_vo:
        fail(f"c_kv: width {c_kv.shape[1]}, but the spec's kv_lora_rank (head_dim_vo) is {spec.head_dim_vo}")
    if k_pe.shape[1] != rope:
        fail(f"k_pe: width {k_pe.shape[1]}, but the spec's qk_rope_head_dim (head_dim_qk - head_dim_vo) is {rope}")
    if _SRC[c_kv.dtype] != spec.q_dtype:
        fail(f"c_kv: dtype {c_kv.dtype}, but the spec's q_dtype is {spec.q_dtype}")
    if isinstance(latent_cache, torch.Tensor) and latent_cache.dim() == 3:
        if latent_cache.shape[1] != spec.page_size:
            fail(f"latent_cache: page size {latent_cache.shape[1]} (dim 1), but the spec's page_size is "
                 f"{spec.page_size}")
        if str(latent_cache.dtype).removeprefix("torch.") != spec.kv_dtype:
            fail(f"latent_cache: dtype {latent_cache.dtype}, but the spec's kv_dtype is {spec.kv_dtype}")


def append_latent_kv(c_kv: torch.Tensor, k_pe: torch.Tensor, latent_cache: torch.Tensor, slot_mapping: torch.Tensor,
                     *, k_scale: float = 1.0, spec: AttentionSpec | None = None) -> None:
    """Write new tokens' latent rows into a latent (MLA) cache, in place: token ``t``'s row ``[c_kv[t],
    k_pe[t]]`` goes to page ``slot_mapping[t] // page_size``, offset ``slot_mapping[t] % page_size``
    (vLLM's ``concat_and_cache_mla``, FlashInfer's ``append_paged_mla_kv_cache``).

    Args:
        c_kv: ``(num_tokens, kv_lora_rank)``, the compressed latent (after its norm), float16 or bfloat16.
        k_pe: ``(num_tokens, rope_dim)``, the shared rotary key (after RoPE), c_kv's dtype and device.
        latent_cache: what a latent spec reads (:class:`~jitattn.spec.AttentionSpec` with
            ``kv_storage="latent"``): ``(num_pages, page_size, kv_lora_rank + rope_dim)`` of c_kv's dtype
            or ``torch.float8_e4m3fn``.
        slot_mapping: int64 ``(num_tokens,)``, ``page_id * page_size + offset``; ``-1`` skips a token.
        k_scale: an FP8 cache holds ``x * float32(1 / k_scale)`` rounded to nearest e4m3 and saturated to
            +-448, as :func:`append_kv` writes K; a Python float; 1.0 for a 16-bit cache.
        spec: the latent spec that reads the cache (optional): c_kv's width must be its ``head_dim_vo``
            (kv_lora_rank, 512 for DeepSeek), k_pe's ``head_dim_qk - head_dim_vo`` (qk_rope_head_dim,
            64), c_kv's dtype its ``q_dtype``, the cache's page size and dtype its ``page_size`` and
            ``kv_dtype``. Without it only the sum of the two widths is checked (against the cache's
            last dim): where c_kv ends and k_pe begins is then the caller's to get right.

    Torch only (advanced-index assignment, any device; on a GPU, slots out of range are dropped with a
    device sync). What is checked, before any write: shapes, dtypes, devices, the scale, ``spec`` if
    given, and for CPU tensors the slot range.

    Raises:
        ValueError: naming the argument, what was given and what is allowed.
    """
    ckv_cache, kpe_cache, k_scale = check_append_latent(c_kv, k_pe, latent_cache, slot_mapping, k_scale, spec)
    if c_kv.shape[0]:  # the row's two parts are views of one cache: the K/V path writes each
        _append_torch(c_kv, k_pe, ckv_cache, kpe_cache, slot_mapping, k_scale, k_scale)
