"""The ``jitattn`` command line.

- ``jitattn warmup``: compile every kernel some models (``--model config.json``) or specs
  (``--spec``) need, for every target arch, into the cache. nvcc only: no GPU, no torch.
- ``jitattn cache ls``: every entry of every cache layer, verified.
- ``jitattn bench``: jitattn against the anchors on a CUDA GPU (:mod:`jitattn.bench`).

Exit codes: 0 success; 1 a kernel failed to compile (each failure's nvcc message is printed);
2 a usage error (missing file, bad JSON, unknown arch, invalid spec, nvcc missing, no GPU),
printed as one ``jitattn: error: ...`` line without a traceback.

Each verb is a small function over the library's own objects (:class:`~jitattn.cache.KernelCache`,
:func:`~jitattn.models.load_model_config`, :class:`~jitattn.spec.AttentionSpec`); later verbs
(``select``, ``doctor``, more ``cache`` verbs) are added the same way.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Iterator, NoReturn, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

import jitattn
from jitattn import settings
from jitattn.build import BuildError, CompileError, normalize_arch, nvcc_version
from jitattn.cache import MANIFEST, KernelCache
from jitattn.spec import AttentionSpec

app = typer.Typer(
    name="jitattn",
    help="JIT kernel-specialisation compiler for attention: warm the kernel cache, inspect it, benchmark.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
cache_app = typer.Typer(help="Inspect the on-disk kernel cache.", no_args_is_help=True)
app.add_typer(cache_app, name="cache")

USAGE_ERROR = 2
#: Wide enough that kernel names never wrap when output goes to a file or a pipe.
_PIPE_WIDTH = 220


class UsageError(Exception):
    """A problem the user can fix (bad argument, missing file, no nvcc): one line, exit 2."""


def _console(stderr: bool = False) -> Console:
    probe = Console(stderr=stderr)
    return probe if probe.is_terminal else Console(stderr=stderr, width=_PIPE_WIDTH)


def _fail(message: str) -> NoReturn:
    typer.echo(f"jitattn: error: {message}", err=True)
    raise typer.Exit(USAGE_ERROR)


@contextlib.contextmanager
def _usage_errors() -> Iterator[None]:
    """Turn the errors a user causes into one line and exit code 2."""
    try:
        yield
    except UsageError as exc:
        _fail(str(exc))
    except (ValueError, FileNotFoundError, BuildError) as exc:
        _fail(str(exc).strip().replace("\n", " "))


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"jitattn {jitattn.__version__}")
        raise typer.Exit()


@app.callback()
def main(version: Annotated[bool, typer.Option("--version", callback=_version_callback, is_eager=True,
                                               help="Print the version and exit.")] = False) -> None:
    """JIT kernel-specialisation compiler for attention."""


# ---- warmup: what to build ---------------------------------------------------------------------
@dataclass
class Target:
    """One spec to build, with every source that asked for it (``model/layer kind`` or ``--spec #i``)."""

    spec: AttentionSpec
    sources: list[str]


def default_jobs() -> int:
    """Parallel compiles: one per core, at most one per 2 GiB of available memory, at least one."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, min(cores, _available_gib() // 2))


def _available_gib() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) // (1 << 20)
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // (1 << 30)
    except (ValueError, OSError, AttributeError):
        return 2


def parse_spec_arg(text: str) -> list[AttentionSpec]:
    """``--spec`` value: AttentionSpec JSON text, or a path to a file holding a spec object or a list.

    Raises:
        UsageError: not JSON and not a file, invalid JSON, or an invalid spec (AttentionSpec's message).
    """
    stripped = text.strip()
    if stripped.startswith(("{", "[")):
        source, raw = "--spec", stripped
    else:
        path = Path(text).expanduser()
        if not path.is_file():
            raise UsageError(f"--spec {text!r}: no such file, and not JSON text (which starts with '{{'); "
                             f"pass AttentionSpec JSON or a path to a .json file")
        source, raw = str(path), path.read_text(encoding="utf-8")
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{source}: not valid JSON ({exc})") from None
    items = data if isinstance(data, list) else [data]
    specs = []
    for i, item in enumerate(items):
        where = source if len(items) == 1 else f"{source} [{i}]"
        if not isinstance(item, dict):
            raise UsageError(f"{where}: expected a JSON object with AttentionSpec fields, got {type(item).__name__}")
        try:
            specs.append(AttentionSpec.from_json(item))
        except (ValueError, TypeError, KeyError) as exc:
            raise UsageError(f"{where}: invalid spec: {exc}") from None
    return specs


def collect_targets(models: list[Path], spec_args: list[str], *, dtype: str | None, page_size: int,
                    kv_layout: str) -> list[Target]:
    """The distinct specs to build, in order of first mention, each with who asked for it."""
    from jitattn.models import load_model_config

    targets: dict[AttentionSpec, Target] = {}

    def add(spec: AttentionSpec, source: str) -> None:
        targets.setdefault(spec, Target(spec, [])).sources.append(source)

    for path in models:
        model = load_model_config(path, dtype=dtype, kv_layout=kv_layout, page_size=page_size)
        for kind in model.layer_kinds:
            add(kind.spec, f"{Path(path).stem}/{kind.name}")
    for i, text in enumerate(spec_args, start=1):
        for spec in parse_spec_arg(text):
            add(spec, f"--spec #{i}")
    return list(targets.values())


def resolve_archs(archs: list[str]) -> list[str]:
    """Normalized, deduplicated ``--arch`` values; ``JITATTN_ARCHS`` (default sm_80, sm_90a) when none."""
    chosen = [normalize_arch(a, field="--arch") for a in archs] if archs else list(settings.archs())
    return list(dict.fromkeys(chosen))


def _check_build_box(cache: KernelCache) -> str:
    """nvcc runs and the cache root is writable; returns nvcc's version line."""
    nvcc = settings.nvcc()
    version = nvcc_version(nvcc)  # BuildError with the path tried and the fix
    base = cache.root / "v1"
    try:
        base.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cache root {cache.root} is not writable ({exc.strerror}); set JITATTN_CACHE_DIR") from None
    if not os.access(base, os.W_OK):
        raise UsageError(f"cache root {cache.root} is not writable; set JITATTN_CACHE_DIR to a writable directory")
    return version


# ---- warmup: building --------------------------------------------------------------------------
@dataclass
class Outcome:
    target: Target
    arch: str
    status: str  # "compiled" | "cached" | "failed"
    seconds: float
    error: str = ""


def _build_one(cache: KernelCache, target: Target, arch: str) -> Outcome:
    start = time.perf_counter()
    try:
        _, built = cache.get_or_build(target.spec, arch)
    except CompileError as exc:
        return Outcome(target, arch, "failed", time.perf_counter() - start, str(exc))
    except Exception as exc:  # noqa: BLE001 - one kernel's failure must not hide the others' results
        return Outcome(target, arch, "failed", time.perf_counter() - start, f"{type(exc).__name__}: {exc}")
    return Outcome(target, arch, "compiled" if built else "cached", time.perf_counter() - start)


def run_warmup(cache: KernelCache, targets: list[Target], archs: list[str], jobs: int,
               console: Console) -> list[Outcome]:
    """Build every (target, arch) with at most ``jobs`` compiles at once, showing a progress bar."""
    work = [(t, a) for t in targets for a in archs]
    outcomes: list[Outcome] = []
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress, \
            ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="jitattn-warmup") as pool:
        task = progress.add_task("compiling", total=len(work))
        futures = [pool.submit(_build_one, cache, t, a) for t, a in work]
        try:
            for future in as_completed(futures):
                outcome = future.result()
                outcomes.append(outcome)
                progress.update(task, advance=1,
                                description=f"{outcome.status:>8} {outcome.target.spec.name} {outcome.arch}")
        except KeyboardInterrupt:
            for future in futures:  # let the running compiles finish (they publish atomically), start no more
                future.cancel()
            raise
        progress.update(task, description="done")
    order = {(id(t), a): i for i, (t, a) in enumerate(work)}
    return sorted(outcomes, key=lambda o: order[(id(o.target), o.arch)])


def summary_table(outcomes: list[Outcome]) -> Table:
    table = Table()
    for name, kw in (("kernel", {"no_wrap": True}), ("arch", {}), ("needed by", {}), ("result", {}),
                     ("seconds", {"justify": "right"})):
        table.add_column(name, **kw)
    style = {"compiled": "green", "cached": "cyan", "failed": "bold red"}
    for o in outcomes:
        table.add_row(o.target.spec.name, o.arch, escape(", ".join(o.target.sources)),
                      f"[{style[o.status]}]{o.status}[/]", f"{o.seconds:.1f}")
    return table


@app.command()
def warmup(
    model: Annotated[Optional[list[Path]], typer.Option(
        "--model", "-m", help="Hugging Face config.json; repeat for several models.")] = None,
    spec: Annotated[Optional[list[str]], typer.Option(
        "--spec", help="AttentionSpec JSON text, or a path to a .json file (one spec or a list); repeatable.")] = None,
    arch: Annotated[Optional[list[str]], typer.Option(
        "--arch", "-a", help="Target arch such as sm_80 or sm_90a; repeatable. Default: JITATTN_ARCHS "
                             "(sm_80, sm_90a).")] = None,
    jobs: Annotated[Optional[int], typer.Option(
        "--jobs", "-j", min=1, help="Compiles at once. Default: cores, at most one per 2 GiB of free memory.")] = None,
    dtype: Annotated[Optional[str], typer.Option(
        "--dtype", help="float16 or bfloat16 for --model specs (default: the config's torch_dtype).")] = None,
    page_size: Annotated[int, typer.Option("--page-size", help="KV page size of --model specs.")] = 16,
    kv_layout: Annotated[str, typer.Option("--kv-layout", help="NHD or HND, for --model specs.")] = "NHD",
) -> None:
    """Compile every kernel the models or specs need, for every arch, into the cache (nvcc only, no GPU).

    Run it again and everything reports "cached" without compiling. Exit code 1 when a kernel failed.
    """
    with _usage_errors():
        if not model and not spec:
            raise UsageError("nothing to build: pass --model CONFIG.json and/or --spec JSON_OR_FILE")
        targets = collect_targets(model or [], spec or [], dtype=dtype, page_size=page_size, kv_layout=kv_layout)
        archs = resolve_archs(arch or [])
        cache = KernelCache()
        nvcc = _check_build_box(cache)
    jobs = jobs or default_jobs()
    out, err = _console(), _console(stderr=True)
    err.print(f"jitattn warmup: {len(targets)} specs x {len(archs)} archs ({', '.join(archs)}), -j {jobs}\n"
              f"  cache: {cache.root}\n  nvcc: {nvcc}", markup=False, highlight=False)
    if settings.disable_jit():
        err.print("  note: JITATTN_DISABLE_JIT=1 is set; warmup is the build step, so it compiles anyway",
                  markup=False, highlight=False)
    start = time.perf_counter()
    with settings.scope(JITATTN_DISABLE_JIT="0"):
        try:
            outcomes = run_warmup(cache, targets, archs, jobs, err)
        except KeyboardInterrupt:
            err.print("interrupted: kernels already compiled stay in the cache", markup=False, highlight=False)
            raise typer.Exit(130) from None
    wall = time.perf_counter() - start
    out.print(summary_table(outcomes))
    counts = {s: sum(o.status == s for o in outcomes) for s in ("compiled", "cached", "failed")}
    out.print(f"compiled {counts['compiled']}, cached {counts['cached']}, failed {counts['failed']} "
              f"in {wall:.1f} s", markup=False, highlight=False)
    failed = [o for o in outcomes if o.status == "failed"]
    for o in failed:
        err.print(f"\nFAILED {o.target.spec.name} {o.arch} (needed by {', '.join(o.target.sources)}):\n{o.error}",
                  markup=False, highlight=False)
    if failed:
        raise typer.Exit(1)


# ---- cache -------------------------------------------------------------------------------------
def _entry_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def cache_rows(cache: KernelCache) -> list[dict]:
    """One dict per entry in every layer, the writable root first; ``status`` is ``ok`` or the problem."""
    roots = {str(cache.root): "writable", **{str(r): "read-only" for r in cache.layers}}
    rows = []
    for path, entry, problem in cache.entries():
        try:
            manifest = json.loads((path / MANIFEST).read_text())
        except (OSError, ValueError):
            manifest = {}
        inputs = manifest.get("key_inputs") or {}
        root = str(path.parents[3])
        rows.append({
            "key": path.name,
            "name": manifest.get("name", "?"),
            "arch": inputs.get("arch", "?"),
            "size": _entry_size(path),
            "build_seconds": manifest.get("build_seconds"),
            "created": manifest.get("created", "?"),
            "root": root,
            "layer": roots.get(root, "?"),
            "path": str(path),
            "status": "ok" if problem is None else problem,
        })
    layer_order = list(roots)
    return sorted(rows, key=lambda r: (layer_order.index(r["root"]) if r["root"] in layer_order else len(layer_order),
                                       r["name"], r["arch"]))


@cache_app.command("ls")
def cache_ls(as_json: Annotated[bool, typer.Option("--json", help="One JSON list, for scripts.")] = False) -> None:
    """List every entry of every cache layer: key, spec, arch, size, build time, layer, status (verified)."""
    with _usage_errors():
        cache = KernelCache()
    rows = cache_rows(cache)
    if as_json:
        typer.echo(json.dumps(rows, indent=1))
        return
    out = _console()
    if not rows:
        looked = ", ".join(str(r) for r in (cache.root, *cache.layers))
        out.print(f"no cache entries in {looked}", markup=False, highlight=False)
        return
    table = Table()
    for name in ("key", "spec", "arch", "size", "build s", "created", "layer", "status"):
        table.add_column(name, no_wrap=name in ("key", "spec"), justify="right" if name in ("size", "build s") else "left")
    for r in rows:
        status = "[green]ok[/]" if r["status"] == "ok" else "[bold red]corrupt[/]"
        secs = "" if r["build_seconds"] is None else f"{r['build_seconds']:.1f}"
        table.add_row(r["key"][:12], r["name"], r["arch"], _human(r["size"]), secs, r["created"],
                      escape(f"{r['root']} ({r['layer']})"), status)
    out.print(table)
    out.print(f"{len(rows)} entries, {_human(sum(r['size'] for r in rows))}", markup=False, highlight=False)
    for r in rows:
        if r["status"] != "ok":  # never loaded: a lookup in the writable root moves it to quarantine/
            out.print(f"corrupt {r['key'][:12]} ({r['path']}): {r['status']}", markup=False, highlight=False,
                      soft_wrap=True)


# ---- bench -------------------------------------------------------------------------------------
def gpu_problem() -> str | None:
    """Why kernels cannot run here (no torch, no CUDA device, no CuPy), or None when they can."""
    try:
        import torch
    except ImportError:
        return "torch is not installed (pip install 'jitattn[cuda13]')"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device on this machine"
    try:
        import cupy  # noqa: F401
    except ImportError:
        return "CuPy is not installed (pip install 'jitattn[cuda12]' or 'jitattn[cuda13]')"
    return None


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def bench(ctx: typer.Context) -> None:
    """Time jitattn against the anchors side by side (needs a CUDA GPU).

    Other arguments go to jitattn.bench: --case NAME (repeatable), --host-profile, --no-check.
    """
    problem = gpu_problem()
    if problem:
        _fail(f"jitattn bench runs kernels on a CUDA GPU, and cannot here: {problem}")
    from jitattn import bench as bench_module

    bench_module.main(list(ctx.args))


if __name__ == "__main__":
    app()
