"""The ``jitattn`` command line.

- ``jitattn warmup``: compile every kernel some models (``--model config.json``) or specs
  (``--spec``) need, for every target arch, into the cache. nvcc only: no GPU, no torch. A model
  also gets the ``merge_state`` utility module of its output dtype (:mod:`jitattn.merge_module`) and
  the ``append_kv`` module of its paged layers' K/V and cache dtypes (:mod:`jitattn.append_kv_module`);
  a latent (MLA decode) spec that its kernel cannot serve (latent head dims not multiples of 64) compiles
  nothing: warmup names the backend that serves it;
  ``--spec '{"kind":"merge_state","dtype":"bfloat16"}'`` names one directly.
- ``jitattn cache ls | verify | prune | clear | export | import``: list the entries of every layer;
  check every checksum (quarantining corrupt entries); remove what no lookup uses; empty the
  writable root; ship the entries a model needs as one archive, and add one, verified, elsewhere
  (:mod:`jitattn.cache_admin`).
- ``jitattn select``: which backend serves each layer kind of a model on a device, and why
  (:func:`jitattn.selector.select_model`).
- ``jitattn doctor``: can this node serve some models with ``JITATTN_DISABLE_JIT=1``? nvcc, GPU,
  torch, the cache layers and, per model, which kernels are present (:mod:`jitattn.doctor`).
- ``jitattn bench``: jitattn against the anchors on a CUDA GPU (:mod:`jitattn.bench`).

``warmup``, ``cache export``, ``select`` and ``doctor`` take ``--tensor-parallel-size N``: the specs
are then one rank's (:func:`jitattn.models.per_rank_heads`).

Exit codes: 0 success; 1 the work found a problem: a kernel failed to compile (nvcc's message is
printed), ``cache verify`` found corrupt entries, ``cache export`` misses kernels (the warm-up
command that fills them is printed), ``cache import`` refused an archive, ``select`` found a layer
kind no backend serves, ``doctor`` found the node cannot serve the models (the warm-up command is
printed); 2 a usage error (missing file, bad JSON, unknown arch, invalid spec, an unknown model
type, heads that do not split over the ranks, nvcc missing, an unwritable cache root, no GPU),
printed as one ``jitattn: error: ...`` line without a traceback.

Each verb is a small function over the library's own objects (:class:`~jitattn.cache.KernelCache`,
:func:`~jitattn.models.load_model_config`, :class:`~jitattn.spec.AttentionSpec`).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import warnings
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Callable, Iterator, NoReturn, Optional

import typer
import typer.core
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from jitattn import modules, settings
from jitattn._version import __version__
from jitattn.build import BuildError, CompileError, normalize_arch, nvcc_version
from jitattn.cache import MANIFEST, CacheWriteError, KernelCache, point_root_elsewhere
from jitattn.commands import models_warmup_command
from jitattn.merge_module import MergeModule
from jitattn.modules import KernelModule
from jitattn.spec import KV_DTYPES, KV_LAYOUTS, PAGE_SIZE_MAX, QO_DTYPES, canonical_dtype

# torch prints this at import when its NumPy bridge cannot load (no NumPy, or one built for another
# ABI); jitattn never hands torch a NumPy array, so it is noise on every command that loads torch.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)

# The click that typer runs on: its own copy (typer.core._click, typer >= 0.2x) or the click package.
_click = getattr(typer.core, "_click", None) or typer.core.click


class _OneLineUsageError(_click.exceptions.UsageError):
    """click's own parse errors (a value it cannot convert, an unknown option or command, a missing
    option value), shown as jitattn's other usage errors: one ``jitattn: error:`` line, exit 2."""

    def show(self, file=None) -> None:
        typer.echo(f"jitattn: error: {self.format_message()}", file=file, err=file is None)


@contextlib.contextmanager
def _one_line_click_errors() -> Iterator[None]:
    try:
        yield
    except (_OneLineUsageError, getattr(_click.exceptions, "NoArgsIsHelpError", ())):
        raise  # already one line; or a bare command, whose help click prints
    except _click.exceptions.UsageError as exc:
        raise _OneLineUsageError(" ".join(exc.format_message().split()), exc.ctx) from None


class _Group(typer.core.TyperGroup):
    """The root command group: parse errors of the root and of every subcommand pass through here."""

    def make_context(self, *args, **kwargs):
        with _one_line_click_errors():
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx):
        with _one_line_click_errors():
            return super().invoke(ctx)


app = typer.Typer(
    cls=_Group,
    name="jitattn",
    help="JIT kernel-specialisation compiler for attention: warm the kernel cache, look after it, ship it, "
         "select backends, benchmark.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
cache_app = typer.Typer(help="Look after the on-disk kernel cache: ls, verify, prune, clear, export, import.",
                        no_args_is_help=True)
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
    except (ValueError, FileNotFoundError, BuildError, CacheWriteError) as exc:
        _fail(str(exc).strip().replace("\n", " "))


def _need_torch(command: str) -> None:
    """Exit 2 with one line when torch is missing (the build-box install has no torch)."""
    try:
        import torch  # noqa: F401
    except ImportError:
        _fail(f"`jitattn {command}` needs torch, which is not installed here (`jitattn warmup`, `cache`, `doctor` "
              f"and `select --device NAME` work without it): pip install 'jitattn[torch]'")


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"jitattn {__version__}")
        raise typer.Exit()


@app.callback()
def main(version: Annotated[bool, typer.Option("--version", callback=_version_callback, is_eager=True,
                                               help="Print the version and exit.")] = False) -> None:
    """JIT kernel-specialisation compiler for attention."""
    with _usage_errors():
        settings.check_environment()  # every JITATTN_* value, before any command reads one mid-way
        settings.configure_logging()  # JITATTN_VERBOSE=1: compile commands and cache decisions on stderr


# ---- options shared by the verbs that take models ----------------------------------------------
ModelOpt = Annotated[Optional[list[Path]], typer.Option(
    "--model", "-m", help="Hugging Face config.json; repeat for several models.")]
SpecOpt = Annotated[Optional[list[str]], typer.Option(
    "--spec", help="AttentionSpec JSON text, or a path to a .json file (one spec or a list); repeatable. "
                   "'{\"kind\":\"merge_state\",\"dtype\":\"bfloat16\"}' names a merge_state module.")]
ArchOpt = Annotated[Optional[list[str]], typer.Option(
    "--arch", "-a", help="Target arch such as sm_80 or sm_90a; repeatable. Default: JITATTN_ARCHS (sm_80, sm_90a).")]


def _dtype_option(allowed: tuple[str, ...]) -> Callable[[Optional[str]], Optional[str]]:
    """A dtype option's check at parsing, naming the option (the spec's names and aliases, as AttentionSpec takes)."""
    aliases = ", ".join(a for a in ("fp16", "bf16", "fp8") if canonical_dtype(a) in allowed)

    def check(value: Optional[str]) -> Optional[str]:
        if value is not None and canonical_dtype(value) not in allowed:
            raise typer.BadParameter(f"{value!r}: expected one of {', '.join(allowed)} (or an alias: {aliases})")
        return value
    return check


def _page_size_option(value: int) -> int:
    if not 1 <= value <= PAGE_SIZE_MAX:
        raise typer.BadParameter(f"{value}: expected tokens per page in [1, {PAGE_SIZE_MAX}]")
    return value


def _kv_layout_option(value: str) -> str:
    if value not in KV_LAYOUTS:
        raise typer.BadParameter(f"{value!r}: expected one of {', '.join(KV_LAYOUTS)} (upper case, as AttentionSpec's)")
    return value


DtypeOpt = Annotated[Optional[str], typer.Option(
    "--dtype", callback=_dtype_option(QO_DTYPES),
    help="float16 or bfloat16 for --model specs (default: the config's torch_dtype).")]
PageSizeOpt = Annotated[int, typer.Option("--page-size", callback=_page_size_option,
                                          help="KV page size of --model specs.")]
KvLayoutOpt = Annotated[str, typer.Option("--kv-layout", callback=_kv_layout_option,
                                          help="NHD or HND, for --model specs.")]
KvDtypeOpt = Annotated[Optional[str], typer.Option(
    "--kv-dtype", callback=_dtype_option(KV_DTYPES),
    help="KV-cache dtype of --model specs: float8_e4m3fn (fp8) for an FP8 cache (default: the q dtype).")]
CascadeOpt = Annotated[bool, typer.Option(
    "--cascade", help="Also each paged spec's explicit-position twin (the module cascade attention runs) and the "
                      "merge_state module it merges with.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="JSON output, for scripts.")]
TpOpt = Annotated[int, typer.Option(
    "--tensor-parallel-size", "--tp", min=1, help="Ranks a model's heads are split over: the specs are one rank's "
                                           "(query heads / N; KV heads / N, or 1 when fewer KV heads than ranks).")]


# ---- warmup: what to build ---------------------------------------------------------------------
@dataclass
class Target:
    """One spec (or utility module) to build, with every source that asked for it (``model/layer kind``,
    ``model/merge_state`` or ``--spec #i``)."""

    spec: KernelModule
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


def parse_spec_arg(text: str) -> list[KernelModule]:
    """``--spec`` value: AttentionSpec JSON text, or a path to a file holding a spec object or a list.

    An object with ``"kind": "merge_state"`` is a :class:`~jitattn.merge_module.MergeModule` (the
    text its missing-kernel error prints).

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
    if not items:
        raise UsageError(f"{source}: an empty list; --spec needs at least one AttentionSpec object")
    specs = []
    for i, item in enumerate(items):
        where = source if len(items) == 1 else f"{source} [{i}]"
        if not isinstance(item, dict):
            raise UsageError(f"{where}: expected a JSON object with AttentionSpec fields, got {type(item).__name__}")
        try:  # an AttentionSpec, or a module of another kind: {"kind": "merge_state", "dtype": ...}
            specs.append(modules.from_json(item))
        except (ValueError, TypeError, KeyError) as exc:
            raise UsageError(f"{where}: invalid spec: {exc}") from None
    return specs


def collect_targets(models: list[Path], spec_args: list[str], *, dtype: str | None, page_size: int,
                    kv_layout: str, kv_dtype: str | None = None, cascade: bool = False,
                    tensor_parallel_size: int = 1) -> list[Target]:
    """The distinct specs to build, in order of first mention, each with who asked for it.

    Each model also needs the ``merge_state`` module of each of its output dtypes and the ``append_kv``
    module of each of its (K/V dtype, cache dtype) pairs (after its specs).
    With ``cascade``, every paged spec's explicit-position twin too (the module cascade attention's
    passes run, :mod:`jitattn.cascade`) and the ``merge_state`` module of its output dtype (which merges
    the passes' states), after the spec itself. ``tensor_parallel_size`` makes a model's specs one
    rank's (``--spec`` values are taken as given).
    """
    from jitattn.doctor import model_modules
    from jitattn.models import load_model_config

    targets: dict[KernelModule, Target] = {}

    def add(spec: KernelModule, source: str) -> None:
        targets.setdefault(spec, Target(spec, [])).sources.append(source)
        if cascade and modules.kind_of(spec).name == modules.ATTENTION and spec.has_decode:
            add(spec.replace(query_positions="explicit"), f"{source} (cascade)")
            add(MergeModule(spec.o_dtype), f"{source} (cascade merge)")  # the cascade merges its levels' states

    for path in models:
        model = load_model_config(path, dtype=dtype, kv_layout=kv_layout, page_size=page_size, kv_dtype=kv_dtype,
                                  tensor_parallel_size=tensor_parallel_size)
        for module, part in model_modules(model):  # doctor checks the same list
            add(module, f"{Path(path).stem}/{part}")
    for i, text in enumerate(spec_args, start=1):
        for spec in parse_spec_arg(text):
            add(spec, f"--spec #{i}")
    return list(targets.values())


def without_kernels(targets: list[Target], arch: str) -> tuple[list[Target], list[str]]:
    """The targets that have a kernel to build or ship, and one line for each that has none (latent head dims
    the MLA decode kernel does not take: :func:`jitattn.doctor.no_kernel_note`) naming the backend that serves
    it on ``arch``."""
    from jitattn.doctor import no_kernel_note

    kept, notes = [], []
    for t in targets:
        note = no_kernel_note(t.spec, arch)
        if note:
            notes.append(f"{t.spec.name} (needed by {', '.join(t.sources)}): {note}")
        else:
            kept.append(t)
    return kept, notes


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
        raise UsageError(f"cache root {cache.root} is not writable ({exc.strerror}); "
                         f"{point_root_elsewhere(cache.root, 'writable')}") from None
    if not os.access(base, os.W_OK):
        raise UsageError(f"cache root {cache.root} is not writable; {point_root_elsewhere(cache.root, 'writable')}")
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
    model: ModelOpt = None,
    spec: SpecOpt = None,
    arch: ArchOpt = None,
    jobs: Annotated[Optional[int], typer.Option(
        "--jobs", "-j", help="Compiles at once. Default: cores, at most one per 2 GiB of free memory.")] = None,
    dtype: DtypeOpt = None,
    page_size: PageSizeOpt = 16,
    kv_layout: KvLayoutOpt = "NHD",
    kv_dtype: KvDtypeOpt = None,
    cascade: CascadeOpt = False,
    tensor_parallel_size: TpOpt = 1,
) -> None:
    """Compile every kernel the models or specs need, for every arch, into the cache (nvcc only, no GPU).

    Run it again and everything reports "cached" without compiling. Exit code 1 when a kernel failed.
    """
    with _usage_errors():
        if not model and not spec:
            raise UsageError("nothing to build: pass --model CONFIG.json and/or --spec JSON_OR_FILE")
        if jobs is not None and jobs < 1:
            raise UsageError(f"--jobs {jobs}: expected a number of compiles >= 1 (or leave it out for the default)")
        targets = collect_targets(model or [], spec or [], dtype=dtype, page_size=page_size, kv_layout=kv_layout,
                                  kv_dtype=kv_dtype, cascade=cascade, tensor_parallel_size=tensor_parallel_size)
        archs = resolve_archs(arch or [])
        targets, unbuilt = without_kernels(targets, archs[0])
        cache = KernelCache()
        nvcc = _check_build_box(cache)
    jobs = jobs or default_jobs()
    out, err = _console(), _console(stderr=True)
    err.print(f"jitattn warmup: {len(targets)} specs x {len(archs)} archs ({', '.join(archs)}), -j {jobs}\n"
              f"  cache: {cache.root}\n  nvcc: {nvcc}", markup=False, highlight=False)
    for line in unbuilt:
        out.print(f"not compiled: {line}", markup=False, highlight=False)
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


#: What to do about corrupt cache entries (``doctor``, ``cache ls``).
CORRUPT_FIX = ("`jitattn cache verify` moves those of the writable root to quarantine, and the next request (or "
               "`jitattn warmup`) rebuilds them; rebuild or re-ship those of a read-only layer (`jitattn cache export` "
               "/ `import`)")


def cache_rows(cache: KernelCache) -> list[dict]:
    """One dict per entry in every layer, the writable root first; ``status`` is ``ok`` or the problem."""
    roots = {str(cache.root): "writable", **{str(r): "read-only" for r in cache.layers}}
    rows = []
    for path, entry, problem in cache.entries():
        try:
            manifest = json.loads((path / MANIFEST).read_text())
        except (OSError, ValueError):
            manifest = {}
        manifest = manifest if isinstance(manifest, dict) else {}  # what it lacks is the row's status
        inputs = manifest.get("key_inputs") if isinstance(manifest.get("key_inputs"), dict) else {}
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


def _open_cache() -> KernelCache:
    """The cache the ``jitattn cache`` commands act on.

    Raises:
        UsageError: the root (``JITATTN_CACHE_DIR``) or a layer (``JITATTN_CACHE_PATH``) exists but is
            not a directory (a cache there would read as empty and every command would report nothing).
    """
    cache = KernelCache()
    for name, path in (("JITATTN_CACHE_DIR", cache.root), *(("JITATTN_CACHE_PATH", p) for p in cache.layers)):
        if path.exists() and not path.is_dir():
            raise UsageError(f"{name}: {path} is a file, not a cache directory")
    return cache


@cache_app.command("ls")
def cache_ls(as_json: Annotated[bool, typer.Option("--json", help="One JSON list, for scripts.")] = False) -> None:
    """List every entry of every cache layer: key, spec, arch, size, build time, layer, status (verified)."""
    with _usage_errors():
        cache = _open_cache()
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
    corrupt = [r for r in rows if r["status"] != "ok"]
    for r in corrupt:  # never loaded: a lookup in the writable root moves it to quarantine/
        _say(out, f"corrupt {r['key'][:12]} ({r['path']}): {r['status']}")
    if corrupt:
        _say(out, f"corrupt entries are never loaded. {CORRUPT_FIX}.")


def _say(console: Console, text: str) -> None:
    console.print(text, markup=False, highlight=False, soft_wrap=True)


@cache_app.command("verify")
def cache_verify(
    as_json: JsonOpt = False,
    no_quarantine: Annotated[bool, typer.Option(
        "--no-quarantine", help="Only report corrupt entries of the writable root; do not move them.")] = False,
) -> None:
    """Check every entry of every layer (manifest, key, each artifact's sha256).

    Corrupt entries of the writable root move to quarantine (the next request rebuilds them);
    those of read-only layers are reported. Exit code 1 when any entry is corrupt.
    """
    from jitattn import cache_admin

    with _usage_errors():
        findings = cache_admin.verify(_open_cache(), quarantine=not no_quarantine)
    bad = [f for f in findings if f.problem]
    if as_json:
        typer.echo(json.dumps([f.to_json() for f in findings], indent=1))
    else:
        out = _console()
        for f in bad:
            where = f"moved to {f.quarantined}" if f.quarantined else f"left in place ({f.layer})"
            _say(out, f"corrupt {f.path}: {f.problem}; {where}")
        _say(out, f"{len(findings)} entries checked, {len(findings) - len(bad)} ok, {len(bad)} corrupt")
    if bad:
        raise typer.Exit(1)


def _print_removals(removals: list, verb: str, dry_run: bool, as_json: bool, root: Path) -> None:
    if as_json:
        typer.echo(json.dumps([r.to_json() for r in removals], indent=1))
        return
    out = _console()
    label = f"would {verb}" if dry_run else f"{verb}d"
    for r in removals:
        _say(out, f"{label} {r.path} ({_human(r.size)}): {r.reason}")
    total = _human(sum(r.size for r in removals))
    _say(out, f"{label} {len(removals)} items, {total}, in {root}" if removals else f"nothing to {verb} in {root}")


def _remove_and_print(verb: str, remove: Callable[..., list], dry_run: bool, as_json: bool) -> None:
    """``remove(cache, dry_run=...)`` on the writable root, an OSError as a usage error naming the root."""
    with _usage_errors():
        cache = _open_cache()
        try:
            removals = remove(cache, dry_run=dry_run)
        except OSError as exc:
            raise UsageError(f"cannot {verb} {cache.root}: {exc}") from None
    _print_removals(removals, "remove", dry_run, as_json, cache.root)


@cache_app.command("prune")
def cache_prune(
    dry_run: Annotated[bool, typer.Option("--dry-run", "-n", help="Say what would go; remove nothing.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Remove from the writable root what no lookup uses, saying what and why.

    Unfinished publishes and imports (tmp/), killed builds (build/), failed builds, quarantine, idle
    lock files, markers of missing entries, and entries built by another jitattn version, other
    templates or other nvcc flags. Work in progress (a held lock, a live process) is left alone;
    read-only layers are never touched.
    """
    from jitattn import cache_admin

    _remove_and_print("prune", cache_admin.prune, dry_run, as_json)


@cache_app.command("clear")
def cache_clear(
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Really remove every entry of the writable root.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", "-n", help="Say what would go; remove nothing.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Remove every entry of the writable root (JITATTN_CACHE_DIR), then prune. Layers are untouched.

    Refuses without --yes, saying how much it would remove.
    """
    from jitattn import cache_admin

    def clear(cache, dry_run: bool) -> list:
        if not yes and not dry_run:
            planned = cache_admin.clear(cache, dry_run=True)
            count = sum(r.reason == "cleared" for r in planned)
            raise UsageError(f"cache clear removes {count} entries ({_human(sum(r.size for r in planned))}) "
                             f"from {cache.root}; pass --yes to do it, or --dry-run to list them")
        return cache_admin.clear(cache, dry_run=dry_run)

    _remove_and_print("clear", clear, dry_run, as_json)


@cache_app.command("export")
def cache_export(
    output: Annotated[Path, typer.Option("--output", "-o", help="Archive to write: .tar.gz, .tgz or .tar.")],
    model: ModelOpt = None,
    spec: SpecOpt = None,
    arch: ArchOpt = None,
    dtype: DtypeOpt = None,
    page_size: PageSizeOpt = 16,
    kv_layout: KvLayoutOpt = "NHD",
    kv_dtype: KvDtypeOpt = None,
    cascade: CascadeOpt = False,
    tensor_parallel_size: TpOpt = 1,
) -> None:
    """Write exactly the entries the models or specs need, for the archs, into one archive.

    A deployment ships only what it uses; `jitattn cache import FILE` adds it to another cache, or
    `tar -xzf FILE -C DIR` makes DIR a cache layer. Nothing compiles: a kernel that is not cached
    fails the export (exit 1) with the `jitattn warmup` command that builds it.
    """
    from jitattn import cache_admin

    with _usage_errors():
        if not model and not spec:
            raise UsageError("nothing to export: pass --model CONFIG.json and/or --spec JSON_OR_FILE")
        targets = collect_targets(model or [], spec or [], dtype=dtype, page_size=page_size, kv_layout=kv_layout,
                                  kv_dtype=kv_dtype, cascade=cascade, tensor_parallel_size=tensor_parallel_size)
        archs = resolve_archs(arch or [])
        targets, unbuilt = without_kernels(targets, archs[0])
        cache = _open_cache()
        wanted = cache_admin.needed(((t.spec, t.sources) for t in targets), archs)
        try:
            entries = cache_admin.export_entries(cache, wanted, output)
        except cache_admin.MissingEntriesError as exc:
            lines = [f"  {w.spec.name} {w.arch} (needed by {', '.join(w.needed_by)})" for w in exc.missing]
            looked = ", ".join(str(r) for r in cache.roots)
            command = models_warmup_command(model or [], spec or [], archs, dtype=dtype, page_size=page_size,
                                            kv_layout=kv_layout, kv_dtype=kv_dtype, cascade=cascade,
                                            tensor_parallel_size=tensor_parallel_size)
            typer.echo(f"jitattn: error: {len(exc.missing)} of {len(wanted)} kernels are not cached (looked in "
                       f"{looked}); nothing written:\n" + "\n".join(lines) +
                       f"\nbuild them on a machine with nvcc, then export again:\n  {command}", err=True)
            raise typer.Exit(1) from None
        except OSError as exc:
            raise UsageError(f"cannot write {output}: {exc.strerror or exc}") from None
    size = output.stat().st_size
    for line in unbuilt:
        _say(_console(), f"not exported: {line}")
    _say(_console(), f"exported {len(entries)} entries ({len(targets)} specs x {len(archs)} archs: "
                     f"{', '.join(archs)}) to {output} ({_human(size)})")


@cache_app.command("import")
def cache_import(
    archive: Annotated[Path, typer.Argument(help="An archive written by `jitattn cache export`.")],
    as_json: JsonOpt = False,
) -> None:
    """Add the entries of an exported archive to the writable root (JITATTN_CACHE_DIR).

    Every artifact is checked against its manifest's sha256 before any entry becomes visible; one
    bad entry refuses the whole archive (exit 1). Entries are renamed into place atomically.
    """
    from jitattn import cache_admin

    with _usage_errors():
        cache = _open_cache()
        try:
            results = cache_admin.import_archive(cache, archive)
        except cache_admin.ArchiveError as exc:
            typer.echo(f"jitattn: error: {exc}", err=True)
            raise typer.Exit(1) from None
    if as_json:
        typer.echo(json.dumps([r.to_json() for r in results], indent=1))
        return
    out = _console()
    for r in results:
        _say(out, f"{r.status:>8} {r.key[:12]} {r.name} {r.arch}")
    imported = sum(r.status == "imported" for r in results)
    _say(out, f"imported {imported}, already present {len(results) - imported}, into {cache.root}")


# ---- select ------------------------------------------------------------------------------------
@app.command()
def select(
    model: Annotated[Path, typer.Option("--model", "-m", help="Hugging Face config.json.")],
    device: Annotated[Optional[str], typer.Option(
        "--device", "-d", help="cpu, cuda, cuda:N, a GPU name (h100, a100, ...), an arch (sm_90) or a capability "
                               "(9.0). Default: the current CUDA device, else the CPU.")] = None,
    phase: Annotated[str, typer.Option("--phase", help="prefill, decode or mixed.")] = "mixed",
    dtype: DtypeOpt = None,
    page_size: PageSizeOpt = 16,
    kv_layout: KvLayoutOpt = "NHD",
    kv_dtype: KvDtypeOpt = None,
    need_lse: Annotated[bool, typer.Option("--need-lse", help="The caller needs the lse.")] = False,
    cuda_graph: Annotated[bool, typer.Option("--cuda-graph", help="Calls are captured in CUDA graphs.")] = False,
    backend: Annotated[Optional[str], typer.Option("--backend", help="Force one backend by name.")] = None,
    tensor_parallel_size: TpOpt = 1,
    as_json: JsonOpt = False,
) -> None:
    """Which backend serves each layer kind of a model on a device, and why the others do not.

    Works without a GPU, and without torch, when the device is named (--device h100): the planning
    command for a serving node, on a build box. Exit code 1 when a layer kind has no backend; 2 (one
    error line) for --device cuda / cuda:N where torch sees no GPU.
    """
    from jitattn.backends import DeviceInfo
    from jitattn.selector import format_model_selection, no_gpu_problem, select_model

    with _usage_errors():
        no_gpu = no_gpu_problem(DeviceInfo.parse(device)) if device is not None else None
        if no_gpu:
            raise UsageError(f"--device {device}: {no_gpu}; name the serving node's GPU or arch to plan for it "
                             f"(--device h100, --device sm_90), or use --device cpu")
        result = select_model(model, device, phase=phase, dtype=dtype, kv_layout=kv_layout, page_size=page_size,
                              need_lse=need_lse, cuda_graph=cuda_graph, backend=backend, kv_dtype=kv_dtype,
                              tensor_parallel_size=tensor_parallel_size)
    if as_json:
        typer.echo(json.dumps(result.to_json(), indent=1))
    else:
        typer.echo(format_model_selection(result), nl=False)
    if not result.ok:
        raise typer.Exit(1)


# ---- doctor ------------------------------------------------------------------------------------
@app.command()
def doctor(
    model: ModelOpt = None,
    arch: ArchOpt = None,
    dtype: DtypeOpt = None,
    page_size: PageSizeOpt = 16,
    kv_layout: KvLayoutOpt = "NHD",
    kv_dtype: KvDtypeOpt = None,
    tensor_parallel_size: TpOpt = 1,
    as_json: JsonOpt = False,
) -> None:
    """Can this node serve the models with JITATTN_DISABLE_JIT=1? nvcc, GPU and driver, torch, the cache
    layers, and which kernels each model needs are cached for which arch.

    Exit code 0 when every model's kernels are cached for an arch this node runs (without a GPU: for
    every --arch, default JITATTN_ARCHS) and no cache entry is corrupt, 1 otherwise, printing the
    `jitattn warmup` command that fills the gap or the corrupt entries: a health check for a
    deployment. Never compiles, never writes.
    """
    from jitattn import doctor as _doctor

    with _usage_errors():
        report = _doctor.diagnose(model or [], arch or [], dtype=dtype, page_size=page_size, kv_layout=kv_layout,
                                  kv_dtype=kv_dtype, tensor_parallel_size=tensor_parallel_size, cache=_open_cache())
    if as_json:
        typer.echo(json.dumps(report.to_json(), indent=1))
    else:
        _print_report(report, _console())
    if not report.ok:
        raise typer.Exit(1)


def _print_report(report, out: Console) -> None:
    """``jitattn doctor``'s tables: the node, the cache layers, each model's kernels, the verdict."""
    node = Table(title="node", show_header=False)
    node.add_column(no_wrap=True)
    node.add_column()
    n, d, t = report.nvcc, report.driver, report.torch
    node.add_row("nvcc", escape(f"{n.path}: {n.version}") if n.version else f"[red]not found[/] ({escape(n.error)})")
    node.add_row("driver", f"CUDA {d.version}" if d.version else escape(d.error))
    for g in d.gpus:
        node.add_row(f"GPU {g.index}", escape(f"{g.name}, compute capability {g.capability[0]}.{g.capability[1]} "
                                              f"(runs {', '.join(g.archs) or 'no jitattn arch'})"))
    node.add_row("torch", "torch not installed" if t.version is None else
                 escape(f"{t.version}, CUDA {t.cuda or 'none (CPU build)'}"
                        + (", sees the GPU" if t.cuda_available else "")))
    node.add_row("archs checked", ", ".join(report.archs) + (" (any one per kernel)" if report.any_arch else " (each)"))
    out.print(node)
    layers = Table(title="cache layers")
    for name in ("root", "layer", "exists", "writable", "entries", "corrupt"):
        layers.add_column(name, justify="right" if name in ("entries", "corrupt") else "left")
    for lay in report.layers:
        layers.add_row(escape(lay.root), lay.kind, "yes" if lay.exists else "no", "yes" if lay.writable else "no",
                       str(lay.entries), f"[bold red]{len(lay.corrupt)}[/]" if lay.corrupt else "0")
    out.print(layers)
    for lay in report.layers:
        for c in lay.corrupt:
            _say(out, f"corrupt, not loaded: {c}")
    for m in report.models:
        table = Table(title=escape(f"{m.name} ({m.config})" + (f", tensor parallel {m.tensor_parallel_size}"
                                                                if m.tensor_parallel_size > 1 else "")))
        table.add_column("kernel", no_wrap=True)
        table.add_column("needed by")
        for a in report.archs:
            table.add_column(a)
        table.add_column("served")
        for k in m.kernels:
            table.add_row(k.name, escape(", ".join(k.needed_by)),
                          *("no kernel" if k.note else "[green]present[/]" if a in k.found else "[red]missing[/]"
                            for a in report.archs),
                          "[green]yes[/]" if k.served else "[bold red]no[/]")
        out.print(table)
        for k in m.kernels:
            if k.note:
                _say(out, f"note: {k.name}: {k.note}")
    for note in report.notes:
        _say(out, f"note: {note}")
    if not report.models:
        _say(out, "no --model given: only the node and the cache were checked")
    elif all(m.ok for m in report.models):
        _say(out, "ok: this node can serve every model with JITATTN_DISABLE_JIT=1")
    else:
        missing = sum(not k.served for m in report.models for k in m.kernels)
        what = "1 kernel is" if missing == 1 else f"{missing} kernels are"
        _say(out, f"NOT OK: {what} missing; JITATTN_DISABLE_JIT=1 would fail on them. "
                  f"Fill the cache on a build box with:\n  {report.warmup_command}\nthen ship it "
                  f"(jitattn cache export / import).")
    if report.corrupt:
        what = "1 cache entry is" if len(report.corrupt) == 1 else f"{len(report.corrupt)} cache entries are"
        _say(out, f"NOT OK: {what} corrupt (listed above; never loaded). {CORRUPT_FIX}.")


# ---- bench -------------------------------------------------------------------------------------
def gpu_problem() -> str | None:
    """Why kernels cannot run here (no torch, no CUDA device), or None when they can."""
    try:
        import torch
    except ImportError:
        return "torch is not installed (pip install 'jitattn[torch]', or torch for your CUDA from pytorch.org)"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device on this machine"
    return None


@app.command()
def bench(
    case: Annotated[Optional[list[str]], typer.Option(
        "--case", metavar="NAME", help="Case name substring; repeatable (--list shows the cases).")] = None,
    model: Annotated[Optional[list[str]], typer.Option(
        "--model", metavar="CONFIG", help="A Hugging Face config.json: a decode and a prefill case per paged layer "
                                          "kind, a decode case per latent (MLA) kind, none for a ragged kind (such as "
                                          "DeepSeek's mla_prefill); repeatable.")] = None,
    anchors: Annotated[Optional[str], typer.Option(
        "--anchors", help="Comma-separated anchors to run, from sdpa, flex, flashinfer (default: all; '' for "
                          "jitattn alone).")] = None,
    json_path: Annotated[Optional[str], typer.Option(
        "--json", metavar="PATH", help="Write environment, cases, results and compile figures as JSON (rewritten "
                                       "after every case, so a killed run keeps what it measured).")] = None,
    md: Annotated[Optional[str], typer.Option(
        "--md", metavar="PATH", help="Replace the 'Latest' section of this BENCHMARKS.md.")] = None,
    no_check: Annotated[bool, typer.Option("--no-check", help="Skip the reference error check.")] = False,
    host_profile: Annotated[bool, typer.Option(
        "--host-profile", help="cProfile the host side of each jitattn call instead of timing.")] = False,
    compile_: Annotated[bool, typer.Option(
        "--compile", help="Also measure compile figures: cold nvcc s (fresh cache), warm load ms (fresh process), "
                          "torch.compile s of the Flex variant; without a GPU, the nvcc figures only.")] = False,
    compile_only: Annotated[bool, typer.Option("--compile-only", help="--compile, and time nothing else.")] = False,
    list_: Annotated[bool, typer.Option(
        "--list", help="Print the selected cases and exit (no GPU, no torch needed).")] = False,
    from_json: Annotated[Optional[list[str]], typer.Option(
        "--from-json", metavar="PATH", help="Run nothing: print the tables of earlier --json files, merged in order "
                                            "(repeatable; with --md, write BENCHMARKS.md from them).")] = None,
    seed: Annotated[int, typer.Option("--seed", help="Input seed.")] = 0,
) -> None:
    """Time jitattn against the anchors side by side (SDPA, FlexAttention, FlashInfer) on a CUDA GPU.

    Prefill in TFLOP/s, decode in TB/s of K/V read, host cases in us per eager call, each with its
    error against the fp32 reference (jitattn.bench). Without a GPU, --list, --from-json (tables and
    BENCHMARKS.md from earlier runs) and --compile-only (nvcc figures) still work; --list and
    --from-json need no torch either.
    """
    from jitattn import bench as bench_module

    try:
        options = bench_module.BenchOptions(
            cases=tuple(case or ()), models=tuple(model or ()), json=json_path, md=md, check=not no_check,
            host_profile=host_profile, compile=compile_, compile_only=compile_only, list=list_,
            from_json=tuple(from_json or ()), seed=seed,
            **({} if anchors is None else {"anchors": bench_module.BenchOptions.parse_anchors(anchors)}))
        problem = None if options.list or options.from_json or options.compile_only else gpu_problem()
        if problem:  # a usage error (--case nope, a bad --model) is named first: a GPU would not fix it
            bench_module.select_cases(options.cases, options.models)
            _fail(f"jitattn bench runs kernels on a CUDA GPU, and cannot here: {problem} "
                  f"(--list, --from-json and --compile-only work without one)")
        if not (options.list or options.from_json):
            _need_torch("bench")
        bench_module.main(options)
    except bench_module.BenchUsageError as exc:  # a bad --case / --model / --from-json: one line, exit 2
        _fail(str(exc).strip().replace("\n", " "))


if __name__ == "__main__":
    app()
