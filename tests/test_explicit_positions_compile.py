"""Real nvcc compilation, without a GPU, of every explicit query position spec the GPU tests run
(tests/explicit_position_cases.py) for sm_80 and sm_90a: the prefill kernel only (no decode or merge
kernel), and no more ptxas spills than the same spec with implicit positions (none where it has none).
"""

from __future__ import annotations

import pytest

from jitattn.render import KERNEL_NAMES
from tests.conftest import build_in_parallel, built
from tests.explicit_position_cases import explicit_cases
from tests.test_ragged import prefill_spills

pytestmark = pytest.mark.slow

ARCHS = ("sm_80", "sm_90a")
SPECS = {c.name: c.spec for c in explicit_cases()}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict:
    specs = list(dict.fromkeys([*SPECS.values(), *(s.replace(query_positions="implicit") for s in SPECS.values())]))
    return build_in_parallel(tmp_path_factory.mktemp("explicit-compile"), [(s, a) for s in specs for a in ARCHS])


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", sorted(SPECS))
def test_explicit_spec_compiles_without_new_spills(compiled, name, arch):
    spec = SPECS[name]
    entry = built(compiled, spec, arch)
    log = entry.manifest["compiler_log"]
    assert f"Compiling entry function '{KERNEL_NAMES['prefill']}' for '{arch}'" in log
    assert KERNEL_NAMES["decode"] not in log  # prefill only
    assert entry.cubin.read_bytes()[:4] == b"\x7fELF"
    spills = prefill_spills(entry, name, arch)
    implicit = prefill_spills(compiled[(spec.replace(query_positions="implicit"), arch)], name + "-implicit", arch)
    assert max(spills) <= max(implicit), f"{name} {arch}: spills {spills}, implicit positions {implicit}"
