"""Cache: compiled kernels on disk, addressed by content, published atomically, verified on load.

Layout (``cache/README.md`` has the full description)::

    <root>/v1/entries/<key[:2]>/<key>/manifest.json   # written last: its presence means complete
                                     /kernel.cu       # the rendered source
                                     /kernel.<arch>.cubin
                                     /build.ninja, build.log
    <root>/v1/index/<skey[:2]>/<skey>/<key>            # empty marker: entry <key> serves source key <skey>
    <root>/v1/locks/<key>.lock                         # one lock per key (flock: released on kill -9)
    <root>/v1/tmp/<key>.<pid>.<random>/                # builds in progress; renamed into entries/
    <root>/v1/quarantine/<key>.<time>/                 # corrupt entries moved aside, never loaded

The key is a sha256 over everything that changes the binary: the canonical spec, the rendered
source, every template and header file, nvcc's version, the target arch, the flags and the
jitattn version. One entry holds one (spec, arch) pair.

Lookup order: the writable root (``JITATTN_CACHE_DIR``), then the read-only layers
(``JITATTN_CACHE_PATH``). Under ``JITATTN_DISABLE_JIT=1`` a miss raises
:class:`MissingKernelError` and nvcc never runs.

A machine that may not compile (``JITATTN_DISABLE_JIT=1``, or no nvcc at all: a serving node) cannot
compute the exact key when nvcc is missing, and should not refuse a shipped cubin because its own
nvcc differs from the build box's. It looks up by the *source key* instead: the same hash without the
nvcc version (``index/``), and takes the newest valid entry any nvcc built.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import filelock

import jitattn
from jitattn import settings
from jitattn.build import NVCC_FLAGS, BuildError, CompileError, build, cubin_name, normalize_arch, nvcc_version
from jitattn.render import RENDERED_FILE, RenderedSource, render, template_hashes
from jitattn.spec import AttentionSpec

LAYOUT_VERSION = "v1"
MANIFEST = "manifest.json"


class MissingKernelError(RuntimeError):
    """A kernel is not in any cache layer and JITATTN_DISABLE_JIT=1 forbids compiling it."""


class CacheWriteError(RuntimeError):
    """The writable cache root cannot take a new entry (read-only, full, no permission)."""


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
        data = self.to_json()
        del data["nvcc"]
        return _sha256_json(data)


def _sha256_json(data: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def key_inputs(spec: AttentionSpec, source: RenderedSource, arch: str, *, nvcc: str | None = None) -> KeyInputs:
    """The key inputs of (spec, arch); ``nvcc`` defaults to this machine's (runs ``nvcc --version`` once).

    Raises:
        jitattn.build.BuildError: ``nvcc`` not given and nvcc cannot run.
    """
    return KeyInputs(spec=spec.canonical_json(), source_sha256=source.sha256, templates=template_hashes(),
                     nvcc=nvcc_version(settings.nvcc()) if nvcc is None else nvcc, arch=normalize_arch(arch),
                     flags=NVCC_FLAGS, jitattn_version=jitattn.__version__)


def _local_nvcc() -> str | None:
    """This machine's nvcc version banner, or None when nvcc cannot run."""
    try:
        return nvcc_version(settings.nvcc())
    except BuildError:
        return None


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


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
    def spec(self) -> AttentionSpec:
        return AttentionSpec.from_json(self.manifest["key_inputs"]["spec"])


class KernelCache:
    """The layered, content-addressed kernel store.

    Args:
        root: writable root (default: ``settings.cache_dir()``).
        layers: read-only roots searched after it (default: ``settings.cache_path()``).
    """

    def __init__(self, root: Path | None = None, layers: tuple[Path, ...] | None = None):
        self.root = Path(root) if root is not None else settings.cache_dir()
        self.layers = tuple(layers) if layers is not None else settings.cache_path()

    # ---- paths ---------------------------------------------------------------------------------
    def _base(self, root: Path) -> Path:
        return root / LAYOUT_VERSION

    def entry_dir(self, key: str, root: Path | None = None) -> Path:
        return self._base(root or self.root) / "entries" / key[:2] / key

    def lock_path(self, key: str) -> Path:
        return self._base(self.root) / "locks" / f"{key}.lock"

    def index_dir(self, source_key: str, root: Path | None = None) -> Path:
        return self._base(root or self.root) / "index" / source_key[:2] / source_key

    # ---- reading -------------------------------------------------------------------------------
    def lookup(self, key: str) -> CacheEntry | None:
        """The first valid entry for ``key`` in the writable root, then each layer; None on a miss.

        A corrupt entry in the writable root is moved to quarantine (and reported in the log); one
        in a read-only layer is skipped.
        """
        for root in (self.root, *self.layers):
            entry = self._lookup_in(root, key)
            if entry is not None:
                return entry
        return None

    def lookup_any_nvcc(self, source_key: str) -> CacheEntry | None:
        """The newest valid entry of ``source_key`` built by any nvcc, in the first layer that has one."""
        for root in (self.root, *self.layers):
            index = self.index_dir(source_key, root)
            keys = sorted(p.name for p in index.iterdir()) if index.is_dir() else []
            found = [e for e in (self._lookup_in(root, key) for key in keys) if e is not None]
            if found:
                return max(found, key=lambda e: (e.manifest.get("created", ""), e.key))
        return None

    def _lookup_in(self, root: Path, key: str) -> CacheEntry | None:
        path = self.entry_dir(key, root)
        if not (path / MANIFEST).is_file():
            return None
        problem = verify_entry(path)
        if problem is None:
            return CacheEntry(key, path, json.loads((path / MANIFEST).read_text()))
        if root == self.root:
            self._quarantine(path, problem)
        return None

    def find(self, spec: AttentionSpec, arch: str) -> CacheEntry | None:
        """The cached kernel of ``(spec, arch)``, or None; never compiles.

        With nvcc here, the entry of the exact key (this nvcc's build). When this machine may not
        compile (``JITATTN_DISABLE_JIT=1``, or nvcc cannot run), also any nvcc's build of the same
        source (:meth:`lookup_any_nvcc`), so a shipped cache serves a node without nvcc.
        """
        entry, _ = self._find(spec, normalize_arch(arch), render(spec), _local_nvcc())
        return entry

    def _find(self, spec: AttentionSpec, arch: str, source: RenderedSource, nvcc: str | None
              ) -> tuple[CacheEntry | None, KeyInputs]:
        inputs = key_inputs(spec, source, arch, nvcc=nvcc or "")
        if nvcc is not None:
            entry = self.lookup(inputs.key)
            if entry is not None:
                return entry, inputs
        if nvcc is None or settings.disable_jit():
            return self.lookup_any_nvcc(inputs.source_key), inputs
        return None, inputs

    def entries(self) -> Iterator[tuple[Path, CacheEntry | None, str | None]]:
        """Every entry in every layer: ``(path, entry or None, problem or None)``."""
        for root in (self.root, *self.layers):
            base = self._base(root) / "entries"
            if not base.is_dir():
                continue
            for path in sorted(base.glob("*/*")):
                if not (path / MANIFEST).is_file():
                    continue
                problem = verify_entry(path)
                entry = None if problem else CacheEntry(path.name, path, json.loads((path / MANIFEST).read_text()))
                yield path, entry, problem

    # ---- writing -------------------------------------------------------------------------------
    def get_or_build(self, spec: AttentionSpec, arch: str) -> tuple[CacheEntry, bool]:
        """The cached kernel of ``(spec, arch)``, compiling it on a miss.

        Returns:
            ``(entry, built)``: ``built`` is False when it came from disk.

        Lookup as in :meth:`find`: without nvcc, or under JITATTN_DISABLE_JIT=1, a build of the same
        source by another nvcc is taken rather than failing.

        Raises:
            MissingKernelError: a miss under JITATTN_DISABLE_JIT=1.
            CacheWriteError: the writable root cannot take the entry.
            jitattn.build.CompileError: nvcc rejected the source.
            jitattn.build.BuildError: a miss, and nvcc cannot run.
            filelock.Timeout: another process held the build lock past JITATTN_LOCK_TIMEOUT.
        """
        arch = normalize_arch(arch)
        source = render(spec)
        nvcc = _local_nvcc()
        entry, inputs = self._find(spec, arch, source, nvcc)
        if entry is not None:
            return entry, False
        if settings.disable_jit():
            raise MissingKernelError(missing_message(spec, arch, inputs.source_key, (self.root, *self.layers)))
        if nvcc is None:
            nvcc_version(settings.nvcc())  # raises BuildError: what was tried and how to fix it
        key = inputs.key
        try:
            self.lock_path(key).parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CacheWriteError(f"cannot create {self.lock_path(key).parent} to build {spec.name} for {arch}: "
                                  f"{exc}; set JITATTN_CACHE_DIR to a writable directory") from None
        with filelock.FileLock(str(self.lock_path(key)), timeout=settings.lock_timeout()):
            entry = self.lookup(key)  # another process may have built it while we waited
            if entry is not None:
                return entry, False
            return self._build_and_publish(spec, source, inputs), True

    def _build_and_publish(self, spec: AttentionSpec, source: RenderedSource, inputs: KeyInputs) -> CacheEntry:
        key = inputs.key
        tmp = self._base(self.root) / "tmp" / f"{key}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        try:
            tmp.mkdir(parents=True)
        except OSError as exc:
            raise CacheWriteError(f"cannot create build directory {tmp}: {exc}; set JITATTN_CACHE_DIR to a "
                                  f"writable directory") from None
        try:
            try:
                result = build(source, inputs.arch, tmp)
            except CompileError as exc:
                raise self._keep_failed(tmp, key, exc) from None
            (tmp / "build.log").write_text(result.log)
            manifest = {
                "key": key,
                "source_key": inputs.source_key,
                "key_inputs": inputs.to_json(),
                "name": spec.name,
                "artifacts": {cubin_name(inputs.arch): sha256_file(result.cubin), RENDERED_FILE: source.sha256},
                "build_seconds": round(result.seconds, 3),
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "compiler_log": result.log[-20000:],
            }
            _write_json_atomic(tmp / MANIFEST, manifest)  # last: its presence marks the entry complete
            final = self.entry_dir(key)
            final.parent.mkdir(parents=True, exist_ok=True)
            if final.exists():  # a corrupt leftover that lookup could not move aside
                self._quarantine(final, "replaced by a fresh build")
            os.rename(tmp, final)
            index = self.index_dir(inputs.source_key)
            index.mkdir(parents=True, exist_ok=True)
            (index / key).touch()
        except OSError as exc:
            raise CacheWriteError(f"cannot write cache entry {self.entry_dir(key)}: {exc}") from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return CacheEntry(key, final, manifest)

    def _keep_failed(self, tmp: Path, key: str, exc: CompileError) -> CompileError:
        """Move a failed build to ``failed/<key>`` so its kernel.cu stays readable; re-point the error."""
        kept = self._base(self.root) / "failed" / key
        try:
            shutil.rmtree(kept, ignore_errors=True)
            kept.parent.mkdir(parents=True, exist_ok=True)
            os.rename(tmp, kept)
        except OSError:
            return exc
        exc.args = (str(exc).replace(str(tmp), str(kept)),)
        exc.source_path = kept / RENDERED_FILE
        return exc

    def _quarantine(self, path: Path, problem: str) -> None:
        dest = self._base(self.root) / "quarantine" / f"{path.name}.{int(time.time() * 1000)}"
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.rename(path, dest)
            (dest / "QUARANTINED").write_text(problem + "\n")
        except OSError:
            pass  # a concurrent process moved it first, or the root is read-only: lookup skips it either way
        if settings.verbose():
            print(f"[jitattn] corrupt cache entry {path} moved to {dest}: {problem}")


def verify_entry(path: Path) -> str | None:
    """None if the entry at ``path`` is complete and every artifact matches its sha256, else the problem."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        artifacts = manifest["artifacts"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"unreadable manifest ({exc})"
    for name, digest in artifacts.items():
        file = path / name
        if not file.is_file():
            return f"missing artifact {name}"
        if sha256_file(file) != digest:
            return f"artifact {name} does not match its sha256 (truncated or altered)"
    return None


def _write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)


def missing_message(spec: AttentionSpec, arch: str, key: str, roots: tuple[Path, ...]) -> str:
    """The error text of a DISABLE_JIT miss: which kernel, where we looked, the command that fills it."""
    spec_json = spec.canonical_json()
    looked = ", ".join(str(r) for r in roots)
    return (f"kernel {spec.name} for {arch} (key {key[:16]}) is not cached and JITATTN_DISABLE_JIT=1 forbids "
            f"compiling it.\n  looked in: {looked}\n  fill it on a build box with:\n"
            f"    jitattn warmup --spec {shlex.quote(spec_json)} --arch {arch}\n"
            f"  (or `jitattn warmup --model <config.json> --arch {arch}` for the whole model), then ship the cache.")
