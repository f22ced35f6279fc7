"""Build: a rendered source becomes one cubin per target arch, through nvcc driven by ninja.

No GPU is needed: nvcc cross-compiles for any arch it knows. A compile error raises
:class:`CompileError` carrying nvcc's own message, the rendered file's path and line, and the
functor the line came from (the rendered source marks functor lines with ``#line`` directives, so
nvcc reports them as ``logits_transform(1): error: ...``).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from jitattn import settings
from jitattn.render import FUNCTOR_NAMES, RENDERED_FILE, RenderedSource, functor_at, template_dir

#: Arch name -> the ``-gencode`` value that builds its cubin. ``a`` archs use arch-specific features.
ARCHS: dict[str, str] = {
    "sm_80": "arch=compute_80,code=sm_80",
    "sm_86": "arch=compute_86,code=sm_86",
    "sm_89": "arch=compute_89,code=sm_89",
    "sm_90": "arch=compute_90,code=sm_90",
    "sm_90a": "arch=compute_90a,code=sm_90a",
    "sm_100a": "arch=compute_100a,code=sm_100a",
    "sm_120": "arch=compute_120,code=sm_120",
}

#: Flags every build uses; part of the cache key. ``-Xptxas -v`` puts register and spill counts in
#: the build log that the cache manifest keeps.
NVCC_FLAGS: tuple[str, ...] = ("-O3", "-std=c++17", "-Xptxas", "-v", "-lineinfo")


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


def normalize_arch(value: str, *, field: str = "arch") -> str:
    """``"90a"``, ``"sm90a"``, ``"9.0a"`` or ``"sm_90a"`` -> ``"sm_90a"``; ValueError if unknown."""
    raw = str(value).strip().lower()
    m = re.fullmatch(r"(?:sm_?|compute_?)?(\d+)\.?(\d)?([a-z]?)", raw)
    name = None
    if m:
        major_minor = m.group(1) + (m.group(2) or "")
        if len(major_minor) == 1:
            major_minor += "0"
        name = f"sm_{major_minor}{m.group(3)}"
    if name not in ARCHS:
        raise ValueError(f"{field}={value!r}: unknown target arch; expected one of {sorted(ARCHS)}")
    return name


def archs_for_capability(major: int, minor: int) -> list[str]:
    """Archs whose cubins run on a device of this compute capability, best first.

    A cubin runs on devices of the same major version and an equal or higher minor; ``a`` archs
    run only on exactly their own capability.
    """
    exact = f"sm_{major}{minor}"
    out = [a for a in (exact + "a", exact) if a in ARCHS]
    for name in sorted(ARCHS, reverse=True):
        if name.endswith("a") or name in out:
            continue
        num = int(name[3:])
        if num // 10 == major and num % 10 <= minor:
            out.append(name)
    return out


@lru_cache(maxsize=None)
def nvcc_version(nvcc: str) -> str:
    """nvcc's version banner (release and build strings), part of every cache key.

    Raises:
        BuildError: nvcc cannot be run, with the path tried and how to point jitattn at it.
    """
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise BuildError(
            f"cannot run nvcc at {nvcc!r} ({exc}); install the CUDA toolkit or set JITATTN_NVCC / CUDA_HOME") from None
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


def ninja_file(archs: list[str], nvcc: str) -> str:
    """build.ninja text: one nvcc edge per target arch, all from ``kernel.cu``."""
    flags = " ".join(shlex.quote(f) for f in NVCC_FLAGS)
    lines = [
        "# Written by jitattn/build.py",
        "ninja_required_version = 1.3",
        f"nvcc = {shlex.quote(nvcc)}",
        f"flags = {flags} -I{shlex.quote(str(template_dir()))}",
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


def build(source: RenderedSource, arch: str, build_dir: Path) -> BuildResult:
    """Compile ``source`` for ``arch`` in ``build_dir`` (created if needed).

    Returns:
        The cubin path, nvcc's output (ptxas resource usage included) and wall seconds.

    Raises:
        BuildError: nvcc or ninja cannot run.
        CompileError: nvcc rejected the source (message, path, line, functor, nvcc output).
    """
    arch = normalize_arch(arch)
    nvcc = settings.nvcc()
    nvcc_version(nvcc)  # fails early, with a clear message, when nvcc is missing
    build_dir.mkdir(parents=True, exist_ok=True)
    write_if_different(build_dir / RENDERED_FILE, source.text)
    write_if_different(build_dir / "build.ninja", ninja_file([arch], nvcc))
    cmd = [ninja_executable(), "-C", str(build_dir), "-v", cubin_name(arch)]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "NINJA_STATUS": ""})
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
            where = f"{m.group('file')}:{line} (included by {path})"
        headline = f"nvcc ({arch}) rejected the rendered kernel: {m.group('msg').strip()}\n  at {where}"
    else:
        headline = f"nvcc/ninja ({arch}) failed building {path}"
    errors = "\n".join(ln for ln in log.splitlines() if "error" in ln.lower())[:4000]
    return CompileError(f"{headline}\n--- nvcc output (errors) ---\n{errors or log[-4000:]}", source_path=path,
                        arch=arch, functor=functor, line=line, nvcc_output=log)
