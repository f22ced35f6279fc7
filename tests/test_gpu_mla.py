"""Latent (MLA) decode on the GPU (``pytest -m gpu``) against the fp32 reference at the issue's shapes: the
jit backend's MLA decode kernel (templates/mla_decode.cuh), which serves latent specs, and the sdpa and
reference backends, which serve the latent specs it does not take (named explicitly here).

Group sizes 1 / 16 / 64 / 128 (DeepSeek-V3 at TP 128 / 8 / 2 / 1), page sizes 1 / 16 / 64, bf16 and FP8
(e4m3, per-tensor k_scale) caches, 1 and 4 queries per sequence (4: MTP / speculative decode, causal
among themselves), one 32,768-key sequence (split-KV) and a batch of 129 ragged sequences with empty ones
among them. Outputs are poisoned before each call; the lse is checked against the float64 reference.
"""

from __future__ import annotations

import pytest
import torch

import jitattn
from jitattn import AttentionSpec, reference
from jitattn.selector import select
from jitattn.testing import random_paged_batch, relative_error
from tests.conftest import GPU_TOL, NOT_WRITTEN, precompile, replay_on_new_q

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
    sel = select(spec, "cuda", backend="sdpa")  # named: jit serves these specs by default
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
def test_the_reference_backend_returns_the_lse_of_a_latent_spec(kv_dtype, seed, record):
    spec = AttentionSpec(16, 1, 576, 512, kv_storage="latent", page_size=64, kv_dtype=kv_dtype, sm_scale=SM_SCALE)
    sel = select(spec, "cuda", need_lse=True, backend="reference")  # named: jit serves these specs by default
    assert sel.name == "reference", sel.explain()
    batch = random_paged_batch(spec, *_lens("b129", 4, seed), device="cuda", seed=seed)
    out, lse = sel.build()(*batch.args(), return_lse=True, **batch.scales)
    want, want_lse = reference.paged_attention(spec, *batch.args(), return_lse=True, compute_dtype=torch.float64,
                                               **batch.scales)
    err = relative_error(out, want)
    lse_err = (lse.double() - want_lse.double()).abs().max().item()
    record(rel_err=err, lse_max_abs_err=lse_err)
    assert err < GPU_TOL["bfloat16"] and lse_err < 2e-2


# ---- the jit backend's MLA decode kernel --------------------------------------------------------------
HEADS, PAGE_SIZES = (1, 16, 64, 128), (1, 16, 64)


KV_DTYPES = ("bfloat16", "float8_e4m3fn")
# Groups whose (query, head) rows straddle the sm_90a kernels' tiles of 16, 32 and 64 flattened rows
# (templates/mla_decode_sm90.cuh).
PACKED_HEADS = (3, 20, 48)


def jit_latent(heads: int, page_size: int, q_dtype: str = "bfloat16", kv_dtype: str | None = None) -> AttentionSpec:
    return AttentionSpec(heads, 1, 576, 512, kv_storage="latent", page_size=page_size, q_dtype=q_dtype,
                         kv_dtype=kv_dtype, sm_scale=SM_SCALE)


@pytest.fixture(scope="module")
def mla_compiled(session_cache_dir):
    precompile([jit_latent(h, p, kv_dtype=kv) for h in HEADS for p in PAGE_SIZES for kv in KV_DTYPES] +
               [jit_latent(20, 16, "float16"), jit_latent(20, 16, "float16", "float8_e4m3fn")] +
               [jit_latent(h, 16, kv_dtype=kv) for h in PACKED_HEADS for kv in KV_DTYPES], session_cache_dir)


@pytest.fixture
def mla_kernels(mla_compiled, session_cache):
    """The MLA decode kernels of this file, compiled into the session cache, which the test reads."""


def _check_against_reference(spec, batch, out, lse, record):
    want, want_lse = reference.paged_attention(spec, *batch.args(), return_lse=True, compute_dtype=torch.float64,
                                               **batch.scales)
    err = relative_error(out, want)
    lse_err = (lse.double() - want_lse.double()).abs().max().item() if lse.numel() else 0.0
    record(rel_err=err, lse_max_abs_err=lse_err)
    assert torch.isfinite(out).all(), "unwritten (poisoned) or NaN outputs"
    assert err < GPU_TOL[spec.q_dtype] and lse_err < 2e-2


@pytest.mark.parametrize("shape", ["b1x32768", "b129"])
@pytest.mark.parametrize("q_len", [1, 4])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("heads", HEADS)
def test_jit_latent_decode_matches_the_reference(mla_kernels, heads, page_size, kv_dtype, q_len, shape, seed,
                                                 record):
    """Every query of the batch through the MLA kernel (one launch), with the lse: splits for 1 x 32,768 (groups
    of whole 16-head tiles), empty sequences and a sequence with keys but no query this step in the 129; an FP8
    cache with its k_scale."""
    spec = jit_latent(heads, page_size, kv_dtype=kv_dtype)
    sel = select(spec, "cuda", need_lse=True)
    assert sel.name == "jit", sel.explain()
    batch = random_paged_batch(spec, *_lens(shape, q_len, seed), device="cuda", seed=seed)
    out = torch.full((batch.q.shape[0], heads, 512), NOT_WRITTEN, dtype=torch.bfloat16, device="cuda")
    got, lse = sel.build()(*batch.args(), out=out, return_lse=True, max_query_len=q_len, **batch.scales)
    torch.cuda.synchronize()
    _check_against_reference(spec, batch, got, lse, record)


@pytest.mark.parametrize("kv_dtype", [None, "float8_e4m3fn"])
def test_jit_latent_decode_without_a_query_length_hint_and_with_fp16(mla_kernels, kv_dtype, seed, record):
    """A group of 20 (two tiles, the second half padding: one split), fp16, mixed 1..8 queries per sequence,
    no max_query_len (graph-mode slots from total_q)."""
    spec = jit_latent(20, 16, "float16", kv_dtype)
    batch = random_paged_batch(spec, [1, 8, 3, 0, 5], [9, 4000, 3, 0, 70], device="cuda", seed=seed)
    out = torch.full((batch.q.shape[0], 20, 512), NOT_WRITTEN, dtype=torch.float16, device="cuda")
    got, lse = jitattn.paged_attention(spec, *batch.args(), out=out, return_lse=True, **batch.scales)
    torch.cuda.synchronize()
    _check_against_reference(spec, batch, got, lse, record)


def test_jit_latent_decode_replays_in_a_cuda_graph(mla_kernels, seed, record):
    """plan once, run captured: a graph replayed on new q gives the reference's answer for it (split-KV on)."""
    spec = jit_latent(16, 64)
    batch = random_paged_batch(spec, [1, 2], [20000, 513], device="cuda", seed=seed)
    plan = jitattn.plan(spec, batch.block_table, batch.seq_lens, batch.query_start_loc, total_q=batch.q.shape[0],
                        max_query_len=2, mode="graph")
    out = torch.empty(batch.q.shape[0], 16, 512, dtype=torch.bfloat16, device="cuda")
    jitattn.run(batch.q, batch.kv_cache, plan, out=out)  # loaded outside the capture
    replay_on_new_q(lambda: jitattn.run(batch.q, batch.kv_cache, plan, out=out), batch.q, out, seed)
    want = reference.paged_attention(spec, *batch.args())
    err = relative_error(out, want)
    record(rel_err=err)
    assert err < GPU_TOL["bfloat16"]


# ---- which kernel runs, and the contracts a new kernel must keep ------------------------------------------
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_the_sm90_kernels_run_on_sm_90_only(mla_kernels, kv_dtype):
    """On an sm_90 GPU the cubin geometry of 16 heads is the swapped-operand wgmma kernel's (128 threads, tiles of
    16 flattened rows), a bf16 cache's at 128 heads the 64-row wgmma kernel's (256 threads) and an FP8 one's there
    the mma.sync kernel's; on other GPUs every one is the mma.sync kernel's (prefill_block_m 0)."""
    from jitattn.runtime import load_kernel

    sm90 = torch.cuda.get_device_capability()[0] == 9
    g = load_kernel(jit_latent(16, 64, kv_dtype=kv_dtype), "cuda").geometry
    assert (g["decode_threads"], g["prefill_block_m"]) == ((128, 16) if sm90 else (128, 0))
    g = load_kernel(jit_latent(128, 64, kv_dtype=kv_dtype), "cuda").geometry
    wide = sm90 and kv_dtype == "bfloat16"
    assert (g["decode_threads"], g["prefill_block_m"]) == ((256, 64) if wide else (128, 0))


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("heads", PACKED_HEADS)
def test_jit_latent_decode_packs_queries_across_row_tiles(mla_kernels, heads, kv_dtype, seed, record):
    """Groups of 3, 20, 48 with 1..8 queries per sequence: a 64-row tile holds rows of several queries (each with
    its own causal bound) and a query's rows may span two tiles; a 32,768-key sequence splits."""
    spec = jit_latent(heads, 16, kv_dtype=kv_dtype)
    batch = random_paged_batch(spec, [8, 1, 5, 0, 3], [32768, 100, 3000, 0, 3], device="cuda", seed=seed)
    out = torch.full((batch.q.shape[0], heads, 512), NOT_WRITTEN, dtype=torch.bfloat16, device="cuda")
    got, lse = jitattn.paged_attention(spec, *batch.args(), out=out, return_lse=True, max_query_len=8,
                                       **batch.scales)
    torch.cuda.synchronize()
    _check_against_reference(spec, batch, got, lse, record)


@pytest.mark.parametrize("shape", ["b1x32768", "b129"])
def test_jit_latent_decode_gives_nan_rows_for_bad_metadata_and_leaves_rows_past_q(mla_kernels, shape, seed):
    """A page id outside the cache and a sequence longer than its page-table row: that sequence's rows are NaN
    (with splits too), the others right; an out buffer with rows past total_q keeps them."""
    spec = jit_latent(16, 64)
    batch = random_paged_batch(spec, *_lens(shape, 2, seed), device="cuda", seed=seed)
    table, seq_lens = batch.block_table.clone(), batch.seq_lens.clone()
    from jitattn.runtime import load_kernel

    first = 0 if shape == "b1x32768" else 1  # b129's sequence 0 is empty
    table[first, 0] = batch.kv_cache.shape[0] + 5  # in the first split only: the merge must carry the NaN
    if shape == "b129":
        seq_lens[3] = table.shape[1] * 64 + 1
    total_q = batch.q.shape[0]
    buf = torch.full((total_q + 7, 16, 512), NOT_WRITTEN, dtype=torch.bfloat16, device="cuda")
    got = load_kernel(spec).paged_attention(batch.q, batch.kv_cache, table, seq_lens, batch.query_start_loc,
                                            out=buf[:total_q], max_query_len=2)
    torch.cuda.synchronize()
    assert (buf[total_q:] == NOT_WRITTEN).all(), "rows past q were written"
    rows = batch.query_start_loc.tolist()
    bad = torch.zeros(total_q, dtype=torch.bool, device="cuda")
    bad[rows[first]:rows[first + 1]] = True
    if shape == "b129":
        bad[rows[3]:rows[4]] = True
    assert torch.isnan(got[bad]).all()
    if shape == "b129":  # (b1x32768's one sequence is the bad one)
        want = reference.paged_attention(spec, *batch.args())
        assert not (got[~bad] == NOT_WRITTEN).any() and relative_error(got[~bad], want[~bad]) < GPU_TOL["bfloat16"]
