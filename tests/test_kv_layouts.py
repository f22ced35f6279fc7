"""The engines' KV caches as ``(k_cache, v_cache)`` pairs (issue 19, item 1), on the CPU.

Every layout of tests/kv_layouts.py gives the reference the same output as the single tensor; through
plan/run (kernels that record their launches, tests/test_plan_launches.py) a pair packs K's address
and the K-to-V offset that lands on V's address; pairs the kernels cannot read are refused by name.
"""

from __future__ import annotations

import pytest
import torch

from jitattn import reference, runtime
from jitattn.backends import get_backend
from jitattn.backends.base import DeviceInfo
from jitattn.spec import AttentionSpec
from jitattn.testing import random_paged_batch
from tests.kv_layouts import ALL_LAYOUTS, LAYOUTS, engine_kv
from tests.test_plan_launches import kernels  # noqa: F401 (the fixture)

CPU = DeviceInfo.parse("cpu")
Q_LENS, KV_LENS = [1, 5, 1, 3], [17, 40, 1, 9]  # decode and prefill rows in one batch


def _spec(kv_layout: str, kv_dtype: str, page_size: int) -> AttentionSpec:
    return AttentionSpec(4, 2, 64, q_dtype="bfloat16", kv_dtype=kv_dtype,
                         kv_layout=kv_layout, page_size=page_size, causal=True)


def _cases():
    for kv_layout in ("NHD", "HND"):
        for kv_dtype in ("bfloat16", "float8_e4m3fn"):
            for layout in ALL_LAYOUTS:
                yield kv_layout, kv_dtype, layout


@pytest.mark.parametrize("kv_layout,kv_dtype,layout", list(_cases()))
def test_engine_layouts_match_the_single_tensor_through_the_reference(kv_layout, kv_dtype, layout):
    spec = _spec(kv_layout, kv_dtype, 1 if layout == "sglang_token_pool" else 16)
    b = random_paged_batch(spec, Q_LENS, KV_LENS, seed=3)
    want, want_lse = reference.paged_attention(spec, *b.args(), **b.kwargs(), return_lse=True)
    kv = engine_kv(spec, b.kv_cache, layout)
    got, lse = reference.paged_attention(spec, b.q, kv, *b.args()[2:], **b.kwargs(), return_lse=True)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["reference", "sdpa", "flex"])
def test_backends_take_a_pair(backend):
    spec = _spec("NHD", "bfloat16", 16)
    b = random_paged_batch(spec, Q_LENS, KV_LENS, seed=4)
    if get_backend(backend).reasons(spec, CPU):
        pytest.skip(f"{backend}: {get_backend(backend).reasons(spec, CPU)}")
    fn = get_backend(backend).build(spec, CPU)
    want = fn(*b.args())
    got = fn(b.q, engine_kv(spec, b.kv_cache, "separate_caches"), *b.args()[2:])
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def _packed_v_address(fields, elem: int) -> int:
    return fields["kv_cache"] + fields["kv_stride_kv"] * elem


@pytest.mark.parametrize("kv_layout,kv_dtype,layout", [c for c in _cases() if c[2] in LAYOUTS])
def test_plan_run_packs_k_and_the_offset_to_v(kv_layout, kv_dtype, layout, kernels):  # noqa: F811
    """The packed kv_cache is K's address, kv_cache + kv_stride_kv elements is V's, kv_stride_page the
    pair's page stride; a single-tensor run after a pair packs the spec's offset again."""
    spec = _spec(kv_layout, kv_dtype, 16)
    b = random_paged_batch(spec, Q_LENS, KV_LENS, seed=5)
    kv = engine_kv(spec, b.kv_cache, layout)
    plan = runtime.plan(spec, b.block_table, b.seq_lens, b.query_start_loc)
    runtime.run(b.q, kv, plan, **b.scales)
    runtime.run(b.q, b.kv_cache, plan, **b.scales)
    _, module = kernels[spec.canonical_text]
    n = len(module.launches) // 2
    assert n >= 1 and [x["kernel"] for x in module.launches[:n]] == [x["kernel"] for x in module.launches[n:]]
    k, v = (kv[:, 0], kv[:, 1]) if layout == "single" else kv
    elem = k.element_size()
    for launch in module.launches[:n]:
        f = launch["fields"]
        assert f["kv_cache"] == k.data_ptr() and _packed_v_address(f, elem) == v.data_ptr()
        assert f["kv_stride_page"] == k.stride(0) and f["num_pages"] == k.shape[0]
    for launch in module.launches[n:]:
        f = launch["fields"]
        assert f["kv_cache"] == b.kv_cache.data_ptr() and f["kv_stride_kv"] == b.kv_cache.stride(1)


def test_a_pair_whose_v_sits_before_k_packs_a_negative_offset(kernels):  # noqa: F811
    spec = _spec("NHD", "bfloat16", 16)
    b = random_paged_batch(spec, Q_LENS, KV_LENS, seed=6)
    both = torch.stack((b.kv_cache[:, 1], b.kv_cache[:, 0])).contiguous()  # V first, then K
    plan = runtime.plan(spec, b.block_table, b.seq_lens, b.query_start_loc)
    runtime.run(b.q, (both[1], both[0]), plan)
    _, module = kernels[spec.canonical_text]
    f = module.launches[0]["fields"]
    assert f["kv_stride_kv"] == -both[0].numel() and _packed_v_address(f, 2) == both[0].data_ptr()


def test_the_one_call_takes_a_pair(kernels):  # noqa: F811
    spec = _spec("HND", "bfloat16", 16)
    b = random_paged_batch(spec, Q_LENS, KV_LENS, seed=7)
    k, v = engine_kv(spec, b.kv_cache, "separate_caches")
    runtime.paged_attention(spec, b.q, (k, v), *b.args()[2:])
    _, module = kernels[spec.canonical_text]
    f = module.launches[-1]["fields"]
    assert f["kv_cache"] == k.data_ptr() and _packed_v_address(f, 2) == v.data_ptr()


def _bad_pair_cases(spec, kv):
    k, v = kv[:, 0], kv[:, 1]
    wide = torch.zeros(k.shape[0] * 3, *k.shape[1:], dtype=k.dtype)[::3]  # a page stride other than k's
    yield "one tensor", (k,), "a pair is \\(k_cache, v_cache\\)"
    yield "dtype", (k, v.float()), "expected dtype torch.bfloat16"
    yield "4 dims", (kv, kv), "expected 4 dims"
    yield "shape", (k, v[:-1]), "must have one shape"
    yield "head dim", (k[..., :32], v[..., :32]), "expected NHD shape"
    yield "strides", (k, wide.copy_(v)), "k_cache's page stride is .* and v_cache's .*same strides"
    yield "inner", (k.transpose(1, 2).contiguous().transpose(1, 2), v), "dims 1-3 must be contiguous"


@pytest.mark.parametrize("what", ["one tensor", "dtype", "4 dims", "shape", "head dim", "strides", "inner"])
def test_pairs_the_kernels_cannot_read_are_refused(what, kernels):  # noqa: F811
    spec = _spec("NHD", "bfloat16", 16)
    b = random_paged_batch(spec, Q_LENS, KV_LENS, seed=8)
    _, pair, match = next(c for c in _bad_pair_cases(spec, b.kv_cache) if c[0] == what)
    plan = runtime.plan(spec, b.block_table, b.seq_lens, b.query_start_loc)
    with pytest.raises(ValueError, match=match):
        runtime.run(b.q, pair, plan)
    _, module = kernels[spec.canonical_text]
    assert module.launches == []
    if what not in ("strides", "inner"):  # the reference reads any strides
        with pytest.raises(ValueError, match=match):
            reference.paged_attention(spec, b.q, pair, *b.args()[2:])


def test_the_custom_op_refuses_a_pair_and_says_what_takes_it():
    from jitattn import ops

    spec = _spec("NHD", "bfloat16", 16)
    b = random_paged_batch(spec, Q_LENS, KV_LENS, seed=9)
    with pytest.raises(ValueError, match="custom op's schema takes one cache tensor.*jitattn.plan / run"):
        ops.paged_attention(spec, b.q, engine_kv(spec, b.kv_cache, "pair_views"), *b.args()[2:])


@pytest.mark.parametrize("layout", ["vllm_flash_attn", "separate_caches"])
def test_cascade_takes_a_pair(layout):
    """Through the reference (validate=True checks the levels' page ids against the pair's page count)."""
    from jitattn.cascade import cascade_attention
    from jitattn.testing import random_cascade_batch

    spec = _spec("NHD", "bfloat16", 16)
    batch = random_cascade_batch(spec, [21], [3], [5, 9, 2], [1, 3, 1], seed=2)
    kw = dict(use_cascade=True, validate=True, attention=reference.paged_attention, return_lse=True)
    want = cascade_attention(spec, batch.q, batch.kv_cache, batch.levels, **kw)
    got = cascade_attention(spec, batch.q, engine_kv(spec, batch.kv_cache, layout), batch.levels, **kw)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_a_tensor_subclass_is_one_cache_not_a_pair(kernels):  # noqa: F811
    spec = _spec("NHD", "bfloat16", 16)
    b = random_paged_batch(spec, Q_LENS, KV_LENS, seed=10)
    kv = torch.nn.Parameter(b.kv_cache, requires_grad=False)
    plan = runtime.plan(spec, b.block_table, b.seq_lens, b.query_start_loc)
    runtime.run(b.q, kv, plan)
    _, module = kernels[spec.canonical_text]
    f = module.launches[0]["fields"]
    assert f["kv_cache"] == kv.data_ptr() and f["kv_stride_kv"] == kv.stride(1) and f["num_pages"] == kv.shape[0]
