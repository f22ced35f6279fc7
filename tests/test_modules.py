"""The module protocol: the cache, the build and the command line treat every module kind alike.

A third kind, added as one row of ``jitattn.modules.KINDS`` (as the ``append_kv`` module is),
goes through parsing, rendering, keying, the cache, the missing-kernel error and the warm-up
command without any other change.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from jitattn import modules
from jitattn.cache import KernelCache, MissingKernelError
from jitattn.cli import parse_spec_arg
from jitattn.commands import model_warmup_command, warmup_command
from jitattn.merge_module import MergeModule
from jitattn.modules import KINDS, KernelModule, ModuleKind
from jitattn.spec import AttentionSpec
from tests.fake_entries import publish_fake


@dataclass(frozen=True)
class ProbeModule:
    """A stand-in third kind: renders the float16 merge kernels under its own name."""

    tag: str

    @property
    def name(self) -> str:
        return f"probe_{self.tag}"

    def to_json(self) -> dict:
        return {"kind": "probe", "tag": self.tag}

    def canonical_json(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))

    def describe(self) -> str:
        return f"probe module {self.tag}"

    @classmethod
    def from_json(cls, data) -> "ProbeModule":
        return cls(data["tag"])

    def render(self):
        return MergeModule("float16").render()


@pytest.fixture
def probe_kind(monkeypatch):
    kind = ModuleKind("probe", ProbeModule, ProbeModule.from_json, ProbeModule.render, {})
    monkeypatch.setitem(KINDS, "probe", kind)
    monkeypatch.setitem(modules._BY_TYPE, ProbeModule, kind)
    return kind


def test_every_kind_satisfies_the_protocol():
    for module in (AttentionSpec(8, 2, 64), MergeModule("bfloat16")):
        assert isinstance(module, KernelModule)
        assert modules.from_json(json.loads(module.canonical_json())) == module
        assert modules.render(module).text
        assert dict(modules.kind_of(module).kernel_names) == modules.render(module).names


def test_an_unknown_kind_is_named_with_the_known_ones():
    with pytest.raises(ValueError, match=r"kind='rope_cache': unknown module kind; expected one of "
                                         r"\['append_kv', 'attention', 'merge_state'\]"):
        modules.from_json({"kind": "rope_cache"})
    with pytest.raises(TypeError, match=r"str is not a jitattn module kind"):
        modules.kind_of("not a module")


def test_a_third_kind_needs_only_its_row(tmp_path, probe_kind, monkeypatch):
    module = ProbeModule("x")
    assert parse_spec_arg('{"kind": "probe", "tag": "x"}') == [module]
    cache = KernelCache(root=tmp_path / "c", layers=())
    entry = publish_fake(cache, module, "sm_90a")
    assert entry.spec == module  # read back from the manifest through the kind table
    monkeypatch.setenv("JITATTN_DISABLE_JIT", "1")
    assert cache.find(module, "sm_90a").key == entry.key
    with pytest.raises(MissingKernelError) as info:
        cache.get_or_build(module, "sm_80")
    assert warmup_command(module, "sm_80") in str(info.value)
    assert warmup_command(module, "sm_80") == """jitattn warmup --spec '{"kind":"probe","tag":"x"}' --arch sm_80"""
    assert model_warmup_command(module, "sm_80") is None  # no model builds a probe module
