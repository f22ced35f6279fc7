"""Runtime: load a spec's cubin and launch its kernels on torch's current stream.

No C++ extension and no torch ABI coupling: the cubin is loaded through the CUDA driver API
(``cuModuleLoadData``, bound with ctypes in :mod:`jitattn.cuda_driver`) into the primary context
torch uses, the kernel arguments travel as one packed struct (layout from :mod:`jitattn.render`), and
launches go to the raw handle of torch's current stream, so they order with torch's own work and can
be captured in CUDA graphs. Launch geometry (block sizes, shared memory, tile shapes) is read from
the cubin itself, never re-derived in Python.

An engine calls it in two steps (:mod:`jitattn.planning` holds the machinery):

- :func:`plan` once per step: the batch's metadata checked, the kernels and the split-KV factor
  chosen, the scratch allocated, the ``Params`` struct packed except the per-layer fields;
- :func:`run` once per layer: q, the cache and ``out`` checked against the plan, their pointers
  written into the packed bytes, the launches.

:func:`paged_attention` and :func:`ragged_attention` are the one-call form (a plan made and run for
the one call, reading nothing on the host). A mixed batch's sequences that bring one query go to the
decode kernel (split-KV when the batch cannot fill the GPU), the rest to the prefill kernel, from
the same ``query_start_loc`` / ``seq_lens`` metadata; the two kernels write disjoint rows, so the
decode kernel runs on a side stream forked from the caller's and joined back before the call
returns. A ragged spec (``kv_storage="ragged"``) has only the prefill kernel, launched once for
every row of the batch; a latent (MLA) spec only its MLA decode kernel, likewise for every row.
"""

from __future__ import annotations

import functools
import hashlib
import math
import threading
import weakref
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from jitattn import cuda_driver
from jitattn.build import archs_for_capability
from jitattn.cache import CacheEntry, KernelCache
from jitattn.checks import check_kv_cache, check_paged_q, check_spec, fail, kv_num_pages
from jitattn.constants import template_constant
from jitattn.dtypes import default_alibi_slopes
from jitattn.planning import (ParamsLayout, Plan, SpecPlan, capturing, make_paged_plan,  # noqa: F401
                              make_ragged_plan, params_packer)
from jitattn.render import KERNEL_NAMES
from jitattn.spec import AttentionSpec, latent_kernel_problem

_GEOMETRY = ("decode_threads", "decode_smem", "decode_tile_keys", "prefill_threads", "prefill_smem",
             "prefill_block_m", "prefill_block_n", "params_size")
#: Most partial states the fused split-KV merge takes (the templates' kMaxSplits).
MAX_SPLITS = template_constant("kMaxSplits")
_DEFAULT_SMEM_LIMIT = 48 * 1024
# A call that may hold prefill rows runs its decode kernel on a side stream beside the prefill kernel
# (JitKernel.mixed_on_two_streams; False: both on the caller's stream, one after the other).
MIXED_ON_TWO_STREAMS = True

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


def _current_device() -> int:
    """torch's current CUDA device index: its C getter (CUDA is initialised once a module is loaded, which
    is all ``torch.cuda.current_device`` adds)."""
    return torch._C._cuda_getDevice()


class _DeviceArray:
    """A device buffer described by ``__cuda_array_interface__`` (v3), for ``torch.as_tensor``."""

    def __init__(self, ptr: int, count: int, typestr: str):
        self.__cuda_array_interface__ = {"shape": (count,), "typestr": typestr, "data": (ptr, False), "version": 3,
                                         "strides": None}


class CubinModule:
    """A cubin loaded into the device's primary context through the CUDA driver API (:mod:`jitattn.cuda_driver`).

    Launches pass the kernel's packed ``Params`` bytes straight to ``cuLaunchKernelEx``: no per-call
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

    def is_current(self) -> bool:
        """Whether this device's primary context is current on the calling thread already (the usual case: a
        raw stream handle, 0 = the legacy default stream, then means this device's stream)."""
        primed = getattr(_thread_state, "primed", None)
        return primed is not None and self.device_index in primed and _current_device() == self.device_index

    def launch(self, kernel: str, grid: tuple[int, int, int], block: int, smem: int, params: bytes,
               stream: int) -> None:
        """``cuLaunchKernelEx`` with one by-value struct argument (the driver copies it before returning)."""
        primed = getattr(_thread_state, "primed", None)  # is_current, written out: this runs per launch
        if primed is not None and self.device_index in primed and torch._C._cuda_getDevice() == self.device_index:
            self._driver.launch_kernel(self.functions[kernel], grid, (block, 1, 1), smem, stream, params)
            return  # the usual case: this device's context is current on this thread already
        prev = self._make_current()
        try:
            self._driver.launch_kernel(self.functions[kernel], grid, (block, 1, 1), smem, stream, params)
        finally:
            self._restore(prev)

    def record_and_wait(self, event: int, stream: int, waiter: int) -> None:
        """``waiter`` waits for what ``stream`` has queued so far (``CudaDriver.record_and_wait``), in this device's
        context, as :meth:`launch` runs: a raw handle of 0 names the current context's default stream."""
        if self.is_current():
            self._driver.record_and_wait(event, stream, waiter)
            return
        prev = self._make_current()
        try:
            self._driver.record_and_wait(event, stream, waiter)
        finally:
            self._restore(prev)


class StreamFork:
    """A caller's stream and the side stream a mixed batch's decode kernel runs on beside it: :meth:`fork`
    makes the side stream wait for the caller's work so far and returns its raw handle, :meth:`join` makes
    the caller's stream wait for what was queued on the side. One driver event each way, made once and
    recorded again at every call (a wait takes the event's latest record at the time it is queued, so a
    later record never changes an earlier wait); CUDA graph capture records the pair as a fork and a join,
    as it does ``torch.cuda.Stream.wait_stream`` (which makes an Event object per call: BENCHMARKS.md,
    History 2026-12-04). Both calls run with the module's context current, as the launches do: a raw
    handle of 0 (the legacy default stream) names the current context's stream, and a wait on another
    device's stream would succeed and order nothing here.

    Args:
        module: the kernels' loaded module (its context: the device's primary one).
        device: the CUDA device of both streams.
        main: the raw handle of the caller's stream.

    Raises:
        jitattn.cuda_driver.CudaDriverError: the driver refused an event call.
    """

    def __init__(self, module: "CubinModule", device: torch.device, main: int):
        self.module, self.main = module, main
        self.side_stream = torch.cuda.Stream(device, priority=-1)  # lower is higher
        self.side = self.side_stream.cuda_stream
        drv = module._driver
        events: list[int] = []
        prev = module._make_current()
        try:
            for _ in range(2):
                events.append(drv.event_create())
        finally:
            module._restore(prev)
            if len(events) < 2:  # the second create failed: the first is not left behind
                _destroy_events(drv, tuple(events))
        self._forked, self._joined = events
        weakref.finalize(self, _destroy_events, drv, (self._forked, self._joined))

    def fork(self) -> int:
        self.module.record_and_wait(self._forked, self.main, self.side)
        return self.side

    def join(self) -> None:
        self.module.record_and_wait(self._joined, self.side, self.main)


def _destroy_events(drv: cuda_driver.CudaDriver, events: tuple[int, ...]) -> None:
    for event in events:
        try:
            drv.event_destroy(event)
        except Exception:  # noqa: BLE001 - at exit the context may be gone already
            pass


def choose_num_splits(blocks: int, slots: int, max_useful: int, *, min_wave_fill: float = 0.9) -> int:
    """Split-KV factor (FlashDecoding; Dao et al. 2023): one wave filled as far as it goes, else the
    fewest splits whose waves are nearly full on average.

    ``blocks`` = batch x num_kv_heads decode blocks; ``slots`` = SMs x resident blocks per SM (the
    driver's occupancy); each sequence's keys are split into ``s`` blocks, merged by log-sum-exp.
    Capped by ``max_useful`` (>= 4 tiles per split) and MAX_SPLITS. When the blocks fit one wave, ``s``
    is the most that still fit it (``slots // blocks``: a split there costs no wave, and shortens the
    longest block), taken when it fills the wave to ``min_wave_fill``; otherwise the smallest ``s``
    whose ``blocks * s`` blocks fill their waves to at least ``min_wave_fill`` of ``waves * slots``
    (a partial last wave idles the rest of the GPU). Fitted on the H200 by graph times (BENCHMARKS.md,
    "Split-KV sweep" and History 2026-12-04): 64 x 4096 hd128 (512 blocks, 264 slots) best unsplit;
    1 x 32768 (8 blocks) best at 33, one exact wave; Gemma-2 64 x 8192 on the CUDA-core decode (512
    blocks, 396 slots) best at 2-3; one wave 97 % full unsplit beats two waves at 2 splits (issue 18's
    mixed probe, MLA decode at TP8 and TP1), and FP8 MLA at TP8 (128 blocks, 264 slots) is best at 2.
    """
    cap = max(1, min(max_useful, MAX_SPLITS))
    if blocks <= slots:
        s = min(cap, max(1, slots // max(blocks, 1)))
        if s == cap or blocks * s >= min_wave_fill * slots:
            return s
    else:
        s = 1
    while s < cap:
        waves = math.ceil(blocks * s / slots)
        if blocks * s / (waves * slots) >= min_wave_fill:
            break
        s += 1
    return s


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
        device = cuda_device(device)
        self.entry = select_entry(spec, torch.cuda.get_device_capability(device))
        # A ragged spec's module holds only the prefill kernel (attention.cu.j2 builds no decode for it), a latent
        # spec's only its MLA decode kernel.
        wanted = ("decode", "prefill") if spec.has_decode else ("decode",) if spec.latent else ("prefill",)
        kernels = {k: v for k, v in KERNEL_NAMES.items() if k in wanted}
        module = CubinModule(str(self.entry.cubin), device.index, kernels,
                             sha256=self.entry.manifest["artifacts"].get(self.entry.cubin.name))
        geometry = dict(zip(_GEOMETRY, module.read_global_int32(KERNEL_NAMES["geometry"], len(_GEOMETRY))))
        layout = ParamsLayout(spec)
        if geometry["params_size"] != layout.size:
            raise RuntimeError(f"{self.entry.cubin}: Params is {geometry['params_size']} bytes in the cubin but "
                               f"{layout.size} on the host; the cache entry is stale: `jitattn cache clear --yes` "
                               f"(or `jitattn cache prune`) and warm up again")
        for name in ("decode", "prefill"):
            smem = geometry[f"{name}_smem"]
            if name in kernels and smem > _DEFAULT_SMEM_LIMIT:
                module.set_max_dynamic_smem(name, smem)
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        per_sm = module.blocks_per_sm("decode", geometry["decode_threads"], geometry["decode_smem"]) \
            if "decode" in kernels else 0
        self._setup(spec, device, module, geometry, num_sms, per_sm, stream_handle(device))

    @classmethod
    def from_module(cls, spec: AttentionSpec, module: Any, geometry: Mapping[str, int], *, device: torch.device,
                    num_sms: int, decode_blocks_per_sm: int, stream_handle: Callable[[], int]) -> "JitKernel":
        """A kernel over any module with ``launch(kernel, grid, block, smem, params, stream)``: the launch
        boundary, injectable (the CPU tests record launches from a module with a fixed ``geometry``).

        ``geometry``: the cubin's launch geometry (keys of ``_GEOMETRY`` but ``params_size``);
        ``stream_handle()``: the raw handle of the stream to launch on.
        """
        kernel = object.__new__(cls)
        kernel.entry = None
        kernel._setup(spec, torch.device(device), module, {**geometry, "params_size": ParamsLayout(spec).size},
                      num_sms, decode_blocks_per_sm, stream_handle)
        return kernel

    def _setup(self, spec: AttentionSpec, device: torch.device, module: Any, geometry: Mapping[str, int],
               num_sms: int, decode_blocks_per_sm: int, stream_handle: Callable[[], int]) -> None:
        self.spec, self.device, self._module, self.geometry = spec, device, module, dict(geometry)
        self.layout = ParamsLayout(spec)
        self._num_sms, self._decode_blocks_per_sm = num_sms, decode_blocks_per_sm
        self.stream_handle = stream_handle
        self.launch = module.launch  # (kernel, grid, block, smem, params, stream): the boundary
        # the spec's default ALiBi slopes, made once: no copy per call, safe under graph capture
        self.default_slopes = default_alibi_slopes(spec, device) if spec.alibi else None
        self._split_counters: dict[int, torch.Tensor] = {}  # stream handle -> fused-merge counters
        self._retired_counters: list[torch.Tensor] = []  # outgrown buffers that captured graphs may still use
        self._unzeroed_counters: set[int] = set()  # streams whose buffer was made under capture, not yet zeroed
        self._side_streams: dict[int, StreamFork] = {}  # caller's stream handle -> its decode stream
        self.mixed_on_two_streams = MIXED_ON_TWO_STREAMS
        self._num_splits: dict[tuple[int, int], int] = {}  # (batch, max keys) -> split factor, made once
        self._last_plans: dict[int, tuple[tuple, Any]] = {}  # stream handle -> (metadata key, its one-call plan)

    def max_decode_keys(self, max_pages_per_seq: int) -> int:
        """Most keys one decode row can read: the page table's capacity, or the window if smaller."""
        keys = max_pages_per_seq * self.spec.page_size
        return min(keys, self.spec.window_left + 1) if self.spec.window_left >= 0 else keys

    def num_splits(self, batch: int, max_kv_len: int) -> int:
        """Split-KV factor of a decode launch (:func:`choose_num_splits` for this kernel's geometry).

        Depends only on shapes, so a captured CUDA graph stays valid for any sequence lengths.
        (``kMaxSplits`` caps it: :data:`MAX_SPLITS`, read from the templates.)
        """
        found = self._num_splits.get((batch, max_kv_len))
        if found is None:
            blocks = batch * self.spec.num_kv_heads
            slots = self._num_sms * self._decode_blocks_per_sm
            max_useful = max(1, max_kv_len // (4 * self.geometry["decode_tile_keys"]))
            found = self._num_splits[(batch, max_kv_len)] = choose_num_splits(blocks, slots, max_useful)
        return found

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
        stream = self.stream_handle()
        now_capturing = capturing()
        buf = self._split_counters.get(stream)
        if buf is None or buf.numel() < pairs:
            if buf is not None:
                self._retired_counters.append(buf)
            buf = torch.zeros(max(pairs, 1024), dtype=torch.int32, device=self.device)
            self._split_counters[stream] = buf
            if now_capturing:
                self._unzeroed_counters.add(stream)
            else:
                self._unzeroed_counters.discard(stream)
        elif stream in self._unzeroed_counters:
            buf.zero_()
            if not now_capturing:
                self._unzeroed_counters.discard(stream)
        return buf

    def side_stream(self, main: int | None = None) -> torch.cuda.Stream:
        """The stream a mixed batch's decode kernel runs on beside the caller's (one per caller stream).

        High priority, so the decode blocks are dispatched before the prefill blocks waiting beside
        them; the prefill kernel then fills each SM the decode leaves (see ``paged_attention``).
        """
        if main is None:  # the caller's stream handle, unless the caller has it already
            main = self.stream_handle()
        return self.stream_fork(main).side_stream

    def stream_fork(self, main: int) -> "StreamFork":
        """The fork to the side stream of :meth:`side_stream` and the join back, for the caller's stream
        ``main`` (a raw handle): made once per caller's stream."""
        fork = self._side_streams.get(main)
        if fork is None:
            fork = self._side_streams.setdefault(main, StreamFork(self._module, self.device, main))
        return fork

    # ---- plan / run ---------------------------------------------------------------------------------
    def plan(self, block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, *,
             also: Sequence[AttentionSpec] = (), total_q: int | None = None, max_query_len: int | None = None,
             num_pages: int | None = None, query_positions: torch.Tensor | None = None,
             functor_batch: torch.Tensor | None = None, position_offset: torch.Tensor | None = None,
             mode: str | None = None, validate: bool = False, shared_scratch: bool = False) -> Plan:
        """:func:`jitattn.plan` for this kernel's spec (and the specs in ``also``, loaded on its device)."""
        if self.spec.ragged:
            fail("spec.kv_storage='ragged': this kernel reads ragged K/V; plan it with "
                 "plan_ragged(spec, query_start_loc, kv_start_loc, ...)")
        return make_paged_plan(self._loader(), (self.spec, *also), self.device, block_table, seq_lens,
                               query_start_loc, total_q=total_q, max_query_len=max_query_len, num_pages=num_pages,
                               query_positions=query_positions, functor_batch=functor_batch,
                               position_offset=position_offset, mode=mode, validate=validate,
                               shared_scratch=shared_scratch)

    def plan_ragged(self, query_start_loc: torch.Tensor, kv_start_loc: torch.Tensor, *,
                    also: Sequence[AttentionSpec] = (), total_q: int | None = None, total_kv: int | None = None,
                    mode: str | None = None, validate: bool = False) -> Plan:
        """:func:`jitattn.plan_ragged` for this kernel's spec (and the specs in ``also``)."""
        if not self.spec.ragged:
            fail(f"spec.kv_storage={self.spec.kv_storage!r}: this kernel reads the paged cache; plan it with "
                 f"plan(spec, block_table, seq_lens, query_start_loc, ...)")
        return make_ragged_plan(self._loader(), (self.spec, *also), self.device, query_start_loc, kv_start_loc,
                                total_q=total_q, total_kv=total_kv, mode=mode, validate=validate)

    def _loader(self) -> Callable[[AttentionSpec], Any]:
        """How a plan finds the kernel of each spec it runs: this one, or the loaded one on this device."""
        return lambda spec: self if spec is self.spec or spec == self.spec else load_kernel(spec, self.device)

    # ---- the one call ---------------------------------------------------------------------------------
    def paged_attention(self, q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                        seq_lens: torch.Tensor, query_start_loc: torch.Tensor, *, sinks: torch.Tensor | None = None,
                        alibi_slopes: torch.Tensor | None = None, params: Mapping[str, Any] | None = None,
                        return_lse: bool = False, out: torch.Tensor | None = None, max_query_len: int | None = None,
                        validate: bool = False, k_scale: float = 1.0, v_scale: float = 1.0,
                        query_positions: torch.Tensor | None = None, functor_batch: torch.Tensor | None = None,
                        position_offset: torch.Tensor | None = None
                        ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attention over the paged KV cache; same contract as :func:`jitattn.reference.paged_attention`.

        A graph-mode plan (nothing read on the host) and its run: the stream's last plan when the
        metadata tensors are the ones of the last call (addresses, shapes, strides), so the layers of
        a step plan once; an engine can also make the plan itself (:meth:`plan`, :func:`run`).

        Args:
            max_query_len: optional host-side hint; ``1`` promises a pure decode batch (only the decode
                kernel is launched; a sequence with another query count is then left unwritten);
                without it both kernels are launched.
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
        part = self._one_call_plan(q, kv_cache, block_table, seq_lens, query_start_loc, max_query_len, validate,
                                   (query_positions, functor_batch, position_offset))
        return part.run(q, kv_cache, out, return_lse, sinks, alibi_slopes, params, k_scale, v_scale)

    def _one_call_plan(self, q: Any, kv_cache: Any, block_table: Any, seq_lens: Any, query_start_loc: Any,
                       max_query_len: Any, validate: Any, positions: tuple) -> SpecPlan:
        """The graph-mode plan of a one-call: the stream's last one when the call's metadata is the same
        (same tensors: addresses, shapes, strides, dtypes; same sizes and hint), else a new one.

        A graph-mode plan depends on nothing else (it reads no value), so the layers of a step that call
        paged_attention with one batch's metadata plan once. Never reused with ``validate`` (it reads the
        values) nor under graph capture (a plan made there holds the graph's memory).
        """
        key = stream = None
        if validate is False and (max_query_len is None or type(max_query_len) is int) and not capturing():
            bt, sl, qs = block_table, seq_lens, query_start_loc
            try:  # what a graph-mode plan reads of each metadata tensor (_layout_key), written out: per call
                key = (q.shape[0], kv_cache.shape[0] if type(kv_cache) is torch.Tensor else kv_num_pages(kv_cache),
                       max_query_len, bt.data_ptr(), bt.shape, bt.stride(), bt.dtype, bt.device,
                       sl.data_ptr(), sl.shape, sl.stride(), sl.dtype, sl.device,
                       qs.data_ptr(), qs.shape, qs.stride(), qs.dtype, qs.device,
                       None if positions[0] is None and positions[1] is None and positions[2] is None
                       else tuple(map(_layout_key, positions)))
            except Exception:  # not tensors, or q / the cache without a dim 0: the checks below say what is wrong
                key = None
            if key is not None:
                stream = self.stream_handle()
                last = self._last_plans.get(stream)
                if last is not None and last[0] == key:  # only a paged plan holds a paged key: not ragged
                    return last[1]
        if self.spec.ragged:
            fail("spec.kv_storage='ragged': this kernel reads ragged K/V; call "
                 "ragged_attention(q, k, v, query_start_loc, kv_start_loc, ...)")
        check_paged_q(self.spec, q)  # q and the cache first: their sizes go into the plan
        check_kv_cache(self.spec, kv_cache, q.device)
        p = self.plan(block_table, seq_lens, query_start_loc, total_q=q.shape[0], max_query_len=max_query_len,
                      num_pages=kv_num_pages(kv_cache), query_positions=positions[0], functor_batch=positions[1],
                      position_offset=positions[2], mode="graph", validate=validate, shared_scratch=True)
        if key is not None:
            # Eager, and no more query rows than sequences: its prefill rows (if any) are at most a few, so the
            # side-stream fork's host cost (about 9 us a call on the H100) buys no overlap: one stream
            p._first.two_streams = q.shape[0] > p.batch  # type: ignore[union-attr]
            self._last_plans[stream] = (key, p._first)  # type: ignore[index]
        return p._first  # type: ignore[return-value]

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
            fail(f"spec.kv_storage={spec.kv_storage!r}: this kernel reads the paged cache; call "
                 f"paged_attention(q, kv_cache, block_table, seq_lens, query_start_loc, ...)")
        key = stream = None
        if validate is False and not capturing():  # as paged_attention: the stream's last plan if it fits
            try:
                key = ("ragged", q.shape[0], k.shape[0], _layout_key(query_start_loc), _layout_key(kv_start_loc))
            except Exception:  # as paged_attention's: the checks below say what is wrong
                key = None
            if key is not None:
                stream = self.stream_handle()
                last = self._last_plans.get(stream)
                if last is not None and last[0] == key:
                    return last[1].run(q, (k, v), out=out, return_lse=return_lse, sinks=sinks,
                                       alibi_slopes=alibi_slopes, params=params)
        check_paged_q(spec, q)
        part = self.plan_ragged(query_start_loc, kv_start_loc, total_q=q.shape[0],
                                total_kv=k.shape[0] if isinstance(k, torch.Tensor) and k.dim() else None, mode="graph",
                                validate=validate)._first
        if key is not None:
            self._last_plans[stream] = (key, part)  # type: ignore[index]
        return part.run(q, (k, v), out=out, return_lse=return_lse, sinks=sinks, alibi_slopes=alibi_slopes,
                        params=params)


class LoadedOnce:
    """Objects loaded once per process and key, then reused (the kernels of :func:`load_kernel` and
    :func:`jitattn.merge.load_merge_kernel`).

    Threads loading different keys do not wait for each other; two threads racing for the same key
    both load (the disk cache builds once) and one result is kept.
    """

    def __init__(self) -> None:
        self._loaded: dict[Any, Any] = {}
        self._lock = threading.Lock()
        # a caller's memo of recent gets under a cheaper key: key -> (the object the key names, the value)
        self.recent: dict[Any, tuple[Any, Any]] = {}

    def clear(self) -> None:
        """Forget every loaded object (the next get loads again; tools that swap templates use it)."""
        with self._lock:
            self._loaded.clear()
            self.recent.clear()

    def get(self, key: Any, load: Callable[[], Any]) -> Any:
        found = self._loaded.get(key)
        if found is None:
            fresh = load()
            with self._lock:
                found = self._loaded.setdefault(key, fresh)
        return found


_KERNELS = LoadedOnce()



def cuda_device(device: torch.device | str | int | None) -> torch.device:
    """A CUDA device with an explicit index (the current device when none is given).

    Raises:
        ValueError: a device of another type (pointing to :mod:`jitattn.reference`).
        RuntimeError: torch sees no CUDA device, saying why.
    """
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


def _layout_key(t: torch.Tensor | None) -> tuple | None:
    """What a graph-mode plan reads of a metadata tensor: its address, shape, strides, dtype, device."""
    return None if t is None else (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)


def stream_handle(device: torch.device) -> Callable[[], int]:
    """The raw handle of the device's current stream, as a call: torch's C getter where it has one (the
    one Triton's launcher calls; no Stream object per launch; bound to the index by a partial, so no
    Python frame per call), else ``current_stream().cuda_stream``."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    index = device.index
    if raw is not None and raw(index) == torch.cuda.current_stream(device).cuda_stream:
        return functools.partial(raw, index)
    return lambda: torch.cuda.current_stream(device).cuda_stream


def load_kernel(spec: AttentionSpec, device: torch.device | str | int | None = None) -> JitKernel:
    """The :class:`JitKernel` of ``spec`` on ``device`` (built or loaded once per process, then reused).

    Threads loading different kernels do not wait for each other (:class:`LoadedOnce`). A spec object
    already loaded on an explicit ``torch.device("cuda", i)`` is found by its identity, without hashing
    the spec (the one-call path: each call looks its kernel up).

    Raises:
        ValueError: a latent spec the MLA decode kernel cannot serve (latent head dims not multiples of 64:
            :func:`jitattn.spec.latent_kernel_problem`), with the call that gives a backend serving it.
    """
    recent = _KERNELS.recent
    if type(device) is torch.device:  # a one-call's path: this spec object was loaded on this device before
        hit = recent.get((id(spec), device))
        if hit is not None and hit[0] is spec:
            return hit[1]
    problem = latent_kernel_problem(spec)  # before any device, cache or compile work: plan / run land here
    if problem:
        fail(f"spec {spec.name}: {problem}; jitattn.selector.select(spec, device).build() gives a backend that "
             f"serves it")
    explicit = isinstance(device, torch.device) and device.type == "cuda" and device.index is not None
    dev = device if explicit else cuda_device(device)
    kernel = _KERNELS.get((spec, dev.index), lambda: JitKernel(spec, dev))
    if explicit and type(device) is torch.device:  # not "cuda" alone: the current device may change
        if len(recent) >= _RECENT_KERNELS:
            recent.clear()
        recent[(id(spec), device)] = (spec, kernel)  # the entry holds the spec, so its id is not reused
    return kernel


#: Most (spec object, device) pairs :func:`load_kernel` remembers by identity (a model's layers share a few).
_RECENT_KERNELS = 64


def _specs(spec: AttentionSpec | Sequence[AttentionSpec], call: str) -> tuple[AttentionSpec, ...]:
    specs = tuple(spec) if isinstance(spec, (list, tuple)) else (spec,)
    if not specs:
        fail(f"spec: expected an AttentionSpec or a non-empty sequence of them: {call}")
    return tuple(check_spec(s, call) for s in specs)


def _metadata_device(query_start_loc: Any) -> torch.device:
    """The device a plan loads its kernels on: its metadata's (checked to be a tensor first)."""
    if not isinstance(query_start_loc, torch.Tensor):
        fail(f"query_start_loc: expected a torch.Tensor, got {type(query_start_loc).__name__}")
    return query_start_loc.device


def plan(spec: AttentionSpec | Sequence[AttentionSpec], block_table: torch.Tensor, seq_lens: torch.Tensor,
         query_start_loc: torch.Tensor, *, total_q: int | None = None, max_query_len: int | None = None,
         num_pages: int | None = None, query_positions: torch.Tensor | None = None,
         functor_batch: torch.Tensor | None = None, position_offset: torch.Tensor | None = None,
         mode: str | None = None, validate: bool = False) -> Plan:
    """Plan a paged batch once per step; every attention layer of the step then calls :func:`run`.

    Checks the metadata (dtypes, shapes, devices, strides), picks the kernels and the split-KV factor,
    allocates the split scratch and packs the kernel's ``Params`` but for the per-layer fields. A
    run costs its checks of q / kv_cache / out, one ``struct.pack`` and the launches.

    Args:
        spec: the layers' spec, or several specs sharing this batch layout (Gemma-2's sliding and
            full layers): the same storage, page size, query positions; the first is the default
            of :func:`run`. Their kernels are loaded (compiled if needed) on the metadata's device.
        block_table: int32 ``(batch, max_pages)``, rows contiguous; seq_lens: int32 ``(batch,)`` keys
            per sequence (new tokens included); query_start_loc: int32 ``(batch + 1,)`` cumulative
            query counts. All on one CUDA device; a run reads them on the device (a captured graph
            sees new values written into them in place).
        total_q: rows of q (default: read from ``query_start_loc[-1]``, eager mode only).
        max_query_len: the longest query count; ``1`` launches only the decode kernel. Default:
            eager mode reads it, graph mode launches both kernels.
        num_pages: pages of the cache (optional): a run then refuses a cache of another page count,
            and ``validate`` checks the page ids against it (required there).
        query_positions, functor_batch, position_offset: the explicit positions of a spec with
            ``query_positions="explicit"`` (:func:`jitattn.reference.paged_attention`).
        mode: "eager" (default outside graph capture): reads ``query_start_loc`` on the host once (one
            device sync) when ``total_q`` or ``max_query_len`` is not given, and launches exactly the
            kernels this step's values need (a pure decode batch only the decode kernel, a pure prefill
            batch only the prefill kernel; the prefill grid then its exact tile count): the plan holds
            for these values. "graph" (the default while the stream captures): reads nothing,
            decides from shapes and arguments: valid for any values of the same shapes, so a graph
            captured from its runs replays with new metadata values.
        validate: also check the metadata values (a device sync; not under capture).

    Returns:
        a :class:`jitattn.planning.Plan`.

    Raises:
        ValueError: a bad spec or metadata tensor, naming the argument (before any launch).
    """
    specs = _specs(spec, "plan(spec, block_table, seq_lens, query_start_loc, ...)")
    first = load_kernel(specs[0], _metadata_device(query_start_loc))
    return first.plan(block_table, seq_lens, query_start_loc, also=specs[1:], total_q=total_q,
                      max_query_len=max_query_len, num_pages=num_pages, query_positions=query_positions,
                      functor_batch=functor_batch, position_offset=position_offset, mode=mode, validate=validate)


def plan_ragged(spec: AttentionSpec | Sequence[AttentionSpec], query_start_loc: torch.Tensor,
                kv_start_loc: torch.Tensor, *, total_q: int | None = None, total_kv: int | None = None,
                mode: str | None = None, validate: bool = False) -> Plan:
    """Plan a ragged batch (contiguous varlen K/V) once; :func:`run` it with ``kv=(k, v)`` per layer.

    Args:
        spec: a ragged spec, or several sharing the layout.
        query_start_loc, kv_start_loc: int32 ``(batch + 1,)`` cumulative query / key counts.
        total_q: rows of q (default: read from ``query_start_loc[-1]``, eager mode only).
        total_kv: rows of k and v (optional): a run then refuses k and v of another row count, and
            ``validate`` checks ``kv_start_loc`` against it (required there).
        mode, validate: as :func:`plan`.

    Raises:
        ValueError: a bad spec or metadata tensor, naming the argument.
    """
    specs = _specs(spec, "plan_ragged(spec, query_start_loc, kv_start_loc, ...)")
    return load_kernel(specs[0], _metadata_device(query_start_loc)).plan_ragged(query_start_loc, kv_start_loc, also=specs[1:], total_q=total_q,
                                                     total_kv=total_kv, mode=mode, validate=validate)


def run(q: torch.Tensor, kv_cache: Any, plan: Plan, *, spec: AttentionSpec | None = None,
        out: torch.Tensor | None = None, return_lse: bool = False, sinks: torch.Tensor | None = None,
        alibi_slopes: torch.Tensor | None = None, params: Mapping[str, Any] | None = None,
        k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One attention layer on a planned batch (:func:`plan` / :func:`plan_ragged`).

    Args:
        q: ``(total_q, num_qo_heads, head_dim_qk)`` of the spec's q dtype, on the plan's device; heads
            and head_dim contiguous, rows 16-byte aligned (a row stride of a fused QKV is fine).
        kv_cache: the paged cache (the spec's layout and KV dtype; ``num_pages`` pages if the plan
            was given it): one tensor, or a ``(k_cache, v_cache)`` pair of two tensors with one shape
            and the same strides (NHD ``(num_pages, page_size, H_kv, D)``, HND ``(num_pages, H_kv,
            page_size, D)``; the kernels read V at K's address plus the pair's offset); or ``(k, v)``
            for a ragged plan.
        plan: the step's plan.
        spec: which of the plan's specs this layer runs (default: the first); a spec not planned yet
            is planned now (allocating its scratch: plan every spec up front for CUDA graphs).
        out: optional contiguous, 16-byte aligned ``(total_q, num_qo_heads, head_dim_vo)`` of
            ``spec.o_dtype``, written in place and returned; it may share no byte with q or the cache.
        return_lse: also return the float32 lse ``(total_q, num_qo_heads)`` (natural log).
        sinks, alibi_slopes, params, k_scale, v_scale: this layer's, as :func:`paged_attention`.

    Returns:
        ``out``, and the lse with ``return_lse``.

    Raises:
        ValueError: a tensor that does not fit the plan or the spec (shape, dtype, device, strides,
            page count), an ``out`` that overlaps q, the cache, sinks, slopes or a params tensor in
            memory, a spec of another layout, naming the argument; before any launch.
    """
    if not isinstance(plan, Plan):
        fail(f"plan: expected a Plan from jitattn.plan / plan_ragged, got {type(plan).__name__}")
    return plan.for_spec(spec).run(q, kv_cache, out, return_lse, sinks, alibi_slopes, params, k_scale, v_scale)


def paged_attention(spec: AttentionSpec, q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, **kwargs: Any
                    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Run ``spec``'s compiled kernels on these inputs (compiling and caching them on first use).

    The one-call form of :func:`plan` + :func:`run` (a plan for this call, nothing read on the host);
    same argument order, shapes, dtypes and semantics as :func:`jitattn.reference.paged_attention`;
    keyword arguments: :meth:`JitKernel.paged_attention`.

    Raises:
        ValueError: ``spec`` not an AttentionSpec, ``q`` not a tensor, or a bad input (before any launch).
    """
    if type(spec) is not AttentionSpec or type(q) is not torch.Tensor:  # exact types first: the per-call path
        _check_spec_and_q(spec, q, "paged_attention(spec, q, kv_cache, block_table, seq_lens, query_start_loc, ...)")
    return load_kernel(spec, q.device).paged_attention(q, kv_cache, block_table, seq_lens, query_start_loc, **kwargs)


def _check_spec_and_q(spec: Any, q: Any, call: str) -> None:
    """What the one-call forms read before the kernel's own checks: the spec (its kernel is loaded) and
    q's device (where it is loaded)."""
    check_spec(spec, call)
    if not isinstance(q, torch.Tensor):
        fail(f"q: expected a torch.Tensor, got {type(q).__name__}")


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
    _check_spec_and_q(spec, q, "ragged_attention(spec, q, k, v, query_start_loc, kv_start_loc, ...)")
    return load_kernel(spec, q.device).ragged_attention(q, k, v, query_start_loc, kv_start_loc, **kwargs)
