"""Which cached entry a lookup serves, without nvcc compiling anything (fast, runs in CI).

The build step is replaced by one that writes a stand-in cubin, and nvcc by a script that only
answers ``--version``; everything else (keys, publish, markers, manifests, the lookup) is the real
cache. The real-nvcc versions of these checks are the slow tests of tests/test_cache.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import jitattn.build
from jitattn import AttentionSpec
from jitattn.build import BuildResult, cubin_name
from jitattn.cache import KernelCache

SPEC = AttentionSpec(8, 2, 64)


def version_only_nvcc(tmp_path: Path, release: str) -> Path:
    """An nvcc that answers ``--version`` with ``release`` and refuses anything else."""
    script = tmp_path / f"nvcc-{release}"
    script.write_text(f"""#!/bin/sh
if [ "$1" = "--version" ]; then echo "Cuda compilation tools, release {release}, V{release}.0"; exit 0; fi
echo "this nvcc only answers --version" >&2; exit 1
""")
    script.chmod(0o755)
    return script


@pytest.fixture
def stand_in_build(monkeypatch) -> list[str]:
    """Builds write a stand-in cubin instead of running nvcc; returns the list of archs built."""
    built: list[str] = []

    def build(source, arch, build_dir, *, flags=None, templates=None):
        build_dir.mkdir(parents=True, exist_ok=True)
        cubin = build_dir / cubin_name(arch)
        cubin.write_bytes(b"stand-in cubin for " + source.sha256.encode())
        built.append(arch)
        return BuildResult(cubin, "stand-in build", 0.0)

    monkeypatch.setattr(jitattn.build, "build", build)
    return built


def test_a_build_box_never_serves_an_entry_another_nvcc_built(tmp_path, monkeypatch, stand_in_build):
    """The entry (and its spec-key marker, which skips rendering) names nvcc 98.1 in its manifest: under
    nvcc 98.2 the lookup misses and the build makes a second entry; under 98.1 it hits the first; a
    serving node (JITATTN_DISABLE_JIT=1) takes either, as it may not compile."""
    cache = KernelCache(root=tmp_path / "cache", layers=())
    monkeypatch.setenv("JITATTN_NVCC", str(version_only_nvcc(tmp_path, "98.1")))
    first, built = cache.get_or_build(SPEC, "sm_80")
    assert built and "release 98.1" in first.manifest["key_inputs"]["nvcc"]
    assert cache.find(SPEC, "sm_80").key == first.key

    monkeypatch.setenv("JITATTN_NVCC", str(version_only_nvcc(tmp_path, "98.2")))
    assert cache.find(SPEC, "sm_80") is None
    second, built = cache.get_or_build(SPEC, "sm_80")
    assert built and second.key != first.key and "release 98.2" in second.manifest["key_inputs"]["nvcc"]
    assert stand_in_build == ["sm_80", "sm_80"]

    monkeypatch.setenv("JITATTN_NVCC", str(version_only_nvcc(tmp_path, "98.1")))
    assert cache.find(SPEC, "sm_80").key == first.key
    monkeypatch.setenv("JITATTN_DISABLE_JIT", "1")
    monkeypatch.setenv("JITATTN_NVCC", str(tmp_path / "no-nvcc"))
    assert cache.find(SPEC, "sm_80").key in (first.key, second.key)
    assert cache.get_or_build(SPEC, "sm_80")[1] is False
