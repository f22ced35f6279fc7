"""The ctypes driver binding (jitattn.cuda_driver) against a fake driver library built here with the C compiler.

The fake implements the eight entry points with the signatures of cuda.h and records what it was
given, so these tests check on the CPU what the GPU tests cannot see directly: argument order and
widths (a 64-bit device pointer, size_t sizes, the launch's eleven arguments), that the struct bytes
reach the driver, and that a failing CUresult becomes a CudaDriverError that names the call and the
error. The real library is exercised by every GPU test (the runtime launches through this binding).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import re
import shutil
import struct
import subprocess
import sys

import pytest

from jitattn.cuda_driver import CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, CudaDriver, CudaDriverError

_FAKE = r"""
#include <stddef.h>
#include <stdint.h>
#include <string.h>
typedef int CUresult;
typedef void *CUmodule, *CUfunction, *CUstream;
typedef unsigned long long CUdeviceptr;
/* Recorded calls: rec[0..] = the integer arguments of the last call; params = the launch's struct bytes. */
long long rec[16];
unsigned char params[32];
CUresult cuModuleLoadData(CUmodule *module, const void *image) {
  if (memcmp(image, "BAD", 3) == 0) return 200;              /* CUDA_ERROR_INVALID_IMAGE */
  *module = (CUmodule)(uintptr_t)(0x10000 + strlen((const char *)image));
  return 0;
}
CUresult cuModuleUnload(CUmodule m) { rec[0] = (long long)(uintptr_t)m; return 0; }
CUresult cuModuleGetFunction(CUfunction *f, CUmodule m, const char *name) {
  if (strcmp(name, "missing") == 0) return 500;                /* CUDA_ERROR_NOT_FOUND */
  *f = (CUfunction)((uintptr_t)m + 0x100 + strlen(name));
  return 0;
}
CUresult cuModuleGetGlobal_v2(CUdeviceptr *dptr, size_t *bytes, CUmodule m, const char *name) {
  *dptr = 0x7f0000000000ULL + (uintptr_t)m;                   /* above 2^32: a truncated pointer shows */
  *bytes = ((size_t)1 << 33) + strlen(name);                  /* above 2^32: a 32-bit size_t shows */
  return 0;
}
CUresult cuFuncSetAttribute(CUfunction f, int attrib, int value) {
  rec[0] = (long long)(uintptr_t)f; rec[1] = attrib; rec[2] = value; return 0;
}
CUresult cuOccupancyMaxActiveBlocksPerMultiprocessor(int *n, CUfunction f, int block, size_t smem) {
  rec[0] = (long long)(uintptr_t)f; rec[1] = block; rec[2] = (long long)smem;
  *n = 2048 / block;
  return 0;
}
CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                        unsigned bz, unsigned smem, CUstream s, void **kernel_params, void **extra) {
  rec[0] = (long long)(uintptr_t)f; rec[1] = gx; rec[2] = gy; rec[3] = gz; rec[4] = bx; rec[5] = by;
  rec[6] = bz; rec[7] = smem; rec[8] = (long long)(uintptr_t)s; rec[9] = extra == NULL;
  memcpy(params, kernel_params[0], sizeof(params));
  return gx == 0 ? 1 : 0;                                       /* CUDA_ERROR_INVALID_VALUE */
}
typedef void *CUevent;
CUresult cuEventCreate(CUevent *e, unsigned flags) {
  rec[0] = flags; *e = (CUevent)(uintptr_t)0x5E0000000001ULL; return 0;
}
CUresult cuEventDestroy_v2(CUevent e) { rec[0] = (long long)(uintptr_t)e; return 0; }
/* rec[10..12]: the event and stream recorded, then rec[13..15]: the waiting stream, the event, the flags */
CUresult cuEventRecord(CUevent e, CUstream s) {
  rec[10] = (long long)(uintptr_t)e; rec[11] = (long long)(uintptr_t)s; rec[12] = 1;
  return s == (CUstream)(uintptr_t)0xBAD ? 201 : 0;               /* CUDA_ERROR_INVALID_CONTEXT */
}
CUresult cuStreamWaitEvent(CUstream s, CUevent e, unsigned flags) {
  rec[13] = (long long)(uintptr_t)s; rec[14] = (long long)(uintptr_t)e; rec[15] = flags; return 0;
}
CUresult cuGetErrorName(CUresult e, const char **s) {
  *s = e == 200 ? "CUDA_ERROR_INVALID_IMAGE" : e == 500 ? "CUDA_ERROR_NOT_FOUND"
     : e == 1 ? "CUDA_ERROR_INVALID_VALUE" : e == 201 ? "CUDA_ERROR_INVALID_CONTEXT" : NULL;
  return *s ? 0 : 1;
}
CUresult cuGetErrorString(CUresult e, const char **s) {
  *s = e == 200 ? "device kernel image is invalid" : e == 500 ? "named symbol not found"
     : e == 1 ? "invalid argument" : e == 201 ? "invalid device context" : NULL;
  return *s ? 0 : 1;
}
"""


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or not sys.platform.startswith("linux"):
        pytest.skip("needs a C compiler on Linux (nvcc needs one too)")
    d = tmp_path_factory.mktemp("fake_driver")
    (d / "fake_cuda.c").write_text(_FAKE)
    lib = d / "libfakecuda.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(lib), str(d / "fake_cuda.c")], check=True)
    drv = CudaDriver(str(lib))
    raw = ctypes.CDLL(str(lib))
    return drv, (ctypes.c_longlong * 16).in_dll(raw, "rec"), (ctypes.c_ubyte * 32).in_dll(raw, "params")


def test_module_load_and_lookups(fake):
    drv, rec, _ = fake
    module = drv.module_load_data(b"cubin-bytes\0")
    assert module == 0x10000 + len(b"cubin-bytes")
    fn = drv.module_get_function(module, "paged_decode_kernel")
    assert fn == module + 0x100 + len("paged_decode_kernel")
    ptr, size = drv.module_get_global(module, "kGeometry")
    assert ptr == 0x7F0000000000 + module and size == (1 << 33) + len("kGeometry")
    drv.module_unload(module)
    assert rec[0] == module


def test_attribute_occupancy_and_launch_arguments(fake):
    drv, rec, params = fake
    fn = 0x123456789A  # above 2^32: a pointer truncated to 32 bits would show
    drv.func_set_attribute(fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, 227 * 1024)
    assert list(rec[:3]) == [fn, 8, 227 * 1024]
    assert drv.occupancy_max_active_blocks_per_multiprocessor(fn, 256, 100_000) == 8
    assert list(rec[:3]) == [fn, 256, 100_000]
    payload = struct.pack("<QqifQ", 0xDEADBEEFCAFE, -5, 7, 0.5, 2**63 + 1)
    drv.launch_kernel(fn, (132, 8, 3), (384, 1, 1), 230_000, 0x55AA0000F0, payload)
    assert list(rec[:10]) == [fn, 132, 8, 3, 384, 1, 1, 230_000, 0x55AA0000F0, 1]
    assert bytes(params[:len(payload)]) == payload


def test_events_record_then_wait(fake):
    """The fork / join of a mixed batch: the event recorded on one stream, then waited on by the other; a
    failed record raises naming the call, and nothing waits."""
    drv, rec, _ = fake
    event = drv.event_create()
    assert event == 0x5E0000000001 and rec[0] == 2  # CU_EVENT_DISABLE_TIMING
    main, side = 0x7F00000000A0, 0x7F00000000B0
    rec[10:16] = [0] * 6
    drv.record_and_wait(event, main, side)
    assert list(rec[10:16]) == [event, main, 1, side, event, 0]
    rec[10:16] = [0] * 6
    with pytest.raises(CudaDriverError, match=r"cuEventRecord failed: CUDA_ERROR_INVALID_CONTEXT \(201\)"):
        drv.record_and_wait(event, 0xBAD, side)
    assert rec[13] == 0  # no wait after a failed record
    drv.event_destroy(event)
    assert rec[0] == event


def test_errors_name_the_call_and_the_cuda_error(fake):
    drv, _, _ = fake
    with pytest.raises(CudaDriverError, match=r"cuModuleLoadData failed: CUDA_ERROR_INVALID_IMAGE \(200\): "
                                              r"device kernel image is invalid") as info:
        drv.module_load_data(b"BAD image")
    assert info.value.status == 200 and info.value.name == "CUDA_ERROR_INVALID_IMAGE"
    with pytest.raises(CudaDriverError, match=r"cuModuleGetFunction\(missing\) failed: CUDA_ERROR_NOT_FOUND"):
        drv.module_get_function(0x10000, "missing")
    with pytest.raises(CudaDriverError, match=r"cuLaunchKernel failed: CUDA_ERROR_INVALID_VALUE \(1\)"):
        drv.launch_kernel(1, (0, 1, 1), (32, 1, 1), 0, 0, b"\0" * 8)


def test_missing_library_or_symbol_is_a_clear_error(tmp_path, fake):
    with pytest.raises(OSError, match=r"cannot load the CUDA driver library .*no-such-libcuda.*NVIDIA GPU"):
        CudaDriver(str(tmp_path / "no-such-libcuda.so.1"))
    # A library without the entry points (libc here): named symbol, and why.
    libc = ctypes.util.find_library("c")
    with pytest.raises(OSError, match=r"has no cuModuleLoadData; the driver is too old"):
        CudaDriver(libc)


def test_loading_the_runtime_does_not_import_cupy():
    """The binding replaced CuPy's: importing the runtime (and binding the driver) pulls in no cupy."""
    code = ("import sys, jitattn, jitattn.runtime, jitattn.cuda_driver; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('cupy', 'cupy_backends')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_nothing_a_user_runs_or_installs_needs_cupy():
    """CuPy is gone: no install extra, script or example imports or pins it (tests/run_gpu.sh imported
    it for the device banner, which then printed a ModuleNotFoundError instead of torch's version)."""
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    files = [repo / "pyproject.toml", repo / ".ci" / "run", repo / "tests" / "run_gpu.sh",
             *sorted((repo / "examples").rglob("*.py")), *sorted((repo / "jitattn").rglob("*.py"))]
    uses = re.compile(r"import\s+[\w., ]*\bcupy\b|\bfrom\s+cupy\b|\bcupy\.\w|[\"']cupy")
    for path in files:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            assert not uses.search(line.split("#")[0]), f"{path}:{n}: {line}"
