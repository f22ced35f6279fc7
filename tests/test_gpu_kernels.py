"""Kernels against the reference on the GPU (``pytest -m gpu``; skipped without a CUDA device).

Fresh random inputs per case (the ``seed`` fixture: random per run, recorded), outputs poisoned with NaN
before each launch (so an unwritten element fails), tolerance against the fp32 reference: bf16 1e-2,
fp16 5e-3 relative (norm-wise), NaN never passes. Where a test expects NaN rows the output holds a
finite sentinel (``NOT_WRITTEN``) instead, so a row the kernel skips cannot pass. Outcomes go to
GPU_TESTS.md through the ``record`` fixture when JITATTN_GPU_RESULTS is set.
"""

from __future__ import annotations

import pytest
import torch

from jitattn import reference
from jitattn.runtime import MIXED_ON_TWO_STREAMS, load_kernel
from jitattn.testing import random_paged_batch, relative_error
from tests.conftest import GPU_TOL, NOT_WRITTEN, precompile, replay_on_new_q
from tests.gpu_cases import all_cases

pytestmark = pytest.mark.gpu
CASES = all_cases()
TOL = GPU_TOL


@pytest.fixture(scope="module", autouse=True)
def compiled(session_cache_dir):
    """Compile every spec of the matrix up front, in parallel."""
    precompile([c.spec for c in CASES], session_cache_dir)


def _check(case, out, lse, ref_out, ref_lse, record):
    err = relative_error(out, ref_out)
    finite = torch.isfinite(ref_lse)
    lse_err = (lse[finite] - ref_lse[finite]).abs().max().item() if finite.any() else 0.0
    record(rel_err=err, lse_max_abs_err=lse_err)
    assert not torch.isnan(out).any(), f"{case.name}: NaN in output"
    assert err < TOL[case.spec.q_dtype], f"{case.name}: relative error {err:.3e}"
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), f"{case.name}: -inf lse rows differ"
    assert lse_err < 2e-2, f"{case.name}: lse error {lse_err:.3e}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_kernel_matches_reference(case, session_cache, record, seed):
    device = "cuda"
    batch = random_paged_batch(case.spec, case.q_lens, case.kv_lens, device=device, seed=seed,
                               params=case.params(device))
    kernel = load_kernel(case.spec)
    out = torch.full((sum(case.q_lens), case.spec.num_qo_heads, case.spec.head_dim_vo), float("nan"),
                     dtype=batch.q.dtype, device=device)
    softmax = case.spec.variant is None or case.spec.variant.softmax  # a variant without softmax has no lse
    got = kernel.paged_attention(*batch.args(), **batch.kwargs(), out=out, return_lse=softmax, validate=True)
    torch.cuda.synchronize()
    want = reference.paged_attention(case.spec, *batch.args(), **batch.kwargs(), return_lse=softmax)
    record(arch=kernel.entry.arch,
           splits=kernel.num_splits(len(case.q_lens), kernel.max_decode_keys(batch.block_table.shape[1])))
    if softmax:
        _check(case, got[0], got[1], want[0], want[1], record)
    else:
        err = relative_error(got, want)
        record(rel_err=err)
        assert not torch.isnan(got).any() and err < TOL[case.spec.q_dtype], f"{case.name}: relative error {err:.3e}"


def test_empty_rows_are_zero_with_neg_inf_lse(session_cache, seed):
    case = next(c for c in CASES if c.name == "empty-rows-hidden-head")
    batch = random_paged_batch(case.spec, case.q_lens, case.kv_lens, device="cuda", params=case.params("cuda"),
                               seed=seed)
    out = torch.full((batch.q.shape[0], case.spec.num_qo_heads, case.spec.head_dim_vo), float("nan"),
                     dtype=batch.q.dtype, device="cuda")
    out, lse = load_kernel(case.spec).paged_attention(*batch.args(), **batch.kwargs(), out=out, return_lse=True)
    assert torch.all(out[:, 3] == 0) and torch.all(torch.isneginf(lse[:, 3]))
    assert torch.all(torch.isfinite(lse[:, :3]))


def test_invalid_metadata_gives_nan_rows_not_a_crash(session_cache, seed):
    case = next(c for c in CASES if c.name == "odd-lengths")
    batch = random_paged_batch(case.spec, case.q_lens, case.kv_lens, device="cuda", seed=seed)
    seq_lens = batch.seq_lens.clone()
    seq_lens[1] = batch.block_table.shape[1] * case.spec.page_size + 1  # longer than its page table row
    table = batch.block_table.clone()
    table[4, 0] = batch.kv_cache.shape[0] + 5  # a page id outside the cache
    out = torch.full_like(batch.q, NOT_WRITTEN)  # not NaN: a skipped row must not pass for a NaN row
    got = load_kernel(case.spec).paged_attention(batch.q, batch.kv_cache, table, seq_lens, batch.query_start_loc,
                                                 out=out)
    torch.cuda.synchronize()
    assert got.data_ptr() == out.data_ptr()
    rows = batch.query_start_loc.tolist()
    assert torch.isnan(out[rows[1]:rows[2]]).all() and torch.isnan(out[rows[4]:rows[5]]).all()
    good = torch.ones(out.shape[0], dtype=torch.bool, device="cuda")
    good[rows[1]:rows[2]] = False
    good[rows[4]:rows[5]] = False
    ref = reference.paged_attention(case.spec, *batch.args())
    assert not (out[good] == NOT_WRITTEN).any(), "a valid row was not written"
    assert relative_error(out[good], ref[good]) < 1e-2


def test_decode_replays_in_cuda_graph(session_cache, seed):
    case = next(c for c in CASES if c.name == "decode-b3-splitkv")
    batch = random_paged_batch(case.spec, case.q_lens, case.kv_lens, device="cuda", seed=seed)
    kernel = load_kernel(case.spec)
    out = torch.empty_like(batch.q)
    kernel.paged_attention(*batch.args(), out=out, max_query_len=1)  # warm-up outside capture
    replay_on_new_q(lambda: kernel.paged_attention(*batch.args(), out=out, max_query_len=1), batch.q, out, seed)
    ref = reference.paged_attention(case.spec, *batch.args())
    assert relative_error(out, ref) < 1e-2


def test_mixed_batch_decode_on_a_side_stream(session_cache, seed):
    """A batch with prefill and decode rows runs its decode kernel on a side stream beside the prefill
    kernel (fork / join): the same bits as both on one stream, and a CUDA graph captures both branches."""
    case = next(c for c in CASES if c.name == "odd-lengths")
    batch = random_paged_batch(case.spec, case.q_lens, case.kv_lens, device="cuda", seed=seed)
    kernel = load_kernel(case.spec)
    assert kernel.num_splits(len(case.q_lens), kernel.max_decode_keys(batch.block_table.shape[1])) > 1
    results = {}
    try:
        for two in (False, True):
            kernel.mixed_on_two_streams = two
            results[two] = kernel.paged_attention(*batch.args(), return_lse=True)
        torch.cuda.synchronize()
        assert torch.equal(results[False][0], results[True][0]) and torch.equal(results[False][1], results[True][1])
        out = torch.empty_like(results[True][0])
        replay_on_new_q(lambda: kernel.paged_attention(*batch.args(), out=out), batch.q, out, seed)
    finally:
        kernel.mixed_on_two_streams = MIXED_ON_TWO_STREAMS
    ref = reference.paged_attention(case.spec, *batch.args())
    assert not torch.isnan(out).any() and relative_error(out, ref) < TOL[case.spec.q_dtype]


def test_kernel_refuses_bad_call_arguments_before_launch(session_cache, seed):
    """k_scale on a 16-bit cache, a misspelled keyword and a broken max_query_len promise (validate=True)
    are errors at the call, nothing launched."""
    from jitattn import AttentionSpec

    spec = AttentionSpec(32, 8, 128)
    batch = random_paged_batch(spec, [1, 3], [40, 17], device="cuda", seed=seed)
    kernel = load_kernel(spec)
    out = torch.full((4, 32, 128), float("nan"), dtype=batch.q.dtype, device="cuda")
    with pytest.raises(ValueError, match=r"k_scale=2.0: only an FP8 cache .* must be 1.0"):
        kernel.paged_attention(*batch.args(), out=out, k_scale=2.0)
    with pytest.raises(TypeError, match="sink"):
        kernel.paged_attention(*batch.args(), out=out, sink=None)
    with pytest.raises(ValueError, match=r"max_query_len=1: a sequence brings 3 queries"):
        kernel.paged_attention(*batch.args(), out=out, max_query_len=1, validate=True)
    torch.cuda.synchronize()
    assert torch.isnan(out).all()  # nothing was written
