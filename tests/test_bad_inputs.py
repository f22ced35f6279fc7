"""Bad inputs to the torch-level entry points on the CPU: jitattn.reference.paged_attention /
ragged_attention and the torch backends' callables. Each is a ValueError naming the argument and the
value, never a traceback from inside torch and never a silently wrong answer (the reference is the
oracle: it must not compute on metadata the kernels would refuse under ``validate=True``)."""

from __future__ import annotations

import pytest
import torch

from jitattn import AttentionSpec, reference
from jitattn.backends import get_backend
from jitattn.backends.base import DeviceInfo
from jitattn.testing import random_paged_batch, random_ragged_batch

SPEC = AttentionSpec(4, 2, 64, q_dtype="float16", page_size=16)
RAGGED = AttentionSpec(4, 2, 64, head_dim_vo=32, kv_storage="ragged")
I32 = torch.int32


def paged():
    return random_paged_batch(SPEC, [1, 5], [20, 37])  # 3 pages per row, 8 pages in all


def bad_table():
    b = paged()
    t = b.block_table.clone()
    t[1, 1] = b.kv_cache.shape[0] + 5
    return t


def neg_table():
    t = paged().block_table.clone()
    t[1, 1] = -3  # would index from the end of the cache: another sequence's keys
    return t


PAGED_CASES = [
    ("q", lambda b: b.q.float(), r"q: expected dtype torch.float16, got torch.float32"),
    ("q", lambda b: b.q[:, :2], r"q: dim 1 \(num_qo_heads\) must be 4, got 2"),
    ("kv_cache", lambda b: b.kv_cache[:, :, :8], r"kv_cache: dim 2 \(page_size\) must be 16"),
    ("seq_lens", lambda b: b.seq_lens.long(), r"seq_lens: expected dtype torch.int32"),
    ("seq_lens", lambda b: torch.tensor([-1, 37], dtype=I32), r"seq_lens\[0\]=-1: expected a KV length >= 0"),
    ("seq_lens", lambda b: torch.tensor([20, 1000], dtype=I32), r"seq_lens\[1\]=1000 exceeds block_table capacity"),
    ("query_start_loc", lambda b: torch.tensor([0, 1, 3], dtype=I32),
     r"query_start_loc: must start at 0 and end at total_q=6, got 0 \.\.\. 3"),
    ("query_start_loc", lambda b: torch.tensor([1, 2, 6], dtype=I32), r"query_start_loc: must start at 0"),
    ("query_start_loc", lambda b: torch.tensor([0, 7, 6], dtype=I32), r"query_start_loc: decreases at sequence 1"),
    ("block_table", lambda b: bad_table(), r"block_table\[1\]: page ids must be in \[0, 8\), got \[.*13.*\]"),
    ("block_table", lambda b: neg_table(), r"block_table\[1\]: page ids must be in \[0, 8\), got \[.*-3.*\]"),
    ("block_table", lambda b: b.block_table[0], r"block_table: expected 2 dims"),
    ("k_scale", lambda b: float("nan"), r"k_scale=nan: expected a positive finite Python float"),
    ("v_scale", lambda b: -1.0, r"v_scale=-1.0: expected a positive finite Python float"),
    ("sinks", lambda b: torch.zeros(4), r"sinks: given, but spec.sinks=False"),
    # A truthy string was read as True: "no" would have returned the lse too.
    ("return_lse", lambda b: "no", r"return_lse='no': expected True or False"),
]


def _paged_call(fn, b, name, value, **kw):
    args = dict(q=b.q, kv_cache=b.kv_cache, block_table=b.block_table, seq_lens=b.seq_lens,
                query_start_loc=b.query_start_loc)
    extra = {}
    if name in args:
        args[name] = value
    else:
        extra[name] = value
    return fn(*args.values(), **extra, **kw)


@pytest.mark.parametrize("name, make, match", PAGED_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(PAGED_CASES)])
def test_reference_paged_attention_refuses(name, make, match):
    b = paged()
    with pytest.raises(ValueError, match=match):
        _paged_call(lambda *a, **kw: reference.paged_attention(SPEC, *a, **kw), b, name, make(b))


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
@pytest.mark.parametrize("name, make, match",
                         [c for c in PAGED_CASES if c[0] not in ("k_scale", "v_scale")],
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(PAGED_CASES) if c[0] not in ("k_scale", "v_scale")])
def test_torch_backends_refuse_bad_metadata(backend, name, make, match):
    """reference and sdpa read the metadata on the host anyway: they always check its values."""
    fn = get_backend(backend).build(SPEC, DeviceInfo.parse("cpu"))
    b = paged()
    with pytest.raises(ValueError, match=match):
        _paged_call(fn, b, name, make(b))


def test_backends_take_validate_like_the_jit_kernel():
    b = paged()
    for name in ("reference", "sdpa"):
        fn = get_backend(name).build(SPEC, DeviceInfo.parse("cpu"))
        torch.testing.assert_close(fn(*b.args(), validate=True), reference.paged_attention(SPEC, *b.args()))
        with pytest.raises(ValueError, match=r"block_table\[1\]: page ids must be in \[0, 8\)"):
            fn(b.q, b.kv_cache, bad_table(), b.seq_lens, b.query_start_loc, validate=True)


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_backends_refuse_a_misspelled_keyword(backend):
    """A keyword the call does not take is a TypeError naming it, for the paged and the ragged callables
    (the sdpa and flashinfer callables take **kwargs for the optional tensors: a ``sink=`` must not
    be dropped silently)."""
    b = paged()
    fn = get_backend(backend).build(SPEC, DeviceInfo.parse("cpu"))
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['sink'\]; the attention call takes "
                                        r"sinks, alibi_slopes, params, k_scale, v_scale"):
        fn(*b.args(), sink=torch.zeros(SPEC.num_qo_heads))
    r = ragged()
    fn = get_backend(backend).build(RAGGED, DeviceInfo.parse("cpu"))
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['alibi', 'scale'\]"):
        fn(r.q, r.k, r.v, r.query_start_loc, r.kv_start_loc, alibi=None, scale=1.0)


def test_zero_length_sequences_and_empty_q_are_fine():
    b = paged()
    qsl = torch.tensor([0, 0, 5], dtype=I32)
    out, lse = reference.paged_attention(SPEC, b.q[1:], b.kv_cache, b.block_table, torch.tensor([0, 37], dtype=I32),
                                         qsl, return_lse=True)
    assert out.shape == (5, 4, 64) and not out.isnan().any() and lse.isfinite().all()
    empty = reference.paged_attention(SPEC, b.q[:0], b.kv_cache, b.block_table, b.seq_lens,
                                      torch.zeros(3, dtype=I32))
    assert empty.shape == (0, 4, 64)


def ragged():
    return random_ragged_batch(RAGGED, [1, 5], [20, 37])  # 57 keys


RAGGED_CASES = [
    ("v", lambda b: b.k, r"v: dim 2 \(head_dim_vo\) must be 32, got 64"),
    ("q", lambda b: b.q.half(), r"q: expected dtype torch.bfloat16, got torch.float16"),
    ("kv_start_loc", lambda b: torch.tensor([0, 20, 50], dtype=I32),
     r"kv_start_loc: must start at 0 and end at 57 \(rows of k and v\), got 0 \.\.\. 50"),
    ("kv_start_loc", lambda b: torch.tensor([0, 20, 80], dtype=I32), r"kv_start_loc: must start at 0 and end at 57"),
    ("kv_start_loc", lambda b: torch.tensor([0, 60, 57], dtype=I32), r"kv_start_loc: decreases at sequence 1"),
    ("query_start_loc", lambda b: torch.tensor([0, 1, 4], dtype=I32),
     r"query_start_loc: must start at 0 and end at 6 \(rows of q\)"),
    ("kv_start_loc", lambda b: b.kv_start_loc.long(), r"kv_start_loc: expected dtype torch.int32"),
]


@pytest.mark.parametrize("via", ["reference", "backend:reference", "backend:sdpa"])
@pytest.mark.parametrize("name, make, match", RAGGED_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(RAGGED_CASES)])
def test_ragged_refuses(via, name, make, match):
    b = ragged()
    if via == "reference":
        fn = lambda *a, **kw: reference.ragged_attention(RAGGED, *a, **kw)  # noqa: E731
    else:
        fn = get_backend(via.split(":")[1]).build(RAGGED, DeviceInfo.parse("cpu"))
    args = dict(q=b.q, k=b.k, v=b.v, query_start_loc=b.query_start_loc, kv_start_loc=b.kv_start_loc)
    args[name] = make(b)
    with pytest.raises(ValueError, match=match):
        fn(*args.values())


@pytest.mark.parametrize("scale", [{"k_scale": 2.0}, {"v_scale": 0.5}])
def test_scales_of_a_16_bit_cache_must_be_1(scale, monkeypatch):
    """k_scale / v_scale dequantise an FP8 cache only. On a 16-bit cache the reference multiplied K / V
    by them and the CUDA-core decode applied them, while the tensor-core decode, the prefill and the
    sdpa / flex backends ignored them: one call, different answers. Now refused everywhere the checks
    run, naming the argument, the value and the kv_dtype; 1.0 (the default) still passes."""
    (name, value), = scale.items()
    b = paged()
    match = rf"{name}={value}: only an FP8 cache .* spec.kv_dtype='float16' holds K and V as they are"
    with pytest.raises(ValueError, match=match):
        reference.paged_attention(SPEC, *b.args(), **scale)
    for backend in ("reference", "sdpa", "flex"):
        fn = get_backend(backend).build(SPEC, DeviceInfo.parse("cpu"))
        with pytest.raises(ValueError, match=match):
            fn(*b.args(), **scale)
    torch.testing.assert_close(reference.paged_attention(SPEC, *b.args(), k_scale=1.0, v_scale=1.0),
                               reference.paged_attention(SPEC, *b.args()))

    # The jit backend's callable checks before it reaches the kernel (no GPU here: a stand-in kernel).
    import jitattn.runtime

    launched = []
    stand_in = type("K", (), {"paged_attention": lambda self, *a, **kw: launched.append(kw)})()
    monkeypatch.setattr(jitattn.runtime, "load_kernel", lambda spec, device=None: stand_in)
    fn = get_backend("jit").build(SPEC, DeviceInfo.parse("h100"))
    with pytest.raises(ValueError, match=match):
        fn(*b.args(), **scale)
    fn(*b.args(), k_scale=1.0)
    assert launched == [{"k_scale": 1.0}]


def test_scales_of_an_fp8_cache_are_applied():
    fp8 = SPEC.replace(kv_dtype="float8_e4m3fn")
    b = random_paged_batch(fp8, [1, 5], [20, 37])
    one = reference.paged_attention(fp8, *b.args())
    scaled = reference.paged_attention(fp8, *b.args(), k_scale=1.0, v_scale=2.0)
    torch.testing.assert_close(scaled.float(), 2 * one.float(), rtol=2e-3, atol=2e-3)


def test_ops_wrapper_refuses_scales_of_a_16_bit_cache():
    """jitattn.ops.paged_attention dropped k_scale / v_scale for a 16-bit cache without a word."""
    import jitattn.ops

    b = paged()
    with pytest.raises(ValueError, match=r"k_scale=3.0: only an FP8 cache"):
        jitattn.ops.paged_attention(SPEC, *b.args(), k_scale=3.0, backend="reference")
    torch.testing.assert_close(jitattn.ops.paged_attention(SPEC, *b.args(), backend="reference"),
                               reference.paged_attention(SPEC, *b.args()))
    with pytest.raises(ValueError, match=r"return_lse=1: expected True or False"):
        jitattn.ops.paged_attention(SPEC, *b.args(), return_lse=1, backend="reference")


NOT_SPECS = [("x", r"got str \(a JSON text becomes one through AttentionSpec.from_json\);"),
             ({"num_qo_heads": 4}, r"got dict \(a dict of fields becomes one through AttentionSpec\(\*\*fields\)\);"),
             (None, r"got NoneType;")]


@pytest.mark.parametrize("spec, got", NOT_SPECS, ids=["str", "dict", "None"])
def test_spec_that_is_not_an_attention_spec(spec, got):
    """A spec that is not an AttentionSpec (a JSON text, a dict, None, or the arguments in the wrong
    order) is a ValueError naming what was given and how the call is written; it was an
    AttributeError ('str' object has no attribute 'ragged') from inside the reference."""
    import jitattn.ops

    b, r = paged(), ragged()
    with pytest.raises(ValueError, match=rf"spec: expected a jitattn.AttentionSpec, {got} the spec comes first: "
                                         r"reference.paged_attention\(spec, q, kv_cache"):
        reference.paged_attention(spec, *b.args())
    with pytest.raises(ValueError, match=rf"spec: expected a jitattn.AttentionSpec, {got}.*"
                                         r"reference.ragged_attention\(spec, q, k, v"):
        reference.ragged_attention(spec, r.q, r.k, r.v, r.query_start_loc, r.kv_start_loc)
    with pytest.raises(ValueError, match=rf"spec: expected a jitattn.AttentionSpec, {got}.*"
                                         r"jitattn.ops.paged_attention\(spec, q"):
        jitattn.ops.paged_attention(spec, *b.args(), backend="reference")


def test_spec_passed_last_names_the_order():
    b = paged()
    with pytest.raises(ValueError, match=r"spec: expected a jitattn.AttentionSpec, got Tensor; the spec comes first"):
        reference.paged_attention(*b.args(), SPEC)


def test_random_batch_helpers_refuse_bad_arguments():
    """jitattn.testing's batch builders: a ragged spec for the paged builder was a TypeError from inside
    (int / NoneType page size), a non-spec an AttributeError, an int for the lengths 'has no len()'."""
    with pytest.raises(ValueError, match=r"spec.kv_storage='ragged': random_paged_batch needs a paged spec"):
        random_paged_batch(RAGGED, [1], [5])
    with pytest.raises(ValueError, match=r"spec: expected a jitattn.AttentionSpec, got str.*random_paged_batch"):
        random_paged_batch("x", [1], [5])
    with pytest.raises(ValueError, match=r"spec: expected a jitattn.AttentionSpec, got NoneType.*random_ragged_batch"):
        random_ragged_batch(None, [1], [5])
    for q_lens, kv_lens, bad in ((1, [5], "q_lens=1"), ([1], [5.0], r"kv_lens=\[5.0\]"),
                                 ([True], [5], r"q_lens=\[True\]")):
        with pytest.raises(ValueError, match=rf"{bad}: expected a list of ints, one per sequence"):
            random_paged_batch(SPEC, q_lens, kv_lens)
    assert random_paged_batch(SPEC, (1, 2), range(3, 5)).q.shape[0] == 3  # tuples and ranges are fine


@pytest.mark.parametrize("backend", ["reference", "sdpa", "flex"])
@pytest.mark.parametrize("value", ["no", 1, None, torch.tensor(True)])
def test_backends_refuse_a_validate_that_is_not_a_bool(backend, value):
    """``validate`` must be True or False in every backend's callable, as in the jit kernel's
    (check_flag): the torch backends took any value ('no' validated, None did not)."""
    b, r = paged(), ragged()
    match = r"validate=.*: expected True or False"
    with pytest.raises(ValueError, match=match):
        get_backend(backend).build(SPEC, DeviceInfo.parse("cpu"))(*b.args(), validate=value)
    if backend != "flex":  # flex serves no ragged spec
        with pytest.raises(ValueError, match=match):
            get_backend(backend).build(RAGGED, DeviceInfo.parse("cpu"))(r.q, r.k, r.v, r.query_start_loc,
                                                                          r.kv_start_loc, validate=value)
