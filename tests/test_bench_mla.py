"""jitattn.bench's MLA decode cases (issue 20) on CPU: the catalogue, units, targets, and each row's plumbing.

The FlashInfer adapter is checked against FlashInfer's documented semantics of
``BatchMLAPagedAttentionWrapper`` (``flashinfer/mla.py``: ``plan(qo_indptr, kv_indptr, kv_indices,
kv_len_arr, ...)``, ``run(q_nope, q_pe, ckv_cache, kpe_cache)``, caches ``(num_pages, page_size, dim)``),
written out in torch (:class:`FakeMLAWrapper`), since flashinfer is not installed here; the real one runs in
``test_mla_cases_on_gpu``.
"""

from __future__ import annotations

import functools
import math
import sys
import time
from pathlib import Path

import pytest
import torch

from jitattn import reference
from jitattn.bench import cases, harness, mla, report, run
from jitattn.bench.cases import BenchCase
from jitattn.bench.report import Result
from jitattn.models import load_model_config
from jitattn.spec import latent_kernel_problem
from jitattn.testing import random_paged_batch, relative_error
from tests.test_bench import flashinfer_module  # noqa: F401 (fixture: installs a fake flashinfer module)

DEEPSEEK = Path(__file__).parent / "models" / "deepseek-v3.json"
TP8, TP1, FP8 = "decode-mla-tp8-h16-b128x4096", "decode-mla-tp1-h128-b64x4096", "decode-mla-tp8-h16-b128x4096-fp8"


def tiny_case(name: str = TP8, heads: int = 16, kv_dtype: str | None = None, kv_lens=(40, 17, 64, 1, 33, 5)
              ) -> BenchCase:
    """A small latent case under a real case's name (its targets apply), page 16."""
    spec = cases.mla_spec(heads, kv_dtype).replace(page_size=16)
    return BenchCase(name, spec, [1] * len(kv_lens), list(kv_lens), "decode")


# ---- the cases ----------------------------------------------------------------------------------
def test_mla_cases_are_issue_20s_shapes_with_deepseek_v3s_specs():
    by_name = {c.name: c for c in cases.mla_cases()}
    assert list(by_name) == [TP8, TP1, FP8]
    for name, tp, batch in ((TP8, 8, 128), (TP1, 1, 64), (FP8, 8, 128)):
        c = by_name[name]
        kv_dtype = "float8_e4m3fn" if name == FP8 else None
        want = load_model_config(DEEPSEEK, tensor_parallel_size=tp, page_size=64, kv_dtype=kv_dtype).layer_kinds[0]
        assert want.name == "mla_decode" and c.spec == want.spec  # the config's dims, heads per rank and scale
        assert (c.phase, c.q_lens, c.kv_lens) == ("decode", [1] * batch, [4096] * batch)
        assert c.check_seqs == cases.MLA_CHECK_SEQS == 4
    assert by_name[TP8].spec.sm_scale == pytest.approx(192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2)
    assert [by_name[n].spec.num_qo_heads for n in (TP8, TP1)] == [16, 128]
    assert by_name[TP8].spec.page_size == cases.MLA_PAGE_SIZE == 64
    assert {c.name for c in cases.select_cases(["mla"], None)} == {TP8, TP1, FP8}
    assert by_name[TP1].describe().startswith("decode in TFLOP/s, 64 x (1 q, 4096 kv), 128/1 heads, hd 576/512")


def test_units_follow_the_h200_ridge_and_count_issue_20s_work():
    """TP8 (30 FLOP per byte of latent row) and FP8 (60) are memory-bound: TB/s; TP1 (242) compute-bound."""
    units = {c.name: cases.latent_unit(c.spec) for c in cases.mla_cases()}
    assert units == {TP8: "TB/s", TP1: "TFLOP/s", FP8: "TB/s"}
    assert cases.decode_kv_bytes(cases.mla_spec(16), 128, 4096) == 128 * 4096 * 576 * 2  # 604 MB > 2 x L2
    assert cases.decode_kv_bytes(cases.mla_spec(16, "float8_e4m3fn"), 128, 4096) == 128 * 4096 * 576
    case = tiny_case(heads=8)
    batch = random_paged_batch(case.spec, case.q_lens, case.kv_lens)
    assert mla.latent_work(case, batch) == (sum(case.kv_lens) * 576 * 2 / 1e12, "TB/s")
    big = tiny_case(TP1, heads=128, kv_lens=(9, 3))
    big_batch = random_paged_batch(big.spec, big.q_lens, big.kv_lens)
    assert mla.latent_work(big, big_batch) == (2 * (576 + 512) * 128 * 12 / 1e12, "TFLOP/s")


# ---- the FlashInfer adapter ---------------------------------------------------------------------
def flashinfer_mla_semantics(x: dict, num_heads: int, page_size: int, causal: bool, sm_scale: float,
                             ckv_scale: float = 1.0, kpe_scale: float = 1.0) -> torch.Tensor:
    """What FlashInfer's docs say ``run`` computes, in fp32: sequence ``b`` reads the pages
    ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]`` of ckv / kpe, its first ``kv_len_arr[b]`` tokens; a score is
    ``sm_scale * (q_nope . ckv + q_pe . kpe)``, the output the softmax-weighted sum of the ckv rows."""
    qo, ip, idx, lens = (x[k].tolist() for k in ("qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr"))
    out = torch.zeros(x["q_nope"].shape, dtype=torch.float32)
    for b in range(len(lens)):
        pages = torch.tensor(idx[ip[b]:ip[b + 1]], dtype=torch.long)
        ckv = x["ckv"][pages].reshape(-1, x["head_dim_ckv"])[: lens[b]].float() * ckv_scale
        kpe = x["kpe"][pages].reshape(-1, x["head_dim_kpe"])[: lens[b]].float() * kpe_scale
        n = qo[b + 1] - qo[b]
        for i in range(n):
            row = qo[b] + i
            s = sm_scale * (x["q_nope"][row].float() @ ckv.T + x["q_pe"][row].float() @ kpe.T)  # (H, L)
            if causal:
                s[:, lens[b] - n + i + 1:] = -math.inf
            out[row] = torch.softmax(s, -1) @ ckv
    return out


@pytest.mark.parametrize("kv_dtype", [None, "float8_e4m3fn"])
def test_flashinfer_mla_inputs_are_views_and_the_page_table_flashinfer_documents(kv_dtype):
    from jitattn.reference import gather_latent

    spec = cases.mla_spec(4, kv_dtype).replace(page_size=4)
    batch = random_paged_batch(spec, [1, 2, 1], [9, 4, 13], seed=2)
    x = mla.flashinfer_mla_inputs(spec, batch)
    assert x["qo_indptr"].tolist() == [0, 1, 3, 4] and x["kv_len_arr"].tolist() == [9, 4, 13]
    assert x["kv_indptr"].tolist() == [0, 3, 4, 8]  # pages per sequence: ceil(9/4), ceil(4/4), ceil(13/4)
    table = batch.block_table
    assert x["kv_indices"].tolist() == table[0, :3].tolist() + table[1, :1].tolist() + table[2, :4].tolist()
    assert all(x[k].dtype == torch.int32 for k in ("qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr"))
    assert (x["head_dim_ckv"], x["head_dim_kpe"]) == (512, 64)
    assert x["ckv"].shape == (batch.kv_cache.shape[0], 4, 512) and x["kpe"].shape == (batch.kv_cache.shape[0], 4, 64)
    assert x["ckv"].data_ptr() == batch.kv_cache.data_ptr()  # views: no copy of the cache
    assert x["ckv"].stride() == x["kpe"].stride() == (4 * 576, 576, 1)
    assert torch.equal(torch.cat([x["q_nope"], x["q_pe"]], -1), batch.q) and x["q_nope"].is_contiguous()
    for b, n in enumerate(batch.kv_lens):
        pages = x["kv_indices"][x["kv_indptr"][b]:x["kv_indptr"][b + 1]].long()
        rows = gather_latent(spec, batch.kv_cache, batch.block_table, b, n)
        assert torch.equal(x["ckv"][pages].reshape(-1, 512)[:n], rows[:, :512])
        assert torch.equal(x["kpe"][pages].reshape(-1, 64)[:n], rows[:, 512:])
    scale = batch.scales.get("k_scale", 1.0)
    got = flashinfer_mla_semantics(x, 4, 4, True, spec.sm_scale, scale, scale)
    want = reference.paged_attention(spec, *batch.args(), **batch.kwargs())
    assert relative_error(got, want) < 1e-2  # the reference output is bf16


class FakeMLAWrapper:
    """flashinfer.mla.BatchMLAPagedAttentionWrapper as documented; run() computes the documented result."""

    calls: list = []

    def __init__(self, float_workspace_buffer, use_cuda_graph=False, backend="auto"):
        self._backend = "fa3" if backend == "auto" else backend
        FakeMLAWrapper.calls.append(("init", (), {"backend": backend}))

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe, page_size,
             causal, sm_scale, q_data_type, kv_data_type):
        self.meta = dict(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices, kv_len_arr=kv_len_arr,
                         head_dim_ckv=head_dim_ckv, head_dim_kpe=head_dim_kpe)
        self.args = (num_heads, page_size, causal, sm_scale)
        FakeMLAWrapper.calls.append(("plan", (num_heads, head_dim_ckv, head_dim_kpe, page_size, causal, sm_scale,
                                              q_data_type, kv_data_type), {}))

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, out=None, lse=None, return_lse=False, *, ckv_scale=None,
            kpe_scale=None):
        FakeMLAWrapper.calls.append(("run", (), {"ckv_scale": ckv_scale, "kpe_scale": kpe_scale}))
        x = dict(self.meta, q_nope=q_nope, q_pe=q_pe, ckv=ckv_cache, kpe=kpe_cache)
        out.copy_(flashinfer_mla_semantics(x, *self.args, ckv_scale or 1.0, kpe_scale or 1.0))
        return out


class OldFakeMLAWrapper(FakeMLAWrapper):
    """A FlashInfer before FP8 MLA caches: run() has no ckv_scale / kpe_scale."""

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, out=None, lse=None, return_lse=False):
        return super().run(q_nope, q_pe, ckv_cache, kpe_cache, out)


def fake_flashinfer(wrapper: type | None = FakeMLAWrapper):
    module = type(sys)("flashinfer")
    module.__version__ = "0.0-fake"
    if wrapper is not None:
        module.mla = type(sys)("flashinfer.mla")
        module.mla.BatchMLAPagedAttentionWrapper = wrapper
    return module


@pytest.fixture(autouse=True)
def small_workspace(monkeypatch):
    monkeypatch.setattr(mla, "FLASHINFER_WORKSPACE_BYTES", 16)


@pytest.mark.parametrize("kv_dtype", [None, "float8_e4m3fn"])
def test_flashinfer_mla_runner_plans_once_and_runs_on_the_latent_views(flashinfer_module, kv_dtype):
    flashinfer_module(fake_flashinfer())
    FakeMLAWrapper.calls = []
    case = tiny_case(heads=8, kv_dtype=kv_dtype)
    batch = random_paged_batch(case.spec, case.q_lens, case.kv_lens, seed=4)
    runner = mla.flashinfer_mla_runner(case, batch)
    assert runner.note.startswith("fa3, plan+1st call ") and runner.graph
    fp8 = kv_dtype is not None
    (_, _, init), (_, plan, _), (_, _, first) = FakeMLAWrapper.calls
    assert init == {"backend": "fa3" if fp8 else "auto"}
    assert plan == (8, 512, 64, 16, True, case.spec.sm_scale, torch.bfloat16,
                    torch.float8_e4m3fn if fp8 else torch.bfloat16)
    k = batch.scales["k_scale"] if fp8 else None
    assert first == {"ckv_scale": k, "kpe_scale": k}
    out = runner.rows(runner.call())
    assert relative_error(out, reference.paged_attention(case.spec, *batch.args(), **batch.kwargs())) < 1e-2
    assert len(FakeMLAWrapper.calls) == 4  # the timed call is run() alone: plan stays outside


def test_flashinfer_mla_skips_with_reasons(flashinfer_module):
    case = tiny_case(heads=4, kv_dtype="float8_e4m3fn")
    batch = random_paged_batch(case.spec, case.q_lens, case.kv_lens)
    flashinfer_module(fake_flashinfer(OldFakeMLAWrapper))
    with pytest.raises(harness.Skip, match=r"run takes no ckv_scale / kpe_scale .*PR 3694"):
        mla.flashinfer_mla_runner(case, batch)
    bf16 = tiny_case(heads=4)
    mla.flashinfer_mla_runner(bf16, random_paged_batch(bf16.spec, bf16.q_lens, bf16.kv_lens))  # bf16 needs no scales
    flashinfer_module(fake_flashinfer(None))
    with pytest.raises(harness.Skip, match=r"flashinfer 0.0-fake has no flashinfer.mla.BatchMLAPagedAttentionWrapper"):
        mla.flashinfer_mla_runner(case, batch)
    flashinfer_module(None)
    with pytest.raises(harness.Skip, match="import flashinfer failed: ModuleNotFoundError"):
        mla.flashinfer_mla_runner(case, batch)


# ---- the jitattn and sdpa rows ------------------------------------------------------------------
def test_jitattn_row_times_jitattn_run_on_the_batch(monkeypatch):
    case = tiny_case(heads=4)
    batch = random_paged_batch(case.spec, case.q_lens, case.kv_lens)
    seen = {}

    def fake_plan_run_call(spec, b, out, max_query_len):
        seen.update(spec=spec, batch=b, max_query_len=max_query_len, out=out.shape)
        return lambda: out

    monkeypatch.setattr(mla, "plan_run_call", fake_plan_run_call)
    runner = mla.jitattn_latent_runner(case, batch)
    assert seen == {"spec": case.spec, "batch": batch, "max_query_len": 1, "out": (6, 4, 512)}
    assert runner.call().shape == (6, 4, 512) and runner.graph
    assert runner.note == "jitattn.plan once, jitattn.run timed (MLA decode kernel, none loaded on cpu)"

    def other_refusal(*args):
        raise ValueError("block_table: something else")

    monkeypatch.setattr(mla, "plan_run_call", other_refusal)
    with pytest.raises(ValueError, match="something else"):
        mla.jitattn_latent_runner(case, batch)  # only the jit backend's refusal is a skip


def test_jitattn_row_is_a_skip_with_the_reason_where_jit_does_not_serve_the_spec(monkeypatch):
    """A latent spec whose head dims the MLA kernel does not take (not multiples of 64)."""
    monkeypatch.setattr(mla, "plan_run_call", lambda *a: pytest.fail("planned a spec jit does not serve"))
    tiny = tiny_case(heads=4)
    case = BenchCase(tiny.name, tiny.spec.replace(head_dim_qk=288, head_dim_vo=256), tiny.q_lens, tiny.kv_lens,
                     "decode")
    batch = random_paged_batch(case.spec, case.q_lens, case.kv_lens)
    problem = latent_kernel_problem(case.spec)
    assert problem.startswith("head_dim_qk=288: the MLA decode kernel takes latent head dims that are multiples of 64")
    with pytest.raises(harness.Skip) as why:
        mla.jitattn_latent_runner(case, batch)
    assert str(why.value) == problem
    (_, [row]) = harness.build_runners(case, "jitattn", lambda: mla.jitattn_latent_runner(case, batch), "TB/s")
    assert (row.status, row.note) == ("skipped", report.one_line(problem))


@pytest.mark.parametrize("kv_dtype", [None, "float8_e4m3fn"])
def test_sdpa_row_is_the_sdpa_backend_with_its_gather_and_no_graph(kv_dtype):
    case = tiny_case(heads=8, kv_dtype=kv_dtype)
    batch = random_paged_batch(case.spec, case.q_lens, case.kv_lens, seed=5)
    runner = mla.sdpa_latent_runner(case, batch)
    assert not runner.graph and "gather timed" in runner.note
    out = runner.call()
    assert out.shape == (6, 8, 512) and out.dtype == torch.bfloat16
    assert relative_error(out, reference.paged_attention(case.spec, *batch.args(), **batch.kwargs())) < 1e-2
    with pytest.raises(harness.Skip, match="sdpa row is the dense anchor"):
        mla.flex_latent_runner(case, batch)


# ---- end to end on the CPU ----------------------------------------------------------------------
def cpu_timer(fn, **kwargs) -> float:
    """harness.time_ms / time_graph_ms on the CPU: one call's wall milliseconds."""
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def reference_plan_run_call(spec, batch, out, max_query_len):
    """mla.plan_run_call on the CPU: the call writes the reference's output into ``out``."""
    def call():
        return out.copy_(reference.paged_attention(spec, *batch.args(), **batch.kwargs()))

    return call


def test_a_tiny_latent_case_end_to_end_through_run_case(monkeypatch, flashinfer_module):
    """run_case on the CPU (timers replaced, jitattn.run by the reference): jitattn, sdpa and FlashInfer's MLA
    wrapper (the documented-semantics fake) timed and right, the targets on the jitattn row, flex skipped."""
    monkeypatch.setattr(harness, "time_ms", cpu_timer)
    monkeypatch.setattr(harness, "time_graph_ms", cpu_timer)
    monkeypatch.setattr(mla, "plan_run_call", reference_plan_run_call)
    flashinfer_module(fake_flashinfer())
    case = tiny_case(TP8, heads=8)
    rows = run.run_case(case, device="cpu")
    assert [(r.impl, r.status) for r in rows] == [("jitattn", "ok"), ("sdpa", "ok"), ("flex", "skipped"),
                                                 ("flashinfer-mla", "ok")]
    jit, sdpa, _, fi = rows
    assert jit.note.startswith(f"{jit.rate:.2f} TB/s (target >= 3.6 TB/s: ")
    assert "x flashinfer-mla (target >= 1.0x flashinfer-mla: " in jit.note
    assert all(r.unit == "TB/s" for r in rows)
    assert jit.rel_err < 1e-2 and sdpa.rel_err < 1e-2 and fi.rel_err < 1e-2
    assert math.isnan(sdpa.graph_ms) and "no graph: host-side metadata reads" in sdpa.note
    assert not math.isnan(fi.graph_ms) and not math.isnan(jit.graph_ms)
    work = sum(case.kv_lens) * 576 * 2 / 1e12
    assert sdpa.rate == pytest.approx(work / (sdpa.ms / 1e3))
    tflops = 2 * (576 + 512) * 8 * sum(case.kv_lens) / 1e12 / (sdpa.ms / 1e3)
    assert sdpa.note.startswith(f"= {tflops:.2f} TFLOP/s; err on 4 of 6 seqs; sdpa backend")
    table = report.format_table(rows)
    assert "| decode-mla-tp8-h16-b128x4096 | flashinfer-mla |" in table


def test_targets_measured_on_the_jitattn_row():
    def rows(name, jit_ms, fi_ms, unit="TB/s", work=1e-3):
        return [Result(name, "jitattn", jit_ms, jit_ms, work / (jit_ms / 1e3), unit, 1e-3),
                Result(name, "flashinfer-mla", fi_ms, fi_ms, work / (fi_ms / 1e3), unit, 1e-3)]

    case = tiny_case(TP8, heads=8)
    batch = random_paged_batch(case.spec, case.q_lens, case.kv_lens)
    met = rows(TP8, 0.2, 0.25)  # 5.0 TB/s, 1.25x FlashInfer
    mla.add_notes(case, batch, met)
    assert met[0].note.startswith("5.00 TB/s (target >= 3.6 TB/s: met); 1.25x flashinfer-mla (target >= 1.0x "
                                  "flashinfer-mla: met); = ")
    slow = rows(TP8, 0.5, 0.25)  # 2.0 TB/s, 0.5x
    mla.add_notes(case, batch, slow)
    assert "2.00 TB/s (target >= 3.6 TB/s: not met); 0.50x flashinfer-mla (target >= 1.0x flashinfer-mla: not met)" \
        in slow[0].note
    fp8_case = tiny_case(FP8, heads=8, kv_dtype="float8_e4m3fn")
    fp8 = rows(FP8, 0.25, 0.3)
    mla.add_notes(fp8_case, random_paged_batch(fp8_case.spec, fp8_case.q_lens, fp8_case.kv_lens), fp8)
    assert fp8[0].note.startswith(f"target >= 1.6x faster than {TP8} (jitattn); = ")
    mla.add_ratio_targets(slow + fp8)  # 0.5 ms bf16 / 0.25 ms FP8
    assert fp8[0].note.startswith(f"2.00x faster than {TP8} (target >= 1.6x: met); = ")
    lone = rows(FP8, 0.25, 0.3)
    mla.add_notes(fp8_case, random_paged_batch(fp8_case.spec, fp8_case.q_lens, fp8_case.kv_lens), lone)
    mla.add_ratio_targets(lone)  # the bf16 case did not run: the target stays as text
    assert lone[0].note.startswith(f"target >= 1.6x faster than {TP8} (jitattn)")


def test_run_adds_the_cross_case_targets_after_every_case(monkeypatch):
    order = []
    monkeypatch.setattr(run, "run_case_safely", lambda case, **kw: order.append(case.name) or [])
    monkeypatch.setattr(run, "add_ratio_targets", lambda results: order.append("targets"))
    monkeypatch.setattr(run, "environment", lambda *a: {})
    from jitattn.bench import BenchOptions

    run.run(BenchOptions(), cases.mla_cases())
    assert order == [TP8, TP1, FP8, "targets"]


# ---- on a GPU ------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_mla_cases_on_gpu(monkeypatch):
    """The three MLA cases at their real shapes, few timed calls: jitattn (the MLA decode kernel), sdpa and
    FlashInfer's MLA wrapper (where installed) right against the reference, rates positive."""
    monkeypatch.setattr(harness, "time_ms", functools.partial(harness.time_ms, warmup=1, rep=2, trials=1))
    monkeypatch.setattr(harness, "time_graph_ms", functools.partial(harness.time_graph_ms, rep=2, trials=1))
    results = []
    for case in cases.mla_cases():
        rows = {r.impl: r for r in run.run_case_safely(case)}
        assert {"jitattn", "sdpa", "flex"} <= set(rows) and ("flashinfer-mla" in rows or "flashinfer" in rows), rows
        jit = rows["jitattn"]
        assert latent_kernel_problem(case.spec) is None
        assert jit.status == "ok" and jit.rel_err < report.MAX_REL_ERR and jit.rate > 0, jit
        assert rows["sdpa"].status == "ok" and rows["sdpa"].rel_err < report.MAX_REL_ERR, rows["sdpa"]
        fi = rows.get("flashinfer-mla") or rows["flashinfer"]
        assert fi.status in ("ok", "skipped"), fi
        if fi.status == "ok":
            assert fi.rel_err < report.MAX_REL_ERR and fi.rate > 0, fi
        assert all(r.unit == cases.latent_unit(case.spec) for r in rows.values())
        results += rows.values()
    mla.add_ratio_targets(results)
    print(report.format_table(results))
