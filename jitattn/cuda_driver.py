"""The CUDA driver-API calls the runtime makes, bound with ctypes on the driver library (``libcuda.so.1``).

The runtime needs twelve driver entry points: load a cubin image, find its kernels and a global, set a
kernel's dynamic shared memory limit, ask the occupancy calculator, launch (``cuLaunchKernelEx``), unload,
name an error, and make, record, wait on and destroy the events of a mixed batch's fork to a side stream
and join back ("Event Management", "Stream Management": cuStreamWaitEvent).
They are bound here directly, with their C signatures from ``cuda.h`` (CUDA Driver API reference,
"Module Management", "Execution Control", "Occupancy"), instead of through CuPy: CuPy's bindings
import all of ``cupy`` on the first call, ~130 ms of a process's first kernel load (cProfile on the
H200, 2026-11-29), which issue #7's warm-start budget (50 ms per kernel, import included) cannot
afford. The driver's C ABI is stable across CUDA 12 and 13, so one binding serves both; the versioned
symbols (``cuModuleGetGlobal_v2``) are named explicitly, as ``cuda.h`` does through its macros.

Every call checks the returned ``CUresult``; a failure raises :class:`CudaDriverError` naming the call,
the error's name and the driver's description. The calls work on whatever context is current on the
calling thread: the runtime makes the device's primary context current through torch
(``torch.cuda.set_device``) before calling, so modules and launches share torch's context and streams.
"""

from __future__ import annotations

import ctypes
import operator
import threading
from typing import Any

__all__ = ["CudaDriver", "CudaDriverError", "driver", "LIBRARY"]

LIBRARY = "libcuda.so.1"  # the driver library the NVIDIA driver installs (Linux)

_c_int = ctypes.c_int
_c_uint = ctypes.c_uint
_c_size_t = ctypes.c_size_t
_c_void_p = ctypes.c_void_p
_c_char_p = ctypes.c_char_p
_P = ctypes.POINTER

# name -> (argtypes); every entry point returns CUresult (an int). Handles (CUmodule, CUfunction,
# CUstream) are opaque pointers; CUdeviceptr is a 64-bit unsigned integer.
_SIGNATURES = {
    "cuModuleLoadData": (_P(_c_void_p), _c_char_p),
    "cuModuleUnload": (_c_void_p,),
    "cuModuleGetFunction": (_P(_c_void_p), _c_void_p, _c_char_p),
    "cuModuleGetGlobal_v2": (_P(ctypes.c_uint64), _P(_c_size_t), _c_void_p, _c_char_p),
    "cuFuncSetAttribute": (_c_void_p, _c_int, _c_int),
    "cuOccupancyMaxActiveBlocksPerMultiprocessor": (_P(_c_int), _c_void_p, _c_int, _c_size_t),
    "cuLaunchKernelEx": (_c_void_p, _c_void_p, _P(_c_void_p), _P(_c_void_p)),
    "cuEventCreate": (_P(_c_void_p), _c_uint),
    "cuEventRecord": (_c_void_p, _c_void_p),
    "cuStreamWaitEvent": (_c_void_p, _c_void_p, _c_uint),
    "cuEventDestroy_v2": (_c_void_p,),
    "cuGetErrorName": (_c_int, _P(_c_char_p)),
    "cuGetErrorString": (_c_int, _P(_c_char_p)),
}

CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8  # CUfunction_attribute in cuda.h
CU_EVENT_DISABLE_TIMING = 2  # CUevent_flags in cuda.h


class LaunchConfig(ctypes.Structure):
    """``CUlaunchConfig`` of cuda.h (CUDA 11.8+): a launch's grid, block, shared memory and stream; no attributes."""

    _fields_ = [("gridDimX", _c_uint), ("gridDimY", _c_uint), ("gridDimZ", _c_uint), ("blockDimX", _c_uint),
                ("blockDimY", _c_uint), ("blockDimZ", _c_uint), ("sharedMemBytes", _c_uint), ("hStream", _c_void_p),
                ("attrs", _c_void_p), ("numAttrs", _c_uint)]


class CudaDriverError(RuntimeError):
    """A CUDA driver call returned an error (``status`` is its ``CUresult``)."""

    def __init__(self, call: str, status: int, name: str, description: str):
        self.call, self.status, self.name = call, status, name
        super().__init__(f"{call} failed: {name} ({status}): {description}")


class CudaDriver:
    """ctypes bindings of the driver calls the runtime uses, on one loaded driver library.

    Args:
        library: the shared library to bind (default ``libcuda.so.1``); tests pass another.

    Raises:
        OSError: the library cannot be loaded (no NVIDIA driver on this machine), or lacks an entry
            point; the message names the library and the missing symbol.
    """

    def __init__(self, library: str = LIBRARY):
        try:
            self._lib = ctypes.CDLL(library)
        except OSError as exc:
            raise OSError(f"cannot load the CUDA driver library {library!r} ({exc}); running jitattn kernels "
                          f"needs an NVIDIA GPU with its driver installed") from exc
        for name, argtypes in _SIGNATURES.items():
            try:
                fn = getattr(self._lib, name)
            except AttributeError as exc:
                raise OSError(f"the CUDA driver library {library!r} has no {name}; the driver is too old for "
                              f"jitattn (needs CUDA 12 or newer)") from exc
            fn.argtypes, fn.restype = argtypes, _c_int
            setattr(self, "_" + name, fn)
        # The per-layer launch once more, without argtypes: its config and function made once per launch tuple
        # (_remember_launch); ctypes converts each argument per call: cuLaunchKernelEx has 4, cuLaunchKernel 11.
        self._launch_raw = self._lib["cuLaunchKernelEx"]  # a function object of its own: no argtypes
        self._launch_raw.restype = _c_int
        self._launches: dict[tuple, tuple] = {}  # (function, grid, block, smem, stream) -> (config, function)

    def _check(self, call: str, status: int) -> None:
        if status == 0:
            return
        name, text = _c_char_p(), _c_char_p()
        got_name = self._cuGetErrorName(status, ctypes.byref(name)) == 0 and name.value
        got_text = self._cuGetErrorString(status, ctypes.byref(text)) == 0 and text.value
        raise CudaDriverError(call, status, name.value.decode() if got_name else "CUDA_ERROR_UNKNOWN",
                              text.value.decode() if got_text else "no description from the driver")

    def module_load_data(self, image: bytes) -> int:
        """``cuModuleLoadData``: load a cubin image (these exact bytes) into the current context.

        Returns:
            The ``CUmodule`` handle (an int).

        Raises:
            CudaDriverError: e.g. ``CUDA_ERROR_NO_BINARY_FOR_GPU`` for a cubin of another arch,
                ``CUDA_ERROR_INVALID_IMAGE`` for a damaged one.
        """
        handle = _c_void_p()
        self._check("cuModuleLoadData", self._cuModuleLoadData(ctypes.byref(handle), image))
        return int(handle.value)

    def module_unload(self, module: int) -> None:
        """``cuModuleUnload``."""
        self._check("cuModuleUnload", self._cuModuleUnload(module))

    def module_get_function(self, module: int, name: str) -> int:
        """``cuModuleGetFunction``: the ``CUfunction`` of a kernel by its (mangled) symbol name.

        Raises:
            CudaDriverError: ``CUDA_ERROR_NOT_FOUND`` when the module has no such kernel.
        """
        fn = _c_void_p()
        self._check(f"cuModuleGetFunction({name})", self._cuModuleGetFunction(ctypes.byref(fn), module, name.encode()))
        return int(fn.value)

    def module_get_global(self, module: int, name: str) -> tuple[int, int]:
        """``cuModuleGetGlobal_v2``: a ``__device__`` / ``__constant__`` variable's device address and size in bytes."""
        ptr, size = ctypes.c_uint64(), _c_size_t()
        self._check(f"cuModuleGetGlobal({name})",
                    self._cuModuleGetGlobal_v2(ctypes.byref(ptr), ctypes.byref(size), module, name.encode()))
        return int(ptr.value), int(size.value)

    def func_set_attribute(self, function: int, attribute: int, value: int) -> None:
        """``cuFuncSetAttribute`` (e.g. ``CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES``, bytes)."""
        self._check("cuFuncSetAttribute", self._cuFuncSetAttribute(function, attribute, value))

    def occupancy_max_active_blocks_per_multiprocessor(self, function: int, block_threads: int,
                                                        dynamic_smem: int) -> int:
        """``cuOccupancyMaxActiveBlocksPerMultiprocessor``: resident blocks per SM (registers, smem, threads)."""
        blocks = _c_int()
        self._check("cuOccupancyMaxActiveBlocksPerMultiprocessor",
                    self._cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(blocks), function, block_threads,
                                                                       dynamic_smem))
        return int(blocks.value)

    def event_create(self, flags: int = CU_EVENT_DISABLE_TIMING) -> int:
        """``cuEventCreate`` in the current context (default: no timing, the cheapest to record); the ``CUevent``."""
        event = _c_void_p()
        self._check("cuEventCreate", self._cuEventCreate(ctypes.byref(event), flags))
        return int(event.value)

    def event_destroy(self, event: int) -> None:
        """``cuEventDestroy_v2``."""
        self._check("cuEventDestroy", self._cuEventDestroy_v2(event))

    def record_and_wait(self, event: int, stream: int, waiter: int) -> None:
        """``cuEventRecord(event, stream)``, then ``cuStreamWaitEvent(waiter, event, 0)``: ``waiter``'s later work
        waits for what ``stream`` has queued so far (under CUDA graph capture, a fork or a join of the capture).
        A raw handle of 0 names the current context's default stream."""
        status = self._cuEventRecord(event, stream)
        if status:
            self._check("cuEventRecord", status)
        status = self._cuStreamWaitEvent(waiter, event, 0)
        if status:
            self._check("cuStreamWaitEvent", status)

    def launch_kernel(self, function: int, grid: tuple[int, int, int], block: tuple[int, int, int], smem: int,
                      stream: int, params: bytes) -> None:
        """``cuLaunchKernelEx`` (no launch attributes: ``cuLaunchKernel``'s launch) of a kernel that takes one
        by-value struct argument.

        Args:
            function: the ``CUfunction``.
            grid, block: dimensions (blocks, threads), tuples of three ints (the memo's key: hashable).
            smem: dynamic shared memory in bytes.
            stream: the raw ``CUstream`` handle (``torch.cuda.current_stream().cuda_stream``; 0 = legacy default).
            params: the struct's bytes; the driver copies them before returning.

        Raises:
            CudaDriverError: the driver refused the launch.
            TypeError, OverflowError: a dimension, size or handle that is not an int of its C type's range.
        """
        key = (function, grid, block, smem, stream)
        fixed = self._launches.get(key)
        if fixed is None:
            fixed = _remember_launch(self._launches, key)
        args = getattr(_launch_args, "buffers", None)
        if args is None or args[2] < len(params):
            args = _launch_args.buffers = _argument_buffers(len(params))
        args[0].raw = params  # into this thread's buffer (ctypes releases the GIL in the launch); no foreign call
        status = self._launch_raw(fixed[0], fixed[1], args[1], None)
        if status:
            self._check("cuLaunchKernelEx", status)


def _remember_launch(made: dict[tuple, tuple], key: tuple) -> tuple:
    """A launch's ``CUlaunchConfig`` (by reference) and function handle, made (and range-checked) once per distinct
    ``(function, grid, block, smem, stream)``: a plan's launches repeat theirs every layer. At most
    :data:`_MAX_LAUNCHES` tuples are kept (then all are dropped: a process that plans many batch shapes
    remakes the few it uses)."""
    found = _launch_arguments(key)
    if len(made) >= _MAX_LAUNCHES:
        made.clear()
    made[key] = found
    return found


_MAX_LAUNCHES = 4096


def _integer(name: str, value: Any) -> int:
    """``value`` as a Python int: an int or what stands for one (``__index__``: numpy's integers), as argtypes took."""
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}") from None


def _uint(name: str, value: Any) -> int:
    """An ``unsigned int`` field, refused outside its range (a ctypes field would wrap a negative one silently)."""
    value = _integer(f"cuLaunchKernelEx {name}", value)
    if not 0 <= value < 1 << 32:
        raise OverflowError(f"cuLaunchKernelEx {name}={value}: outside unsigned int's range")
    return value


def _handle(name: str, value: Any) -> int:
    """A handle (pointer-sized): a non-negative int below 2^64; 0 or None for NULL."""
    value = 0 if value is None else _integer(name, value)
    if not 0 <= value < 1 << 64:
        raise OverflowError(f"{name}={value}: not a pointer-sized handle")
    return value


def _launch_arguments(key: tuple) -> tuple:
    function, grid, block, smem, stream = key
    if len(grid) != 3 or len(block) != 3:
        raise TypeError(f"cuLaunchKernelEx grid={grid}, block={block}: expected three dimensions each")
    function = _handle("cuLaunchKernelEx function", function)
    dims = [_uint(f"grid[{i}]", d) for i, d in enumerate(grid)] + [_uint(f"block[{i}]", d) for i, d in enumerate(block)]
    config = LaunchConfig(*dims, _uint("sharedMemBytes", smem), _handle("cuLaunchKernelEx stream", stream), None, 0)
    return ctypes.byref(config), _c_void_p(function)  # the reference keeps the config alive


#: Per thread: a struct-argument buffer and the one-entry argument array pointing at it, made once (the
#: driver copies the bytes before cuLaunchKernelEx returns, so the next launch may overwrite them).
_launch_args = threading.local()


def _argument_buffers(size: int) -> tuple[ctypes.Array, ctypes.Array, int]:
    size = max(size, 4096)
    buf = (ctypes.c_char * size)()
    return buf, (_c_void_p * 1)(ctypes.addressof(buf)), size


_driver: CudaDriver | None = None
_lock = threading.Lock()


def driver() -> CudaDriver:
    """The process's :class:`CudaDriver` (bound on first use; binding takes well under a millisecond)."""
    global _driver
    if _driver is None:
        with _lock:
            if _driver is None:
                _driver = CudaDriver()
    return _driver
