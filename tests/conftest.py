"""Shared pytest setup.

- ``gpu`` tests run only where torch sees a CUDA device; elsewhere they are skipped
  with that reason (CI has no GPU; the device runs them: see GPU_TESTS.md).
- Every test gets its own empty cache root unless it asks for the session-wide one (``session_cache``),
  so no test sees another's entries by accident and nothing touches the user's real cache.
- When ``JITATTN_GPU_RESULTS`` names a file, each gpu test appends one JSON line with its outcome
  and the numbers it recorded (``record`` fixture), for the committed GPU results.
- Seeds: a run draws one session seed (``JITATTN_TEST_SEED``, else fresh from ``os.urandom``), printed
  in pytest's header; each test's seed (``seed`` fixture) is the session seed mixed with the test's id.
  A gpu test also starts with torch's global generators seeded with it (so unseeded draws, CUDA-graph
  replay inputs included, are reproducible), and its JSON line carries ``seed`` and ``session_seed``:
  ``JITATTN_TEST_SEED=<session_seed>`` replays the run's inputs.
"""

from __future__ import annotations

import json
import os
import time
import zlib
from pathlib import Path

import pytest



def _gpu_available() -> tuple[bool, str]:
    try:
        import torch
    except ImportError:
        return False, "torch is not installed"
    if not torch.cuda.is_available():
        return False, "no CUDA device visible to torch"
    return True, ""


GPU_OK, GPU_REASON = _gpu_available()


def _session_seed() -> int:
    fixed = os.environ.get("JITATTN_TEST_SEED", "").strip()
    if not fixed:
        return int.from_bytes(os.urandom(4), "little") % 1_000_000
    try:
        return int(fixed)
    except ValueError:
        raise pytest.UsageError(f"JITATTN_TEST_SEED={fixed!r}: expected an int (a session_seed of a GPU results "
                                f"line)") from None


#: This run's seed: fresh inputs every run, the same ones again with JITATTN_TEST_SEED.
SESSION_SEED = _session_seed()
#: Written into outputs before a launch whose test expects NaN rows: finite and far beyond any output
#: of these inputs, so a kernel that skips such a row leaves it (NaN poison would pass for written NaN).
NOT_WRITTEN = 16384.0


def seed_of(nodeid: str) -> int:
    """The seed of the test ``nodeid`` in this run (the session seed mixed with the id)."""
    return (SESSION_SEED + zlib.crc32(nodeid.encode())) % (1 << 31)


def pytest_report_header(config):
    return f"jitattn test seed: {SESSION_SEED} (JITATTN_TEST_SEED={SESSION_SEED} draws the same inputs again)"


def pytest_collection_modifyitems(config, items):
    if GPU_OK:
        return
    skip = pytest.mark.skip(reason=f"gpu test: {GPU_REASON}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seeded(request):
    """Every test knows its seed; a gpu test starts with torch's generators (CPU and CUDA) seeded by it."""
    request.node._jitattn_seed = seed_of(request.node.nodeid)
    if "gpu" in request.node.keywords and GPU_OK:
        import torch

        torch.manual_seed(request.node._jitattn_seed)


@pytest.fixture
def seed(request, _seeded) -> int:
    """This test's seed: random per run, recorded in its GPU results line (``JITATTN_TEST_SEED`` to replay)."""
    return request.node._jitattn_seed


@pytest.fixture(autouse=True)
def _isolated_cache(request, tmp_path_factory, monkeypatch):
    if "session_cache" in request.fixturenames:
        return
    root = tmp_path_factory.mktemp("jitattn-cache")
    monkeypatch.setenv("JITATTN_CACHE_DIR", str(root))
    monkeypatch.delenv("JITATTN_CACHE_PATH", raising=False)
    monkeypatch.delenv("JITATTN_DISABLE_JIT", raising=False)


@pytest.fixture(scope="session")
def session_cache_dir(tmp_path_factory) -> Path:
    """One cache root for the whole session (``JITATTN_TEST_CACHE`` to reuse one across runs)."""
    fixed = os.environ.get("JITATTN_TEST_CACHE")
    return Path(fixed) if fixed else tmp_path_factory.mktemp("jitattn-session-cache")


@pytest.fixture
def session_cache(session_cache_dir, monkeypatch) -> Path:
    monkeypatch.setenv("JITATTN_CACHE_DIR", str(session_cache_dir))
    monkeypatch.delenv("JITATTN_CACHE_PATH", raising=False)
    monkeypatch.delenv("JITATTN_DISABLE_JIT", raising=False)
    return session_cache_dir


#: Tolerance of a kernel against the fp32 reference (norm-wise relative error), by query dtype.
GPU_TOL = {"bfloat16": 1e-2, "float16": 5e-3}


def replay_on_new_q(call, q, out, seed: int) -> None:
    """Capture ``call()`` (which writes ``out``) in a CUDA graph on a fresh stream, then write new random
    values into ``q`` (standard normal drawn from ``seed``: the test's, so it is recorded), poison ``out``
    with NaN and replay: ``out`` then holds the kernels' answer for the new ``q`` (needs a CUDA device;
    the kernels must be loaded before, outside the capture)."""
    import torch

    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        call()
    gen = torch.Generator(device=q.device).manual_seed(seed + 1)  # not the batch's own draw
    q.copy_(torch.randn(q.shape, generator=gen, device=q.device).to(q.dtype))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()


def precompile(specs, root: Path) -> None:
    """Build every spec for this GPU's arch up front, in parallel (device time is the scarce thing)."""
    import torch

    from jitattn.build import archs_for_capability
    from jitattn.cache import KernelCache

    if not torch.cuda.is_available():
        return
    from concurrent.futures import ThreadPoolExecutor

    arch = archs_for_capability(*torch.cuda.get_device_capability())[0]
    cache = KernelCache(root=root, layers=())
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 4) as pool:
        list(pool.map(lambda s: cache.get_or_build(s, arch), list(dict.fromkeys(specs))))


def build_in_parallel(root: Path, work) -> dict:
    """Build every ``(spec, arch)`` of ``work`` into a fresh cache at ``root``, in parallel (nvcc only).

    Returns ``(spec, arch) -> CacheEntry``, or the exception its build raised, so that each test
    reports its own (spec, arch) instead of the whole module failing on the first error.
    """
    from concurrent.futures import ThreadPoolExecutor

    from jitattn.cache import KernelCache

    cache = KernelCache(root=root, layers=())

    def build(item):
        try:
            return item, cache.get_or_build(*item)[0]
        except Exception as exc:  # noqa: BLE001 - reported by the test of that (spec, arch)
            return item, exc

    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        return dict(pool.map(build, list(dict.fromkeys(work))))


def built(compiled: dict, spec, arch: str):
    """The entry :func:`build_in_parallel` made for ``(spec, arch)``; the test fails with its build error."""
    entry = compiled[(spec, arch)]
    if isinstance(entry, Exception):
        pytest.fail(f"{type(entry).__name__}: {entry}", pytrace=False)
    return entry


@pytest.fixture
def record(request):
    """Call ``record(key=value, ...)`` to attach numbers to this test's line in the GPU results file."""
    data: dict = {}
    request.node._jitattn_record = data
    return data.update


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    path = os.environ.get("JITATTN_GPU_RESULTS")
    if not path or "gpu" not in item.keywords:
        return
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        line = {"test": item.nodeid, "outcome": report.outcome, "seconds": round(report.duration, 3),
                "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "seed": seed_of(item.nodeid),
                "session_seed": SESSION_SEED, **getattr(item, "_jitattn_record", {})}
        if report.outcome == "failed":
            line["error"] = str(report.longrepr)[-1500:]
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")
