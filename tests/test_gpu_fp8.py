"""The FP8 (e4m3) cache on the tensor-core decode, exactly, on the GPU (``pytest -m gpu``).

decode_mma.cuh widens e4m3 bytes to f16 in registers (common.cuh, e4m3x4_to_f16x4: bit moves, or
the converter on sm_89 and later, JITATTN_E4M3_BY_CVT) and reorders Q's dims to match the K fragments; these tests put every
e4m3 code (the NaN codes 0x7f / 0xff left out) into K and V rows and check that the decode reads each
one exactly, at hd 128 and at 72 / 88 (rows of 8-byte chunks: padded to 16 dims on the tensor-core decode,
8-byte lanes on the CUDA-core one). Each sequence has one key, so p = 1 and the output is V's row times v_scale (exact in
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
FP8 = "float8_e4m3fn"
# Group 16 (one m16 tile, rows 8..15 used), the tile pipeline and the whole-window split-dims kernel
# (window 127: 2 tiles, swizzled rows).
SPECS = [AttentionSpec(16, 1, D, q_dtype=qd, kv_dtype=FP8, sm_scale=1.0, window_left=w)
         for qd in ("bfloat16", "float16") for w in (-1, 127)]
# Rows of 8-byte chunks: group 16 on the tensor-core decode's tile pipeline and whole-window (key-split)
# kernel, group 2 on the CUDA-core decode.
PADDED_SPECS = [AttentionSpec(16, 1, d, kv_dtype=FP8, sm_scale=1.0, window_left=w) for d in (72, 88)
                for w in (-1, 127)] + [AttentionSpec(2, 1, d, q_dtype="float16", kv_dtype=FP8, sm_scale=1.0)
                                       for d in (72, 88)]


def _codes(d: int = D) -> torch.Tensor:
    """The 256 e4m3 codes (the NaN codes replaced by 0) as rows of d, the last one filled up with 0."""
    c = torch.arange(-(-256 // d) * d, dtype=torch.int32)
    c[(c == 0x7F) | (c == 0xFF) | (c > 0xFF)] = 0
    return c.to(torch.uint8).view(torch.float8_e4m3fn).reshape(-1, d)


@pytest.mark.parametrize("spec", SPECS + PADDED_SPECS, ids=lambda s: s.name)
@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.5, 0.25)])
def test_every_e4m3_code_is_read_exactly(spec, k_scale, v_scale, session_cache):
    dev = "cuda"
    d, heads = spec.head_dim_qk, spec.num_qo_heads
    rows = _codes(d)  # K and V rows
    per_row = -(-d // heads)  # sequence b: K = V = rows[b // per_row]; head h queries dim (b % per_row) * heads + h
    batch = rows.shape[0] * per_row
    kv = rows[torch.arange(batch) // per_row].reshape(batch, 1, d).to(dev)
    kv_cache, block_table = make_paged_kv(kv, kv, [1] * batch, spec)
    dt = torch.bfloat16 if spec.q_dtype == "bfloat16" else torch.float16
    dims = (torch.arange(batch)[:, None] % per_row) * heads + torch.arange(heads)[None, :]
    has = dims < d  # a head whose dim is past the row queries nothing: logit 0
    q = torch.zeros(batch, heads, d, dtype=dt)
    b_idx, h_idx = has.nonzero(as_tuple=True)
    q[b_idx, h_idx, dims[has]] = 3.0
    q = q.to(dev)
    seq_lens = torch.ones(batch, dtype=torch.int32, device=dev)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=dev)
    kernel = load_kernel(spec)
    # The tensor-core decode (groups 4..16): 64-key tiles (whole window) or 128 (FP8 tile pipeline, 32 keys
    # per warp); the CUDA-core decode takes 32 here.
    assert (kernel.geometry["decode_tile_keys"] in (64, 128)) == (spec.group_size >= 4)
    out, lse = kernel.paged_attention(q, kv_cache, block_table, seq_lens, qsl, k_scale=k_scale, v_scale=v_scale,
                                      return_lse=True)
    torch.cuda.synchronize()
    exact = kv.float().reshape(batch, d)
    want_out = (exact * v_scale)[:, None, :].expand(batch, heads, d)
    assert torch.equal(out.float(), want_out), (out.float() - want_out).abs().max()
    want_lse = torch.where(has, 3.0 * k_scale * exact.cpu().gather(1, dims.clamp(max=d - 1)), 0.0)
    torch.testing.assert_close(lse.float().cpu(), want_lse, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("spec", SPECS[:2], ids=lambda s: s.name)
@pytest.mark.parametrize("code", [0x7F, 0xFF])
def test_nan_codes_read_as_nan(spec, code, session_cache, seed):
    """An e4m3 NaN code in a visible K or V element makes its rows NaN, as in the reference (only with
    the converter, sm_89 and later: the bit moves read it as +-480, as README says)."""
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


@pytest.mark.parametrize("head_dim", [128, 72])
def test_out_of_range_page_id_gives_a_nan_row(head_dim, session_cache, seed):
    """The FP8 tile pipeline issues its copies itself (decode_mma_load_tile; at hd 72 8-byte copies into
    padded rows): a page id outside the cache in a decode row's table turns that row into NaN (no
    out-of-bounds read); the others are right."""
    spec = AttentionSpec(64, 8, head_dim, kv_dtype=FP8, kv_layout="HND", page_size=64)
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
