"""The ready-made variants on the kernels against their independent oracles (``pytest -m gpu``).

The kernels run the variants' traced functions, the reference runs the same functions on torch, so
tests/test_gpu_kernels.py cannot see a bug in a variant's definition. Here each ready-made variant
(document / prefix-LM masks, T5 bias, sigmoid attention, RoPE) runs through the kernels (decode rows,
a long split-KV decode, prefill chunks after a prefix, a full prefill) and is compared with the oracle
written from the variant's definition (tests/oracles.py), in float64 on the CPU.

Conventions of tests/test_gpu_kernels.py: fresh random inputs (the ``seed`` fixture, recorded), the
output poisoned with NaN before the launch, tolerance by query dtype (norm-wise relative error), NaN
never passes, lse within 2e-2 with the same ``-inf`` rows.
"""

from __future__ import annotations

import pytest
import torch

from jitattn.runtime import load_kernel
from jitattn.testing import random_paged_batch, relative_error
from tests import oracles
from tests.conftest import GPU_TOL, precompile

pytestmark = pytest.mark.gpu
Q_LENS = [1, 1, 40, 130, 7, 0]  # decode, split-KV decode, chunks after a prefix, a full prefill, no queries
KV_LENS = [300, 5000, 1000, 130, 2100, 9]
CASES = oracles.oracle_cases(Q_LENS, KV_LENS, head_dim=128)


@pytest.fixture(scope="module", autouse=True)
def compiled(session_cache_dir):
    """Compile every spec up front, in parallel."""
    precompile([c.spec for c in CASES], session_cache_dir)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_kernel_matches_the_independent_oracle(case, session_cache, record, seed):
    params = case.params("cuda", seed)
    batch = random_paged_batch(case.spec, Q_LENS, KV_LENS, device="cuda", seed=seed, params=params)
    kernel = load_kernel(case.spec)
    out = torch.full((sum(Q_LENS), case.spec.num_qo_heads, case.spec.head_dim_vo), float("nan"),
                     dtype=batch.q.dtype, device="cuda")
    want, want_lse = oracles.attention(case.spec, batch, case.pieces(params))
    softmax = want_lse is not None
    got = kernel.paged_attention(*batch.args(), **batch.kwargs(), out=out, return_lse=softmax, validate=True)
    torch.cuda.synchronize()
    got_out, got_lse = (got if softmax else (got, None))
    err = relative_error(got_out.cpu(), want)
    record(arch=kernel.entry.arch, rel_err=err)
    assert not torch.isnan(got_out).any(), f"{case.name}: NaN in output"
    assert err < GPU_TOL[case.spec.q_dtype], f"{case.name}: relative error {err:.3e}"
    if softmax:
        lse = got_lse.cpu().double()
        assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse)), f"{case.name}: -inf lse rows differ"
        finite = torch.isfinite(want_lse)
        lse_err = (lse[finite] - want_lse[finite]).abs().max().item() if finite.any() else 0.0
        record(lse_max_abs_err=lse_err)
        assert lse_err < 2e-2, f"{case.name}: lse error {lse_err:.3e}"
