"""The FP8 (e4m3) cache on the tensor-core decode, exactly, on the GPU (``pytest -m gpu``).

decode_mma.cuh widens e4m3 bytes to f16 in registers (common.cuh, e4m3x4_to_f16x4: bit moves, or
the converter under JITATTN_FP8_CVT) and reorders Q's dims to match the K fragments; these tests put every
e4m3 code (the NaN codes 0x7f / 0xff left out) into K and V rows and check that the decode reads each
one exactly. Each sequence has one key, so p = 1 and the output is V's row times v_scale (exact in
bf16 and f16: e4m3 values fit both), and the lse is the logit q.k * k_scale (q one-hot, times 3.0,
sm_scale 1), exact up to the few fp32 roundings of the log2 <-> ln conversion.
"""

from __future__ import annotations

import pytest
import torch

from jitattn import AttentionSpec, reference
from jitattn.runtime import load_kernel
from jitattn.testing import make_paged_kv, random_paged_batch, relative_error
from tests.conftest import NOT_WRITTEN

pytestmark = pytest.mark.gpu

D = 128
# Group 16 (one m16 tile, rows 8..15 used), the tile pipeline and the whole-window split-dims kernel
# (window 127: 2 tiles, swizzled rows).
SPECS = [AttentionSpec(16, 1, D, q_dtype=qd, kv_dtype="float8_e4m3fn", sm_scale=1.0, window_left=w)
         for qd in ("bfloat16", "float16") for w in (-1, 127)]


def _codes() -> torch.Tensor:
    """The 256 e4m3 codes as 2 rows of 128, the NaN codes replaced by 0."""
    c = torch.arange(256, dtype=torch.int32)
    c[(c == 0x7F) | (c == 0xFF)] = 0
    return c.to(torch.uint8).view(torch.float8_e4m3fn).reshape(2, D)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.5, 0.25)])
def test_every_e4m3_code_is_read_exactly(spec, k_scale, v_scale, session_cache):
    dev = "cuda"
    rows = _codes()  # K and V rows
    batch = 16       # sequence b: K = V = rows[b // 8]; head h queries dim (b % 8) * 16 + h
    kv = rows[torch.arange(batch) // 8].reshape(batch, 1, D).to(dev)
    kv_cache, block_table = make_paged_kv(kv, kv, [1] * batch, spec)
    dt = torch.bfloat16 if spec.q_dtype == "bfloat16" else torch.float16
    q = torch.zeros(batch, 16, D, dtype=dt, device=dev)
    for b in range(batch):
        for h in range(16):
            q[b, h, (b % 8) * 16 + h] = 3.0
    seq_lens = torch.ones(batch, dtype=torch.int32, device=dev)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=dev)
    kernel = load_kernel(spec)
    # The tensor-core decode: 64-key tiles (whole window) or 128 (FP8 tile pipeline, 32 keys per warp);
    # the CUDA-core decode takes 32 here.
    assert kernel.geometry["decode_tile_keys"] in (64, 128)
    out, lse = kernel.paged_attention(q, kv_cache, block_table, seq_lens, qsl, k_scale=k_scale, v_scale=v_scale,
                                      return_lse=True)
    torch.cuda.synchronize()
    exact = kv.float().reshape(batch, D)
    want_out = (exact * v_scale)[:, None, :].expand(batch, 16, D)
    assert torch.equal(out.float(), want_out), (out.float() - want_out).abs().max()
    dims = (torch.arange(batch)[:, None] % 8) * 16 + torch.arange(16)[None, :]
    want_lse = 3.0 * k_scale * exact.cpu().gather(1, dims)
    torch.testing.assert_close(lse.float().cpu(), want_lse, rtol=2e-6, atol=1e-7)


def _fp8_cvt_on() -> bool:
    from jitattn.render import template_dir

    return "#define JITATTN_FP8_CVT 1\n" in (template_dir() / "common.cuh").read_text()


@pytest.mark.parametrize("spec", SPECS[:2], ids=lambda s: s.name)
@pytest.mark.parametrize("code", [0x7F, 0xFF])
def test_nan_codes_read_as_nan(spec, code, session_cache, seed):
    """An e4m3 NaN code in a visible K or V element makes its rows NaN, as in the reference (only with
    the converter, sm_89 and later: the bit moves read it as +-480, as README says)."""
    if not _fp8_cvt_on():
        pytest.skip("JITATTN_FP8_CVT is 0: the tensor-core decode reads the NaN codes as +-480 (README)")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("sm_80: no e4m3 converter; the tensor-core decode reads the NaN codes as +-480 (README)")
    batch = random_paged_batch(spec, [1, 1, 1], [40, 300, 7], device="cuda", seed=seed)
    for where in ("k", "v"):
        cache = batch.kv_cache.clone()
        page = int(batch.block_table[1, 299 // 16])  # NHD page of sequence 1's last key (inside any window)
        cache.view(torch.uint8)[page, 0 if where == "k" else 1, 299 % 16, 0, 5] = code
        out = torch.full_like(batch.q, NOT_WRITTEN)  # not NaN: a skipped row must not pass for a NaN row
        load_kernel(spec).paged_attention(batch.q, cache, batch.block_table, batch.seq_lens, batch.query_start_loc,
                                          out=out, **batch.scales)
        torch.cuda.synchronize()
        ref = reference.paged_attention(spec, batch.q, cache, batch.block_table, batch.seq_lens,
                                        batch.query_start_loc, **batch.kwargs())
        assert torch.equal(torch.isnan(out), torch.isnan(ref)) and torch.isnan(out[1]).any(), where
        assert not (out == NOT_WRITTEN).any(), where


def test_out_of_range_page_id_gives_a_nan_row(session_cache, seed):
    """The FP8 tile pipeline issues its copies itself (decode_mma_load_tile): a page id outside the
    cache in a decode row's table turns that row into NaN (no out-of-bounds read); the others are right."""
    spec = AttentionSpec(64, 8, 128, kv_dtype="float8_e4m3fn", kv_layout="HND", page_size=64)
    batch = random_paged_batch(spec, [1, 1, 1], [300, 2000, 77], device="cuda", seed=seed)
    table = batch.block_table.clone()
    table[1, 3] = batch.kv_cache.shape[0] + 5
    out = torch.full_like(batch.q, NOT_WRITTEN)  # not NaN: a skipped row must not pass for a NaN row
    load_kernel(spec).paged_attention(batch.q, batch.kv_cache, table, batch.seq_lens, batch.query_start_loc,
                                      out=out, **batch.scales)
    torch.cuda.synchronize()
    assert torch.isnan(out[1]).all() and not torch.isnan(out[[0, 2]]).any()
    ref = reference.paged_attention(spec, *batch.args(), **batch.kwargs())
    assert relative_error(out[[0, 2]], ref[[0, 2]]) < 1e-2
