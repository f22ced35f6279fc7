"""``jitattn cache verify | prune | clear | export | import`` (jitattn/cache_admin.py), through the
command line in real processes, with real nvcc for the entries that need compiling.

One small kernel is compiled once per module (``small``); tests copy that cache root. Entries that
another jitattn version, other templates or other flags built are made from it with consistent
keys (the manifest rewritten and re-addressed), as those builds would have made them.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from jitattn import AttentionSpec
from jitattn.cache import MANIFEST, KernelCache, key_lock, verify_entry
from jitattn.append_kv_module import AppendKvModule
from jitattn.merge_module import MergeModule
from jitattn.models import model_specs
from tests.test_cache import child_env, copy_of, fake_nvcc
from tests.test_cli import GEMMA, jitattn

SMALL = AttentionSpec(8, 2, 64)
GEMMA_MERGE = MergeModule("bfloat16")  # the merge_state module a model's warmup/export adds for its output dtype
GEMMA_APPEND = AppendKvModule("bfloat16")  # and the append_kv module of its K/V and cache dtypes


def gemma_kernels() -> list:
    """What `--model gemma-2-9b.json` needs: its two layer kinds' specs and the bf16 merge_state and append_kv modules."""
    return [*model_specs(GEMMA), GEMMA_MERGE, GEMMA_APPEND]


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    """A cache root holding SMALL for sm_80."""
    root = tmp_path_factory.mktemp("small") / "cache"
    KernelCache(root=root, layers=()).get_or_build(SMALL, "sm_80")
    return root


@pytest.fixture(scope="module")
def gemma(tmp_path_factory) -> Path:
    """A cache root holding Gemma-2-9B's kernels for sm_80 (2 specs + merge_state), and SMALL (which no
    export of Gemma ships)."""
    root = tmp_path_factory.mktemp("gemma") / "cache"
    cache = KernelCache(root=root, layers=())
    for spec in [*gemma_kernels(), SMALL]:
        cache.get_or_build(spec, "sm_80")
    return root


def only_entry(root: Path) -> Path:
    (path,) = [p.parent for p in root.glob(f"v1/entries/*/*/{MANIFEST}")]
    return path


def rekeyed(entry: Path, root: Path, **changes) -> Path:
    """A copy of ``entry`` as if built with other key inputs: consistent manifest, key and address."""
    manifest = json.loads((entry / MANIFEST).read_text())
    manifest["key_inputs"].update(changes)
    text = json.dumps(manifest["key_inputs"], sort_keys=True, separators=(",", ":"))
    key = hashlib.sha256(text.encode()).hexdigest()
    manifest["key"] = key
    dest = root / "v1" / "entries" / key[:2] / key
    shutil.copytree(entry, dest)
    (dest / MANIFEST).write_text(json.dumps(manifest))
    assert verify_entry(dest) is None
    return dest


# ---- verify ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_verify_quarantines_the_writable_root_and_reports_layers(tmp_path, small):
    rw, ro = copy_of(small, tmp_path / "rw"), copy_of(small, tmp_path / "ro")
    env = {"JITATTN_CACHE_PATH": str(ro)}
    ok = jitattn("cache", "verify", cache=rw, env=env)
    assert ok.returncode == 0 and ok.stdout.strip() == "2 entries checked, 2 ok, 0 corrupt"
    bad_rw, bad_ro = only_entry(rw), only_entry(ro)
    for entry in (bad_rw, bad_ro):
        cubin = next(entry.glob("*.cubin"))
        cubin.write_bytes(cubin.read_bytes()[:-10])  # truncated
    proc = jitattn("cache", "verify", cache=rw, env=env)
    assert proc.returncode == 1
    lines = proc.stdout.splitlines()
    (moved,) = (rw / "v1" / "quarantine").iterdir()
    problem = "artifact kernel.sm_80.cubin does not match its sha256 (truncated or altered)"
    assert lines == [f"corrupt {bad_rw}: {problem}; moved to {moved}",
                     f"corrupt {bad_ro}: {problem}; left in place (read-only)",
                     "2 entries checked, 0 ok, 2 corrupt"]
    assert not bad_rw.exists() and bad_ro.exists()
    again = json.loads(jitattn("cache", "verify", "--json", cache=rw, env=env).stdout)
    assert [(r["layer"], r["status"]) for r in again] == [("read-only", problem)]


# ---- prune -------------------------------------------------------------------------------------
def _fake_key(c: str) -> str:
    return c * 64


@pytest.mark.slow
def test_prune_removes_what_no_lookup_uses_and_says_why(tmp_path, small):
    import jitattn as pkg

    root = copy_of(small, tmp_path / "cache")
    base = root / "v1"
    current = only_entry(root)
    old_version = rekeyed(current, root, jitattn_version="0.0.0")
    other_flags = rekeyed(current, root, flags=["-O0"])
    other_templates = rekeyed(current, root, templates={"decode.cuh": "0" * 64})
    dead, busy = _fake_key("d"), _fake_key("b")
    leftovers = {
        base / "tmp" / f"{dead}.999999999.0a0b0c0d": "unfinished publish, import or removal",
        base / "tmp" / "import.999999999.0a0b0c0d": "unfinished publish, import or removal",
        base / "build" / dead: "leftover of a killed or failed build",
        base / "failed" / dead: "failed build, kept for reading its kernel.cu",
        base / "quarantine" / f"{dead}.1234": "corrupt entry moved aside: missing artifact kernel.sm_80.cubin",
        base / "entries" / "ee" / _fake_key("e"): "incomplete entry (no manifest)",
    }
    for path in leftovers:
        path.mkdir(parents=True)
        (path / "kernel.cu").write_text("// left behind\n")
    (base / "quarantine" / f"{dead}.1234" / "QUARANTINED").write_text("missing artifact kernel.sm_80.cubin\n")
    marker = base / "index" / "ff" / _fake_key("f") / _fake_key("a")
    marker.parent.mkdir(parents=True)
    marker.touch()
    (base / "locks" / f"{dead}.lock").touch()
    in_use = [base / "build" / busy, base / "tmp" / f"{busy}.{os.getpid()}.0a0b0c0d",
              base / "tmp" / f"import.{os.getpid()}.0a0b0c0d"]
    for path in in_use:
        path.mkdir(parents=True)
    with key_lock(base / "locks" / f"{busy}.lock", 5.0):  # a build of `busy` is running
        before = sorted(str(p) for p in root.rglob("*"))
        dry = jitattn("cache", "prune", "--dry-run", cache=root)
        assert dry.returncode == 0, dry.stderr
        assert sorted(str(p) for p in root.rglob("*")) == before  # nothing removed
        done = jitattn("cache", "prune", cache=root)
    assert done.returncode == 0, done.stderr
    expected = {**leftovers, marker: "marker of a missing entry (index/)",
                old_version: f"built for another jitattn version (0.0.0; this is {pkg.__version__})",
                other_flags: "built for other nvcc flags (['-O0'])",
                other_templates: "built for other templates than this installation's",
                base / "locks" / f"{dead}.lock": "idle lock file"}
    for output, verb in ((dry.stdout, "would remove"), (done.stdout, "removed")):
        for path, reason in expected.items():
            assert any(ln.startswith(f"{verb} {path} (") and ln.endswith(f"): {reason}") for ln in output.splitlines()), \
                (path, reason, output)
    for path in expected:
        assert not path.exists(), path
    for path in in_use + [current, base / "locks" / f"{busy}.lock"]:
        assert path.exists(), path  # work in progress and the current entry stay
    assert KernelCache(root=root, layers=()).find(SMALL, "sm_80").path == current
    assert sorted((base / "tmp").iterdir()) == sorted(in_use[1:])
    again = json.loads(jitattn("cache", "prune", "--json", cache=root).stdout)  # the build of `busy` is over
    assert {r["path"] for r in again if r["reason"] != "idle lock file"} == {str(p) for p in in_use[:2]}
    assert in_use[2].exists()  # its process (this one) still runs


# ---- clear -------------------------------------------------------------------------------------
@pytest.mark.slow
def test_clear_needs_yes_and_leaves_the_layers(tmp_path, small):
    rw, ro = copy_of(small, tmp_path / "rw"), copy_of(small, tmp_path / "ro")
    entry, env = only_entry(rw), {"JITATTN_CACHE_PATH": str(ro)}
    refused = jitattn("cache", "clear", cache=rw, env=env)
    assert refused.returncode == 2
    assert refused.stderr.startswith("jitattn: error: cache clear removes 1 entries (") and \
        refused.stderr.rstrip().endswith(f"from {rw}; pass --yes to do it, or --dry-run to list them")
    assert entry.exists()
    done = jitattn("cache", "clear", "--yes", cache=rw, env=env)
    assert done.returncode == 0, done.stderr
    assert f"removed {entry} (" in done.stdout and "): cleared" in done.stdout
    assert not list(rw.glob("v1/entries/*/*")) and not list(rw.glob("v1/index/*/*"))
    assert only_entry(ro).is_dir()
    rows = json.loads(jitattn("cache", "ls", "--json", cache=rw, env=env).stdout)
    assert [r["layer"] for r in rows] == ["read-only"]


# ---- export and import -------------------------------------------------------------------------
def members(archive: Path) -> list[str]:
    with tarfile.open(archive) as tar:
        return tar.getnames()


@pytest.mark.slow
def test_export_ships_exactly_the_model_entries_and_import_makes_them_load_anywhere(tmp_path, gemma):
    out = tmp_path / "gemma-sm80.tar.gz"
    proc = jitattn("cache", "export", "--model", str(GEMMA), "--arch", "sm_80", "-o", str(out), cache=gemma)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"exported 4 entries (4 specs x 1 archs: sm_80) to {out} (")
    cache = KernelCache(root=gemma, layers=())
    wanted = [cache.find(spec, "sm_80") for spec in gemma_kernels()]
    expected = {"jitattn-export.json"}
    for e in wanted:
        expected |= {f"v1/entries/{e.key[:2]}/{e.key}/{name}" for name in [*e.manifest["artifacts"], MANIFEST]}
        expected |= {f"v1/index/{e.manifest['source_key'][:2]}/{e.manifest['source_key']}/{e.key}",
                     f"v1/specs/{e.manifest['spec_key'][:2]}/{e.manifest['spec_key']}/{e.key}"}
    names = members(out)
    assert names[0] == "jitattn-export.json" and set(names) == expected  # exactly: SMALL is not shipped
    with tarfile.open(out) as tar:
        listing = json.load(tar.extractfile("jitattn-export.json"))
    assert sorted(e["needed_by"][0] for e in listing["entries"]) == ["gemma-2-9b/append_kv",
                                                                    "gemma-2-9b/full_attention",
                                                                    "gemma-2-9b/merge_state",
                                                                    "gemma-2-9b/sliding_attention"]
    again = tmp_path / "again.tar.gz"
    jitattn("cache", "export", "-m", str(GEMMA), "-a", "sm_80", "-o", str(again), cache=gemma)
    assert again.read_bytes() == out.read_bytes()  # the archive depends only on the entries

    node = tmp_path / "node"
    imported = jitattn("cache", "import", str(out), cache=node)
    assert imported.returncode == 0, imported.stderr
    assert imported.stdout.splitlines()[-1] == f"imported 4, already present 0, into {node}"
    assert jitattn("cache", "import", str(out), cache=node).stdout.splitlines()[-1] == \
        f"imported 0, already present 4, into {node}"
    assert not list((node / "v1" / "tmp").iterdir())
    unpacked = tmp_path / "layer"  # `tar -x` alone makes a layer too
    unpacked.mkdir()
    subprocess.run(["tar", "-xzf", str(out), "-C", str(unpacked)], check=True)
    refusing, log = fake_nvcc(tmp_path, "no-compile")
    for env in ({"JITATTN_CACHE_DIR": str(node)},
                {"JITATTN_CACHE_DIR": str(tmp_path / "empty"), "JITATTN_CACHE_PATH": str(unpacked)}):
        for spec, entry in zip(gemma_kernels(), wanted):
            got = _load(spec, {**env, "JITATTN_DISABLE_JIT": "1", "JITATTN_NVCC": str(refusing)})
            assert got == {"built": False, "key": entry.key}
    assert not log.exists()


_LOAD = """
import json, sys
from jitattn import modules
from jitattn.cache import KernelCache
spec = modules.from_json(json.loads(sys.argv[1]))
entry, built = KernelCache().get_or_build(spec, "sm_80")
print(json.dumps({"built": built, "key": entry.key}))
"""


def _load(spec: AttentionSpec | MergeModule, env: dict[str, str]) -> dict:
    proc = subprocess.run([sys.executable, "-c", _LOAD, spec.canonical_json()], capture_output=True, text=True,
                          env={**child_env(), **env}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.slow
def test_export_of_a_missing_kernel_fails_with_the_warmup_command(tmp_path, gemma):
    out = tmp_path / "g.tar"
    proc = jitattn("cache", "export", "-m", str(GEMMA), "-a", "sm_80", "-a", "sm_90a", "-o", str(out), cache=gemma)
    assert proc.returncode == 1 and not out.exists() and not list(tmp_path.glob(".g.tar*"))
    err = proc.stderr
    assert err.startswith(f"jitattn: error: 4 of 8 kernels are not cached (looked in {gemma}); nothing written:")
    for spec in gemma_kernels():
        assert f"  {spec.name} sm_90a (needed by gemma-2-9b/" in err
    assert err.rstrip().endswith(f"build them on a machine with nvcc, then export again:\n"
                                 f"  jitattn warmup --model {GEMMA} --arch sm_80 --arch sm_90a")
    bad = jitattn("cache", "export", "-m", str(GEMMA), "-a", "sm_80", "-o", str(tmp_path / "g.zip"), cache=gemma)
    assert bad.returncode == 2 and "expected a .tar.gz, .tgz or .tar file name" in bad.stderr


def _rewrite(archive: Path, out: Path, edit) -> Path:
    """A copy of a .tar.gz export with ``edit(name, data) -> data | None`` (None drops the member)."""
    with tarfile.open(archive) as src, tarfile.open(out, "w:gz") as dst:
        for member in src:
            data = edit(member.name, src.extractfile(member).read())
            if data is not None:
                member.size = len(data)
                dst.addfile(member, io.BytesIO(data))
    return out


def _flip_cubin(name: str, data: bytes) -> bytes:
    if name.endswith(".cubin") and "sliding" not in name:
        data = bytearray(data)
        data[len(data) // 2] ^= 0x01
        return bytes(data)
    return data


@pytest.fixture(scope="module")
def archive(gemma, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("archive") / "gemma.tar.gz"
    proc = jitattn("cache", "export", "-m", str(GEMMA), "-a", "sm_80", "-o", str(out), cache=gemma)
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["one altered cubin", "truncated gzip", "entry missing", "link member",
                                    "path outside the layout"])
def test_import_verifies_everything_before_anything_is_visible(tmp_path, archive, damage):
    bad = tmp_path / "bad.tar.gz"
    first_cubin = next(n for n in members(archive) if n.endswith(".cubin"))
    if damage == "one altered cubin":
        _rewrite(archive, bad, lambda n, d: _flip_cubin(n, d) if n == first_cubin else d)
        expect = "1 entry failed verification, nothing imported:"
        detail = "artifact kernel.sm_80.cubin does not match its sha256 (truncated or altered)"
    elif damage == "truncated gzip":
        bad.write_bytes(archive.read_bytes()[: archive.stat().st_size // 2])
        expect, detail = "not a readable jitattn export", ""
    elif damage == "entry missing":
        key = first_cubin.split("/")[3]
        _rewrite(archive, bad, lambda n, d: None if f"/{key}/" in n else d)
        expect, detail = "1 entry failed verification, nothing imported:", "listed in jitattn-export.json but not"
    elif damage == "link member":
        shutil.copy(archive, bad)
        with gzip.open(bad, "rb") as f:
            raw = f.read()
        plain = tmp_path / "bad.tar"
        plain.write_bytes(raw)
        with tarfile.open(plain, "a") as tar:
            link = tarfile.TarInfo("v1/entries/00/" + "0" * 64 + "/kernel.sm_80.cubin")
            link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
            tar.addfile(link)
        bad = plain
        expect, detail = "is not a regular file; refusing the archive", ""
    else:
        _rewrite(archive, bad, lambda n, d: d)
        with tarfile.open(bad, "r:gz") as src:
            kept = [(m, src.extractfile(m).read()) for m in src]
        with tarfile.open(bad, "w:gz") as dst:
            for m, d in kept:
                dst.addfile(m, io.BytesIO(d))
            evil = tarfile.TarInfo("../../evil.txt")
            evil.size = 4
            dst.addfile(evil, io.BytesIO(b"evil"))
        expect, detail = "unexpected member '../../evil.txt'", ""
    node = tmp_path / "node"
    proc = jitattn("cache", "import", str(bad), cache=node)
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert proc.stderr.startswith(f"jitattn: error: {bad}: ") and expect in proc.stderr and detail in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not list(node.glob("v1/entries/*/*")) and not list(node.glob("v1/tmp/*"))  # nothing visible, no leftovers
    assert not (tmp_path.parent / "evil.txt").exists() and not (tmp_path / "evil.txt").exists()


def test_import_of_a_missing_file_is_a_usage_error(tmp_path):
    proc = jitattn("cache", "import", str(tmp_path / "nope.tar.gz"), cache=tmp_path / "c")
    assert proc.returncode == 2 and proc.stderr.strip() == f"jitattn: error: {tmp_path / 'nope.tar.gz'}: no such file"


def test_import_of_a_directory_says_it_is_one(tmp_path):
    """`jitattn cache import DIR` said 'DIR: no such file' for a directory that exists."""
    proc = jitattn("cache", "import", str(tmp_path), cache=tmp_path / "c")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith(f"jitattn: error: {tmp_path}: a directory, not an archive (expected the .tar.gz "
                                  f"or .tar that `jitattn cache export` wrote"), proc.stderr
