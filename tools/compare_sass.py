"""Compare the SASS of two jitattn trees: does a template change alter what runs on the GPU?

For every spec of a list and every target arch, each tree renders and compiles the spec with its own
``jitattn.render.render`` and ``jitattn.build.build`` (a subprocess with that tree first on
``PYTHONPATH``, so each tree's templates are the ones compiled). The cubins are disassembled with
``cuobjdump -sass`` and compared kernel by kernel, after removing what is not code: the code
addresses printed in comments and the file headers. Resource usage (``cuobjdump -res-usage``:
registers, stack, shared and constant memory) is compared too.

Builds are stored by the hash of the preprocessed device source (``nvcc -E``, line markers and
whitespace removed) and the arch, in ``--work``: a spec whose preprocessed source did not change is
not compiled again, and two trees that preprocess to the same text share one cubin. Keep ``--work``
between runs so the base tree is compiled once.

Usage::

    python tools/compare_sass.py --base /path/to/old/checkout [--tree .] [--arch sm_80 --arch sm_90a]
        [--only SUBSTRING ...] [--work /tmp/compare-sass] [--list]

Needs nvcc, cuobjdump (CUOBJDUMP or PATH) and the nvdisasm it runs (NVDISASM_PATH, PATH, or
``pip install nvidia-cuda-nvdisasm``); no GPU.

A spec a tree refuses at construction (a base older than the feature the spec needs, e.g. head dims that
are multiples of 8 only) is listed as ``spec only in tree`` and not compared; the new tree refusing a
spec the base takes counts as a difference.

Exit status: 0 when every (spec, arch, kernel) is identical, 1 when any differs or is missing, 2
when a tree fails to render or compile a spec.
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

DEFAULT_ARCHS = ("sm_80", "sm_90a")
DEFAULT_WORK = Path("/tmp/compare-sass")
CUOBJDUMP_CANDIDATES = ("/opt/cuobjdump/x/nvidia/cu13/bin/cuobjdump",)

#: Specs beyond the bench catalogue, one per feature of the GPU matrix (tests/gpu_cases.py) the bench
#: does not build: ``label -> Python expression`` over AttentionSpec and jitattn.variant's constructors.
EXTRA_SPECS: dict[str, str] = {
    "fp8-gpt-oss-sliding-hnd": "AttentionSpec(64, 8, 64, kv_dtype='float8_e4m3fn', sinks=True, window_left=127, "
                               "kv_layout='HND')",
    "fp8-hd256-fp16-softcap-rotary": "AttentionSpec(16, 8, 256, q_dtype='float16', kv_dtype='float8_e4m3fn', "
                                     "logits_soft_cap=50.0, variant=rotary_embedding(256))",
    "hnd-page7-fp16-softcap-window": "AttentionSpec(12, 4, 96, q_dtype='float16', kv_layout='HND', page_size=7, "
                                     "logits_soft_cap=30.0, window_left=200)",
    "explicit-positions-hd128": "AttentionSpec(32, 8, 128, query_positions='explicit')",
    "rotary-hd128-group4": "AttentionSpec(8, 2, 128, variant=rotary_embedding(128))",
    "t5-bias-bidirectional": "AttentionSpec(8, 2, 128, variant=relative_position_bias(32, 128, True), causal=False)",
    "sigmoid-whole-window-group12-hd192": "AttentionSpec(24, 2, 192, window_left=100, variant=sigmoid_attention())",
    "ragged-192x128-gqa8-softcap": "AttentionSpec(16, 2, 192, 128, kv_storage='ragged', logits_soft_cap=30.0)",
    "ragged-noncausal-window-both-alibi": "AttentionSpec(12, 3, 96, kv_storage='ragged', causal=False, "
                                          "window_left=31, window_right=17, alibi=True)",
    "alibi-sinks-noncausal-hd80": "AttentionSpec(8, 8, 80, alibi=True, sinks=True, causal=False)",
    "noncausal-window-right": "AttentionSpec(8, 2, 128, causal=False, window_left=64, window_right=32)",
    "fp8-group16-page1-softcap-window": "AttentionSpec(32, 2, 256, kv_dtype='float8_e4m3fn', page_size=1, "
                                        "logits_soft_cap=30.0, window_left=1000)",
    "group1-hd80": "AttentionSpec(8, 8, 80)",
    "fp8-hd80-group4-unswizzled": "AttentionSpec(16, 4, 80, kv_dtype='float8_e4m3fn', kv_layout='HND')",
    "fp8-hd96-group8-window127-keysplit": "AttentionSpec(64, 8, 96, kv_dtype='float8_e4m3fn', window_left=127)",
    "fp8-hd16-group2-page1": "AttentionSpec(4, 2, 16, kv_dtype='float8_e4m3fn', page_size=1)",
    "fp8-hd64-explicit-positions": "AttentionSpec(8, 2, 64, kv_dtype='float8_e4m3fn', query_positions='explicit')",
    # FP8 rows that end in half a 16-byte chunk (8-byte copies): in the new tree only, before issue 21
    "fp8-hd72-group4-page1": "AttentionSpec(32, 8, 72, kv_dtype='float8_e4m3fn', page_size=1)",
    "fp8-hd88-group2-hnd": "AttentionSpec(8, 4, 88, kv_dtype='float8_e4m3fn', kv_layout='HND')",
}


# ---- the worker: runs inside one tree ------------------------------------------------------------
def _spec_namespace() -> dict:
    from jitattn import variant
    from jitattn.spec import AttentionSpec

    ns = {"AttentionSpec": AttentionSpec}
    ns.update({name: getattr(variant, name) for name in dir(variant) if not name.startswith("_")})
    return ns


def bench_specs() -> dict[str, str]:
    """``label -> expression`` of every distinct spec the bench builds (its ragged twins and latent MLA
    specs included)."""
    from jitattn.bench.cases import all_cases

    out: dict[str, str] = {}
    for case in all_cases():
        specs = [case.spec] + ([case.spec.replace(kv_storage="ragged")] if case.ragged_twin else [])
        for spec in specs:
            if spec.variant is not None:
                raise ValueError(f"bench case {case.name}: a variant spec cannot be written as repr(); "
                                 f"add it to EXTRA_SPECS")
            expr = repr(spec)
            if expr not in out.values():
                label = case.name + ("-ragged" if spec.kv_storage == "ragged" else "")
                out[label] = expr
    return out


def _normalised_preprocessed(build_dir: Path, arch: str, nvcc: str) -> str:
    """The device source nvcc compiles for ``arch``, without line markers and blank space."""
    from jitattn import build

    cmd = [nvcc, *build.NVCC_FLAGS, f"-I{build_dir / build.INCLUDE_DIR}", "-E", "-cubin",
           f"-gencode={build.ARCHS[arch]}", build.RENDERED_FILE, "-o", "-"]
    text = subprocess.run(cmd, cwd=build_dir, capture_output=True, text=True, check=True).stdout
    lines = (ln.strip() for ln in text.splitlines())
    return "\n".join(ln for ln in lines if ln and not ln.startswith("#"))


def worker(specs: dict[str, str], archs: list[str], work: Path) -> dict[str, dict[str, str]]:
    """Render and build each spec for each arch in this process's tree; return label -> arch -> cubin."""
    from jitattn import build, render, settings

    ns = _spec_namespace()
    nvcc = settings.nvcc()
    out: dict[str, dict[str, str]] = {}
    for label, expr in specs.items():
        try:
            spec = eval(expr, ns)  # noqa: S307 - expressions from this file or a spec's own repr
        except ValueError as err:  # a spec this tree does not take (e.g. a base older than the spec's feature)
            print(f"  refused   {label}: {err}", file=sys.stderr, flush=True)
            continue
        source = render.render(spec)
        for arch in archs:
            scratch = work / "scratch" / f"{os.getpid()}"
            shutil.rmtree(scratch, ignore_errors=True)
            build.prepare(source, arch, scratch)
            key_text = _normalised_preprocessed(scratch, arch, nvcc) + f"\n{arch}\n{build.NVCC_FLAGS}"
            key = hashlib.sha256(key_text.encode()).hexdigest()[:24]
            cubin = work / "cubins" / f"{key}.{arch}.cubin"
            if not cubin.exists():
                print(f"  compiling {label} {arch}", file=sys.stderr, flush=True)
                result = build.build(source, arch, work / "build" / key)
                cubin.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(result.cubin, cubin)
            else:
                print(f"  cached    {label} {arch}", file=sys.stderr, flush=True)
            out.setdefault(label, {})[arch] = str(cubin)
    return out


# ---- the driver ----------------------------------------------------------------------------------
def run_worker(tree: Path, specs: dict[str, str], archs: list[str], work: Path) -> dict[str, dict[str, str]]:
    """Run :func:`worker` in a subprocess with ``tree`` first on PYTHONPATH."""
    # a base from before aebcc69 builds FP8 rows of 8-byte chunks only behind this variable (newer trees ignore it)
    env = {**os.environ, "PYTHONPATH": str(tree), "JITATTN_CACHE_DIR": str(work / "jitattn-cache"),
           "JITATTN_UNVERIFIED_FP8_PADDED": "1"}
    request = json.dumps({"specs": specs, "archs": archs, "work": str(work)})
    proc = subprocess.run([sys.executable, __file__, "--worker"], input=request, text=True, env=env,
                          stdout=subprocess.PIPE, cwd=tree)
    if proc.returncode != 0:
        raise SystemExit(2)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def cuobjdump() -> str:
    """cuobjdump's path (CUOBJDUMP, a known install, PATH). cuobjdump -sass runs nvdisasm: NVDISASM_PATH (its
    folder), PATH, or the nvidia-cuda-nvdisasm wheel of this environment, whose folder is put in NVDISASM_PATH."""
    if not os.environ.get("NVDISASM_PATH") and not shutil.which("nvdisasm"):
        try:
            import nvidia.cu13  # the nvidia-cuda-nvdisasm wheel, when installed in this environment

            wheel_bins = [str(Path(folder) / "bin") for folder in nvidia.cu13.__path__]
        except ImportError:
            wheel_bins = []
        for folder in wheel_bins:
            if (Path(folder) / "nvdisasm").is_file():
                os.environ["NVDISASM_PATH"] = folder
                break
        else:
            raise SystemExit("nvdisasm not found (cuobjdump -sass needs it): `pip install nvidia-cuda-nvdisasm` "
                             "or set NVDISASM_PATH to its folder")
    for path in (os.environ.get("CUOBJDUMP", ""), *CUOBJDUMP_CANDIDATES):
        if path and Path(path).is_file():
            return path
    found = shutil.which("cuobjdump")
    if not found:
        raise SystemExit("cuobjdump not found: set CUOBJDUMP to its path")
    return found


_FUNCTION = re.compile(r"^\s*Function : (\S+)")
_ADDRESS = re.compile(r"/\*[0-9a-f]{4,}\*/")


def kernels_sass(cubin: str) -> dict[str, list[str]]:
    """Kernel name -> normalised SASS lines (code addresses removed), plus ``<name> resources`` and the
    constant bank 3 data; kept beside the cubin (``.sass.json``), which is named by its source's hash."""
    saved = Path(cubin + ".sass.json")
    if saved.exists():
        return json.loads(saved.read_text())
    out = _disassemble(cubin)
    saved.write_text(json.dumps(out))
    return out


def _disassemble(cubin: str) -> dict[str, list[str]]:
    tool = cuobjdump()
    sass = subprocess.run([tool, "-sass", cubin], capture_output=True, text=True, check=True).stdout
    out: dict[str, list[str]] = {}
    current = None
    for line in sass.splitlines():
        m = _FUNCTION.match(line)
        if m:
            current = m.group(1)
            out[current] = []
            continue
        if current is None or not line.strip():
            continue
        out[current].append(_ADDRESS.sub("", line).strip())
    res = subprocess.run([tool, "-res-usage", cubin], capture_output=True, text=True, check=True).stdout
    lines = res.splitlines()
    for i, line in enumerate(lines):
        if line.strip().startswith("Function ") and i + 1 < len(lines):
            name = line.strip()[len("Function "):].rstrip(":")
            out[f"{name} resources"] = [lines[i + 1].strip()]
    elf = subprocess.run([tool, "-elf", cubin], capture_output=True, text=True, check=True).stdout
    m = re.search(r"^\.nv\.constant3\n((?:0x[0-9a-f]+\s*)+)", elf, re.M)
    out["<constant bank 3: __constant__ data, jitattn_geometry>"] = m.group(1).split() if m else []
    return out


def compare(base: dict, new: dict, archs: list[str], diff_lines: int = 0, removed: tuple[str, ...] = ()) -> int:
    """Print one line per (spec, arch, kernel); return how many are not identical (``removed``: kernels
    the new tree drops on purpose, reported but not counted)."""
    failures = 0
    for label in sorted(set(base) | set(new), key=list({**base, **new}).index):
        if label not in base or label not in new:  # a spec one tree refuses: only the new tree refusing counts
            failures += label not in new
            print(f"{'spec only in ' + ('tree' if label in new else 'base'):24s} {label}")
            continue
        for arch in archs:
            a, b = kernels_sass(base[label][arch]), kernels_sass(new[label][arch])
            for kernel in sorted(set(a) | set(b)):
                if kernel not in a or kernel not in b:
                    state = "only in base" if kernel in a else "only in tree"
                elif a[kernel] == b[kernel]:
                    state = "identical"
                else:
                    state = "differs"
                if state == "only in base" and kernel.split()[0] in removed:
                    state = "removed"
                elif state != "identical":
                    failures += 1
                print(f"{state:12s} {label:50s} {arch:7s} {kernel}")
                if state == "differs" and diff_lines:
                    diff = difflib.unified_diff(a[kernel], b[kernel], "base", "tree", n=1, lineterm="")
                    for line in list(diff)[:diff_lines]:
                        print("    " + line)
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", type=Path, help="the old checkout (e.g. a detached git worktree)")
    parser.add_argument("--tree", type=Path, default=Path(__file__).resolve().parent.parent, help="the new checkout")
    parser.add_argument("--arch", action="append", help=f"target arch (repeatable; default {DEFAULT_ARCHS})")
    parser.add_argument("--only", action="append", help="only specs whose label contains this (repeatable)")
    parser.add_argument("--work", type=Path, default=DEFAULT_WORK, help="cubin store, kept between runs")
    parser.add_argument("--list", action="store_true", help="print the spec list and exit")
    parser.add_argument("--diff", type=int, nargs="?", const=60, default=0, metavar="LINES",
                        help="print the first LINES (60) lines of each SASS difference")
    parser.add_argument("--removed", action="append", default=[],
                        help="a kernel the new tree drops on purpose: reported, not counted (repeatable)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        request = json.loads(sys.stdin.read())
        print(json.dumps(worker(request["specs"], request["archs"], Path(request["work"]))))
        return 0
    sys.path.insert(0, str(args.tree))
    specs = {**bench_specs(), **EXTRA_SPECS}
    if args.only:
        specs = {k: v for k, v in specs.items() if any(s in k for s in args.only)}
    if args.list:
        for label, expr in specs.items():
            print(f"{label}: {expr}")
        return 0
    if args.base is None:
        parser.error("--base is required (the checkout to compare against)")
    archs = args.arch or list(DEFAULT_ARCHS)
    args.work.mkdir(parents=True, exist_ok=True)
    print(f"base tree {args.base}", file=sys.stderr)
    base = run_worker(args.base.resolve(), specs, archs, args.work)
    print(f"new tree {args.tree}", file=sys.stderr)
    new = run_worker(args.tree.resolve(), specs, archs, args.work)
    failures = compare(base, new, archs, args.diff, tuple(args.removed))
    one_side = len(set(base) ^ set(new))
    print(f"{len(specs) - one_side} specs x {len(archs)} archs: {'all identical' if not failures else f'{failures} differ'}"
          + (f"; {one_side} specs in one tree only" if one_side else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
