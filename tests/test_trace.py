"""Python variants traced to CUDA (issue 4): expressions, error paths, keys, the variant library, nvcc."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from jitattn import AttentionSpec, Param, Variant
from jitattn import reference
from jitattn.cache import KernelCache
from jitattn.testing import random_paged_batch, relative_error
from jitattn.trace import ParamView, TraceError
from jitattn.variant import (document_mask, prefix_lm_mask, relative_position_bias, rotary_embedding,
                             sigmoid_attention, trace_hook)
from tests import oracles

SLOPE = (Param("slope", "float32", ("num_qo_heads",)),)


def cuda(hook: str, fn, params=()) -> str:
    return trace_hook(hook, fn, tuple(params))


# ---- expressions ---------------------------------------------------------------------------------
@pytest.mark.parametrize("fn,expected", [
    (lambda s, b, h, qi, ki, p: s * 2, "(logits * static_cast<float>(2))"),
    (lambda s, b, h, qi, ki, p: s + (qi - ki), "(logits + static_cast<float>((qo_idx - kv_idx)))"),
    (lambda s, b, h, qi, ki, p: s / 4, "(logits / static_cast<float>(4))"),
    (lambda s, b, h, qi, ki, p: (qi - ki) // 3 + s, "(static_cast<float>(jitattn::floor_div((qo_idx - kv_idx), 3)) + logits)"),
    (lambda s, b, h, qi, ki, p: s - (ki % 7), "(logits - static_cast<float>(jitattn::floor_mod(kv_idx, 7)))"),
    (lambda s, b, h, qi, ki, p: torch.tanh(s), "jitattn::fast_tanh(logits)"),
    (lambda s, b, h, qi, ki, p: torch.exp(s) + torch.log(s) + torch.sqrt(s), "((expf(logits) + logf(logits)) + sqrtf(logits))"),
    (lambda s, b, h, qi, ki, p: torch.sigmoid(s), "jitattn::sigmoid(logits)"),
    (lambda s, b, h, qi, ki, p: torch.where(qi > ki, s, -1.5), "((qo_idx > kv_idx) ? logits : -1.500000000e+00f)"),
    (lambda s, b, h, qi, ki, p: torch.minimum(s, torch.maximum(s, s * 0.5)), "fminf(logits, fmaxf(logits, (logits * 5.000000000e-01f)))"),
    (lambda s, b, h, qi, ki, p: s.clamp(min=-2.0, max=2.0), "fminf(fmaxf(logits, -2.000000000e+00f), 2.000000000e+00f)"),
    (lambda s, b, h, qi, ki, p: abs(s) + torch.abs(qi - ki), "(fabsf(logits) + static_cast<float>(abs((qo_idx - kv_idx))))"),
    (lambda s, b, h, qi, ki, p: s ** 2, "powf(logits, static_cast<float>(2))"),
    (lambda s, b, h, qi, ki, p: -s, "(-logits)"),
    (lambda s, b, h, qi, ki, p: (qi - ki).float() * 0.5, "(static_cast<float>((qo_idx - kv_idx)) * 5.000000000e-01f)"),
    (lambda s, b, h, qi, ki, p: s + (s * 3).to(torch.int32), "(logits + static_cast<float>(static_cast<int>((logits * static_cast<float>(3)))))"),
])
def test_transform_expressions(fn, expected):
    assert cuda("logits_transform", fn) == expected


@pytest.mark.parametrize("fn,expected", [
    (lambda s, b, h, qi, ki, p: 100 // (ki + 1) + s, "(static_cast<float>(jitattn::floor_div(100, (kv_idx + 1))) + logits)"),
    (lambda s, b, h, qi, ki, p: 100 % (ki + 1) + s, "(static_cast<float>(jitattn::floor_mod(100, (kv_idx + 1))) + logits)"),
    (lambda s, b, h, qi, ki, p: 100 - qi + s, "(static_cast<float>((100 - qo_idx)) + logits)"),
    (lambda s, b, h, qi, ki, p: 1.5 / s, "(1.500000000e+00f / logits)"),
    (lambda s, b, h, qi, ki, p: 2.0 ** s, "powf(2.000000000e+00f, logits)"),
    (lambda s, b, h, qi, ki, p: 3 * s + 1, "((static_cast<float>(3) * logits) + static_cast<float>(1))"),
])
def test_reflected_operators_keep_the_left_operand_on_the_left(fn, expected):
    """``100 // x`` is floor(100 / x), not floor(x / 100): a Python number on the left of an operator
    reaches the traced value's reflected method (``__rfloordiv__``, ``__rsub__``, ...), which must not
    swap the operands; the same function on torch integers gives Python's answer (checked below)."""
    assert cuda("logits_transform", fn) == expected
    qi, ki = torch.tensor([[[7]]]), torch.tensor([[[3]]])
    got = fn(torch.ones(1, 1, 1), 0, torch.zeros(1, 1, 1, dtype=torch.long), qi, ki, None).item()
    want = fn(1.0, 0, 0, 7, 3, None)
    assert got == pytest.approx(want)


def test_masks_and_logic():
    assert cuda("logits_mask", lambda b, h, qi, ki, p: (ki <= qi) & ~(qi - ki > 5) | (h == 3)) == \
        "(((kv_idx <= qo_idx) && (!((qo_idx - kv_idx) > 5))) || (qo_head == 3))"
    assert cuda("logits_mask", lambda b, h, qi, ki, p: (qi >= 0) ^ (ki >= 0)) == "((qo_idx >= 0) != (kv_idx >= 0))"


def test_parameter_reads_are_bounds_checked_and_flattened():
    params = (Param("table", "float32", (32, "num_qo_heads")), Param("doc", "int32", ("*",)), Param("w", "float32"))
    expr = cuda("logits_transform", lambda s, b, h, qi, ki, p: s * p.w + p.table[ki % 32, h] + p["doc"][qi], params)
    assert "params.w" in expr
    assert "jitattn::read_param(params.table, (jitattn::floor_mod(kv_idx, 32) * Spec::kNumQoHeads + qo_head), " \
           "params.table__numel, oob)" in expr
    assert "jitattn::read_param(params.doc, qo_idx, params.doc__numel, oob)" in expr


def test_vector_hooks_see_their_own_variables():
    assert cuda("query_transform", lambda x, xr, b, h, pos, d, p: x + xr * pos) == \
        "(x + (x_rot * static_cast<float>(qo_idx)))"
    assert cuda("key_transform", lambda x, xr, b, h, pos, d, p: x * (h + 1) + d) == \
        "((x * static_cast<float>((kv_head + 1))) + static_cast<float>(dim))"
    assert cuda("output_transform", lambda o, b, h, qi, d, p: torch.where(d < 64, o, o * 2.0)) == \
        "((dim < 64) ? out : (out * 2.000000000e+00f))"


# ---- errors: function, source line, what to write instead ---------------------------------------
def _uses_if(score, batch, qo_head, qo_idx, kv_idx, params):
    if score > 0:
        return score
    return score * 0.5


def _uses_math(score, batch, qo_head, qo_idx, kv_idx, params):
    return math.exp(score)


def _float_index(batch, qo_head, qo_idx, kv_idx, params):
    return params.doc[qo_idx / 2] == 1


def _unknown_fn(score, batch, qo_head, qo_idx, kv_idx, params):
    return torch.erf(score)


def _closure_tensor(score, batch, qo_head, qo_idx, kv_idx, params):
    return score + torch.ones(3)[0]


@pytest.mark.parametrize("hook,fn,params,pattern", [
    ("logits_transform", _uses_if, (), r"_uses_if at .*test_trace.py:\d+ `if score > 0:`.*Python `if`.*torch.where"),
    ("logits_transform", _uses_math, (), r"_uses_math at .*`return math.exp\(score\)`.*use the torch function"),
    ("logits_mask", _float_index, (Param("doc", "int32", ("*",)),), r"_float_index at .*index 0 is a float.*integer"),
    ("logits_transform", _unknown_fn, (), r"_unknown_fn at .*erf is not supported.*supported: torch.ceil"),
    ("logits_transform", _closure_tensor, (), r"_closure_tensor .*(torch tensor|cannot use)"),
    ("logits_transform", lambda s, b: s, (), r"takes the wrong arguments.*logits_transform\(score, batch, qo_head"),
    ("logits_mask", lambda b, h, qi, ki, p: qi - ki, (), r"must return a boolean"),
    ("logits_transform", lambda s, b, h, qi, ki, p: qi > ki, (), r"must return a number, got a boolean"),
    ("logits_mask", lambda b, h, qi, ki, p: p.missing[qi] > 0, (), r"params has no 'missing'"),
    ("logits_mask", lambda b, h, qi, ki, p: ~(qi - ki) > 0, (), r"`~` is supported on booleans"),
    ("logits_mask", lambda b, h, qi, ki, p: p.t[qi, ki] > 0, (Param("t", "float32", ("*", "*")),),
     r"dim 1 must have a fixed size"),
    ("logits_mask", lambda b, h, qi, ki, p: p.t[qi, ki] > 0, (Param("t", "float32", ("*",)),), r"has 1 dims; indexed with 2"),
])
def test_unsupported_constructs_name_the_function_line_and_fix(hook, fn, params, pattern):
    with pytest.raises((TraceError, AttributeError, KeyError), match=pattern):
        cuda(hook, fn, params)


def test_variant_construction_reports_trace_errors():
    with pytest.raises(TraceError, match=r"logits_transform _uses_if at"):
        Variant("v", logits_transform=_uses_if)


# ---- the cache key follows the traced expression ------------------------------------------------
def _bias_a(score, batch, qo_head, qo_idx, kv_idx, params):
    return score - params.slope[qo_head] * (qo_idx - kv_idx)


def undeclared_bias(score, batch, qo_head, qo_idx, kv_idx, params):
    return score + params.bias[qo_head]


def undeclared_item(score, batch, qo_head, qo_idx, kv_idx, params):
    return score * params["scale"]


@pytest.mark.parametrize("fn, name", [(undeclared_bias, "bias"), (undeclared_item, "scale")])
def test_undeclared_parameter_is_a_trace_error_naming_the_line(fn, name):
    with pytest.raises(TraceError, match=rf"logits_transform {fn.__name__} at .*test_trace.py:\d+ `return .*`: "
                                         rf"params has no '{name}'; declared: \[\] \(declare it in Variant"):
        Variant("v", logits_transform=fn)


def test_same_function_same_key_changed_constant_new_key():
    a = AttentionSpec(8, 2, 64, variant=Variant("b", logits_transform=_bias_a, params=SLOPE))
    again = AttentionSpec(8, 2, 64, variant=Variant("b", logits_transform=_bias_a, params=SLOPE))
    changed = AttentionSpec(8, 2, 64, variant=Variant(
        "b", logits_transform=lambda s, b, h, qi, ki, p: s - p.slope[h] * (qi - ki) * 1.5, params=SLOPE))
    assert a == again and a.key == again.key
    assert changed.key != a.key
    # the JSON form (what `jitattn warmup --spec` receives) renders the same kernel: same key
    assert AttentionSpec.from_json(a.canonical_json()).key == a.key


def test_traced_key_is_stable_across_processes(tmp_path):
    script = tmp_path / "k.py"
    script.write_text(
        "import torch\nfrom jitattn import AttentionSpec, Variant, Param\n"
        "def f(score, batch, qo_head, qo_idx, kv_idx, params):\n"
        "    return torch.where(qo_idx - kv_idx > 8, score - params.slope[qo_head], score)\n"
        "v = Variant('x', logits_transform=f, params=(Param('slope', 'float32', ('num_qo_heads',)),))\n"
        "print(AttentionSpec(8, 2, 64, variant=v).key)\n")
    keys = {subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin"}).stdout.strip() for seed in ("1", "2")}
    assert len(keys) == 1 and len(keys.pop()) == 16


# ---- the library: semantics on the reference path -----------------------------------------------
def _t5_bucket_loop(n: int, num_buckets: int, max_distance: int, bidirectional: bool) -> int:
    """transformers' T5 bucketing, one integer at a time (n = query - key)."""
    ret = 0
    if bidirectional:
        num_buckets //= 2
        ret += num_buckets if n < 0 else 0
        n = abs(n)
    else:
        n = max(n, 0)
    max_exact = num_buckets // 2
    if n < max_exact:
        return ret + n
    large = max_exact + int(math.log(n / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact))
    return ret + min(large, num_buckets - 1)


@pytest.mark.parametrize("bidirectional", [False, True])
def test_t5_bias_matches_the_reference_bucketing(bidirectional):
    variant = relative_position_bias(32, 128, bidirectional)
    table = torch.randn(32, 4)
    qi, ki = torch.arange(300)[None, :, None], torch.arange(300)[None, None, :]
    out = variant.logits_transform(torch.zeros(4, 300, 300), 0, torch.arange(4)[:, None, None], qi, ki,
                                   ParamView({"table": table}))
    for q, k in [(0, 0), (5, 1), (20, 3), (299, 0), (3, 200), (0, 299), (150, 149)]:
        want = table[_t5_bucket_loop(q - k, 32, 128, bidirectional), 2]
        assert out[2, q, k].item() == pytest.approx(want.item(), abs=1e-6), (q, k)


def test_prefix_lm_mask_on_the_reference():
    """The hook's mask is the hand-written prefix-LM mask, and the reference's output over a batch is
    the oracle's (tests/oracles.py: attention with that mask written independently)."""
    spec = AttentionSpec(4, 2, 32, causal=False, variant=prefix_lm_mask())
    params = {"prefix_len": torch.tensor([3, 0, 6], dtype=torch.int32)}
    mask = spec.variant.logits_mask(0, torch.zeros(1, 1, 1, dtype=torch.long), torch.arange(6)[None, :, None],
                                    torch.arange(6)[None, None, :], ParamView(params))[0]
    expected = torch.tensor([[j <= i or j < 3 for j in range(6)] for i in range(6)])
    assert torch.equal(mask, expected)
    batch = random_paged_batch(spec, [6, 2, 3], [6, 9, 6], params=params)
    out = reference.paged_attention(spec, *batch.args(), **batch.kwargs())
    want, _ = oracles.attention(spec, batch, oracles.prefix_lm_pieces(params))
    assert relative_error(out, want) < 4e-3


def test_document_mask_on_the_reference():
    """Sequence b reads its document ids at doc[b * doc_stride + position]: the hook's mask is the
    hand-written block-diagonal mask of each sequence's own ids, and the output is the oracle's."""
    spec = AttentionSpec(4, 2, 32, variant=document_mask())
    ids = [[0, 0, 1, 1, 1, 2, 9, 9], [5, 6, 6, 6, 7, 7, 7, 7]]  # stride 8; sequence 1 uses 6 positions
    params = {"doc": torch.tensor(ids[0] + ids[1], dtype=torch.int32), "doc_stride": 8}
    for b, kv_len in ((0, 8), (1, 6)):
        pos = torch.arange(kv_len)
        mask = spec.variant.logits_mask(b, torch.zeros(1, 1, 1, dtype=torch.long), pos[None, :, None],
                                        pos[None, None, :], ParamView(params))[0]
        expected = torch.tensor([[ids[b][i] == ids[b][j] for j in range(kv_len)] for i in range(kv_len)])
        assert torch.equal(mask, expected), b
    batch = random_paged_batch(spec, [8, 3], [8, 6], params=params)
    out = reference.paged_attention(spec, *batch.args(), **batch.kwargs())
    want, _ = oracles.attention(spec, batch, oracles.document_pieces(params))
    assert relative_error(out, want) < 4e-3


def test_sigmoid_attention_is_a_weighted_sum_without_lse():
    spec = AttentionSpec(2, 1, 32, causal=False, variant=sigmoid_attention())
    batch = random_paged_batch(spec, [3], [5], params={"bias": -1.0})
    out = reference.paged_attention(spec, *batch.args(), **batch.kwargs(), compute_dtype=torch.float64)
    from jitattn.reference import gather_kv

    k, v = gather_kv(spec, batch.kv_cache, batch.block_table, 0, 5)
    q = batch.q.double()
    s = torch.einsum("qhd,khd->hqk", q, k.double().expand(5, 2, 32)) * spec.sm_scale
    want = torch.einsum("hqk,khd->qhd", torch.sigmoid(s - 1.0), v.double().expand(5, 2, 32))
    assert torch.allclose(out.double(), want, atol=2e-2)
    with pytest.raises(ValueError, match="no softmax, so there is no lse"):
        reference.paged_attention(spec, *batch.args(), **batch.kwargs(), return_lse=True)
    with pytest.raises(ValueError, match="sinks=True with variant 'sigmoid'"):
        AttentionSpec(2, 1, 32, sinks=True, variant=sigmoid_attention())


def test_rotary_embedding_equals_the_rotate_half_formula():
    variant = rotary_embedding(64)
    x = torch.randn(5, 3, 64)
    pos = torch.arange(10, 15)
    from jitattn.reference import _rotate_half, _transform_vectors

    got = _transform_vectors(variant.query_transform, x, 0, pos, ParamView({}))
    inv = 10000.0 ** (-torch.arange(0, 64, 2).float() / 64)
    angle = pos[:, None].float() * inv[None, :]  # (5, 32)
    cos, sin = torch.cat([angle.cos()] * 2, -1)[:, None], torch.cat([angle.sin()] * 2, -1)[:, None]
    assert torch.allclose(got, x * cos + _rotate_half(x) * sin, atol=1e-5)


# ---- nvcc compiles every built-in and library variant ---------------------------------------------
LIBRARY = [
    AttentionSpec(8, 2, 128, variant=document_mask()),
    AttentionSpec(8, 2, 128, causal=False, variant=prefix_lm_mask()),
    AttentionSpec(8, 2, 128, causal=False, variant=relative_position_bias(32, 128, True)),
    AttentionSpec(8, 2, 64, variant=sigmoid_attention()),
    AttentionSpec(8, 2, 128, variant=rotary_embedding(128)),
    AttentionSpec(16, 8, 256, logits_soft_cap=50.0, window_left=4095, alibi=True),
    AttentionSpec(8, 2, 64, variant=Variant("traced_bias", logits_transform=_bias_a, params=SLOPE,
                                           output_transform=lambda o, b, h, qi, d, p: o * 0.5)),
]


@pytest.mark.slow
@pytest.mark.parametrize("spec", LIBRARY, ids=lambda s: s.name)
def test_nvcc_compiles_library_variants(spec, tmp_path):
    entry, built = KernelCache(root=tmp_path, layers=()).get_or_build(spec, "sm_90a")
    assert built and entry.cubin.stat().st_size > 10_000
    assert "error" not in entry.manifest["compiler_log"].lower()


def test_example_custom_variant_runs_on_the_reference_path():
    script = Path(__file__).resolve().parent.parent / "examples" / "custom_variant.py"
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr
    assert "reference" in proc.stdout
