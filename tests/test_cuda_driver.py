"""The ctypes driver binding (jitattn.cuda_driver) against a fake driver library built here with the C compiler.

The fake (tests/fake_cuda_driver.py) implements the entry points with the signatures of cuda.h and
records what it was given, so these tests check on the CPU what the GPU tests cannot see directly: argument order and
widths (a 64-bit device pointer, size_t sizes, the launch's CUlaunchConfig fields), that the struct bytes
reach the driver, and that a failing CUresult becomes a CudaDriverError that names the call and the
error. The real library is exercised by every GPU test (the runtime launches through this binding).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import re
import struct
import subprocess
import sys

import pytest

from jitattn import cuda_driver
from jitattn.cuda_driver import CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, CudaDriver, CudaDriverError
from tests.fake_cuda_driver import build


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    lib = build(tmp_path_factory.mktemp("fake_driver"))
    if lib is None:
        pytest.skip("needs a C compiler on Linux (nvcc needs one too)")
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


def test_launch_config_is_cuda_hs_layout():
    """CUlaunchConfig as cuda.h lays it out on a 64-bit host (the fake library reads every field through its C
    struct: test_attribute_occupancy_and_launch_arguments)."""
    cfg = cuda_driver.LaunchConfig
    assert ctypes.sizeof(cfg) == 56
    assert (cfg.sharedMemBytes.offset, cfg.hStream.offset, cfg.attrs.offset, cfg.numAttrs.offset) == (24, 32, 40, 48)


def test_launch_config_matches_the_toolkits_cuda_h(tmp_path):
    """The same offsets from the CUDA toolkit's own cuda.h, compiled by its nvcc (host code only); skipped
    where nvcc cannot build a host program."""
    from jitattn import settings

    probe = tmp_path / "probe.cpp"
    fields = ", ".join(f"offsetof(CUlaunchConfig, {f})" for f in ("sharedMemBytes", "hStream", "attrs", "numAttrs"))
    probe.write_text("#include <cuda.h>\n#include <stddef.h>\n#include <stdio.h>\n"
                     f"int main() {{ printf(\"%zu %zu %zu %zu %zu\", sizeof(CUlaunchConfig), {fields}); return 0; }}\n")
    try:
        subprocess.run([settings.nvcc(), "-o", str(tmp_path / "probe"), str(probe)], check=True, capture_output=True,
                       timeout=120)
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"nvcc cannot build a host program here: {exc}")
    got = subprocess.run([str(tmp_path / "probe")], check=True, capture_output=True, text=True).stdout.split()
    cfg = cuda_driver.LaunchConfig
    assert [int(n) for n in got] == [ctypes.sizeof(cfg), cfg.sharedMemBytes.offset, cfg.hStream.offset,
                                     cfg.attrs.offset, cfg.numAttrs.offset]


def test_cubin_module_launches_with_its_devices_context_current(fake, monkeypatch):
    """CubinModule.launch on the binding: launched at once where its device is current on this thread and was
    made current here before; else made current for the launch and the caller's device restored."""
    import threading

    import torch

    from jitattn import runtime

    drv, rec, params = fake
    module = object.__new__(runtime.CubinModule)
    module._driver, module.device_index, module.functions = drv, 1, {"decode": 0x123456789A}
    current, switched = [0], []

    def set_device(index):
        switched.append(index)
        current[0] = index

    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: current[0], raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(runtime, "_thread_state", threading.local())
    for i, (device, want) in enumerate([(0, [1, 0]), (1, []), (1, []), (0, [1, 0])]):
        current[0], switched[:] = device, []
        payload = struct.pack("<QQ", i, 0xABC)
        module.launch("decode", (3, 2, 1), 128, 4096, payload, 0x55AA0000F0)
        assert switched == want and current[0] == device, i
        assert list(rec[:10]) == [0x123456789A, 3, 2, 1, 128, 1, 1, 4096, 0x55AA0000F0, 1]
        assert bytes(params[:16]) == payload


def test_launch_arguments_made_once_per_tuple_are_each_launchs_own(fake, monkeypatch):
    """The per-layer launch converts its arguments once per (function, grid, block, smem, stream): each
    launch still reaches the driver with its own, also after the memo is full and dropped."""
    drv, rec, params = fake
    monkeypatch.setattr(cuda_driver, "_MAX_LAUNCHES", 2)
    calls = [(0x123456789A, (132, 8, 3), (384, 1, 1), 230_000, 0x55AA0000F0),
             (0x123456789A, (132, 8, 3), (384, 1, 1), 230_000, 0x66BB0000F0),  # another stream only
             (0x1234567800, (1, 1, 1), (128, 1, 1), 0, 0),  # the memo is full here: dropped, then kept
             (0x123456789A, (132, 8, 3), (384, 1, 1), 230_000, 0x55AA0000F0)]
    for i, (fn, grid, block, smem, stream) in enumerate(calls * 2):
        payload = struct.pack("<QQ", i, ~i & 0xFFFF)
        drv.launch_kernel(fn, grid, block, smem, stream, payload)
        assert list(rec[:10]) == [fn, *grid, *block, smem, stream, 1]
        assert bytes(params[:16]) == payload
        assert len(drv._launches) <= 2


@pytest.mark.parametrize("grid, block, smem, error, match", [
    ((-1, 1, 1), (128, 1, 1), 0, OverflowError, r"grid\[0\]=-1: outside unsigned int"),
    ((1, 1, 1), (128, 1, 1), 1 << 32, OverflowError, r"sharedMemBytes=4294967296"),
    ((1.0, 1, 1), (128, 1, 1), 0, TypeError, r"grid\[0\]: expected an int, got float"),
    ((1, 1), (128, 1, 1), 0, TypeError, r"expected three dimensions"),
    ((1 << 32, 1, 1), (128, 1, 1), 0, OverflowError, r"grid\[0\]=4294967296: outside unsigned int"),
])
def test_launch_arguments_out_of_range_are_refused_not_wrapped(fake, grid, block, smem, error, match):
    drv, rec, _ = fake
    rec[1] = 77
    with pytest.raises(error, match=match):
        drv.launch_kernel(0x10, grid, block, smem, 0, b"\0" * 8)
    assert rec[1] == 77  # nothing launched
    with pytest.raises(OverflowError, match=r"cuLaunchKernelEx stream=-1: not a pointer-sized handle"):
        drv.launch_kernel(0x10, (1, 1, 1), (32, 1, 1), 0, -1, b"\0" * 8)
    with pytest.raises(OverflowError, match=r"cuLaunchKernelEx function=18446744073709551616: not a pointer-sized"):
        drv.launch_kernel(1 << 64, (1, 1, 1), (32, 1, 1), 0, 0, b"\0" * 8)


def test_launch_arguments_take_what_argtypes_took(fake):
    """Integers that stand for ints (numpy's, through ``__index__``) and None for a NULL stream, as the
    argtypes call took them; they reach the driver as their values."""
    np = pytest.importorskip("numpy")
    drv, rec, _ = fake
    drv.launch_kernel(np.uint64(0x123456789A), (np.int64(5), np.int32(2), 1), (np.int64(96), 1, 1), np.int64(1024),
                      None, b"\0" * 8)
    assert list(rec[:9]) == [0x123456789A, 5, 2, 1, 96, 1, 1, 1024, 0]


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
    drv.record_and_wait(event + 1, side, main)  # the join: another event, the streams the other way
    assert list(rec[10:16]) == [event + 1, side, 1, main, event + 1, 0]
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
    with pytest.raises(CudaDriverError, match=r"cuLaunchKernelEx failed: CUDA_ERROR_INVALID_VALUE \(1\)"):
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
