"""Multi-head latent attention (issue 20, the CPU half): the latent spec, the reference against a naive
per-head loop, the sdpa backend against the reference, append_latent_kv, the DeepSeek config mapping,
and what selection, plan, warmup, doctor and cache export do with a latent spec."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

import jitattn
from jitattn import AttentionSpec, reference
from jitattn.backends import DeviceInfo, get_backend
from jitattn.kv_write import append_kv, append_latent_kv
from jitattn.models import MLA_DECODE, MLA_PREFILL, compare_with_transformers, load_model_config
from jitattn.selector import NoBackendError, select
from jitattn.testing import random_paged_batch, relative_error
from tests.test_cache import compile_calls, fake_nvcc
from tests.test_cli import jitattn as run_cli

DEEPSEEK_V3 = Path(__file__).resolve().parent / "models" / "deepseek-v3.json"
FP8 = torch.float8_e4m3fn
#: DeepSeek-V3's softmax scale, from the formula (qk_nope + qk_rope) ** -0.5 * (0.1 * mscale_all_dim * ln(factor) + 1) ** 2.
DEEPSEEK_V3_SCALE = (128 + 64) ** -0.5 * (0.1 * 1.0 * math.log(40) + 1) ** 2


def latent(heads: int = 16, page_size: int = 16, kv_dtype: str | None = None, **kw) -> AttentionSpec:
    return AttentionSpec(num_qo_heads=heads, num_kv_heads=1, head_dim_qk=576, head_dim_vo=512, kv_storage="latent",
                         page_size=page_size, kv_dtype=kv_dtype, sm_scale=0.1352, **kw)


# ---- the spec --------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw", [dict(page_size=1), dict(page_size=64), dict(page_size=1024), dict(kv_dtype="fp8"),
                                dict(heads=1), dict(heads=128), dict(q_dtype="float16")])
def test_latent_specs_of_the_issue_are_accepted(kw):
    spec = latent(**kw)
    assert spec.latent and not spec.ragged and not spec.has_decode
    assert "latent" in spec.name and "latent (MLA)" in spec.describe()
    assert AttentionSpec.from_json(spec.canonical_json()) == spec


def test_other_latent_head_dims_are_accepted():
    """MiniCPM3-style 288 / 256 (kv_lora_rank 256, rope 32) and the largest, 1024 / 1008."""
    for qk, vo in ((288, 256), (1024, 1008), (48, 32)):
        assert AttentionSpec(8, 1, qk, vo, kv_storage="latent", sm_scale=0.1).head_dim_vo == vo


BAD = [
    (dict(num_kv_heads=2), r"num_kv_heads=2 with kv_storage='latent': .* num_kv_heads must be 1"),
    (dict(num_qo_heads=256), r"num_qo_heads=256: expected an int in \[1, 128\] with kv_storage='latent'"),
    (dict(head_dim_vo=576), r"head_dim_vo=576, head_dim_qk=576 with kv_storage='latent': .*head_dim_vo must be < "
                            r"head_dim_qk"),
    (dict(head_dim_vo=None), r"head_dim_vo=576, head_dim_qk=576"),
    (dict(head_dim_qk=1040, head_dim_vo=512), r"head_dim_qk=1040: expected an int in \[32, 1024\], a multiple of 16"),
    (dict(head_dim_qk=584), r"head_dim_qk=584: expected a multiple of 16 in \[32, 1024\]"),
    (dict(sm_scale=None), r"sm_scale=None with kv_storage='latent': give it explicitly"),
    (dict(kv_layout="HND"), r"kv_layout='HND' with kv_storage='latent': .* leave kv_layout 'NHD'"),
    (dict(causal=False), r"causal=False with kv_storage='latent': latent \(MLA decode\) specs take causal=True only"),
    (dict(window_left=127), r"window_left=127 with kv_storage='latent': .* take window_left=-1 only"),
    (dict(logits_soft_cap=30.0), r"logits_soft_cap=30.0 with kv_storage='latent': .* take logits_soft_cap=0 only"),
    (dict(alibi=True), r"alibi=True with kv_storage='latent'"),
    (dict(sinks=True), r"sinks=True with kv_storage='latent'"),
    (dict(variant=jitattn.variant.document_mask()), r"variant=.* with kv_storage='latent'"),
    (dict(query_positions="explicit"), r"query_positions='explicit' with kv_storage='latent'"),
    (dict(kv_dtype="float16"), r"kv_dtype='float16': must equal q_dtype='bfloat16' or be 'float8_e4m3fn'"),
    (dict(page_size=2048), r"page_size=2048: expected an int in \[1, 1024\]"),
]


@pytest.mark.parametrize("kw,match", BAD, ids=[next(iter(kw)) + f"={list(kw.values())[0]!r}"[:20] for kw, _ in BAD])
def test_latent_spec_errors_name_field_value_and_allowed(kw, match):
    fields = {**dict(num_qo_heads=16, num_kv_heads=1, head_dim_qk=576, head_dim_vo=512, kv_storage="latent",
                     sm_scale=0.1, page_size=16), **kw}
    with pytest.raises(ValueError, match=match):
        AttentionSpec(**fields)


# ---- the reference against a naive per-head loop ---------------------------------------------------
def naive_latent(spec: AttentionSpec, q, cache, block_table, seq_lens, query_start_loc, k_scale=1.0):
    """One head and one sequence at a time, in float64, reading each token's row through the block table."""
    out = torch.zeros(q.shape[0], spec.num_qo_heads, spec.head_dim_vo, dtype=torch.float64)
    lse = torch.full((q.shape[0], spec.num_qo_heads), float("-inf"), dtype=torch.float64)
    qsl = query_start_loc.tolist()
    for b, kv_len in enumerate(seq_lens.tolist()):
        q0, q1 = qsl[b], qsl[b + 1]
        if q1 == q0:
            continue
        rows = torch.stack([cache[int(block_table[b, t // spec.page_size]), t % spec.page_size]
                            for t in range(kv_len)]).double() * k_scale  # (L, 576)
        for i in range(q1 - q0):
            pos = kv_len - (q1 - q0) + i
            for h in range(spec.num_qo_heads):
                s = rows[: pos + 1] @ q[q0 + i, h].double() * spec.sm_scale  # causal: keys 0 .. pos
                p = torch.softmax(s, 0)
                out[q0 + i, h] = p @ rows[: pos + 1, : spec.head_dim_vo]
                lse[q0 + i, h] = torch.logsumexp(s, 0)
    return out, lse


MATRIX = [pytest.param(page, q_len, heads, dtype, id=f"p{page}-q{q_len}-g{heads}-{dtype}")
          for page in (1, 16, 64) for q_len in (1, 4) for heads in (1, 16, 128) for dtype in ("bf16", "fp8")]


def _batch(page, q_len, heads, dtype, seed=0):
    spec = latent(heads, page, "fp8" if dtype == "fp8" else None)
    # an empty sequence (no keys, no queries), one whose queries were served already (keys, no queries)
    return spec, random_paged_batch(spec, [q_len, 0, q_len, 0], [37, 0, 70 + q_len, 5], seed=seed)


@pytest.mark.parametrize("page,q_len,heads,dtype", MATRIX)
def test_reference_matches_a_naive_per_head_loop(page, q_len, heads, dtype, seed):
    spec, b = _batch(page, q_len, heads, dtype, seed)
    out, lse = reference.paged_attention(spec, *b.args(), return_lse=True, **b.scales)
    want, want_lse = naive_latent(spec, *b.args(), k_scale=b.scales.get("k_scale", 1.0))
    assert out.shape == (2 * q_len, heads, 512) and out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert relative_error(out, want) < 1e-2
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-4, atol=1e-4)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


def test_the_reference_reads_only_the_sequences_rows():
    """Unused cache slots hold NaN (random_paged_batch): the answer stays finite, and one changed key changes it."""
    spec, b = _batch(16, 4, 16, "bf16")
    out = reference.paged_attention(spec, *b.args())
    page, slot = int(b.block_table[2, 0]), 3
    b.kv_cache[page, slot] += 4.0  # a key the last queries of sequence 2 see
    changed = reference.paged_attention(spec, *b.args())
    assert torch.isfinite(out).all() and not torch.equal(out[4:], changed[4:]) and torch.equal(out[:4], changed[:4])


def test_latent_reference_input_errors():
    spec, b = _batch(16, 1, 16, "bf16")
    five_dim = torch.zeros(3, 2, 16, 1, 576, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"kv_cache: expected 3 dims, got shape \(3, 2, 16, 1, 576\)"):
        reference.paged_attention(spec, b.q, five_dim, *b.args()[2:])
    with pytest.raises(ValueError, match=r"kv_cache: dim 2 \(head_dim_qk; latent cache \(num_pages, page_size, "
                                         r"head_dim_qk\)\) must be 576, got 512"):
        reference.paged_attention(spec, b.q, b.kv_cache[..., :512], *b.args()[2:])
    with pytest.raises(ValueError, match=r"a latent spec reads one tensor .* got a \(k_cache, v_cache\) pair"):
        reference.paged_attention(spec, b.q, (b.kv_cache, b.kv_cache), *b.args()[2:])
    fp8_spec, fb = _batch(16, 1, 16, "fp8")
    with pytest.raises(ValueError, match=r"v_scale=0.5: a latent cache has one scale, k_scale"):
        reference.paged_attention(fp8_spec, *fb.args(), k_scale=0.5, v_scale=0.5)
    with pytest.raises(ValueError, match=r"k_scale=2.0: only an FP8 cache"):
        reference.paged_attention(spec, *b.args(), k_scale=2.0)


# ---- the backends ----------------------------------------------------------------------------------
@pytest.mark.parametrize("page,q_len,heads,dtype", [p for p in MATRIX if p.values[0] != 1 or p.values[2] != 1])
def test_sdpa_backend_matches_the_reference(page, q_len, heads, dtype, seed):
    spec, b = _batch(page, q_len, heads, dtype, seed)
    fn = select(spec, "cpu").build()
    assert select(spec, "cpu").name == "sdpa"
    out = torch.full((b.q.shape[0], heads, 512), float("nan"), dtype=torch.bfloat16)
    got = fn(*b.args(), out=out, **b.scales)
    assert got is out
    want = reference.paged_attention(spec, *b.args(), compute_dtype=torch.float64, **b.scales)
    assert relative_error(got, want) < 1e-2


def test_sdpa_refuses_what_it_cannot_do_and_reference_returns_the_lse():
    spec, b = _batch(16, 4, 16, "bf16")
    fn = select(spec, "cpu").build()
    with pytest.raises(NotImplementedError, match=r"sdpa: cannot return the lse"):
        fn(*b.args(), return_lse=True)
    with pytest.raises(ValueError, match=r"sinks: given, but spec.sinks=False"):
        fn(*b.args(), sinks=torch.zeros(16))
    chosen = select(spec, "cpu", need_lse=True)
    assert chosen.name == "reference"
    out, lse = chosen.build()(*b.args(), return_lse=True)
    ref_out, ref_lse = reference.paged_attention(spec, *b.args(), return_lse=True)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


#: A latent spec whose head dims the MLA decode kernel does not take (not multiples of 64).
ODD_DIMS = AttentionSpec(16, 1, 288, 256, kv_storage="latent", page_size=16, sm_scale=0.1352)
ODD_DIMS_REASON = ("head_dim_qk=288: the MLA decode kernel takes latent head dims that are multiples of 64 "
                   "(576 / 512 for DeepSeek); the sdpa and reference backends serve this one")


@pytest.mark.parametrize("kv_dtype", [None, "fp8"])
@pytest.mark.parametrize("device", ["h100", "a100"])
def test_the_jit_backend_serves_a_latent_spec_on_cuda(device, kv_dtype):
    spec = latent(128, 64, kv_dtype)
    sel = select(spec, device)
    assert sel.name == "jit" and select(spec, device, need_lse=True).name == "jit"
    assert select(spec, device, backend="jit").name == "jit"
    assert get_backend("jit").spec_reasons(spec, DeviceInfo.parse(device), "decode") == []
    for name in ("flex", "flashinfer"):
        with pytest.raises(ValueError, match=rf"backend '{name}' cannot serve this spec .* latent attention"):
            get_backend(name).build(spec, device)


@pytest.mark.parametrize("device", ["h100", "a100"])
def test_a_latent_spec_the_kernel_cannot_serve_goes_to_sdpa_with_the_reason(device):
    sel = select(ODD_DIMS, device)
    assert sel.name == "sdpa" and select(ODD_DIMS, device, need_lse=True).name == "reference"
    reasons = {r.backend: " ".join(r.reasons) for r in sel.passed_over}
    assert reasons["jit"] == f"jit: {ODD_DIMS_REASON}"
    for name in ("flex", "flashinfer"):
        assert f"{name}: latent attention (kv_storage='latent', MLA) not served" in reasons[name]
    with pytest.raises(NoBackendError, match=r"jit: head_dim_qk=288: the MLA decode kernel takes latent head dims"):
        select(ODD_DIMS, device, backend="jit")


def test_without_cuda_or_under_disable_jit_the_torch_backends_serve_a_latent_spec(monkeypatch):
    spec = latent(128, 64, "fp8")
    sel = select(spec, "cpu")
    assert sel.name == "sdpa" and select(spec, "cpu", need_lse=True).name == "reference"
    assert "latent" not in " ".join(r for rej in sel.passed_over if rej.backend == "jit" for r in rej.reasons)
    monkeypatch.setenv("JITATTN_DISABLE_JIT", "1")  # the cache is empty: jit has no kernel to load
    sel = select(spec, "h100")
    assert sel.name == "sdpa" and select(spec, "h100", need_lse=True).name == "reference"
    reasons = {r.backend: " ".join(r.reasons) for r in sel.passed_over}
    assert reasons["jit"].startswith(f"jit: missing kernel: {spec.name} is not cached for sm_90a")
    assert reasons["jit"].endswith("--arch sm_90a") and "fill it with: jitattn warmup --spec" in reasons["jit"]


def test_plan_and_the_kernel_calls_refuse_a_latent_spec_the_kernel_cannot_serve_before_any_work():
    b = random_paged_batch(ODD_DIMS, [1, 2], [10, 20], seed=0)
    expected = (rf"spec {ODD_DIMS.name}: {re.escape(ODD_DIMS_REASON)}; "
                r"jitattn.selector.select\(spec, device\).build\(\) gives a backend that serves it")
    for call in (lambda: jitattn.plan(ODD_DIMS, b.block_table, b.seq_lens, b.query_start_loc),
                 lambda: jitattn.paged_attention(ODD_DIMS, *b.args()),
                 lambda: jitattn.load_kernel(ODD_DIMS, "cuda")):
        with pytest.raises(ValueError, match=expected):
            call()


def test_the_custom_op_serves_a_latent_spec_through_the_selector():
    spec, b = _batch(16, 4, 16, "fp8")
    got = jitattn.ops.paged_attention(spec, *b.args(), **b.scales)
    want = reference.paged_attention(spec, *b.args(), **b.scales)
    assert relative_error(got, want) < 1e-2


# ---- append_latent_kv ------------------------------------------------------------------------------
def _rows(n: int, rank: int = 512, rope: int = 64, scale: float = 1.0):
    return (torch.randn(n, rank) * scale).bfloat16(), (torch.randn(n, rope) * scale).bfloat16()


@pytest.mark.parametrize("cache_dtype,k_scale", [(torch.bfloat16, 1.0), (FP8, 0.02), (FP8, 1.0)])
def test_append_latent_kv_matches_per_token_indexing(cache_dtype, k_scale):
    pages, page = 5, 16
    cache = torch.randn(pages, page, 576).to(cache_dtype)
    before = cache.clone()
    c_kv, k_pe = _rows(6, scale=20.0)  # FP8 with k_scale 0.02 saturates: |x| up to ~90 / 0.02 is far past 448
    slots = torch.tensor([0, -1, 17, 79, -1, 40])
    append_latent_kv(c_kv, k_pe, cache, slots, k_scale=k_scale)
    want = before.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            row = torch.cat([c_kv[t], k_pe[t]]).float()
            if cache_dtype == FP8:
                row = (row * jitattn.kv_write.inverse_scale(k_scale)).clamp(-448, 448)
            want[slot // page, slot % page] = row.to(cache_dtype)
    assert torch.equal(cache.view(torch.uint8), want.view(torch.uint8))
    if cache_dtype == FP8 and k_scale < 1.0:
        assert cache.float().abs().max() == 448.0


def test_append_latent_kv_then_attention_reads_the_rows():
    spec = latent(8, 4)
    cache = torch.full((6, 4, 576), float("nan"), dtype=torch.bfloat16)
    c_kv, k_pe = _rows(7)
    block_table = torch.tensor([[5, 2]], dtype=torch.int32)
    append_latent_kv(c_kv, k_pe, cache, (block_table[0].long()[:, None] * 4 + torch.arange(4)).flatten()[:7])
    q = torch.randn(2, 8, 576).bfloat16()
    args = (block_table, torch.tensor([7], dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32))
    got = reference.paged_attention(spec, q, cache, *args)
    rows = torch.cat([c_kv, k_pe], 1).double()  # (7, 576): the keys in order, as written
    s = torch.einsum("qhd,kd->qhk", q.double(), rows) * spec.sm_scale
    s[0, :, 6] = float("-inf")  # query 0 sits at position 5 of 7 (causal)
    want = torch.einsum("qhk,kd->qhd", s.softmax(-1), rows[:, :512])
    assert relative_error(got, want) < 1e-2


def test_append_latent_kv_errors():
    cache = torch.zeros(4, 16, 576, dtype=torch.bfloat16)
    c_kv, k_pe = _rows(3)
    slots = torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match=r"latent_cache: expected \(num_pages, page_size, 576\) \(kv_lora_rank 512 \+ "
                                         r"rope dim 64\), got \(4, 16, 512\)"):
        append_latent_kv(c_kv, k_pe, cache[..., :512], slots)
    with pytest.raises(ValueError, match=r"k_pe: 2 tokens"):
        append_latent_kv(c_kv, k_pe[:2], cache, slots)
    with pytest.raises(ValueError, match=r"slot_mapping: values in \[0, 64\]; allowed: -1 \(skip\) or 0 .. 63"):
        append_latent_kv(c_kv, k_pe, cache, torch.tensor([0, 1, 64]))
    with pytest.raises(ValueError, match=r"k_scale=2.0: only an FP8"):
        append_latent_kv(c_kv, k_pe, cache, slots, k_scale=2.0)
    with pytest.raises(ValueError, match=r"latent_cache: dtype torch.float16"):
        append_latent_kv(c_kv, k_pe, cache.half(), slots)
    with pytest.raises(ValueError, match=r"latent_cache: stride 0 in a dim of size > 1 \(shape \(4, 16, 576\)"):
        append_latent_kv(c_kv, k_pe, cache[:1].expand(4, 16, 576), slots)
    with pytest.raises(ValueError, match=r"a 3-dim latent MLA cache takes append_latent_kv"):
        append_kv(c_kv[:, None], c_kv[:, None], cache, slots)


# ---- DeepSeek configs ------------------------------------------------------------------------------
def test_deepseek_v3_maps_to_the_latent_decode_and_the_ragged_prefill_spec():
    model = load_model_config(DEEPSEEK_V3)
    assert [k.name for k in model.layer_kinds] == [MLA_DECODE, MLA_PREFILL]
    assert all(k.layers == tuple(range(61)) for k in model.layer_kinds)
    decode, prefill = (k.spec for k in model.layer_kinds)
    assert decode == AttentionSpec(128, 1, 576, 512, kv_storage="latent", page_size=16, sm_scale=decode.sm_scale)
    assert prefill == AttentionSpec(128, 128, 192, 128, kv_storage="ragged", sm_scale=prefill.sm_scale)
    assert decode.sm_scale == pytest.approx(DEEPSEEK_V3_SCALE, rel=1e-12) == prefill.sm_scale
    assert decode.sm_scale == pytest.approx(0.13523377886, rel=1e-9)  # not 192 ** -0.5 = 0.0722


def test_deepseek_v3_per_rank_and_serving_choices():
    model = load_model_config(DEEPSEEK_V3, tensor_parallel_size=8, page_size=64, kv_dtype="fp8")
    decode, prefill = (k.spec for k in model.layer_kinds)
    assert (decode.num_qo_heads, decode.num_kv_heads, prefill.num_qo_heads, prefill.num_kv_heads) == (16, 1, 16, 16)
    assert decode.page_size == 64 and decode.kv_dtype == "float8_e4m3fn"
    assert prefill.kv_dtype == "bfloat16" and prefill.page_size is None  # the decompressed K/V of prefill
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3: num_attention_heads=128 does not divide"):
        load_model_config(DEEPSEEK_V3, tensor_parallel_size=3)
    with pytest.raises(ValueError, match=r"layer kind 'mla_decode' .*kv_layout='HND' with kv_storage='latent'"):
        load_model_config(DEEPSEEK_V3, kv_layout="HND")


@pytest.mark.parametrize("rope,scale", [
    (None, 192 ** -0.5),
    ({"type": "yarn", "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707},  # DeepSeek-V2's
     192 ** -0.5 * (0.1 * 0.707 * math.log(40) + 1) ** 2),
    ({"type": "yarn", "factor": 40}, 192 ** -0.5),  # no mscale_all_dim: no softmax correction
    ({"rope_type": "yarn", "factor": 1.0, "mscale_all_dim": 1.0}, 192 ** -0.5),  # factor <= 1: mscale 1
    ({"rope_type": "default", "factor": 40, "mscale_all_dim": 1.0}, 192 ** -0.5),
])
def test_mla_softmax_scale_follows_yarn_mscale(rope, scale):
    cfg = {**json.loads(DEEPSEEK_V3.read_text()), "rope_scaling": rope}
    assert load_model_config(cfg).layer_kinds[0].spec.sm_scale == pytest.approx(scale, rel=1e-12)


@pytest.mark.parametrize("change,match", [
    ({"v_head_dim": 192}, r"v_head_dim=192 > qk_nope_head_dim=128"),
    ({"kv_lora_rank": None}, r"multi-head latent attention config without kv_lora_rank"),
    ({"qk_rope_head_dim": 0}, r"qk_rope_head_dim=0: expected a positive int"),
    ({"kv_lora_rank": 500}, r"layer kind 'mla_decode' \(kv_lora_rank=500, .*head_dim_qk=564: expected a multiple "
                            r"of 16"),
    ({"rope_scaling": {"type": "yarn", "mscale_all_dim": 1.0}}, r"rope_scaling.factor=None: expected a finite "
                                                               r"number >= 1 \(YaRN: factor >= 1, mscale_all_dim >= 0"),
    # not "layer kind 'mla_decode' ...: sm_scale=inf": the rope_scaling field that made it
    ({"rope_scaling": {"type": "yarn", "factor": math.inf, "mscale_all_dim": 1.0}},
     r"rope_scaling.factor=inf: expected a finite number >= 1"),
    ({"rope_scaling": {"type": "yarn", "factor": 40, "mscale_all_dim": math.nan}},
     r"rope_scaling.mscale_all_dim=nan: expected a finite number >= 0"),
    ({"rope_scaling": {"type": "yarn", "factor": 1e8, "mscale_all_dim": -20}},  # once sm_scale 92.7, silently
     r"rope_scaling.mscale_all_dim=-20: expected a finite number >= 0"),
    ({"rope_scaling": {"type": "yarn", "factor": 0.5, "mscale_all_dim": 1.0}},
     r"rope_scaling.factor=0.5: expected a finite number >= 1"),
    ({"rope_scaling": None, "rope_parameters": {"rope_type": "yarn", "factor": 40, "mscale_all_dim": "1"}},
     r"rope_parameters.mscale_all_dim='1': expected a finite number >= 0"),
])
def test_mla_fields_that_do_not_fit_are_clear_errors(change, match):
    cfg = {**json.loads(DEEPSEEK_V3.read_text()), **change}
    with pytest.raises(ValueError, match=match):
        load_model_config(cfg)


def test_transformers_reads_deepseek_v3_the_same_way(monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert compare_with_transformers(DEEPSEEK_V3) == []
    v2_like = {**json.loads(DEEPSEEK_V3.read_text()), "rope_scaling": {
        "type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
        "mscale": 0.707, "mscale_all_dim": 0.707}}
    assert compare_with_transformers(v2_like) == []
    real = jitattn.models.load_model_config

    def misread(config, **kwargs):  # the plain 192 ** -0.5, YaRN's mscale forgotten: must be reported
        from dataclasses import replace
        model = real(config, **kwargs)
        kinds = tuple(replace(k, spec=k.spec.replace(sm_scale=192 ** -0.5)) for k in model.layer_kinds)
        return replace(model, layer_kinds=kinds)

    monkeypatch.setattr(jitattn.models, "load_model_config", misread)
    (diff,) = compare_with_transformers(DEEPSEEK_V3)
    assert diff.field == "sm_scale" and diff.transformers == pytest.approx(DEEPSEEK_V3_SCALE)
    assert diff.layers == tuple(range(61)) and "DeepseekV3Attention.scaling" in diff.source


# ---- the command line ------------------------------------------------------------------------------
def test_select_names_jit_for_the_latent_decode_and_the_prefill(tmp_path):
    proc = run_cli("select", "--model", str(DEEPSEEK_V3), "--device", "h200", "--tensor-parallel-size", "8", "--json",
                   cache=tmp_path / "c")
    assert proc.returncode == 0, proc.stderr
    rows = {r["layer_kind"]: r for r in json.loads(proc.stdout)["layer_kinds"]}
    assert rows[MLA_DECODE]["backend"] == "jit" and rows[MLA_PREFILL]["backend"] == "jit"
    assert rows[MLA_DECODE]["spec"]["num_qo_heads"] == 16
    assert not any(line.startswith("jit:") for line in rows[MLA_DECODE]["passed_over"])


def test_warmup_compiles_the_latent_decode_beside_the_prefill(tmp_path):
    """With an nvcc that refuses to compile, the attempts show what warmup builds: the latent decode spec, the
    prefill spec and merge_state, with no note that another backend serves the decode."""
    from jitattn.doctor import no_kernel_note

    nvcc, log = fake_nvcc(tmp_path, "no-compile")
    proc = run_cli("warmup", "--model", str(DEEPSEEK_V3), "--arch", "sm_90a", "--tensor-parallel-size", "8",
                   cache=tmp_path / "c", env={"JITATTN_NVCC": str(nvcc)})
    model = load_model_config(DEEPSEEK_V3, tensor_parallel_size=8)
    decode, prefill = (k.spec for k in model.layer_kinds)
    assert decode.latent and proc.returncode == 1  # the three modules fail under the refusing nvcc
    assert "3 specs x 1 archs (sm_90a)" in proc.stderr and "not compiled" not in proc.stdout
    assert f"FAILED {decode.name} sm_90a" in proc.stderr and f"FAILED {prefill.name} sm_90a" in proc.stderr
    assert "FAILED merge_state_bf16" in proc.stderr and "append_kv" not in proc.stdout + proc.stderr
    assert len(compile_calls(log)) == 3
    assert no_kernel_note(decode, "sm_90a") is None and no_kernel_note(decode, "sm_80") is None


def test_warmup_compiles_nothing_for_a_latent_spec_the_kernel_cannot_serve(tmp_path):
    nvcc, log = fake_nvcc(tmp_path, "no-compile")
    proc = run_cli("warmup", "--spec", ODD_DIMS.canonical_json(), "--spec", latent().canonical_json(), "--arch",
                   "sm_90a", cache=tmp_path / "c", env={"JITATTN_NVCC": str(nvcc)})
    assert f"not compiled: {ODD_DIMS.name} (needed by --spec #1): no kernel to build: {ODD_DIMS_REASON}; " \
           f"served by the sdpa backend on sm_90a" in " ".join(proc.stdout.split()), proc.stdout + proc.stderr
    assert "1 specs x 1 archs (sm_90a)" in proc.stderr and f"FAILED {latent().name} sm_90a" in proc.stderr
    assert f"FAILED {ODD_DIMS.name}" not in proc.stderr and len(compile_calls(log)) == 1


@pytest.mark.slow
def test_warmup_of_deepseek_v3_compiles_its_decode_and_prefill_specs(tmp_path):
    proc = run_cli("warmup", "--model", str(DEEPSEEK_V3), "--arch", "sm_90a", "--tensor-parallel-size", "8",
                   cache=tmp_path / "c")
    assert proc.returncode == 0, proc.stderr
    assert "compiled 3, cached 0, failed 0" in proc.stdout and "served by" not in proc.stdout
    doctor = run_cli("doctor", "--model", str(DEEPSEEK_V3), "--arch", "sm_90a", "--tensor-parallel-size", "8",
                     cache=tmp_path / "c")
    assert doctor.returncode == 0 and "ok: this node can serve every model" in doctor.stdout


def test_doctor_and_export_count_the_latent_decode_as_a_kernel_to_cache(tmp_path):
    proc = run_cli("doctor", "--model", str(DEEPSEEK_V3), "--arch", "sm_90a", "--json", cache=tmp_path / "c")
    assert proc.returncode == 1  # nothing is cached: the decode and prefill specs and merge_state are missing
    (model,) = json.loads(proc.stdout)["models"]
    by_name = {k["needed_by"][0]: k for k in model["kernels"]}
    assert not by_name[MLA_DECODE]["served"] and not by_name[MLA_DECODE]["note"]
    assert not by_name[MLA_PREFILL]["served"] and not by_name["merge_state"]["served"]
    export = run_cli("cache", "export", "-o", str(tmp_path / "x.tar.gz"), "--model", str(DEEPSEEK_V3), "--arch",
                     "sm_90a", cache=tmp_path / "c")
    assert export.returncode == 1 and "3 of 3 kernels are not cached" in export.stderr
    decode = load_model_config(DEEPSEEK_V3).layer_kinds[0].spec
    assert f"{decode.name} sm_90a (needed by deepseek-v3/mla_decode)" in export.stderr
