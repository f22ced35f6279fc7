"""jitattn.models: Hugging Face config.json -> the specs a model's layers need."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jitattn.models import (IMPLIED_FEATURES, MODEL_TYPES, LayerKind, ModelAttention, load_model_config, model_specs,
                            per_rank_heads)
from jitattn.spec import AttentionSpec

MODELS = Path(__file__).resolve().parent.parent / "examples" / "models"


def config(stem: str) -> Path:
    return MODELS / f"{stem}.json"


def read(stem: str) -> dict:
    return json.loads(config(stem).read_text())


def spec(qo: int, kv: int, hd: int, **kw) -> AttentionSpec:
    return AttentionSpec(num_qo_heads=qo, num_kv_heads=kv, head_dim_qk=hd, causal=True, **kw)


def kinds(model: ModelAttention) -> dict[str, LayerKind]:
    return {k.name: k for k in model.layer_kinds}


EVEN, ODD = lambda n: tuple(range(0, n, 2)), lambda n: tuple(range(1, n, 2))  # noqa: E731


# ---- every example config, exactly -------------------------------------------------------------
# stem -> (model_type, num_layers, [(kind, spec, layers)]) in order of first layer.
EXPECTED = {
    "llama-3-8b": ("llama", 32, [("full_attention", spec(32, 8, 128), tuple(range(32)))]),
    "mistral-7b-v0.1": ("mistral", 32, [("sliding_attention", spec(32, 8, 128, window_left=4095), tuple(range(32)))]),
    "phi-3-mini-4k-instruct": ("phi3", 32, [
        ("sliding_attention", spec(32, 32, 96, window_left=2046), tuple(range(32)))]),
    "bloom-560m": ("bloom", 24, [
        ("full_attention", spec(16, 16, 64, alibi=True, q_dtype="float16"), tuple(range(24)))]),
    "gemma-2-9b": ("gemma2", 42, [
        ("sliding_attention", spec(16, 8, 256, window_left=4095, logits_soft_cap=50.0, sm_scale=256 ** -0.5), EVEN(42)),
        ("full_attention", spec(16, 8, 256, logits_soft_cap=50.0, sm_scale=256 ** -0.5), ODD(42))]),
    "gemma-2-27b": ("gemma2", 46, [
        ("sliding_attention", spec(32, 16, 128, window_left=4095, logits_soft_cap=50.0, sm_scale=144 ** -0.5), EVEN(46)),
        ("full_attention", spec(32, 16, 128, logits_soft_cap=50.0, sm_scale=144 ** -0.5), ODD(46))]),
    "gemma-3-1b": ("gemma3_text", 26, [
        ("sliding_attention", spec(4, 1, 256, window_left=511, sm_scale=256 ** -0.5),
         tuple(i for i in range(26) if i not in (5, 11, 17, 23))),
        ("full_attention", spec(4, 1, 256, sm_scale=256 ** -0.5), (5, 11, 17, 23))]),
    "gpt-oss-20b": ("gpt_oss", 24, [
        ("sliding_attention", spec(64, 8, 64, window_left=127, sinks=True), EVEN(24)),
        ("full_attention", spec(64, 8, 64, sinks=True), ODD(24))]),
}


def test_every_example_config_is_covered():
    assert {p.stem for p in MODELS.glob("*.json")} == set(EXPECTED)


@pytest.mark.parametrize("stem", sorted(EXPECTED))
def test_example_config_maps_exactly(stem):
    model_type, num_layers, expected = EXPECTED[stem]
    model = load_model_config(config(stem))
    assert (model.model_type, model.name, model.num_layers) == (model_type, stem, num_layers)
    got = [(k.name, k.spec, k.layers) for k in model.layer_kinds]
    assert got == expected
    assert sorted(i for k in model.layer_kinds for i in k.layers) == list(range(num_layers))
    assert model.specs() == [s for _, s, _ in expected]
    assert model_specs(config(stem)) == model.specs()


def test_gemma2_27b_scale_is_the_scalar_not_head_dim():
    spec_ = model_specs(config("gemma-2-27b"))[0]
    assert spec_.head_dim_qk == 128
    assert spec_.sm_scale == pytest.approx(1 / 12, rel=1e-15)  # 144 ** -0.5
    assert spec_.sm_scale != pytest.approx(128 ** -0.5)


def test_gemma2_9b_alternates_sliding_and_global():
    k = kinds(load_model_config(config("gemma-2-9b")))
    assert list(k) == ["sliding_attention", "full_attention"]
    assert k["sliding_attention"].layers[:3] == (0, 2, 4)
    assert k["sliding_attention"].spec.window_left == 4095
    assert k["full_attention"].spec.window_left == -1
    assert {s.logits_soft_cap for s in model_specs(config("gemma-2-9b"))} == {50.0}


def test_gemma3_null_softcap_is_off():
    assert all(s.logits_soft_cap == 0.0 for s in model_specs(config("gemma-3-1b")))


def test_bloom_reads_n_head_and_hidden_size():
    (s,) = model_specs(config("bloom-560m"))
    assert (s.num_qo_heads, s.num_kv_heads, s.head_dim_qk, s.q_dtype, s.alibi, s.sinks) == (
        16, 16, 64, "float16", True, False)


def test_llama_is_plain_causal():
    (s,) = model_specs(config("llama-3-8b"))
    assert s.causal and s.window_left == -1 and not (s.alibi or s.sinks or s.logits_soft_cap)
    assert s.sm_scale == 128 ** -0.5


# ---- arguments ---------------------------------------------------------------------------------
def test_dtype_argument_overrides_config():
    assert {s.q_dtype for s in model_specs(config("bloom-560m"), dtype="bfloat16")} == {"bfloat16"}
    assert {s.q_dtype for s in model_specs(config("gemma-2-9b"), dtype="fp16")} == {"float16"}


def test_bad_dtype_argument_raises():
    with pytest.raises(ValueError, match=r"dtype='float32'"):
        model_specs(config("llama-3-8b"), dtype="float32")


def test_kv_layout_and_page_size_pass_through():
    specs = model_specs(config("gpt-oss-20b"), kv_layout="HND", page_size=64)
    assert len(specs) == 2
    assert all((s.kv_layout, s.page_size) == ("HND", 64) for s in specs)


def test_kv_dtype_passes_through_for_an_fp8_cache():
    specs = model_specs(config("gpt-oss-20b"), kv_dtype="fp8")
    assert len(specs) == 2
    assert all((s.q_dtype, s.kv_dtype) == ("bfloat16", "float8_e4m3fn") for s in specs)
    assert model_specs(config("gpt-oss-20b"), kv_dtype=None) == model_specs(config("gpt-oss-20b"))
    with pytest.raises(ValueError, match=r"kv_dtype='float16': must equal q_dtype='bfloat16'"):
        model_specs(config("gpt-oss-20b"), kv_dtype="float16")


def test_bad_kv_layout_names_source_and_kind():
    with pytest.raises(ValueError, match=r"llama-3-8b\.json: layer kind 'full_attention'.*kv_layout='XYZ'"):
        model_specs(config("llama-3-8b"), kv_layout="XYZ")


def test_dict_input():
    cfg = read("gemma-2-9b")
    model = load_model_config(cfg)
    assert model.name == "gemma2"  # no file stem, no _name_or_path: the model type
    assert model.specs() == model_specs(config("gemma-2-9b"))
    cfg["_name_or_path"] = "google/gemma-2-9b"
    assert load_model_config(cfg).name == "google/gemma-2-9b"


def test_name_or_path_wins_over_file_stem(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**read("llama-3-8b"), "_name_or_path": "meta-llama/Meta-Llama-3-8B"}))
    assert load_model_config(path).name == "meta-llama/Meta-Llama-3-8B"
    assert load_model_config(str(path)).specs() == model_specs(config("llama-3-8b"))


def test_missing_dtype_defaults_to_bfloat16():
    cfg = read("bloom-560m")
    del cfg["torch_dtype"]
    assert model_specs(cfg)[0].q_dtype == "bfloat16"


def test_dtype_key_is_read_like_torch_dtype():
    cfg = read("llama-3-8b")
    del cfg["torch_dtype"]
    cfg["dtype"] = "float16"
    assert model_specs(cfg)[0].q_dtype == "float16"


# ---- layer placement rules ---------------------------------------------------------------------
def test_layer_types_win_over_model_rule():
    cfg = read("gemma-2-9b")
    cfg["num_hidden_layers"] = 4
    cfg["layer_types"] = ["full_attention", "full_attention", "sliding_attention", "full_attention"]
    k = kinds(load_model_config(cfg))
    assert k["full_attention"].layers == (0, 1, 3)
    assert k["sliding_attention"].layers == (2,)
    assert list(k) == ["full_attention", "sliding_attention"]


def test_gemma3_pattern_from_config():
    cfg = {**read("gemma-3-1b"), "num_hidden_layers": 8, "sliding_window_pattern": 4}
    assert kinds(load_model_config(cfg))["full_attention"].layers == (3, 7)


def test_gemma3_pattern_defaults_to_6():
    cfg = read("gemma-3-1b")
    del cfg["sliding_window_pattern"]
    assert kinds(load_model_config(cfg))["full_attention"].layers == (5, 11, 17, 23)


def test_gemma3_multimodal_reads_text_config():
    text = read("gemma-3-1b")
    cfg = {"model_type": "gemma3", "torch_dtype": "float16",
           "text_config": {k: v for k, v in text.items() if k != "torch_dtype"}}
    model = load_model_config(cfg)
    assert model.model_type == "gemma3_text"
    assert model.specs() == model_specs(text, dtype="float16")


def test_null_sliding_window_means_no_window():
    cfg = {**read("mistral-7b-v0.1"), "sliding_window": None}
    (k,) = load_model_config(cfg).layer_kinds
    assert (k.name, k.spec.window_left) == ("full_attention", -1)


def test_use_sliding_window_false_means_no_window():
    cfg = {**read("llama-3-8b"), "model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False}
    assert [s.window_left for s in model_specs(cfg)] == [-1]


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_qwen_slides_only_from_max_window_layers(model_type):
    """Hugging Face's Qwen2 / Qwen3 configs: with use_sliding_window=true, layers i >= max_window_layers
    slide and the first max_window_layers are full (Qwen2Config(..., num_hidden_layers=4,
    use_sliding_window=True, sliding_window=128, max_window_layers=2).layer_types is full, full,
    sliding, sliding in transformers 5.24); use_sliding_window defaults to false there. jitattn gave
    every layer the window (a wrong answer on the full layers)."""
    base = {**read("llama-3-8b"), "model_type": model_type, "num_hidden_layers": 4, "sliding_window": 128}
    model = load_model_config({**base, "use_sliding_window": True, "max_window_layers": 2})
    assert [(k.name, k.layers, k.spec.window_left) for k in model.layer_kinds] == [
        ("full_attention", (0, 1), -1), ("sliding_attention", (2, 3), 127)]
    assert [s.window_left for s in model_specs({**base, "use_sliding_window": True, "max_window_layers": 0})] == [127]
    assert [s.window_left for s in model_specs(base)] == [-1]  # use_sliding_window absent: false
    with pytest.raises(ValueError, match=r"max_window_layers=None: with use_sliding_window=true, "
                                         rf"{model_type} needs an int >= 0"):
        load_model_config({**base, "use_sliding_window": True})


def test_qwen2_moe_slides_even_layers_below_max_window_layers():
    """Hugging Face's Qwen2MoeConfig (transformers 5.24): layer i slides when use_sliding_window and i is
    even and i < max_window_layers (7 layers, max_window_layers=5: S F S F S F F)."""
    base = {**read("llama-3-8b"), "model_type": "qwen2_moe", "num_hidden_layers": 7, "sliding_window": 128}
    model = load_model_config({**base, "use_sliding_window": True, "max_window_layers": 5})
    assert [(k.name, k.layers) for k in model.layer_kinds] == [("sliding_attention", (0, 2, 4)),
                                                              ("full_attention", (1, 3, 5, 6))]
    assert [s.window_left for s in model_specs(base)] == [-1]


# ---- model types: unknown and implied features --------------------------------------------------
def test_unknown_model_type_is_an_error_listing_the_known_ones():
    """A model type jitattn does not know may attend differently than its fields say (Mamba has no
    attention at all): it is refused, never mapped as plain MHA."""
    cfg = {"model_type": "mamba", "hidden_size": 2560, "num_hidden_layers": 3,
           "num_attention_heads": 32, "num_key_value_heads": 4}
    with pytest.raises(ValueError, match=r"config dict \(mamba\): model_type='mamba' is not a model type jitattn "
                                         r"maps .*; known: llama, mistral, .*gpt_oss"):
        load_model_config(cfg)
    for known in MODEL_TYPES:  # every listed type maps (with the fields its rules read)
        extra = {"sliding_window": 128} if known in ("gemma2", "gemma3", "gemma3_text") else {}
        assert load_model_config({**cfg, **extra, "model_type": known}).model_type == known


def test_implied_features_table():
    assert IMPLIED_FEATURES["gpt_oss"]({}) == {"sinks": True}
    assert IMPLIED_FEATURES["bloom"]({}) == {"alibi": True}


def test_mpt_implies_alibi_and_reads_its_aliases():
    cfg = {"model_type": "mpt", "d_model": 4096, "n_heads": 32, "n_layers": 32, "attn_config": {"alibi": True}}
    assert model_specs(cfg) == [spec(32, 32, 128, alibi=True)]


def test_falcon_alibi_and_multi_query():
    base = {"model_type": "falcon", "hidden_size": 4544, "num_attention_heads": 71, "num_hidden_layers": 32}
    falcon_7b = {**base, "multi_query": True, "alibi": False}
    assert model_specs(falcon_7b) == [spec(71, 1, 64)]
    falcon_rw = {"model_type": "falcon", "hidden_size": 2048, "n_head": 32, "n_layer": 24,
                 "multi_query": False, "alibi": True}
    assert model_specs(falcon_rw) == [spec(32, 32, 64, alibi=True)]
    falcon_40b = {**base, "num_attention_heads": 128, "hidden_size": 8192, "new_decoder_architecture": True,
                  "num_kv_heads": 8}
    assert model_specs(falcon_40b) == [spec(128, 8, 64)]


# ---- errors ------------------------------------------------------------------------------------
def write(tmp_path: Path, data, name: str = "config.json") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_missing_field_names_field_and_file(tmp_path):
    cfg = read("llama-3-8b")
    del cfg["num_attention_heads"]
    path = write(tmp_path, cfg)
    with pytest.raises(ValueError, match=rf"{path}: missing field num_attention_heads/n_head"):
        load_model_config(path)


def test_missing_hidden_size_and_head_dim(tmp_path):
    cfg = read("llama-3-8b")
    del cfg["hidden_size"]
    with pytest.raises(ValueError, match=r"missing field hidden_size"):
        load_model_config(write(tmp_path, cfg))


def test_missing_model_type():
    cfg = read("llama-3-8b")
    del cfg["model_type"]
    with pytest.raises(ValueError, match=r"missing field model_type \(it decides implied features"):
        load_model_config(cfg)
    cfg["model_type"] = ""
    with pytest.raises(ValueError, match=r"model_type='': expected a non-empty string"):
        load_model_config(cfg)


def test_float32_config_raises_with_fix(tmp_path):
    path = write(tmp_path, {**read("llama-3-8b"), "torch_dtype": "float32"})
    with pytest.raises(ValueError, match=rf"{path}: torch_dtype='float32'.*--dtype bfloat16 \(or float16\) on the "
                                         rf"command line, dtype=\"bfloat16\" in Python"):
        load_model_config(path)
    assert model_specs(path, dtype="bfloat16")[0].q_dtype == "bfloat16"  # the suggested fix works


def test_unknown_config_dtype(tmp_path):
    with pytest.raises(ValueError, match=r"torch_dtype='float8_e4m3fn'"):
        load_model_config(write(tmp_path, {**read("llama-3-8b"), "torch_dtype": "float8_e4m3fn"}))


def test_head_dim_72_maps_and_a_bad_head_dim_surfaces_spec_error_with_source_and_kind(tmp_path):
    # hidden 2304 / 32 heads = 72: a multiple of 8, mapped; 2176 / 32 = 68 is not.
    path = write(tmp_path, {**read("mistral-7b-v0.1"), "hidden_size": 2304}, "hd72.json")
    assert {k.spec.head_dim_qk for k in load_model_config(path).layer_kinds} == {72}
    path = write(tmp_path, {**read("mistral-7b-v0.1"), "hidden_size": 2176}, "hd68.json")
    with pytest.raises(ValueError, match=rf"{path}: layer kind 'sliding_attention' \(layers 0, 1.*"
                                         r"head_dim_qk=68: expected a multiple of 8") as info:
        load_model_config(path)
    assert isinstance(info.value.__cause__, ValueError)


def test_hidden_size_not_divisible():
    with pytest.raises(ValueError, match=r"hidden_size=4097 is not a multiple of num_attention_heads=32"):
        load_model_config({**read("llama-3-8b"), "hidden_size": 4097})


@pytest.mark.parametrize("field,value", [("num_attention_heads", "32"), ("num_hidden_layers", 0),
                                         ("num_key_value_heads", -8), ("head_dim", 64.0)])
def test_bad_int_fields(field, value):
    with pytest.raises(ValueError, match=rf"{field}={value!r}: expected a positive int"):
        load_model_config({**read("llama-3-8b"), field: value})


def test_bad_softcap_and_scalar():
    with pytest.raises(ValueError, match=r"attn_logit_softcapping=-1.*positive number or null"):
        load_model_config({**read("gemma-2-9b"), "attn_logit_softcapping": -1})
    with pytest.raises(ValueError, match=r"query_pre_attn_scalar='256'"):
        load_model_config({**read("gemma-2-9b"), "query_pre_attn_scalar": "256"})


def test_bad_sliding_window():
    with pytest.raises(ValueError, match=r"sliding_window=0: sliding_attention layers need a positive int"):
        load_model_config({**read("mistral-7b-v0.1"), "sliding_window": 0})
    with pytest.raises(ValueError, match=r"sliding_window=None"):  # gemma-2 rule needs a window
        load_model_config({**read("gemma-2-9b"), "sliding_window": None})


def test_bad_layer_types():
    cfg = read("gpt-oss-20b")
    with pytest.raises(ValueError, match=r"layer_types has 23 entries: expected .*num_hidden_layers=24"):
        load_model_config({**cfg, "layer_types": cfg["layer_types"][:-1]})
    bad = ["chunked_attention"] + cfg["layer_types"][1:]
    with pytest.raises(ValueError, match=r"layer_types\[0\]='chunked_attention': expected one of"):
        load_model_config({**cfg, "layer_types": bad})


def test_mla_config_without_its_fields_is_an_error_naming_them():
    cfg = {"model_type": "deepseek_v2", "hidden_size": 2048, "num_attention_heads": 16,
           "num_hidden_layers": 27, "kv_lora_rank": 512}
    with pytest.raises(ValueError, match=r"multi-head latent attention config without qk_nope_head_dim, "
                                         r"qk_rope_head_dim, v_head_dim: an MLA config needs kv_lora_rank"):
        load_model_config(cfg)


@pytest.mark.parametrize("cfg,named", [
    ({"model_type": "deepseek_v3"}, r"without kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim"),
    ({"model_type": "deepseek_v2"}, r"without kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim"),
    ({"model_type": "llama", "q_lora_rank": 1536}, r"model_type='llama' with q_lora_rank=1536: multi-head latent "
                                                   r"attention fields on a model type jitattn maps as standard"),
    ({"model_type": "llama", "qk_rope_head_dim": 64}, r"model_type='llama' with qk_rope_head_dim=64: multi-head"),
])
def test_mla_fields_that_do_not_fit_are_refused_by_name(cfg, named):
    """An MLA model type without its fields, or MLA fields on a standard model type: never mapped as MHA."""
    base = {"hidden_size": 7168, "num_attention_heads": 128, "num_key_value_heads": 128, "num_hidden_layers": 61}
    with pytest.raises(ValueError, match=named):
        load_model_config({**base, **cfg})


# ---- tensor parallelism ------------------------------------------------------------------------
LLAMA_70B = Path(__file__).resolve().parent / "models" / "llama-3-70b.json"


@pytest.mark.parametrize("tp,heads", [(1, (64, 8)), (2, (32, 4)), (8, (8, 1)), (16, (4, 1)), (64, (1, 1))])
def test_per_rank_heads_follow_vllm(tp, heads):
    """Query heads divide; KV heads divide, or replicate to one per rank when fewer than the ranks."""
    assert per_rank_heads(64, 8, tp) == heads


def test_tp8_llama_3_70b_gives_8_query_and_1_kv_head_per_rank():
    model = load_model_config(LLAMA_70B, tensor_parallel_size=8)
    (kind,) = model.layer_kinds
    assert (kind.spec.num_qo_heads, kind.spec.num_kv_heads, kind.spec.head_dim_qk) == (8, 1, 128)
    assert kind.spec.sm_scale == pytest.approx(128 ** -0.5)  # the scale follows head_dim, not the rank's heads
    assert model.tensor_parallel_size == 8 and len(kind.layers) == 80
    assert load_model_config(LLAMA_70B).layer_kinds[0].spec.num_kv_heads == 8


@pytest.mark.parametrize("tp,message", [
    (3, r"tensor_parallel_size=3: num_attention_heads=64 does not divide over 3 ranks"),
    (128, r"tensor_parallel_size=128: num_attention_heads=64 does not divide over 128 ranks"),
    (0, r"tensor_parallel_size=0: expected a positive int"),
])
def test_heads_that_do_not_divide_are_a_clear_error(tp, message):
    with pytest.raises(ValueError, match=rf"{LLAMA_70B}: {message}"):
        load_model_config(LLAMA_70B, tensor_parallel_size=tp)


@pytest.mark.parametrize("heads,message", [
    ((32, 0), r"num_key_value_heads=0: expected a positive int"),
    ((0, 8), r"num_attention_heads=0: expected a positive int"),
    ((-8, 2), r"num_attention_heads=-8: expected a positive int"),
    ((32, 8.0), r"num_key_value_heads=8.0: expected a positive int"),
])
def test_per_rank_heads_refuses_head_counts_that_are_not_positive_ints(heads, message):
    """Called directly (not through a config, which checks them first): a ValueError, not a ZeroDivisionError
    or a rank with no heads."""
    with pytest.raises(ValueError, match=message):
        per_rank_heads(*heads, 4)


def test_kv_heads_that_do_not_split_name_both_numbers():
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4: num_key_value_heads=6 does not divide over 4"):
        per_rank_heads(24, 6, 4)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=8: 8 ranks are not a multiple of "
                                         r"num_key_value_heads=3"):
        per_rank_heads(24, 3, 8)


def test_missing_file(tmp_path):
    path = tmp_path / "nope" / "config.json"
    with pytest.raises(FileNotFoundError, match=rf"{path}: model config not found"):
        load_model_config(path)


def test_invalid_json(tmp_path):
    path = write(tmp_path, '{"model_type": "llama",', "broken.json")
    with pytest.raises(ValueError, match=rf"{path}: not valid JSON"):
        load_model_config(path)


def test_json_not_an_object(tmp_path):
    with pytest.raises(ValueError, match=r"top level is a list"):
        load_model_config(write(tmp_path, "[1, 2]"))


def test_model_directory_reads_its_config_json(tmp_path):
    """A Hugging Face model directory (what a snapshot download gives) was 'model config not found'
    although it exists; now its config.json is read (the model is named after the directory), and a
    directory without one says so."""
    model_dir = tmp_path / "gemma-2-9b"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(config("gemma-2-9b").read_text())
    assert load_model_config(model_dir).specs() == load_model_config(config("gemma-2-9b")).specs()
    with pytest.raises(FileNotFoundError, match=rf"{tmp_path}: a directory without config.json"):
        load_model_config(tmp_path)
