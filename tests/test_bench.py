"""jitattn.bench on CPU: cases, accounting, the anchors' translations, tables, JSON, the command line.

Timing and the anchors themselves need a GPU (the device runs them); everything that decides what
is run and how it is reported is checked here. FlexAttention's score_mod / mask_mod are checked two
ways: evaluated on index tensors against jitattn.reference's rules, and through FlexAttention's
unfused eager path on CPU against jitattn.reference.paged_attention. The host case runs on a GPU only
(``test_host_case_on_gpu``).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from jitattn import bench, reference
from jitattn.backends.flashinfer import flashinfer_import_error, page_metadata
from jitattn.bench import BenchOptions, anchors, cases, compile_figures, harness, host, report, run
from jitattn.bench.cases import BenchCase
from jitattn.bench.report import CompileFigure, Result
from jitattn.spec import AttentionSpec
from jitattn.testing import random_paged_batch

REPO = Path(__file__).resolve().parent.parent
MODELS = sorted((REPO / "examples" / "models").glob("*.json"))
nan = math.nan


# ---- cases ------------------------------------------------------------------------------------
V0_CASES = {  # the v0 names and shapes, which BENCHMARKS.md's history refers to
    "prefill-hd128-causal-b4x8192": (4, 8192, 8192), "prefill-gemma2-9b-b2x8192": (2, 8192, 8192),
    "prefill-phi3-hd96-b4x8192": (4, 8192, 8192), "decode-hd128-b64x4096": (64, 1, 4096),
    "decode-gemma2-9b-b64x8192": (64, 1, 8192), "decode-hd128-b1x32768": (1, 1, 32768),
    "decode-gpt-oss-sliding-b256x8192": (256, 1, 8192), "decode-hd128-b64x4096-page1": (64, 1, 4096),
    "decode-hd128-b64x4096-page16": (64, 1, 4096), "decode-hd128-b64x4096-page64": (64, 1, 4096),
}


def test_existing_cases_keep_their_names_and_shapes():
    by_name = {c.name: c for c in cases.design_cases() + cases.decode_target_cases()}
    assert set(V0_CASES) <= set(by_name)
    assert by_name["decode-hd128-b64x4096-fp8"].spec.kv_dtype == "float8_e4m3fn"
    for name, (b, q, kv) in V0_CASES.items():
        c = by_name[name]
        assert (len(c.q_lens), set(c.q_lens), set(c.kv_lens)) == (b, {q}, {kv})
        assert c.phase == name.split("-")[0]
    assert [by_name[f"decode-hd128-b64x4096-page{p}"].spec.page_size for p in (1, 16, 64)] == [1, 16, 64]


@pytest.mark.parametrize("config", MODELS, ids=[m.stem for m in MODELS])
def test_model_cases_cover_every_layer_kind(config):
    from jitattn.models import load_model_config

    kinds = load_model_config(config).layer_kinds
    made = cases.model_cases(config)
    assert len(made) == 2 * len(kinds)
    for kind, (dec, pre) in zip(kinds, zip(made[::2], made[1::2])):
        short = kind.name.split("_")[0]
        assert dec.spec == kind.spec == pre.spec
        assert dec.phase == "decode" and set(dec.q_lens) == {1} and set(dec.kv_lens) == {4096}
        assert dec.name == f"decode-{config.stem}-{short}-b{len(dec.q_lens)}x4096"
        assert pre.name == f"prefill-{config.stem}-{short}-b2x4096"
        assert pre.q_lens == pre.kv_lens == [4096, 4096]
        read = cases.decode_kv_bytes(dec.spec, len(dec.q_lens), 4096)
        assert read >= cases.MIN_DECODE_BYTES or len(dec.q_lens) == cases.MAX_DECODE_BATCH
        cache_bytes = cases.decode_kv_bytes(dec.spec.replace(window_left=-1), len(dec.q_lens), 4096)
        assert 2 * cache_bytes < 20e9  # the paged cache plus one dense copy for SDPA / Flex


def test_narrow_windows_get_bigger_decode_batches():
    gpt_oss_sliding = AttentionSpec(64, 8, 64, window_left=127, sinks=True)  # 128 keys x 2 KB per sequence
    assert cases.decode_kv_bytes(gpt_oss_sliding, 64, 4096) == 64 * 128 * 8 * 128 * 2
    assert cases.decode_batch_size(gpt_oss_sliding) == 512
    assert cases.decode_batch_size(AttentionSpec(32, 8, 128)) == 64  # 64 x 4096 already reads 1.07 GB


def test_all_cases_are_unique_and_cover_the_examples():
    names = [c.name for c in cases.all_cases()]
    assert len(names) == len(set(names))
    extra = ["decode-hd128-b64x4096-fp8", "mixed-hd128-4x2048-prefill+60x4096-decode",
             "prefill-hd128-causal-b4x8192-vs-ragged", "cascade-hd128-r50-p1000-s100", "cascade-hd128-r64-p8192-s256",
             "host-decode-hd128-b1x512", "host-mixed-hd128-2x64-prefill+30-decode", "host-append-kv-b64-h8-hd128",
             "generate-llama-3-8b-b8x4096",
             "generate-gemma-2-9b-b8x4096", "decode-mla-tp8-h16-b128x4096", "decode-mla-tp1-h128-b64x4096",
             "decode-mla-tp8-h16-b128x4096-fp8", "prefill-hd72-causal-b4x8192", "decode-hd72-b64x4096",
             "decode-hd72-b64x4096-hnd", "prefill-hd88-causal-b4x8192", "decode-hd88-b64x4096", "decode-hd88-b64x4096-hnd"]
    assert len(names) == len(V0_CASES) + len(extra) + sum(len(cases.model_cases(m)) for m in MODELS)
    assert set(extra) <= set(names)


def test_select_cases():
    assert [c.name for c in cases.select_cases(["b1x32768"], None)] == ["decode-hd128-b1x32768"]
    both = cases.select_cases(["page1", "page16"], None)  # "page1" also matches page16: kept once
    assert [c.name for c in both] == ["decode-hd128-b64x4096-page1", "decode-hd128-b64x4096-page16"]
    gemma = cases.select_cases(None, [str(REPO / "examples/models/gemma-2-9b.json")])
    assert [c.name for c in gemma] == [f"{p}-gemma-2-9b-{k}-b{b}x4096" for k in ("sliding", "full")
                                       for p, b in (("decode", 64), ("prefill", 2))]
    assert len(cases.select_cases(None, None)) == len(cases.all_cases())
    with pytest.raises(SystemExit, match="matches no case"):
        cases.select_cases(["no-such-case"], None)


def test_check_seqs_prefill_over_two_sequences_checks_the_first():
    spec = AttentionSpec(4, 2, 64)
    assert BenchCase("p", spec, [8] * 4, [8] * 4, "prefill").check_seqs == 1
    assert BenchCase("p", spec, [8] * 2, [8] * 2, "prefill").check_seqs == 2
    assert BenchCase("d", spec, [1] * 64, [8] * 64, "decode").check_seqs == 64


def test_reference_rows_of_the_first_sequence_match_the_full_reference():
    spec = AttentionSpec(4, 2, 64, window_left=5)
    case = BenchCase("p", spec, [9, 7, 8], [9, 12, 8], "prefill")
    batch = random_paged_batch(spec, case.q_lens, case.kv_lens, seed=3)
    full = reference.paged_attention(spec, *batch.args(), **batch.kwargs())
    first = run.reference_rows(case, batch)
    assert first.shape == (9, 4, 64)
    torch.testing.assert_close(first, full[:9])
    assert harness.check_error(full, first) == 0.0


def test_mixed_case_checks_every_row_and_splits_into_the_same_output():
    case = cases.mixed_cases()[0]
    assert case.q_lens == [2048] * 4 + [1] * 60 and case.check_seqs == 64 and not case.is_decode
    spec = AttentionSpec(4, 2, 64)
    batch = random_paged_batch(spec, [20, 9, 1, 1, 1], [20, 30, 50, 7, 64], seed=4)
    first, rest = run.split_batch(batch, 2)
    assert first.q.shape[0] == 29 and rest.q.shape[0] == 3 and rest.query_start_loc.tolist() == [0, 1, 2, 3]
    assert rest.kv_cache is batch.kv_cache
    whole = reference.paged_attention(spec, *batch.args(), **batch.kwargs())
    parts = [reference.paged_attention(spec, *b.args(), **b.kwargs()) for b in (first, rest)]
    torch.testing.assert_close(torch.cat(parts), whole, rtol=0, atol=0)


def test_ragged_twin_inputs_give_the_paged_answer():
    case = cases.ragged_cases()[0]
    assert case.ragged_twin and case.name in {c.name for c in cases.all_cases()}
    small = BenchCase("r", AttentionSpec(8, 2, 64, window_left=7), [5, 1, 9], [12, 30, 9], "prefill", ragged_twin=True)
    batch = random_paged_batch(small.spec, small.q_lens, small.kv_lens, seed=2)
    spec, k, v, kv_start_loc = run.ragged_twin_inputs(small, batch)
    assert spec.ragged and k.shape == (51, 2, 64) and kv_start_loc.tolist() == [0, 12, 42, 51]
    got = reference.ragged_attention(spec, batch.q, k, v, batch.query_start_loc, kv_start_loc)
    torch.testing.assert_close(got, reference.paged_attention(small.spec, *batch.args()), rtol=0, atol=0)


# ---- FLOP and byte accounting -----------------------------------------------------------------
def test_flops_causal_prefill_by_hand():
    spec = AttentionSpec(4, 2, 64)
    batch = random_paged_batch(spec, [10, 3], [10, 10])  # second sequence: queries at positions 7, 8, 9
    pairs = 10 * 11 // 2 + (8 + 9 + 10)
    assert batch.flops == 4 * 64 * pairs * 4
    work, unit = run.case_work(BenchCase("p", spec, [10, 3], [10, 10], "prefill"), batch)
    assert (work, unit) == (batch.flops / 1e12, "TFLOP/s")


def test_flops_window_prefill_by_hand():
    spec = AttentionSpec(2, 1, 32, window_left=3)  # 4 keys: the query's own and 3 before it
    batch = random_paged_batch(spec, [10], [10])
    pairs = 1 + 2 + 3 + 4 * 7
    assert batch.flops == 4 * 32 * pairs * 2


def test_kv_bytes_decode_by_hand():
    spec = AttentionSpec(8, 2, 64)  # bf16: one token's K and V over 2 heads = 2 * 2 * 64 * 2 bytes
    batch = random_paged_batch(spec, [1, 1, 1], [50, 20, 33])
    assert batch.kv_bytes_read == (50 + 20 + 33) * 2 * 2 * 64 * 2
    windowed = random_paged_batch(spec.replace(window_left=9), [1, 1, 1], [50, 20, 5])
    assert windowed.kv_bytes_read == (10 + 10 + 5) * 2 * 2 * 64 * 2
    work, unit = run.case_work(BenchCase("d", spec, [1] * 3, [50, 20, 33], "decode"), batch)
    assert (work, unit) == (batch.kv_bytes_read / 1e12, "TB/s")
    assert cases.decode_kv_bytes(spec.replace(window_left=9), 3, 50) == 3 * 10 * 2 * 2 * 64 * 2


def test_design_decode_case_reads_1_07_gb():
    case = cases.design_cases()[3]
    assert case.name == "decode-hd128-b64x4096"
    assert cases.decode_kv_bytes(case.spec, 64, 4096) == 64 * 4096 * 8 * 256 * 2  # 1.07e9, as in BENCHMARKS.md


# ---- FlexAttention translation ----------------------------------------------------------------
MASK_SPECS = [AttentionSpec(4, 2, 64), AttentionSpec(4, 2, 64, window_left=5),
              AttentionSpec(4, 2, 64, causal=False, window_left=3, window_right=2),
              AttentionSpec(4, 2, 64, causal=False, window_right=0), AttentionSpec(4, 2, 64, window_left=0)]


@pytest.mark.parametrize("spec", MASK_SPECS, ids=lambda s: s.name)
@pytest.mark.parametrize("q_len,kv_len", [(12, 12), (1, 40), (5, 17)])
def test_flex_mask_mod_matches_reference_visibility(spec, q_len, kv_len):
    mask_mod = anchors.flex_mask_mod(spec, kv_len - q_len)
    q_idx, kv_idx = torch.arange(q_len)[:, None], torch.arange(kv_len)[None, :]
    got = mask_mod(torch.tensor(0), torch.tensor(0), q_idx, kv_idx)
    want = reference.visible(spec, torch.arange(kv_len - q_len, kv_len), torch.arange(kv_len))
    assert torch.equal(got, want)


def test_flex_mask_mod_none_without_a_mask():
    assert anchors.flex_mask_mod(AttentionSpec(4, 2, 64, causal=False), 0) is None


def test_flex_score_mod_soft_cap_and_alibi():
    spec = AttentionSpec(4, 2, 64, logits_soft_cap=30.0, alibi=True)
    slopes = reference.default_alibi_slopes(spec)
    q_offset = 7
    score_mod = anchors.flex_score_mod(spec, q_offset, slopes)
    score = torch.randn(4, 3, 10) * 80  # (h, q, kv): beyond the cap, so tanh matters
    h, q, kv = torch.arange(4)[:, None, None], torch.arange(3)[None, :, None], torch.arange(10)[None, None, :]
    got = score_mod(score, torch.tensor(0), h, q, kv)
    want = 30.0 * torch.tanh(score / 30.0) + slopes[:, None, None] * (kv - (q + q_offset))
    torch.testing.assert_close(got, want)
    assert anchors.flex_score_mod(AttentionSpec(4, 2, 64), 0) is None
    with pytest.raises(ValueError, match="alibi_slopes"):
        anchors.flex_score_mod(spec, 0)


FLEX_CASES = [  # (spec, q_lens, kv_lens): every translated feature, prefill and decode, GQA
    (AttentionSpec(4, 2, 64), [16, 16], [16, 16]),
    (AttentionSpec(4, 1, 64, window_left=6), [1, 1, 1], [40, 40, 40]),
    (AttentionSpec(4, 2, 64, logits_soft_cap=5.0, window_left=9, sm_scale=0.3), [24, 24], [24, 24]),
    (AttentionSpec(4, 4, 64, alibi=True), [1, 1], [33, 33]),
    (AttentionSpec(8, 2, 32, alibi=True, logits_soft_cap=2.0), [6, 6], [20, 20]),
    (AttentionSpec(4, 2, 64, causal=False, window_left=3, window_right=2), [10], [10]),
]


@pytest.mark.parametrize("spec,q_lens,kv_lens", FLEX_CASES, ids=[c[0].name for c in FLEX_CASES])
def test_flex_call_eager_on_cpu_matches_the_reference(spec, q_lens, kv_lens):
    """flex_call's closure, uncompiled (Flex's unfused path runs on CPU), against jitattn.reference."""
    batch = random_paged_batch(spec, q_lens, kv_lens, seed=1, scale=2.0)
    dense = anchors.to_contiguous(batch)
    call = anchors.flex_call(spec, dense.q, dense.k, dense.v, kv_lens[0] - q_lens[0], compiled=False)
    with torch.no_grad():
        out = dense.rows(call())
    ref = reference.paged_attention(spec, *batch.args(), **batch.kwargs())
    assert out.shape == ref.shape
    assert harness.check_error(out, ref) < 1e-2


def test_anchor_problems():
    sinks = BenchCase("d", AttentionSpec(64, 8, 64, window_left=127, sinks=True), [1], [4096], "decode")
    assert "sinks" in anchors.flex_problem(sinks.spec)
    assert anchors.flashinfer_problem(sinks.spec) is None  # FlashInfer's attention-sink variant
    assert "sinks with soft-cap" in anchors.flashinfer_problem(sinks.spec.replace(logits_soft_cap=30.0))
    assert anchors.plain_attention_problem(sinks) == "SDPA flash/cuDNN take no window, sinks"
    capped = BenchCase("p", AttentionSpec(16, 8, 256, logits_soft_cap=50.0), [8], [8], "prefill")
    assert anchors.plain_attention_problem(capped) == "SDPA flash/cuDNN take no soft-cap"
    assert anchors.flex_problem(capped.spec) is None and anchors.flashinfer_problem(capped.spec) is None
    mistral = cases.select_cases(None, [str(REPO / "examples/models/mistral-7b-v0.1.json")])
    assert [anchors.plain_attention_problem(c) for c in mistral] == [None, None]  # a 4096 window over 4096 keys
    phi3 = cases.select_cases(None, [str(REPO / "examples/models/phi-3-mini-4k-instruct.json")])
    assert [anchors.plain_attention_problem(c) for c in phi3] == ["SDPA flash/cuDNN take no window"] * 2
    assert not anchors.needs_dense(sinks, cases.ANCHORS)
    assert anchors.needs_dense(capped, ("flex",)) and not anchors.needs_dense(capped, ("sdpa", "flashinfer"))


DENSE_SHAPES = [(12, 12), (1, 40), (5, 17)]  # causal prefill, a decode row, a chunk after cached keys


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("q_len,kv_len", DENSE_SHAPES)
def test_sdpa_dense_attention_fn_matches_the_reference(causal, q_len, kv_len):
    """The SDPA anchor's call (jitattn.backends.sdpa.dense_attention_fn) on dense K/V, GQA, on CPU."""
    spec = AttentionSpec(8, 2, 64, causal=causal, q_dtype="float16")
    batch = random_paged_batch(spec, [q_len] * 2, [kv_len] * 2, seed=5)
    dense = anchors.to_contiguous(batch)
    from jitattn.backends.sdpa import dense_attention_fn

    out = dense.rows(dense_attention_fn(spec)(dense.q.float(), dense.k.float(), dense.v.float()))
    ref = reference.paged_attention(spec, *batch.args())
    assert harness.check_error(out, ref) < 1e-2


def test_sdpa_dense_attention_fn_refuses_what_sdpa_lacks():
    from jitattn.backends.sdpa import dense_attention_fn

    with pytest.raises(ValueError, match="sdpa: logits_soft_cap=50 not supported"):
        dense_attention_fn(AttentionSpec(16, 8, 256, logits_soft_cap=50.0))
    with pytest.raises(ValueError, match="sdpa: sliding window"):
        dense_attention_fn(AttentionSpec(16, 8, 128, window_left=63))


def test_sdpa_runners_drop_a_window_that_hides_nothing():
    """Mistral's 4096 window over 4096 keys: SDPA runs it as plain causal attention (the backend refuses windows)."""
    case = BenchCase("p", AttentionSpec(4, 2, 64, window_left=8), [9], [9], "prefill")
    batch = random_paged_batch(case.spec, case.q_lens, case.kv_lens, seed=6)
    dense = anchors.to_contiguous(batch)
    runners = anchors.sdpa_runners(case, dense)
    assert set(runners) == {"sdpa-flash", "sdpa-cudnn"}
    chunk = BenchCase("p", AttentionSpec(4, 2, 64), [4], [9], "prefill")
    with pytest.raises(harness.Skip, match="top-left aligned"):
        anchors.sdpa_runners(chunk, anchors.to_contiguous(random_paged_batch(chunk.spec, [4], [9])))


def test_sdpa_and_flex_skip_with_reasons():
    sinks = BenchCase("d", AttentionSpec(64, 8, 64, sinks=True), [1], [64], "decode")
    with pytest.raises(harness.Skip, match="sinks"):
        anchors.sdpa_runners(sinks, None)
    with pytest.raises(harness.Skip, match="sinks"):
        anchors.flex_runner(sinks, None)
    plain = BenchCase("p", AttentionSpec(4, 2, 64), [4, 5], [4, 5], "prefill")
    with pytest.raises(harness.Skip, match="unequal"):
        anchors.sdpa_runners(plain, None)


def test_build_runners_turns_skips_and_errors_into_rows():
    case = BenchCase("c", AttentionSpec(4, 2, 64), [1], [8], "decode")

    def skip():
        raise harness.Skip("cannot | express")

    def fail():
        raise RuntimeError("boom\nsecond line")

    (_, [skipped]), (_, [failed]) = harness.build_runners(case, "flex", skip, "TB/s"), \
        harness.build_runners(case, "flashinfer", fail, "TB/s")
    assert (skipped.status, skipped.note) == ("skipped", "cannot / express")
    assert (failed.status, failed.note) == ("failed", "RuntimeError: boom second line")
    runner = harness.Runner(lambda: torch.zeros(1))
    assert harness.build_runners(case, "jitattn", lambda: runner, "TB/s") == ({"jitattn": runner}, [])


def test_flashinfer_page_metadata_addresses_the_same_keys():
    from jitattn.reference import gather_kv

    spec = AttentionSpec(4, 2, 64, page_size=4)
    batch = random_paged_batch(spec, [1, 1, 1], [9, 4, 13], seed=2)
    indptr, indices, last = page_metadata(spec, batch.block_table, batch.seq_lens)
    assert indptr.tolist() == [0, 3, 4, 8] and last.tolist() == [1, 4, 1]
    assert indices.dtype == indptr.dtype == last.dtype == torch.int32
    for b, n in enumerate(batch.kv_lens):
        pages = indices[indptr[b]:indptr[b + 1]].long()
        k = batch.kv_cache[pages, 0].reshape(-1, 2, 64)[:n]  # NHD: (pages, 2, page_size, H, D)
        torch.testing.assert_close(k, gather_kv(spec, batch.kv_cache, batch.block_table, b, n)[0])


class FakeWrapper:
    """Records what flashinfer_runner passes to a FlashInfer wrapper; run() returns zeros of q's shape."""

    calls: list = []

    def __init__(self, *args, **kwargs):
        self._backend = "fa2"
        FakeWrapper.calls.append((type(self).__name__, "init", args[1:], kwargs))

    def plan(self, *args, **kwargs):
        FakeWrapper.calls.append((type(self).__name__, "plan", args, kwargs))

    def run(self, q, kv_cache, *extra):
        FakeWrapper.calls.append((type(self).__name__, "run", extra, {}))
        return torch.zeros_like(q)


def fake_flashinfer(with_sinks: bool = True):
    names = ["BatchDecodeWithPagedKVCacheWrapper", "BatchPrefillWithPagedKVCacheWrapper"]
    if with_sinks:
        names += ["BatchDecodeWithAttentionSinkWrapper", "BatchAttentionWithAttentionSinkWrapper"]
    module = type(sys)("flashinfer")
    module.__version__ = "0.0-fake"
    for name in names:
        setattr(module, name, type(name, (FakeWrapper,), {}))
    return module


@pytest.fixture
def flashinfer_module(monkeypatch):
    """Install a module as ``flashinfer`` (None: ``import flashinfer`` fails); the import is tried afresh."""

    def install(module):
        monkeypatch.setitem(sys.modules, "flashinfer", module)
        flashinfer_import_error.cache_clear()

    yield install
    flashinfer_import_error.cache_clear()  # the real import's outcome again, after monkeypatch restores


@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_flashinfer_runner_plumbing(monkeypatch, flashinfer_module, phase):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(anchors, "FLASHINFER_WORKSPACE_BYTES", 16)
    q_lens = [1, 1] if phase == "decode" else [5, 5]
    for spec, cls in [(AttentionSpec(16, 2, 64, logits_soft_cap=30.0, window_left=7, page_size=4), "Paged"),
                      (AttentionSpec(8, 2, 64, window_left=3, sinks=True, page_size=4), "AttentionSink")]:
        FakeWrapper.calls = []
        flashinfer_module(fake_flashinfer())
        case = BenchCase("c", spec, q_lens, [9, 9], phase)
        batch = random_paged_batch(spec, q_lens, [9, 9])
        runner = anchors.flashinfer_runner(case, batch)
        assert runner.note.startswith("fa2, plan+1st call ")
        (name, _, init_args, init_kw), (_, _, plan_args, plan_kw), (_, _, run_extra, _) = FakeWrapper.calls
        assert cls in name and ("Decode" in name) == (phase == "decode")
        assert init_args == ("NHD",)
        pages = plan_args[1:4] if phase == "prefill" else plan_args[:3]
        assert [p.tolist() for p in pages] == [[0, 3, 6], batch.block_table[:, :3].flatten().tolist(), [1, 1]]
        assert plan_args[-4:] == (spec.num_qo_heads, 2, 64, 4)
        assert plan_kw["window_left"] == spec.window_left and plan_kw["sm_scale"] == spec.sm_scale
        if phase == "prefill":
            assert plan_args[0] is batch.query_start_loc and plan_kw["causal"] is True
        if spec.sinks:
            assert run_extra[0] is batch.sinks and run_extra[1] == spec.sm_scale
            assert init_kw["window_left"] == 3 and init_kw["head_dim_qk"] == 64
        else:
            assert run_extra == () and plan_kw["logits_soft_cap"] == 30.0 and plan_kw["pos_encoding_mode"] == "NONE"
            assert phase == "prefill" or init_kw == {"use_tensor_cores": True, "backend": "fa2"}  # group 8 > 4
    flashinfer_module(fake_flashinfer(with_sinks=False))
    with pytest.raises(harness.Skip, match="has no Batch.*AttentionSinkWrapper"):
        anchors.flashinfer_runner(case, batch)


def test_flashinfer_absent_is_a_skip_with_the_import_error(flashinfer_module):
    flashinfer_module(None)  # import raises ImportError
    with pytest.raises(harness.Skip, match="import flashinfer failed: ModuleNotFoundError: import of flashinfer"):
        anchors.import_flashinfer()
    with pytest.raises(harness.Skip, match="import flashinfer failed"):  # the failure is remembered
        anchors.import_flashinfer()


# ---- tables -----------------------------------------------------------------------------------
def fake_results() -> list[Result]:
    return [
        Result("decode-x", "jitattn", 0.33, 0.30, 3.0, "TB/s", 5e-5),
        Result("decode-x", "sdpa-flash", 0.40, 0.45, 2.0, "TB/s", 2.5e-3),
        Result("decode-x", "sdpa-cudnn", 0.25, 0.24, 4.0, "TB/s", 2.5e-3),
        Result("decode-x", "flex", 0.10, 0.10, 9.0, "TB/s", 0.5, "WRONG (rel err > 0.02)"),
        Result.not_run("decode-x", "flashinfer", "TB/s", "skipped", "import flashinfer failed: ImportError"),
        Result("prefill-y", "jitattn", 8.9, nan, 247.0, "TFLOP/s", 2.3e-3, "no graph: RuntimeError"),
        Result.not_run("prefill-y", "sdpa", "TFLOP/s", "skipped", "SDPA flash/cuDNN take no soft-cap"),
    ]


def table_rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in text.splitlines()[2:]]


def test_format_table_ratios_against_the_best_correct_anchor():
    text = report.format_table(fake_results())
    header = text.splitlines()[0]
    assert "rel err (prefill > 2 seqs: 1st seq only)" in header and "vs best anchor" in header
    rows = {(r[0], r[1]): r for r in table_rows(text)}
    assert rows["decode-x", "jitattn"][2:7] == ["0.330", "0.300", "3.00 TB/s", "0.75x", "5.00e-05"]
    assert rows["decode-x", "sdpa-cudnn"][5] == "1.00x"  # the wrong, faster flex is not the best anchor
    assert rows["decode-x", "flex"][5] == "2.25x" and rows["decode-x", "flex"][7].startswith("WRONG")
    assert rows["decode-x", "flashinfer"][2:] == ["-"] * 5 + ["skipped: import flashinfer failed: ImportError"]
    assert rows["prefill-y", "jitattn"][3:6] == ["-", "247.00 TFLOP/s", "-"]  # no anchor ran: no ratio
    assert len(table_rows(text)) == len(fake_results())


def host_results() -> list[Result]:
    unit = report.HOST_UNIT
    return [Result("host-x", "jitattn", 0.216, nan, 216.0, unit, 1e-3), Result("host-x", "jitattn-kernel", 0.02, nan, 20.0,
                                                                            unit, 1e-3),
            Result("host-x", "sdpa-cudnn", 0.0177, nan, 17.7, unit, 2e-3),
            Result("host-x", "flex", 0.001, nan, 1.0, unit, 0.5, "WRONG (rel err > 0.02)"),
            Result("host-x", "torch.add", 0.0075, nan, 7.5, unit, nan)]


def test_host_rows_compare_against_the_fastest_call():
    """us per call: lower is better, so the best anchor is the fastest correct call and the ratio best / time."""
    rows = {r[1]: r for r in table_rows(report.format_table(host_results()))}
    assert report.best_anchor_rates(host_results()) == {"host-x": 7.5}  # torch.add; the wrong flex never counts
    assert rows["jitattn"][4:6] == ["216.00 us/call", "0.03x"]
    assert rows["torch.add"][5] == "1.00x" and rows["sdpa-cudnn"][5] == "0.42x"
    mixed = fake_results() + host_results()  # other cases keep higher-is-better
    assert report.best_anchor_rates(mixed)["decode-x"] == 4.0


def test_host_cases_are_issue_18s_probes_and_issue_19s_append():
    decode, mixed, append = cases.host_cases()
    assert decode.host and mixed.host and {decode.name, mixed.name} <= {c.name for c in cases.all_cases()}
    assert decode.spec == AttentionSpec(32, 8, 128, page_size=16)
    assert (decode.phase, decode.q_lens, decode.kv_lens) == ("decode", [1], [512])
    assert (mixed.phase, mixed.q_lens, mixed.kv_lens) == ("mixed", [64, 64] + [1] * 30, [512] * 32)
    assert decode.describe().startswith("host us per call, decode, 1 x (1 q, 512 kv)")
    assert cases.HOST_CALLS == 2000
    assert [c.name for c in cases.select_cases(["host"], None)] == [decode.name, mixed.name, append.name]
    assert append.host and append.name in {c.name for c in cases.all_cases()}
    assert (append.phase, append.q_lens, append.kv_lens) == ("append", [1] * 64, [512] * 64)
    assert (append.spec.num_kv_heads, append.spec.head_dim_qk, append.spec.page_size) == (8, 128, 16)
    assert (append.spec.kv_dtype, append.spec.kv_layout) == ("bfloat16", "NHD")
    assert append.describe().startswith("host us per call, append, 64 x (1 q, 512 kv)")


def _tiny_append_case() -> BenchCase:
    return BenchCase("host-append-x", AttentionSpec(4, 2, 64, page_size=4), [1] * 6, [5, 9, 1, 4, 16, 7], "append",
                     host=True)


@pytest.mark.parametrize("times, verdict", [({"jitattn": 9.0, "torch.index_copy_": 6.0}, "1.50x torch.index_copy_ "
                                             "(target <= 2x: met)"),
                                            ({"jitattn": 13.0, "torch.index_copy_": 6.0}, "2.17x torch.index_copy_ "
                                             "(target <= 2x: not met)")])
def test_append_case_rows_on_cpu(monkeypatch, times, verdict):
    """Both rows write the step's K and V into the right slots (checked against them), report us per call, and
    the jitattn row's note measures the target; the timer is replaced (it synchronises CUDA)."""
    case = _tiny_append_case()
    timed = []

    def fake_timer(fn, *, calls):
        fn()
        timed.append(calls)
        return times["jitattn" if len(timed) == 1 else "torch.index_copy_"]

    monkeypatch.setattr(host, "host_us_per_call", fake_timer)
    rows = {r.impl: r for r in host.run_append_case(case, device="cpu")}
    assert list(rows) == ["jitattn", "torch.index_copy_"] and timed == [cases.HOST_CALLS] * 2
    for impl, r in rows.items():
        assert r.status == "ok" and r.unit == report.HOST_UNIT and r.rel_err == 0.0, r
        assert r.rate == times[impl] and r.ms == pytest.approx(times[impl] / 1e3)
    assert rows["jitattn"].note.startswith(verdict + "; jitattn.append_kv(k, v, kv_cache, slot_mapping)")
    assert rows["torch.index_copy_"].note.startswith("12 rows (K, V stacked) into the cache seen flat")
    monkeypatch.setattr(host, "run_append_case", lambda c, **kw: [c.name, kw])
    assert run.run_case(case, seed=3) == [case.name, {"seed": 3, "check": True}]  # the bench's way in


def test_append_case_writes_each_sequences_last_key_slot():
    """The runners' slots: each sequence's last key (its page from the block table), K and V rows of the
    flat view; a row written wrong, or left unwritten, shows in the check."""
    case = _tiny_append_case()
    batch = random_paged_batch(case.spec, case.q_lens, case.kv_lens, device="cpu")
    runners, ref, clear = host.append_runners(case, batch)
    for impl, runner in runners.items():
        clear()
        runner.call()
        for b, n in enumerate(case.kv_lens):
            page, off = batch.block_table[b, (n - 1) // 4], (n - 1) % 4
            assert torch.equal(batch.kv_cache[page, 0, off], ref[b]), impl
            assert torch.equal(batch.kv_cache[page, 1, off], ref[len(case.kv_lens) + b]), impl
    clear()
    assert harness.check_error(runners["jitattn"].rows(None), ref) == pytest.approx(1.0)  # zeroed: all wrong


@pytest.mark.gpu
def test_host_case_on_gpu():
    """Both probes: every call form runs, is right, and reports us per call (torch.add the smallest)."""
    for case in [c for c in cases.host_cases() if c.phase != "append"]:
        rows = {r.impl: r for r in host.run_host_case(case)}
        assert {"jitattn", "jitattn-one-stream", "jitattn-kernel", "torch.add"} <= set(rows)
        for impl in ("jitattn", "jitattn-one-stream", "jitattn-kernel", "jitattn-plan"):
            if impl in rows:
                r = rows[impl]
                assert r.status == "ok" and r.unit == report.HOST_UNIT and r.rel_err < 1e-2, r
                assert r.rate > 0 and r.ms == pytest.approx(r.rate / 1e3)
        assert rows["torch.add"].status == "ok" and math.isnan(rows["torch.add"].rel_err)
        if case.phase == "mixed":
            assert rows["sdpa"].status == "skipped" and "unequal" in rows["sdpa"].note


@pytest.mark.gpu
def test_append_case_on_gpu():
    """append_kv's kernel and index_copy_ both write the right rows and report us per call; the note says the target."""
    (case,) = [c for c in cases.host_cases() if c.phase == "append"]
    rows = {r.impl: r for r in host.run_host_case(case)}
    assert list(rows) == ["jitattn", "torch.index_copy_"]
    for r in rows.values():
        assert r.status == "ok" and r.unit == report.HOST_UNIT and r.rel_err == 0.0 and r.rate > 0, r
    assert "x torch.index_copy_ (target <= 2x: " in rows["jitattn"].note


def test_format_compile_table():
    fig = CompileFigure("h32x8_d128", "sm_90a", 41.24, 40.9, 2210.0, 1850.0, 240.0, 12.34, 18.2, nan, "", 31.6)
    row = table_rows(report.format_compile_table([fig]))[0]
    assert row == ["h32x8_d128", "sm_90a", "41.2 (40.9)", "2210", "1850 (32)", "240", "12.3 (-)", "18.2", "-", ""]


def test_one_line_keeps_tables_intact():
    assert report.one_line(ValueError("a | b\n  c")) == "ValueError: a / b c"
    assert len(report.one_line("x" * 500, 40)) == 40


# ---- JSON and BENCHMARKS.md -------------------------------------------------------------------
ENV = {"date": "2026-11-30 09:00 UTC", "device": "NVIDIA H200", "driver": "580.159.04", "torch": "2.11.0+cu130",
       "cuda": "13.0", "triton": "3.6.0", "flashinfer": "unavailable (Skip: ...)",
       "nvcc": "release 13.0", "arch": "sm_90a", "jitattn": "0.1.0", "git": "abc1234",
       "command": "python -m jitattn.bench --json out.json"}


def test_json_round_trip(tmp_path):
    two = cases.design_cases()[:2]
    figs = [CompileFigure("k", "sm_90a", 40.0, 39.0, 2000.0, 1800.0, 200.0, 9.0, nan, 30.0, "flex prefill: x")]
    results = fake_results() + [Result("decode-x", "broken", 1.0, 1.0, 1.0, "TB/s", math.inf)]
    path = tmp_path / "bench.json"
    report.write_json(path, ENV, two, results, figs)
    data = json.loads(path.read_text())  # strict JSON: NaN became null, inf "inf"
    assert set(data) == {"environment", "cases", "results", "compile"}
    assert data["environment"] == ENV
    assert data["cases"][0]["name"] == "prefill-hd128-causal-b4x8192" and data["cases"][0]["batch"] == 4
    assert data["cases"][0]["spec"]["num_qo_heads"] == 32 and data["cases"][0]["check_seqs"] == 1
    assert data["results"][4]["ms"] is None and data["results"][4]["status"] == "skipped"
    assert data["results"][-1]["rel_err"] == "inf"
    assert set(data["results"][0]) == {"case", "impl", "ms", "graph_ms", "rate", "unit", "rel_err", "note", "status"}
    env, back, figs_back = report.read_json(path)
    assert env == ENV
    assert report.format_table(back) == report.format_table(results)
    assert report.format_compile_table(figs_back) == report.format_compile_table(figs)


BENCHMARKS = """# Benchmarks

Intro text.

## Latest: 2026-11-29 10:38 UTC

- old bullet

| old | table |

## The two numbers (METHOD.md)

- kept

## History (what changed, what was predicted, what happened)

| version | change |
|---|---|
| v4 | kept row |
"""


def test_write_benchmarks_md_replaces_only_the_latest_section(tmp_path):
    path = tmp_path / "BENCHMARKS.md"
    path.write_text(BENCHMARKS)
    figs = [CompileFigure("k", "sm_90a", 40.0, 39.0, 2000.0, 1800.0, 200.0, 9.0, nan, 30.0, "")]
    report.write_benchmarks_md(fake_results(), ENV, path, figs)
    text = path.read_text()
    assert text.startswith("# Benchmarks\n\nIntro text.\n\n## Latest: 2026-11-30 09:00 UTC\n")
    assert "old bullet" not in text and "| old | table |" not in text
    assert "- Command: `python -m jitattn.bench --json out.json`." in text
    assert "- Device: NVIDIA H200, driver 580.159.04, torch 2.11.0+cu130" in text
    assert report.format_table(fake_results()) in text and report.format_compile_table(figs) in text
    anchors = "- Anchors: ran: flex, sdpa-cudnn, sdpa-flash; flashinfer never ran (skipped: import flashinfer failed"
    assert anchors in text
    assert text.endswith("## The two numbers (METHOD.md)\n\n- kept\n\n## History (what changed, what was predicted, "
                         "what happened)\n\n| version | change |\n|---|---|\n| v4 | kept row |\n")
    report.write_benchmarks_md(fake_results(), ENV, path)  # idempotent: one Latest section
    assert path.read_text().count("## Latest") == 1 and "| v4 | kept row |" in path.read_text()


def test_write_benchmarks_md_inserts_a_missing_latest_section(tmp_path):
    path = tmp_path / "BENCHMARKS.md"
    path.write_text("# Benchmarks\n\nIntro.\n\n## History\n\n- v0\n")
    report.write_benchmarks_md(fake_results(), ENV, path)
    text = path.read_text()
    assert text.index("## Latest") < text.index("## History") and text.endswith("## History\n\n- v0\n")


# ---- compile figures without a GPU ------------------------------------------------------------
FAKE_NVCC = """#!/bin/sh
if [ "$1" = "--version" ]; then echo "Cuda compilation tools, release 13.0, V13.0.88"; exit 0; fi
while [ $# -gt 0 ]; do if [ "$1" = "-o" ]; then shift; printf 'not a cubin' > "$1"; fi; shift; done
"""


def test_compile_figure_without_gpu_measures_nvcc_only(tmp_path, monkeypatch):
    nvcc = tmp_path / "nvcc"
    nvcc.write_text(FAKE_NVCC)
    nvcc.chmod(0o755)
    monkeypatch.setenv("JITATTN_NVCC", str(nvcc))
    spec = AttentionSpec(4, 2, 64)
    fig = compile_figures.compile_figure(spec, {"decode"}, "sm_90a", tmp_path / "cache", gpu=False)
    assert fig.spec == spec.name and fig.arch == "sm_90a"
    assert fig.nvcc_s > 0 and fig.build_s >= 0 and math.isnan(fig.warm_load_ms)
    assert fig.note == "no CUDA device: warm load and Flex not measured"
    again = compile_figures.compile_figure(spec, {"decode"}, "sm_90a", tmp_path / "cache", gpu=False)
    assert math.isnan(again.nvcc_s) and "already cached" in again.note  # a warm cache is never reported as cold


def test_distinct_specs_with_phases():
    pool = cases.design_cases() + cases.decode_target_cases()
    specs = dict(cases.distinct_specs(pool))
    assert specs[AttentionSpec(32, 8, 128)] == {"prefill", "decode"}
    assert specs[AttentionSpec(32, 8, 128, page_size=64)] == {"decode"}
    assert specs[AttentionSpec(32, 8, 128, kv_dtype="float8_e4m3fn")] == {"decode"}
    assert len(specs) == 7


# ---- the command line -------------------------------------------------------------------------
def test_main_list_on_cpu(capsys):
    text = bench.main(BenchOptions(list=True, cases=("page",)))
    assert [ln.split()[0] for ln in text.splitlines()] == [f"decode-hd128-b64x4096-page{p}" for p in (1, 16, 64)]
    assert "decode, 64 x (1 q, 4096 kv), 32/8 heads, hd 128" in capsys.readouterr().out


def _clean_env(tmp_path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JITATTN_")}
    return {**env, "PYTHONPATH": str(REPO), "JITATTN_CACHE_DIR": str(tmp_path)}


def test_list_in_a_fresh_process(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "jitattn.bench", "--list"], capture_output=True, text=True,
                          cwd=REPO, env=_clean_env(tmp_path), timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert [ln.split()[0] for ln in proc.stdout.splitlines()] == [c.name for c in cases.all_cases()]


def test_an_installed_wheel_lists_the_same_cases(tmp_path):
    """The wheel's files laid out as pyproject.toml's hatch build section says (the packages, then each
    force-include), away from the checkout: `--list` there names every case the checkout does, the
    example-model ones included (they were missing: the configs lived only in examples/models)."""
    tomllib = pytest.importorskip("tomllib")
    import shutil

    wheel = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["hatch"]["build"]["targets"]["wheel"]
    site = tmp_path / "site-packages"
    skip = shutil.ignore_patterns("__pycache__")
    for package in wheel["packages"]:
        shutil.copytree(REPO / package, site / package, ignore=skip)
    for src, dst in wheel.get("force-include", {}).items():
        shutil.copytree(REPO / src, site / dst, ignore=skip)
    env = {**_clean_env(tmp_path / "cache"), "PYTHONPATH": str(site)}
    proc = subprocess.run([sys.executable, "-m", "jitattn", "bench", "--list"], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    listed = [ln.split()[0] for ln in proc.stdout.splitlines()]
    assert listed == [c.name for c in cases.all_cases()]
    assert any(name.startswith("decode-llama-3-8b-") for name in listed)


# torch made unimportable in a fresh process: `import torch` raises ImportError, as on a box without it.
NO_TORCH = "import sys; sys.modules['torch'] = None; from jitattn.cli import app; app(sys.argv[1:], prog_name='jitattn')"


@pytest.mark.parametrize("args, expect", [
    (["bench", "--list", "--case", "host"], "host-decode-hd128-b1x512 "),
    (["bench", "--list", "--case", "mla", "--model", "tests/models/deepseek-v3.json"],
     "decode-deepseek-v3-mla-b64x4096 "),
    (["bench", "--help"], "--from-json PATH"),
])
def test_list_and_help_need_no_torch(tmp_path, args, expect):
    """Issue 23: `jitattn bench --list` (and --help) on a box without torch (was: 'needs torch')."""
    proc = subprocess.run([sys.executable, "-c", NO_TORCH, *args], capture_output=True, text=True, cwd=REPO,
                          env=_clean_env(tmp_path), timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert expect in proc.stdout


def test_from_json_needs_no_torch(tmp_path):
    path = tmp_path / "bench.json"
    report.write_json(path, ENV, [], fake_results(), [])
    proc = subprocess.run([sys.executable, "-c", NO_TORCH, "bench", "--from-json", str(path)], capture_output=True,
                          text=True, cwd=REPO, env=_clean_env(tmp_path), timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == report.format_table(fake_results()) + "\n"


def test_timing_without_torch_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-c", NO_TORCH, "bench", "--case", "b1x32768"], capture_output=True,
                          text=True, cwd=REPO, env=_clean_env(tmp_path), timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("jitattn: error: jitattn bench runs kernels on a CUDA GPU, and cannot here: "
                                  "torch is not installed")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_main_without_gpu_says_why():
    with pytest.raises(SystemExit, match="needs a CUDA GPU.*--list, --from-json and --compile-only"):
        bench.main(BenchOptions(cases=("b1x32768",)))


def test_main_from_json_prints_and_writes_md(tmp_path, capsys):
    path, md = tmp_path / "bench.json", tmp_path / "BENCHMARKS.md"
    report.write_json(path, ENV, cases.design_cases(), fake_results(), [])
    md.write_text(BENCHMARKS)
    text = bench.main(BenchOptions(from_json=(str(path),), md=str(md)))
    assert text == report.format_table(fake_results()) + "\n" == capsys.readouterr().out
    assert "## Latest: 2026-11-30 09:00 UTC" in md.read_text() and "| v4 | kept row |" in md.read_text()


def test_main_merges_several_runs(tmp_path, capsys):
    first, second, md = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "BENCHMARKS.md"
    fig = CompileFigure("k", "sm_90a", 2.0, 1.9, 3000.0, 2500.0, 300.0, 15.0, 20.0, 12.0, "")
    report.write_json(first, ENV, [], fake_results()[:5], [])
    compile_env = {**ENV, "command": "python -m jitattn.bench --compile-only"}
    report.write_json(second, compile_env, [], fake_results()[5:], [fig])
    text = bench.main(BenchOptions(from_json=(str(first), str(second)), md=str(md)))
    assert text == report.format_table(fake_results()) + "\n\n" + report.format_compile_table([fig]) + "\n"
    written = md.read_text()
    commands = ["- Command: `python -m jitattn.bench --json out.json`.",
                "- Command: `python -m jitattn.bench --compile-only`."]
    assert "\n".join(commands) in written


def invoke_bench(monkeypatch, *args: str):
    """``jitattn bench ARGS`` through typer, with the run replaced: ``(exit code, output, options passed)``."""
    from typer.testing import CliRunner

    from jitattn import cli

    seen: list[BenchOptions] = []
    monkeypatch.setattr(cli, "gpu_problem", lambda: None)
    monkeypatch.setattr(bench, "main", seen.append)
    result = CliRunner().invoke(cli.app, ["bench", *args])
    return result.exit_code, result.output, seen


def test_cli_parses_every_option(monkeypatch, tmp_path):
    args = ["--case", "decode", "--case", "page1", "--model", "m.json", "--anchors", "flex,sdpa", "--json", "o.json",
            "--md", "B.md", "--no-check", "--host-profile", "--compile", "--seed", "7"]
    code, output, seen = invoke_bench(monkeypatch, *args)
    assert code == 0, output
    assert seen == [BenchOptions(cases=("decode", "page1"), models=("m.json",), anchors=("sdpa", "flex"),
                                 json="o.json", md="B.md", check=False, host_profile=True, compile=True, seed=7)]
    assert invoke_bench(monkeypatch)[2] == [BenchOptions()]  # no option: every case, every anchor, checked
    assert invoke_bench(monkeypatch, "--anchors", "")[2][0].anchors == ()
    only = invoke_bench(monkeypatch, "--compile-only", "--from-json", "a.json", "--from-json", "b.json", "--list")[2][0]
    assert only.compile and only.compile_only and only.list and only.from_json == ("a.json", "b.json")


def test_options_to_argv_round_trip(monkeypatch):
    """The command the environment records parses back to the same options."""
    for options in (BenchOptions(), BenchOptions(cases=("a b",), anchors=(), json="o.json", check=False, seed=3),
                    BenchOptions(compile_only=True, models=("x.json",), anchors=("flashinfer",))):
        assert invoke_bench(monkeypatch, *options.to_argv())[2] == [options]
    assert BenchOptions(cases=("a b",), json="o.json").to_argv() == ["--case", "a b", "--json", "o.json"]


def test_bad_anchor_name_is_a_usage_error(monkeypatch):
    with pytest.raises(bench.BenchUsageError, match=r"--anchors: unknown \['flashattn'\]"):
        BenchOptions(anchors=("sdpa", "flashattn"))
    code, output, seen = invoke_bench(monkeypatch, "--anchors", "sdpa,flashattn", "--list")
    assert code == 2 and seen == [] and "jitattn: error: --anchors: unknown ['flashattn']" in output
    assert BenchOptions(anchors=BenchOptions.parse_anchors("flex, sdpa")).anchors == ("sdpa", "flex")
    assert BenchOptions(compile_only=True).compile


def test_command_line_names_the_entry_point(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/x/jitattn/bench/__main__.py"])
    assert run.command_line(["--case", "a b"]) == "python -m jitattn.bench --case 'a b'"
    monkeypatch.setattr(sys, "argv", ["/venv/bin/jitattn", "bench"])
    assert run.command_line(["--json", "o.json"]) == "jitattn bench --json o.json"


@pytest.mark.parametrize("content, match", [
    (None, r"--from-json .*missing\.json: no such file"),
    ("xx", r"--from-json .*: not valid JSON .*expected the file `jitattn bench --json PATH` wrote"),
    ('{"a": 1}', r"--from-json .*: not a `jitattn bench --json` file"),
    ("[1, 2]", r"--from-json .*: not a `jitattn bench --json` file"),
])
def test_from_json_bad_file_is_a_usage_error(tmp_path, content, match):
    """A missing, non-JSON or foreign --from-json file names the file and what was expected; no traceback
    from json / pathlib (was FileNotFoundError, JSONDecodeError, KeyError 'environment')."""
    path = tmp_path / "missing.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(bench.BenchUsageError, match=match):
        bench.main(BenchOptions(from_json=(str(path),)))
    with pytest.raises(bench.BenchUsageError, match=r"--from-json .*: cannot read it \(IsADirectoryError"):
        bench.main(BenchOptions(from_json=(str(tmp_path),)))


def test_missing_model_config_is_a_usage_error(tmp_path):
    with pytest.raises(bench.BenchUsageError, match=r"--model .*nope\.json: .*model config not found"):
        bench.main(BenchOptions(models=(str(tmp_path / "nope.json"),), list=True))


def test_cli_bench_bad_arguments_exit_2_with_one_line(tmp_path):
    """`jitattn bench` reports a bad --from-json / --model / --case as one `jitattn: error:` line, exit 2."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JITATTN_")}
    for args, match in ((["--from-json", str(tmp_path / "none.json")], "no such file"),
                        (["--model", str(tmp_path / "none.json"), "--list"], "model config not found"),
                        (["--case", "no-such-case", "--list"], "matches no case")):
        proc = subprocess.run([sys.executable, "-m", "jitattn", "bench", *args], capture_output=True, text=True,
                              cwd=REPO, env={**env, "PYTHONPATH": str(REPO), "JITATTN_CACHE_DIR": str(tmp_path)},
                              timeout=300)
        assert proc.returncode == 2, proc.stderr
        assert "Traceback" not in proc.stderr
        assert proc.stderr.startswith("jitattn: error: ") and match in proc.stderr, proc.stderr


def test_model_cases_give_deepseek_its_mla_decode_case_and_refuse_a_config_with_no_cache_kind(tmp_path, monkeypatch):
    """DeepSeek-V3's kinds are latent decode and ragged prefill: the latent one gets a decode case (the
    ragged one none); a config whose kinds are all ragged is still a usage error that names them."""
    import dataclasses

    from jitattn import models
    from jitattn.models import load_model_config

    config = Path(__file__).parent / "models" / "deepseek-v3.json"
    [dec] = cases.model_cases(config)
    assert dec.name == "decode-deepseek-v3-mla-b64x4096" and dec.phase == "decode"
    assert dec.spec == load_model_config(config).layer_kinds[0].spec and dec.spec.latent
    assert (set(dec.q_lens), set(dec.kv_lens), dec.check_seqs) == ({1}, {4096}, cases.MLA_CHECK_SEQS)
    assert [c.name for c in cases.select_cases(None, [str(config)])] == [dec.name]
    assert cases.decode_kv_bytes(dec.spec, 64, 4096) == 64 * 4096 * 576 * 2  # one latent row per token

    model = load_model_config(config)
    prefill_only = dataclasses.replace(model, layer_kinds=model.layer_kinds[1:])  # the ragged mla_prefill kind alone
    monkeypatch.setattr(models, "load_model_config", lambda _: prefill_only)
    with pytest.raises(ValueError, match=r"no bench case for its layer kinds mla_prefill \(kv_storage='ragged'\)"):
        cases.model_cases(config)
    with pytest.raises(cases.BenchUsageError, match="deepseek-v3.json: no bench case"):
        cases.select_cases(None, [str(config)])


def test_one_stream_row_turns_the_fork_off_for_its_call_only():
    """The host case's ``jitattn-one-stream`` row: its call runs with the kernel's mixed launches on one
    stream, and the kernel's setting is back after it, also when the call raises."""
    kernel = SimpleNamespace(mixed_on_two_streams=True)
    seen = []
    assert host._one_stream(kernel, lambda: seen.append(kernel.mixed_on_two_streams) or "out") == "out"
    assert seen == [False] and kernel.mixed_on_two_streams is True

    def fails():
        seen.append(kernel.mixed_on_two_streams)
        raise RuntimeError("launch failed")

    with pytest.raises(RuntimeError, match="launch failed"):
        host._one_stream(kernel, fails)
    assert seen == [False, False] and kernel.mixed_on_two_streams is True
