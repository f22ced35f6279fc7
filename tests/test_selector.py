"""The selector on the CPU: decisions for every example model on named devices, forcing, errors, logging,
third-party registration and entry points, and the ``jitattn select`` table."""

from __future__ import annotations

import importlib.metadata
import json
import logging
from pathlib import Path

import pytest

from jitattn import AttentionSpec, Variant, backends, selector, settings
from jitattn.backends import Backend, DeviceInfo, register_backend
from jitattn.backends import flashinfer as fi_mod
from jitattn.selector import NoBackendError, select, select_model, selection_table

MODELS = Path(__file__).resolve().parent.parent / "examples" / "models"
PLAIN = AttentionSpec(8, 2, 128)
GEMMA2 = AttentionSpec(16, 8, 256, logits_soft_cap=50.0, window_left=4095, sm_scale=256 ** -0.5)
NO_TORCH = Variant(name="cuda_only", logits_transform="logits * 2.0f")
NOT_INSTALLED = "ModuleNotFoundError: No module named 'flashinfer'"


@pytest.fixture(autouse=True)
def _clean_registry(monkeypatch):
    """Fresh registry and selector caches; no entry points; flashinfer absent (the CI box has none)."""
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **kw: [])
    monkeypatch.setattr(fi_mod, "flashinfer_import_error", lambda: NOT_INSTALLED)
    monkeypatch.delenv("JITATTN_BACKEND", raising=False)
    backends.reset_registry()
    selector.clear_caches()
    yield
    backends.reset_registry()
    selector.clear_caches()


# ---- every example model on named devices ---------------------------------------------------------------
EXPECTED = {  # model -> device -> backend per layer kind, in layer-kind order
    "bloom-560m": {"h100": ["jit"], "cpu": ["reference"], "t4": ["reference"]},
    "gemma-2-27b": {"h100": ["jit", "jit"], "cpu": ["reference", "reference"], "t4": ["reference", "reference"]},
    "gemma-2-9b": {"h100": ["jit", "jit"], "cpu": ["reference", "reference"], "t4": ["reference", "reference"]},
    "gemma-3-1b": {"h100": ["jit", "jit"], "cpu": ["reference", "sdpa"], "t4": ["reference", "sdpa"]},
    "gpt-oss-20b": {"h100": ["jit", "jit"], "cpu": ["reference", "reference"], "t4": ["reference", "reference"]},
    "llama-3-8b": {"h100": ["jit"], "cpu": ["sdpa"], "t4": ["sdpa"]},
    "mistral-7b-v0.1": {"h100": ["jit"], "cpu": ["reference"], "t4": ["reference"]},
    "phi-3-mini-4k-instruct": {"h100": ["jit"], "cpu": ["reference"], "t4": ["reference"]},
}


def test_every_example_model_is_covered():
    assert sorted(p.stem for p in MODELS.glob("*.json")) == sorted(EXPECTED)


@pytest.mark.parametrize("model", sorted(EXPECTED))
@pytest.mark.parametrize("device", ["h100", "cpu", "t4"])
def test_example_model_decisions(model, device):
    ms = select_model(MODELS / f"{model}.json", device)
    assert ms.ok
    assert [r.backend for r in ms.rows] == EXPECTED[model][device]
    for row in ms.rows:  # every other backend is accounted for, with a reason or as lower priority
        others = {r.backend for r in row.selection.passed_over}
        assert others == {"jit", "flashinfer", "flex", "sdpa", "reference"} - {row.backend}


def test_gemma2_on_cpu_reasons_in_full():
    sel = select(GEMMA2, "cpu", "decode")
    assert sel.name == "reference" and not sel.forced
    assert [line for r in sel.passed_over for line in r.lines()] == [
        "jit: runs on CUDA devices only, device is cpu",
        f"flashinfer: not installed (import flashinfer failed: {NOT_INSTALLED})",
        "flex: runs on CUDA devices only, device is cpu",
        "sdpa: sliding window (window_left=4095) not supported (torch SDPA has no window; a dense mask would take "
        "it off its flash path); logits_soft_cap=50 not supported (torch SDPA has no soft-cap)",
    ]  # one line per backend, its reasons joined
    [sdpa] = [r for r in sel.passed_over if r.backend == "sdpa"]
    assert len(sdpa.reasons) == 2  # the structured result keeps them apart


def test_lower_priority_backends_that_could_serve_say_so():
    sel = select(PLAIN, "h100")
    lines = {r.backend: r.lines() for r in sel.passed_over}
    assert sel.name == "jit"
    assert lines["flex"] == ["flex: could serve; lower priority than jit"]
    assert lines["sdpa"] == ["sdpa: could serve; lower priority than jit"]


def test_installed_flashinfer_is_second(monkeypatch):
    monkeypatch.setattr(fi_mod, "flashinfer_import_error", lambda: None)
    assert select(PLAIN, "t4").name == "sdpa"  # flashinfer needs 8.0, like jit
    assert select(PLAIN, "h100", backend=None).name == "jit"
    with settings.scope(JITATTN_BACKEND="flashinfer"):
        assert select(GEMMA2, "h100").name == "flashinfer"


def test_requirements_change_the_choice():
    assert select(PLAIN, "cpu").name == "sdpa"
    assert select(PLAIN, "cpu", need_lse=True).name == "reference"
    with pytest.raises(NoBackendError) as err:
        select(PLAIN, "cpu", cuda_graph=True)
    assert "reference: not CUDA-graph capturable" in str(err.value)
    assert select(PLAIN, "h100", "decode", cuda_graph=True).name == "jit"


# ---- forcing and errors -----------------------------------------------------------------------------------
def test_forced_backend_that_serves():
    with settings.scope(JITATTN_BACKEND="reference"):
        sel = select(GEMMA2, "h100")
    assert sel.name == "reference" and sel.forced
    assert {r.backend: r.lines() for r in sel.passed_over}["jit"] == ["jit: could serve; reference forced"]


def test_forced_backend_that_cannot_serve_fails_with_its_reasons():
    with settings.scope(JITATTN_BACKEND="sdpa"), pytest.raises(NoBackendError) as err:
        select(GEMMA2, "h100", "prefill")
    assert str(err.value) == (
        "JITATTN_BACKEND=sdpa cannot serve 16/8 heads, hd 256, bfloat16, NHD p16, scale 0.0625, causal, "
        "window_left=4095, soft_cap=50 on h100 (cuda, 9.0) (phase prefill):\n"
        "  - sdpa: sliding window (window_left=4095) not supported (torch SDPA has no window; a dense mask would "
        "take it off its flash path)\n"
        "  - sdpa: logits_soft_cap=50 not supported (torch SDPA has no soft-cap)\n"
        "unset JITATTN_BACKEND to select automatically")
    assert [r.backend for r in err.value.rejections] == ["sdpa"]


def test_forced_jit_on_cpu():
    with settings.scope(JITATTN_BACKEND="jit"), pytest.raises(NoBackendError, match=r"(?s)JITATTN_BACKEND=jit cannot "
                                                                                  r"serve.*jit: runs on CUDA devices only"):
        select(PLAIN, "cpu")


def test_backend_argument_overrides_the_environment():
    with settings.scope(JITATTN_BACKEND="sdpa"):
        assert select(GEMMA2, "cpu", backend="reference").name == "reference"


def test_forced_backend_errors_name_the_argument_the_user_set():
    """select(..., backend=NAME) (and `jitattn select --backend NAME`) blamed JITATTN_BACKEND, which was not set."""
    with settings.scope(JITATTN_BACKEND=None):
        with pytest.raises(ValueError) as err:
            select(PLAIN, "h100", backend="cudnn")
        assert str(err.value).startswith("backend='cudnn': no attention backend named 'cudnn'; registered: jit")
        with pytest.raises(NoBackendError, match=r"(?s)^backend=jit cannot serve.*pass no backend to select "
                                                 r"automatically"):
            select(PLAIN, "cpu", backend="jit")


def test_unknown_forced_backend_lists_the_registered_ones():
    with settings.scope(JITATTN_BACKEND="cudnn"), pytest.raises(ValueError) as err:
        select(PLAIN, "h100")
    assert str(err.value) == ("JITATTN_BACKEND='cudnn': no attention backend named 'cudnn'; registered: jit, "
                              "flashinfer, flex, sdpa, reference")


def test_no_backend_lists_every_backends_reasons():
    spec = AttentionSpec(8, 2, 64, variant=NO_TORCH)
    with pytest.raises(NoBackendError) as err:
        select(spec, "cpu")
    text = str(err.value)
    assert text.startswith("no attention backend can serve 8/2 heads, hd 64, bfloat16, NHD p16, scale 0.125, causal, "
                           "variant=cuda_only on cpu (phase mixed):\n")
    for line in ["jit: runs on CUDA devices only, device is cpu",
                 f"flashinfer: not installed (import flashinfer failed: {NOT_INSTALLED})",
                 "flex: runs on CUDA devices only, device is cpu",
                 "sdpa: custom functors (variant 'cuda_only') not supported",
                 "reference: variant 'cuda_only' has logits_transform (CUDA only, no torch version)"]:
        assert f"  - {line}" in text
    assert {r.backend for r in err.value.rejections} == {"jit", "flashinfer", "flex", "sdpa", "reference"}
    assert select(spec, "h100").name == "jit"  # only the kernels take a CUDA-only functor


def test_model_with_unservable_layer_reports_instead_of_raising():
    with settings.scope(JITATTN_BACKEND="sdpa"):
        ms = select_model(MODELS / "gemma-3-1b.json", "h100")
    assert not ms.ok
    assert [r.backend for r in ms.rows] == [None, "sdpa"]
    assert ms.rows[0].passed_over() == [
        "sdpa: sliding window (window_left=511) not supported (torch SDPA has no window; a dense mask would take it "
        "off its flash path)"]
    assert ms.to_json()["layer_kinds"][0]["error"].startswith("JITATTN_BACKEND=sdpa cannot serve")


# ---- logging -------------------------------------------------------------------------------------------------
def test_choice_logged_once_per_layer_kind(caplog):
    caplog.set_level(logging.INFO, logger="jitattn.selector")
    for _ in range(3):
        select(GEMMA2, "cpu", "decode")
        select(PLAIN, "cpu", "decode")
    records = [r for r in caplog.records if r.name == "jitattn.selector"]
    assert len(records) == 2
    assert "backend reference (by priority)" in records[0].getMessage()
    assert "  sdpa: sliding window (window_left=4095) not supported" in records[0].getMessage()
    assert "; logits_soft_cap=50 not supported" in records[0].getMessage()  # its second reason, on its line
    assert "backend sdpa (by priority)" in records[1].getMessage()
    select(GEMMA2, "cpu", "prefill")  # another phase is another decision
    assert len([r for r in caplog.records if r.name == "jitattn.selector"]) == 3


# ---- third-party backends --------------------------------------------------------------------------------------
class EverythingBackend(Backend):
    name = "everything"
    priority = 90

    def spec_reasons(self, spec, device, phase):
        return [] if device.type == "cuda" else [f"{self.name}: CUDA only, device is {device.name}"]

    def build(self, spec, device):
        return lambda *args, **kwargs: "called"


class EntryPoint:
    """Stands in for importlib.metadata.EntryPoint: name, value, load()."""

    def __init__(self, name, value, obj=None, error=None):
        self.name, self.value, self._obj, self._error = name, value, obj, error
        self.loads = 0

    def load(self):
        self.loads += 1
        if self._error:
            raise self._error
        return self._obj


def test_register_backend_takes_its_priority():
    register_backend(EverythingBackend)
    assert [b.name for b in backends.registered_backends()] == ["jit", "everything", "flashinfer", "flex", "sdpa",
                                                                "reference"]
    assert select(GEMMA2, "t4").name == "everything"
    assert select(GEMMA2, "h100").name == "jit"
    assert select(GEMMA2, "cpu").name == "reference"
    assert select(GEMMA2, "t4").build()() == "called"


def test_register_backend_refuses_duplicates():
    register_backend(EverythingBackend())
    with pytest.raises(ValueError, match="a backend named 'everything' is already registered"):
        register_backend(EverythingBackend())
    register_backend(EverythingBackend(), replace=True)
    with pytest.raises(TypeError, match="expected a jitattn.backends.Backend"):
        register_backend(object())  # type: ignore[arg-type]


def test_entry_points_load_once_and_lazily(monkeypatch):
    good = EntryPoint("everything", "plugin.attn:EverythingBackend", EverythingBackend)
    broken = EntryPoint("broken", "plugin.broken:Backend", error=ImportError("No module named 'plugin.broken'"))
    groups = []

    def entry_points(**kw):
        groups.append(kw)
        return [good, broken]

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    backends.reset_registry()
    assert groups == []  # nothing loaded until the registry is used
    sel = select(PLAIN, "t4")
    select(PLAIN, "a100")
    backends.registered_backends()
    assert groups == [{"group": "jitattn.backends"}]
    assert good.loads == 1 and broken.loads == 1
    assert sel.name == "everything"
    lines = {r.backend: r.lines() for r in sel.passed_over}
    assert lines["broken"] == ["broken: entry point broken = 'plugin.broken:Backend' (jitattn.backends) failed to "
                               "load: ImportError: No module named 'plugin.broken'"]
    with settings.scope(JITATTN_BACKEND="broken"), pytest.raises(NoBackendError, match="failed to load"):
        select(PLAIN, "h100")


def test_entry_point_of_the_wrong_type_becomes_a_refusal(monkeypatch, caplog):
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **kw: [EntryPoint("odd", "plugin:ODD", 42)])
    backends.reset_registry()
    caplog.set_level(logging.WARNING, logger="jitattn.backends")
    assert backends.get_backend("odd").reasons(PLAIN, "h100") == [
        "odd: entry point odd = 'plugin:ODD' (jitattn.backends) failed to load: TypeError: entry point odd = "
        "'plugin:ODD': expected a jitattn.backends.Backend subclass, instance or factory, got int"]
    assert any("failed to load" in r.getMessage() for r in caplog.records)


# ---- the select table -------------------------------------------------------------------------------------------
def test_selection_table_for_a_named_gpu_without_one():
    text = selection_table(MODELS / "gemma-2-9b.json", "h100")
    assert text.splitlines()[:5] == [
        "gemma-2-9b (gemma2, 42 layers) on h100 (cuda, 9.0), phase mixed",
        "",
        "| layer kind | layers | backend | spec |",
        "|---|---|---|---|",
        "| sliding_attention | 21 (0, 2, 4, 6, ...) | jit | 16/8 heads, hd 256, bfloat16, NHD p16, scale 0.0625, "
        "causal, window_left=4095, soft_cap=50 |",
    ]
    assert "\nsliding_attention -> jit:\n  - flashinfer: not installed" in text
    assert "  - sdpa: sliding window (window_left=4095) not supported (torch SDPA has no window; a dense mask would " \
           "take it off its flash path); logits_soft_cap=50 not supported (torch SDPA has no soft-cap)\n" in text
    assert "  - reference: could serve; lower priority than jit" in text


def test_selection_table_marks_forced_and_missing():
    with settings.scope(JITATTN_BACKEND="sdpa"):
        text = selection_table(MODELS / "gemma-3-1b.json", "cpu", phase="decode")
    assert "| sliding_attention | 22 (0, 1, 2, 3, ...) | none | 4/1 heads" in text
    assert "| full_attention | 4 (5, 11, 17, 23) | sdpa (forced) | 4/1 heads" in text
    assert "sliding_attention -> no backend:" in text


def test_select_model_structured_json():
    data = select_model(MODELS / "gpt-oss-20b.json", "sm_90", phase="decode").to_json()
    assert data["ok"] and data["phase"] == "decode" and data["device"] == "sm_90 (cuda, 9.0)"
    assert [k["backend"] for k in data["layer_kinds"]] == ["jit", "jit"]
    assert "flex: sinks not supported (FlexAttention's softmax has no sink term in the denominator)" in \
        data["layer_kinds"][0]["passed_over"]


def test_device_defaults_to_the_cpu_without_a_gpu(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert select(PLAIN).device == DeviceInfo("cpu", "cpu")


def test_a_backend_with_two_reasons_is_listed_once():
    """DeepSeek-V3's latent decode kind on a named H100: flashinfer is absent and would not take a latent
    cache anyway; `jitattn select` lists it once, both reasons on its line."""
    text = selection_table(DEEPSEEK_V3, "h100")
    decode = text.split("\nmla_decode -> jit:\n")[1].split("\n\n")[0].splitlines()
    assert [ln.split(":")[0] for ln in decode] == ["  - flashinfer", "  - flex", "  - sdpa", "  - reference"]
    assert decode[0] == (f"  - flashinfer: not installed (import flashinfer failed: {NOT_INSTALLED}); latent attention "
                         "(kv_storage='latent', MLA) not served: its call reads a paged K/V cache, not the latent "
                         "rows of an MLA cache")
    kinds = {k["layer_kind"]: k for k in select_model(DEEPSEEK_V3, "h100").to_json()["layer_kinds"]}
    assert [ln.split(":")[0] for ln in kinds["mla_decode"]["passed_over"]] == ["flashinfer", "flex", "sdpa",
                                                                               "reference"]
    with pytest.raises(NoBackendError) as err:  # the message when none serves: one line per backend too
        select(LATENT, "t4", "decode", cuda_graph=True)
    assert str(err.value).count("\n  - flashinfer: ") == 1 and "; latent attention" in str(err.value)


# ---- this machine's GPU, when there is none ----------------------------------------------------------------------
NO_GPU = "no CUDA device is visible on this machine (torch.cuda.is_available() is False)"


@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
@pytest.mark.parametrize("forced", [None, "sdpa"])
def test_cuda_without_a_gpu_is_an_error_naming_the_device(monkeypatch, device, forced):
    """`select(spec, "cuda")` where torch sees no GPU raises, naming the device, rather than picking sdpa (which
    would fail at the first call): as torch's own tensors on "cuda" do. Forcing a backend does not help."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(NoBackendError, match=rf"^device '{device}': no CUDA device is visible on this machine") as err:
        select(PLAIN, device, "decode", backend=forced)
    reasons = {r.backend: r.reasons for r in err.value.rejections}
    assert reasons["sdpa"] == (f"sdpa: {NO_GPU}",) and reasons["reference"] == (f"reference: {NO_GPU}",)
    assert "'h100', 'sm_90'" in str(err.value)
    assert select(PLAIN, "h100", "decode").name == "jit"  # a named GPU is still planned for without one
    ms = select_model(MODELS / "llama-3-8b.json", device)
    assert not ms.ok and "no CUDA device is visible" in str(ms.rows[0].error)


def test_a_torch_cuda_device_without_a_gpu_is_the_same_error(monkeypatch):
    """A torch.device("cuda") gets the error the name "cuda" gets, not torch's "not compiled with CUDA"."""
    import torch

    from jitattn.backends import base

    def no_gpu(index):
        raise AssertionError("Torch not compiled with CUDA enabled")

    monkeypatch.setattr(base, "_cuda_device_info", no_gpu)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device in (torch.device("cuda"), torch.device("cuda", 0)):
        with pytest.raises(NoBackendError, match=rf"^device '{device}': no CUDA device is visible on this machine"):
            select(PLAIN, device, "decode")


def test_select_device_cuda_without_a_gpu_is_a_usage_error(tmp_path):
    """`jitattn select --device cuda` on a machine whose torch sees no GPU (CUDA_VISIBLE_DEVICES='' hides any):
    one error line, exit 2, not a table of a capability-unknown device; a named GPU still plans."""
    from tests.test_cli import jitattn

    hidden = {"CUDA_VISIBLE_DEVICES": ""}
    for device in ("cuda", "cuda:0"):
        proc = jitattn("select", "--model", str(MODELS / "llama-3-8b.json"), "--device", device,
                       cache=tmp_path / "c", env=hidden)
        assert proc.returncode == 2, proc.stdout
        assert proc.stdout == ""
        assert proc.stderr.splitlines() == [
            f"jitattn: error: --device {device}: {NO_GPU}; name the serving node's GPU or arch to plan for it "
            f"(--device h100, --device sm_90), or use --device cpu"]
    named = jitattn("select", "--model", str(MODELS / "llama-3-8b.json"), "--device", "h100", "--json",
                    cache=tmp_path / "c", env=hidden)
    assert named.returncode == 0, named.stderr
    assert [k["backend"] for k in json.loads(named.stdout)["layer_kinds"]] == ["jit"]


# ---- the eager op path remembers its choice --------------------------------------------------------------
def test_select_cached_reuses_the_choice_until_the_variable_or_the_registry_changes(monkeypatch):
    calls = []
    real = selector.select
    monkeypatch.setattr(selector, "select", lambda *a, **kw: calls.append(a) or real(*a, **kw))
    cpu = DeviceInfo.parse("cpu")
    assert selector.select_cached(PLAIN, cpu, "decode").name == "sdpa"
    assert selector.select_cached(PLAIN, cpu, "decode").name == "sdpa"
    assert len(calls) == 1  # remembered
    selector.select_cached(PLAIN, cpu, "decode", need_lse=True)
    selector.select_cached(PLAIN, cpu, "prefill")
    assert len(calls) == 3  # other keys
    with settings.scope(JITATTN_BACKEND="reference"):
        assert selector.select_cached(PLAIN, cpu, "decode").name == "reference"  # the variable is in the key
    register_backend(type("CpuFirst", (EverythingBackend,), {
        "name": "cpu_first", "priority": 1000, "spec_reasons": lambda self, spec, device, phase: []}))
    assert selector.select_cached(PLAIN, cpu, "decode").name == "cpu_first"  # so is the registry
    selector.clear_caches()
    calls.clear()
    selector.select_cached(PLAIN, cpu, "decode")
    assert len(calls) == 1


def test_eager_op_selects_once(monkeypatch):
    import torch

    from jitattn import ops
    from jitattn.testing import random_paged_batch

    spec = AttentionSpec(4, 2, 64, page_size=16)
    b = random_paged_batch(spec, [1, 1], [20, 37])
    calls = []
    real = selector.select
    monkeypatch.setattr(selector, "select", lambda *a, **kw: calls.append(a) or real(*a, **kw))
    first = ops.paged_attention(spec, *b.args())
    second = ops.paged_attention(spec, *b.args())
    assert len(calls) == 1
    torch.testing.assert_close(first, second)


def test_explain_names_what_forced_the_backend():
    assert "backend reference (forced by backend=reference)" in select(GEMMA2, "h100", backend="reference").explain()
    with settings.scope(JITATTN_BACKEND="reference"):
        sel = select(GEMMA2, "h100")
    assert sel.forced_by == "JITATTN_BACKEND" and "(forced by JITATTN_BACKEND=reference)" in sel.explain()
    auto = select(GEMMA2, "h100")
    assert auto.forced_by == "" and "(by priority)" in auto.explain()


# ---- backends this machine cannot import ----------------------------------------------------------------
def test_without_torch_the_cpu_backends_are_passed_over_with_the_reason(monkeypatch):
    """Every backend's call takes torch tensors: on the CPU without torch none serves, and each that
    would have says so; a named GPU (planned for another machine) is not judged by this machine's imports."""
    monkeypatch.setattr(selector, "torch_installed", lambda: False)
    with pytest.raises(NoBackendError) as err:
        select(PLAIN, "cpu", "decode")
    reasons = {r.backend: r.reasons for r in err.value.rejections}
    want = "torch is not installed (its calls take torch tensors; pip install 'jitattn[torch]')"
    assert reasons["sdpa"] == (f"sdpa: {want}",) and reasons["reference"] == (f"reference: {want}",)
    assert reasons["jit"] == ("jit: runs on CUDA devices only, device is cpu",)  # its own reason is enough
    assert select(PLAIN, "h100", "decode").name == "jit"


LATENT = AttentionSpec(16, 1, 576, 512, kv_storage="latent", sm_scale=0.1)
DEEPSEEK_V3 = Path(__file__).resolve().parent / "models" / "deepseek-v3.json"


@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:1"])
@pytest.mark.parametrize("spec", [LATENT, PLAIN], ids=["latent", "paged"])
def test_without_torch_this_machines_gpu_is_judged_like_its_cpu(monkeypatch, device, spec):
    """``cuda`` / ``cuda:N`` name this machine's GPU: without torch no backend runs on it, and the torch
    backends say that torch is missing rather than being picked."""
    monkeypatch.setattr(selector, "torch_installed", lambda: False)
    with pytest.raises(NoBackendError) as err:
        select(spec, device, "decode")
    reasons = {r.backend: r.reasons for r in err.value.rejections}
    want = "torch is not installed (its calls take torch tensors; pip install 'jitattn[torch]')"
    assert reasons["sdpa"] == (f"sdpa: {want}",) and reasons["reference"] == (f"reference: {want}",)
    assert select(spec, "h100", "decode").name == "jit"  # planned for another node


def test_select_device_cuda_0_without_torch_names_no_backend_for_a_latent_kind(tmp_path):
    """`jitattn select --device cuda:0` for DeepSeek-V3 (its decode kind latent) without torch."""
    from tests.test_cli import _without, jitattn

    proc = jitattn("select", "--model", str(DEEPSEEK_V3), "--device", "cuda:0", "--json",
                   cache=tmp_path / "c", env=_without(tmp_path, "torch"))
    assert proc.returncode == 1, proc.stderr
    kinds = {k["layer_kind"]: k for k in json.loads(proc.stdout)["layer_kinds"]}
    assert kinds["mla_decode"]["backend"] is None
    for name in ("sdpa", "reference"):
        assert f"{name}: torch is not installed (its calls take torch tensors; pip install 'jitattn[torch]')" in \
            kinds["mla_decode"]["passed_over"]


def test_select_device_cpu_without_torch_names_no_backend(tmp_path):
    """`jitattn select --device cpu` on a machine without torch (a meta-path finder blocks it)."""
    from tests.test_cli import _without, jitattn

    proc = jitattn("select", "--model", str(MODELS / "llama-3-8b.json"), "--device", "cpu", "--json",
                   cache=tmp_path / "c", env=_without(tmp_path, "torch"))
    assert proc.returncode == 1, proc.stderr
    [kind] = json.loads(proc.stdout)["layer_kinds"]
    assert kind["backend"] is None
    assert "sdpa: torch is not installed (its calls take torch tensors; pip install 'jitattn[torch]')" in \
        kind["passed_over"]
