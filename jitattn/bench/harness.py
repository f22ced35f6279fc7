"""The timing harness: eager and CUDA-graph times, median of trials, and the run of one implementation.

Each implementation of a case is a :class:`Runner`: ``call()`` launches it (what is timed) and
``rows(out)`` maps its output to the paged row layout for the error check. :func:`run_impl` checks
one runner against the reference, then times it; a failure there is a "failed" row, never a crash.

Eager times: CUDA events around ``rep`` back-to-back calls, median of ``trials``. Graph times: the
same ``rep`` calls captured once in a CUDA graph and replayed (GPU time alone). Host times
(:func:`host_us_per_call`): wall-clock microseconds per call of many back-to-back eager calls,
synchronised only at the end.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from jitattn.bench.cases import BenchCase
from jitattn.bench.report import MAX_REL_ERR, Result, one_line
from jitattn.testing import relative_error


class Skip(Exception):
    """The implementation cannot express this case; the message says why (a "skipped" row)."""


@dataclass
class Runner:
    """One implementation ready to run a case.

    ``call()`` launches it (what is timed); ``rows(out)`` maps its output to the paged layout
    ``(total_q, num_qo_heads, head_dim_vo)`` for the error check; ``note`` goes to the table.
    ``graph=False``: the call reads device values on the host (a sync), so no CUDA-graph capture is tried.
    """

    call: Callable[[], torch.Tensor]
    rows: Callable[[torch.Tensor], torch.Tensor] = lambda out: out
    note: str = ""
    graph: bool = True


def time_ms(fn: Callable[[], Any], *, warmup: int = 3, rep: int = 10, trials: int = 5) -> float:
    """Milliseconds per call of ``fn``: CUDA events around ``rep`` back-to-back calls, median of ``trials``.

    Back-to-back calls let the host run ahead of the GPU, so launch latency is hidden exactly when
    it would be in a real serving loop, and counted when the host cannot keep up.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(rep):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / rep)
    return statistics.median(times)


def time_graph_ms(fn: Callable[[], Any], *, rep: int = 10, trials: int = 5) -> float:
    """Milliseconds per call of ``fn`` replayed from a CUDA graph of ``rep`` calls: GPU time only,
    no host launch cost (how a serving engine runs decode). Raises if ``fn`` cannot be captured."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up on the capture stream (lazy initialisation must not happen under capture)
        stream.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(rep):
                fn()
    torch.cuda.synchronize()
    return time_ms(graph.replay, warmup=1, rep=1, trials=trials) / rep


def host_us_per_call(fn: Callable[[], Any], *, calls: int, warmup: int = 50, trials: int = 3) -> float:
    """Wall-clock microseconds per call of ``calls`` back-to-back eager calls, synchronised only at the end.

    Median of ``trials``. On inputs too small to keep the GPU busy this is the host's cost per call
    (argument checks, packing, allocation, launch), which is what a serving engine pays per layer
    when attention runs outside a CUDA graph.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


def measure(case: str, impl: str, fn: Callable[[], Any], work: float, unit: str, err: float, *,
            graph: bool = True) -> Result:
    """Eager and graph timings of one implementation (``graph=False``: eager only); the rate uses the
    graph time when there is one.

    ``work`` is in TFLOP or TB, so work / seconds is TFLOP/s or TB/s.
    """
    ms = time_ms(fn)
    gms, note = math.nan, "" if graph else "no graph: host-side metadata reads"
    try:
        if graph:
            gms = time_graph_ms(fn)
    except Exception as exc:  # noqa: BLE001 - any capture failure just means "no graph figure"
        gms, note = math.nan, f"no graph: {one_line(exc, 60)}"
    best = gms if not math.isnan(gms) else ms
    return Result(case, impl, ms, gms, work / (best / 1e3), unit, err, note)


def check_error(out_rows: torch.Tensor, ref: torch.Tensor | None) -> float:
    """Relative error of the first ``len(ref)`` rows (nan without a reference)."""
    return math.nan if ref is None else relative_error(out_rows[: ref.shape[0]], ref)


def run_impl(case: BenchCase, impl: str, runner: Runner, work: float, unit: str, ref: torch.Tensor | None) -> Result:
    """Check one ready implementation against the reference, then time it. Never raises."""
    try:
        err = check_error(runner.rows(runner.call()), ref)
        result = measure(case.name, impl, runner.call, work, unit, err, graph=runner.graph)
    except Exception as exc:  # noqa: BLE001 - a failing implementation is a row, not a crash
        return Result.not_run(case.name, impl, unit, "failed", one_line(exc))
    return with_notes(result, runner, err)


def with_notes(result: Result, runner: Runner, err: float) -> Result:
    """The runner's note (WRONG first when the error is over :data:`MAX_REL_ERR`), then the timing's."""
    if err > MAX_REL_ERR:
        runner.note = f"WRONG (rel err > {MAX_REL_ERR:g}); {runner.note}"
    result.note = "; ".join(n for n in (runner.note, result.note) if n)
    return result


def build_runners(case: BenchCase, family: str, build: Callable[[], Runner | dict[str, Runner]], unit: str
                  ) -> tuple[dict[str, Runner], list[Result]]:
    """Call one implementation family's builder: its runners, or a skipped / failed row named ``family``."""
    try:
        made = build()
    except Skip as why:
        return {}, [Result.not_run(case.name, family, unit, "skipped", one_line(str(why)))]
    except Exception as exc:  # noqa: BLE001
        return {}, [Result.not_run(case.name, family, unit, "failed", one_line(exc))]
    return (made if isinstance(made, dict) else {family: made}), []
