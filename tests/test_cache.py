"""The kernel cache with real processes and real nvcc: hits without compiling, atomic publish, locks,
corruption, read-only layers, JITATTN_DISABLE_JIT and machines without nvcc.

nvcc is replaced where a test must see what ran: ``JITATTN_NVCC`` points at a small script that logs
every call, then either runs the real nvcc, refuses to compile (exit 1, loudly), or claims another
version.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from jitattn import AttentionSpec, settings
from jitattn.build import BuildError
from jitattn.cache import (MANIFEST, CacheWriteError, KernelCache, MissingKernelError, key_inputs, verify_entry)
from jitattn.render import render

SPEC = AttentionSpec(8, 2, 64, page_size=16)  # small: ~1 s per compile
REAL_NVCC = settings.nvcc()
REPO = Path(__file__).resolve().parent.parent


def fake_nvcc(tmp_path: Path, mode: str = "record", *, sleep: float = 0.0, name: str | None = None) -> tuple[Path, Path]:
    """A stand-in nvcc: logs each call's arguments to the returned log, then acts by ``mode``.

    record: run the real nvcc. no-compile: answer --version, fail loudly on anything else.
    other-version: claim release 99.9 for --version, compile with the real nvcc.
    """
    script, log = tmp_path / (name or f"nvcc-{mode}"), tmp_path / f"{name or mode}.log"
    version = {"record": f'exec "{REAL_NVCC}" --version',
               "no-compile": f'exec "{REAL_NVCC}" --version',
               "other-version": 'echo "Cuda compilation tools, release 99.9, V99.9.1"; exit 0'}[mode]
    compile_ = {"record": f'exec "{REAL_NVCC}" "$@"',
                "no-compile": 'echo "FAKE NVCC: this run must not compile anything" >&2; exit 1',
                "other-version": f'exec "{REAL_NVCC}" "$@"'}[mode]
    script.write_text(f"""#!/bin/sh
echo "$*" >> "{log}"
if [ "$1" = "--version" ]; then {version}; fi
sleep {sleep}
{compile_}
""")
    script.chmod(0o755)
    return script, log


def compile_calls(log: Path) -> list[str]:
    return [ln for ln in log.read_text().splitlines() if "--version" not in ln] if log.exists() else []


_CHILD = """
import json, sys
from jitattn import AttentionSpec
from jitattn.cache import KernelCache
entry, built = KernelCache().get_or_build(AttentionSpec.from_json(sys.argv[1]), sys.argv[2])
print(json.dumps({"built": built, "key": entry.key, "path": str(entry.path)}))
"""


def child_env() -> dict[str, str]:
    """This process's environment without jitattn settings, with the checkout importable."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("JITATTN_")}, "PYTHONPATH": str(REPO)}


def run_child(env: dict[str, str], spec: AttentionSpec = SPEC, arch: str = "sm_80", check: bool = True
              ) -> subprocess.CompletedProcess:
    full = {**child_env(), **env}
    proc = subprocess.run([sys.executable, "-c", _CHILD, spec.canonical_json(), arch], capture_output=True,
                          text=True, env=full, timeout=300)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def child_result(proc: subprocess.CompletedProcess) -> dict:
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- hits across processes ---------------------------------------------------------------------
@pytest.mark.slow
def test_second_process_loads_from_disk_without_compiling(tmp_path):
    root = tmp_path / "cache"
    nvcc, log = fake_nvcc(tmp_path, "record")
    first = child_result(run_child({"JITATTN_CACHE_DIR": str(root), "JITATTN_NVCC": str(nvcc)}))
    assert first["built"] is True
    assert len(compile_calls(log)) == 1 and "-cubin" in compile_calls(log)[0]

    refusing, log2 = fake_nvcc(tmp_path, "no-compile")
    second = child_result(run_child({"JITATTN_CACHE_DIR": str(root), "JITATTN_NVCC": str(refusing)}))
    assert second == {**first, "built": False}
    assert compile_calls(log2) == []  # only `nvcc --version`, for the key
    assert log2.read_text().splitlines() == ["--version"]


@pytest.mark.slow
def test_serving_node_without_nvcc_loads_the_shipped_kernel(tmp_path):
    root = tmp_path / "cache"
    entry, built = KernelCache(root=root, layers=()).get_or_build(SPEC, "sm_90a")
    assert built
    for env in ({"JITATTN_DISABLE_JIT": "1"}, {}):  # with or without the kill switch
        got = child_result(run_child({"JITATTN_CACHE_DIR": str(root), "JITATTN_NVCC": str(tmp_path / "no-nvcc"),
                                      **env}, arch="sm_90a"))
        assert got == {"built": False, "key": entry.key, "path": str(entry.path)}


def test_miss_without_nvcc_is_a_build_error(tmp_path, monkeypatch):
    monkeypatch.setenv("JITATTN_NVCC", str(tmp_path / "no-nvcc"))
    with pytest.raises(BuildError, match=r"cannot run nvcc at .*no-nvcc"):
        KernelCache(root=tmp_path / "c", layers=()).get_or_build(SPEC, "sm_80")


@pytest.mark.slow
def test_nvcc_version_is_in_the_key_but_a_no_jit_node_takes_any_build(tmp_path, monkeypatch):
    cache = KernelCache(root=tmp_path / "cache", layers=())
    original, _ = cache.get_or_build(SPEC, "sm_80")
    other, log = fake_nvcc(tmp_path, "other-version")
    monkeypatch.setenv("JITATTN_NVCC", str(other))
    monkeypatch.setenv("JITATTN_DISABLE_JIT", "1")
    served, built = cache.get_or_build(SPEC, "sm_80")  # a serving node with another nvcc: no rebuild
    assert (served.key, built) == (original.key, False) and compile_calls(log) == []
    monkeypatch.setenv("JITATTN_DISABLE_JIT", "0")
    rebuilt, built = cache.get_or_build(SPEC, "sm_80")  # a build box with another nvcc: a new entry
    assert built and rebuilt.key != original.key and len(compile_calls(log)) == 1
    assert rebuilt.manifest["key_inputs"]["nvcc"].startswith("Cuda compilation tools, release 99.9")
    assert rebuilt.manifest["source_key"] == original.manifest["source_key"]
    monkeypatch.setenv("JITATTN_NVCC", str(tmp_path / "no-nvcc"))
    assert cache.find(SPEC, "sm_80").key in (original.key, rebuilt.key)  # the newest build of that source


# ---- atomic publish and locks ------------------------------------------------------------------
def _published(root: Path) -> list[Path]:
    return sorted(root.glob("v1/entries/*/*"))


@pytest.mark.slow
def test_publish_is_atomic_while_building(tmp_path, monkeypatch):
    nvcc, _ = fake_nvcc(tmp_path, "record", sleep=1.5)
    monkeypatch.setenv("JITATTN_NVCC", str(nvcc))
    root = tmp_path / "cache"
    seen_tmp, seen_partial, stop = [], [], threading.Event()

    def watch():
        while not stop.is_set():
            seen_tmp.extend(root.glob("v1/tmp/*"))
            for path in _published(root):
                if verify_entry(path) is not None:
                    seen_partial.append(path)
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        entry, built = KernelCache(root=root, layers=()).get_or_build(SPEC, "sm_80")
    finally:
        stop.set()
        watcher.join()
    assert built and seen_tmp, "the build should have happened in v1/tmp"
    assert seen_partial == []
    assert _published(root) == [entry.path] and verify_entry(entry.path) is None
    assert list(root.glob("v1/tmp/*")) == []
    assert (root / "v1" / "index").is_dir()


@pytest.mark.slow
def test_killed_build_leaves_no_entry_and_no_stuck_lock(tmp_path):
    root = tmp_path / "cache"
    nvcc, log = fake_nvcc(tmp_path, "record", sleep=30)
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, SPEC.canonical_json(), "sm_80"],
                            env={**child_env(), "JITATTN_CACHE_DIR": str(root),
                                 "JITATTN_NVCC": str(nvcc)}, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 60
        while not compile_calls(log) and time.time() < deadline:  # wait until the compile has started
            time.sleep(0.05)
        assert compile_calls(log), "the child never started compiling"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the child, its ninja and the sleeping nvcc
        proc.wait()
    assert _published(root) == []
    real, _ = fake_nvcc(tmp_path, "record", name="nvcc-after")
    got = child_result(run_child({"JITATTN_CACHE_DIR": str(root), "JITATTN_NVCC": str(real),
                                  "JITATTN_LOCK_TIMEOUT": "20"}))
    assert got["built"] is True and verify_entry(Path(got["path"])) is None


@pytest.mark.slow
def test_concurrent_processes_compile_once(tmp_path):
    root = tmp_path / "cache"
    nvcc, log = fake_nvcc(tmp_path, "record", sleep=1.0)
    env = {**child_env(), "JITATTN_CACHE_DIR": str(root), "JITATTN_NVCC": str(nvcc)}
    procs = [subprocess.Popen([sys.executable, "-c", _CHILD, SPEC.canonical_json(), "sm_80"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert len(compile_calls(log)) == 1
    assert sorted(r["built"] for r in results) == [False, False, True]
    assert len({r["key"] for r in results}) == 1


# ---- corruption --------------------------------------------------------------------------------
def _corrupt(entry_path: Path, how: str) -> None:
    cubin = next(entry_path.glob("*.cubin"))
    if how == "truncated cubin":
        cubin.write_bytes(cubin.read_bytes()[:1000])
    elif how == "flipped byte":
        data = bytearray(cubin.read_bytes())
        data[len(data) // 2] ^= 0xFF
        cubin.write_bytes(bytes(data))
    elif how == "missing cubin":
        cubin.unlink()
    elif how == "broken manifest":
        (entry_path / MANIFEST).write_text("{not json")


@pytest.mark.slow
@pytest.mark.parametrize("how,problem", [("truncated cubin", "does not match its sha256"),
                                         ("flipped byte", "does not match its sha256"),
                                         ("missing cubin", "missing artifact kernel.sm_80.cubin"),
                                         ("broken manifest", "unreadable manifest")])
def test_corrupt_entry_is_quarantined_then_rebuilt(tmp_path, how, problem):
    cache = KernelCache(root=tmp_path / "cache", layers=())
    entry, _ = cache.get_or_build(SPEC, "sm_80")
    _corrupt(entry.path, how)
    assert problem in verify_entry(entry.path)
    assert cache.lookup(entry.key) is None  # never loaded
    (moved,) = (tmp_path / "cache" / "v1" / "quarantine").iterdir()
    assert moved.name.startswith(entry.key) and problem in (moved / "QUARANTINED").read_text()
    assert not entry.path.exists()
    fresh, built = cache.get_or_build(SPEC, "sm_80")
    assert built and fresh.path == entry.path and verify_entry(fresh.path) is None
    assert fresh.cubin.read_bytes()[:4] == b"\x7fELF"


@pytest.mark.slow
def test_corrupt_entry_in_a_read_only_layer_is_skipped_not_moved(tmp_path):
    layer = tmp_path / "image-cache"
    entry, _ = KernelCache(root=layer, layers=()).get_or_build(SPEC, "sm_80")
    _corrupt(entry.path, "flipped byte")
    cache = KernelCache(root=tmp_path / "rw", layers=(layer,))
    assert cache.lookup(entry.key) is None
    assert entry.path.exists() and not (layer / "v1" / "quarantine").exists()
    fresh, built = cache.get_or_build(SPEC, "sm_80")  # rebuilt into the writable root
    assert built and fresh.path == cache.entry_dir(entry.key)


# ---- layers ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_read_only_layer_from_jitattn_cache_path(tmp_path, monkeypatch):
    image = tmp_path / "image"
    baked, _ = KernelCache(root=image, layers=()).get_or_build(SPEC, "sm_90a")
    before = sorted(str(p) for p in image.rglob("*"))
    rw = tmp_path / "rw"
    monkeypatch.setenv("JITATTN_CACHE_DIR", str(rw))
    monkeypatch.setenv("JITATTN_CACHE_PATH", os.pathsep.join([str(tmp_path / "absent"), str(image)]))
    monkeypatch.setenv("JITATTN_DISABLE_JIT", "1")
    cache = KernelCache()
    assert cache.layers == (tmp_path / "absent", image)
    entry, built = cache.get_or_build(SPEC, "sm_90a")
    assert (entry.path, built) == (baked.path, False)
    assert sorted(str(p) for p in image.rglob("*")) == before  # the layer is only read
    assert _published(rw) == []
    with pytest.raises(MissingKernelError):  # another arch is not in the layer
        cache.get_or_build(SPEC, "sm_80")


@pytest.mark.slow
def test_writable_root_wins_over_layers(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    in_b, _ = KernelCache(root=b, layers=()).get_or_build(SPEC, "sm_80")
    in_a, _ = KernelCache(root=a, layers=()).get_or_build(SPEC, "sm_80")
    assert KernelCache(root=a, layers=(b,)).lookup(in_a.key).path == in_a.path
    assert KernelCache(root=tmp_path / "empty", layers=(a, b)).lookup(in_a.key).path == in_a.path


# ---- JITATTN_DISABLE_JIT -------------------------------------------------------------------------
def test_disable_jit_miss_names_spec_and_warmup_command(tmp_path, monkeypatch):
    nvcc, log = fake_nvcc(tmp_path, "no-compile")
    monkeypatch.setenv("JITATTN_NVCC", str(nvcc))
    monkeypatch.setenv("JITATTN_DISABLE_JIT", "1")
    spec = AttentionSpec(16, 8, 256, logits_soft_cap=50.0, window_left=4095)
    cache = KernelCache(root=tmp_path / "c", layers=(tmp_path / "ro",))
    with pytest.raises(MissingKernelError) as info:
        cache.get_or_build(spec, "90a")
    msg = str(info.value)
    assert f"kernel {spec.name} for sm_90a" in msg and "JITATTN_DISABLE_JIT=1" in msg
    assert f"jitattn warmup --spec '{spec.canonical_json()}' --arch sm_90a" in msg
    assert f"looked in: {tmp_path / 'c'}, {tmp_path / 'ro'}" in msg
    assert compile_calls(log) == []
    assert not (tmp_path / "c" / "v1" / "locks").exists()  # nothing was even attempted


# ---- keys --------------------------------------------------------------------------------------
def test_key_covers_arch_spec_templates_flags_and_version(monkeypatch):
    import jitattn
    from jitattn import cache as cache_module

    source = render(SPEC)
    base = key_inputs(SPEC, source, "sm_80")
    assert key_inputs(SPEC, render(SPEC), "80").key == base.key  # deterministic, arch normalized
    other_spec = SPEC.replace(page_size=32)
    keys = {
        "arch": key_inputs(SPEC, source, "sm_90a").key,
        "spec": key_inputs(other_spec, render(other_spec), "sm_80").key,
        "nvcc": key_inputs(SPEC, source, "sm_80", nvcc="release 99.9").key,
    }
    monkeypatch.setattr(jitattn, "__version__", "9.9.9")
    keys["version"] = key_inputs(SPEC, source, "sm_80").key
    monkeypatch.undo()
    monkeypatch.setattr(cache_module, "template_hashes", lambda: {"decode.cuh": "0" * 64})
    keys["templates"] = key_inputs(SPEC, source, "sm_80").key
    monkeypatch.undo()
    monkeypatch.setattr(cache_module, "NVCC_FLAGS", ("-O2",))
    keys["flags"] = key_inputs(SPEC, source, "sm_80").key
    monkeypatch.undo()
    assert len(set(keys.values()) | {base.key}) == len(keys) + 1, keys
    assert key_inputs(SPEC, source, "sm_80", nvcc="release 99.9").source_key == base.source_key


@pytest.mark.slow
def test_each_arch_is_its_own_entry(tmp_path):
    cache = KernelCache(root=tmp_path, layers=())
    e80, _ = cache.get_or_build(SPEC, "sm_80")
    e90, _ = cache.get_or_build(SPEC, "sm_90a")
    assert e80.key != e90.key and (e80.arch, e90.arch) == ("sm_80", "sm_90a")
    assert e80.cubin.name == "kernel.sm_80.cubin" and e90.cubin.name == "kernel.sm_90a.cubin"
    assert e80.spec == SPEC == e90.spec
    manifest = e80.manifest
    assert manifest["key"] == e80.key and manifest["name"] == SPEC.name and manifest["build_seconds"] > 0
    assert manifest["key_inputs"]["spec"] == json.loads(SPEC.canonical_json())
    assert "ptxas info" in manifest["compiler_log"] and (e80.path / "kernel.cu").is_file()
    assert [p for p, e, problem in cache.entries()] == sorted([e80.path, e90.path])


def test_unwritable_root_is_a_cache_write_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(CacheWriteError, match=r"set JITATTN_CACHE_DIR to a writable directory"):
        KernelCache(root=blocker / "cache", layers=()).get_or_build(SPEC, "sm_80")
