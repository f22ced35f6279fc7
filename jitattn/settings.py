"""Every environment variable jitattn reads, declared once, validated, documented.

Nothing else in the package calls ``os.environ``: modules ask this one. Tests change settings with
``settings.scope(...)``, which restores the previous values on exit.

| variable | meaning | default |
|---|---|---|
| ``JITATTN_CACHE_DIR`` | writable cache root (entries, build dirs, locks) | the user cache dir (platformdirs) |
| ``JITATTN_CACHE_PATH`` | extra read-only cache roots, ``os.pathsep``-separated, searched after the writable one | none |
| ``JITATTN_DISABLE_JIT`` | ``1``: a cache miss raises :class:`~jitattn.cache.MissingKernelError`, nvcc never runs (except under ``jitattn warmup``, the build step, which compiles anyway) | ``0`` |
| ``JITATTN_NVCC`` | the nvcc executable | ``$CUDA_HOME/bin/nvcc`` if it exists, else ``nvcc`` on PATH, else the nvcc wheel's (:func:`wheel_nvcc`) |
| ``JITATTN_ARCHS`` | comma-separated target archs for warm-up, e.g. ``sm_80,sm_90a`` | ``sm_80,sm_90a`` |
| ``JITATTN_LOCK_TIMEOUT`` | seconds to wait for another process's build of the same kernel | ``600`` |
| ``JITATTN_BACKEND`` | force one attention backend by name (see :mod:`jitattn.selector`) | automatic |
| ``JITATTN_VERBOSE`` | ``1``: log each compile command and cache decision to stderr | ``0`` |

Logging: every module logs on a child of the ``jitattn`` logger (``jitattn.cache``,
``jitattn.build``, ``jitattn.selector``). :func:`configure_logging` gives that logger a stderr
handler at DEBUG when ``JITATTN_VERBOSE=1`` (and takes it away when it is not); the cache, the
build and the command line call it, so the variable takes effect without any logging setup by
the caller. An application that configures logging itself can leave the variable unset and set
the ``jitattn`` logger's level.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterator

from jitattn.archs import normalize_arch

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _parse_bool(name: str, raw: str) -> bool:
    low = raw.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r}: expected one of 1/0, true/false, yes/no, on/off")


def _parse_float(name: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected a number of seconds") from None
    if value <= 0:
        raise ValueError(f"{name}={raw!r}: expected a positive number of seconds")
    return value


@dataclass(frozen=True)
class _Var:
    name: str
    default: str
    parse: Callable[[str, str], object]
    doc: str

    def get(self) -> object:
        return self.parse(self.name, os.environ.get(self.name, self.default))


def _parse_str(name: str, raw: str) -> str:
    return raw.strip()


def _parse_paths(name: str, raw: str) -> tuple[Path, ...]:
    return tuple(Path(p).expanduser() for p in raw.split(os.pathsep) if p.strip())


def _parse_archs(name: str, raw: str) -> tuple[str, ...]:
    archs = tuple(a.strip() for a in raw.split(",") if a.strip())
    if not archs:
        raise ValueError(f"{name}={raw!r}: expected a comma-separated list such as 'sm_80,sm_90a'")
    return tuple(normalize_arch(a, field=name) for a in archs)


VARIABLES: dict[str, _Var] = {
    v.name: v
    for v in [
        _Var("JITATTN_CACHE_DIR", "", _parse_str, "writable cache root"),
        _Var("JITATTN_CACHE_PATH", "", _parse_paths, "read-only cache roots searched after it"),
        _Var("JITATTN_DISABLE_JIT", "0", _parse_bool, "a cache miss is an error; nvcc never runs"),
        _Var("JITATTN_NVCC", "", _parse_str, "nvcc executable"),
        _Var("JITATTN_ARCHS", "sm_80,sm_90a", _parse_archs, "warm-up target archs"),
        _Var("JITATTN_LOCK_TIMEOUT", "600", _parse_float, "seconds to wait for a build lock"),
        _Var("JITATTN_BACKEND", "", _parse_str, "force one backend by name"),
        _Var("JITATTN_VERBOSE", "0", _parse_bool, "log compiles and cache decisions"),
    ]
}


def check_environment() -> None:
    """Read every ``JITATTN_*`` variable once, so a bad value is refused before any work (the command line
    calls it first: a value read only later, mid-build, would fail as a kernel's compile error).

    Raises:
        ValueError: the first variable whose value does not parse, naming it, the value and what is allowed.
    """
    for var in VARIABLES.values():
        var.get()


def cache_dir_is_set() -> bool:
    """Whether ``JITATTN_CACHE_DIR`` names the root (rather than the platformdirs default)."""
    return bool(VARIABLES["JITATTN_CACHE_DIR"].get())


def cache_dir() -> Path:
    """The writable cache root: ``JITATTN_CACHE_DIR``, else platformdirs' user cache dir."""
    raw = VARIABLES["JITATTN_CACHE_DIR"].get()
    if raw:
        return Path(str(raw)).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("jitattn", appauthor=False))


def cache_path() -> tuple[Path, ...]:
    """Read-only cache layers from ``JITATTN_CACHE_PATH``, in lookup order."""
    return VARIABLES["JITATTN_CACHE_PATH"].get()  # type: ignore[return-value]


def disable_jit() -> bool:
    """True when ``JITATTN_DISABLE_JIT`` forbids compiling (production serving)."""
    return bool(VARIABLES["JITATTN_DISABLE_JIT"].get())


def nvcc() -> str:
    """The nvcc to run: ``JITATTN_NVCC``, else ``$CUDA_HOME/bin/nvcc``, else ``nvcc`` on PATH, else
    the one ``pip install 'jitattn[nvcc]'`` brought (:func:`wheel_nvcc`), else ``"nvcc"``.

    The one place that resolves nvcc (the build, the cache key and ``jitattn doctor`` ask it).
    """
    explicit = VARIABLES["JITATTN_NVCC"].get()
    if explicit:
        return str(explicit)
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if home and (Path(home) / "bin" / "nvcc").exists():
            return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc") or wheel_nvcc() or "nvcc"


@lru_cache(maxsize=1)
def wheel_nvcc() -> str | None:
    """The nvcc of NVIDIA's ``nvidia-cuda-nvcc`` wheel in this Python environment, or None.

    Found through the wheel's installed file list (importlib.metadata), wherever site-packages is.
    The ``jitattn[nvcc]`` extra installs it beside the nvvm (cicc, libdevice), crt, runtime-header
    and CCCL wheels, which unpack into the same ``nvidia/cu13/`` tree a toolkit has (``bin/``,
    ``nvvm/``, ``include/``, ``include/cccl``); the wheel's own ``bin/nvcc.profile`` finds them
    relative to nvcc, so that nvcc runs as it is: no ``CUDA_HOME``, ``-I`` or ``-ccbin`` (it uses the
    host C++ compiler on PATH, as any nvcc does).
    """
    from importlib import metadata

    try:
        files = metadata.distribution("nvidia-cuda-nvcc").files or []
    except metadata.PackageNotFoundError:
        return None
    for file in files:
        if file.parts[-2:] == ("bin", "nvcc"):
            path = Path(str(file.locate())).resolve()
            if path.is_file() and os.access(path, os.X_OK):
                return str(path)
    return None


def archs() -> tuple[str, ...]:
    """Warm-up target archs from ``JITATTN_ARCHS`` (normalized, e.g. ``('sm_80', 'sm_90a')``)."""
    return VARIABLES["JITATTN_ARCHS"].get()  # type: ignore[return-value]


def lock_timeout() -> float:
    """Seconds to wait for another process building the same kernel."""
    return VARIABLES["JITATTN_LOCK_TIMEOUT"].get()  # type: ignore[return-value]


def forced_backend() -> str | None:
    """The backend named by ``JITATTN_BACKEND``, or None for automatic selection."""
    return VARIABLES["JITATTN_BACKEND"].get() or None  # type: ignore[return-value]


def verbose() -> bool:
    """True when ``JITATTN_VERBOSE`` asks for each compile command and cache decision on stderr."""
    return bool(VARIABLES["JITATTN_VERBOSE"].get())


#: The logger every jitattn module logs under (as ``jitattn.<module>``).
LOGGER = "jitattn"


class _StderrHandler(logging.StreamHandler):
    """Writes to the ``sys.stderr`` of the moment (pytest and CLI runners replace it)."""

    def emit(self, record: logging.LogRecord) -> None:
        import sys

        self.setStream(sys.stderr)
        super().emit(record)


_handler = _StderrHandler()
_handler.setFormatter(logging.Formatter("[jitattn] %(message)s"))


def configure_logging() -> logging.Logger:
    """Match the ``jitattn`` logger to ``JITATTN_VERBOSE``: with it, DEBUG records go to stderr
    through one handler of ours; without it, our handler is removed and the level left to the
    application. Cheap (one environment read), so callers run it on each entry point.

    Raises:
        ValueError: ``JITATTN_VERBOSE`` is not a boolean.
    """
    log = logging.getLogger(LOGGER)
    if verbose():
        if _handler not in log.handlers:
            log.addHandler(_handler)
        log.setLevel(logging.DEBUG)
    elif _handler in log.handlers:
        log.removeHandler(_handler)
        log.setLevel(logging.NOTSET)
    return log


@contextlib.contextmanager
def scope(**values: str | None) -> Iterator[None]:
    """Set environment variables for a block and restore them after; None unsets one.

    Example: ``with settings.scope(JITATTN_DISABLE_JIT="1"): ...``. Unknown names raise KeyError,
    so a typo in a test cannot silently set nothing.
    """
    for name in values:
        if name not in VARIABLES:
            raise KeyError(f"{name!r} is not a jitattn setting; known: {sorted(VARIABLES)}")
    saved = {name: os.environ.get(name) for name in values}
    try:
        for name, value in values.items():
            _assign(name, value)
        yield
    finally:
        for name, value in saved.items():
            _assign(name, value)


def _assign(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
