"""Time MLA decode template variants side by side in one process (not a test; run on a GPU).

Each variant is a copy of templates/ with text of mla_decode_sm90.cuh replaced (``prepare`` writes them, on any
machine; ``jitattn.render.template_dir`` is pointed at each copy in turn when its kernels load, so their cache
keys differ). Every (variant, case) of the bench's MLA cases (:func:`jitattn.bench.cases.mla_cases`: TP8 bf16,
TP1 bf16, TP8 FP8) is checked against the fp32 reference on its first 4 sequences, then timed by CUDA-graph
replay in interleaved rounds. A variant that wins still needs ``pytest -m gpu tests/test_gpu_mla.py`` on its
templates before it replaces mla_decode_sm90.cuh.

    python3 tools/tune_mla_variants.py prepare DIR            # variant template copies under DIR
    python3 tools/tune_mla_variants.py build DIR              # compile them (sm_90a) into JITATTN_CACHE_DIR
    python3 tools/tune_mla_variants.py time DIR [--json PATH] # on the GPU
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jitattn.render as _render  # noqa: E402
from tune_decode_variants import time_rounds, use  # noqa: E402  (tools/ is this script's directory)

HEADER = "mla_decode_sm90.cuh"
CHECK_SEQS = 4  # sequences checked against the reference per case

# "tiles-in-flight": the 64-row kernel (the TP1 shape) waits for tile j before it issues tile j + 1, so one
# tile's copies are in flight at a time; here tile j + 2 is issued as soon as tile j's stage is read (a second
# barrier per tile), so two are in flight while a tile waits. The question it answers: is the TP1 shape bound by
# its copies' latency (BENCHMARKS.md History, 2026-12-07 02:05, has the figures behind it)?
_PROLOGUE = """\
  if (lo < hi) loader.load(p, stage(0), lo, hi, bad);
  cp_async_commit();
  loader.fetch(p, batch, lo + T::kTileKeys, hi);
"""
_TOP = """\
    cp_async_wait<0>();
    fence_proxy_async();  // this thread's cp.async writes, read next by wgmma (the async proxy)
    __syncthreads();      // the tile (and Q) landed; every thread is done with the previous tile
    {
      const int next = start + T::kTileKeys;
      if (next < hi) loader.load(p, stage((it + 1) % 2), next, hi, bad);
      cp_async_commit();
      loader.fetch(p, batch, next + T::kTileKeys, hi);
    }
"""
_END = """\
      wgmma_commit();
      wgmma_wait<0>();
      wgmma_fence_operands(o);
    }
  }
  cp_async_wait<0>();
"""
TILES_IN_FLIGHT = [
    (_PROLOGUE, _PROLOGUE + """\
  if (lo + T::kTileKeys < hi) loader.load(p, stage(1), lo + T::kTileKeys, hi, bad);
  cp_async_commit();
  loader.fetch(p, batch, lo + 2 * T::kTileKeys, hi);
"""),
    (_TOP, """\
    cp_async_wait<1>();   // tile `it` (and Q) landed; tile it + 1 may still be in flight
    fence_proxy_async();  // this thread's cp.async writes, read next by wgmma (the async proxy)
    __syncthreads();
"""),
    (_END, _END.replace("    }\n  }\n", """\
    }
    __syncthreads();  // every thread is done with this stage: it refills with tile it + 2
    {
      const int next = start + 2 * T::kTileKeys;
      if (next < hi) loader.load(p, stage(it % 2), next, hi, bad);
      cp_async_commit();
      loader.fetch(p, batch, next + T::kTileKeys, hi);
    }
  }
""")),
]
# The swapped-operand kernel's S^T k-steps whose A fragments load together at 16 rows (12 today), FP8 cache only
# (18 spills 40 bytes on sm_90a).
_KGROUP = "  static constexpr int kKGroup = kRows == 16 ? 12 : kFp8Cache ? 4 : 6;"

#: variant -> [(old, new)] replacements in mla_decode_sm90.cuh; "base" is the templates as they are.
VARIANTS: dict[str, list[tuple[str, str]]] = {
    "base": [],
    "tiles-in-flight": TILES_IN_FLIGHT,
    "fp8-kgroup-6": [(_KGROUP, _KGROUP.replace("kRows == 16 ? 12", "kRows == 16 ? (kFp8Cache ? 6 : 12)"))],
}


def prepare(root: Path) -> None:
    """Write each variant's template copy under ``root``; every replaced text must occur exactly once."""
    src = _render.template_dir()
    for name, edits in VARIANTS.items():
        dst = root / name
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst)
        path = dst / HEADER
        text = path.read_text()
        for old, new in edits:
            if text.count(old) != 1:
                raise SystemExit(f"variant {name}: expected the text once in {HEADER}, found it {text.count(old)} "
                                 f"times: {old[:80]!r}")
            text = text.replace(old, new)
        path.write_text(text)


def cases() -> dict:
    from jitattn.bench.cases import mla_cases
    return {c.name: c for c in mla_cases()}


def build(root: Path) -> None:
    """Compile every (variant, case) for sm_90a into the cache (no GPU), printing registers and spills."""
    from jitattn.cache import KernelCache
    cache = KernelCache()
    for name in VARIANTS:
        use(root, name)
        for case in cases().values():
            entry, built = cache.get_or_build(case.spec, "sm_90a")
            log = (getattr(entry, "manifest", None) or {}).get("compiler_log", "")
            regs = re.findall(r"Used (\d+) registers", log)
            spills = re.findall(r"(\d+) bytes spill stores", log)
            print(name, case.name, "built" if built else "cached", "registers", regs, "spill stores", spills, flush=True)


def time_all(root: Path, out: str | None, rounds: int) -> None:
    from jitattn import reference, runtime
    from jitattn.bench.mla import new_out
    from jitattn.testing import random_paged_batch, relative_error

    batches, refs = {}, {}
    for n, c in cases().items():
        b = batches[n] = random_paged_batch(c.spec, c.q_lens, c.kv_lens, device="cuda", seed=1)
        qsl = b.query_start_loc[: CHECK_SEQS + 1]
        rows = int(qsl[-1])
        refs[n] = rows, reference.paged_attention(c.spec, b.q[:rows], b.kv_cache, b.block_table[:CHECK_SEQS],
                                                  b.seq_lens[:CHECK_SEQS], qsl, **b.kwargs())
    runs = []
    for name in VARIANTS:
        use(root, name)
        runtime._KERNELS.clear()
        for n, c in cases().items():
            b = batches[n]
            plan = runtime.plan(c.spec, b.block_table, b.seq_lens, b.query_start_loc, max_query_len=max(c.q_lens))

            def call(plan=plan, b=b, o=new_out(c.spec, b)):
                return runtime.run(b.q, b.kv_cache, plan, out=o, **b.kwargs())
            rows, ref = refs[n]
            runs.append({"variant": name, "case": n, "err": relative_error(call()[:rows], ref), "call": call, "ms": []})
    time_rounds(runs, rounds)
    print("| variant | case | ms (median of rounds) | min | rel err |")
    for r in runs:
        print(f"| {r['variant']} | {r['case']} | {r['ms_median']:.4f} | {r['ms_min']:.4f} | {r['err']:.2e} |", flush=True)
        del r["call"]
    if out:
        Path(out).write_text(json.dumps(runs, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["prepare", "build", "time"])
    ap.add_argument("root")
    ap.add_argument("--json")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    root = Path(a.root)
    if a.what == "prepare":
        prepare(root)
    elif a.what == "build":
        build(root)
    else:
        time_all(root, a.json, a.rounds)


if __name__ == "__main__":
    sys.exit(main())
