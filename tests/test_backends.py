"""Backends on the CPU: device naming, each backend's reasons (exact texts), and the torch backends' numbers.

The sdpa, flex and reference callables run on the CPU here against :func:`jitattn.reference.paged_attention`
(flex unfused: FlexAttention without torch.compile). The jit and flashinfer callables need a GPU:
tests/test_gpu_integrations.py runs them.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from jitattn import AttentionSpec, Variant, reference
from jitattn.backends import DeviceInfo, Requirements, get_backend
from jitattn.backends import flashinfer as fi_mod
from jitattn.selector import select
from jitattn.testing import random_paged_batch, relative_error
from jitattn.variant import document_mask, rotary_embedding, sigmoid_attention
from tests.gpu_cases import DOC_MASK, HIDE_HEAD, OUTPUT_GATE, REL_BIAS, TRACED_DISTANCE, _doc_params

CPU = DeviceInfo.parse("cpu")
H100 = DeviceInfo.parse("h100")
PLAIN = AttentionSpec(8, 2, 128)
GEMMA2 = AttentionSpec(16, 8, 256, logits_soft_cap=50.0, window_left=4095, sm_scale=256 ** -0.5)
NO_TORCH = Variant(name="cuda_only", logits_transform="logits * 2.0f")


# ---- DeviceInfo ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, kind, cap", [
    ("cpu", "cpu", None), ("h100", "cuda", (9, 0)), ("H200", "cuda", (9, 0)), ("nvidia-a100", "cuda", (8, 0)),
    ("l4", "cuda", (8, 9)), ("t4", "cuda", (7, 5)), ("sm_90", "cuda", (9, 0)), ("sm_90a", "cuda", (9, 0)),
    ("sm80", "cuda", (8, 0)), ("86", "cuda", (8, 6)), ("12.0", "cuda", (12, 0)), ("b200", "cuda", (10, 0)),
])
def test_device_names(name, kind, cap):
    dev = DeviceInfo.parse(name)
    assert (dev.type, dev.capability) == (kind, cap)


def test_cuda_without_gpu_has_unknown_capability(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    dev = DeviceInfo.parse("cuda:1")
    assert (dev.type, dev.capability, dev.index) == ("cuda", None, 1)


def test_unknown_device_name_lists_what_is_accepted():
    with pytest.raises(ValueError, match=r"device='tpu': unknown device; expected 'cpu', 'cuda'.*h100.*sm_90"):
        DeviceInfo.parse("tpu")


def test_from_torch_cpu_and_none_without_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert DeviceInfo.parse(None) == DeviceInfo("cpu", "cpu")
    assert DeviceInfo.from_torch(torch.device("cpu")).type == "cpu"


def test_from_torch_names_a_cuda_device_by_its_index(monkeypatch):
    from jitattn.backends import base

    asked = []
    monkeypatch.setattr(base, "_cuda_device_info",
                        lambda index: asked.append(index) or DeviceInfo("cuda", "H200", (9, 0), index))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 5)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert DeviceInfo.from_torch(torch.device("cuda", 3)).index == 3  # a tensor's device: its own index
    assert DeviceInfo.from_torch("cuda:2").index == 2
    assert DeviceInfo.from_torch(torch.device("cuda")).index == 5  # no index: the current device
    assert asked == [3, 2, 5]


@pytest.mark.parametrize("device", [torch.device("cuda"), torch.device("cuda", 0), "cuda:3"])
def test_from_torch_without_a_gpu_gives_a_capability_unknown_device(monkeypatch, device):
    """Where torch sees no GPU, a torch CUDA device is one of capability unknown (as the name "cuda" is), not
    torch's "not compiled with CUDA" AssertionError: jitattn.select then names it in its error."""
    from jitattn.backends import base

    def no_gpu(index):
        raise AssertionError("Torch not compiled with CUDA enabled")

    monkeypatch.setattr(base, "_cuda_device_info", no_gpu)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    info = DeviceInfo.from_torch(device)
    assert (info.type, info.capability, info.name) == ("cuda", None, str(torch.device(device)))
    assert info.index == torch.device(device).index


def test_from_torch_refuses_an_index_past_the_machines_gpus(monkeypatch):
    from jitattn.backends import base

    def info(index):
        if index >= 2:
            raise AssertionError("Invalid device id")
        return DeviceInfo("H200", "cuda", (9, 0), index)

    monkeypatch.setattr(base, "_cuda_device_info", info)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert DeviceInfo.from_torch(torch.device("cuda", 1)).index == 1
    for device in (torch.device("cuda", 5), "cuda:5"):
        with pytest.raises(ValueError, match=r"^device='cuda:5': this machine has 2 CUDA device\(s\), cuda:0 to cuda:1$"):
            DeviceInfo.from_torch(device)
    with pytest.raises(ValueError, match=r"this machine has 2 CUDA device"):
        DeviceInfo.parse("cuda:5")


def test_registry_generation_changes_with_the_registry():
    from jitattn.backends import (ReferenceBackend, register_backend, registry_generation, reset_registry,
                                  unregister_backend)

    try:
        first = registry_generation()
        assert registry_generation() == first  # reading changes nothing
        register_backend(type("Extra", (ReferenceBackend,), {"name": "extra_gen"}))
        second = registry_generation()
        unregister_backend("extra_gen")
        third = registry_generation()
    finally:
        reset_registry()
    assert len({first, second, third, registry_generation()}) == 4


# ---- reasons: exact texts ----------------------------------------------------------------------------
def reasons(name, spec, device=H100, phase="mixed", **req):
    return get_backend(name).reasons(spec, device, phase, Requirements(**req))


def test_jit_reasons():
    assert reasons("jit", GEMMA2) == []
    assert reasons("jit", AttentionSpec(8, 1, 64, sinks=True, alibi=True, variant=NO_TORCH), "a100") == []
    assert reasons("jit", PLAIN, CPU) == ["jit: runs on CUDA devices only, device is cpu"]
    assert reasons("jit", PLAIN, "t4") == [
        "jit: no build target runs on compute capability 7.5 (t4); jitattn builds sm_80, sm_86, sm_89, sm_90, "
        "sm_90a, sm_100a, sm_120"]
    assert reasons("jit", PLAIN, DeviceInfo("cuda", "cuda")) == [
        "jit: compute capability of device 'cuda' unknown (no GPU visible); name the GPU or arch, e.g. "
        "--device h100 or --device sm_90"]


def test_sdpa_reasons_name_each_feature():
    spec = AttentionSpec(12, 12, 64, causal=False, window_left=31, window_right=17, logits_soft_cap=30.0,
                         alibi=True, sinks=True, variant=REL_BIAS)
    assert reasons("sdpa", spec, CPU) == [
        "sdpa: sliding window (window_left=31, window_right=17) not supported (torch SDPA has no window; a dense "
        "mask would take it off its flash path)",
        "sdpa: logits_soft_cap=30 not supported (torch SDPA has no soft-cap)",
        "sdpa: sinks not supported (torch SDPA has no sink term in the softmax denominator)",
        "sdpa: ALiBi not supported (torch SDPA takes no per-head position bias)",
        "sdpa: custom functors (variant 'rel_bias') not supported (torch SDPA takes no score or mask functions)",
    ]
    assert reasons("sdpa", PLAIN, CPU) == [] and reasons("sdpa", PLAIN, H100) == []
    assert reasons("sdpa", AttentionSpec(8, 2, 96, causal=False), CPU) == []


def test_flex_passes_over_head_dims_below_16_on_cuda():
    # torch inductor's CUDA lowering raises NotImplementedError below 16; the default path must not pick flex
    assert reasons("flex", AttentionSpec(8, 2, 8)) == [
        "flex: head_dim_qk=8 not supported (torch's compiled FlexAttention needs head dims >= 16)",
        "flex: head_dim_vo=8 not supported (torch's compiled FlexAttention needs head dims >= 16)"]
    assert reasons("flex", AttentionSpec(8, 2, 24)) == []  # padded to 32 inside the kernel
    assert select(AttentionSpec(8, 2, 8), "h100").backend.name != "flex"


@pytest.mark.parametrize("num_qo_heads, num_kv_heads", [(6, 2), (10, 2), (12, 2), (28, 4), (7, 1)])
def test_flex_serves_gqa_groups_that_are_not_a_power_of_two(num_qo_heads, num_kv_heads):
    """torch's flex dispatch sends a group that is not a power of two to its main kernel (the decode
    kernel takes only powers of two): nothing fails, so flex refuses none (module doc of backends.flex)."""
    assert reasons("flex", AttentionSpec(num_qo_heads, num_kv_heads, 64)) == []


def test_flex_reasons():
    assert reasons("flex", GEMMA2) == []
    assert reasons("flex", AttentionSpec(12, 12, 64, alibi=True, variant=DOC_MASK)) == []
    assert reasons("flex", AttentionSpec(8, 2, 64, sinks=True)) == [
        "flex: sinks not supported (FlexAttention's softmax has no sink term in the denominator)"]
    assert reasons("flex", AttentionSpec(8, 2, 64, variant=NO_TORCH)) == [
        "flex: variant 'cuda_only' has logits_transform (CUDA only, no torch version); FlexAttention needs the "
        "functors in torch"]
    assert reasons("flex", AttentionSpec(8, 2, 64, variant=TRACED_DISTANCE)) == []
    rope = rotary_embedding(64)
    assert reasons("flex", AttentionSpec(8, 2, 64, variant=rope)) == [
        f"flex: variant {rope.name!r} has query_transform, key_transform (FlexAttention has only score_mod and mask_mod)"]
    assert reasons("flex", AttentionSpec(8, 2, 64, variant=sigmoid_attention())) == [
        "flex: variant 'sigmoid' has softmax=False (FlexAttention always normalises with a softmax)"]
    assert reasons("flex", PLAIN, CPU) == ["flex: runs on CUDA devices only, device is cpu"]
    assert reasons("flex", PLAIN, "t4") == ["flex: needs compute capability >= 8.0, device t4 has 7.5"]


def test_reference_reasons():
    assert reasons("reference", AttentionSpec(8, 1, 64, sinks=True, alibi=True, variant=REL_BIAS), CPU) == []
    for variant in (rotary_embedding(64), sigmoid_attention(), OUTPUT_GATE, document_mask()):
        assert reasons("reference", AttentionSpec(8, 2, 64, variant=variant), CPU) == []
    assert reasons("reference", AttentionSpec(8, 2, 64, variant=sigmoid_attention()), CPU, need_lse=True) == [
        "reference: variant 'sigmoid' has no softmax, so there is no lse"]
    rope_cuda = Variant(name="rope_cuda", query_transform="x * 2.0f")
    assert reasons("reference", AttentionSpec(8, 2, 64, variant=rope_cuda), CPU) == [
        "reference: variant 'rope_cuda' has query_transform (CUDA only, no torch version); torch backends need the "
        "functors in torch"]
    assert reasons("reference", AttentionSpec(8, 2, 64, variant=NO_TORCH), CPU) == [
        "reference: variant 'cuda_only' has logits_transform (CUDA only, no torch version); torch backends need the "
        "functors in torch"]


def test_flashinfer_not_installed_is_one_reason(monkeypatch):
    monkeypatch.setattr(fi_mod, "flashinfer_import_error", lambda: "ModuleNotFoundError: No module named 'flashinfer'")
    assert reasons("flashinfer", PLAIN) == [
        "flashinfer: not installed (import flashinfer failed: ModuleNotFoundError: No module named 'flashinfer')"]


def test_flashinfer_reasons_when_installed(monkeypatch):
    monkeypatch.setattr(fi_mod, "flashinfer_import_error", lambda: None)
    assert reasons("flashinfer", GEMMA2) == []
    assert reasons("flashinfer", AttentionSpec(32, 8, 96)) == [
        "flashinfer: head_dim=96 not supported (FlashInfer's kernels take 64, 128, 256)"]
    spec = AttentionSpec(8, 8, 64, causal=False, window_right=3, sinks=True, alibi=True, variant=DOC_MASK)
    assert reasons("flashinfer", spec, "v100") == [
        "flashinfer: needs compute capability >= 8.0, device v100 has 7.0",
        "flashinfer: window_right=3 not supported (FlashInfer has only window_left)",
        "flashinfer: sinks not supported (BatchPrefillWithPagedKVCacheWrapper has no sink term)",
        "flashinfer: ALiBi not supported by this adapter (it does not pass slopes to FlashInfer)",
        "flashinfer: custom functors (variant 'doc_mask') not supported (FlashInfer's JIT variants use their own "
        "C++ contract)",
    ]


def test_requirements_lse_and_cuda_graph():
    assert reasons("sdpa", PLAIN, CPU, need_lse=True) == ["sdpa: cannot return the lse (return_lse=True)"]
    graph = "not CUDA-graph capturable (reads sequence lengths on the host each call)"
    for name in ("sdpa", "flex", "reference"):
        assert reasons(name, PLAIN, H100, cuda_graph=True)[-1] == f"{name}: {graph}"
    assert reasons("jit", PLAIN, H100, need_lse=True, cuda_graph=True) == []


def test_phase_is_validated():
    with pytest.raises(ValueError, match=r"phase='append': expected one of \('prefill', 'decode', 'mixed'\)"):
        reasons("jit", PLAIN, H100, "append")


def test_fp8_kv_only_where_the_scales_are_applied():
    from jitattn.spec import KV_DTYPES

    spec = AttentionSpec(8, 2, 128)
    object.__setattr__(spec, "kv_dtype", "float8_e4m3fn")  # whether or not the spec takes fp8 yet
    msg = "kv_dtype=float8_e4m3fn not supported (takes float16, bfloat16) (an FP8 cache needs k_scale / v_scale " \
          "applied on load; this backend does not)"
    assert reasons("sdpa", spec, CPU) == [f"sdpa: {msg}"]
    assert reasons("flex", spec) == [f"flex: {msg}"]
    assert reasons("reference", spec, CPU) == []
    jit = reasons("jit", spec)
    assert jit == ([] if "float8_e4m3fn" in KV_DTYPES else
                   [f"jit: kv_dtype=float8_e4m3fn not supported (takes {', '.join(KV_DTYPES)}) (an FP8 cache needs "
                    f"k_scale / v_scale applied on load; this backend does not)"])


# ---- torch backends against the reference, on the CPU ------------------------------------------------
CASES = [
    ("plain", PLAIN, {}),
    ("hnd-page7-noncausal", AttentionSpec(8, 2, 64, causal=False, kv_layout="HND", page_size=7), {}),
    ("fp16-group1", AttentionSpec(4, 4, 80, q_dtype="float16"), {}),
    ("window-softcap", AttentionSpec(8, 2, 64, window_left=20, logits_soft_cap=30.0), {}),
    ("windows-both", AttentionSpec(8, 2, 64, causal=False, window_left=9, window_right=5), {}),
    ("alibi", AttentionSpec(12, 12, 64, alibi=True, q_dtype="float16"), {}),
    ("group6", AttentionSpec(12, 2, 64, window_left=30), {}),  # a GQA group that is not a power of two
    ("rel-bias", AttentionSpec(8, 2, 64, variant=REL_BIAS), {"bias": torch.linspace(-0.2, 0.3, 8), "max_dist": 16.0}),
    ("doc-mask", AttentionSpec(8, 2, 64, variant=DOC_MASK, causal=False), _doc_params("cpu", 400)),
    ("empty-rows", AttentionSpec(8, 2, 64, variant=HIDE_HEAD), {"hidden": 3}),
    ("traced-distance", AttentionSpec(8, 2, 64, variant=TRACED_DISTANCE), {"slope": torch.linspace(0.01, 0.2, 8)}),
    ("traced-document-causal", AttentionSpec(8, 2, 64, variant=document_mask()),
     {"doc": torch.cumsum((torch.rand(6 * 100, generator=torch.Generator().manual_seed(3)) < 0.05).int(),
                          0).to(torch.int32), "doc_stride": 100}),
    ("rotary", AttentionSpec(8, 2, 64, variant=rotary_embedding(64)), {}),
]
Q_LENS, KV_LENS = [1, 17, 1, 5, 0, 3], [40, 17, 100, 60, 3, 3]


@pytest.fixture(autouse=True)
def _quiet_flex():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        yield


# Every case each torch backend accepts (flex refuses the CPU only because it is not selected there).
SERVED = [(b, *c) for b in ("sdpa", "flex", "reference") for c in CASES
          if all("runs on CUDA devices only" in r for r in reasons(b, c[1], CPU))]


@pytest.mark.parametrize("backend, name, spec, params", SERVED, ids=[f"{s[0]}-{s[1]}" for s in SERVED])
def test_torch_backend_matches_reference(backend, name, spec, params):
    batch = random_paged_batch(spec, Q_LENS, KV_LENS, params=params, seed=3)
    ref_out, ref_lse = reference.paged_attention(spec, *batch.args(), **batch.kwargs(), return_lse=True)
    fn = get_backend(backend).build(spec, CPU)
    out = torch.full_like(ref_out, float("nan"))
    if backend == "sdpa":
        res, lse = fn(*batch.args(), **batch.kwargs(), out=out), None
    else:
        res, lse = fn(*batch.args(), **batch.kwargs(), out=out, return_lse=True)
    assert res is out
    assert relative_error(out, ref_out) < 1e-2
    if lse is not None:
        assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
        finite = torch.isfinite(ref_lse)
        # Unfused FlexAttention on the CPU evaluates a score_mod reading captured tensors in bf16 (biases).
        assert (lse[finite] - ref_lse[finite]).abs().max() < (6e-2 if name in ("rel-bias", "traced-distance") else 1e-4)


def test_sdpa_refuses_lse_at_call_time():
    batch = random_paged_batch(PLAIN, [1], [5])
    with pytest.raises(NotImplementedError, match="sdpa: cannot return the lse"):
        get_backend("sdpa").build(PLAIN, CPU)(*batch.args(), return_lse=True)


def test_backend_call_checks_tensors():
    batch = random_paged_batch(PLAIN, [1], [5])
    with pytest.raises(ValueError, match=r"q: dim 1 \(num_qo_heads\) must be 8"):
        get_backend("sdpa").build(PLAIN, CPU)(batch.q[:, :4], *batch.args()[1:])


def test_flashinfer_page_metadata():
    spec = AttentionSpec(8, 2, 64, page_size=4)
    table = torch.tensor([[7, 3, 9], [2, 0, 0], [5, 6, 0]], dtype=torch.int32)
    seq_lens = torch.tensor([9, 4, 5], dtype=torch.int32)
    indptr, indices, last = fi_mod.page_metadata(spec, table, seq_lens)
    assert indptr.tolist() == [0, 3, 4, 6]
    assert indices.tolist() == [7, 3, 9, 2, 5, 6]
    assert last.tolist() == [1, 4, 1]


@pytest.mark.parametrize("text, described", [
    ("7.0", "compute capability 7.0 (cuda)"),    # named by its capability: said once
    ("sm_90", "sm_90 (cuda, 9.0)"),
    ("h100", "h100 (cuda, 9.0)"),
    ("cpu", "cpu"),
])
def test_device_describe(text, described):
    assert DeviceInfo.parse(text).describe() == described


@pytest.mark.parametrize("backend, change, match", [
    ("sdpa", dict(logits_soft_cap=50.0, window_left=7), r"sdpa: sliding window \(window_left=7\) not supported.*; "
                                                         r"sdpa: logits_soft_cap=50 not supported"),
    ("flex", dict(kv_dtype="float8_e4m3fn"), r"flex: kv_dtype=float8_e4m3fn not supported"),
])
def test_build_called_directly_refuses_a_spec_the_backend_cannot_serve(backend, change, match):
    """``get_backend(name).build(spec, device)`` without the selector: a spec the backend cannot serve is
    a ValueError naming the reasons, not a callable that drops a soft-cap or a window or reads FP8
    without its scales (a silent wrong answer)."""
    spec = dataclasses.replace(PLAIN, **change)
    with pytest.raises(ValueError, match=rf"backend '{backend}' cannot serve this spec on sm_90 \(cuda, 9.0\): {match}"):
        get_backend(backend).build(spec, DeviceInfo.parse("sm_90"))
    with pytest.raises(ValueError, match=rf"backend '{backend}' cannot serve this spec on cpu: {match}"):
        get_backend(backend).build(spec, CPU)
    assert callable(get_backend(backend).build(PLAIN, CPU))  # what it serves still builds


def test_build_guard_judges_a_cpu_only_backend_on_the_cpu():
    """A third-party backend that serves the CPU only: ``reasons(spec, "cpu")`` is empty, so ``build(spec,
    "cpu")`` builds (the guard must not judge it on a stand-in CUDA device only); a feature it refuses
    is named without the stand-in device."""
    from jitattn.backends import Backend

    class CpuOnly(Backend):
        name = "cpu_only_test"

        def spec_reasons(self, spec, device, phase):
            out = [] if device.type == "cpu" else [f"{self.name}: CPU only, device is {device.name}"]
            return out + ([f"{self.name}: no soft-cap"] if spec.logits_soft_cap else [])

        def build(self, spec, device, *, workspace=None):
            return lambda: ("ran", device.type, workspace)

    backend = CpuOnly()
    assert backend.reasons(PLAIN, CPU) == []
    assert backend.build(PLAIN, CPU)() == ("ran", "cpu", None)
    assert backend.build(PLAIN, "cpu", workspace=7)() == ("ran", "cpu", 7)  # the subclass's own keywords pass
    with pytest.raises(ValueError, match=r"^backend 'cpu_only_test' cannot serve this spec on cpu: "
                                         r"cpu_only_test: no soft-cap$"):
        backend.build(PLAIN.replace(logits_soft_cap=30.0), CPU)
    with pytest.raises(ValueError, match=r"cannot serve this spec on h100 \(cuda, 9.0\): cpu_only_test: CPU only"):
        backend.build(PLAIN, H100)
