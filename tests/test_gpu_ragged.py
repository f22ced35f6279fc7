"""Ragged (contiguous varlen) K/V kernels against the reference on the GPU (``pytest -m gpu``).

Every spec of :func:`tests.gpu_cases.ragged_cases` is compiled up front in one parallel step; each case
then runs on fresh random inputs (the ``seed`` fixture: random per run, recorded) with the output
poisoned with NaN before the launch (an unwritten element fails; where NaN rows are expected, a finite
sentinel instead), against :func:`jitattn.reference.ragged_attention` in fp32 on the same device:
bf16 1e-2, fp16 5e-3 relative error (norm-wise), lse within 2e-2 absolute, the same ``-inf`` rows,
never NaN. Cases cover lengths 1/17/127/1000/8191, query chunks shorter than their prefix,
head_dim_qk != head_dim_vo (192/128, 256/64, 32/256), GQA groups 1/4/8, soft-cap, windows, ALiBi,
sinks, custom functors (transform, mask, q/k transforms, output transform, softmax-free), strided
q/k/v views, rows that see no key, zero-query sequences.
"""

from __future__ import annotations

import pytest
import torch

from jitattn import reference
from jitattn.runtime import load_kernel
from jitattn.testing import random_ragged_batch, relative_error
from tests.conftest import GPU_TOL, NOT_WRITTEN, precompile, replay_on_new_q
from tests.gpu_cases import ragged_cases

pytestmark = pytest.mark.gpu
CASES = ragged_cases()


@pytest.fixture(scope="module", autouse=True)
def compiled(session_cache_dir):
    """Compile every ragged spec up front, in parallel."""
    precompile([c.spec for c in CASES], session_cache_dir)


def _batch(case, seed, device="cuda"):
    return random_ragged_batch(case.spec, case.q_lens, case.kv_lens, device=device, strided=case.strided,
                               seed=seed, params=case.params(device))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_ragged_kernel_matches_reference(case, session_cache, record, seed):
    batch = _batch(case, seed)
    kernel = load_kernel(case.spec)
    out = torch.full((sum(case.q_lens), case.spec.num_qo_heads, case.spec.head_dim_vo), float("nan"),
                     dtype=batch.q.dtype, device="cuda")
    softmax = case.spec.variant is None or case.spec.variant.softmax
    got = kernel.ragged_attention(*batch.args(), **batch.kwargs(), out=out, return_lse=softmax, validate=True)
    torch.cuda.synchronize()
    want = reference.ragged_attention(case.spec, *batch.args(), **batch.kwargs(), return_lse=softmax)
    record(arch=kernel.entry.arch)
    tol = GPU_TOL[case.spec.q_dtype]
    if not softmax:
        err = relative_error(got, want)
        record(rel_err=err)
        assert not torch.isnan(got).any() and err < tol, f"{case.name}: relative error {err:.3e}"
        return
    (o, lse), (ref_o, ref_lse) = got, want
    err = relative_error(o, ref_o)
    finite = torch.isfinite(ref_lse)
    lse_err = (lse[finite] - ref_lse[finite]).abs().max().item() if finite.any() else 0.0
    record(rel_err=err, lse_max_abs_err=lse_err)
    assert not torch.isnan(o).any(), f"{case.name}: NaN in output"
    assert err < tol, f"{case.name}: relative error {err:.3e}"
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), f"{case.name}: -inf lse rows differ"
    assert lse_err < 2e-2, f"{case.name}: lse error {lse_err:.3e}"


def test_ragged_equals_paged_kernel_on_the_same_data(session_cache, seed):
    """The same batch packed both ways: the ragged kernel and the paged kernels agree (decode rows included)."""
    case = next(c for c in CASES if c.name == "ragged-hd128-gqa4-chunk-after-prefix")
    batch = _batch(case, seed)
    paged = batch.to_paged(page_size=16, seed=seed)
    ragged_out = load_kernel(case.spec).ragged_attention(*batch.args())
    paged_out = load_kernel(paged.spec).paged_attention(*paged.args())
    torch.cuda.synchronize()
    assert not torch.isnan(ragged_out).any(), "NaN in the ragged kernel's output"
    assert not torch.isnan(paged_out).any(), "NaN in the paged kernel's output"
    assert relative_error(ragged_out, paged_out) < 1e-2


def test_ragged_empty_rows_are_zero_with_neg_inf_lse(session_cache, seed):
    case = next(c for c in CASES if c.name == "ragged-hidden-head-empty-rows")
    batch = _batch(case, seed)
    out = torch.full((batch.q.shape[0], case.spec.num_qo_heads, case.spec.head_dim_vo), float("nan"),
                     dtype=batch.q.dtype, device="cuda")
    out, lse = load_kernel(case.spec).ragged_attention(*batch.args(), **batch.kwargs(), out=out, return_lse=True)
    assert torch.all(out[:, 3] == 0) and torch.all(torch.isneginf(lse[:, 3]))
    assert torch.all(torch.isfinite(lse[:, :3]))


def test_ragged_invalid_start_locations_give_nan_rows_not_a_crash(session_cache, seed):
    case = next(c for c in CASES if c.name == "ragged-hd128-gqa4-chunk-after-prefix")
    batch = _batch(case, seed)
    ksl = batch.kv_start_loc.clone()
    ksl[2] = ksl[1] + 3  # sequence 1 now has fewer keys (3) than queries (17); sequence 2 starts early
    ksl_bad = ksl.clone()
    ksl_bad[-1] = batch.k.shape[0] + 100  # the last sequence runs past the end of k / v
    out = torch.full((batch.q.shape[0], case.spec.num_qo_heads, case.spec.head_dim_vo), NOT_WRITTEN,
                     dtype=batch.q.dtype, device="cuda")  # not NaN: a skipped row must not pass for a NaN row
    load_kernel(case.spec).ragged_attention(batch.q, batch.k, batch.v, batch.query_start_loc, ksl_bad, out=out)
    torch.cuda.synchronize()
    rows = batch.query_start_loc.tolist()
    assert torch.isnan(out[rows[1]:rows[2]]).all() and torch.isnan(out[rows[4]:rows[5]]).all()
    good = [0, 2, 3]
    for b in good:  # the other sequences are served from their (shifted) keys as the reference reads them
        q0, q1 = rows[b], rows[b + 1]
        k0, k1 = ksl[b].item(), ksl[b + 1].item()
        sub_q = batch.q[q0:q1]
        want = reference.ragged_attention(
            case.spec, sub_q, batch.k[k0:k1], batch.v[k0:k1],
            torch.tensor([0, q1 - q0], dtype=torch.int32, device="cuda"),
            torch.tensor([0, k1 - k0], dtype=torch.int32, device="cuda"))
        assert relative_error(out[q0:q1], want) < 1e-2, b


def test_ragged_replays_in_cuda_graph(session_cache, seed):
    case = next(c for c in CASES if c.name == "ragged-192x128-gqa8-chunks")
    batch = _batch(case, seed)
    kernel = load_kernel(case.spec)
    out = torch.empty(batch.q.shape[0], case.spec.num_qo_heads, case.spec.head_dim_vo, dtype=batch.q.dtype,
                      device="cuda")
    kernel.ragged_attention(*batch.args(), out=out)  # warm-up outside capture
    replay_on_new_q(lambda: kernel.ragged_attention(*batch.args(), out=out), batch.q, out, seed)
    assert relative_error(out, reference.ragged_attention(case.spec, *batch.args())) < 1e-2
