"""Plant known bugs in a copy of the tree and check that the tests named for each one catch it.

    python tools/mutation_check.py            # every mutation of MUTATIONS
    python tools/mutation_check.py --list     # the table
    python tools/mutation_check.py --only doc-stride --only nvcc-ignored

Each mutation replaces one piece of text (which must occur exactly once in its file) in a temporary
copy of the tree (git's tracked and untracked, not ignored, files), runs its tests there with pytest,
and expects them to fail. First the named tests run on the unmutated copy and must pass, or a failure
would prove nothing. A bug found by review and fixed gets a row here with the test that now catches
it, so the next change to that place can be checked the same way.

Exit status: 0 every mutation caught; 1 a mutation survived (its tests passed) or its tests could not
run (collection error, no test selected), or the baseline failed; 2 the table is stale (a text not
found exactly once; fix the row).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutation:
    """One planted bug: ``original`` -> ``mutated`` in ``path`` (relative to the repo), caught by ``tests``
    (pytest arguments: files, node ids, ``-k`` expressions)."""

    name: str
    path: str
    original: str
    mutated: str
    tests: tuple[str, ...]


MUTATIONS: tuple[Mutation, ...] = (
    Mutation("doc-stride", "jitattn/variant.py",
             "row = batch * params.doc_stride", "row = batch + params.doc_stride",
             ("tests/test_variant_oracles.py", "tests/test_trace.py::test_document_mask_on_the_reference")),
    Mutation("prefix-lm-bound", "jitattn/variant.py",
             "(kv_idx < params.prefix_len[batch])", "(kv_idx <= params.prefix_len[batch])",
             ("tests/test_variant_oracles.py",)),
    Mutation("t5-last-bucket", "jitattn/variant.py",
             "large = where(large < span - 1, large, span - 1)", "large = where(large < span - 2, large, span - 2)",
             ("tests/test_variant_oracles.py", "-k", "t5")),
    Mutation("t5-direction", "jitattn/variant.py",
             "offset = where(n < 0, span, 0) if bidirectional else 0",
             "offset = where(n > 0, span, 0) if bidirectional else 0",
             ("tests/test_variant_oracles.py", "-k", "t5")),
    Mutation("rope-sign", "jitattn/variant.py",
             "return x * _cos(angle) + x_rot * _sin(angle)", "return x * _cos(angle) - x_rot * _sin(angle)",
             ("tests/test_variant_oracles.py", "-k", "rope")),
    Mutation("sigmoid-bias-sign", "jitattn/variant.py",
             "return _sigmoid(score + params.bias)", "return _sigmoid(score - params.bias)",
             ("tests/test_variant_oracles.py", "-k", "sigmoid")),
    Mutation("kv-cache-head-dim-unchecked", "jitattn/checks.py",
             "for d in range(1, 5):\n        if kv_cache.shape[d] != expected[d]:",
             "for d in range(1, 4):\n        if kv_cache.shape[d] != expected[d]:",
             ("tests/test_checks.py::test_kv_cache_of_another_head_dim_is_refused",)),
    Mutation("reflected-swapped", "jitattn/trace.py",
             "return build(self, other, arg, True)",
             "return build(self, other, arg, False)",
             ("tests/test_trace.py::test_reflected_operators_keep_the_left_operand_on_the_left",)),
    Mutation("nvcc-ignored", "jitattn/cache.py",
             'return ok and (nvcc is None or inputs.get("nvcc") == nvcc)', "return ok",
             ("tests/test_cache_lookup.py",)),
    Mutation("metric-ignores-ref-nan", "jitattn/testing.py",
             "if not (finite_o.all() and finite_r.all()):", "if not finite_o.all():",
             ("tests/test_reference.py", "-k", "relative_error")),
    Mutation("launch-memo-without-stream", "jitattn/cuda_driver.py",
             "key = (function, grid, block, smem, stream)",
             "key = (function, grid, block, smem, 0)",
             ("tests/test_cuda_driver.py", "-k", "made_once")),
    Mutation("launch-grid-wraps", "jitattn/cuda_driver.py",
             "    if not 0 <= value < 1 << 32:\n", "    if False:\n",
             ("tests/test_cuda_driver.py", "-k", "out_of_range")),
)


def tree_files(repo: Path) -> list[str]:
    """The files a checkout holds: git's tracked and untracked, not ignored (relative paths)."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=repo,
                         capture_output=True, check=True).stdout
    return [p for p in out.decode().split("\0") if p and (repo / p).is_file()]


def copy_tree(repo: Path, dest: Path) -> None:
    for rel in tree_files(repo):
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(repo / rel, target)


def stale_rows(mutations: tuple[Mutation, ...], root: Path) -> list[str]:
    """Rows whose original text does not occur exactly once in their file."""
    problems = []
    for m in mutations:
        path = root / m.path
        count = path.read_text().count(m.original) if path.is_file() else -1
        if count != 1:
            where = "file missing" if count < 0 else f"found {count} times"
            problems.append(f"{m.name}: {m.original!r} in {m.path}: {where} (expected once)")
    return problems


def run_tests(root: Path, tests: tuple[str, ...], cache: Path) -> tuple[int, str, float]:
    """pytest's exit status, the last lines of its output and the seconds it took, in the copy ``root``."""
    env = {**os.environ, "PYTHONPATH": str(root), "JITATTN_CACHE_DIR": str(cache), "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("JITATTN_CACHE_PATH", None)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests], cwd=root,
                          env=env, capture_output=True, text=True)
    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-3:])
    return proc.returncode, tail, time.monotonic() - start


def check(mutations: tuple[Mutation, ...], baseline: bool = True) -> int:
    """Run the check; print one line per mutation; return the exit status (see the module doc)."""
    with tempfile.TemporaryDirectory(prefix="jitattn-mutants-") as tmp:
        root, cache = Path(tmp) / "tree", Path(tmp) / "cache"
        copy_tree(REPO, root)
        stale = stale_rows(mutations, root)
        if stale:
            print("stale mutation table:\n  " + "\n  ".join(stale))
            return 2
        if baseline:
            tests = tuple(dict.fromkeys(t for m in mutations for t in _selection(m)))
            code, tail, secs = run_tests(root, tests, cache)
            print(f"baseline (unmutated): {'passed' if code == 0 else 'FAILED'} in {secs:.0f} s")
            if code != 0:
                print("  " + tail.replace("\n", "\n  "))
                return 1
        failures = 0
        for m in mutations:
            path = root / m.path
            text = path.read_text()
            path.write_text(text.replace(m.original, m.mutated))
            try:
                code, tail, secs = run_tests(root, m.tests, cache)
            finally:
                path.write_text(text)
            verdict = {0: "SURVIVED", 1: "caught"}.get(code, f"ERROR (pytest exit {code})")
            print(f"{m.name:30s} {verdict:24s} {secs:5.1f} s  {m.path}: {m.original!r} -> {m.mutated!r}")
            if code != 1:
                failures += 1
                print("  " + tail.replace("\n", "\n  "))
        print(f"{len(mutations) - failures} of {len(mutations)} mutations caught")
        return 1 if failures else 0


def _selection(m: Mutation) -> tuple[str, ...]:
    """The test files and node ids of a row (a ``-k`` filter belongs to its own row's run only)."""
    out, skip = [], False
    for arg in m.tests:
        if skip:
            skip = False
        elif arg == "-k":
            skip = True
        else:
            out.append(arg)
    return tuple(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", default=[], metavar="NAME", help="run only this mutation")
    parser.add_argument("--list", action="store_true", help="print the table and exit")
    parser.add_argument("--no-baseline", action="store_true", help="skip the run on the unmutated copy")
    args = parser.parse_args(argv)
    names = {m.name for m in MUTATIONS}
    unknown = sorted(set(args.only) - names)
    if unknown:
        parser.error(f"--only {', '.join(unknown)}: no such mutation (known: {', '.join(sorted(names))})")
    chosen = tuple(m for m in MUTATIONS if not args.only or m.name in args.only)
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.path}: {m.original!r} -> {m.mutated!r}; tests: {' '.join(m.tests)}")
        return 0
    return check(chosen, baseline=not args.no_baseline)


if __name__ == "__main__":
    sys.exit(main())
