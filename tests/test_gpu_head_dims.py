"""Every head dim that is a multiple of 8 (8 .. 256) against the reference on the GPU (``pytest -m gpu``).

The padded-tile kernels (the prefill and the tensor-core decode pad a multiple of 8 to 16 in shared memory
and registers; the CUDA-core decode guards its lanes) serve these dims.

Each dim runs the GPU suite's mixed batch (decode rows, prefill rows, a split-KV decode row of 5000 keys:
tests/gpu_cases.py MIXED_Q / MIXED_KV) with NaN planted where a kernel reading past a row would find
it: after each token's q row (a strided q), in every page slot and page the batch does not use (the
paged cache's rows are contiguous, head after head, so nothing lies between them), and just past each
q, K and V row of the ragged tests (strided views of NaN buffers). The output is a contiguous view of a
longer buffer whose tail holds a sentinel the kernels must not overwrite. At 72 and 88: the odd-length
and empty-row cases of the suite, rotary (rotate_half pairs across a half chunk), the tensor-core decode's
whole-window mode, ragged K/V; at 8, the groups on either side of the tensor-core decode's merge limit.

FP8 caches at the dims that are multiples of 8 only (8, 24, ..., 248: rows of whole 8-byte chunks, copied 8
bytes at a time): every such dim with group 2 (the CUDA-core decode, lanes of 8-byte chunks) and group 4
(the tensor-core decode, rows padded to 16 dims) on the mixed batch, the prefill widening them too; at 72
and 88 also NHD and HND, page 1 with pages of 216 bytes (8 bytes off a 16-byte boundary) and page 16, group
16, the whole-window mode, rotary keys read one partner at a time, odd lengths and empty rows, a long
split-KV decode.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from jitattn import AttentionSpec, reference
from jitattn.runtime import load_kernel
from jitattn.testing import RaggedBatch, random_paged_batch, random_ragged_batch
from jitattn.variant import rotary_embedding
from tests.conftest import NOT_WRITTEN, precompile
from tests.gpu_cases import HIDE_HEAD, MIXED_KV, MIXED_Q, Case
from tests.test_gpu_kernels import _check as check_against_reference

pytestmark = pytest.mark.gpu

MIXED = [Case(f"hd{d}-mixed", AttentionSpec(8, 2, d), MIXED_Q, MIXED_KV) for d in range(8, 257, 8)]
ODD_Q, ODD_KV = [1, 15, 17, 127, 1, 1000], [1, 15, 17, 127, 8191, 1000]
SPECIAL = [c for d in (72, 88) for c in (
    Case(f"hd{d}-odd-lengths", AttentionSpec(8, 2, d), ODD_Q, ODD_KV),
    Case(f"hd{d}-zero-query-seqs", AttentionSpec(8, 2, d), [0, 5, 0, 1], [10, 5, 3, 40]),
    Case(f"hd{d}-empty-rows-hidden-head-sinks", AttentionSpec(8, 2, d, variant=HIDE_HEAD, sinks=True), ODD_Q, ODD_KV,
         lambda device: {"hidden": 5}),
    Case(f"hd{d}-rotary-gqa1-softcap", AttentionSpec(4, 4, d, variant=rotary_embedding(d), logits_soft_cap=30.0),
         MIXED_Q, MIXED_KV),
    Case(f"hd{d}-fp16-group8-window-hnd", AttentionSpec(16, 2, d, q_dtype="float16", window_left=255,
                                                        kv_layout="HND", page_size=7), MIXED_Q, MIXED_KV),
    Case(f"hd{d}-group8-whole-window-sinks", AttentionSpec(64, 8, d, window_left=127, sinks=True), MIXED_Q, MIXED_KV),
)] + [Case(f"hd8-group{g}-mixed", AttentionSpec(g, 1, 8), MIXED_Q, MIXED_KV) for g in (9, 10, 16)]
FP8 = "float8_e4m3fn"
FP8_MIXED = [Case(f"fp8-hd{d}-group{g}-mixed", AttentionSpec(4 * g, 4, d, kv_dtype=FP8), MIXED_Q, MIXED_KV)
             for d in range(8, 257, 16) for g in (2, 4)]
FP8_SPECIAL = [c for d in (72, 88) for c in (
    Case(f"fp8-hd{d}-group4-hnd-page1", AttentionSpec(12, 3, d, kv_dtype=FP8, kv_layout="HND", page_size=1),
         MIXED_Q, MIXED_KV),
    Case(f"fp8-hd{d}-group2-fp16-page1", AttentionSpec(6, 3, d, q_dtype="float16", kv_dtype=FP8, page_size=1),
         MIXED_Q, MIXED_KV),
    Case(f"fp8-hd{d}-group16-hnd", AttentionSpec(32, 2, d, kv_dtype=FP8, kv_layout="HND"), MIXED_Q, MIXED_KV),
    Case(f"fp8-hd{d}-group8-whole-window-sinks", AttentionSpec(64, 8, d, kv_dtype=FP8, window_left=127, sinks=True),
         MIXED_Q, MIXED_KV),
    Case(f"fp8-hd{d}-group12-whole-window-softcap-page7",
         AttentionSpec(24, 2, d, kv_dtype=FP8, window_left=100, logits_soft_cap=30.0, page_size=7), MIXED_Q, MIXED_KV),
    Case(f"fp8-hd{d}-rotary-gqa1-softcap", AttentionSpec(4, 4, d, kv_dtype=FP8, variant=rotary_embedding(d),
                                                         logits_soft_cap=30.0), MIXED_Q, MIXED_KV),
    Case(f"fp8-hd{d}-odd-lengths", AttentionSpec(8, 2, d, kv_dtype=FP8), ODD_Q, ODD_KV),
    Case(f"fp8-hd{d}-empty-rows-hidden-head-sinks", AttentionSpec(8, 2, d, kv_dtype=FP8, variant=HIDE_HEAD, sinks=True),
         ODD_Q, ODD_KV, lambda device: {"hidden": 5}),
    Case(f"fp8-hd{d}-decode-b1-32768", AttentionSpec(32, 8, d, kv_dtype=FP8), [1], [32768]),
)]
RAGGED = [Case(f"ragged-{qk}x{vo}", AttentionSpec(8, 2, qk, vo, kv_storage="ragged"), [1, 40, 17, 1, 127, 5],
               [1, 1000, 17, 8191, 300, 5]) for qk, vo in ((72, 72), (88, 88), (72, 88), (128, 40), (8, 248))]


@pytest.fixture(scope="module", autouse=True)
def compiled(session_cache_dir):
    precompile([c.spec for c in MIXED + SPECIAL + FP8_MIXED + FP8_SPECIAL + RAGGED], session_cache_dir)


def _nan_past_q(q: torch.Tensor) -> torch.Tensor:
    """q ``(T, H, D)`` as a view whose token rows are 8 elements apart from the next: those hold NaN."""
    t, h, d = q.shape
    buf = torch.full((t, h * d + 8), float("nan"), dtype=q.dtype, device=q.device)
    view = buf[:, :h * d].unflatten(1, (h, d))
    view.copy_(q)
    return view


def _nan_in_unused_slots(batch) -> None:
    """NaN in every page the batch's sequences do not use and in each last page's slots past the sequence
    (an FP8 cache: e4m3's NaN code 0x7f, written through a byte view)."""
    cache, table, page = batch.kv_cache, batch.block_table, batch.spec.page_size
    if cache.dtype == torch.float8_e4m3fn:
        cache, nan = cache.view(torch.uint8), 0x7F
    else:
        nan = float("nan")
    used = torch.zeros(cache.shape[0], dtype=torch.bool, device=cache.device)
    for b, kv_len in enumerate(batch.kv_lens):
        pages = -(-kv_len // page)
        used[table[b, :pages].long()] = True
        if kv_len % page:
            last = table[b, pages - 1]
            if batch.spec.kv_layout == "NHD":  # (pages, 2, page_size, H, D)
                cache[last, :, kv_len % page:] = nan
            else:  # (pages, 2, H, page_size, D)
                cache[last, :, :, kv_len % page:] = nan
    cache[~used] = nan


def _out_with_sentinel_tail(total_q: int, spec: AttentionSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """A NaN-poisoned contiguous ``out`` and the 64 sentinel elements that follow it in memory."""
    n = total_q * spec.num_qo_heads * spec.head_dim_vo
    buf = torch.full((n + 64,), NOT_WRITTEN, dtype=torch.bfloat16 if spec.o_dtype == "bfloat16" else torch.float16,
                     device="cuda")
    buf[:n] = float("nan")
    return buf[:n].view(total_q, spec.num_qo_heads, spec.head_dim_vo), buf[n:]


def _check_prefill_kernel(kernel, spec: AttentionSpec, record) -> None:
    """Which prefill kernel the cubin runs, as the templates choose (PrefillLaunch): the wgmma prefill
    (more than the mma.sync prefill's 128 threads) on sm_90a for 16-bit head dims from 32, the padded ones
    (multiples of 8, not 16) included, so their cases cover that path; an FP8 cache runs the mma.sync one."""
    dims = (spec.head_dim_qk, spec.head_dim_vo)
    wgmma = kernel.entry.arch == "sm_90a" and spec.kv_dtype == spec.q_dtype and all(d >= 32 for d in dims)
    threads = kernel.geometry["prefill_threads"]
    record(prefill_threads=threads, decode_tile_keys=kernel.geometry["decode_tile_keys"])
    assert (threads > 128) == wgmma, f"{spec.name} on {kernel.entry.arch}: prefill of {threads} threads"


def _check(case: Case, out, lse, ref_out, ref_lse, tail, record) -> None:
    check_against_reference(case, out, lse, ref_out, ref_lse, record)
    assert torch.all(tail == NOT_WRITTEN), f"{case.name}: written past the output"


@pytest.mark.parametrize("case", MIXED + SPECIAL + FP8_MIXED + FP8_SPECIAL, ids=lambda c: c.id)
def test_head_dim_matches_reference(case, session_cache, record, seed):
    batch = random_paged_batch(case.spec, case.q_lens, case.kv_lens, device="cuda", seed=seed,
                               params=case.params("cuda"))
    want = reference.paged_attention(case.spec, *batch.args(), **batch.kwargs(), return_lse=True)
    _nan_in_unused_slots(batch)
    q = _nan_past_q(batch.q)
    kernel = load_kernel(case.spec)
    out, tail = _out_with_sentinel_tail(q.shape[0], case.spec)
    got = kernel.paged_attention(q, *batch.args()[1:], **batch.kwargs(), out=out, return_lse=True, validate=True)
    torch.cuda.synchronize()
    record(arch=kernel.entry.arch,
           splits=kernel.num_splits(len(case.q_lens), kernel.max_decode_keys(batch.block_table.shape[1])))
    _check_prefill_kernel(kernel, case.spec, record)
    _check(case, got[0], got[1], want[0], want[1], tail, record)
    if case.spec.variant is HIDE_HEAD:  # the hidden head's rows see no key: the sink alone, output 0
        assert torch.all(got[0][:, 5] == 0)


def _nan_past_rows(batch: RaggedBatch) -> RaggedBatch:
    """The batch with q, k and v as views whose every row is followed by 8 NaN elements."""
    def padded(x: torch.Tensor) -> torch.Tensor:
        buf = torch.full((*x.shape[:2], x.shape[2] + 8), float("nan"), dtype=x.dtype, device=x.device)
        view = buf[:, :, :x.shape[2]]
        view.copy_(x)
        return view

    return dataclasses.replace(batch, q=padded(batch.q), k=padded(batch.k), v=padded(batch.v))


@pytest.mark.parametrize("case", RAGGED, ids=lambda c: c.id)
def test_ragged_head_dim_matches_reference(case, session_cache, record, seed):
    batch = random_ragged_batch(case.spec, case.q_lens, case.kv_lens, device="cuda", seed=seed)
    want = reference.ragged_attention(case.spec, *batch.args(), **batch.kwargs(), return_lse=True)
    batch = _nan_past_rows(batch)
    kernel = load_kernel(case.spec)
    out, tail = _out_with_sentinel_tail(batch.q.shape[0], case.spec)
    got = kernel.ragged_attention(*batch.args(), **batch.kwargs(), out=out, return_lse=True, validate=True)
    torch.cuda.synchronize()
    record(arch=kernel.entry.arch)
    _check_prefill_kernel(kernel, case.spec, record)
    _check(case, got[0], got[1], want[0], want[1], tail, record)
