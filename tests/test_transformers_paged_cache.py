"""``PagedCache``: transformers ``generate`` with K/V kept in jitattn's pages, on the CPU.

Each model is the real attention of a config in examples/models (and ../shared/models when present):
its heads, KV heads, head dim, softmax scale, soft-caps, sinks and layer kinds, with 2 layers, hidden
size 128, vocabulary 256 and random weights; sliding windows shrink to :data:`WINDOW` tokens so that
the sequences here cross them. ``attn_implementation="jitattn"`` with a ``PagedCache`` runs greedy
``generate`` against ``"eager"`` (both bfloat16) on a batch with a left-padded row: the same tokens,
or, where they first differ, eager's top-2 logits there tie within bf16 noise and every earlier
step's logits agree within tolerance. The device version is tests/test_gpu_transformers_paged_cache.py.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
import jitattn.integrations.transformers as jt  # noqa: E402  (registers "jitattn")
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIRS = [ROOT / "examples" / "models", Path(__file__).resolve().parents[2] / "shared" / "models"]
#: Sliding windows of the small models (the real ones, 128-4096 tokens, would never bite here).
WINDOW = 8
PROMPT, NEW, PAD = 12, 16, 4
#: Configs the integration does not serve, and why.
UNSERVED = {
    "bloom": "BLOOM's attention does not go through transformers' AttentionInterface",
    "deepseek_v3": "MLA: PagedCache keeps paged K/V, not the latent cache (its decode runs through jitattn.select)",
}


def config_files() -> dict[str, Path]:
    """Model config files by name (examples/models first, then shared/models for the others)."""
    files: dict[str, Path] = {}
    for d in MODEL_DIRS:
        for f in sorted(d.glob("*.json")) if d.is_dir() else ():
            files.setdefault(f.stem, f)
    return files


CONFIGS = config_files()


def small_config(path: Path, device: str = "cpu"):
    """The config at ``path`` with its attention kept and everything else shrunk (see the module doc)."""
    raw = json.loads(path.read_text())
    if raw["model_type"] in UNSERVED:
        pytest.skip(UNSERVED[raw["model_type"]])
    heads = raw["num_attention_heads"]
    fields = {k: v for k, v in raw.items() if k not in ("architectures", "torch_dtype", "rope_scaling")}
    fields.update(num_hidden_layers=2, hidden_size=128, intermediate_size=256, vocab_size=256,
                  head_dim=raw.get("head_dim") or raw["hidden_size"] // heads, max_position_embeddings=256,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.1)
    if raw.get("sliding_window"):
        fields["sliding_window"] = WINDOW
    if "layer_types" in raw or raw.get("sliding_window_pattern"):  # keep one layer of each kind
        fields["layer_types"] = ["sliding_attention", "full_attention"]
        fields.pop("sliding_window_pattern", None)
    if raw["model_type"] == "gpt_oss":  # every expert on every token: top-k routing would amplify noise
        fields.update(num_local_experts=2, num_experts_per_tok=2)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def build_pair(config, device: str = "cpu", seed: int = 0):
    """bf16 ``eager`` and ``jitattn`` models with the same random weights."""
    torch.manual_seed(seed)
    eager = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager",
                                             dtype=torch.bfloat16)
    with torch.no_grad():
        for module in eager.modules():
            if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):  # gpt-oss: sinks that matter
                module.sinks.normal_(2.0, 1.0)
    jit = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="jitattn",
                                           dtype=torch.bfloat16)
    jit.load_state_dict(eager.state_dict())
    return eager.to(device).eval(), jit.to(device).eval()


def padded_batch(device: str = "cpu", seed: int = 1):
    """Two prompts of :data:`PROMPT` tokens; row 1 left-padded by :data:`PAD`."""
    ids = torch.randint(3, 256, (2, PROMPT), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1, :PAD], ids[1, :PAD] = 0, 0
    return ids.to(device), mask.to(device)


def generate(model, ids, mask, new_tokens=NEW, **kw):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False, output_scores=True, return_dict_in_generate=True, **kw)


def compare(eager, jit, prompt: int, atol: float = 0.1, tie: float | None = None) -> tuple[list[int | None], float]:
    """Per row, the first step where the tokens differ (None: never), checked to be a near-tie of
    eager's with every earlier step's logits within ``atol``; and the largest logit difference seen.

    ``tie`` (default ``atol``): the most eager's top-2 margin may be where the tokens first differ. It is
    the logit tolerance itself: jit's pick b over eager's a means ``margin <= |d_a| + |d_b|``, so a
    tolerance of ``atol`` per logit admits flips up to ``2 * atol``; ``atol`` keeps them to half of that.
    (The random-weight models tie often: gpt-oss's eager top-2 margin is under 0.07 on ~15% of its
    steps, and a flip at 0.0625 with every logit within 0.1 is what the tolerance allows.)
    """
    tie = atol if tie is None else tie
    assert eager.sequences.shape == jit.sequences.shape
    first, worst = [], 0.0
    for row in range(eager.sequences.shape[0]):
        steps = (eager.sequences[row, prompt:] != jit.sequences[row, prompt:]).nonzero()
        stop = int(steps[0]) if len(steps) else len(eager.scores)
        for step in range(stop + (stop < len(eager.scores))):
            a, b = eager.scores[step][row].float(), jit.scores[step][row].float()
            err = torch.where(a == b, 0.0, a - b).abs().max().item()  # min_new_tokens puts -inf on eos
            assert err < atol, f"row {row} step {step}: logits differ by {err:.3f} (atol {atol})"
            worst = max(worst, err)
        if stop < len(eager.scores):
            top2 = eager.scores[stop][row].float().topk(2).values
            margin = (top2[0] - top2[1]).item()
            assert margin < tie, f"row {row} step {stop}: tokens differ where eager's margin is {margin:.3f} " \
                                 f"(a near-tie is under {tie})"
        first.append(stop if stop < len(eager.scores) else None)
    return first, worst


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_paged_generate_matches_eager(name):
    eager, jit = build_pair(small_config(CONFIGS[name]))
    ids, mask = padded_batch()
    cache = jt.PagedCache(jit.config, max_batch_size=2, max_cache_len=PROMPT + NEW)
    ref = generate(eager, ids, mask)
    out = generate(jit, ids, mask, past_key_values=cache)
    first, worst = compare(ref, out, PROMPT)
    print(f"{name}: first differing step per row {first} of {NEW}, logits within {worst:.3f}")
    # padded tokens are not stored: row 1 holds PAD fewer; the last new token is never fed back
    assert cache.layers[0].seq_lens.tolist() == [PROMPT + NEW - 1, PROMPT + NEW - 1 - PAD]
    assert cache.get_seq_length() == PROMPT + NEW - 1


def llama_pair():
    return build_pair(small_config(CONFIGS["llama-3-8b"]))


def test_history_is_not_copied_per_call(monkeypatch):
    """One append_kv per layer per step, of the step's tokens only; the copying packers never run;
    the outputs equal the copying integration's."""
    eager, jit = llama_pair()
    ids = torch.randint(3, 256, (2, PROMPT), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    copying = generate(jit, ids, mask, new_tokens=8)
    tokens = []
    real = jt.append_kv

    def counting(k, *args, **kwargs):
        tokens.append(k.shape[0])
        return real(k, *args, **kwargs)

    def refuse(*args, **kwargs):
        raise AssertionError("the paged cache's layer was copied into a fresh paged cache")

    monkeypatch.setattr(jt, "append_kv", counting)
    for packer in ("_pack_dense", "_pack_padded", "_pages"):
        monkeypatch.setattr(jt, packer, refuse)
    cache = jt.PagedCache(jit.config, max_batch_size=2, max_cache_len=PROMPT + 8)
    paged = generate(jit, ids, mask, new_tokens=8, past_key_values=cache)
    layers = jit.config.num_hidden_layers
    assert tokens == [2 * PROMPT] * layers + [2] * (layers * 7)  # prefill, then 7 decode steps of 1 token each
    assert torch.equal(paged.sequences, copying.sequences)
    for a, b in zip(paged.scores, copying.scores):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=0)


def test_batch_over_max_batch_size_is_refused():
    _, jit = llama_pair()
    ids, mask = padded_batch()
    with pytest.raises(ValueError, match=r"batch of 2 sequences, but max_batch_size=1"):
        generate(jit, ids, mask, new_tokens=2, past_key_values=jt.PagedCache(jit.config, 1, 64))


def test_length_over_max_cache_len_is_refused():
    _, jit = llama_pair()
    ids, mask = padded_batch()
    cache = jt.PagedCache(jit.config, 2, PROMPT + 2)
    with pytest.raises(ValueError, match=rf"{PROMPT + 2} cached \+ 1 new tokens exceed max_cache_len={PROMPT + 2}"):
        generate(jit, ids, mask, new_tokens=4, past_key_values=cache)


def test_float32_model_is_refused():
    config = small_config(CONFIGS["llama-3-8b"])
    model = AutoModelForCausalLM.from_config(config, attn_implementation="jitattn", dtype=torch.float32).eval()
    ids, mask = padded_batch()
    with pytest.raises(ValueError, match=r"runs in torch.float32; .* dtype=torch.bfloat16"):
        generate(model, ids, mask, new_tokens=2, past_key_values=jt.PagedCache(config, 2, 64))
    with pytest.raises(ValueError, match=r"dtype=torch.float32; jitattn's kernels take torch.float16"):
        jt.PagedCache(config, 2, 64, dtype=torch.float32)


def test_other_attention_implementation_is_refused():
    eager, _ = llama_pair()
    ids, mask = padded_batch()
    with pytest.raises(RuntimeError, match=r"layer 0's new K/V were not read by jitattn's attention function"):
        generate(eager, ids, mask, new_tokens=2, past_key_values=jt.PagedCache(eager.config, 2, 64))


def test_bad_sizes_are_refused():
    config = small_config(CONFIGS["llama-3-8b"])
    with pytest.raises(ValueError, match=r"max_cache_len=0; expected a positive int"):
        jt.PagedCache(config, 2, 0)
    with pytest.raises(ValueError, match=r"page_size=1.5; expected a positive int"):
        jt.PagedCache(config, 2, 64, page_size=1.5)


@pytest.mark.parametrize("name", ["llama-3-8b", "gemma-2-9b", "gpt-oss-20b"])  # one spec; sliding + full; sinks
def test_jit_path_plans_once_per_step_and_runs_per_layer(name, monkeypatch):
    """On the jit backend each forward makes one jitattn.plan (its first layer) and every layer runs it,
    a sliding layer's spec too; here plan / run are stand-ins over the reference, so the generated
    tokens must equal the op path's (the reference's) exactly, padded row included."""
    from jitattn import reference

    eager, jit = build_pair(small_config(CONFIGS[name]))
    ids, mask = padded_batch()
    want = generate(jit, ids, mask, new_tokens=6, past_key_values=jt.PagedCache(jit.config, 2, PROMPT + 6))
    plans, runs = [], []

    def fake_plan(spec, block_table, seq_lens, qsl, *, total_q, max_query_len):
        assert total_q == int(qsl[-1]) and block_table.shape[0] == seq_lens.shape[0] == qsl.shape[0] - 1
        plans.append(max_query_len)
        return block_table, seq_lens, qsl

    def fake_run(q, kv_cache, step_plan, *, spec, sinks):
        runs.append(spec)
        return reference.paged_attention(spec, q, kv_cache, *step_plan, sinks=sinks)

    monkeypatch.setattr(jt, "_runs_planned", lambda backend, query: True)
    monkeypatch.setattr(jt, "plan", fake_plan)
    monkeypatch.setattr(jt, "run", fake_run)
    cache = jt.PagedCache(jit.config, max_batch_size=2, max_cache_len=PROMPT + 6)
    got = generate(jit, ids, mask, new_tokens=6, past_key_values=cache)
    layers = jit.config.num_hidden_layers
    assert plans == [PROMPT] + [1] * 5  # the prefill forward, then 5 decode steps: one plan each
    assert len(runs) == 6 * layers
    assert len(set(runs)) == len(set(getattr(jit.config, "layer_types", None) or ["full"]))
    assert torch.equal(got.sequences, want.sequences)
    assert cache.layers[0].seq_lens.tolist() == [PROMPT + 5, PROMPT + 5 - PAD]
    assert all(layer.seq_lens is cache.layers[0].seq_lens for layer in cache.layers)  # one shared tensor
    assert list(cache.layers[0].steps) == [torch.device("cpu")]  # one step state per device the layers are on


def test_unpadded_decode_steps_reuse_one_plan(monkeypatch):
    """Without padding a decode step's metadata depends only on its shape: the first decode step's plan (and
    query_start_loc) serve every later one, seq_lens advancing in place; a reset plans afresh. Stand-ins over
    the reference, so the tokens must equal the op path's exactly."""
    from jitattn import reference

    eager, jit = build_pair(small_config(CONFIGS["gemma-2-9b"]))  # sliding + full layers: two specs, one plan
    ids = torch.randint(3, 256, (2, PROMPT), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    want = generate(jit, ids, mask, new_tokens=6, past_key_values=jt.PagedCache(jit.config, 2, PROMPT + 6))
    plans, starts = [], []

    def fake_plan(spec, block_table, seq_lens, qsl, *, total_q, max_query_len):
        plans.append(max_query_len)
        starts.append(qsl)
        return block_table, seq_lens, qsl

    monkeypatch.setattr(jt, "_runs_planned", lambda backend, query: True)
    monkeypatch.setattr(jt, "plan", fake_plan)
    monkeypatch.setattr(jt, "run", lambda q, kv_cache, step_plan, *, spec, sinks:
                        reference.paged_attention(spec, q, kv_cache, *step_plan, sinks=sinks))
    cache = jt.PagedCache(jit.config, max_batch_size=2, max_cache_len=PROMPT + 6)
    got = generate(jit, ids, mask, new_tokens=6, past_key_values=cache)
    assert plans == [PROMPT, 1]  # the prefill forward's, then one for the 5 decode steps
    assert torch.equal(got.sequences, want.sequences)
    assert cache.layers[0].seq_lens.tolist() == [PROMPT + 5] * 2
    cache.reset()
    again = generate(jit, ids, mask, new_tokens=6, past_key_values=cache)
    assert plans == [PROMPT, 1, PROMPT, 1] and starts[3] is not starts[1]  # planned afresh after the reset
    assert torch.equal(again.sequences, want.sequences)
