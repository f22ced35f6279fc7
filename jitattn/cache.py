"""Cache: compiled kernels on disk, addressed by content, built once, published atomically, verified on load.

Layout (``cache/README.md`` has the full description)::

    <root>/v1/entries/<key[:2]>/<key>/manifest.json    # written last: its presence means complete
                                     /kernel.cu        # the rendered source
                                     /kernel.<arch>.cubin
                                     /build.ninja, build.log
    <root>/v1/index/<skey[:2]>/<skey>/<key>             # empty marker: entry <key> serves source key <skey>
    <root>/v1/specs/<pkey[:2]>/<pkey>/<key>             # empty marker: entry <key> serves spec key <pkey>
    <root>/v1/locks/<key>.lock                          # one lock per key (flock: released on kill -9)
    <root>/v1/build/<key>/                              # the one build directory of a key (under its lock)
    <root>/v1/tmp/<key>.<pid>.<random>/                 # an entry being published, or a directory being removed
    <root>/v1/quarantine/<key>.<ms>/                    # corrupt entries moved aside, never loaded
    <root>/v1/failed/<key>/                             # the last failed build of a key, for reading

The key is a sha256 over everything that changes the binary: the canonical spec, the rendered
source, every template and header file, nvcc's version, the target arch, the flags and the
jitattn version. One entry holds one (spec, arch) pair; every file in it has its sha256 in the
manifest, checked on every load.

Three ways to find an entry, cheapest first:

- the *spec key*: the key's inputs with the rendered source replaced by what produces it (the
  package's Python files and the templates) and without nvcc. Needs no rendering, so a fresh
  process finds a kernel in milliseconds (``specs/``);
- the exact *key*, with this machine's nvcc (a build box);
- the *source key*: the key without the nvcc version (``index/``). A machine that may not compile
  (``JITATTN_DISABLE_JIT=1``, or no nvcc at all: a serving node) takes the newest valid entry any
  nvcc built, rather than refusing a shipped cubin because its own nvcc differs.

Lookup order: the writable root (``JITATTN_CACHE_DIR``), then the read-only layers
(``JITATTN_CACHE_PATH``). Loading never writes (a corrupt entry in the writable root is moved aside
when that is possible), so a read-only or full disk serves every kernel it holds. Under
``JITATTN_DISABLE_JIT=1`` a miss raises :class:`MissingKernelError` and nvcc never runs, not even
``nvcc --version``.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator

from jitattn import _version
from jitattn import build as _build
from jitattn import modules as _modules
from jitattn import render as _render
from jitattn import settings
from jitattn.build import BuildError, CompileError, cubin_name, normalize_arch, nvcc_version
from jitattn.commands import fill_hint
from jitattn.modules import KernelModule

LAYOUT_VERSION = "v1"
MANIFEST = "manifest.json"
#: Files a build directory holds that an entry does not (ninja's state, the copied headers).
_BUILD_ONLY = (".ninja_log", ".ninja_deps", _build.INCLUDE_DIR)


logger = logging.getLogger("jitattn.cache")


class MissingKernelError(RuntimeError):
    """A kernel is not in any cache layer and JITATTN_DISABLE_JIT=1 forbids compiling it.

    The message names the kernel, the layers searched, every corrupt entry of it that was passed
    over (now, or moved to quarantine earlier), and the ``jitattn warmup`` command that fills it.

    Attributes:
        module: the spec (or utility module) asked for.
        arch: the target arch (``"sm_90a"``).
        key: its source key (the key without nvcc), as the message abbreviates it.
        roots: the cache roots searched, in order.
        corrupt: ``"<path>: <problem>"`` of each corrupt entry of this kernel.
    """

    def __init__(self, module: KernelModule, arch: str, key: str, roots: tuple[Path, ...],
                 corrupt: tuple[str, ...] = ()):
        self.module, self.arch, self.key, self.roots, self.corrupt = module, arch, key, tuple(roots), tuple(corrupt)
        super().__init__(missing_message(module, arch, key, self.roots, self.corrupt))

    def __reduce__(self):  # picklable (a worker process may raise it)
        return type(self), (self.module, self.arch, self.key, self.roots, self.corrupt)


class CacheWriteError(RuntimeError):
    """The writable cache root cannot take a new entry (read-only, full, no permission)."""


class LockTimeout(TimeoutError):
    """Another process held a key's build lock longer than JITATTN_LOCK_TIMEOUT."""


# ---- keys ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KeyInputs:
    """Everything hashed into a kernel's cache key; stored in its manifest."""

    spec: str
    source_sha256: str
    templates: dict[str, str]
    nvcc: str
    arch: str
    flags: tuple[str, ...]
    jitattn_version: str

    def to_json(self) -> dict[str, Any]:
        return {"spec": json.loads(self.spec), "source_sha256": self.source_sha256, "templates": self.templates,
                "nvcc": self.nvcc, "arch": self.arch, "flags": list(self.flags),
                "jitattn_version": self.jitattn_version}

    @property
    def key(self) -> str:
        """The entry's address: sha256 over every input, the nvcc version included."""
        return _sha256_json(self.to_json())

    @property
    def source_key(self) -> str:
        """sha256 over every input but the nvcc version: what a machine without nvcc can match."""
        return source_key_of(self.to_json())


def _sha256_json(data: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def source_key_of(key_inputs_json: dict[str, Any]) -> str:
    """The source key of a manifest's ``key_inputs``: the same hash without ``nvcc``."""
    return _sha256_json({k: v for k, v in key_inputs_json.items() if k != "nvcc"})


def key_inputs(spec: KernelModule, source: _render.RenderedSource, arch: str, *, nvcc: str | None = None
               ) -> KeyInputs:
    """The key inputs of (spec, arch); ``nvcc`` defaults to this machine's (runs ``nvcc --version`` once).

    Raises:
        jitattn.build.BuildError: ``nvcc`` not given and nvcc cannot run.
    """
    return KeyInputs(spec=spec.canonical_json(), source_sha256=source.sha256, templates=_render.template_hashes(),
                     nvcc=nvcc_version(settings.nvcc()) if nvcc is None else nvcc, arch=normalize_arch(arch),
                     flags=tuple(_build.NVCC_FLAGS), jitattn_version=_version.__version__)


@lru_cache(maxsize=None)
def _python_files_digest(package: str) -> str:
    h = hashlib.sha256()
    root = Path(package)
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" not in path.parts:
            h.update(f"{path.relative_to(root).as_posix()}\0".encode() + hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()


def code_digest() -> str:
    """sha256 of the jitattn package's Python files: with the templates, everything rendering depends on."""
    return _python_files_digest(str(Path(__file__).resolve().parent))


def spec_key_inputs(spec: KernelModule, arch: str) -> dict[str, Any]:
    """What the spec key hashes: the key inputs, with the package's code instead of the rendered
    source (which it determines) and without nvcc."""
    return {"spec": json.loads(spec.canonical_json()), "arch": normalize_arch(arch),
            "templates": _render.template_hashes(), "code": code_digest(), "flags": list(_build.NVCC_FLAGS),
            "jitattn_version": _version.__version__}


def spec_key(spec: KernelModule, arch: str) -> str:
    """A key for (spec, arch) that needs no rendering: what produces the source instead of the source.

    Equal spec keys render equal sources (rendering is a function of the spec, the templates and the
    package's code), so an entry recorded under a spec key serves it without rendering again. It
    leaves out nvcc, like the source key.
    """
    return _sha256_json(spec_key_inputs(spec, arch))


def _local_nvcc() -> str | None:
    """This machine's nvcc version banner, or None when nvcc cannot run."""
    try:
        return nvcc_version(settings.nvcc())
    except BuildError:
        return None


# ---- entries -------------------------------------------------------------------------------------
def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


#: What a manifest must hold for a reader to trust and use it (:func:`check_entry`; :class:`CacheEntry`
#: reads ``key_inputs.arch`` and ``key_inputs.spec``).
MANIFEST_KEYS = ("key", "key_inputs", "artifacts")
KEY_INPUTS_KEYS = ("spec", "arch")


def check_entry(path: Path) -> tuple[str | None, dict[str, Any]]:
    """``(problem, manifest)``: problem is None when the entry at ``path`` is complete, its manifest
    holds :data:`MANIFEST_KEYS` and matches its address, and every artifact matches its sha256.
    A problem names ``manifest.json`` (the entry's path precedes it wherever it is printed) and, for
    a manifest lacking keys, each one missing."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        return f"unreadable {MANIFEST} ({exc})", {}
    shape = _manifest_shape_problem(manifest)
    if shape:
        return f"{MANIFEST} {shape} (written by another jitattn version, or altered)", \
            manifest if isinstance(manifest, dict) else {}
    artifacts, inputs = manifest["artifacts"], manifest["key_inputs"]
    if manifest["key"] != path.name or _sha256_json(inputs) != path.name:
        return "manifest does not match the entry's key (altered or misplaced)", manifest
    for name, digest in artifacts.items():
        file = path / name
        if "/" in name or os.sep in name or not file.is_file():
            return f"missing artifact {name}", manifest
        try:
            actual = sha256_file(file)
        except OSError as exc:
            return f"unreadable artifact {name} ({exc.strerror})", manifest
        if actual != digest:
            return f"artifact {name} does not match its sha256 (truncated or altered)", manifest
    return None, manifest


def _manifest_shape_problem(manifest: Any) -> str | None:
    """What a parsed manifest lacks of the keys every reader takes from it, or None."""
    if not isinstance(manifest, dict):
        return f"is not a JSON object (a {type(manifest).__name__})"
    inputs = manifest.get("key_inputs")
    missing = [k for k in MANIFEST_KEYS if k not in manifest]
    missing += [f"key_inputs.{k}" for k in KEY_INPUTS_KEYS if isinstance(inputs, dict) and k not in inputs]
    if missing:
        return f"lacks key{'s' if len(missing) > 1 else ''} {', '.join(repr(k) for k in missing)}"
    if not isinstance(inputs, dict):
        return f"has a key_inputs that is not a JSON object (a {type(inputs).__name__})"
    if not isinstance(manifest["artifacts"], dict) or not manifest["artifacts"]:
        return "lists no artifacts"
    return None


def verify_entry(path: Path) -> str | None:
    """None if the entry at ``path`` is complete and every artifact matches its sha256, else the problem."""
    return check_entry(path)[0]


@dataclass(frozen=True)
class CacheEntry:
    """One verified entry: a (spec, arch) cubin and its manifest."""

    key: str
    path: Path
    manifest: dict[str, Any]

    @property
    def arch(self) -> str:
        return self.manifest["key_inputs"]["arch"]

    @property
    def cubin(self) -> Path:
        return self.path / cubin_name(self.arch)

    @property
    def spec(self) -> KernelModule:
        """The module the entry was built for: an AttentionSpec, or a utility module (its JSON's ``kind``)."""
        return _modules.from_json(self.manifest["key_inputs"]["spec"])


@dataclass
class _Search:
    """What a lookup found, and what it computed on the way (a miss needs it to build)."""

    entry: CacheEntry | None = None
    spec_key: str = ""
    source: _render.RenderedSource | None = None
    inputs: KeyInputs | None = None
    rejected: list[str] = field(default_factory=list)  # "path: problem" of corrupt entries passed over


# ---- locks ---------------------------------------------------------------------------------------
@contextlib.contextmanager
def key_lock(path: Path, timeout: float, what: str = "") -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if needed) for the block.

    The kernel releases it when the holder exits or is killed (``kill -9`` included), so a dead
    process never blocks the next one. A lock file removed while we waited (``jitattn cache prune``
    removes idle ones) is detected and the lock taken again on the new file.

    Raises:
        LockTimeout: not acquired within ``timeout`` seconds.
        OSError: the lock file cannot be created.
    """
    import fcntl

    deadline = time.monotonic() + timeout
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise LockTimeout(f"waited {timeout:g} s for {path}, held by another process building "
                                          f"{what or 'the same kernel'}; raise JITATTN_LOCK_TIMEOUT") from None
                    time.sleep(0.05)
            with contextlib.suppress(FileNotFoundError):
                if os.path.samestat(os.fstat(fd), os.stat(path)):
                    break
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    try:
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def try_key_lock(path: Path) -> Iterator[bool]:
    """Take ``path``'s lock if nobody holds it: yields True (held for the block) or False (busy).

    Raises:
        OSError: the lock file cannot be opened.
    """
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(key_lock(path, timeout=0.0))
        except LockTimeout:
            yield False
            return
        yield True


# ---- the store -----------------------------------------------------------------------------------
class KernelCache:
    """The layered, content-addressed kernel store.

    Args:
        root: writable root (default: ``settings.cache_dir()``).
        layers: read-only roots searched after it (default: ``settings.cache_path()``).
        look_only: lookups write nothing at all, not even the best-effort quarantine move or
            spec-key marker (``jitattn doctor`` inspects a node without changing it).
    """

    def __init__(self, root: Path | None = None, layers: tuple[Path, ...] | None = None, *,
                 look_only: bool = False):
        self.root = Path(root) if root is not None else settings.cache_dir()
        self.layers = tuple(Path(p) for p in layers) if layers is not None else settings.cache_path()
        self.look_only = look_only

    # ---- paths ---------------------------------------------------------------------------------
    @property
    def roots(self) -> tuple[Path, ...]:
        """The writable root, then the layers: lookup order."""
        return (self.root, *self.layers)

    def base(self, root: Path | None = None) -> Path:
        return (root or self.root) / LAYOUT_VERSION

    def entry_dir(self, key: str, root: Path | None = None) -> Path:
        return self.base(root) / "entries" / key[:2] / key

    def lock_path(self, key: str) -> Path:
        return self.base() / "locks" / f"{key}.lock"

    def build_dir(self, key: str) -> Path:
        return self.base() / "build" / key

    def index_dir(self, source_key: str, root: Path | None = None) -> Path:
        return self.base(root) / "index" / source_key[:2] / source_key

    def spec_index_dir(self, key: str, root: Path | None = None) -> Path:
        return self.base(root) / "specs" / key[:2] / key

    def scratch(self, label: str) -> Path:
        """A fresh name under ``tmp/`` on the root's filesystem (so renames out of it are atomic)."""
        return self.base() / "tmp" / f"{label}.{os.getpid()}.{os.urandom(4).hex()}"

    # ---- reading -------------------------------------------------------------------------------
    def lookup(self, key: str) -> CacheEntry | None:
        """The first valid entry for ``key`` in the writable root, then each layer; None on a miss.

        A corrupt entry in the writable root is moved to quarantine (and reported in the log); one
        in a read-only layer is skipped.
        """
        return self._lookup(key, [])

    def _lookup(self, key: str, rejected: list[str]) -> CacheEntry | None:
        for root in self.roots:
            entry = self._entry_at(root, key, rejected)
            if entry is not None:
                return entry
        return None

    def lookup_any_nvcc(self, source_key: str) -> CacheEntry | None:
        """The newest valid entry of ``source_key`` built by any nvcc, in the first layer that has one."""
        return self._newest("index", source_key, None, [])

    def _newest(self, index: str, name: str, nvcc: str | None, rejected: list[str],
                expect: dict[str, Any] | None = None) -> CacheEntry | None:
        """Through the markers of ``name`` in ``index`` (``"index"``: a source key; ``"specs"``: a spec
        key whose inputs are ``expect``): the newest valid entry (built by ``nvcc``, if given) of the
        first root that has one."""
        for root in self.roots:
            marker_dir = (self.index_dir if index == "index" else self.spec_index_dir)(name, root)
            try:
                keys = os.listdir(marker_dir)
            except OSError:
                continue
            candidates = []
            for key in keys:
                manifest = _read_manifest(self.entry_dir(key, root))
                if manifest is not None and _serves(manifest, index, name, nvcc, expect):
                    candidates.append((manifest.get("created", ""), key))
                elif not _manifest_matches(manifest, key):
                    self._entry_at(root, key, rejected)  # a broken or altered manifest: reported, not skipped
            for _, key in sorted(candidates, reverse=True):
                entry = self._entry_at(root, key, rejected)
                if entry is not None:
                    return entry
        return None

    def entry_in_root(self, key: str) -> CacheEntry | None:
        """The valid entry of ``key`` in the writable root only (a corrupt one goes to quarantine)."""
        return self._entry_at(self.root, key, [])

    def _entry_at(self, root: Path, key: str, rejected: list[str]) -> CacheEntry | None:
        path = self.entry_dir(key, root)
        if not (path / MANIFEST).is_file():
            return None
        problem, manifest = check_entry(path)
        if problem is None:
            return CacheEntry(key, path, manifest)
        rejected.append(f"{path}: {problem}")
        logger.debug("corrupt entry %s: %s; not loaded", path, problem)
        if root == self.root and not self.look_only:
            self.quarantine(path, problem)
        return None

    def find(self, spec: KernelModule, arch: str) -> CacheEntry | None:
        """The cached kernel of ``(spec, arch)``, or None; never compiles.

        Writes nothing a load depends on: at most (best effort) a corrupt entry of the writable root
        is moved to quarantine, and a spec-key marker is added so the next process skips rendering.

        With nvcc here, the entry this nvcc built (the exact key). When this machine may not
        compile (``JITATTN_DISABLE_JIT=1``, or nvcc cannot run), the newest entry any nvcc built
        of the same source, so a shipped cache serves a node without nvcc.
        """
        return self._search(spec, normalize_arch(arch)).entry

    def _search(self, spec: KernelModule, arch: str) -> _Search:
        settings.configure_logging()
        expect = spec_key_inputs(spec, arch)
        found = _Search(spec_key=_sha256_json(expect))
        nvcc = None if settings.disable_jit() else _local_nvcc()
        found.entry = self._newest("specs", found.spec_key, nvcc, found.rejected, expect)
        if found.entry is not None:  # found without rendering
            logger.debug("hit %s for %s: %s (spec key %s)", spec.name, arch, found.entry.path, found.spec_key[:16])
            return found
        found.source = _modules.render(spec)
        found.inputs = key_inputs(spec, found.source, arch, nvcc=nvcc or "")
        if nvcc is not None:
            found.entry = self._lookup(found.inputs.key, found.rejected)
            how = f"key {found.inputs.key[:16]}, this nvcc"
        else:
            found.entry = self._newest("index", found.inputs.source_key, None, found.rejected)
            how = f"source key {found.inputs.source_key[:16]}, any nvcc"
        if found.entry is not None:
            logger.debug("hit %s for %s: %s (%s)", spec.name, arch, found.entry.path, how)
            if found.entry.path.is_relative_to(self.root):
                self._remember_spec_key(found.entry, found.spec_key)
        else:
            logger.debug("miss %s for %s (%s) in %s", spec.name, arch, how, ", ".join(map(str, self.roots)))
        return found

    def quarantined(self, source_key: str, spec_key: str = "") -> list[tuple[Path, str]]:
        """``(path, problem)`` of each entry of one kernel that ``quarantine/`` holds (moved there
        earlier, by this process or another). An entry is the kernel's when a marker of
        ``source_key`` or ``spec_key`` names its key (markers stay when an entry moves; they are how
        an entry whose manifest no longer parses is recognised), or its manifest has that source key."""
        base = self.base() / "quarantine"
        if not base.is_dir():
            return []
        keys = set()
        for marker_dir in (self.index_dir(source_key), *([self.spec_index_dir(spec_key)] if spec_key else [])):
            with contextlib.suppress(OSError):
                keys.update(os.listdir(marker_dir))
        out = []
        for path in sorted(base.iterdir()):
            manifest = _read_manifest(path)
            try:
                ours = manifest is not None and source_key_of(manifest["key_inputs"]) == source_key
            except (KeyError, TypeError, AttributeError):
                ours = False
            if ours or path.name.rsplit(".", 1)[0] in keys:  # quarantine/<key>.<ms>
                with contextlib.suppress(OSError):
                    out.append((path, (path / "QUARANTINED").read_text().strip()))
        return out

    def _missing(self, spec: KernelModule, arch: str, found: _Search) -> MissingKernelError:
        """The error of a miss under JITATTN_DISABLE_JIT=1, naming every corrupt entry of the kernel:
        those this lookup passed over, and those an earlier lookup moved to quarantine."""
        moved_now = {Path(r.split(": ", 1)[0]).name for r in found.rejected}
        earlier = [f"{path}: {problem} (quarantined)"
                   for path, problem in self.quarantined(found.inputs.source_key, found.spec_key)
                   if path.name.rsplit(".", 1)[0] not in moved_now]
        return MissingKernelError(spec, arch, found.inputs.source_key, self.roots, (*found.rejected, *earlier))

    def _remember_spec_key(self, entry: CacheEntry, key: str) -> None:
        """Best effort: let the next process find ``entry`` without rendering (never fails a load)."""
        if self.look_only:
            return
        with contextlib.suppress(OSError):
            marker_dir = self.spec_index_dir(key)
            marker_dir.mkdir(parents=True, exist_ok=True)
            (marker_dir / entry.key).touch()

    def entries(self) -> Iterator[tuple[Path, CacheEntry | None, str | None]]:
        """Every entry in every layer: ``(path, entry or None, problem or None)``."""
        for root in self.roots:
            for path in self.entry_paths(root):
                problem, manifest = check_entry(path)
                yield path, (None if problem else CacheEntry(path.name, path, manifest)), problem

    def entry_paths(self, root: Path | None = None) -> list[Path]:
        """The published entry directories of one root (those with a manifest), sorted."""
        base = self.base(root) / "entries"
        return sorted(p.parent for p in base.glob(f"*/*/{MANIFEST}")) if base.is_dir() else []

    # ---- writing -------------------------------------------------------------------------------
    def get_or_build(self, spec: KernelModule, arch: str) -> tuple[CacheEntry, bool]:
        """The cached kernel of ``(spec, arch)``, compiling it on a miss.

        Returns:
            ``(entry, built)``: ``built`` is False when it came from disk.

        Lookup as in :meth:`find`. On a miss, the key's lock is taken and the cache looked up again,
        so processes asking at once compile once: the first builds, the others load its entry.

        Raises:
            MissingKernelError: a miss under JITATTN_DISABLE_JIT=1 (names the spec and the warm-up command).
            CacheWriteError: the writable root cannot take the entry (says where and why).
            jitattn.build.CompileError: nvcc rejected the source.
            jitattn.build.BuildError: a miss, and nvcc cannot run.
            LockTimeout: another process held the build lock past JITATTN_LOCK_TIMEOUT.
        """
        arch = normalize_arch(arch)
        found = self._search(spec, arch)
        if found.entry is not None:
            return found.entry, False
        if settings.disable_jit():
            raise self._missing(spec, arch, found)
        if not found.inputs.nvcc:
            nvcc_version(settings.nvcc())  # raises BuildError: what was tried and how to fix it
        key = found.inputs.key
        with self.locked(key, f"{spec.name} for {arch}"):
            entry = self.entry_in_root(key)  # another process may have built it while we waited
            if entry is not None:
                logger.debug("hit %s for %s: %s (built by another process while this one waited)",
                             spec.name, arch, entry.path)
                return entry, False
            entry = self._build_and_publish(spec, found)
            logger.debug("published %s for %s as %s (%.1f s)", spec.name, arch, entry.path,
                         entry.manifest.get("build_seconds", 0.0))
            return entry, True

    @contextlib.contextmanager
    def locked(self, key: str, what: str) -> Iterator[None]:
        """Hold the build lock of ``key`` (:func:`key_lock`); CacheWriteError if it cannot be created."""
        lock = self.lock_path(key)
        with contextlib.ExitStack() as stack:
            with self.writing(lock, f"create the build lock of {what}:"):
                lock.parent.mkdir(parents=True, exist_ok=True)
                stack.enter_context(key_lock(lock, settings.lock_timeout(), what))
            yield

    def _build_and_publish(self, spec: KernelModule, found: _Search) -> CacheEntry:
        """Build in ``build/<key>`` (a fixed path: reproducible), then publish it as ``entries/<key>``.
        Called with the key's lock held, so nobody else uses that directory."""
        inputs = found.inputs
        key, build_dir = inputs.key, self.build_dir(inputs.key)
        with self.writing(build_dir, f"prepare the build directory of {spec.name} for {inputs.arch}:"):
            self.discard(build_dir)  # a killed build's leftovers: its nvcc may still be writing there
            build_dir.mkdir(parents=True)
            templates = _build.snapshot_templates(inputs.templates)
            try:
                result = _build.build(found.source, inputs.arch, build_dir, flags=inputs.flags, templates=templates)
            except CompileError as exc:
                raise self._keep_failed(build_dir, key, exc) from None
        stage = self.scratch(key)
        final = self.entry_dir(key)
        try:
            with self.writing(final, f"publish {spec.name} for {inputs.arch} as"):
                stage.parent.mkdir(parents=True, exist_ok=True)
                os.rename(build_dir, stage)
                for name in _BUILD_ONLY:
                    _remove(stage / name)
                (stage / "build.log").write_text(result.log)
                manifest = self._manifest(spec, inputs, found.spec_key, stage, result)
                _write_json_atomic(stage / MANIFEST, manifest)  # last: its presence marks the entry complete
                final.parent.mkdir(parents=True, exist_ok=True)
                if final.exists():  # a corrupt leftover that lookup could not move aside
                    self.quarantine(final, "replaced by a fresh build")
                os.rename(stage, final)
                self.add_markers(manifest)
        finally:
            _rmtree(stage)
        return CacheEntry(key, final, manifest)

    @staticmethod
    def _manifest(spec: KernelModule, inputs: KeyInputs, skey: str, stage: Path, result: _build.BuildResult
                  ) -> dict[str, Any]:
        return {
            "key": inputs.key,
            "source_key": inputs.source_key,
            "spec_key": skey,
            "key_inputs": inputs.to_json(),
            "name": spec.name,
            "artifacts": {p.name: sha256_file(p) for p in sorted(stage.iterdir()) if p.name != MANIFEST},
            "build_seconds": round(result.seconds, 3),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "jitattn_version": inputs.jitattn_version,
            "compiler_log": result.log[-20000:],
        }

    def add_markers(self, manifest: dict[str, Any], root: Path | None = None) -> None:
        """The ``index/`` (source key) and ``specs/`` (spec key) markers of a published entry."""
        key = manifest["key"]
        dirs = [self.index_dir(source_key_of(manifest["key_inputs"]), root)]
        if manifest.get("spec_key"):
            dirs.append(self.spec_index_dir(manifest["spec_key"], root))
        for marker_dir in dirs:
            marker_dir.mkdir(parents=True, exist_ok=True)
            (marker_dir / key).touch()

    def _keep_failed(self, build_dir: Path, key: str, exc: CompileError) -> CompileError:
        """Move a failed build to ``failed/<key>`` so its kernel.cu stays readable; re-point the error."""
        kept = self.base() / "failed" / key
        try:
            self.discard(kept)
            kept.parent.mkdir(parents=True, exist_ok=True)
            os.rename(build_dir, kept)
        except OSError:
            return exc
        exc.args = (str(exc).replace(str(build_dir), str(kept)),)
        exc.source_path = kept / _render.RENDERED_FILE
        return exc

    def quarantine(self, path: Path, problem: str) -> Path | None:
        """Move a corrupt entry of the writable root to ``quarantine/`` (with the reason); never raises.

        Returns where it went, or None when it could not move (a concurrent process moved it first,
        or the root is read-only: lookups skip it either way).
        """
        dest = self.base() / "quarantine" / f"{path.name}.{int(time.time() * 1000)}"
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.rename(path, dest)
        except OSError:
            return None
        with contextlib.suppress(OSError):
            (dest / "QUARANTINED").write_text(problem + "\n")
        logger.debug("corrupt cache entry %s moved to %s: %s", path, dest, problem)
        return dest

    def discard(self, path: Path) -> None:
        """Remove a directory of the writable root: renamed into ``tmp/`` first (so it vanishes at
        once, and a killed build's nvcc still writing into it writes there), then deleted.

        Raises:
            OSError: it exists and cannot be moved.
        """
        gone = self.scratch(f"{path.name}.discard")
        try:
            gone.parent.mkdir(parents=True, exist_ok=True)
            os.rename(path, gone)
        except FileNotFoundError:
            return
        _rmtree(gone)

    @contextlib.contextmanager
    def writing(self, path: Path, what: str) -> Iterator[None]:
        """Turn an OSError in the block into a CacheWriteError saying where, why and what to do."""
        try:
            yield
        except LockTimeout:
            raise
        except OSError as exc:
            raise CacheWriteError(write_error_message(self.root, path, what, exc)) from None


def write_error_message(root: Path, path: Path, what: str, exc: OSError) -> str:
    """``cannot <what> <path>: <reason>`` and the fix, for a cache root that refuses a write."""
    reason = exc.strerror or str(exc)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        fix = (f"the disk holding {root} is full: free space (`jitattn cache prune`), or "
               f"{point_root_elsewhere(root, 'with room')}")
    else:
        fix = (f"{point_root_elsewhere(root, 'writable')} (a read-only cache belongs in JITATTN_CACHE_PATH, "
               "which is only read)")
    return f"cannot {what} {path}: {reason}; {fix}"


def point_root_elsewhere(root: Path, what: str) -> str:
    """How to give jitattn another writable root than ``root``: set JITATTN_CACHE_DIR, or, when it
    is already set to ``root``, point it at another directory."""
    if settings.cache_dir_is_set() and settings.cache_dir() == Path(root):
        return f"JITATTN_CACHE_DIR is set to this root: point it at a {what} directory"
    return f"set JITATTN_CACHE_DIR to a {what} directory"


def _serves(manifest: dict[str, Any], index: str, name: str, nvcc: str | None,
            expect: dict[str, Any] | None) -> bool:
    """Whether a manifest found through a marker is what the marker promises: the same source key,
    or (a spec key) the same spec, arch, templates, flags and version; and nvcc, if given.

    A spec-key marker cannot be checked for the rendered source (that is what it saves computing);
    it is written only after a build or a render showed the entry serves it.
    """
    try:
        inputs = manifest["key_inputs"]
        if index == "specs":
            ok = all(inputs[k] == v for k, v in (expect or {}).items() if k != "code") and bool(expect)
        else:
            ok = source_key_of(inputs) == name
        return ok and (nvcc is None or inputs.get("nvcc") == nvcc)
    except (KeyError, TypeError, AttributeError):
        return False


def _manifest_matches(manifest: dict[str, Any] | None, key: str) -> bool:
    """Whether a manifest read through a marker is intact enough to be judged by its inputs (readable,
    its ``key_inputs`` hashing to its entry's key); one that is not gets the full check."""
    try:
        return manifest is not None and _sha256_json(manifest["key_inputs"]) == key
    except (KeyError, TypeError, ValueError):
        return False


def _read_manifest(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def _rmtree(path: Path) -> None:
    import shutil  # here, not at the top: a warm start never removes anything (and shutil costs 2 ms)

    shutil.rmtree(path, ignore_errors=True)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        _rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)


def missing_message(module: KernelModule, arch: str, key: str, roots: tuple[Path, ...],
                    corrupt: list[str] | tuple[str, ...] = ()) -> str:
    """The error text of a DISABLE_JIT miss: which kernel, where we looked, what was corrupt, and
    (from :func:`jitattn.commands.fill_hint`) the command that fills it."""
    looked = ", ".join(str(r) for r in roots)
    state = "is cached only as corrupt entries" if corrupt else "is not cached"
    lines = "".join(f"\n  corrupt, not loaded: {r}" for r in corrupt)
    return (f"kernel {module.name} for {arch} (key {key[:16]}) {state} and JITATTN_DISABLE_JIT=1 forbids "
            f"compiling it.\n  looked in: {looked}{lines}\n{fill_hint(module, arch)}")
