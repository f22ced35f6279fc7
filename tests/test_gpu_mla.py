"""Latent (MLA) decode on the GPU (``pytest -m gpu``): the sdpa backend, the path that serves latent specs
until the jit kernel exists, against the fp32 reference at the issue's shapes.

Group sizes 1 / 16 / 64 / 128 (DeepSeek-V3 at TP 128 / 8 / 2 / 1), page sizes 1 / 16 / 64, bf16 and FP8
(e4m3, per-tensor k_scale) caches, 1 and 4 queries per sequence (4: MTP / speculative decode, causal
among themselves), one 32,768-key sequence and a batch of 129 ragged sequences with empty ones among
them. Outputs are poisoned before each call; the reference also gives the lse, which the reference
backend (chosen with ``need_lse``) must return exactly.
"""

from __future__ import annotations

import pytest
import torch

from jitattn import AttentionSpec, reference
from jitattn.selector import select
from jitattn.testing import random_paged_batch, relative_error
from tests.conftest import GPU_TOL, NOT_WRITTEN

pytestmark = pytest.mark.gpu

SM_SCALE = 0.1352337788608801  # DeepSeek-V3's (YaRN factor 40, mscale_all_dim 1)


def _lens(shape: str, q_len: int, seed: int) -> tuple[list[int], list[int]]:
    if shape == "b1x32768":
        return [q_len], [32768]
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randint(q_len, 3000, (129,), generator=gen).tolist()
    q = [q_len] * 129
    for b in (0, 57, 128):  # empty sequences: no keys and no queries
        q[b], kv[b] = 0, 0
    q[5] = 0  # keys, but no query this step
    return q, kv


@pytest.mark.parametrize("shape", ["b1x32768", "b129"])
@pytest.mark.parametrize("q_len", [1, 4])
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("heads", [1, 16, 64, 128])
def test_sdpa_latent_decode_matches_the_reference(heads, page_size, kv_dtype, q_len, shape, seed, record):
    spec = AttentionSpec(heads, 1, 576, 512, kv_storage="latent", page_size=page_size, kv_dtype=kv_dtype,
                         sm_scale=SM_SCALE)
    sel = select(spec, "cuda")
    assert sel.name == "sdpa", sel.explain()
    q_lens, kv_lens = _lens(shape, q_len, seed)
    batch = random_paged_batch(spec, q_lens, kv_lens, device="cuda", seed=seed)
    out = torch.full((batch.q.shape[0], heads, 512), NOT_WRITTEN, dtype=torch.bfloat16, device="cuda")
    got = sel.build()(*batch.args(), out=out, **batch.scales)
    torch.cuda.synchronize()
    want = reference.paged_attention(spec, *batch.args(), **batch.scales)
    err = relative_error(got, want)
    record(rel_err=err)
    assert torch.isfinite(got).all() and err < GPU_TOL["bfloat16"]


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float8_e4m3fn"])
def test_the_lse_of_a_latent_spec_comes_from_the_reference_backend(kv_dtype, seed, record):
    spec = AttentionSpec(16, 1, 576, 512, kv_storage="latent", page_size=64, kv_dtype=kv_dtype, sm_scale=SM_SCALE)
    sel = select(spec, "cuda", need_lse=True)
    assert sel.name == "reference", sel.explain()
    batch = random_paged_batch(spec, *_lens("b129", 4, seed), device="cuda", seed=seed)
    out, lse = sel.build()(*batch.args(), return_lse=True, **batch.scales)
    want, want_lse = reference.paged_attention(spec, *batch.args(), return_lse=True, compute_dtype=torch.float64,
                                               **batch.scales)
    err = relative_error(out, want)
    lse_err = (lse.double() - want_lse.double()).abs().max().item()
    record(rel_err=err, lse_max_abs_err=lse_err)
    assert err < GPU_TOL["bfloat16"] and lse_err < 2e-2
