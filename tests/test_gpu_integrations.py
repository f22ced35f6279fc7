"""Backends, the custom op and the transformers integration on a CUDA GPU (``pytest -m gpu``).

- Every backend that says it serves a spec on this device (jit, flex, sdpa, flashinfer if
  installed, reference) matches the fp32 reference on a mixed batch.
- A Gemma-2-architecture model (hd 256, soft-cap 50, alternating windows; random weights, built from
  a config: no download) and a gpt-oss one (sinks) run with ``attn_implementation="jitattn"``
  through the jit kernels and match ``"eager"`` (logits, greedy tokens), as on the CPU
  (tests/test_integrations.py, tests/test_transformers_integration.py) but on the device.
- ``torch.compile(fullgraph=True)`` (inductor) traces through the custom op on the jit backend.
- A decode captured in a CUDA graph and replayed on new inputs (new q, K/V, sequence lengths)
  matches the reference.
"""

from __future__ import annotations


import pytest
import torch

from jitattn import AttentionSpec, reference, selector
from jitattn.backends import DeviceInfo, get_backend, registered_backends
from jitattn.ops import paged_attention
from jitattn.testing import random_paged_batch, relative_error
from tests.conftest import GPU_TOL, precompile
from tests.gpu_cases import DOC_MASK, REL_BIAS, _doc_params

pytestmark = pytest.mark.gpu
TOL = GPU_TOL

MATRIX = [
    ("plain-hd128", AttentionSpec(32, 8, 128), {}),
    ("gemma2-hd256-softcap-window", AttentionSpec(16, 8, 256, logits_soft_cap=50.0, window_left=63,
                                                  sm_scale=256 ** -0.5), {}),
    ("hd96-hnd-page7-fp16", AttentionSpec(8, 2, 96, q_dtype="float16", kv_layout="HND", page_size=7), {}),
    ("noncausal-windows", AttentionSpec(8, 2, 64, causal=False, window_left=31, window_right=17), {}),
    ("alibi", AttentionSpec(12, 12, 64, alibi=True, q_dtype="float16"), {}),
    ("sinks-window", AttentionSpec(16, 2, 64, sinks=True, window_left=127), {}),
    ("rel-bias", AttentionSpec(8, 2, 128, variant=REL_BIAS),
     {"bias": lambda d: torch.linspace(-0.2, 0.3, 8, device=d), "max_dist": 64.0}),
    ("doc-mask", AttentionSpec(8, 2, 128, variant=DOC_MASK, causal=False), {"doc": lambda d: _doc_params(d)["doc"]}),
    ("fp8-kv-window", AttentionSpec(32, 8, 128, kv_dtype="float8_e4m3fn", window_left=255), {}),
]
Q_LENS, KV_LENS = [1, 40, 1, 130, 7, 1, 0], [1, 300, 1000, 130, 2100, 17, 5]
BACKENDS = ["jit", "flashinfer", "flex", "sdpa", "reference"]


def _params(params, device):
    return {k: v(device) if callable(v) else v for k, v in params.items()}


def _hf_specs() -> list[AttentionSpec]:
    """The specs the transformers tests' layers map to (same path as the integration)."""
    import jitattn.integrations.transformers as jt

    out = []
    for hq, hkv, d, scale, cap, sinks in ((4, 2, 256, 256 ** -0.5, 50.0, False), (4, 2, 64, 64 ** -0.5, None, True)):
        for window in (8, None):
            out.append(jt.spec_from_json(jt._spec_text(hq, hkv, d, torch.bfloat16, scale, cap, window, True, sinks)))
    return out


GRAPH_SPECS = [AttentionSpec(32, 8, 128), AttentionSpec(16, 8, 256, logits_soft_cap=50.0, window_left=4095,
                                                         sm_scale=256 ** -0.5)]


@pytest.fixture(scope="module", autouse=True)
def compiled(session_cache_dir):
    """Compile every jit spec these tests use up front, in parallel."""
    precompile([m[1] for m in MATRIX] + _hf_specs() + GRAPH_SPECS, session_cache_dir)


@pytest.fixture(autouse=True)
def _fresh_selector():
    selector.clear_caches()


# ---- every backend that says yes, against the reference --------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name, spec, params", MATRIX, ids=[m[0] for m in MATRIX])
def test_backend_matches_reference_on_device(backend, name, spec, params, session_cache, record, seed):
    device = DeviceInfo.from_torch("cuda")
    why = get_backend(backend).reasons(spec, device)
    record(backend=backend, served=not why)
    if why:
        pytest.skip("; ".join(why))
    batch = random_paged_batch(spec, Q_LENS, KV_LENS, device="cuda", params=_params(params, "cuda"), seed=seed)
    fn = get_backend(backend).build(spec, device)
    out = torch.full((sum(Q_LENS), spec.num_qo_heads, spec.head_dim_vo), float("nan"), dtype=batch.q.dtype,
                     device="cuda")
    lse = None
    if get_backend(backend).supports_lse:
        out, lse = fn(*batch.args(), **batch.kwargs(), out=out, return_lse=True)
    else:
        out = fn(*batch.args(), **batch.kwargs(), out=out)
    torch.cuda.synchronize()
    ref_out, ref_lse = reference.paged_attention(spec, *batch.args(), **batch.kwargs(), return_lse=True)
    err = relative_error(out, ref_out)
    record(rel_err=err)
    assert not torch.isnan(out).any(), f"{backend}/{name}: NaN in output"
    assert err < TOL[spec.q_dtype], f"{backend}/{name}: relative error {err:.3e}"
    if lse is not None:
        finite = torch.isfinite(ref_lse)
        assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
        lse_err = (lse[finite] - ref_lse[finite]).abs().max().item()
        record(lse_max_abs_err=lse_err)
        assert lse_err < 2e-2


def test_selector_picks_jit_on_this_device(record):
    device = DeviceInfo.from_torch("cuda")
    record(device=device.describe(), backends=[b.name for b in registered_backends()])
    for _, spec, _ in MATRIX:
        assert selector.select(spec, device).name == "jit"
    for spec in _hf_specs():
        assert selector.select(spec, "cuda", "decode", cuda_graph=True).name == "jit"


# ---- transformers ---------------------------------------------------------------------------------------------
def test_gemma2_matches_eager_on_device_through_jit(session_cache, record, seed):
    from tests.test_transformers_integration import (Gemma2ForCausalLM, build_models, check_greedy, check_logits,
                                                     gemma2_config)

    models = build_models(Gemma2ForCausalLM, gemma2_config(), device="cuda", seed=seed)
    ids = torch.randint(3, 256, (2, 24), generator=torch.Generator().manual_seed(seed)).cuda()
    eager_err, jit_err = check_logits(models, ids)
    eager, jit = check_greedy(models, ids, new_tokens=16)
    record(eager_bf16_vs_fp32=eager_err, jitattn_vs_fp32=jit_err, same_tokens=bool(torch.equal(eager, jit)))
    for spec in _hf_specs()[:2]:
        assert selector.select(spec, "cuda", "prefill").name == "jit"


def test_gemma2_left_padded_batch_on_device(session_cache, record, seed):
    from tests.test_transformers_integration import (Gemma2ForCausalLM, build_models, check_greedy, check_logits,
                                                     gemma2_config)

    models = build_models(Gemma2ForCausalLM, gemma2_config(), device="cuda", seed=seed)
    ids = torch.randint(3, 256, (2, 20), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1, :6], ids[1, :6] = 0, 0
    ids, mask = ids.cuda(), mask.cuda()
    eager_err, jit_err = check_logits(models, ids, mask, valid=mask.bool())
    check_greedy(models, ids, mask)
    record(eager_bf16_vs_fp32=eager_err, jitattn_vs_fp32=jit_err)


def test_gpt_oss_sinks_on_device_through_jit(session_cache, record, seed):
    from tests.test_transformers_integration import (GptOssForCausalLM, build_models, check_greedy, check_logits,
                                                     gpt_oss_config)

    models = build_models(GptOssForCausalLM, gpt_oss_config(), device="cuda", seed=seed)
    ids = torch.randint(3, 256, (2, 24), generator=torch.Generator().manual_seed(seed)).cuda()
    eager_err, jit_err = check_logits(models, ids)
    check_greedy(models, ids, new_tokens=8)
    record(eager_bf16_vs_fp32=eager_err, jitattn_vs_fp32=jit_err)


# ---- the custom op under torch.compile and CUDA graphs ----------------------------------------------------------
def test_op_compiles_fullgraph_with_inductor_on_jit(session_cache, seed):
    spec = MATRIX[1][1]
    batch = random_paged_batch(spec, Q_LENS, KV_LENS, device="cuda", seed=seed)

    def layer(q, kv_cache, block_table, seq_lens, qsl):
        out = paged_attention(spec, q * 1.0, kv_cache, block_table, seq_lens, qsl, backend="jit")
        return out.float() * 2.0

    got = torch.compile(layer, fullgraph=True)(*batch.args())
    ref = reference.paged_attention(spec, *batch.args()).float() * 2.0
    assert relative_error(got, ref) < TOL[spec.q_dtype]


def test_op_selects_jit_when_compiled(session_cache, seed):
    spec = MATRIX[0][1]
    batch = random_paged_batch(spec, Q_LENS, KV_LENS, device="cuda", seed=seed)
    got = torch.compile(lambda *a: paged_attention(spec, *a), fullgraph=True)(*batch.args())
    assert relative_error(got, reference.paged_attention(spec, *batch.args())) < TOL[spec.q_dtype]


@pytest.mark.parametrize("spec", GRAPH_SPECS, ids=["hd128", "gemma2-window-softcap"])
def test_decode_cuda_graph_replay(spec, session_cache, record, seed):
    """Capture one decode call, then replay it on new q, K/V and sequence lengths (same shapes)."""
    kv_lens_a, kv_lens_b = [5000, 17, 300, 1], [4096, 4097, 1, 9000]
    capacity = [max(a, b) for a, b in zip(kv_lens_a, kv_lens_b)]
    base = random_paged_batch(spec, [1] * 4, capacity, device="cuda", seed=seed)  # the page table stays
    q, kv_cache, block_table, seq_lens, qsl = (t.clone() for t in base.args())
    seq_lens.copy_(torch.tensor(kv_lens_a, dtype=torch.int32))

    def decode():
        return paged_attention(spec, q, kv_cache, block_table, seq_lens, qsl, backend="jit", max_query_len=1)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        decode()  # load the kernel, warm the allocator
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode()
    errors = []
    for lens, replay_seed in ((kv_lens_a, seed + 1), (kv_lens_b, seed + 2)):  # new inputs, recorded seeds
        fresh = random_paged_batch(spec, [1] * 4, capacity, device="cuda", seed=replay_seed)
        q.copy_(fresh.q)
        kv_cache.copy_(fresh.kv_cache)
        block_table.copy_(fresh.block_table)
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = reference.paged_attention(spec, q, kv_cache, block_table, seq_lens, qsl)
        errors.append(relative_error(out, ref))
        assert not torch.isnan(out).any()
    record(rel_errs=errors)
    assert max(errors) < TOL[spec.q_dtype]


FLEX_GROUPS = [(12, 2), (10, 2), (7, 1), (32, 8)]  # groups 6, 5, 7, and 4 (a power of two: the decode kernel)


@pytest.mark.parametrize("q_lens", [[1] * 16, [1, 5, 1, 3]], ids=["decode", "short-mixed"])
@pytest.mark.parametrize("num_qo_heads, num_kv_heads", FLEX_GROUPS, ids=[f"{h}x{k}" for h, k in FLEX_GROUPS])
def test_flex_serves_any_gqa_group_on_device(num_qo_heads, num_kv_heads, q_lens, record, seed):
    """Fewer than 128 query rows take torch's flex decode kernel, which packs a GQA group per program and
    takes only powers of two; torch's dispatch sends other groups to its main kernel (module doc of
    jitattn.backends.flex). On a torch that does not, this raises, and flex would have to refuse them."""
    spec = AttentionSpec(num_qo_heads, num_kv_heads, 128)
    device = DeviceInfo.from_torch("cuda")
    why = get_backend("flex").reasons(spec, device)
    if why:
        pytest.skip("; ".join(why))
    kv_lens = [(97 * i) % 700 + len(q_lens) for i in range(1, len(q_lens) + 1)]
    batch = random_paged_batch(spec, q_lens, kv_lens, device="cuda", seed=seed)
    out, lse = get_backend("flex").build(spec, device)(*batch.args(), **batch.kwargs(), return_lse=True)
    torch.cuda.synchronize()
    ref_out, ref_lse = reference.paged_attention(spec, *batch.args(), **batch.kwargs(), return_lse=True)
    err = relative_error(out, ref_out)
    record(torch=torch.__version__, group_size=spec.group_size, rel_err=err)
    assert not torch.isnan(out).any() and err < TOL[spec.q_dtype], f"group {spec.group_size}: {err:.3e}"
    assert (lse - ref_lse).abs().max().item() < 2e-2
