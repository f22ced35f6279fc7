"""The records of a run and how they are written: markdown tables, JSON, BENCHMARKS.md. Needs no torch.

:class:`Result` is one implementation on one case; :class:`CompileFigure` one spec's compile and
load costs. ``--json`` writes both with the environment and the cases (rewritten after every case);
``--from-json`` reads them back, so the tables and BENCHMARKS.md's "Latest" section can be
re-rendered on any machine.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jitattn.bench.cases import FULL_CHECK_MAX_SEQS, BenchUsageError

if TYPE_CHECKING:
    from jitattn.bench.cases import BenchCase

#: An implementation whose relative error exceeds this is marked WRONG and never counts as the best anchor.
MAX_REL_ERR = 2e-2
#: The unit of host-cost rows (:mod:`jitattn.bench.host`): lower is better, unlike TFLOP/s and TB/s.
HOST_UNIT = "us/call"
#: The unit of generate rows (:mod:`jitattn.bench.generate`): attention microseconds per decode step.
STEP_UNIT = "attn us/step"
#: Units where a lower rate is better (times); the ratio column is then best / this.
LOWER_IS_BETTER = (HOST_UNIT, STEP_UNIT)


@dataclass
class Result:
    """One implementation on one case. Times in ms; ``rate`` in ``unit`` (TFLOP/s, TB/s, or us/call)."""

    case: str
    impl: str
    ms: float  # eager, back-to-back calls
    graph_ms: float  # CUDA-graph replay (GPU time); nan when the implementation cannot be captured
    rate: float  # from graph_ms when available, else ms; a host row: microseconds per eager call
    unit: str
    rel_err: float  # vs the fp32 reference; nan with --no-check, inf when the output holds NaN/inf
    note: str = ""
    status: str = "ok"  # "ok", "skipped" (cannot express the case) or "failed" (raised)

    @classmethod
    def not_run(cls, case: str, impl: str, unit: str, status: str, note: str) -> "Result":
        return cls(case, impl, math.nan, math.nan, math.nan, unit, math.nan, note, status)


@dataclass
class CompileFigure:
    """Compile and load costs of one spec's kernel, next to torch.compile of the same Flex variant.

    Seconds (``*_s``) and milliseconds (``*_ms``); nan where not measured (the note says why).
    """

    spec: str  # spec.name
    arch: str
    nvcc_s: float  # wall seconds of a cold KernelCache.get_or_build (render, nvcc, publish)
    build_s: float  # the manifest's build_seconds (nvcc through ninja only)
    warm_total_ms: float  # a fresh process: interpreter start to kernel loaded and synchronized
    warm_import_ms: float  # inside it: import torch, jitattn and jitattn.runtime
    warm_cuda_init_ms: float  # inside it: CUDA context creation
    warm_load_ms: float  # inside it: load_kernel (cache lookup, checksum, module load) + synchronize
    flex_prefill_s: float = math.nan  # torch.compile'd Flex, first call, dynamo reset, inductor caches off
    flex_decode_s: float = math.nan
    note: str = ""
    warm_jitattn_import_ms: float = math.nan  # of warm_import_ms: import jitattn.runtime (torch loaded)
    warm_reload_ms: float = math.nan  # the same kernel loaded again in that process: the per-kernel cost alone


def one_line(exc: BaseException | str, limit: int = 160) -> str:
    """``Type: first line of the message``, cut to ``limit`` characters (for a table cell)."""
    text = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
    text = " ".join(text.split()).replace("|", "/")
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---- markdown tables --------------------------------------------------------------------------
def _cell(x: float, fmt: str) -> str:
    return "-" if x is None or math.isnan(x) else format(x, fmt)


REL_ERR_HEADER = f"rel err (prefill > {FULL_CHECK_MAX_SEQS} seqs: 1st seq only)"


#: jitattn's rows that are never a case's baseline: the call itself and its plan/run form (same kernels).
NOT_ANCHORS = ("jitattn", "jitattn-run")


def best_anchor_rates(results: list[Result]) -> dict[str, float]:
    """Per case, the best rate among anchors that ran and were not WRONG (nan when none).

    The best is the highest TFLOP/s or TB/s, and the lowest time (:data:`LOWER_IS_BETTER`: us/call of a
    host case, attention us per step of a generate case).
    """
    best: dict[str, float] = {}
    for r in results:
        ok = (r.impl not in NOT_ANCHORS and r.status == "ok" and not math.isnan(r.rate)
              and not (r.rel_err > MAX_REL_ERR))
        best.setdefault(r.case, math.nan)
        if not ok:
            continue
        better = r.rate < best[r.case] if r.unit in LOWER_IS_BETTER else r.rate > best[r.case]
        if math.isnan(best[r.case]) or better:
            best[r.case] = r.rate
    return best


def _ratio(r: Result, best: float) -> float:
    """How many times better than the best anchor (> 1: better): rate / best, or best / time for times."""
    if math.isnan(best):
        return math.nan
    return best / r.rate if r.unit in LOWER_IS_BETTER else r.rate / best


def format_table(results: list[Result]) -> str:
    """Markdown table with the ratio of each implementation to the best correct anchor of its case."""
    lines = [f"| case | impl | eager ms | graph ms | rate | vs best anchor | {REL_ERR_HEADER} | note |",
             "|---|---|---|---|---|---|---|---|"]
    best = best_anchor_rates(results)
    for r in results:
        ratio = _ratio(r, best[r.case])
        rate = f"{_cell(r.rate, '.2f')} {r.unit}" if not math.isnan(r.rate) else "-"
        note = f"{r.status}: {r.note}" if r.status != "ok" else r.note
        lines.append(f"| {r.case} | {r.impl} | {_cell(r.ms, '.3f')} | {_cell(r.graph_ms, '.3f')} | {rate} | "
                     f"{'-' if math.isnan(ratio) else f'{ratio:.2f}x'} | {_cell(r.rel_err, '.2e')} | {note} |")
    return "\n".join(lines)


def format_compile_table(figures: list[CompileFigure]) -> str:
    """Markdown table of the compile figures (seconds and milliseconds as the headers say)."""
    lines = ["| kernel | arch | nvcc cold s (build.ninja s) | warm load, fresh process: total ms | "
             "import ms (of which jitattn) | CUDA init ms | load ms (again) | Flex torch.compile prefill s | decode s | "
             "note |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for f in figures:
        lines.append(f"| {f.spec} | {f.arch} | {_cell(f.nvcc_s, '.1f')} ({_cell(f.build_s, '.1f')}) | "
                     f"{_cell(f.warm_total_ms, '.0f')} | {_cell(f.warm_import_ms, '.0f')} "
                     f"({_cell(f.warm_jitattn_import_ms, '.0f')}) | "
                     f"{_cell(f.warm_cuda_init_ms, '.0f')} | {_cell(f.warm_load_ms, '.1f')} ({_cell(f.warm_reload_ms, '.1f')}) | "
                     f"{_cell(f.flex_prefill_s, '.1f')} | {_cell(f.flex_decode_s, '.1f')} | {f.note} |")
    return "\n".join(lines)


# ---- JSON -------------------------------------------------------------------------------------
def _json_safe(x: Any) -> Any:
    """NaN / inf floats -> None / "inf" (strict JSON has neither), recursively."""
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def case_json(case: "BenchCase") -> dict[str, Any]:
    out = {"name": case.name, "phase": case.phase, "spec": case.spec.to_json(), "spec_name": case.spec.name,
           "batch": len(case.q_lens), "q_lens": sorted(set(case.q_lens)), "kv_lens": sorted(set(case.kv_lens)),
           "check_seqs": case.check_seqs, "describe": case.describe()}
    if case.generate is not None:  # the small model and the steps a generate case ran
        out["generate"] = asdict(case.generate)
    return out


def write_json(path: str | os.PathLike, env: dict[str, Any], cases: list["BenchCase"], results: list[Result],
               figures: list[CompileFigure]) -> None:
    """Everything machine-readable: ``{"environment", "cases", "results", "compile"}`` (NaN as null)."""
    data = {"environment": env, "cases": [case_json(c) for c in cases], "results": [asdict(r) for r in results],
            "compile": [asdict(f) for f in figures]}
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(_json_safe(data), indent=1))
    os.replace(tmp, path)


def _float(x: Any) -> Any:
    if x is None:
        return math.nan
    if x in ("inf", "-inf"):
        return float(x)
    return x


def read_json(path: str | os.PathLike) -> tuple[dict[str, Any], list[Result], list[CompileFigure]]:
    """Inverse of :func:`write_json`: ``(environment, results, compile figures)``.

    Raises:
        BenchUsageError: the file is missing, unreadable, not JSON, or not a ``--json`` output.
    """
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise BenchUsageError(f"--from-json {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise BenchUsageError(f"--from-json {path}: cannot read it ({exc.__class__.__name__}: {exc})") from None
    except json.JSONDecodeError as exc:
        raise BenchUsageError(f"--from-json {path}: not valid JSON ({exc}); expected the file "
                              f"`jitattn bench --json PATH` wrote") from None
    if not isinstance(data, dict) or not isinstance(data.get("environment"), dict) \
            or not isinstance(data.get("results"), list):
        raise BenchUsageError(f"--from-json {path}: not a `jitattn bench --json` file (expected an object with "
                              f"'environment' and 'results')")

    def load(cls, row):
        names = {f.name for f in fields(cls)}
        return cls(**{k: _float(v) for k, v in row.items() if k in names})

    return data["environment"], [load(Result, r) for r in data["results"]], [load(CompileFigure, f) for f in
                                                                             data.get("compile", [])]


def merge_runs(runs: list[tuple[dict[str, Any], list[Result], list[CompileFigure]]]
               ) -> tuple[dict[str, Any], list[Result], list[CompileFigure]]:
    """Several runs' ``(environment, results, figures)`` as one: the first run's environment with
    ``commands`` listing every run's command, results and figures concatenated in order."""
    env = dict(runs[0][0])
    env["commands"] = [r[0].get("command", "?") for r in runs]
    return env, [x for r in runs for x in r[1]], [x for r in runs for x in r[2]]


# ---- BENCHMARKS.md ----------------------------------------------------------------------------
def anchors_line(results: list[Result]) -> str:
    """Which anchors ran at least once, and why the others never did (first reason)."""
    ran = sorted({r.impl for r in results if r.status == "ok" and r.impl != "jitattn"})
    never: dict[str, str] = {}
    for r in results:
        family = r.impl.split("-")[0]
        if r.status != "ok" and not any(x.split("-")[0] == family for x in ran):
            never.setdefault(family, f"{r.status}: {r.note}")
    parts = [f"ran: {', '.join(ran) or 'none'}"] + [f"{k} never ran ({v})" for k, v in never.items()]
    return "; ".join(parts)


def latest_section(results: list[Result], env: dict[str, Any], figures: list[CompileFigure] | None = None) -> str:
    """BENCHMARKS.md's "Latest" section: date, device, versions, the exact command, the table(s)."""
    lines = [f"## Latest: {env.get('date', '?')}", "",
             f"- Device: {env.get('device')}, driver {env.get('driver')}, torch {env.get('torch')} "
             f"(CUDA {env.get('cuda')}), triton {env.get('triton')}, "
             f"nvcc {env.get('nvcc')}, {env.get('arch')} cubins, jitattn {env.get('jitattn')} ({env.get('git')}).",
             f"- FlashInfer: {env.get('flashinfer')}.",
             *[f"- Command: `{cmd}`." for cmd in env.get("commands", [env.get("command")])],
             f"- Anchors: {anchors_line(results)}.", "", format_table(results), ""]
    if figures:
        lines += ["Compile figures (cold: fresh cache, nvcc; warm: a fresh process loading the cached cubin):", "",
                  format_compile_table(figures), ""]
    return "\n".join(lines)


def write_benchmarks_md(results: list[Result], env: dict[str, Any], path: str | os.PathLike,
                        figures: list[CompileFigure] | None = None) -> None:
    """Replace the "## Latest..." section of ``path`` (up to the next "## " heading) with this run's.

    Everything else (the method, the history table) is kept as it is. Without a Latest section,
    the new one goes before the first "## " heading (or at the end).
    """
    p = Path(path)
    text = p.read_text() if p.exists() else "# Benchmarks\n"
    lines = text.splitlines()
    heads = [i for i, ln in enumerate(lines) if ln.startswith("## ")]
    latest = next((i for i in heads if lines[i].startswith("## Latest")), None)
    if latest is None:
        start = end = heads[0] if heads else len(lines)
    else:
        start, end = latest, next((i for i in heads if i > latest), len(lines))
    new = lines[:start] + latest_section(results, env, figures).splitlines() + lines[end:]
    p.write_text("\n".join(new).rstrip("\n") + "\n")


def render(results: list[Result], figures: list[CompileFigure]) -> str:
    """The text a run prints: the results table, then the compile table (each only when it has rows)."""
    text = ""
    if results:
        text += format_table(results) + "\n"
    if figures:
        text += ("\n" if text else "") + format_compile_table(figures) + "\n"
    return text
