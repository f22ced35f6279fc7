"""jitattn.checks on CPU tensors: each bad input raises ValueError naming the tensor, the dimension,
what was expected and what was given, before anything is launched."""

from __future__ import annotations

import pytest
import torch

from jitattn import AttentionSpec, Param, Variant
from jitattn.checks import PagedCall, check_metadata_values, check_paged_call, kv_cache_shape
from jitattn.testing import random_paged_batch

VARIANT = Variant("v", logits_transform="logits + bias[qo_head] * scale_", logits_mask="doc[kv_idx] >= 0",
                  params=(Param("bias", "float32", ("num_qo_heads",)), Param("scale_", "float32"),
                          Param("doc", "int32", ("*",)), Param("per_seq", "float32", ("batch", 2)),
                          Param("n", "int32")))


def good_params():
    return {"bias": torch.zeros(8), "scale_": 0.5, "doc": torch.zeros(50, dtype=torch.int32),
            "per_seq": torch.zeros(3, 2), "n": 3}


def make(layout="NHD", **kw):
    spec = AttentionSpec(8, 2, 64, kv_layout=layout, page_size=16, **kw)
    return random_paged_batch(spec, [1, 4, 2], [10, 40, 2], params=good_params() if kw.get("variant") else None)


def call(batch, **changes):
    args = dict(q=batch.q, kv_cache=batch.kv_cache, block_table=batch.block_table, seq_lens=batch.seq_lens,
                query_start_loc=batch.query_start_loc, sinks=batch.sinks, alibi_slopes=batch.alibi_slopes,
                params=batch.params)
    args.update(changes)
    spec = args.pop("spec", batch.spec)
    return check_paged_call(spec, **args)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_good_call_passes_and_reports_sizes(layout):
    batch = make(layout)
    assert call(batch) == PagedCall(batch=3, total_q=7, num_pages=batch.kv_cache.shape[0],
                                    max_pages_per_seq=batch.block_table.shape[1])
    assert tuple(batch.kv_cache.shape[1:]) == kv_cache_shape(batch.spec, 1)[1:]


@pytest.mark.parametrize("change,match", [
    (lambda b: dict(q=b.q.float()), r"q: expected dtype torch.bfloat16, got torch.float32"),
    (lambda b: dict(q=b.q[:, 0]), r"q: expected 3 dims, got shape \(7, 64\)"),
    (lambda b: dict(q=b.q[:, :6]), r"q: dim 1 \(num_qo_heads\) must be 8, got 6"),
    (lambda b: dict(q=b.q[:, :, :32]), r"q: dim 2 \(head_dim_qk\) must be 64, got 32"),
    (lambda b: dict(q=[1, 2]), r"q: expected a torch.Tensor, got list"),
    (lambda b: dict(kv_cache=b.kv_cache.half()), r"kv_cache: expected dtype torch.bfloat16, got torch.float16"),
    (lambda b: dict(kv_cache=b.kv_cache[:, 0]), r"kv_cache: expected 5 dims, got shape"),
    (lambda b: dict(kv_cache=b.kv_cache[:, :, :8]), r"kv_cache: dim 2 \(page_size\) must be 16 for NHD layout"),
    (lambda b: dict(kv_cache=b.kv_cache[:, :, :, :1]), r"kv_cache: dim 3 \(num_kv_heads\) must be 2 for NHD"),
    (lambda b: dict(kv_cache=b.kv_cache[:, :1]), r"kv_cache: dim 1 \(K/V\) must be 2"),
    (lambda b: dict(kv_cache=b.kv_cache.to("meta")), r"kv_cache: expected device cpu \(the device of q\), got meta"),
    (lambda b: dict(query_start_loc=b.query_start_loc.long()), r"query_start_loc: expected dtype torch.int32, got torch.int64"),
    (lambda b: dict(query_start_loc=b.query_start_loc[:1]), r"query_start_loc: expected shape \(batch \+ 1,\) with batch >= 1"),
    (lambda b: dict(seq_lens=b.seq_lens[:2]), r"seq_lens: dim 0 \(batch, from query_start_loc\) must be 3, got 2"),
    (lambda b: dict(seq_lens=b.seq_lens.long()), r"seq_lens: expected dtype torch.int32"),
    (lambda b: dict(block_table=b.block_table[:2]), r"block_table: dim 0 \(batch, from query_start_loc\) must be 3"),
    (lambda b: dict(block_table=b.block_table.long()), r"block_table: expected dtype torch.int32"),
    (lambda b: dict(block_table=b.block_table[0]), r"block_table: expected 2 dims"),
])
def test_bad_tensor_names_tensor_and_dimension(change, match):
    batch = make()
    with pytest.raises(ValueError, match=match):
        call(batch, **change(batch))


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("head_dim", [32, 128])
def test_kv_cache_of_another_head_dim_is_refused(layout, head_dim):
    """A cache of head dim 32 or 128 for a head-dim-64 spec: refused at the call, naming dim 4; the
    reference would otherwise read it as rows of 64 (128: twice the tokens, every value misplaced)."""
    from jitattn import reference

    batch = make(layout)
    shape = list(batch.kv_cache.shape)
    shape[4] = head_dim
    other = torch.randn(shape).to(batch.kv_cache.dtype)
    match = rf"kv_cache: dim 4 \(head_dim\) must be 64 for {layout} layout"
    with pytest.raises(ValueError, match=match):
        call(batch, kv_cache=other)
    with pytest.raises(ValueError, match=match):
        reference.paged_attention(batch.spec, batch.q, other, batch.block_table, batch.seq_lens, batch.query_start_loc)


def test_hnd_cache_given_to_an_nhd_spec_names_the_layout():
    hnd = make("HND")
    nhd_spec = hnd.spec.replace(kv_layout="NHD")
    with pytest.raises(ValueError, match=r"kv_cache: dim 2 \(page_size\) must be 16 for NHD layout"):
        call(hnd, spec=nhd_spec)
    with pytest.raises(ValueError, match=r"kv_cache: dim 2 \(num_kv_heads\) must be 2 for HND layout"):
        call(make("NHD"), spec=hnd.spec)


def test_sinks():
    batch = make(sinks=True)
    with pytest.raises(ValueError, match=r"sinks: spec.sinks=True, so a float32 \(8,\) tensor is required"):
        call(batch, sinks=None)
    with pytest.raises(ValueError, match=r"sinks: expected dtype torch.float32, got torch.bfloat16"):
        call(batch, sinks=batch.sinks.bfloat16())
    with pytest.raises(ValueError, match=r"sinks: dim 0 \(num_qo_heads\) must be 8, got 4"):
        call(batch, sinks=batch.sinks[:4])
    with pytest.raises(ValueError, match=r"sinks: must be contiguous"):
        call(batch, sinks=torch.zeros(16)[::2])
    with pytest.raises(ValueError, match=r"sinks: given, but spec.sinks=False; build the spec with sinks=True"):
        call(make(), sinks=torch.zeros(8))


def test_alibi_slopes_optional_but_checked():
    batch = make(alibi=True)
    call(batch, alibi_slopes=None)  # the standard slopes are used
    call(batch, alibi_slopes=torch.ones(8))
    with pytest.raises(ValueError, match=r"alibi_slopes: dim 0 \(num_qo_heads\) must be 8, got 2"):
        call(batch, alibi_slopes=torch.ones(2))
    with pytest.raises(ValueError, match=r"alibi_slopes: given, but spec.alibi=False"):
        call(make(), alibi_slopes=torch.ones(8))


@pytest.mark.parametrize("change,match", [
    (dict(extra=torch.zeros(1)), r"params: unknown names \['extra'\]; the variant declares \['bias', 'doc', 'n', "),
    (dict(bias=None), r"params\['bias'\]: missing; the variant declares it as float32 shape \('num_qo_heads',\)"),
    (dict(bias=torch.zeros(8, dtype=torch.float64)), r"params\['bias'\]: expected dtype torch.float32, got torch.float64"),
    (dict(bias=torch.zeros(7)), r"params\['bias'\]: dim 0 \(num_qo_heads\) must be 8, got shape \(7,\)"),
    (dict(bias=torch.zeros(8, 1)), r"params\['bias'\]: expected 1 dims, got shape \(8, 1\)"),
    (dict(per_seq=torch.zeros(2, 2)), r"params\['per_seq'\]: dim 0 \(batch\) must be 3"),
    (dict(per_seq=torch.zeros(3, 3)), r"params\['per_seq'\]: dim 1 \(2\) must be 2"),
    (dict(per_seq=torch.zeros(2, 3).T), r"params\['per_seq'\]: must be contiguous"),
    (dict(scale_=torch.tensor(0.5)), r"params\['scale_'\]: expected a Python float scalar \(float32\), got tensor"),
    (dict(scale_=True), r"params\['scale_'\]: expected a Python float scalar"),
    (dict(n=3.0), r"params\['n'\]: expected a Python int in \[-2\*\*31, 2\*\*31\) scalar \(int32\), got 3.0"),
    (dict(n=2 ** 31), r"params\['n'\]: expected a Python int in \[-2\*\*31, 2\*\*31\) scalar \(int32\), got 2147483648"),
    (dict(scale_=1e40), r"params\['scale_'\]: 1e\+40 is outside float32's range"),
    (dict(scale_=-(10 ** 400)), r"params\['scale_'\]: -1000.* is outside float32's range"),
])
def test_variant_params(change, match):
    batch = make(variant=VARIANT)
    params = {**batch.params, **change}
    params = {k: v for k, v in params.items() if v is not None}
    with pytest.raises(ValueError, match=match):
        call(batch, params=params)


def test_variant_params_good_and_any_size_dim():
    batch = make(variant=VARIANT)
    call(batch)
    call(batch, params={**batch.params, "doc": torch.zeros(7, dtype=torch.int32), "scale_": 2})  # "*" and int->float
    with pytest.raises(ValueError, match=r"params: unknown names \['bias'\]; the variant declares none"):
        call(make(), params={"bias": torch.zeros(8)})


def test_out_tensor():
    batch = make()
    good = torch.empty(7, 8, 64, dtype=torch.bfloat16)
    check_paged_call(batch.spec, *batch.args(), out=good)
    with pytest.raises(ValueError, match=r"out: expected a contiguous \(7, 8, 64\) tensor, got shape \(7, 8, 32\)"):
        check_paged_call(batch.spec, *batch.args(), out=good[..., :32])
    with pytest.raises(ValueError, match=r"out: expected dtype torch.bfloat16, got torch.float32"):
        check_paged_call(batch.spec, *batch.args(), out=good.float())


def test_kernel_checks_require_cuda():
    batch = make()
    with pytest.raises(ValueError, match=r"q: the jit backend runs on CUDA devices, got cpu; use the reference"):
        check_paged_call(batch.spec, *batch.args(), for_kernel=True)


# ---- metadata values ---------------------------------------------------------------------------
def meta(batch, *, seq_lens=None, qsl=None, table=None):
    return check_metadata_values(batch.spec, batch.seq_lens if seq_lens is None else torch.tensor(seq_lens, dtype=torch.int32),
                                 batch.query_start_loc if qsl is None else torch.tensor(qsl, dtype=torch.int32),
                                 batch.block_table if table is None else table, batch.kv_cache.shape[0],
                                 batch.q.shape[0])


def test_metadata_values():
    batch = make()
    meta(batch)
    with pytest.raises(ValueError, match=r"query_start_loc: must start at 0 and end at total_q=7, got 1 \.\.\. 7"):
        meta(batch, qsl=[1, 2, 5, 7])
    with pytest.raises(ValueError, match=r"query_start_loc: decreases at sequence 1 \(5 -> 4\)"):
        meta(batch, qsl=[0, 5, 4, 7])
    with pytest.raises(ValueError, match=r"seq_lens\[1\]=3 but the sequence brings 4 queries"):
        meta(batch, seq_lens=[10, 3, 2])
    cap = batch.block_table.shape[1] * 16
    with pytest.raises(ValueError, match=rf"seq_lens\[0\]={cap + 1} exceeds block_table capacity"):
        meta(batch, seq_lens=[cap + 1, 40, 2])
    bad = batch.block_table.clone()
    bad[2, 0] = batch.kv_cache.shape[0]
    with pytest.raises(ValueError, match=rf"block_table\[2\]: page ids must be in \[0, {batch.kv_cache.shape[0]}\)"):
        meta(batch, table=bad)
