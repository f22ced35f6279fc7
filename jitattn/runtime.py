"""Runtime: load a spec's cubin and launch its kernels on torch's current stream.

No C++ extension and no torch ABI coupling: the cubin is loaded through the CUDA driver API
(``cuModuleLoadData``, bound with ctypes in :mod:`jitattn.cuda_driver`) into the primary context
torch uses, the kernel arguments travel as one packed struct (layout from :mod:`jitattn.render`), and launches go to ``torch.cuda.current_stream()``'s raw handle, so they
order with torch's own work and can be captured in CUDA graphs. Launch geometry (block sizes, shared memory,
tile shapes) is read from the cubin itself, never re-derived in Python.

One call of :meth:`JitKernel.paged_attention` serves a mixed batch: sequences that bring one query
go to the decode kernel (split-KV when the batch cannot fill the GPU), the rest to the prefill
kernel, from the same ``query_start_loc`` / ``seq_lens`` metadata. The two kernels write disjoint
rows, so the decode kernel runs on a side stream forked from the caller's and joined back before the
call returns: the prefill blocks take each SM the memory-bound decode leaves instead of waiting for
its last wave. A ragged spec
(``kv_storage="ragged"``) has only the prefill kernel: :meth:`JitKernel.ragged_attention` launches
it once for every row of the batch, one-query rows included.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import struct
import threading
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from jitattn import cuda_driver
from jitattn.build import archs_for_capability
from jitattn.cache import CacheEntry, KernelCache
from jitattn.checks import (check_flag, check_max_query_len, check_metadata_values, check_paged_call,
                            check_position_values, check_positions, check_ragged_call, check_ragged_metadata_values,
                            check_scales)
from jitattn.reference import default_alibi_slopes, torch_dtype
from jitattn.render import KERNEL_NAMES, params_fields, params_layout
from jitattn.spec import AttentionSpec

_GEOMETRY = ("decode_threads", "decode_smem", "decode_tile_keys", "prefill_threads", "prefill_smem",
             "prefill_block_m", "prefill_block_n", "params_size")
MAX_SPLITS = 64  # kMaxSplits in templates/decode.cuh
_DEFAULT_SMEM_LIMIT = 48 * 1024
# A call that may hold prefill rows runs its decode kernel on a side stream beside the prefill kernel
# (JitKernel.mixed_on_two_streams; False: both on the caller's stream, one after the other).
MIXED_ON_TWO_STREAMS = True


_STRUCT_CODE = {"ptr": "Q", "i64": "q", "i32": "i", "f32": "f"}


def params_packer(spec: AttentionSpec) -> tuple[struct.Struct, tuple[str, ...]]:
    """A ``struct.Struct`` that packs the ``Params`` fields (in their order) into the kernel's bytes."""
    placed, size = params_layout(params_fields(spec))
    fmt, pos = "<", 0
    for f, off in placed:
        fmt += "x" * (off - pos) + _STRUCT_CODE[f.kind]
        pos = off + f.size
    fmt += "x" * (size - pos)
    return struct.Struct(fmt), tuple(f.name for f, _ in placed)


def select_entry(spec: AttentionSpec, capability: tuple[int, int], cache: KernelCache | None = None) -> CacheEntry:
    """The cache entry to run on a device of this compute capability, compiling it if allowed.

    Takes the best cached arch that runs on the device (``KernelCache.find``: on a node without
    nvcc, any nvcc's build of the same source); on a miss builds the best arch.

    Raises:
        RuntimeError: no known arch runs on this capability.
        MissingKernelError: nothing cached and JITATTN_DISABLE_JIT=1.
    """
    archs = archs_for_capability(*capability)
    if not archs:
        raise RuntimeError(f"jitattn builds no arch that runs on compute capability {capability}")
    cache = cache or KernelCache()
    for arch in archs:
        entry = cache.find(spec, arch)
        if entry is not None:
            return entry
    return cache.get_or_build(spec, archs[0])[0]


_thread_state = threading.local()


class _DeviceArray:
    """A device buffer described by ``__cuda_array_interface__`` (v3), for ``torch.as_tensor``."""

    def __init__(self, ptr: int, count: int, typestr: str):
        self.__cuda_array_interface__ = {"shape": (count,), "typestr": typestr, "data": (ptr, False), "version": 3,
                                         "strides": None}


class CubinModule:
    """A cubin loaded into the device's primary context through the CUDA driver API (:mod:`jitattn.cuda_driver`).

    Launches pass the kernel's packed ``Params`` bytes straight to ``cuLaunchKernel``: no per-call
    argument conversion (CuPy's ``RawKernel`` call spent ~30 us per launch describing the
    structured dtype, measured on the H200 2026-11-29), and the stream is torch's raw handle.

    Args:
        path: the cubin file.
        device_index: the CUDA device to load it on.
        names: our kernel name -> the cubin's symbol name.
        sha256: the digest the cache verified; the bytes read are checked against it and then loaded,
            so a file swapped after verification is refused, never loaded.

    Raises:
        RuntimeError: the file's sha256 differs from ``sha256``.
        CudaDriverError: the driver refused the image (another arch, damaged) or a kernel is missing.
    """

    def __init__(self, path: str, device_index: int, names: Mapping[str, str], sha256: str | None = None):
        self._driver = cuda_driver.driver()
        self.device_index = device_index
        image = Path(path).read_bytes()
        if sha256 is not None and hashlib.sha256(image).hexdigest() != sha256:
            raise RuntimeError(f"{path}: changed after the cache verified it (sha256 differs); run "
                               f"`jitattn cache verify` and load again")
        prev = self._make_current()
        try:
            self._module = self._driver.module_load_data(image)
            self.functions = {k: self._driver.module_get_function(self._module, v) for k, v in names.items()}
        finally:
            self._restore(prev)

    def _make_current(self) -> int | None:
        """Make this device's primary context current on the calling thread; return the device to restore."""
        primed = getattr(_thread_state, "primed", None)
        if primed is None:
            primed = _thread_state.primed = set()
        current = torch.cuda.current_device()
        if self.device_index in primed and current == self.device_index:
            return None
        torch.cuda.set_device(self.device_index)  # creates and binds the primary context if needed
        primed.add(self.device_index)
        return current if current != self.device_index else None

    def _restore(self, prev: int | None) -> None:
        if prev is not None:
            torch.cuda.set_device(prev)

    def read_global_int32(self, name: str, count: int) -> list[int]:
        """``count`` int32 values of a ``__constant__`` / global array of the module (copied by torch).

        Raises:
            ValueError: the global holds fewer than ``count`` int32 values.
        """
        ptr, size = self._driver.module_get_global(self._module, name)
        if size < 4 * count:
            raise ValueError(f"module global {name} has {size} bytes, fewer than the {count} int32 values asked for")
        view = _DeviceArray(ptr, count, "<i4")
        return torch.as_tensor(view, device=torch.device("cuda", self.device_index)).cpu().tolist()

    def set_max_dynamic_smem(self, kernel: str, nbytes: int) -> None:
        """Allow ``kernel`` up to ``nbytes`` of dynamic shared memory (needed above 48 KiB)."""
        self._driver.func_set_attribute(self.functions[kernel],
                                        cuda_driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes)

    def blocks_per_sm(self, kernel: str, threads: int, smem: int) -> int:
        """Resident blocks per SM from the driver's occupancy calculator (registers, smem, threads)."""
        return max(1, self._driver.occupancy_max_active_blocks_per_multiprocessor(self.functions[kernel], threads,
                                                                                   smem))

    def launch(self, kernel: str, grid: tuple[int, int, int], block: int, smem: int, params: bytes,
               stream: int) -> None:
        """``cuLaunchKernel`` with one by-value struct argument (the driver copies it before returning)."""
        prev = self._make_current()
        try:
            self._driver.launch_kernel(self.functions[kernel], grid, (block, 1, 1), smem, stream, params)
        finally:
            self._restore(prev)


def choose_num_splits(blocks: int, slots: int, max_useful: int, *, min_wave_fill: float = 0.9) -> int:
    """Split-KV factor (FlashDecoding; Dao et al. 2023): the smallest that fills whole waves.

    ``blocks`` = batch x num_kv_heads decode blocks; ``slots`` = SMs x resident blocks per SM (the
    driver's occupancy); each sequence's keys are split into ``s`` blocks, merged by log-sum-exp.
    The smallest ``s`` with at least one full wave (``blocks * s >= slots``) whose waves are at least
    ``min_wave_fill`` full (the last, partial wave idles the rest of the GPU), capped by
    ``max_useful`` (>= 4 tiles per split) and MAX_SPLITS. Fewer splits mean longer blocks (less
    prologue, no merge kernel at s = 1). Rule fitted to tests/tune_decode_splits.py on the H200,
    2026-11-29: 64 x 4096 hd128 (512 blocks, 264 slots) best at 1 (the old ">= 4 waves" rule took 3,
    4 % slower); 1 x 32768 (8 blocks) best at 33, one exact wave (the old rule took 64, 31 % slower);
    Gemma-2 64 x 8192 on the CUDA-core decode (512 blocks, 396 slots) best at 2-3.
    """
    cap = max(1, min(max_useful, MAX_SPLITS))
    s = min(max(1, math.ceil(slots / max(blocks, 1))), cap)
    while s < cap:
        waves = math.ceil(blocks * s / slots)
        if blocks * s / (waves * slots) >= min_wave_fill:
            break
        s += 1
    return s


def _capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _validating(validate: Any) -> bool:
    """``validate`` checked (a bool), and refused under CUDA graph capture, which forbids its host reads.

    Raises:
        ValueError: not a bool; True while the current stream captures a graph.
    """
    if check_flag("validate", validate) and _capturing():
        raise ValueError("validate=True: the metadata checks read the values on the host (a device sync), which "
                         "CUDA graph capture does not allow; check the batch outside the capture and pass "
                         "validate=False inside it")
    return bool(validate)


class JitKernel:
    """The compiled kernels of one spec, loaded on one CUDA device.

    Args:
        spec: the variant.
        device: a CUDA device (default: the current one).

    Raises:
        MissingKernelError: not cached under JITATTN_DISABLE_JIT=1.
        jitattn.build.CompileError: nvcc rejected the rendered source.
        OSError: no CUDA driver library (:mod:`jitattn.cuda_driver`).
    """

    def __init__(self, spec: AttentionSpec, device: torch.device | str | int | None = None):
        self.spec = spec
        self.device = _cuda_device(device)
        self.entry = select_entry(spec, torch.cuda.get_device_capability(self.device))
        # A ragged spec's module holds only the prefill kernel (attention.cu.j2 builds no decode for it).
        wanted = ("decode", "prefill") if spec.has_decode else ("prefill",)
        kernels = {k: v for k, v in KERNEL_NAMES.items() if k in wanted}
        self._module = CubinModule(str(self.entry.cubin), self.device.index, kernels,
                                   sha256=self.entry.manifest["artifacts"].get(self.entry.cubin.name))
        raw = self._module.read_global_int32(KERNEL_NAMES["geometry"], len(_GEOMETRY))
        self.geometry = dict(zip(_GEOMETRY, raw))
        self._packer, self._field_order = params_packer(spec)
        if self.geometry["params_size"] != self._packer.size:
            raise RuntimeError(f"{self.entry.cubin}: Params is {self.geometry['params_size']} bytes in the cubin but "
                               f"{self._packer.size} on the host; the cache entry is stale: `jitattn cache clear --yes` "
                               f"(or `jitattn cache prune`) and warm up again")
        for name in ("decode", "prefill"):
            smem = self.geometry[f"{name}_smem"]
            if name in kernels and smem > _DEFAULT_SMEM_LIMIT:
                self._module.set_max_dynamic_smem(name, smem)
        self._num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self._decode_blocks_per_sm = 0 if not spec.has_decode else self._module.blocks_per_sm(
            "decode", self.geometry["decode_threads"], self.geometry["decode_smem"])
        self._default_slopes = default_alibi_slopes(spec, self.device) if spec.alibi else None
        self._split_counters: dict[int, torch.Tensor] = {}  # stream handle -> fused-merge counters
        self._retired_counters: list[torch.Tensor] = []  # outgrown buffers that captured graphs may still use
        self._unzeroed_counters: set[int] = set()  # streams whose buffer was made under capture, not yet zeroed
        self._side_streams: dict[int, torch.cuda.Stream] = {}  # caller's stream handle -> its decode stream
        self.mixed_on_two_streams = MIXED_ON_TWO_STREAMS

    def max_decode_keys(self, max_pages_per_seq: int) -> int:
        """Most keys one decode row can read: the page table's capacity, or the window if smaller."""
        keys = max_pages_per_seq * self.spec.page_size
        return min(keys, self.spec.window_left + 1) if self.spec.window_left >= 0 else keys

    def num_splits(self, batch: int, max_kv_len: int) -> int:
        """Split-KV factor of a decode launch (:func:`choose_num_splits` for this kernel's geometry).

        Depends only on shapes, so a captured CUDA graph stays valid for any sequence lengths.
        """
        blocks = batch * self.spec.num_kv_heads
        slots = self._num_sms * self._decode_blocks_per_sm
        max_useful = max(1, max_kv_len // (4 * self.geometry["decode_tile_keys"]))
        return choose_num_splits(blocks, slots, max_useful)

    def split_counters(self, pairs: int) -> torch.Tensor:
        """Zeroed int32 counters of the fused split-KV merge, at least one per (sequence, kv head).

        One buffer per stream (launches on one stream never overlap). The decode kernel's last split
        of each pair merges the partial states and resets that pair's counter, so the buffer is zero
        between launches and needs no memset per call (nor in a captured graph). A larger batch gets a
        larger buffer, but the smaller ones are kept alive: a CUDA graph captured earlier holds their
        address, and freeing them would let its replays count in memory that is no longer zeroed.
        (One graph replayed on two streams at once would share one buffer: not supported.)

        Under CUDA graph capture a new buffer's zero fill is only recorded into that graph: until the
        graph replays, the memory holds whatever it held. So such a buffer is zeroed again at its next
        use: eagerly (then it is known zero) or, in another capture, recorded into that graph too (a
        graph captured later may replay first).
        """
        stream = torch.cuda.current_stream(self.device).cuda_stream
        capturing = _capturing()
        buf = self._split_counters.get(stream)
        if buf is None or buf.numel() < pairs:
            if buf is not None:
                self._retired_counters.append(buf)
            buf = torch.zeros(max(pairs, 1024), dtype=torch.int32, device=self.device)
            self._split_counters[stream] = buf
            if capturing:
                self._unzeroed_counters.add(stream)
            else:
                self._unzeroed_counters.discard(stream)
        elif stream in self._unzeroed_counters:
            buf.zero_()
            if not capturing:
                self._unzeroed_counters.discard(stream)
        return buf

    def side_stream(self) -> torch.cuda.Stream:
        """The stream a mixed batch's decode kernel runs on beside the caller's (one per caller stream).

        High priority, so the decode blocks are dispatched before the prefill blocks waiting beside
        them; the prefill kernel then fills each SM the decode leaves (see ``paged_attention``).
        """
        main = torch.cuda.current_stream(self.device).cuda_stream
        side = self._side_streams.get(main)
        if side is None:
            side = torch.cuda.Stream(self.device, priority=-1)  # lower is higher
            self._side_streams[main] = side
        return side

    def _launch(self, name: str, grid: tuple[int, int, int], block: int, smem: int, args: bytes) -> None:
        stream = torch.cuda.current_stream(self.device).cuda_stream
        self._module.launch(name, grid, block, smem, args, stream)

    def _launch_prefill(self, total_q: int, batch: int, args: bytes) -> None:
        """The prefill kernel over ``total_q`` query rows of ``batch`` sequences: one block per (m-tile, kv
        head), the grid an upper bound on the tiles (each sequence may start a partial tile; blocks past
        the work exit at once, prefill_find_tile)."""
        g = self.geometry
        tiles = math.ceil(total_q * self.spec.group_size / g["prefill_block_m"]) + batch
        self._launch("prefill", (tiles, self.spec.num_kv_heads, 1), g["prefill_threads"], g["prefill_smem"], args)

    # ---- the call ---------------------------------------------------------------------------------
    def paged_attention(self, q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                        seq_lens: torch.Tensor, query_start_loc: torch.Tensor, *, sinks: torch.Tensor | None = None,
                        alibi_slopes: torch.Tensor | None = None, params: Mapping[str, Any] | None = None,
                        return_lse: bool = False, out: torch.Tensor | None = None, max_query_len: int | None = None,
                        validate: bool = False, k_scale: float = 1.0, v_scale: float = 1.0,
                        query_positions: torch.Tensor | None = None, functor_batch: torch.Tensor | None = None,
                        position_offset: torch.Tensor | None = None
                        ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attention over the paged KV cache; same contract as :func:`jitattn.reference.paged_attention`.

        Args:
            max_query_len: optional host-side hint; ``1`` promises a pure decode batch (only the decode
                kernel is launched; a sequence with another query count is then left unwritten).
            validate: also check the metadata values and the ``max_query_len`` promise (a device sync;
                not under graph capture).
            k_scale, v_scale: per-tensor dequantisation scales of an FP8 cache (Python floats, so no
                device sync; 1.0 for a 16-bit cache).
            out: optional preallocated output ``(total_q, num_qo_heads, head_dim_vo)``.
            query_positions, functor_batch, position_offset: int32 ``(total_q,)``, ``(total_q,)``,
                ``(batch,)``, required by a spec with ``query_positions="explicit"`` (semantics:
                :func:`jitattn.reference.paged_attention`); its prefill kernel then serves every row.

        Returns:
            ``out`` and, when ``return_lse``, lse float32 ``(total_q, num_qo_heads)`` (natural log).
            Rows whose sequence has invalid metadata (more queries than keys, more keys than its
            block_table row holds, a page id outside the cache) are NaN.

        Raises:
            ValueError: a tensor does not match the spec (before any launch).
        """
        spec = self.spec
        if spec.ragged:
            raise ValueError("spec.kv_storage='ragged': this kernel reads ragged K/V; call "
                             "ragged_attention(q, k, v, query_start_loc, kv_start_loc, ...)")
        params = dict(params or {})
        call = check_paged_call(spec, q, kv_cache, block_table, seq_lens, query_start_loc, sinks=sinks,
                                alibi_slopes=alibi_slopes, params=params, out=out, for_kernel=True)
        self._check_device(q)
        check_positions(spec, query_positions, functor_batch, position_offset, total_q=call.total_q,
                        batch=call.batch, device=q.device)
        max_query_len = check_max_query_len(max_query_len)
        if _validating(validate):
            check_metadata_values(spec, seq_lens, query_start_loc, block_table, call.num_pages, call.total_q)
            if spec.explicit_positions:
                check_position_values(functor_batch, spec, params)
            if max_query_len is not None:
                longest = int((query_start_loc[1:] - query_start_loc[:-1]).max()) if call.batch else 0
                if longest > max_query_len:
                    raise ValueError(f"max_query_len={max_query_len}: a sequence brings {longest} queries; "
                                     f"pass the longest query count (or None)")
        scales = check_scales(spec, k_scale, v_scale)  # 1.0 unless the cache is FP8
        total_q, batch = call.total_q, call.batch
        alibi_slopes, out, lse = self._outputs(q, total_q, alibi_slopes, return_lse, out)
        if total_q == 0:
            return (out, lse) if return_lse else out
        ptr = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
        fields = {
            "q": ptr(q), "kv_cache": ptr(kv_cache), "o": ptr(out), "lse": ptr(lse),
            "block_table": ptr(block_table), "seq_lens": ptr(seq_lens), "query_start_loc": ptr(query_start_loc),
            "sinks": ptr(sinks), "alibi_slopes": ptr(alibi_slopes),
            "q_stride_token": q.stride(0), "q_stride_head": q.stride(1),
            "kv_stride_page": kv_cache.stride(0), "kv_stride_kv": kv_cache.stride(1),
            "block_table_stride": block_table.stride(0), "batch_size": batch, "total_q": total_q,
            "num_pages": call.num_pages, "k_scale": scales[0], "v_scale": scales[1],
        }
        if spec.explicit_positions:  # the prefill kernel serves every row (no decode kernel is built)
            args = self._pack(params, {**fields, "query_positions": ptr(query_positions),
                                       "functor_batch": ptr(functor_batch), "position_offset": ptr(position_offset),
                                       "num_splits": 1, "prefill_skip_decode_rows": 0})
            self._launch_prefill(total_q, batch, args)
            return (out, lse) if return_lse else out
        splits = self.num_splits(batch, self.max_decode_keys(call.max_pages_per_seq))
        decode_only = max_query_len == 1
        main = torch.cuda.current_stream(self.device)
        # A batch that may hold prefill rows launches both kernels; they write disjoint rows of out / lse
        # and share no scratch, so the decode runs on a side stream, forked from and joined back into
        # the caller's (a fork / join that CUDA graph capture records as two branches).
        side = None if decode_only or not self.mixed_on_two_streams else self.side_stream()
        if side is not None:
            side.wait_stream(main)
        try:
            g = self.geometry
            # the split scratch belongs to the stream that uses it (no stream switch on one stream: the hot
            # decode-only path pays nothing for the fork)
            with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                partial_o = partial_lse = counters = None
                if splits > 1:
                    counters = self.split_counters(batch * spec.num_kv_heads)
                    partial_o = torch.empty(splits, batch, spec.num_qo_heads, spec.head_dim_vo, dtype=torch.float32,
                                            device=q.device)
                    partial_lse = torch.empty(splits, batch, spec.num_qo_heads, dtype=torch.float32, device=q.device)
                args = self._pack(params, {**fields, "partial_o": ptr(partial_o), "partial_lse": ptr(partial_lse),
                                           "split_counters": ptr(counters), "num_splits": splits,
                                           "prefill_skip_decode_rows": 1})
                # With split_counters set, the last split of each (sequence, kv head) merges the partials
                # (merge_splits_last_block): no merge launch.
                self._launch("decode", (splits, spec.num_kv_heads, batch), g["decode_threads"], g["decode_smem"], args)
            if not decode_only:
                self._launch_prefill(total_q, batch, args)
        finally:  # joined even when a launch raises: the caller's stream must not run ahead of the
            # decode kernel already queued, and a CUDA graph capture must not end with a fork unjoined
            if side is not None:
                main.wait_stream(side)
        return (out, lse) if return_lse else out

    def _check_device(self, q: torch.Tensor) -> None:
        if q.device != self.device:
            raise ValueError(f"q: on {q.device}, but this kernel was loaded on {self.device}")

    def _outputs(self, q: torch.Tensor, total_q: int, alibi_slopes: torch.Tensor | None, return_lse: bool,
                 out: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """What the paged and the ragged call share once their inputs are checked: the ALiBi slopes
        (the spec's defaults, built once: no copy per call, safe under graph capture), ``out`` (given or
        new, ``(total_q, num_qo_heads, head_dim_vo)``) and the float32 lse ``(total_q, num_qo_heads)``
        when asked for.

        Raises:
            ValueError: ``return_lse`` for a variant without softmax (there is no lse).
        """
        spec = self.spec
        if check_flag("return_lse", return_lse) and spec.variant is not None and not spec.variant.softmax:
            raise ValueError(f"return_lse=True: variant {spec.variant.name!r} has no softmax, so there is no lse")
        if spec.alibi and alibi_slopes is None:
            alibi_slopes = self._default_slopes
        if out is None:
            out = torch.empty(total_q, spec.num_qo_heads, spec.head_dim_vo, dtype=torch_dtype(spec.o_dtype),
                              device=q.device)
        lse = torch.empty(total_q, spec.num_qo_heads, dtype=torch.float32, device=q.device) if return_lse else None
        return alibi_slopes, out, lse

    def _pack(self, params: Mapping[str, Any], fields: dict[str, Any]) -> bytes:
        """The packed Params bytes: ``fields`` plus the variant's parameters; fields not given are 0."""
        fields = dict(fields)
        for p in self.spec.params:
            if p.is_scalar:
                fields[p.name] = params[p.name]
            else:
                fields[p.name] = params[p.name].data_ptr()
                fields[f"{p.name}__numel"] = params[p.name].numel()
        return self._packer.pack(*(fields.get(name, 0) for name in self._field_order))

    def ragged_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_start_loc: torch.Tensor,
                         kv_start_loc: torch.Tensor, *, sinks: torch.Tensor | None = None,
                         alibi_slopes: torch.Tensor | None = None, params: Mapping[str, Any] | None = None,
                         return_lse: bool = False, out: torch.Tensor | None = None,
                         max_query_len: int | None = None, validate: bool = False
                         ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attention over contiguous varlen K/V; same contract as :func:`jitattn.reference.ragged_attention`.

        One launch of the tensor-core prefill kernel serves every row (one-query sequences too).
        q, k and v may be strided views (a fused QKV or KV projection): the last dim must be
        contiguous and the token / head strides multiples of 16 bytes; they travel in Params.

        Args:
            q: ``(total_q, num_qo_heads, head_dim_qk)``; k: ``(total_kv, num_kv_heads, head_dim_qk)``;
                v: ``(total_kv, num_kv_heads, head_dim_vo)``, all of the spec's dtypes, on this device.
            query_start_loc, kv_start_loc: int32 ``(batch + 1,)`` cumulative query / key counts.
            max_query_len: accepted for a uniform signature and ignored (no decode kernel to pick).
            validate: also check the start locations' values (a device sync; not under graph capture).
            out: optional preallocated contiguous output ``(total_q, num_qo_heads, head_dim_vo)``.

        Returns:
            ``out`` and, when ``return_lse``, lse float32 ``(total_q, num_qo_heads)`` (natural log).
            Rows of a sequence with invalid start locations (outside ``[0, total_kv]``, decreasing, or
            fewer keys than queries) are NaN.

        Raises:
            ValueError: a paged spec, or a tensor that does not match the spec (before any launch).
        """
        spec = self.spec
        if not spec.ragged:
            raise ValueError(f"spec.kv_storage={spec.kv_storage!r}: this kernel reads the paged cache; call "
                             f"paged_attention(q, kv_cache, block_table, seq_lens, query_start_loc, ...)")
        params = dict(params or {})
        call = check_ragged_call(spec, q, k, v, query_start_loc, kv_start_loc, sinks=sinks, alibi_slopes=alibi_slopes,
                                 params=params, out=out, for_kernel=True)
        self._check_device(q)
        if _validating(validate):
            check_ragged_metadata_values(query_start_loc, kv_start_loc, call.total_q, call.total_kv)
        total_q, batch = call.total_q, call.batch
        alibi_slopes, out, lse = self._outputs(q, total_q, alibi_slopes, return_lse, out)
        if total_q == 0:
            return (out, lse) if return_lse else out
        ptr = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
        args = self._pack(params, {
            "q": ptr(q), "k": ptr(k), "v": ptr(v), "o": ptr(out), "lse": ptr(lse), "kv_start_loc": ptr(kv_start_loc),
            "query_start_loc": ptr(query_start_loc), "sinks": ptr(sinks), "alibi_slopes": ptr(alibi_slopes),
            "q_stride_token": q.stride(0), "q_stride_head": q.stride(1), "k_stride_token": k.stride(0),
            "k_stride_head": k.stride(1), "v_stride_token": v.stride(0), "v_stride_head": v.stride(1),
            "batch_size": batch, "total_q": total_q, "total_kv": call.total_kv, "num_splits": 1,
            "prefill_skip_decode_rows": 0, "k_scale": 1.0, "v_scale": 1.0,
        })
        self._launch_prefill(total_q, batch, args)
        return (out, lse) if return_lse else out


class LoadedOnce:
    """Objects loaded once per process and key, then reused (the kernels of :func:`load_kernel` and
    :func:`jitattn.merge.load_merge_kernel`).

    Threads loading different keys do not wait for each other; two threads racing for the same key
    both load (the disk cache builds once) and one result is kept.
    """

    def __init__(self) -> None:
        self._loaded: dict[Any, Any] = {}
        self._lock = threading.Lock()

    def clear(self) -> None:
        """Forget every loaded object (the next get loads again; tools that swap templates use it)."""
        with self._lock:
            self._loaded.clear()

    def get(self, key: Any, load: Callable[[], Any]) -> Any:
        found = self._loaded.get(key)
        if found is None:
            fresh = load()
            with self._lock:
                found = self._loaded.setdefault(key, fresh)
        return found


_KERNELS = LoadedOnce()


def _cuda_device(device: torch.device | str | int | None) -> torch.device:
    """A CUDA device with an explicit index (the current device when none is given)."""
    if isinstance(device, int):
        device = torch.device("cuda", device)
    dev = torch.device("cuda") if device is None else torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"device={dev}: jitattn kernels run on CUDA devices; use jitattn.reference on {dev.type}")
    if not torch.cuda.is_available():
        why = "this torch is built without CUDA" if torch.version.cuda is None else "torch sees no CUDA device"
        raise RuntimeError(f"device={dev}: {why}; jitattn kernels need an NVIDIA GPU and torch built with CUDA "
                           f"(jitattn.reference runs on the CPU; `jitattn warmup` compiles without a GPU)")
    return torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())


def load_kernel(spec: AttentionSpec, device: torch.device | str | int | None = None) -> JitKernel:
    """The :class:`JitKernel` of ``spec`` on ``device`` (built or loaded once per process, then reused).

    Threads loading different kernels do not wait for each other (:class:`LoadedOnce`).
    """
    dev = _cuda_device(device)
    return _KERNELS.get((spec, dev.index), lambda: JitKernel(spec, dev))


def paged_attention(spec: AttentionSpec, q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, **kwargs: Any
                    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Run ``spec``'s compiled kernels on these inputs (compiling and caching them on first use).

    Same argument order, shapes, dtypes and semantics as :func:`jitattn.reference.paged_attention`;
    keyword arguments: :meth:`JitKernel.paged_attention`.
    """
    return load_kernel(spec, q.device).paged_attention(q, kv_cache, block_table, seq_lens, query_start_loc, **kwargs)


def ragged_attention(spec: AttentionSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     query_start_loc: torch.Tensor, kv_start_loc: torch.Tensor, **kwargs: Any
                     ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Run a ragged spec's compiled prefill kernel on contiguous varlen K/V (compiling it on first use).

    Same argument order, shapes, dtypes and semantics as :func:`jitattn.reference.ragged_attention`:
    q ``(total_q, num_qo_heads, head_dim_qk)``, k ``(total_kv, num_kv_heads, head_dim_qk)``, v
    ``(total_kv, num_kv_heads, head_dim_vo)``, int32 ``query_start_loc`` / ``kv_start_loc`` ``(batch + 1,)``;
    returns out ``(total_q, num_qo_heads, head_dim_vo)`` (and the natural-log lse with ``return_lse``).
    Keyword arguments (``sinks``, ``alibi_slopes``, ``params``, ``return_lse``, ``out``, ``validate``):
    :meth:`JitKernel.ragged_attention`.

    Raises:
        ValueError: a paged spec or a bad input, before any launch.
    """
    return load_kernel(spec, q.device).ragged_attention(q, k, v, query_start_loc, kv_start_loc, **kwargs)
