"""``pip install '.[nvcc]'`` on a machine without the CUDA toolkit: jitattn compiles with NVIDIA's nvcc wheel.

A fresh virtual environment gets the project and its ``nvcc`` extra (from PyPI; no torch), then runs
``jitattn warmup`` with the system toolkit hidden: no nvcc on PATH, ``CUDA_HOME`` / ``CUDA_PATH`` /
``JITATTN_NVCC`` unset. The entry it publishes must have been built by the wheel's nvcc.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from jitattn import AttentionSpec

REPO = Path(__file__).resolve().parent.parent
SPEC = AttentionSpec(8, 2, 64)  # one small GQA spec: a single sm_90a cubin


def _without_toolkit(path: str) -> list[str]:
    """PATH's directories minus the toolkit's (``/usr/local/cuda*``) and every other one holding an nvcc
    (``/usr/local/bin`` has a wrapper script that runs the toolkit's)."""
    return [d for d in path.split(os.pathsep)
            if d and not Path(d, "nvcc").exists() and not d.startswith("/usr/local/cuda")]


def _run(cmd: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=timeout)
    assert proc.returncode == 0, (f"{' '.join(cmd)} exited {proc.returncode}\n"
                                  f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


@pytest.mark.slow
def test_warmup_compiles_with_the_nvcc_wheel_when_no_toolkit_is_visible(tmp_path):
    venv = tmp_path / "venv"
    base = {k: v for k, v in os.environ.items()
            if not k.startswith("JITATTN_") and k not in ("CUDA_HOME", "CUDA_PATH", "PYTHONPATH", "VIRTUAL_ENV")}
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    _run([*pip, f"{REPO}[nvcc]"], env=base, timeout=1200)

    path = [str(venv / "bin"), *_without_toolkit(base.get("PATH", os.defpath))]
    env = {**base, "PATH": os.pathsep.join(path), "JITATTN_CACHE_DIR": str(tmp_path / "cache")}
    assert shutil.which("nvcc", path=env["PATH"]) is None, f"an nvcc is still on PATH {env['PATH']}"
    if shutil.which("gcc", path=env["PATH"]) is None:
        pytest.fail(f"no host compiler (gcc, with g++) on PATH {env['PATH']}: nvcc, the wheel's too, runs it")

    locate = ("from importlib import metadata; "
              "print(metadata.distribution('nvidia-cuda-nvcc').locate_file('nvidia/cu13/bin/nvcc').resolve())")
    wheel_nvcc = Path(_run([str(venv / "bin" / "python"), "-c", locate], env=env, timeout=120).stdout.strip())
    assert wheel_nvcc.is_file() and wheel_nvcc.is_relative_to(venv.resolve()), wheel_nvcc

    proc = _run([str(venv / "bin" / "jitattn"), "warmup", "--spec", SPEC.canonical_json(), "--arch", "sm_90a"],
                env=env, timeout=900)
    assert "compiled 1, cached 0, failed 0" in proc.stdout, proc.stdout

    manifests = list((tmp_path / "cache").glob("v1/entries/*/*/manifest.json"))
    assert len(manifests) == 1, manifests
    entry = manifests[0].parent
    manifest = json.loads(manifests[0].read_text())
    assert manifest["name"] == SPEC.name and manifest["key_inputs"]["arch"] == "sm_90a"
    assert "release 13.0" in manifest["key_inputs"]["nvcc"], manifest["key_inputs"]["nvcc"]
    # ninja -v logs the command it ran, and the entry keeps its build.ninja: both name the wheel's nvcc
    assert str(wheel_nvcc) in manifest["compiler_log"], manifest["compiler_log"][:2000]
    assert f"nvcc = {wheel_nvcc}" in (entry / "build.ninja").read_text()
    assert (entry / "kernel.sm_90a.cubin").stat().st_size > 0


def test_nvcc_lookup_takes_the_wheel_last(tmp_path, monkeypatch):
    from jitattn import settings

    wheel = tmp_path / "site-packages" / "nvidia" / "cu13" / "bin" / "nvcc"
    on_path = tmp_path / "toolkit" / "bin" / "nvcc"
    for exe in (wheel, on_path):
        exe.parent.mkdir(parents=True)
        exe.write_text("#!/bin/sh\n")
        exe.chmod(0o755)
    monkeypatch.setattr(settings, "wheel_nvcc", lambda: str(wheel))
    for name in ("JITATTN_NVCC", "CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert settings.nvcc() == str(wheel)
    monkeypatch.setenv("PATH", str(on_path.parent))
    assert settings.nvcc() == str(on_path)
    monkeypatch.setenv("CUDA_HOME", str(on_path.parent.parent))
    monkeypatch.setenv("PATH", str(tmp_path))
    assert settings.nvcc() == str(on_path)
    monkeypatch.setattr(settings, "wheel_nvcc", lambda: None)
    monkeypatch.delenv("CUDA_HOME")
    assert settings.nvcc() == "nvcc"  # nothing anywhere: nvcc_version's error then says how to get one
