"""AttentionSpec, Variant and Param: validation messages, defaults, canonical JSON and keys."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from jitattn import AttentionSpec, Param, Variant
from jitattn.variant import alibi_slopes, rotary_embedding

BASE = dict(num_qo_heads=32, num_kv_heads=8, head_dim_qk=128)


def mk(**kw) -> AttentionSpec:
    return AttentionSpec(**{**BASE, **kw})


# ---- validation: every field, the value, what is allowed -------------------------------------
BAD = [
    (dict(num_qo_heads=0), r"num_qo_heads=0: expected an int in \[1, 1024\]"),
    (dict(num_qo_heads=2000), r"num_qo_heads=2000: expected an int in \[1, 1024\]"),
    (dict(num_qo_heads=32.0), r"num_qo_heads=32.0: expected an int"),
    (dict(num_qo_heads=True), r"num_qo_heads=True: expected an int"),
    (dict(num_kv_heads=0), r"num_kv_heads=0: expected an int in \[1, 1024\]"),
    (dict(num_kv_heads=5), r"num_qo_heads=32, num_kv_heads=5: num_kv_heads must divide num_qo_heads"),
    (dict(head_dim_qk=76), r"head_dim_qk=76: expected a multiple of 8 in \[8, 256\]"),
    (dict(head_dim_qk=4), r"head_dim_qk=4: expected an int in \[8, 256\], a multiple of 8"),
    (dict(head_dim_qk=0), r"head_dim_qk=0: expected an int in \[8, 256\], a multiple of 8"),
    (dict(head_dim_qk=264), r"head_dim_qk=264: expected an int in \[8, 256\], a multiple of 8"),
    (dict(head_dim_qk=272), r"head_dim_qk=272: expected an int in \[8, 256\]"),
    (dict(head_dim_qk="128"), r"head_dim_qk='128': expected an int"),
    (dict(head_dim_vo=64), r"head_dim_vo=64, head_dim_qk=128: .*must be equal"),
    (dict(head_dim_vo=100), r"head_dim_vo=100: expected a multiple of 8"),
    (dict(q_dtype="float32"), r"q_dtype='float32': expected one of \('float16', 'bfloat16'\)"),
    (dict(q_dtype="fp8"), r"q_dtype='fp8': expected one of"),
    (dict(kv_dtype="float16"), r"kv_dtype='float16': must equal q_dtype='bfloat16' or be 'float8_e4m3fn'"),
    (dict(kv_dtype="int8"), r"kv_dtype='int8': expected one of \('float16', 'bfloat16', 'float8_e4m3fn'\)"),
    (dict(o_dtype="float32"), r"o_dtype='float32': expected one of \('float16', 'bfloat16'\)"),
    (dict(kv_layout="nhd"), r"kv_layout='nhd': expected one of \('NHD', 'HND'\)"),
    (dict(page_size=0), r"page_size=0: expected an int in \[1, 1024\]"),
    (dict(page_size=2048), r"page_size=2048: expected an int in \[1, 1024\]"),
    (dict(causal=1), r"causal=1: expected True or False"),
    (dict(alibi="yes"), r"alibi='yes': expected True or False"),
    (dict(sinks=None), r"sinks=None: expected True or False"),
    (dict(window_left=-2), r"window_left=-2: expected an int in \[-1, 1073741823\] \(-1: no window"),
    (dict(window_left=1.5), r"window_left=1.5: expected an int"),
    (dict(causal=False, window_right=-5), r"window_right=-5: expected an int in \[-1, 1073741823\]"),
    # windows are int constants the kernels add to int32 positions (before: a TraceError at render, or nvcc's)
    (dict(window_left=10 ** 12), r"window_left=1000000000000: expected an int in \[-1, 1073741823\]"),
    (dict(window_left=2 ** 31 - 1), r"window_left=2147483647: expected an int in \[-1, 1073741823\]"),
    (dict(window_left=2 ** 30), r"window_left=1073741824: expected an int in \[-1, 1073741823\]"),
    (dict(causal=False, window_right=2 ** 31), r"window_right=2147483648: expected an int in \[-1, 1073741823\]"),
    (dict(window_right=8), r"window_right=8: a causal spec sees no key right of the query; .*causal=False"),
    (dict(logits_soft_cap=-1.0), r"logits_soft_cap=-1.0: expected a number >= 0"),
    (dict(logits_soft_cap=float("inf")), r"logits_soft_cap=inf: expected a finite number"),
    (dict(logits_soft_cap="50"), r"logits_soft_cap='50': expected a finite number"),
    # the kernels hold cap and 1 / cap as float32 constants: past float32, or a denormal reciprocal
    (dict(logits_soft_cap=1e39), r"logits_soft_cap=1e\+39: expected 0 \(off\) or a cap in \[1.17549e-38, 8.50706e\+37\]"),
    (dict(logits_soft_cap=1e38), r"logits_soft_cap=1e\+38: expected 0 \(off\) or a cap in"),
    (dict(logits_soft_cap=1e-39), r"logits_soft_cap=1e-39: expected 0 \(off\) or a cap in"),
    (dict(sm_scale=0.0), r"sm_scale=0.0: expected a number > 0"),
    (dict(sm_scale=-0.1), r"sm_scale=-0.1: expected a number > 0"),
    (dict(sm_scale=float("nan")), r"sm_scale=nan: expected a finite number"),
    (dict(sm_scale=1e39), r"sm_scale=1e\+39: expected a positive number a float32 holds"),
    (dict(sm_scale=1e-46), r"sm_scale=1e-46: expected a positive number a float32 holds"),
    (dict(variant="soft"), r"variant='soft': expected a jitattn.Variant or None"),
    (dict(kv_storage="varlen"), r"kv_storage='varlen': expected one of \('paged', 'ragged', 'latent'\)"),
    (dict(query_positions="absolute"), r"query_positions='absolute': expected one of \('implicit', 'explicit'\)"),
    (dict(kv_storage="ragged", query_positions="explicit"), r"query_positions='explicit' with kv_storage='ragged'"),
    (dict(kv_storage="ragged", page_size=16), r"page_size=16 with kv_storage='ragged': ragged K/V have no pages"),
    (dict(kv_storage="ragged", kv_layout="HND"), r"kv_layout='HND' with kv_storage='ragged': .*must be 'NHD'"),
    (dict(kv_storage="ragged", kv_dtype="fp8"), r"kv_dtype='float8_e4m3fn' with kv_storage='ragged': FP8 K/V .*paged"),
    (dict(kv_storage="ragged", head_dim_vo=204), r"head_dim_vo=204: expected a multiple of 8 in \[8, 256\]"),
    (dict(kv_storage="ragged", head_dim_vo=4), r"head_dim_vo=4: expected an int in \[8, 256\]"),
    # GQA groups whose CUDA-core decode block decode.cuh's static_asserts refuse (threads, merge scratch)
    (dict(num_qo_heads=65, num_kv_heads=1, kv_dtype="fp8"),
     r"num_qo_heads=65, num_kv_heads=1: a GQA group of 65 query heads at head_dim 128 with "
     r"kv_dtype='float8_e4m3fn' is too large: a paged spec there takes every group of up to 64 heads \(this one "
     r"needs a decode block of 1056 threads \(at most 1024, whole warps\); ragged specs have no decode kernel"),
    (dict(num_qo_heads=129, num_kv_heads=1, head_dim_qk=64), r"group of 129 .* up to 128 heads \(this one .*1056 threads"),
    (dict(num_qo_heads=1024, num_kv_heads=1, head_dim_qk=64), r"group of 1024 .* up to 128 heads \(this one .*2048 threads"),
    (dict(num_qo_heads=61, num_kv_heads=1, head_dim_qk=48), r"group of 61 .* up to 60 heads \(this one .*merge scratch"),
    # groups past the first that does not fit, whose block happens to fit again: one range, up to the limit
    (dict(num_qo_heads=133, num_kv_heads=1), r"num_qo_heads=133, num_kv_heads=1: a GQA group of 133 query heads at "
     r"head_dim 128 with kv_dtype='bfloat16' is too large: a paged spec there takes every group of up to 128 heads "
     r"\(a group of 129 needs a decode block of 1056 threads .*; larger ones that fit the block again are refused"),
    (dict(num_qo_heads=256, num_kv_heads=1), r"group of 256 .* up to 128 heads \(a group of 129 needs"),
    (dict(num_qo_heads=256, num_kv_heads=1, head_dim_qk=64), r"group of 256 .* up to 128 heads"),
    (dict(num_qo_heads=68, num_kv_heads=1, kv_dtype="fp8"), r"group of 68 .* up to 64 heads \(a group of 65 needs"),
    (dict(num_qo_heads=65, num_kv_heads=1, head_dim_qk=24), r"group of 65 .* up to 60 heads \(a group of 61 needs "
     r"more split-KV merge scratch"),
]


@pytest.mark.parametrize("kw,match", BAD, ids=[f"{next(iter(kw))}={list(kw.values())[0]!r}" for kw, _ in BAD])
def test_bad_value_names_field_value_and_allowed(kw, match):
    with pytest.raises(ValueError, match=match):
        mk(**kw)


def test_every_field_has_a_validation_case():
    from dataclasses import fields

    covered = {next(iter(kw)) for kw, _ in BAD}
    assert {f.name for f in fields(AttentionSpec)} <= covered


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float8_e4m3fn"])
def test_paged_groups_are_one_range_up_to_the_limit(kv_dtype):
    """Every head dim takes every group 1..largest_decode_group and nothing above, never above 128 (before,
    some groups past the first refused one were taken again: 133-136 ... 256 at head dim 128, 65-70 at 24)."""
    from jitattn.spec import PAGED_MAX_GROUP, largest_decode_group

    def accepted(group: int, head_dim: int) -> bool:
        try:
            AttentionSpec(group, 1, head_dim, kv_dtype=kv_dtype)
        except ValueError as e:
            assert "is too large: a paged spec there takes every group of up to" in str(e)
            return False
        return True

    largest = {}
    for head_dim in range(8, 257, 8):
        groups = [g for g in range(1, 2 * PAGED_MAX_GROUP + 1) if accepted(g, head_dim)]
        largest[head_dim] = largest_decode_group(head_dim, kv_dtype)
        assert groups == list(range(1, largest[head_dim] + 1)), head_dim
    assert PAGED_MAX_GROUP == max(largest.values()) == 128 and min(largest.values()) == 60  # README: 60-128
    assert AttentionSpec(1024, 1, 256, kv_storage="ragged").group_size == 1024  # no decode kernel, no limit


def test_a_variant_made_for_a_head_dim_takes_that_head_dim_only():
    # rotary_embedding rotates the whole head (x_rot pairs dims half a row apart): no partial rotary
    with pytest.raises(ValueError, match=r"variant 'rope_64_10000' with head_dim_qk=128: the variant is made for head "
                       r"dim 64 \(Variant.head_dim\); build it for 128 \(e.g. rotary_embedding\(128\): .*partial "
                       r"rotary is not supported"):
        mk(variant=rotary_embedding(64))
    with pytest.raises(ValueError, match=r"variant 'rope_256_10000' with head_dim_qk=128: .*head dim 256"):
        mk(variant=rotary_embedding(256))
    assert mk(variant=rotary_embedding(128)).variant.head_dim == 128
    assert mk(head_dim_qk=192, head_dim_vo=128, kv_storage="ragged", variant=rotary_embedding(192))  # q/k's dim
    for bad in (63, 0, True, 64.0):
        with pytest.raises(ValueError, match=rf"rotary_embedding\(head_dim={bad!r}\): expected a positive even int"):
            rotary_embedding(bad)
    with pytest.raises(ValueError, match=r"Variant\('v'\).head_dim=0: expected a positive int or None"):
        Variant("v", query_transform="x", head_dim=0)
    # not part of the kernel key: the JSON (and so the spec's key) is what it was, and a spec read back from it
    # (hooks as CUDA strings, no head_dim) is equal
    spec = mk(head_dim_qk=64, variant=rotary_embedding(64))
    assert "head_dim" not in spec.variant.to_json()
    assert AttentionSpec.from_json(spec.canonical_json()) == spec
    assert Variant("v", query_transform="x", head_dim=64) == Variant("v", query_transform="x")


def test_the_largest_windows_and_soft_caps_render():
    """The bounds are the kernels' 32-bit constants: the largest window renders (a window past int32 used
    to fail in render with a TraceError), the extreme soft-caps too."""
    from jitattn.render import render
    from jitattn.spec import SOFT_CAP_RANGE, WINDOW_MAX

    for spec in (mk(window_left=WINDOW_MAX), mk(causal=False, window_left=WINDOW_MAX, window_right=WINDOW_MAX),
                 mk(logits_soft_cap=SOFT_CAP_RANGE[0]), mk(logits_soft_cap=SOFT_CAP_RANGE[1])):
        assert "kWindowLeft" in render(spec).text


def test_ragged_spec_fields_json_and_key():
    ragged = mk(head_dim_qk=192, head_dim_vo=128, kv_storage="ragged")
    assert ragged.ragged and not mk().ragged
    assert (ragged.page_size, ragged.kv_layout, ragged.head_dim_vo) == (None, "NHD", 128)
    assert ragged.sm_scale == 192 ** -0.5  # the scale follows head_dim_qk
    data = json.loads(ragged.canonical_json())
    assert (data["kv_storage"], data["page_size"], data["head_dim_vo"]) == ("ragged", None, 128)
    assert AttentionSpec.from_json(ragged.canonical_json()) == ragged
    assert "ragged" in ragged.name and "d192v128" in ragged.name
    assert "hd 192/128" in ragged.describe() and "ragged K/V" in ragged.describe()
    # Paged specs keep their JSON (page_size 16 filled in) and get kv_storage "paged".
    assert json.loads(mk().canonical_json())["page_size"] == 16
    assert mk().kv_storage == "paged" and mk(page_size=None) == mk()
    assert ragged.key != mk(kv_storage="ragged", head_dim_qk=192).key != mk(head_dim_qk=192).key


def test_replace_moves_between_paged_and_ragged():
    paged = mk()
    ragged = paged.replace(kv_storage="ragged")
    assert ragged.page_size is None and ragged == mk(kv_storage="ragged")
    assert ragged.replace(kv_storage="paged") == paged  # page_size back to its default 16
    with pytest.raises(ValueError, match="page_size=64 with kv_storage='ragged'"):
        mk(page_size=64).replace(kv_storage="ragged")
    with pytest.raises(ValueError, match=r"head_dim_vo=128, head_dim_qk=192: the paged KV cache"):
        mk(head_dim_qk=192, head_dim_vo=128, kv_storage="ragged").replace(kv_storage="paged")
    for vo in range(8, 257, 8):  # every multiple of 8 for each of qk and vo
        assert mk(head_dim_qk=48, head_dim_vo=vo, kv_storage="ragged").head_dim_vo == vo
        assert mk(head_dim_qk=vo, kv_storage="ragged").head_dim_qk == vo
        assert mk(head_dim_qk=vo).head_dim_vo == vo  # paged, 16-bit cache


def test_missing_required_field_is_a_type_error():
    with pytest.raises(TypeError, match="head_dim_qk"):
        AttentionSpec(num_qo_heads=8, num_kv_heads=8)  # type: ignore[call-arg]


# ---- defaults and normalization ----------------------------------------------------------------
def test_defaults_filled_in():
    s = AttentionSpec(8, 2, 96)
    assert s.head_dim_vo == 96
    assert (s.q_dtype, s.kv_dtype, s.o_dtype) == ("bfloat16",) * 3
    assert s.sm_scale == 96 ** -0.5
    assert (s.kv_layout, s.page_size, s.causal, s.window_left, s.window_right) == ("NHD", 16, True, -1, -1)
    assert (s.logits_soft_cap, s.alibi, s.sinks, s.variant) == (0.0, False, False, None)
    assert s.group_size == 4


def test_kv_and_o_dtype_follow_q_dtype_and_aliases_normalize():
    torch = pytest.importorskip("torch")
    s = mk(q_dtype=torch.float16)
    assert (s.q_dtype, s.kv_dtype, s.o_dtype) == ("float16",) * 3
    assert mk(q_dtype="fp16") == mk(q_dtype="half") == s
    assert mk(q_dtype="bf16", o_dtype="fp16").o_dtype == "float16"


def test_int_soft_cap_and_scale_become_floats_with_equal_keys():
    a, b = mk(logits_soft_cap=50, sm_scale=1), mk(logits_soft_cap=50.0, sm_scale=1.0)
    assert isinstance(a.logits_soft_cap, float) and isinstance(a.sm_scale, float)
    assert a == b and a.key == b.key and a.canonical_json() == b.canonical_json()


def test_explicit_default_scale_equals_omitted_scale():
    assert mk(sm_scale=128 ** -0.5) == mk()
    assert mk(sm_scale=128 ** -0.5).key == mk().key


def test_frozen():
    spec = mk()
    key = spec.key
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot assign to field 'page_size'"):
        spec.page_size = 32  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot delete field 'window_left'"):
        del spec.window_left
    assert spec.page_size == 16 and spec.key == key  # unchanged: the key still names this spec


def test_replace_moves_derived_defaults_along():
    s = mk().replace(head_dim_qk=64)
    assert (s.head_dim_vo, s.sm_scale) == (64, 64 ** -0.5)
    assert mk(sm_scale=0.1).replace(head_dim_qk=64).sm_scale == 0.1  # an explicit scale stays
    f16 = mk().replace(q_dtype="float16")
    assert (f16.kv_dtype, f16.o_dtype) == ("float16", "float16")
    assert mk(o_dtype="float16").replace(q_dtype="float16").o_dtype == "float16"
    assert mk().replace(q_dtype="float16", o_dtype="bfloat16").o_dtype == "bfloat16"
    assert mk().replace(page_size=32) == mk(page_size=32)


def test_replace_validates_again():
    assert mk().replace(page_size=1).page_size == 1
    with pytest.raises(ValueError, match="page_size=0"):
        mk().replace(page_size=0)


# ---- canonical JSON and key --------------------------------------------------------------------
VARIANT = Variant(
    name="rel_bias",
    logits_transform="logits + bias[qo_head] * (float)(kv_idx - qo_idx)",
    logits_mask="kv_idx % stride != 0",
    params=(Param("bias", "float32", ("num_qo_heads",)), Param("stride", "int32")),
    reference_transform=lambda s, b, h, qi, ki, p: s,
)
RICH = [
    mk(),
    mk(q_dtype="float16", kv_layout="HND", page_size=7, causal=False, window_left=31, window_right=17),
    mk(logits_soft_cap=30.0, window_left=4095, sm_scale=0.0625, alibi=True, sinks=True),
    mk(variant=VARIANT),
]


@pytest.mark.parametrize("spec", RICH, ids=lambda s: s.name)
def test_canonical_json_round_trip(spec):
    text = spec.canonical_json()
    back = AttentionSpec.from_json(text)
    assert back == spec and back.key == spec.key and back.canonical_json() == text
    assert AttentionSpec.from_json(json.loads(text)) == spec
    assert text == json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))  # canonical form


def test_canonical_json_is_independent_of_argument_form():
    a = AttentionSpec(32, 8, 128, q_dtype="bf16", window_left=10)
    b = AttentionSpec(head_dim_qk=128, window_left=10, num_kv_heads=8, num_qo_heads=32, kv_dtype="bfloat16")
    assert a.canonical_json() == b.canonical_json()


def test_key_changes_with_every_kernel_relevant_field():
    base = mk(causal=False)
    variants = [base.replace(**kw) for kw in (
        dict(num_qo_heads=16), dict(num_kv_heads=4), dict(head_dim_qk=64), dict(q_dtype="float16"),
        dict(kv_layout="HND"), dict(page_size=32), dict(causal=True), dict(window_left=5), dict(window_right=5),
        dict(logits_soft_cap=1.0), dict(sm_scale=0.5), dict(alibi=True), dict(sinks=True), dict(variant=VARIANT))]
    keys = {s.key for s in variants} | {base.key}
    assert len(keys) == len(variants) + 1


def test_reference_functors_are_not_part_of_the_key():
    other = Variant(VARIANT.name, VARIANT.logits_transform, VARIANT.logits_mask, VARIANT.params,
                    reference_transform=lambda s, b, h, qi, ki, p: s + 1)
    assert mk(variant=other) == mk(variant=VARIANT)
    assert mk(variant=other).key == mk(variant=VARIANT).key


def test_variant_expression_text_is_part_of_the_key():
    changed = Variant(VARIANT.name, VARIANT.logits_transform + " * 1.0f", VARIANT.logits_mask, VARIANT.params)
    assert mk(variant=changed).key != mk(variant=VARIANT).key


def test_key_is_stable_across_processes():
    code = ("from jitattn import AttentionSpec, Variant, Param\n"
            "v = Variant('rel_bias', 'logits + bias[qo_head] * (float)(kv_idx - qo_idx)', 'kv_idx % stride != 0',"
            " (Param('bias', 'float32', ('num_qo_heads',)), Param('stride', 'int32')))\n"
            "print(AttentionSpec(32, 8, 128, variant=v).key, AttentionSpec(32, 8, 128, logits_soft_cap=30.0,"
            " window_left=4095, sm_scale=0.0625, alibi=True, sinks=True).key)")
    for seed in ("1", "2"):  # different hash seeds: nothing may depend on set or dict hashing order
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={"PYTHONHASHSEED": seed}).stdout.split()
        assert out == [RICH[3].key, RICH[2].key]


def test_from_json_rejects_unknown_fields():
    data = mk().to_json()
    data["head_dim"] = 128
    with pytest.raises(ValueError, match=r"unknown fields \['head_dim'\]"):
        AttentionSpec.from_json(data)


def test_from_json_validates():
    data = mk().to_json()
    data["page_size"] = -3
    with pytest.raises(ValueError, match="page_size=-3"):
        AttentionSpec.from_json(data)


def test_name_is_readable_and_unique_with_key():
    s = mk(window_left=4095, logits_soft_cap=50.0, sinks=True, variant=VARIANT)
    assert s.name.startswith("h32x8_d128_bf16_nhd_p16_causal_w4095_-1_cap50_sinks_rel_bias_")
    assert s.name.endswith(s.key[:8])
    assert all(c.isalnum() or c in "_-." for c in s.name)


def test_describe_mentions_features():
    d = mk(window_left=10, sinks=True, alibi=True, logits_soft_cap=5.0).describe()
    for word in ("32/8 heads", "hd 128", "window_left=10", "soft_cap=5", "alibi", "sinks", "causal"):
        assert word in d


# ---- Param and Variant -------------------------------------------------------------------------
@pytest.mark.parametrize("kw,match", [
    (dict(name="1abc"), r"Param.name='1abc': expected a C identifier"),
    (dict(name="a-b"), r"Param.name='a-b': expected a C identifier"),
    (dict(name="qo_idx"), r"Param.name='qo_idx': reserved"),
    (dict(name="float"), r"Param.name='float': reserved"),
    (dict(name="lambda"), r"Param.name='lambda': reserved"),
    (dict(name="params"), r"Param.name='params': reserved"),
    (dict(dtype="float64"), r"Param\('x'\).dtype='float64': expected one of"),
    (dict(shape=(0,)), r"Param\('x'\).shape=\(0,\): each dim must be a positive int or one of"),
    (dict(shape=("heads",)), r"Param\('x'\).shape=\('heads',\)"),
    (dict(shape=(True,)), r"Param\('x'\).shape=\(True,\)"),
    (dict(dtype="bfloat16", shape=()), r"Param\('x'\).dtype='bfloat16': a scalar \(shape=\(\)\) must be one of"),
])
def test_param_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        Param(**{"name": "x", **kw})


def test_param_cuda_types():
    assert Param("x").cuda_type == "float"
    assert Param("n", "int32").cuda_type == "int"
    assert Param("t", "bfloat16", ("num_qo_heads", 4)).cuda_type == "const __nv_bfloat16* __restrict__"
    assert Param("t", "int64", ["*"]).shape == ("*",)  # lists become tuples


@pytest.mark.parametrize("kw,match", [
    (dict(name="my variant"), r"Variant.name='my variant': expected a C identifier"),
    (dict(logits_transform=""), r"Variant\('v'\).logits_transform='': expected a non-empty C\+\+ expression"),
    (dict(logits_transform="   "), r"logits_transform='   ': expected a non-empty"),
    (dict(logits_mask=3), r"logits_mask=3: expected a non-empty C\+\+ expression"),
    (dict(logits_transform="logits; return 0"), r"logits_transform: expected one C\+\+ expression, got statements"),
    (dict(logits_mask="{ true }"), r"logits_mask: expected one C\+\+ expression"),
    (dict(logits_mask="logits > 0"), r"logits_mask uses 'logits'; a mask sees positions only"),
    (dict(params=(Param("a"), Param("a", "int32"))), r"params: duplicate names \['a'\]"),
    (dict(params=("a",)), r"params: expected Param objects, got 'a'"),
])
def test_variant_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        Variant(**{"name": "v", **kw})


def test_variant_json_round_trip_drops_reference_functors():
    back = Variant.from_json(json.loads(json.dumps(VARIANT.to_json())))
    assert back == VARIANT
    assert back.reference_transform is None
    assert back.has_transform and back.has_mask


def test_spec_params_come_from_the_variant():
    assert mk().params == ()
    assert [p.name for p in mk(variant=VARIANT).params] == ["bias", "stride"]


@pytest.mark.parametrize("n", [1, 2, 8, 12, 16, 24, 64])
def test_alibi_slopes(n):
    slopes = alibi_slopes(n)
    assert len(slopes) == n and len(set(slopes)) == n
    closest = 1 << (n.bit_length() - 1)
    assert slopes[:closest] == [2.0 ** (-8.0 * (h + 1) / closest) for h in range(closest)]
    if closest < n:  # BLOOM's interleaving: odd-indexed slopes of the 2x sequence
        assert slopes[closest:] == [2.0 ** (-8.0 * (2 * h + 1) / (2 * closest)) for h in range(n - closest)]


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_alibi_slopes_bad_count(bad):
    with pytest.raises(ValueError, match="num_heads"):
        alibi_slopes(bad)


@pytest.mark.parametrize("text, match", [
    ('{"num_qo_heads": 4}', r"from_json: missing required fields \['num_kv_heads', 'head_dim_qk'\]"),
    ("[1]", r"from_json: expected a JSON object of spec fields, got list"),
    ("{", r"from_json: not valid JSON"),
])
def test_from_json_bad_text_is_a_value_error(text, match):
    with pytest.raises(ValueError, match=match):
        AttentionSpec.from_json(text)


def test_submodules_are_attributes_of_the_package_without_importing_them_first():
    """``jitattn.testing.random_paged_batch`` works after a plain ``import jitattn``; the package itself
    stays torch-free (the submodules load on first use)."""
    import subprocess
    import sys

    code = ("import sys, jitattn; assert 'torch' not in sys.modules and 'jitattn.testing' not in sys.modules; "
            "print(jitattn.testing.random_paged_batch.__name__, jitattn.cuda_driver.CudaDriver.__name__)\n"
            "try:\n    jitattn.nope\nexcept AttributeError as e:\n    print(e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["random_paged_batch CudaDriver", "module 'jitattn' has no attribute 'nope'"]


# Groups at the limits of jitattn.spec.decode_block_problem (a mirror of decode.cuh's DecodeTraits and
# decode_finish asserts): each compiles; one head more is refused at construction (BAD above), not in nvcc.
LARGEST_GROUPS = {
    "fp8-g64-hd128": dict(num_qo_heads=64, num_kv_heads=1, head_dim_qk=128, kv_dtype="fp8"),
    "fp8-g62-hd48": dict(num_qo_heads=62, num_kv_heads=1, head_dim_qk=48, kv_dtype="fp8"),
    "bf16-g128-hd256": dict(num_qo_heads=128, num_kv_heads=1, head_dim_qk=256),
    "bf16-g60-hd48": dict(num_qo_heads=60, num_kv_heads=1, head_dim_qk=48),
    "bf16-g124-hd32": dict(num_qo_heads=124, num_kv_heads=1, head_dim_qk=32),
    "ragged-g1024-hd256": dict(num_qo_heads=1024, num_kv_heads=1, head_dim_qk=256, kv_storage="ragged"),
    # head dims that are multiples of 8 only: the decode block of 3 chunks (24) and of 1 (8)
    "bf16-g60-hd24": dict(num_qo_heads=60, num_kv_heads=1, head_dim_qk=24),
    "bf16-g124-hd8": dict(num_qo_heads=124, num_kv_heads=1, head_dim_qk=8),
    "bf16-g128-hd72": dict(num_qo_heads=128, num_kv_heads=1, head_dim_qk=72),
    # FP8 rows that end in half a 16-byte chunk: 8-byte chunks, so the 16-bit blocks of the same head dim
    "fp8-g60-hd24": dict(num_qo_heads=60, num_kv_heads=1, head_dim_qk=24, kv_dtype="fp8"),
    "fp8-g128-hd72": dict(num_qo_heads=128, num_kv_heads=1, head_dim_qk=72, kv_dtype="fp8"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LARGEST_GROUPS))
def test_largest_accepted_groups_compile(tmp_path, name):
    from jitattn.cache import KernelCache

    spec = AttentionSpec(**LARGEST_GROUPS[name])
    entry, _ = KernelCache(root=tmp_path, layers=()).get_or_build(spec, "sm_80")
    assert entry.cubin.read_bytes()[:4] == b"\x7fELF"
    if not spec.ragged:
        with pytest.raises(ValueError, match=r"a GQA group of \d+ query heads .* needs"):
            spec.replace(num_qo_heads=spec.num_qo_heads + 1)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_the_largest_windows_compile(tmp_path, arch):
    """jitattn.spec.WINDOW_MAX on both sides: decode_mma (a group of 4) rounds window_left + 1 up to tiles at
    compile time, where 2**31 - 66 and more overflowed int (nvcc: "expression must have a constant value")."""
    from jitattn.cache import KernelCache
    from jitattn.spec import WINDOW_MAX

    spec = AttentionSpec(8, 2, 128, causal=False, window_left=WINDOW_MAX, window_right=WINDOW_MAX)
    entry, _ = KernelCache(root=tmp_path, layers=()).get_or_build(spec, arch)
    assert entry.cubin.read_bytes()[:4] == b"\x7fELF"
