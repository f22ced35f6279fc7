"""plan / run on the GPU against the reference (``pytest -m gpu``; skipped without a CUDA device).

Outputs poisoned with NaN before each run (an unwritten element fails); tolerances as the kernel
tests (tests/conftest.py GPU_TOL). Covered: eager plans on mixed and split-KV batches run by several
layers; Gemma-2's sliding and full specs sharing one plan; graph-mode plans captured once in a CUDA
graph and replayed with new q / kv / metadata values of the same shapes (the split-KV and the mixed
path); the planned cascade with ``out=``.
"""

from __future__ import annotations

import pytest
import torch

import jitattn
from jitattn import AttentionSpec, reference
from jitattn.cascade import cascade_attention, plan_cascade
from jitattn.testing import random_cascade_batch, random_paged_batch, relative_error
from tests.conftest import GPU_TOL, precompile

pytestmark = pytest.mark.gpu

BASE = AttentionSpec(32, 8, 128)
FULL = AttentionSpec(16, 8, 256, logits_soft_cap=50.0, q_dtype="float16")  # Gemma-2's layers, hd 256
SLIDING = FULL.replace(window_left=4095)
SPECS = [BASE, FULL, SLIDING, BASE.replace(query_positions="explicit")]


@pytest.fixture(scope="module", autouse=True)
def compiled(session_cache_dir):
    precompile(SPECS, session_cache_dir)


def _layers(spec, batch, n, seed):
    """``n`` layers' q and cache: the batch's, then fresh random values of the same shapes."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = [(batch.q, batch.kv_cache)]
    for _ in range(n - 1):
        q = torch.randn(batch.q.shape, generator=g, device="cuda").to(batch.q.dtype)
        kv = torch.randn(batch.kv_cache.shape, generator=g, device="cuda").to(batch.kv_cache.dtype)
        out.append((q, kv))
    return out


@pytest.mark.parametrize("q_lens, kv_lens", [
    ([1, 7, 1, 33], [4000, 4000, 100, 600]),   # mixed, both kernels, split-KV decode
    ([1, 1], [20000, 9000]),                   # pure decode, split-KV: the decode kernel only
    ([64, 64] + [1] * 30, [256, 200] + [512] * 30),  # the bench's small mixed batch
])
def test_plan_run_matches_the_reference_over_several_layers(session_cache, q_lens, kv_lens):
    batch = random_paged_batch(BASE, q_lens, kv_lens, device="cuda", seed=3)
    plan = jitattn.plan(BASE, batch.block_table, batch.seq_lens, batch.query_start_loc,
                        num_pages=batch.kv_cache.shape[0])
    assert plan.prefill_rows == any(n > 1 for n in q_lens)
    out = torch.empty(batch.q.shape[0], 32, 128, dtype=batch.q.dtype, device="cuda")
    for q, kv in _layers(BASE, batch, 3, seed=4):
        out.fill_(float("nan"))
        got, lse = jitattn.run(q, kv, plan, out=out, return_lse=True)
        ref, ref_lse = reference.paged_attention(BASE, q, kv, batch.block_table, batch.seq_lens,
                                                 batch.query_start_loc, return_lse=True)
        assert got is out and not torch.isnan(out).any()
        assert relative_error(out, ref) < GPU_TOL[BASE.q_dtype]
        assert (lse - ref_lse).abs().max().item() < 2e-2


@pytest.mark.parametrize("one_call", [False, True], ids=["run", "one-call"])
def test_the_side_stream_waits_for_the_caller_and_joins_back(session_cache, one_call):
    """The mixed path's fork and join (runtime.StreamFork: two driver events, made once, recorded again per call):
    before each call the caller's stream is kept busy (a 256 MB fill), then q is rewritten and out poisoned on it,
    and the error is read on it after the call. A decode kernel started before the fork would read an earlier
    q, a caller's stream run ahead of the join would read rows not yet written (NaN)."""
    q_lens, kv_lens = [64, 64] + [1] * 30, [256, 200] + [512] * 30
    batch = random_paged_batch(BASE, q_lens, kv_lens, device="cuda", seed=11)
    qs = [torch.randn_like(batch.q) for _ in range(3)]
    refs = [reference.paged_attention(BASE, q, batch.kv_cache, batch.block_table, batch.seq_lens,
                                      batch.query_start_loc) for q in qs]
    plan = jitattn.plan(BASE, batch.block_table, batch.seq_lens, batch.query_start_loc, max_query_len=64)
    assert plan.decode_rows and plan.prefill_rows  # both kernels, so the decode runs on the side stream
    out = torch.empty_like(refs[0])
    busy = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    errors = []
    for trial in range(9):
        i = trial % 3
        busy.fill_(trial)
        batch.q.copy_(qs[i])
        out.fill_(float("nan"))
        if one_call:
            out.copy_(jitattn.paged_attention(BASE, *batch.args()))
        else:
            jitattn.run(batch.q, batch.kv_cache, plan, out=out)
        errors.append(relative_error(out, refs[i]))  # NaN (a row not written) fails the comparison below
    assert all(e < GPU_TOL[BASE.q_dtype] for e in errors), errors


def test_sliding_and_full_layers_share_one_plan(session_cache):
    batch = random_paged_batch(FULL, [1, 1, 5, 1], [9000, 100, 300, 5000], device="cuda", seed=5)
    plan = jitattn.plan([SLIDING, FULL], batch.block_table, batch.seq_lens, batch.query_start_loc)
    for spec in (SLIDING, FULL, SLIDING):
        got = jitattn.run(batch.q, batch.kv_cache, plan, spec=spec)
        ref = reference.paged_attention(spec, *batch.args())
        assert relative_error(got, ref) < GPU_TOL[spec.q_dtype], spec.describe()


@pytest.mark.parametrize("q_lens, kv_lens, max_query_len", [
    ([1, 1, 1], [20000, 9000, 300], 1),        # split-KV decode only
    ([1, 9, 1, 4], [4000, 3000, 100, 40], None),  # mixed: decode on a side stream beside the prefill
])
def test_a_graph_of_plan_runs_replays_with_new_values(session_cache, q_lens, kv_lens, max_query_len):
    """A graph-mode plan, its runs of two layers captured once, replayed with new q, new cache values and
    new metadata values (other sequence lengths and page ids, same shapes): the reference's answer."""
    batch = random_paged_batch(BASE, q_lens, kv_lens, device="cuda", seed=6)
    total_q = batch.q.shape[0]
    plan = jitattn.plan(BASE, batch.block_table, batch.seq_lens, batch.query_start_loc, total_q=total_q,
                        max_query_len=max_query_len, mode="graph")
    layers = _layers(BASE, batch, 2, seed=7)
    outs = [torch.empty(total_q, 32, 128, dtype=batch.q.dtype, device="cuda") for _ in layers]
    for (q, kv), out in zip(layers, outs):  # warm-up outside the capture
        jitattn.run(q, kv, plan, out=out)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for (q, kv), out in zip(layers, outs):
            jitattn.run(q, kv, plan, out=out)
    # new metadata values, same shapes: the sequences reversed, half their keys, other pages
    new_q = q_lens[::-1]
    batch.query_start_loc.copy_(torch.tensor([0, *torch.tensor(new_q).cumsum(0).tolist()], dtype=torch.int32))
    batch.seq_lens.copy_(torch.tensor([max(n // 2, ql) for n, ql in zip(kv_lens, new_q)], dtype=torch.int32))
    batch.block_table.copy_((batch.block_table + 1) % batch.kv_cache.shape[0])
    for (q, kv), out in zip(layers, outs):
        q.copy_(torch.randn_like(q.float()).to(q.dtype))
        kv.copy_(torch.randn_like(kv.float()).to(kv.dtype))
        out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for (q, kv), out in zip(layers, outs):
        ref = reference.paged_attention(BASE, q, kv, batch.block_table, batch.seq_lens, batch.query_start_loc)
        assert not torch.isnan(out).any() and relative_error(out, ref) < GPU_TOL[BASE.q_dtype]


def test_planned_cascade_runs_layers_into_out(session_cache):
    spec = AttentionSpec(32, 8, 128)
    b = random_cascade_batch(spec, [1000], [16], [100] * 16, [1] * 16, device="cuda", seed=9)
    plan = plan_cascade(spec, b.levels, b.q.shape[0], num_sms=torch.cuda.get_device_properties(0).multi_processor_count)
    out = torch.empty(b.q.shape[0], 32, 128, dtype=b.q.dtype, device="cuda")
    want = reference.paged_attention(spec, *b.plain.args())
    for _ in range(2):
        out.fill_(float("nan"))
        assert cascade_attention(spec, b.q, b.kv_cache, b.levels, plan=plan, out=out) is out
        assert relative_error(out, want) < GPU_TOL[spec.q_dtype]
    assert plan.attention_plan is not None
