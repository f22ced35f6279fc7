"""The MLA decode cases (issue 20): jitattn, torch SDPA and FlashInfer's MLA wrapper on one latent batch.

A latent (multi-head latent attention) case is :func:`jitattn.bench.cases.mla_cases`' spec over a
random latent cache ``(num_pages, page_size, 576)``: each token's row is ``c_kv`` (512) then ``k_pe``
(64), one row shared by every query head; V is the row's first 512 values. Its rows, side by side:

- ``jitattn``: ``jitattn.plan`` once, ``jitattn.run`` timed (:func:`jitattn.bench.host.plan_run_call`): the MLA
  decode kernel (templates/mla_decode.cuh). Where the jit backend does not serve the spec (latent head dims
  not multiples of 64) the row is "skipped" with :func:`jitattn.spec.latent_kernel_problem`'s text.
- ``sdpa``: :mod:`jitattn.backends`' sdpa backend on the paged batch, what ``jitattn.select`` serves for the
  latent specs the MLA kernel does not take. The timed call includes the gather: per sequence, its latent
  rows are copied out of the pages, then one SDPA call takes the ``q_len x H`` query rows as one head's; it
  reads the metadata on the host (a sync per call), so it is timed eagerly, with no CUDA graph.
- ``flashinfer-mla``: ``flashinfer.mla.BatchMLAPagedAttentionWrapper`` (:func:`flashinfer_mla_runner`),
  planned once, ``run`` timed; ``ckv`` / ``kpe`` are views of the same latent cache.
- ``flex``: a "skipped" row; the sdpa row is the dense anchor of these cases.

Units (:func:`jitattn.bench.cases.latent_unit`): TB/s of latent rows read (576 values per token, once)
where the case is memory-bound (16 heads), TFLOP/s at 2 x (576 + 512) FLOPs per query head and key where
it is compute-bound (128 heads); every timed row's note has the other figure. Issue 20's targets
(:data:`TARGETS`) are in the jitattn row's note, measured when it ran. Errors: the first
:data:`~jitattn.bench.cases.MLA_CHECK_SEQS` sequences against the fp32 reference.
"""

from __future__ import annotations

import inspect
import math
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from jitattn.backends.flashinfer import page_metadata
from jitattn.bench.anchors import FLASHINFER_WORKSPACE_BYTES, import_flashinfer
from jitattn.bench.cases import BenchCase, latent_unit
from jitattn.bench.harness import Runner, Skip
from jitattn.bench.host import plan_run_call
from jitattn.bench.report import Result
from jitattn.reference import torch_dtype
from jitattn.spec import AttentionSpec, latent_kernel_problem
from jitattn.testing import PagedBatch

#: The row name of FlashInfer's MLA wrapper (family "flashinfer").
FLASHINFER_MLA = "flashinfer-mla"


@dataclass(frozen=True)
class Target:
    """Issue 20's target of one case, on the jitattn row.

    Attributes:
        rate: the jitattn row's rate must be at least this, in the case's unit (None: no rate target).
        vs_flashinfer: jitattn's rate over ``flashinfer-mla``'s must be at least this (None: none).
        faster_than: ``(case, ratio)``: that case's jitattn time over this case's must be at least ``ratio``
            (the FP8 cache against the bf16 one).
    """

    rate: float | None = None
    vs_flashinfer: float | None = None
    faster_than: tuple[str, float] | None = None


TARGETS = {
    "decode-mla-tp8-h16-b128x4096": Target(rate=3.6, vs_flashinfer=1.0),
    "decode-mla-tp1-h128-b64x4096": Target(rate=450.0, vs_flashinfer=1.0),
    "decode-mla-tp8-h16-b128x4096-fp8": Target(faster_than=("decode-mla-tp8-h16-b128x4096", 1.6)),
}


# ---- the rows -----------------------------------------------------------------------------------
def new_out(spec: AttentionSpec, batch: PagedBatch) -> torch.Tensor:
    """An output ``(total_q, num_qo_heads, head_dim_vo)`` in the spec's o dtype, on the batch's device."""
    return torch.empty(batch.q.shape[0], spec.num_qo_heads, spec.head_dim_vo, dtype=torch_dtype(spec.o_dtype),
                       device=batch.q.device)


def jitattn_latent_runner(case: BenchCase, batch: PagedBatch) -> Runner:
    """``jitattn.plan`` once and ``jitattn.run`` timed, as for any spec.

    Raises:
        Skip: the jit backend does not serve the spec (:func:`jitattn.spec.latent_kernel_problem`: head dims
            the MLA kernel does not take), with that reason.
    """
    why = latent_kernel_problem(case.spec)
    if why:
        raise Skip(why)
    call = plan_run_call(case.spec, batch, new_out(case.spec, batch), max(case.q_lens))
    return Runner(call, note=f"jitattn.plan once, jitattn.run timed (MLA decode kernel, "
                  f"{mla_kernel_name(case.spec, batch.q.device)})")


def mla_kernel_name(spec: AttentionSpec, device: torch.device) -> str:
    """Which MLA decode kernel the cubin loaded on ``device`` runs, read off its geometry (templates/attention.cu.j2,
    MlaLaunch): tiles of flattened query rows (``prefill_block_m``) of 64 on 256 threads, or of 16 / 32 with
    swapped operands, else mma.sync's tiles of 16 heads. Off CUDA (a bench test's CPU batch) nothing is loaded."""
    if device.type != "cuda":
        return f"none loaded on {device}"
    from jitattn.runtime import load_kernel

    g = load_kernel(spec, device).geometry
    if not g["prefill_block_m"]:
        return "mma.sync"
    if g["decode_threads"] == 256:
        return "warpgroup MMA, 64-row tiles"
    return f"warpgroup MMA, swapped operands, {g['prefill_block_m']}-row tiles"


def sdpa_latent_runner(case: BenchCase, batch: PagedBatch) -> Runner:
    """jitattn.backends' sdpa backend on the paged latent batch (its gather of each sequence's rows is timed)."""
    from jitattn.selector import select

    fn = select(case.spec, batch.q.device, "decode", backend="sdpa").build()
    out = new_out(case.spec, batch)
    return Runner(lambda: fn(*batch.args(), out=out, **batch.scales), graph=False,
                  note="sdpa backend: per sequence its latent rows gathered from the pages, then SDPA (gather timed)")


def flashinfer_mla_inputs(spec: AttentionSpec, batch: PagedBatch) -> dict[str, Any]:
    """The arguments of FlashInfer's MLA wrapper for a latent batch (no flashinfer import).

    Returns a dict of:
        ``qo_indptr`` int32 ``(B+1,)``: the batch's ``query_start_loc``;
        ``kv_indptr`` int32 ``(B+1,)`` and ``kv_indices`` int32 ``(kv_indptr[-1],)``: sequence ``b``'s pages are
        ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``, its first ``ceil(seq_lens[b] / page_size)`` block-table
        entries (:func:`jitattn.backends.flashinfer.page_metadata`);
        ``kv_len_arr`` int32 ``(B,)``: the keys of each sequence (``seq_lens``);
        ``q_nope`` ``(total_q, H, head_dim_vo)`` and ``q_pe`` ``(total_q, H, head_dim_qk - head_dim_vo)``:
        contiguous copies of the two parts of ``q`` (an engine computes them apart);
        ``ckv`` ``(num_pages, page_size, head_dim_vo)`` and ``kpe`` ``(num_pages, page_size, rope)``:
        views of the latent cache (row stride head_dim_qk), no copy;
        ``head_dim_ckv``, ``head_dim_kpe``: 512 and 64 for DeepSeek.
    """
    dv = spec.head_dim_vo
    kv_indptr, kv_indices, _ = page_metadata(spec, batch.block_table, batch.seq_lens)
    return {"qo_indptr": batch.query_start_loc.to(torch.int32), "kv_indptr": kv_indptr, "kv_indices": kv_indices,
            "kv_len_arr": batch.seq_lens.to(torch.int32), "q_nope": batch.q[..., :dv].contiguous(),
            "q_pe": batch.q[..., dv:].contiguous(), "ckv": batch.kv_cache[..., :dv], "kpe": batch.kv_cache[..., dv:],
            "head_dim_ckv": dv, "head_dim_kpe": spec.head_dim_qk - dv}


def flashinfer_mla_runner(case: BenchCase, batch: PagedBatch) -> Runner:
    """``flashinfer.mla.BatchMLAPagedAttentionWrapper`` on the latent cache: ``plan`` once, ``run`` timed.

    The API (FlashInfer's ``flashinfer/mla.py`` docstrings, docs.flashinfer.ai/api/mla.html):
    ``BatchMLAPagedAttentionWrapper(workspace, backend=...)``; ``plan(qo_indptr, kv_indptr, kv_indices,
    kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe, page_size, causal, sm_scale, q_data_type,
    kv_data_type)``; ``run(q_nope, q_pe, ckv_cache, kpe_cache, out=...)`` with ``ckv_cache``
    ``(num_pages, page_size, head_dim_ckv)`` and ``kpe_cache`` ``(num_pages, page_size, head_dim_kpe)``.
    An FP8 e4m3 cache with bf16 queries runs on the ``fa3`` backend (SM90) with the per-tensor
    ``ckv_scale`` / ``kpe_scale`` keywords of ``run`` (flashinfer PR 3694); a FlashInfer whose ``run``
    has no such keywords is a skip. The note has FlashInfer's backend and the plan + first call seconds.
    The kernels take the views' strides (``ckv_cache.stride(0)`` / ``stride(1)``, as SGLang passes its
    576-wide cache); flashinfer issue 1341 reports fa2 wrong on non-contiguous inputs, which would show
    here as a WRONG row.

    Raises:
        Skip: flashinfer does not import, has no MLA wrapper, or cannot take the FP8 cache.
    """
    fi = import_flashinfer()
    version = getattr(fi, "__version__", "?")
    cls = getattr(getattr(fi, "mla", None), "BatchMLAPagedAttentionWrapper", None)
    if cls is None:
        raise Skip(f"flashinfer {version} has no flashinfer.mla.BatchMLAPagedAttentionWrapper")
    spec = case.spec
    fp8 = spec.kv_dtype == "float8_e4m3fn"
    scales: dict[str, float] = {}
    if fp8:
        if not {"ckv_scale", "kpe_scale"} <= set(inspect.signature(cls.run).parameters):
            raise Skip(f"flashinfer {version}: BatchMLAPagedAttentionWrapper.run takes no ckv_scale / kpe_scale "
                       f"(an FP8 latent cache needs flashinfer with PR 3694: fa3 backend, SM90)")
        scales = {"ckv_scale": batch.scales["k_scale"], "kpe_scale": batch.scales["k_scale"]}
    x = flashinfer_mla_inputs(spec, batch)
    workspace = torch.zeros(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=batch.q.device)
    t0 = time.perf_counter()
    wrapper = cls(workspace, backend="fa3" if fp8 else "auto")
    wrapper.plan(x["qo_indptr"], x["kv_indptr"], x["kv_indices"], x["kv_len_arr"], spec.num_qo_heads,
                 x["head_dim_ckv"], x["head_dim_kpe"], spec.page_size, spec.causal, spec.sm_scale,
                 torch_dtype(spec.q_dtype), torch_dtype(spec.kv_dtype))
    out = new_out(spec, batch)
    call = lambda: wrapper.run(x["q_nope"], x["q_pe"], x["ckv"], x["kpe"], out=out, **scales)  # noqa: E731
    call()
    if batch.q.is_cuda:
        torch.cuda.synchronize()
    return Runner(call, note=f"{getattr(wrapper, '_backend', '?')}, plan+1st call {time.perf_counter() - t0:.1f} s; "
                             f"ckv/kpe views of the latent cache")


def flex_latent_runner(case: BenchCase, batch: PagedBatch) -> Runner:
    """Always raises Skip: the latent cases' dense anchor is the sdpa row."""
    raise Skip("latent (MLA) case: no Flex translation of the latent cache; the sdpa row is the dense anchor")


def latent_builders(case: BenchCase, batch: PagedBatch) -> dict[str, Callable[[], Runner]]:
    """Each row family's builder for a latent case (called by :func:`jitattn.bench.harness.build_runners`)."""
    return {"jitattn": lambda: jitattn_latent_runner(case, batch), "sdpa": lambda: sdpa_latent_runner(case, batch),
            "flex": lambda: flex_latent_runner(case, batch),
            "flashinfer": lambda: {FLASHINFER_MLA: flashinfer_mla_runner(case, batch)}}


# ---- units and targets --------------------------------------------------------------------------
def latent_work(case: BenchCase, batch: PagedBatch) -> tuple[float, str]:
    """``(work, unit)`` of a latent case: TB of latent rows read or TFLOP (:func:`~jitattn.bench.cases.latent_unit`)."""
    unit = latent_unit(case.spec)
    return (batch.flops if unit == "TFLOP/s" else batch.kv_bytes_read) / 1e12, unit


def add_notes(case: BenchCase, batch: PagedBatch, results: list[Result]) -> None:
    """Every timed row's figure in the other unit, the rows checked, then the jitattn row's targets (first)."""
    unit = latent_unit(case.spec)
    other, other_work = ("TB/s", batch.kv_bytes_read) if unit == "TFLOP/s" else ("TFLOP/s", batch.flops)
    for r in results:
        if r.status == "ok":
            extra = f"= {other_work / 1e12 / (_best_ms(r) / 1e3):.2f} {other}"
            if case.check_seqs < len(case.q_lens) and not math.isnan(r.rel_err):
                extra += f"; err on {case.check_seqs} of {len(case.q_lens)} seqs"
            r.note = "; ".join(n for n in (extra, r.note) if n)
    target = TARGETS.get(case.name)
    mine = next((r for r in results if r.impl == "jitattn"), None)
    if target is None or mine is None:
        return
    rows = {r.impl: r for r in results if r.status == "ok"}
    parts = []
    if target.rate is not None:
        parts.append(_verdict(f">= {target.rate:g} {unit}", mine.rate / target.rate if "jitattn" in rows else None,
                              f"{mine.rate:.2f} {unit}"))
    if target.vs_flashinfer is not None:
        ratio = mine.rate / rows[FLASHINFER_MLA].rate if {"jitattn", FLASHINFER_MLA} <= set(rows) else None
        parts.append(_verdict(f">= {target.vs_flashinfer:.1f}x {FLASHINFER_MLA}",
                              None if ratio is None else ratio / target.vs_flashinfer,
                              "" if ratio is None else f"{ratio:.2f}x {FLASHINFER_MLA}"))
    if target.faster_than is not None:  # measured after the run (add_ratio_targets): both cases' rows are needed
        parts.append(_faster_text(*target.faster_than))
    first = (mine.note, "; ".join(parts)) if mine.status != "ok" else ("; ".join(parts), mine.note)  # a skip: why first
    mine.note = "; ".join(p for p in first if p)


def _verdict(target: str, fraction: float | None, measured: str) -> str:
    """``<measured> (target <target>: met)`` / ``not met``, or ``target <target>`` when it was not measured."""
    if fraction is None:
        return f"target {target}"
    return f"{measured} (target {target}: {'met' if fraction >= 1 else 'not met'})"


def add_ratio_targets(results: list[Result]) -> None:
    """The cross-case targets (FP8 vs bf16), measured on each case's jitattn row once every case has run."""
    jit = {r.case: r for r in results if r.impl == "jitattn"}
    for name, target in TARGETS.items():
        if target.faster_than is None or name not in jit:
            continue
        other, bound = target.faster_than
        mine, base = jit[name], jit.get(other)
        if mine.status != "ok" or base is None or base.status != "ok":
            continue
        ratio = _best_ms(base) / _best_ms(mine)
        verdict = "met" if ratio >= bound else "not met"
        mine.note = mine.note.replace(_faster_text(other, bound),
                                      f"{ratio:.2f}x faster than {other} (target >= {bound:.1f}x: {verdict})")


def _faster_text(other: str, bound: float) -> str:
    return f"target >= {bound:.1f}x faster than {other} (jitattn)"


def _best_ms(r: Result) -> float:
    return r.graph_ms if not math.isnan(r.graph_ms) else r.ms
