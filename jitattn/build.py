"""Build: a rendered source becomes one cubin per target arch, through nvcc driven by ninja.

No GPU is needed: nvcc cross-compiles for any arch it knows. Builds are hermetic and reproducible:
the template headers are copied into the build directory (``include/``), byte for byte the files
the cache key hashed; every source nvcc reads gets one fixed mtime (``-lineinfo`` records source
mtimes and the build directory in the cubin's line table); ``NVCC_PREPEND_FLAGS`` /
``NVCC_APPEND_FLAGS`` are removed from nvcc's environment. So two builds of one key in the same
directory give byte-identical cubins (the cache builds each key in ``<root>/v1/build/<key>/``).

A compile error raises
:class:`CompileError` carrying nvcc's own message, the rendered file's path and line, and the
functor the line came from (the rendered source marks functor lines with ``#line`` directives, so
nvcc reports them as ``logits_transform(1): error: ...``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shlex
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Mapping

from jitattn import render as _render
from jitattn import settings
from jitattn.archs import ARCHS, archs_for_capability, normalize_arch  # noqa: F401 (re-exported)
from jitattn.render import FUNCTOR_NAMES, RENDERED_FILE, RenderedSource, functor_at

logger = logging.getLogger("jitattn.build")

#: Flags every build uses; part of the cache key. ``-Xptxas -v`` puts register and spill counts in
#: the build log that the cache manifest keeps.
NVCC_FLAGS: tuple[str, ...] = ("-O3", "-std=c++17", "-Xptxas", "-v", "-lineinfo")

#: The mtime given to every file nvcc reads (2000-01-01T00:00:00Z). ``-lineinfo`` writes each source
#: file's mtime into the cubin's line table, so without this two builds of one key differ byte for byte.
SOURCE_MTIME = 946684800

#: Where the build directory's copy of the template headers lives (``-I`` relative to it).
INCLUDE_DIR = "include"

#: nvcc reads extra flags from these; a build must not depend on the caller's environment.
_NVCC_ENV_FLAGS = ("NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS")


class BuildError(RuntimeError):
    """nvcc or ninja could not run at all (not installed, wrong path)."""


class CompileError(RuntimeError):
    """nvcc rejected a rendered source.

    Attributes:
        source_path: the rendered ``kernel.cu`` (kept for inspection).
        arch: target arch.
        functor: ``"logits_transform"`` / ``"logits_mask"`` when the first error is in a user functor, else None.
        line: 1-based line of the first error in the rendered file (or in the functor), or None.
        nvcc_output: nvcc's complete output.
    """

    def __init__(self, message: str, *, source_path: Path, arch: str, functor: str | None, line: int | None,
                 nvcc_output: str):
        super().__init__(message)
        self.source_path, self.arch, self.functor, self.line, self.nvcc_output = (
            source_path, arch, functor, line, nvcc_output)


@lru_cache(maxsize=None)
def nvcc_version(nvcc: str) -> str:
    """nvcc's version banner (release and build strings), part of every cache key.

    Raises:
        BuildError: nvcc cannot be run, with the path tried and how to point jitattn at it.
    """
    import subprocess  # here, not at the top: a warm start under JITATTN_DISABLE_JIT never runs nvcc

    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise BuildError(
            f"cannot run nvcc at {nvcc!r} ({exc}); install the CUDA toolkit (or "
            f"pip install 'jitattn[nvcc]') or set JITATTN_NVCC / CUDA_HOME") from None
    lines = [ln.strip() for ln in out.splitlines() if "release" in ln or ln.startswith("Build")]
    return " | ".join(lines) or out.strip()


def ninja_executable() -> str:
    """The ninja binary from the ``ninja`` Python package (a declared dependency), else PATH's."""
    try:
        import ninja  # type: ignore[import-not-found]

        path = Path(ninja.BIN_DIR) / "ninja"
        if path.exists():
            return str(path)
    except ImportError:
        pass
    return "ninja"


def write_if_different(path: Path, text: str) -> bool:
    """Write ``text`` unless the file already holds it (keeps mtimes, so ninja stays incremental)."""
    if path.exists() and path.read_text() == text:
        return False
    path.write_text(text)
    return True


def cubin_name(arch: str) -> str:
    return f"kernel.{arch}.cubin"


def nvcc_command(arch: str, nvcc: str, flags: tuple[str, ...], include_dir: str = INCLUDE_DIR) -> list[str]:
    """The nvcc command line ninja runs for ``arch`` in a build directory (as :func:`ninja_file` writes it)."""
    return [nvcc, *flags, f"-I{include_dir}", "-cubin", f"-gencode={ARCHS[arch]}", "-o", cubin_name(arch),
            RENDERED_FILE]


def ninja_file(archs: list[str], nvcc: str, *, flags: tuple[str, ...] | None = None,
               include_dir: str | None = None) -> str:
    """build.ninja text: one nvcc edge per target arch, all from ``kernel.cu``.

    ``flags`` default to :data:`NVCC_FLAGS`; ``include_dir`` (the ``-I`` path) to the template directory.
    """
    flag_text = " ".join(shlex.quote(f) for f in (NVCC_FLAGS if flags is None else flags))
    include = include_dir if include_dir is not None else str(_render.template_dir())
    lines = [
        "# Written by jitattn/build.py",
        "ninja_required_version = 1.3",
        f"nvcc = {shlex.quote(nvcc)}",
        f"flags = {flag_text} -I{shlex.quote(include)}",
        "rule cubin",
        "  command = $nvcc $flags -cubin -gencode=$gencode -o $out $in",
        "  description = nvcc $arch $in",
        "",
    ]
    for arch in archs:
        lines += [f"build {cubin_name(arch)}: cubin {RENDERED_FILE}", f"  gencode = {ARCHS[arch]}", f"  arch = {arch}"]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class BuildResult:
    cubin: Path
    log: str
    seconds: float


def snapshot_templates(expected: Mapping[str, str] | None = None) -> dict[str, bytes]:
    """The template files a build compiles against, read now: name -> bytes.

    ``expected`` (name -> sha256, the cache key's ``templates``) names the files and their hashes;
    default: :func:`jitattn.render.template_hashes`.

    Raises:
        BuildError: a file changed (or vanished) since the key was computed: the entry would be
            keyed by one header and compiled from another.
    """
    expected = _render.template_hashes() if expected is None else expected
    directory = _render.template_dir()
    files = {}
    for name, digest in sorted(expected.items()):
        try:
            data = (directory / name).read_bytes()
        except OSError as exc:
            raise BuildError(f"cannot read template {directory / name}: {exc.strerror}") from None
        if hashlib.sha256(data).hexdigest() != digest:
            raise BuildError(f"template {directory / name} changed after this process computed its cache keys; "
                             f"restart the process so the key covers the new content")
        files[name] = data
    return files


def prepare(source: RenderedSource, arch: str, build_dir: Path, *, flags: tuple[str, ...] | None = None,
            templates: Mapping[str, bytes] | None = None) -> list[str]:
    """Write ``kernel.cu``, ``include/`` and ``build.ninja`` into ``build_dir``; return the ninja command.

    Every source file gets the mtime :data:`SOURCE_MTIME`. Raises OSError when the directory cannot
    be written (the caller says where and why).
    """
    nvcc = settings.nvcc()
    include = build_dir / INCLUDE_DIR
    include.mkdir(parents=True, exist_ok=True)
    sources = [build_dir / RENDERED_FILE]
    write_if_different(sources[0], source.text)
    for name, data in (snapshot_templates() if templates is None else templates).items():
        sources.append(include / name)
        if not sources[-1].exists() or sources[-1].read_bytes() != data:
            sources[-1].write_bytes(data)
    for path in sources:
        os.utime(path, (SOURCE_MTIME, SOURCE_MTIME))
    write_if_different(build_dir / "build.ninja", ninja_file([arch], nvcc, flags=flags, include_dir=INCLUDE_DIR))
    return [ninja_executable(), "-C", str(build_dir), "-v", cubin_name(arch)]


def build(source: RenderedSource, arch: str, build_dir: Path, *, flags: tuple[str, ...] | None = None,
          templates: Mapping[str, bytes] | None = None) -> BuildResult:
    """Compile ``source`` for ``arch`` in ``build_dir`` (created if needed).

    Args:
        flags: nvcc flags (default :data:`NVCC_FLAGS`); the cache passes its key's, so the two agree.
        templates: the header files to compile against, name -> bytes (default: read now,
            :func:`snapshot_templates`); copied into ``build_dir/include``.

    Returns:
        The cubin path, nvcc's output (ptxas resource usage included) and wall seconds.

    Raises:
        BuildError: nvcc or ninja cannot run.
        CompileError: nvcc rejected the source (message, path, line, functor, nvcc output).
        OSError: ``build_dir`` cannot be written.
    """
    arch = normalize_arch(arch)
    settings.configure_logging()
    nvcc = settings.nvcc()
    nvcc_version(nvcc)  # fails early, with a clear message, when nvcc is missing
    cmd = prepare(source, arch, build_dir, flags=flags, templates=templates)
    command = nvcc_command(arch, nvcc, NVCC_FLAGS if flags is None else flags)
    logger.debug("compile %s in %s: %s", arch, build_dir, shlex.join(command))
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in _NVCC_ENV_FLAGS}
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**env, "NINJA_STATUS": ""})
    except OSError as exc:
        raise BuildError(f"cannot run ninja ({cmd[0]}): {exc}; `pip install ninja`") from None
    seconds = time.perf_counter() - start
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise _compile_error(log, build_dir / RENDERED_FILE, source.text, arch)
    return BuildResult(build_dir / cubin_name(arch), log, seconds)


_DIAG = re.compile(r"^(?P<file>[^\s(]+)\((?P<line>\d+)\): (?P<kind>error|catastrophic error)[^:]*: (?P<msg>.*)$", re.M)


def _compile_error(log: str, path: Path, text: str, arch: str) -> CompileError:
    """Turn nvcc output into a CompileError that names the file, the line and the functor."""
    m = _DIAG.search(log)
    functor, line, where = None, None, str(path)
    if m:
        line = int(m.group("line"))
        name = Path(m.group("file")).name
        if name in FUNCTOR_NAMES:
            functor = name
            where = f"{path} (functor {name}, line {line} of the expression)"
        elif name == RENDERED_FILE:
            functor = functor_at(text, line)
            src_line = text.split("\n")[line - 1].strip() if 0 < line <= text.count("\n") + 1 else ""
            where = f"{path}:{line}" + (f" (functor {functor})" if functor else "") + f"\n    {src_line}"
        else:
            header = m.group("file")
            if Path(header).parent.name == INCLUDE_DIR:  # the build's copy of a template: name the original
                header = str(_render.template_dir() / name)
            where = f"{header}:{line} (included by {path})"
        headline = f"nvcc ({arch}) rejected the rendered kernel: {m.group('msg').strip()}\n  at {where}"
    else:
        headline = f"nvcc/ninja ({arch}) failed building {path}"
    errors = "\n".join(ln for ln in log.splitlines() if "error" in ln.lower())[:4000]
    return CompileError(f"{headline}\n--- nvcc output (errors) ---\n{errors or log[-4000:]}", source_path=path,
                        arch=arch, functor=functor, line=line, nvcc_output=log)
