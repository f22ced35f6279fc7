"""Real nvcc compilation, without a GPU, of every kernel the example models need and of every spec the
GPU test matrix runs (tests/gpu_cases.py), for sm_80 and sm_90a.

All of them are compiled once, up front, by a thread pool into one temporary cache (each compile
takes 1-3 s; CI has 2 cores); each test then checks one (spec, arch) result, so a failure names the
model, layer kind and arch, and carries nvcc's message.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path

import pytest

from jitattn.cache import CacheEntry, verify_entry
from jitattn.models import load_model_config
from jitattn.render import KERNEL_NAMES
from tests.conftest import build_in_parallel
from tests.gpu_cases import all_cases

pytestmark = pytest.mark.slow

MODELS = Path(__file__).resolve().parent.parent / "examples" / "models"
ARCHS = ("sm_80", "sm_90a")
MODEL_KERNELS = {f"{p.stem}-{k.name}": k.spec for p in sorted(MODELS.glob("*.json"))
                 for k in load_model_config(p).layer_kinds}
MATRIX_KERNELS = {c.name: c.spec for c in all_cases() if c.spec not in MODEL_KERNELS.values()}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict:
    """(spec, arch) -> CacheEntry, or the exception its build raised."""
    specs = list(dict.fromkeys([*MODEL_KERNELS.values(), *MATRIX_KERNELS.values()]))
    return build_in_parallel(tmp_path_factory.mktemp("compile-all"), [(s, a) for s in specs for a in ARCHS])


def check(result: CacheEntry | Exception, arch: str) -> None:
    if isinstance(result, Exception):
        pytest.fail(f"{type(result).__name__}: {result}", pytrace=False)
    assert verify_entry(result.path) is None
    data = result.cubin.read_bytes()
    assert data[:4] == b"\x7fELF"
    assert (struct.unpack_from("<I", data, 48)[0] >> 8) & 0xFF == int(re.sub(r"\D", "", arch))
    log = result.manifest["compiler_log"]
    for kernel in ("decode", "prefill"):
        assert f"Compiling entry function '{KERNEL_NAMES[kernel]}' for '{arch}'" in log, kernel


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", sorted(MODEL_KERNELS))
def test_model_kernel_compiles(compiled, name, arch):
    check(compiled[(MODEL_KERNELS[name], arch)], arch)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", sorted(MATRIX_KERNELS))
def test_gpu_matrix_kernel_compiles(compiled, name, arch):
    check(compiled[(MATRIX_KERNELS[name], arch)], arch)


def test_every_model_config_is_covered():
    stems = {p.stem for p in MODELS.glob("*.json")}
    assert len(stems) == 8
    for stem in stems:
        assert any(name.startswith(stem + "-") for name in MODEL_KERNELS), stem
    assert {"gemma-2-9b-sliding_attention", "gemma-2-9b-full_attention", "gpt-oss-20b-sliding_attention",
            "gpt-oss-20b-full_attention"} <= set(MODEL_KERNELS)
