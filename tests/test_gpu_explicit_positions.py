"""Explicit query positions on the GPU (``pytest -m gpu``; skipped without a CUDA device): the prefill
kernels (prefill_sm90.cuh for 16-bit specs on sm_90a, prefill.cuh for FP8 caches and sm_80) against
jitattn.reference.paged_attention with the same query_positions / functor_batch / position_offset.

Conventions of tests/test_gpu_kernels.py: fresh random inputs (the ``seed`` fixture: random per run,
recorded), outputs poisoned with NaN before each launch (a finite sentinel where NaN rows are expected),
tolerance against the fp32 reference by query dtype, NaN never passes, rows with lse -inf (no visible
key) must be the reference's and output 0. Outcomes go to the GPU results file through the ``record``
fixture when JITATTN_GPU_RESULTS is set. Cases: tests/explicit_position_cases.py.
"""

from __future__ import annotations

import pytest
import torch

from jitattn import AttentionSpec, reference
from jitattn.runtime import load_kernel
from jitattn.testing import random_paged_batch, relative_error
from tests.conftest import GPU_TOL, NOT_WRITTEN, precompile
from tests.explicit_position_cases import explicit_cases

pytestmark = pytest.mark.gpu
CASES = explicit_cases()
IMPLICIT_TWIN = AttentionSpec(32, 8, 128)


@pytest.fixture(scope="module", autouse=True)
def compiled(session_cache_dir):
    """Compile every spec up front, in parallel."""
    precompile([c.spec for c in CASES] + [IMPLICIT_TWIN, IMPLICIT_TWIN.replace(query_positions="explicit")],
               session_cache_dir)


def _run(case, seed):
    device = "cuda"
    batch = random_paged_batch(case.spec, case.q_lens, case.kv_lens, device=device, seed=seed,
                               params=case.params(device))
    qp, fb, po = case.metadata(seed, device)
    pos_kw = {"query_positions": qp, "functor_batch": fb, "position_offset": po}
    kernel = load_kernel(case.spec)
    out = torch.full((sum(case.q_lens), case.spec.num_qo_heads, case.spec.head_dim_vo), float("nan"),
                     dtype=batch.q.dtype, device=device)
    got, lse = kernel.paged_attention(*batch.args(), **batch.kwargs(), out=out, return_lse=True, validate=True,
                                      **pos_kw)
    torch.cuda.synchronize()
    want, want_lse = reference.paged_attention(case.spec, *batch.args(), **batch.kwargs(), return_lse=True, **pos_kw)
    return kernel, batch, pos_kw, got, lse, want, want_lse


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_explicit_positions_match_reference(case, session_cache, record, seed):
    kernel, _, _, got, lse, want, want_lse = _run(case, seed)
    err = relative_error(got, want)
    finite = torch.isfinite(want_lse)
    lse_err = (lse[finite] - want_lse[finite]).abs().max().item() if finite.any() else 0.0
    empty = torch.isneginf(want_lse)
    record(arch=kernel.entry.arch, rel_err=err, lse_max_abs_err=lse_err, empty_rows=int(empty.sum()))
    assert not torch.isnan(got).any(), f"{case.name}: NaN in output"
    assert err < GPU_TOL[case.spec.q_dtype], f"{case.name}: relative error {err:.3e}"
    assert torch.equal(torch.isneginf(lse), empty), f"{case.name}: -inf lse rows differ"
    assert lse_err < 2e-2, f"{case.name}: lse error {lse_err:.3e}"
    if case.spec.variant is None or case.spec.variant.output_transform is None:
        assert torch.all(got[empty] == 0), f"{case.name}: a row that sees no key is not 0"


def test_implicit_positions_given_explicitly_match_the_implicit_kernel(session_cache, record, seed):
    """Positions kv_len - qo_len + i, the sequence index as hook batch and offset 0: the explicit spec's
    kernel gives the implicit spec's answer (every sequence brings > 1 query, so both run the prefill kernel)."""
    q_lens, kv_lens = [70, 5, 300, 33], [1000, 9, 2000, 700]
    batch = random_paged_batch(IMPLICIT_TWIN, q_lens, kv_lens, device="cuda", seed=seed)
    pos = [p for ql, kl in zip(q_lens, kv_lens) for p in range(kl - ql, kl)]
    hb = [b for b, ql in enumerate(q_lens) for _ in range(ql)]
    as_int = lambda x: torch.tensor(x, dtype=torch.int32, device="cuda")  # noqa: E731
    want, want_lse = load_kernel(IMPLICIT_TWIN).paged_attention(*batch.args(), return_lse=True)
    got, got_lse = load_kernel(IMPLICIT_TWIN.replace(query_positions="explicit")).paged_attention(
        *batch.args(), return_lse=True, query_positions=as_int(pos), functor_batch=as_int(hb),
        position_offset=as_int([0] * len(q_lens)))
    torch.cuda.synchronize()
    record(bitwise_equal=bool(torch.equal(got, want) and torch.equal(got_lse, want_lse)),
           rel_err=relative_error(got, want))
    assert relative_error(got, want) < 1e-3
    assert (got_lse - want_lse).abs().max().item() < 1e-3


def test_invalid_metadata_gives_nan_rows(session_cache, seed):
    """A sequence whose seq_len exceeds its block_table row writes NaN; the others stay right."""
    case = next(c for c in CASES if c.name == "causal-hd128")
    batch = random_paged_batch(case.spec, case.q_lens, case.kv_lens, device="cuda", seed=seed)
    qp, fb, po = case.metadata(seed, "cuda")
    seq_lens = batch.seq_lens.clone()
    seq_lens[2] = batch.block_table.shape[1] * case.spec.page_size + 1
    kw = {"query_positions": qp, "functor_batch": fb, "position_offset": po}
    out = torch.full((batch.q.shape[0], case.spec.num_qo_heads, case.spec.head_dim_vo), NOT_WRITTEN,
                     dtype=batch.q.dtype, device="cuda")  # not NaN: a skipped row must not pass for a NaN row
    load_kernel(case.spec).paged_attention(batch.q, batch.kv_cache, batch.block_table, seq_lens,
                                           batch.query_start_loc, out=out, **kw)
    torch.cuda.synchronize()
    rows = batch.query_start_loc.tolist()
    assert torch.isnan(out[rows[2]:rows[3]]).all()
    good = torch.ones(out.shape[0], dtype=torch.bool, device="cuda")
    good[rows[2]:rows[3]] = False
    assert not torch.isnan(out[good]).any() and not (out[good] == NOT_WRITTEN).any()
    ref = reference.paged_attention(case.spec, *batch.args(), **kw)
    assert relative_error(out[good], ref[good]) < GPU_TOL[case.spec.q_dtype]


def test_cascade_prefix_pass_time(session_cache, record, seed):
    """The shared-prefix pass (64 decode tokens x group 4 = 256 rows against 8192 keys, every query after
    every key) beside the implicit spec's prefill over the same rows and keys: both right, and the
    explicit pass within twice the implicit one's time (recorded runs: 0.65 to 1.1 times)."""
    espec = IMPLICIT_TWIN.replace(query_positions="explicit")
    eb = random_paged_batch(espec, [64], [8192], device="cuda", seed=seed)
    ib = random_paged_batch(IMPLICIT_TWIN, [64], [8256], device="cuda", seed=seed + 1)
    as_int = lambda x: torch.tensor(x, dtype=torch.int32, device="cuda")  # noqa: E731
    kw = {"query_positions": as_int([8192] * 64), "functor_batch": as_int([0] * 64), "position_offset": as_int([0])}
    ek, ik = load_kernel(espec), load_kernel(IMPLICIT_TWIN)

    def time_ms(fn, n=50):
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / n

    explicit_ms = time_ms(lambda: ek.paged_attention(*eb.args(), **kw))
    implicit_ms = time_ms(lambda: ik.paged_attention(*ib.args()))
    record(explicit_ms=round(explicit_ms, 4), implicit_8256keys_ms=round(implicit_ms, 4))
    tol = GPU_TOL[IMPLICIT_TWIN.q_dtype]
    explicit_out = ek.paged_attention(*eb.args(), **kw)
    assert relative_error(explicit_out, reference.paged_attention(espec, *eb.args(), **kw)) < tol
    assert relative_error(ik.paged_attention(*ib.args()), reference.paged_attention(IMPLICIT_TWIN, *ib.args())) < tol
    assert explicit_ms < 2.0 * implicit_ms, f"explicit {explicit_ms:.4f} ms vs implicit {implicit_ms:.4f} ms"
