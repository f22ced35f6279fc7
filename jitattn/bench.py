"""Benchmark: jitattn against the anchors, side by side, in one process, on the same inputs.

A performance claim counts only as a ratio measured in one run (these machines are noisy). Each
case times every implementation installed here on the same random inputs (CUDA events, median
after warm-up), and reports each one's error against the fp32 reference, so a fast wrong answer
shows as wrong.

Units: prefill in TFLOP/s with 4 x head_dim FLOPs per visible (query, key) pair per head;
decode in TB/s of K and V bytes the case must read (keys inside the window only).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from jitattn.spec import AttentionSpec
from jitattn.testing import PagedBatch, random_paged_batch, relative_error


@dataclass
class BenchCase:
    """One benchmark case: a spec and a batch shape (q_lens[b] queries against kv_lens[b] keys)."""

    name: str
    spec: AttentionSpec
    q_lens: list[int]
    kv_lens: list[int]
    phase: str  # "prefill" or "decode": which unit the table reports

    @property
    def is_decode(self) -> bool:
        return self.phase == "decode"


def design_cases() -> list[BenchCase]:
    """The six cases of the anchor table in DESIGN.md, same shapes."""
    hd128 = AttentionSpec(32, 8, 128)
    gemma = AttentionSpec(16, 8, 256, logits_soft_cap=50.0, window_left=4095, sm_scale=256 ** -0.5)
    phi3 = AttentionSpec(32, 32, 96)
    return [
        BenchCase("prefill-hd128-causal-b4x8192", hd128, [8192] * 4, [8192] * 4, "prefill"),
        BenchCase("prefill-gemma2-9b-b2x8192", gemma, [8192] * 2, [8192] * 2, "prefill"),
        BenchCase("prefill-phi3-hd96-b4x8192", phi3, [8192] * 4, [8192] * 4, "prefill"),
        BenchCase("decode-hd128-b64x4096", hd128, [1] * 64, [4096] * 64, "decode"),
        BenchCase("decode-gemma2-9b-b64x8192", gemma, [1] * 64, [8192] * 64, "decode"),
        BenchCase("decode-hd128-b1x32768", hd128, [1], [32768], "decode"),
    ]


def decode_target_cases() -> list[BenchCase]:
    """Extra decode cases of the fast-decode targets: gpt-oss sliding layer, page sizes 1/16/64."""
    gpt_oss = AttentionSpec(64, 8, 64, window_left=127, sinks=True)
    out = [BenchCase("decode-gpt-oss-sliding-b256x8192", gpt_oss, [1] * 256, [8192] * 256, "decode")]
    for ps in (1, 16, 64):
        out.append(BenchCase(f"decode-hd128-b64x4096-page{ps}", AttentionSpec(32, 8, 128, page_size=ps),
                             [1] * 64, [4096] * 64, "decode"))
    return out


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
    no host launch cost (how a serving engine runs decode). Raises RuntimeError if ``fn`` cannot be captured."""
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


@dataclass
class Result:
    case: str
    impl: str
    ms: float  # eager, back-to-back calls
    graph_ms: float  # CUDA-graph replay (GPU time); nan when the implementation cannot be captured
    rate: float  # TFLOP/s or TB/s, from graph_ms when available, else ms
    unit: str
    rel_err: float
    note: str = ""


def measure(case: str, impl: str, fn: Callable[[], Any], work: float, unit: str, err: float) -> Result:
    """Eager and graph timings of one implementation; the rate uses the graph time when there is one."""
    ms = time_ms(fn)
    try:
        gms = time_graph_ms(fn)
    except RuntimeError:
        gms = math.nan
    best = gms if not math.isnan(gms) else ms
    return Result(case, impl, ms, gms, work / (best / 1e3), unit, err)


@dataclass
class Contiguous:
    """The batch as dense (B, H, N, D) tensors, for anchors that take no paged cache (equal lengths only)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


def to_contiguous(batch: PagedBatch) -> Contiguous | None:
    from jitattn.reference import gather_kv

    if len(set(batch.q_lens)) != 1 or len(set(batch.kv_lens)) != 1:
        return None
    b, ql = len(batch.q_lens), batch.q_lens[0]
    q = batch.q.view(b, ql, batch.spec.num_qo_heads, -1).transpose(1, 2)
    ks, vs = zip(*(gather_kv(batch.spec, batch.kv_cache, batch.block_table, i, batch.kv_lens[i]) for i in range(b)))
    k = torch.stack(ks).transpose(1, 2).contiguous()
    v = torch.stack(vs).transpose(1, 2).contiguous()
    return Contiguous(q.contiguous(), k, v)


def sdpa_impls(case: BenchCase) -> dict[str, Callable[[Contiguous], torch.Tensor]]:
    """torch SDPA backends that can run the case (plain causal/full attention, no window or soft-cap)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    s = case.spec
    if s.window_left >= 0 or s.window_right >= 0 or s.logits_soft_cap or s.alibi or s.sinks or s.variant:
        return {}
    causal = s.causal and not case.is_decode  # a decode row sees every key: no mask needed

    def make(backend):
        def run(c: Contiguous) -> torch.Tensor:
            with sdpa_kernel(backend):
                return sdpa(c.q, c.k, c.v, is_causal=causal, scale=s.sm_scale, enable_gqa=s.group_size > 1)
        return run

    return {"sdpa-flash": make(SDPBackend.FLASH_ATTENTION), "sdpa-cudnn": make(SDPBackend.CUDNN_ATTENTION)}


def run_case(case: BenchCase, *, seed: int = 0, check: bool = True) -> list[Result]:
    """Time jitattn and every anchor that can run ``case``; errors against the fp32 reference."""
    from jitattn import reference
    from jitattn.runtime import load_kernel

    batch = random_paged_batch(case.spec, case.q_lens, case.kv_lens, device="cuda", seed=seed)
    work = batch.kv_bytes_read / 1e12 if case.is_decode else batch.flops / 1e12
    unit = "TB/s" if case.is_decode else "TFLOP/s"
    ref = reference.paged_attention(case.spec, *batch.args(), **batch.kwargs()) if check else None
    results = []
    kernel = load_kernel(case.spec)
    hint = 1 if case.is_decode else None
    out = kernel.paged_attention(*batch.args(), **batch.kwargs(), max_query_len=hint)
    err = relative_error(out, ref) if check else math.nan
    results.append(measure(case.name, "jitattn", lambda: kernel.paged_attention(
        *batch.args(), **batch.kwargs(), out=out, max_query_len=hint), work, unit, err))
    dense = to_contiguous(batch)
    if dense is not None:
        for name, fn in sdpa_impls(case).items():
            try:
                o = fn(dense)
            except RuntimeError as exc:
                results.append(Result(case.name, name, math.nan, math.nan, math.nan, unit, math.nan,
                                      f"unavailable: {exc}"[:80]))
                continue
            err = relative_error(o.transpose(1, 2).reshape(ref.shape), ref) if check else math.nan
            results.append(measure(case.name, name, lambda: fn(dense), work, unit, err))
    return results


def format_table(results: list[Result]) -> str:
    """Markdown table with the ratio of each implementation to the best anchor of its case."""
    lines = ["| case | impl | eager ms | graph ms | rate | vs best anchor | rel err | note |",
             "|---|---|---|---|---|---|---|---|"]
    by_case: dict[str, list[Result]] = {}
    for r in results:
        by_case.setdefault(r.case, []).append(r)
    for case, rs in by_case.items():
        anchors = [r.rate for r in rs if r.impl != "jitattn" and not math.isnan(r.rate)]
        best = max(anchors) if anchors else math.nan
        for r in rs:
            ratio = r.rate / best if anchors and not math.isnan(r.rate) else math.nan
            lines.append(f"| {case} | {r.impl} | {r.ms:.3f} | {r.graph_ms:.3f} | {r.rate:.2f} {r.unit} | "
                         f"{'-' if math.isnan(ratio) else f'{ratio:.2f}x'} | {r.rel_err:.2e} | {r.note} |")
    return "\n".join(lines)


def all_cases() -> list[BenchCase]:
    return design_cases() + decode_target_cases()


def profile_host(case: BenchCase, calls: int = 200) -> str:
    """cProfile of ``calls`` eager jitattn calls of ``case`` (host time per call and the top functions)."""
    import cProfile
    import io
    import pstats
    import time

    from jitattn.runtime import load_kernel

    batch = random_paged_batch(case.spec, case.q_lens, case.kv_lens, device="cuda")
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


def main(argv: list[str] | None = None) -> str:
    """``python -m jitattn.bench [--case NAME ...] [--host-profile] [--no-check]``: print the table."""
    import argparse

    parser = argparse.ArgumentParser(prog="jitattn.bench", description=__doc__.split("\n")[0])
    parser.add_argument("--case", action="append", help="case name (substring match); default: all")
    parser.add_argument("--host-profile", action="store_true", help="cProfile the host side of each jitattn call")
    parser.add_argument("--no-check", action="store_true", help="skip the reference error check")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("jitattn bench needs a CUDA GPU (torch.cuda.is_available() is False)")
    cases = [c for c in all_cases() if not args.case or any(sel in c.name for sel in args.case)]
    if args.host_profile:
        report = "\n".join(profile_host(c) for c in cases)
        print(report)
        return report
    results = []
    for case in cases:
        results += run_case(case, check=not args.no_check)
        torch.cuda.empty_cache()
    table = format_table(results)
    print(table)
    return table


if __name__ == "__main__":
    main()
