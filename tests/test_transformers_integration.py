"""The transformers integration on the CPU (reference / sdpa backends): ``attn_implementation="jitattn"``.

The Gemma-2 test builds the real architecture from a config (head_dim 256, attention soft-cap 50,
alternating sliding windows, GQA) with random weights, a few layers and a small hidden size, and
compares ``attn_implementation="jitattn"`` with ``"eager"``: logits, and the tokens greedy decoding
makes. Both run in bfloat16 (jitattn's specs take no float32); an fp32 eager run is the yardstick.
Skipped as a whole where transformers is not installed (the op tests, tests/test_integrations.py, are
not). The device version of these tests is tests/test_gpu_integrations.py.
"""

from __future__ import annotations

import copy

import pytest
import torch

from jitattn import selector

transformers = pytest.importorskip("transformers")
import jitattn.integrations.transformers as jt  # noqa: E402  (registers "jitattn")
from transformers import Gemma2Config, Gemma2ForCausalLM, GptOssConfig, GptOssForCausalLM  # noqa: E402


def gemma2_config() -> Gemma2Config:
    """Gemma-2's attention (hd 256, soft-cap 50, sliding/full alternating, query_pre_attn_scalar 256, GQA 2),
    4 layers, hidden 128, window 8 so that a 24-token prompt crosses it."""
    return Gemma2Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=256, query_pre_attn_scalar=256,
                        sliding_window=8, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                        max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                        initializer_range=0.1)


def gpt_oss_config() -> GptOssConfig:
    """gpt-oss's attention (hd 64, sinks, sliding/full alternating, GQA 2), 2 layers, 4 experts."""
    return GptOssConfig(vocab_size=256, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=8,
                        # every expert on every token: top-k routing is discontinuous, so a rounding-level
                        # difference in attention could flip an expert and swamp the comparison
                        num_local_experts=2, num_experts_per_tok=2, max_position_embeddings=256, pad_token_id=0,
                        bos_token_id=1, eos_token_id=2, initializer_range=0.1,
                        layer_types=["sliding_attention", "full_attention"])


def build_models(model_cls, config, device="cpu", seed=0):
    """fp32 eager (the yardstick), bf16 eager and bf16 jitattn models with the same random weights."""
    torch.manual_seed(seed)
    models = {}
    for name, impl, dtype in (("fp32", "eager", torch.float32), ("eager", "eager", torch.bfloat16),
                              ("jitattn", "jitattn", torch.bfloat16)):
        models[name] = model_cls._from_config(copy.deepcopy(config), attn_implementation=impl, dtype=dtype)
    sinks = getattr(models["fp32"].model.layers[0].self_attn, "sinks", None)
    if sinks is not None:  # gpt-oss: sinks large enough to matter
        with torch.no_grad():
            for layer in models["fp32"].model.layers:
                layer.self_attn.sinks.normal_(2.0, 1.0)
    state = models["fp32"].state_dict()
    for m in models.values():
        m.load_state_dict(state)
        m.to(device).eval()
    assert models["jitattn"].config._attn_implementation == "jitattn"
    assert models["eager"].config._attn_implementation == "eager"
    return models


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def check_logits(models, ids, attention_mask=None, valid=None):
    """jitattn's logits are as close to the fp32 yardstick as eager bf16's, and close to eager bf16's."""
    with torch.no_grad():
        logits = {k: m(ids, attention_mask=attention_mask).logits for k, m in models.items()}
    sel = (lambda t: t[valid]) if valid is not None else (lambda t: t)
    eager_err = rel(sel(logits["eager"]), sel(logits["fp32"]))
    jit_err = rel(sel(logits["jitattn"]), sel(logits["fp32"]))
    assert jit_err < 1.3 * eager_err + 2e-3, f"jitattn vs fp32 {jit_err:.3e}, eager bf16 vs fp32 {eager_err:.3e}"
    assert rel(sel(logits["jitattn"]), sel(logits["eager"])) < 3e-2
    return eager_err, jit_err


def check_greedy(models, ids, attention_mask=None, new_tokens=12, tie=0.05):
    """Greedy decoding makes the same tokens; a divergence is accepted only where eager's top-2 logits tie."""
    kw = dict(attention_mask=attention_mask, max_new_tokens=new_tokens, do_sample=False, output_scores=True,
              return_dict_in_generate=True)
    with torch.no_grad():
        eager = models["eager"].generate(ids, **kw)
        jit = models["jitattn"].generate(ids, **kw)
    assert eager.sequences.shape == jit.sequences.shape
    prompt = ids.shape[1]
    for row in range(ids.shape[0]):
        for step in range(new_tokens):
            a, b = eager.sequences[row, prompt + step], jit.sequences[row, prompt + step]
            if a != b:
                top2 = eager.scores[step][row].float().topk(2).values
                assert top2[0] - top2[1] < tie, f"row {row} step {step}: eager {a} vs jitattn {b}, margin " \
                                                f"{(top2[0] - top2[1]).item():.3f}"
                break
    return eager.sequences, jit.sequences


def test_gemma2_matches_eager_on_cpu_through_the_reference():
    models = build_models(Gemma2ForCausalLM, gemma2_config())
    ids = torch.randint(3, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    check_logits(models, ids)
    eager, jit = check_greedy(models, ids)
    assert torch.equal(eager, jit)  # this seed has no near-ties: every token agrees
    spec = jt.spec_from_json(jt._spec_text(4, 2, 256, torch.bfloat16, 256 ** -0.5, 50.0, 8, True, False))
    assert (spec.window_left, spec.logits_soft_cap, spec.sm_scale) == (7, 50.0, 0.0625)
    assert selector.select(spec, "cpu", "decode").name == "reference"


def test_gemma2_left_padded_batch_on_cpu():
    models = build_models(Gemma2ForCausalLM, gemma2_config(), seed=2)
    ids = torch.randint(3, 256, (2, 20), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :6], ids[1, :6] = 0, 0  # row 1: 6 pad tokens on the left
    check_logits(models, ids, mask, valid=mask.bool())
    check_greedy(models, ids, mask)


def test_gpt_oss_sinks_on_cpu():
    models = build_models(GptOssForCausalLM, gpt_oss_config())
    ids = torch.randint(3, 256, (2, 24), generator=torch.Generator().manual_seed(3))
    check_logits(models, ids)
    check_greedy(models, ids, new_tokens=6)


def test_llama_plain_attention_runs_through_sdpa_on_cpu():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, initializer_range=0.1)
    models = build_models(LlamaForCausalLM, cfg)
    check_logits(models, torch.randint(3, 256, (1, 16), generator=torch.Generator().manual_seed(4)))
    spec = jt.spec_from_json(jt._spec_text(4, 2, 32, torch.bfloat16, 32 ** -0.5, None, None, True, False))
    assert selector.select(spec, "cpu", "prefill").name == "sdpa"


def test_float32_model_is_refused_with_the_fix():
    model = Gemma2ForCausalLM._from_config(gemma2_config(), attn_implementation="jitattn", dtype=torch.float32)
    with pytest.raises(ValueError, match=r"runs in torch.float32; .* load the model with dtype=torch.bfloat16"):
        model(torch.randint(3, 256, (1, 4)))


def test_padding_mask_with_holes_is_refused():
    q = torch.randn(1, 4, 3, 64, dtype=torch.bfloat16)
    kv = torch.randn(1, 2, 6, 64, dtype=torch.bfloat16)
    mask = torch.tensor([[1, 1, 0, 1, 1, 1]], dtype=torch.bool)
    module = torch.nn.Module()
    with pytest.raises(NotImplementedError, match="sequence 0's padding mask has holes"):
        jt.attention_forward(module, q, kv, kv, mask, scaling=0.125)


def test_padding_mask_hook():
    full = torch.ones(2, 10, dtype=torch.bool)
    assert jt.padding_mask(2, 1, 10, attention_mask=full) is None
    left = full.clone()
    left[0, :3] = False
    assert jt.padding_mask(2, 1, 4, kv_offset=6, attention_mask=left) is None  # a sliding layer past the padding
    assert torch.equal(jt.padding_mask(2, 1, 10, attention_mask=left), left)
    static = jt.padding_mask(2, 1, 12, attention_mask=full)  # empty static-cache slots are padding
    assert static.shape == (2, 12) and not static[:, 10:].any() and static[:, :10].all()


def test_right_padded_prefill_matches_unpadded_rows():
    torch.manual_seed(5)
    q = torch.randn(2, 4, 6, 64, dtype=torch.bfloat16)
    k = torch.randn(2, 2, 6, 64, dtype=torch.bfloat16)
    v = torch.randn(2, 2, 6, 64, dtype=torch.bfloat16)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 4:] = False  # row 1: 4 tokens, 2 right pads
    module = torch.nn.Module()
    out, _ = jt.attention_forward(module, q, k, v, mask, scaling=0.125)
    alone, _ = jt.attention_forward(module, q[1:, :, :4], k[1:, :, :4], v[1:, :, :4], None, scaling=0.125)
    assert torch.equal(out[1, :4], alone[0]) and not out[1, 4:].any()
    full, _ = jt.attention_forward(module, q[:1], k[:1], v[:1], None, scaling=0.125)
    assert torch.equal(out[0], full[0])
