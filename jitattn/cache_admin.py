"""Looking after a kernel cache: verify, prune, clear, and shipping entries as one archive.

- :func:`verify` checks every entry of every layer (manifest, address, each artifact's sha256) and
  moves corrupt ones of the writable root to quarantine.
- :func:`prune` removes what no lookup will use: unfinished publishes and removals (``tmp/``), the
  build directories of killed builds, failed builds, quarantine, idle lock files, markers of
  missing entries, and entries that another jitattn version, other templates or other nvcc flags
  built (this installation computes other keys, so it never loads them; another installation
  sharing the root would).
- :func:`clear` removes every entry of the writable root, then prunes.
- :func:`export_entries` writes the entries a deployment needs into one ``.tar.gz`` / ``.tar``;
  :func:`import_archive` checks every artifact of an archive against its manifest before any entry
  becomes visible, then renames each entry into place.

Everything that writes touches only the writable root; the read-only layers are only read. Work
in progress is never removed: a build holds its key's lock (``tmp/`` and ``build/`` items of a
locked key are skipped), an import's staging directory names its live process.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import re
import shutil
import tarfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from jitattn import _version
from jitattn import build as _build
from jitattn import render as _render
from jitattn.cache import MANIFEST, CacheEntry, KernelCache, check_entry, source_key_of, try_key_lock
from jitattn.spec import AttentionSpec

#: First member of an export archive: what it holds and for whom.
EXPORT_MANIFEST = "jitattn-export.json"
_KEY = re.compile(r"[0-9a-f]{64}")
_ENTRY_MEMBER = re.compile(r"v1/entries/(?P<kk>[0-9a-f]{2})/(?P<key>[0-9a-f]{64})/(?P<file>[A-Za-z0-9][A-Za-z0-9._-]*)")
_MARKER_MEMBER = re.compile(r"v1/(index|specs)/[0-9a-f]{2}/[0-9a-f]{64}/[0-9a-f]{64}")
_MAX_MEMBER_BYTES = 1 << 30


class ArchiveError(ValueError):
    """An archive is not a jitattn export, or fails verification; nothing was imported."""


def _size(path: Path) -> int:
    if path.is_file() or path.is_symlink():
        return path.lstat().st_size
    return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


# ---- verify --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Finding:
    """One entry as :func:`verify` found it."""

    path: Path
    layer: str  # "writable" or "read-only"
    problem: str | None  # None: ok
    quarantined: Path | None = None  # where a corrupt writable-root entry went

    def to_json(self) -> dict[str, Any]:
        return {"path": str(self.path), "layer": self.layer, "status": self.problem or "ok",
                "quarantined": str(self.quarantined) if self.quarantined else None}


def verify(cache: KernelCache, *, quarantine: bool = True) -> list[Finding]:
    """Check every entry of every layer; move corrupt ones of the writable root to quarantine."""
    out = []
    for root in cache.roots:
        layer = "writable" if root == cache.root else "read-only"
        for path in cache.entry_paths(root):
            problem, _ = check_entry(path)
            moved = cache.quarantine(path, problem) if problem and quarantine and layer == "writable" else None
            out.append(Finding(path, layer, problem, moved))
    return out


# ---- prune and clear -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Removal:
    """One thing :func:`prune` or :func:`clear` removes (or would, with ``dry_run``)."""

    path: Path
    reason: str
    size: int

    def to_json(self) -> dict[str, Any]:
        return {"path": str(self.path), "reason": self.reason, "size": self.size}


@dataclass
class _Plan:
    cache: KernelCache
    dry_run: bool
    done: list[Removal] = field(default_factory=list)

    def remove(self, path: Path, reason: str) -> None:
        size = _size(path)
        if not self.dry_run:
            if path.is_dir() and not path.is_symlink():
                self.cache.discard(path)
            else:
                path.unlink(missing_ok=True)
        self.done.append(Removal(path, reason, size))

    @property
    def removed_paths(self) -> set[Path]:
        return {r.path for r in self.done}


def prune(cache: KernelCache, *, dry_run: bool = False) -> list[Removal]:
    """Remove from the writable root what no lookup of this installation will use (module doc).

    Returns what was removed (or, with ``dry_run``, what would be), each with the reason and size.

    Raises:
        OSError: the writable root cannot be changed.
    """
    plan = _Plan(cache, dry_run)
    base = cache.base()
    _prune_work_dirs(plan, base)
    for sub, reason in (("failed", "failed build, kept for reading its kernel.cu"),
                        ("quarantine", "corrupt entry moved aside")):
        for path in _children(base / sub):
            why = _read_text(path / "QUARANTINED") if sub == "quarantine" else ""
            plan.remove(path, f"{reason}: {why}" if why else reason)
    _prune_entries(plan)
    _prune_markers(plan)
    _prune_locks(plan, base)
    return plan.done


def clear(cache: KernelCache, *, dry_run: bool = False) -> list[Removal]:
    """Remove every entry of the writable root (the layers are untouched), then :func:`prune`."""
    plan = _Plan(cache, dry_run)
    for path in cache.entry_paths():
        plan.remove(path, "cleared")
    done = plan.done
    if dry_run:
        return done + [r for r in prune(cache, dry_run=True) if r.path not in plan.removed_paths]
    return done + prune(cache)


def _children(path: Path) -> list[Path]:
    try:
        return sorted(path.iterdir())
    except OSError:
        return []


def _read_text(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _prune_work_dirs(plan: _Plan, base: Path) -> None:
    """``tmp/`` and ``build/`` items whose owner is gone (its key's lock is free, its process dead)."""
    for path in _children(base / "tmp") + _children(base / "build"):
        if _in_use(plan.cache, path.name):
            continue
        reason = ("leftover of a killed or failed build" if path.parent.name == "build"
                  else "unfinished publish, import or removal")
        plan.remove(path, reason)


def _in_use(cache: KernelCache, name: str) -> bool:
    """Whether the ``tmp/`` or ``build/`` item ``name`` belongs to a running build or import."""
    head = name.split(".", 1)[0]
    if _KEY.fullmatch(head):
        lock = cache.lock_path(head)
        if not lock.exists():
            return False
        with try_key_lock(lock) as free:
            return not free
    parts = name.split(".")  # <label>.<pid>.<random>
    return len(parts) >= 3 and parts[-2].isdigit() and _alive(int(parts[-2]))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _prune_entries(plan: _Plan) -> None:
    """Entries this installation never loads: incomplete, corrupt, or keyed by other inputs."""
    current = {"jitattn_version": _version.__version__, "templates": _render.template_hashes(),
               "flags": list(_build.NVCC_FLAGS)}
    what = {"jitattn_version": "another jitattn version ({0}; this is {1})",
            "templates": "other templates than this installation's", "flags": "other nvcc flags ({0})"}
    base = plan.cache.base() / "entries"
    for path in sorted(p for p in base.glob("*/*") if p.is_dir()):
        if not (path / MANIFEST).is_file():
            plan.remove(path, "incomplete entry (no manifest)")
            continue
        problem, manifest = check_entry(path)
        if problem:
            plan.remove(path, f"corrupt: {problem}")
            continue
        inputs = manifest["key_inputs"]
        for name, value in current.items():
            if inputs.get(name) != value:
                plan.remove(path, "built for " + what[name].format(inputs.get(name), value))
                break


def _prune_markers(plan: _Plan) -> None:
    """``index/`` and ``specs/`` markers whose entry is gone (or going), and empty marker dirs."""
    gone = plan.removed_paths
    for sub in ("index", "specs"):
        for marker_dir in sorted((plan.cache.base() / sub).glob("*/*")):
            markers = _children(marker_dir)
            for marker in markers:
                entry = plan.cache.entry_dir(marker.name)
                if entry in gone or not (entry / MANIFEST).is_file():
                    plan.remove(marker, f"marker of a missing entry ({sub}/)")
            if all(m in plan.removed_paths for m in markers) and not plan.dry_run:
                for empty in (marker_dir, marker_dir.parent):
                    try:
                        empty.rmdir()
                    except OSError:
                        break


def _prune_locks(plan: _Plan, base: Path) -> None:
    """Lock files nobody holds; each is unlinked while held, so a waiter notices and re-opens."""
    for lock in _children(base / "locks"):
        if plan.dry_run:
            with try_key_lock(lock) as free:
                if free:
                    plan.done.append(Removal(lock, "idle lock file", 0))
            continue
        with try_key_lock(lock) as free:
            if free:
                lock.unlink(missing_ok=True)
                plan.done.append(Removal(lock, "idle lock file", 0))


# ---- export --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Wanted:
    """One kernel a deployment needs: a spec, an arch, and who asked for it."""

    spec: AttentionSpec
    arch: str
    needed_by: tuple[str, ...]


class MissingEntriesError(LookupError):
    """Export found no entry for some (spec, arch) pairs; ``missing`` lists them."""

    def __init__(self, missing: list[Wanted]):
        self.missing = missing
        names = ", ".join(f"{w.spec.name} {w.arch}" for w in missing)
        super().__init__(f"{len(missing)} kernel(s) not in the cache: {names}")


def export_entries(cache: KernelCache, wanted: list[Wanted], out: Path) -> list[CacheEntry]:
    """Write exactly the entries of ``wanted`` (one per spec and arch) into the archive ``out``.

    ``out`` ending in ``.tar.gz`` / ``.tgz`` is gzip-compressed, ``.tar`` is not. The archive is a
    cache root (``v1/entries``, ``v1/index``, ``v1/specs``), so ``tar -x`` alone also gives a usable
    layer; its first member, ``jitattn-export.json``, lists the entries. The bytes depend only on
    the entries (fixed times and owners), and the file appears atomically.

    Raises:
        MissingEntriesError: some kernel is not cached (nothing is written).
        ArchiveError: an entry changed on disk while being exported.
        ValueError: ``out`` has another suffix.
    """
    compress = _compression(out)
    found = [(w, cache.find(w.spec, w.arch)) for w in wanted]
    missing = [w for w, e in found if e is None]
    if missing:
        raise MissingEntriesError(missing)
    entries = {e.key: (w, e) for w, e in found}  # type: ignore[union-attr]
    listing = {"format": "jitattn-cache-export", "layout": "v1", "jitattn_version": _version.__version__,
               "entries": [{"key": k, "name": e.manifest.get("name"), "arch": e.arch, "needed_by": list(w.needed_by)}
                           for k, (w, e) in sorted(entries.items())]}
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as raw:
            stream = gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) if compress else raw
            with tarfile.open(fileobj=stream, mode="w", format=tarfile.PAX_FORMAT) as tar:
                _add(tar, EXPORT_MANIFEST, json.dumps(listing, indent=1, sort_keys=True).encode())
                for key, (_, entry) in sorted(entries.items()):
                    _add_entry(tar, entry)
            if compress:
                stream.close()
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return [e for _, (_, e) in sorted(entries.items())]


def _compression(out: Path) -> bool:
    name = out.name.lower()
    if name.endswith((".tar.gz", ".tgz")):
        return True
    if name.endswith(".tar"):
        return False
    raise ValueError(f"-o {out}: expected a .tar.gz, .tgz or .tar file name")


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), _build.SOURCE_MTIME, 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    tar.addfile(info, io.BytesIO(data))


def _add_entry(tar: tarfile.TarFile, entry: CacheEntry) -> None:
    """The entry's manifest and artifacts (each re-checked against its sha256 as read), and its markers."""
    import hashlib

    prefix = f"v1/entries/{entry.key[:2]}/{entry.key}"
    for name, digest in sorted(entry.manifest["artifacts"].items()):
        data = (entry.path / name).read_bytes()
        if hashlib.sha256(data).hexdigest() != digest:
            raise ArchiveError(f"{entry.path / name} changed while being exported; run `jitattn cache verify`")
        _add(tar, f"{prefix}/{name}", data)
    _add(tar, f"{prefix}/{MANIFEST}", (entry.path / MANIFEST).read_bytes())
    markers = [f"v1/index/{_marker(source_key_of(entry.manifest['key_inputs']))}"]
    if entry.manifest.get("spec_key"):
        markers.append(f"v1/specs/{_marker(entry.manifest['spec_key'])}")
    for marker in markers:
        _add(tar, f"{marker}/{entry.key}", b"")


def _marker(key: str) -> str:
    return f"{key[:2]}/{key}"


# ---- import --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Imported:
    key: str
    name: str
    arch: str
    status: str  # "imported" | "present"

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "name": self.name, "arch": self.arch, "status": self.status}


def import_archive(cache: KernelCache, archive: Path) -> list[Imported]:
    """Add the entries of an export archive to the writable root, all verified first.

    Every member is unpacked into a staging directory on the root's filesystem; every entry is
    checked (manifest, address, each artifact's sha256; every entry the archive lists is present);
    only then is each entry renamed into ``entries/`` (atomically, under its key's lock) and its
    markers written. An entry already present and valid is left as it is.

    Raises:
        FileNotFoundError: no such file, or a directory.
        ArchiveError: not a readable tar, an unexpected member (a link, a path outside the layout),
            or an entry that fails verification; nothing becomes visible.
        jitattn.cache.CacheWriteError: the writable root cannot take the entries (where and why).
    """
    if archive.is_dir():
        raise FileNotFoundError(f"{archive}: a directory, not an archive (expected the .tar.gz or .tar that "
                                f"`jitattn cache export` wrote; an unpacked export is itself a cache root: add it "
                                f"to JITATTN_CACHE_PATH)")
    if not archive.is_file():
        raise FileNotFoundError(f"{archive}: no such file")
    stage = cache.scratch("import")
    try:
        with cache.writing(stage, f"unpack {archive} into"):
            stage.mkdir(parents=True)
            listed = _unpack(archive, stage)
        manifests = _check_staged(stage, listed, archive)
        with cache.writing(cache.base() / "entries", "place the imported entries in"):
            return [_place(cache, stage / key, manifest) for key, manifest in sorted(manifests.items())]
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _unpack(archive: Path, stage: Path) -> list[str] | None:
    """Extract the entry files of ``archive`` into ``stage/<key>/``; return the keys its listing names."""
    listed = None
    try:
        with tarfile.open(archive, mode="r:*") as tar:
            for member in tar:
                name = member.name[2:] if member.name.startswith("./") else member.name
                if member.isdir() or _MARKER_MEMBER.fullmatch(name):
                    continue  # markers are rebuilt from the manifests
                if not member.isfile():
                    raise ArchiveError(f"{archive}: member {member.name!r} is not a regular file; refusing the archive")
                if member.size > _MAX_MEMBER_BYTES:
                    raise ArchiveError(f"{archive}: member {member.name!r} is {member.size} bytes; refusing the archive")
                data = tar.extractfile(member).read()  # type: ignore[union-attr]
                if name == EXPORT_MANIFEST:
                    listed = [e["key"] for e in json.loads(data)["entries"]]
                    continue
                m = _ENTRY_MEMBER.fullmatch(name)
                if m is None or m["kk"] != m["key"][:2]:
                    raise ArchiveError(f"{archive}: unexpected member {member.name!r} (not v1/entries/<kk>/<key>/<file>)"
                                       f"; refusing the archive")
                (stage / m["key"]).mkdir(exist_ok=True)
                (stage / m["key"] / m["file"]).write_bytes(data)
    except (tarfile.TarError, EOFError, zlib.error, ValueError, KeyError, TypeError) as exc:
        if isinstance(exc, ArchiveError):
            raise
        raise ArchiveError(f"{archive}: not a readable jitattn export ({type(exc).__name__}: {exc})") from None
    return listed


def _check_staged(stage: Path, listed: list[str] | None, archive: Path) -> dict[str, dict[str, Any]]:
    """Verify every staged entry; drop files its manifest does not name. All or nothing."""
    problems, manifests = [], {}
    keys = sorted(p.name for p in stage.iterdir())
    for key in sorted(set(listed or ()) - set(keys)):
        problems.append(f"{key[:16]}: listed in {EXPORT_MANIFEST} but not in the archive (truncated?)")
    for key in keys:
        problem, manifest = check_entry(stage / key)
        if problem:
            problems.append(f"{key[:16]} ({manifest.get('name', '?')}): {problem}")
            continue
        allowed = {MANIFEST, *manifest["artifacts"]}
        for extra in (p for p in (stage / key).iterdir() if p.name not in allowed):
            extra.unlink()  # never place bytes no checksum covers
        manifests[key] = manifest
    if problems:
        raise ArchiveError(f"{archive}: {len(problems)} entr{'y' if len(problems) == 1 else 'ies'} failed "
                           f"verification, nothing imported:\n  " + "\n  ".join(problems))
    if not manifests:
        raise ArchiveError(f"{archive}: holds no cache entries")
    return manifests


def _place(cache: KernelCache, staged: Path, manifest: dict[str, Any]) -> Imported:
    key = staged.name
    result = Imported(key, manifest.get("name", "?"), manifest["key_inputs"]["arch"], "present")
    with cache.locked(key, f"import of {result.name} ({result.arch})"):
        if cache.entry_in_root(key) is None:
            final = cache.entry_dir(key)
            final.parent.mkdir(parents=True, exist_ok=True)
            os.rename(staged, final)
            result = Imported(key, result.name, result.arch, "imported")
        cache.add_markers(manifest)
    return result


def needed(models: Iterable[tuple[AttentionSpec, list[str]]], archs: list[str]) -> list[Wanted]:
    """Every (spec, arch) pair of ``models`` (spec, needed-by list) and ``archs``, in order."""
    return [Wanted(spec, arch, tuple(sources)) for spec, sources in models for arch in archs]

