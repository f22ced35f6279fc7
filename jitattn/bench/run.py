"""One case end to end, and the whole run: jitattn's runners, the anchors', the reference, the environment.

:func:`run_case` makes one random batch, the fp32 reference of its rows, jitattn's runners
(:func:`jitattn_runner`: the paged call, and per case the ragged twin, the separate prefill + decode
calls, or the cascade against the plain call) and each anchor's (:mod:`jitattn.bench.anchors`; a latent
(MLA) case's rows are :mod:`jitattn.bench.mla`'s), then checks and times each
(:func:`jitattn.bench.harness.run_impl`). :func:`run` does every case, after the compile figures when
asked, writing the JSON after each step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from jitattn.bench.anchors import anchor_builders, import_flashinfer, needs_dense, to_contiguous
from jitattn.bench.cases import ANCHORS, REPO, BenchCase, latent_unit
from jitattn.bench.compile_figures import device_arch, run_compile_figures
from jitattn.bench.harness import Runner, build_runners, run_impl
from jitattn.bench.mla import add_notes, add_ratio_targets, latent_builders, latent_work
from jitattn.bench.report import HOST_UNIT, STEP_UNIT, CompileFigure, Result, one_line, write_json
from jitattn.reference import torch_dtype
from jitattn.spec import AttentionSpec
from jitattn.testing import PagedBatch, random_paged_batch

if TYPE_CHECKING:
    from jitattn.bench import BenchOptions


# ---- jitattn's runners ------------------------------------------------------------------------
def jitattn_runner(case: BenchCase, batch: PagedBatch) -> Runner | dict[str, Runner]:
    """jitattn's kernels on the paged batch (compiled or loaded from the cache on first use)."""
    from jitattn.runtime import load_kernel

    kernel = load_kernel(case.spec)
    hint = 1 if case.is_decode else None
    out = torch.empty(batch.q.shape[0], case.spec.num_qo_heads, case.spec.head_dim_vo,
                      dtype=torch_dtype(case.spec.o_dtype), device=batch.q.device)
    call = lambda: kernel.paged_attention(*batch.args(), **batch.kwargs(), out=out, max_query_len=hint)  # noqa: E731
    if case.ragged_twin:
        return {"jitattn": Runner(call, note=f"{kernel.entry.arch}, paged (page {case.spec.page_size})"),
                "jitattn-ragged": ragged_twin_runner(case, batch)}
    if case.is_decode:  # the serving loop's form too: plan once per step, run per layer (eager vs graph)
        from jitattn.bench.host import plan_run_call

        return {"jitattn": Runner(call, note=f"{kernel.entry.arch}"),
                "jitattn-run": Runner(plan_run_call(case.spec, batch, out, 1), note="plan once, jitattn.run")}
    if case.phase != "mixed":
        return Runner(call, note=f"{kernel.entry.arch}")
    # The same batch as two calls, the prefill sequences then the decode rows: what one call must beat.
    n = sum(1 for ql in batch.q_lens if ql > 1)
    first, rest = split_batch(batch, n)
    rows = first.q.shape[0]

    def separate() -> torch.Tensor:
        kernel.paged_attention(*first.args(), **first.kwargs(), out=out[:rows])
        kernel.paged_attention(*rest.args(), **rest.kwargs(), out=out[rows:], max_query_len=1)
        return out

    return {"jitattn": Runner(call, note=f"{kernel.entry.arch}, one call"),
            "jitattn-separate": Runner(separate, note=f"prefill call ({n} seqs) + decode call, same kernels")}


def ragged_twin_inputs(case: BenchCase, batch: PagedBatch
                       ) -> tuple[AttentionSpec, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ragged spec, k, v, kv_start_loc)``: the paged batch's K/V copied out to contiguous varlen tensors."""
    from jitattn.reference import gather_kv

    spec = case.spec.replace(kv_storage="ragged")
    ks, vs = zip(*(gather_kv(case.spec, batch.kv_cache, batch.block_table, i, n) for i, n in enumerate(batch.kv_lens)))
    k, v = torch.cat(ks).contiguous(), torch.cat(vs).contiguous()
    kv_start_loc = torch.tensor([0, *itertools.accumulate(batch.kv_lens)], dtype=torch.int32, device=k.device)
    return spec, k, v, kv_start_loc


def ragged_twin_runner(case: BenchCase, batch: PagedBatch) -> Runner:
    """The paged batch's K/V copied out to contiguous varlen tensors, run by the ragged spec's kernel."""
    from jitattn.runtime import load_kernel

    spec, k, v, kv_start_loc = ragged_twin_inputs(case, batch)
    kernel = load_kernel(spec)
    out = torch.empty(batch.q.shape[0], spec.num_qo_heads, spec.head_dim_vo, dtype=torch_dtype(spec.o_dtype),
                      device=batch.q.device)
    kw = {"sinks": batch.sinks, "alibi_slopes": batch.alibi_slopes, "params": batch.params}
    call = lambda: kernel.ragged_attention(batch.q, k, v, batch.query_start_loc, kv_start_loc, **kw,  # noqa: E731
                                           out=out)
    return Runner(call, note=f"{kernel.entry.arch}, contiguous varlen K/V")


def split_batch(batch: PagedBatch, n: int) -> tuple[PagedBatch, PagedBatch]:
    """Sequences ``[0, n)`` and ``[n, B)`` of ``batch`` as two batches over the same KV cache (views)."""
    qsl = batch.query_start_loc
    rows = int(qsl[n])
    first = dataclasses.replace(batch, q=batch.q[:rows], block_table=batch.block_table[:n],
                                seq_lens=batch.seq_lens[:n], query_start_loc=qsl[: n + 1],
                                q_lens=batch.q_lens[:n], kv_lens=batch.kv_lens[:n])
    rest = dataclasses.replace(batch, q=batch.q[rows:], block_table=batch.block_table[n:],
                               seq_lens=batch.seq_lens[n:], query_start_loc=qsl[n:] - rows,
                               q_lens=batch.q_lens[n:], kv_lens=batch.kv_lens[n:])
    return first, rest


def cascade_runners(case: BenchCase, cb: Any) -> dict[str, Runner]:
    """The cascade and the plain decode call on one :func:`jitattn.testing.random_cascade_batch`."""
    from jitattn.cascade import cascade_attention, plain_metadata, plan_cascade
    from jitattn.runtime import load_kernel

    spec, plain = case.spec, cb.plain
    aligned = all(n % spec.page_size == 0 for n in cb.prefix_lens)
    if aligned:  # the shared prefix pages themselves in every request's table, as prefix caching does
        args = (cb.q, cb.kv_cache, *plain_metadata(spec, cb.levels, cb.q.shape[0]))
        how = "prefix pages shared by every table"
    else:
        args = plain.args()
        how = "prefix ends mid-page: each request's copy"
    kernel = load_kernel(spec)
    out = torch.empty_like(cb.q)
    plan = plan_cascade(spec, cb.levels, cb.q.shape[0],
                        num_sms=torch.cuda.get_device_properties(cb.q.device).multi_processor_count)
    chunks = plan.num_states - 1
    return {"jitattn": Runner(lambda: cascade_attention(spec, cb.q, cb.kv_cache, cb.levels, plan=plan),
                              note=f"{kernel.entry.arch}, cascade, prefix in {chunks} chunks, planned ahead"),
            "jitattn-plain": Runner(lambda: kernel.paged_attention(*args, out=out, max_query_len=1),
                                    note=f"plain decode call, {how}")}


# ---- one case ---------------------------------------------------------------------------------
def case_work(case: BenchCase, batch: PagedBatch) -> tuple[float, str]:
    """``(work, unit)``: decode TB of K/V read and "TB/s"; prefill TFLOP and "TFLOP/s"; a latent case's
    by :func:`jitattn.bench.mla.latent_work`."""
    if case.spec.latent:
        return latent_work(case, batch)
    if case.is_decode:
        return batch.kv_bytes_read / 1e12, "TB/s"
    return batch.flops / 1e12, "TFLOP/s"


def reference_rows(case: BenchCase, batch: PagedBatch) -> torch.Tensor:
    """The fp32 reference for the first ``case.check_seqs`` sequences: ``(rows, H_qo, D)``, rows from row 0."""
    from jitattn import reference

    n = case.check_seqs
    if n == len(batch.q_lens):
        return reference.paged_attention(case.spec, *batch.args(), **batch.kwargs())
    qsl = batch.query_start_loc[: n + 1]
    rows = int(qsl[-1])
    return reference.paged_attention(case.spec, batch.q[:rows], batch.kv_cache, batch.block_table[:n],
                                     batch.seq_lens[:n], qsl, **batch.kwargs())


def run_cascade_case(case: BenchCase, *, seed: int, check: bool) -> list[Result]:
    """A cascade case: the cascade against the plain decode call, errors against the un-split reference."""
    from jitattn import reference
    from jitattn.testing import random_cascade_batch

    r, p, s = case.cascade
    cb = random_cascade_batch(case.spec, [p], [r], [s] * r, [1] * r, device="cuda", seed=seed)
    work, unit = cb.plain.kv_bytes_read / 1e12, "TB/s"
    ref = reference.paged_attention(case.spec, *cb.plain.args()) if check else None
    runners, rows = build_runners(case, "jitattn", lambda: cascade_runners(case, cb), unit)
    return rows + [run_impl(case, impl, runner, work, unit, ref) for impl, runner in runners.items()]


def run_case(case: BenchCase, *, seed: int = 0, check: bool = True, anchors: tuple[str, ...] = ANCHORS,
             device: str = "cuda") -> list[Result]:
    """Time jitattn and every requested anchor on one random batch; errors against the fp32 reference.

    A latent (MLA) case's rows are :mod:`jitattn.bench.mla`'s. ``device``: where the batch lives (the
    CPU tests run a latent case there with the timers replaced; host, cascade and generate cases ignore it).
    """
    if case.host:
        from jitattn.bench.host import run_host_case

        return run_host_case(case, seed=seed, check=check, anchors=anchors)
    if case.phase == "cascade":
        return run_cascade_case(case, seed=seed, check=check)
    if case.generate is not None:
        from jitattn.bench.generate import run_generate_case

        return run_generate_case(case, seed=seed, check=check, anchors=anchors)
    batch = random_paged_batch(case.spec, case.q_lens, case.kv_lens, device=device, seed=seed)
    work, unit = case_work(case, batch)
    ref = reference_rows(case, batch) if check else None
    builders: dict[str, Callable[[], Runner | dict[str, Runner]]]
    if case.spec.latent:
        builders = latent_builders(case, batch)
    else:
        dense = to_contiguous(batch) if needs_dense(case, anchors) else None
        builders = {"jitattn": lambda: jitattn_runner(case, batch), **anchor_builders(case, batch, dense)}
    results: list[Result] = []
    for family in ("jitattn", *anchors):
        runners, rows = build_runners(case, family, builders[family], unit)
        results += rows
        for impl, runner in runners.items():
            results.append(run_impl(case, impl, runner, work, unit, ref))
        del runners
        torch.cuda.empty_cache()
    if case.spec.latent:
        add_notes(case, batch, results)
    return results


def run_case_safely(case: BenchCase, **kwargs: Any) -> list[Result]:
    """:func:`run_case`, with a failure outside any one implementation (inputs, reference) as one row."""
    try:
        return run_case(case, **kwargs)
    except Exception as exc:  # noqa: BLE001
        unit = (HOST_UNIT if case.host else STEP_UNIT if case.generate else latent_unit(case.spec) if case.spec.latent
                else "TB/s" if case.is_decode else "TFLOP/s")
        return [Result.not_run(case.name, "(case)", unit, "failed", one_line(exc))]
    finally:
        torch.cuda.empty_cache()


# ---- host profile -----------------------------------------------------------------------------
def profile_host(case: BenchCase, calls: int = 200) -> str:
    """cProfile of ``calls`` eager jitattn calls of ``case`` (host time per call and the top functions); an
    append case's call is its ``append_kv``."""
    import cProfile
    import io
    import pstats

    from jitattn.runtime import load_kernel

    batch = random_paged_batch(case.spec, case.q_lens, case.kv_lens, device="cuda")
    if case.phase == "append":
        from jitattn.bench.host import append_runners

        call = append_runners(case, batch)[0]["jitattn"].call
    else:
        kernel = load_kernel(case.spec)
        hint = 1 if case.is_decode else None
        call = lambda: kernel.paged_attention(*batch.args(), **batch.kwargs(), max_query_len=hint)  # noqa: E731
    call()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        call()
    host_us = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        call()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(25)
    return f"{case.name}: host {host_us:.1f} us per call (no sync)\n{buf.getvalue()}"


# ---- environment ------------------------------------------------------------------------------
def command_line(argv: list[str] | tuple[str, ...]) -> str:
    """The command as typed: ``jitattn bench ...`` or ``python -m jitattn.bench ...``."""
    main = Path(sys.argv[0])
    prog = "python -m jitattn.bench" if (main.name, main.parent.name) == ("__main__.py", "bench") else "jitattn bench"
    return f"{prog} {shlex.join(argv)}".strip()


def _try(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - a missing tool is a fact to record, not an error
        return f"unavailable ({one_line(exc, 120)})"


def environment(argv: list[str] | tuple[str, ...], anchors: tuple[str, ...] = ANCHORS) -> dict[str, Any]:
    """Date (UTC), device, versions (torch, CUDA, triton, FlashInfer, nvcc, driver) and the command.

    FlashInfer is imported only when it is among ``anchors``.
    """
    import jitattn
    from jitattn import settings
    from jitattn.build import nvcc_version

    gpu = torch.cuda.is_available()
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": torch.cuda.get_device_name() if gpu else "no CUDA device",
        "capability": ".".join(map(str, torch.cuda.get_device_capability())) if gpu else None,
        "arch": device_arch(),
        "driver": _try(lambda: subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True,
            timeout=30, check=True).stdout.strip().splitlines()[0]),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _try(lambda: __import__("triton").__version__),
        "flashinfer": _try(lambda: import_flashinfer().__version__) if "flashinfer" in anchors else "not requested",
        "nvcc": _try(lambda: nvcc_version(settings.nvcc())),
        "python": platform.python_version(),
        "jitattn": jitattn.__version__,
        "git": _try(lambda: subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                                           capture_output=True, text=True, timeout=30, check=True).stdout.strip()),
        "command": command_line(argv),
    }


# ---- the run ----------------------------------------------------------------------------------
def require_gpu(options: "BenchOptions") -> None:
    """Raises SystemExit (naming what works without one) when there is no CUDA device and timing is asked."""
    if not torch.cuda.is_available() and not options.compile_only:
        raise SystemExit("jitattn bench needs a CUDA GPU (torch.cuda.is_available() is False); "
                         "--list, --from-json and --compile-only work without one")


def _log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def run(options: "BenchOptions", cases: list[BenchCase]
        ) -> tuple[dict[str, Any], list[Result], list[CompileFigure]]:
    """Compile figures (into a fresh cache the timing then reuses), then every case; JSON after each step.

    Returns ``(environment, results, compile figures)``.
    """
    from jitattn import settings

    env = environment(options.to_argv(), options.anchors)
    results: list[Result] = []
    figures: list[CompileFigure] = []
    save = lambda: options.json and write_json(options.json, env, cases, results, figures)  # noqa: E731
    with contextlib.ExitStack() as stack:
        if options.compile:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="jitattn-bench-cache-")))
            stack.enter_context(settings.scope(JITATTN_CACHE_DIR=str(root), JITATTN_CACHE_PATH=None,
                                               JITATTN_DISABLE_JIT=None))
            figures = run_compile_figures(cases, root, _log)
            save()
        for case in cases if not options.compile_only else []:
            _log(f"{case.name}: {case.describe()}")
            results += run_case_safely(case, seed=options.seed, check=options.check, anchors=options.anchors)
            save()
        add_ratio_targets(results)  # across cases: the FP8 MLA cache against the bf16 one
        save()
    return env, results, figures
