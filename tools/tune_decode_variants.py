"""Time decode template variants side by side in one process (not a test; run on a GPU).

Each variant is a copy of templates/ with some of decode_mma.cuh's JITATTN_* switches set
(``prepare`` writes them, on any machine; ``jitattn.render.template_dir`` is pointed at each copy in
turn when its kernels load, so their cache keys differ). Every (variant, case) is checked against the
fp32 reference, then timed by CUDA-graph replay in interleaved rounds.

    python3 tools/tune_decode_variants.py prepare DIR            # variant template copies under DIR
    python3 tools/tune_decode_variants.py build DIR              # compile them into JITATTN_CACHE_DIR
    python3 tools/tune_decode_variants.py time DIR [--json PATH] # on the GPU
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

import jitattn.render as _render
from jitattn.spec import AttentionSpec

# case name -> (spec, batch, kv_len)
CASES = {f"hd{d}-b64x4096": (AttentionSpec(32, 8, d), 64, 4096) for d in (128, 72, 88, 40, 104)}
CASES.update({f"hd{d}-b64x4096-hnd": (AttentionSpec(32, 8, d, kv_layout="HND"), 64, 4096) for d in (72, 88)})
# variant -> (switches, cases, split overrides {case: [splits]}); "base" is --base-templates as they are.
# A switch whose name holds "=>" replaces text in the first of common.cuh / decode.cuh / decode_mma.cuh that
# holds it instead: "old=>new" (value unused).
# The L2 prefetch-size hint (cp.async .L2::128B / 256B): the tensor-core decode's K/V tile copies at padded
# head dims take .L2::128B (issue 21: an NHD piece of 144 / 176 bytes shares DRAM sectors with the next
# head's). "l2-128" / "l2-256" put the hint on every other 16-byte copy too, the next question (hd128 was equal
# at 128 and 9% slower at 256 on 2026-12-06). Earlier variants (packed rows, stages, swizzle, merge batching,
# Gemma-2 tiles, FP8, tail) are in BENCHMARKS.md's history.
_CP16 = 'asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\\n"'
_CASES = ["hd128-b64x4096", "hd72-b64x4096", "hd88-b64x4096", "hd72-b64x4096-hnd", "hd88-b64x4096-hnd"]


def _l2_prefetch(size: int) -> dict:
    return {f"{_CP16}=>{_CP16.replace('.global [', f'.global.L2::{size}B [')}": 1}


VARIANTS = {
    "base": ({}, _CASES, {}),
    "l2-128": (_l2_prefetch(128), _CASES, {}),
    "l2-256": (_l2_prefetch(256), _CASES, {}),
}
DIAG = ("JITATTN_DIAG_",)


def prepare(root: Path, base_templates: Path | None) -> None:
    src = _render.template_dir()
    for name, (switches, _, _) in VARIANTS.items():
        dst = root / name
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(base_templates if (name == "base" and base_templates) else src, dst)
        if name == "base":
            continue
        apply(dst, switches)


def apply(dst: Path, switches: dict) -> None:
    """Set a variant's switches in the template copy at ``dst`` (common.cuh / decode.cuh / decode_mma.cuh)."""
    for macro, value in switches.items():
        if "=>" in macro:
            a, b = macro.split("=>")
            path = next(f for f in (dst / "common.cuh", dst / "decode.cuh", dst / "decode_mma.cuh") if a in f.read_text())
            path.write_text(path.read_text().replace(a, b, 1))
            continue
        hits = 0
        for path in (dst / "common.cuh", dst / "decode.cuh", dst / "decode_mma.cuh"):
            text = path.read_text()
            if value is None:  # a diagnostic #ifdef switch: defined at the top of the header
                text, n = text.replace("#pragma once\n", f"#pragma once\n#define {macro}\n", 1), 1
            else:
                text, n = re.subn(rf"^#define {re.escape(macro)} .+$", f"#define {macro} {value}", text, flags=re.M)
            path.write_text(text)
            hits += n
        assert hits >= 1, (dst, macro)


def use(root: Path, name: str) -> None:
    d = root / name
    _render.template_dir = lambda d=d: d


def build(root: Path) -> None:
    from jitattn.cache import KernelCache
    cache = KernelCache()
    for name, (_, cases, _) in VARIANTS.items():
        use(root, name)
        for spec in {CASES[c][0] for c in cases}:
            entry, built = cache.get_or_build(spec, "sm_90a")
            log = entry.manifest.get("compiler_log", "") if hasattr(entry, "manifest") else ""
            regs = re.findall(r"Function properties for jitattn_decode\s*\n\s*(.*)\n.*Used (\d+) registers", log)
            print(name, spec.name if hasattr(spec, "name") else spec, "built" if built else "cached", regs, flush=True)


def cudnn_anchor_runs(cases: set[str]) -> list[dict]:
    """torch SDPA's cuDNN backend on each case's shape (dense random q, K, V in q's dtype), timed in the
    same rounds as the variants: the ratio's denominator."""
    import torch
    from torch.nn.attention import SDPBackend
    from jitattn.backends.sdpa import dense_attention_fn
    from jitattn.dtypes import torch_dtype

    runs = []
    for c in sorted(cases):
        spec, b, n = CASES[c]
        fn = dense_attention_fn(spec, sdp_backend=SDPBackend.CUDNN_ATTENTION)
        dt = torch_dtype(spec.q_dtype)
        q = torch.randn(b, spec.num_qo_heads, 1, spec.head_dim_qk, device="cuda", dtype=dt)
        k = torch.randn(b, spec.num_kv_heads, n, spec.head_dim_qk, device="cuda", dtype=dt)
        v = torch.randn(b, spec.num_kv_heads, n, spec.head_dim_vo, device="cuda", dtype=dt)
        runs.append({"variant": "sdpa-cudnn", "case": c, "splits": 0, "rule": True, "err": 0.0, "blocks_per_sm": 0,
                     "call": lambda fn=fn, q=q, k=k, v=v: fn(q, k, v), "ms": []})
    return runs


def time_rounds(runs: list[dict], rounds: int) -> None:
    """Each run's ``call`` timed by graph replay (ms) in ``rounds`` interleaved rounds: its ``ms`` list, then
    ``ms_median`` and ``ms_min``."""
    import torch
    from jitattn.bench.harness import time_graph_ms

    torch.cuda.synchronize()
    for _ in range(rounds):
        for r in runs:
            r["ms"].append(time_graph_ms(r["call"]))
    for r in runs:
        r.update(ms_median=sorted(r["ms"])[len(r["ms"]) // 2], ms_min=min(r["ms"]))


def time_all(root: Path, out: str | None, rounds: int) -> None:
    from jitattn import reference, runtime
    from jitattn.testing import random_paged_batch, relative_error

    batches, refs = {}, {}
    for c, (spec, b, n) in CASES.items():
        batches[c] = random_paged_batch(spec, [1] * b, [n] * b, device="cuda", seed=1)
        refs[c] = reference.paged_attention(spec, *batches[c].args(), **batches[c].kwargs())
    runs = []  # (variant, case, splits, call)
    for name, (_, cases, splits) in VARIANTS.items():
        use(root, name)
        runtime._KERNELS.clear()
        for c in cases:
            batch = batches[c]
            k = runtime.load_kernel(CASES[c][0])
            rule = k.num_splits(batch.q.shape[0], k.max_decode_keys(batch.block_table.shape[1]))
            # the kernel merges at most runtime.MAX_SPLITS partial states (kMaxSplits): 66 forced past it
            # gave rel err 0.18 on 2026-11-29 (the rule never goes past it)
            for s in [None, *(x for x in splits.get(c, []) if x <= runtime.MAX_SPLITS)]:
                # a plan of its own per split count (the one-call form would reuse the stream's last plan)
                if s is not None:
                    k.num_splits = lambda b, n, s=s: s
                try:
                    plan = k.plan(batch.block_table, batch.seq_lens, batch.query_start_loc, max_query_len=1)
                finally:
                    if s is not None:
                        del k.num_splits

                def call(plan=plan, batch=batch):
                    return runtime.run(batch.q, batch.kv_cache, plan, **batch.kwargs())
                err = relative_error(call(), refs[c])
                runs.append({"variant": name, "case": c, "splits": s or rule, "rule": s is None, "err": err,
                             "blocks_per_sm": k._decode_blocks_per_sm, "call": call, "ms": []})
    runs += cudnn_anchor_runs({r["case"] for r in runs})
    time_rounds(runs, rounds)
    print("| variant | case | splits | blk/SM | ms (median of rounds) | min | TB/s | rel err |")
    for r in runs:
        spec, b, n = CASES[r["case"]]
        kv = batches[r["case"]].kv_bytes_read
        ms = r["ms_median"]
        r.update(tb_s=kv / 1e12 / (ms / 1e3))
        print(f"| {r['variant']} | {r['case']} | {r['splits']}{'' if r['rule'] else ' (forced)'} | {r['blocks_per_sm']} | "
              f"{ms:.4f} | {min(r['ms']):.4f} | {r['tb_s']:.2f} | {r['err']:.2e} |")
        del r["call"]
    if out:
        Path(out).write_text(json.dumps(runs, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["prepare", "build", "time"])
    ap.add_argument("root")
    ap.add_argument("--base-templates")
    ap.add_argument("--json")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    root = Path(a.root)
    if a.what == "prepare":
        prepare(root, Path(a.base_templates) if a.base_templates else None)
    elif a.what == "build":
        build(root)
    else:
        time_all(root, a.json, a.rounds)


if __name__ == "__main__":
    sys.exit(main())
