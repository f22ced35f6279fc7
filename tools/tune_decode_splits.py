"""Time the decode bench cases at several split-KV factors, to choose JitKernel.num_splits' rule
(not a test; run on a GPU). Each split count is checked against the fp32 reference first.

    python3 tools/tune_decode_splits.py [--json PATH] [case-substring ...]

Prints, per case, graph-replay ms and TB/s at each split count, with the count the current rule
picks marked ``*``.
"""

from __future__ import annotations

import argparse
import json
import math


import jitattn
from jitattn import reference
from jitattn.bench.cases import all_cases
from jitattn.bench.harness import time_graph_ms
from jitattn.runtime import MAX_SPLITS, load_kernel
from jitattn.testing import random_paged_batch, relative_error

CANDIDATES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 33, 48, 64)
DEFAULT_CASES = ("decode-hd128-b64x4096-page16", "decode-hd128-b1x32768", "decode-gemma2-9b-b64x8192",
                 "decode-gpt-oss-sliding-b256x8192", "decode-hd128-b64x4096-page1",
                 "decode-mla-tp8-h16-b128x4096", "decode-mla-tp1-h128-b64x4096")  # MLA TP8: bf16 and FP8


def sweep(case) -> list[dict]:
    batch = random_paged_batch(case.spec, case.q_lens, case.kv_lens, device="cuda", seed=1)
    kernel = load_kernel(case.spec)
    ref = reference.paged_attention(case.spec, *batch.args(), **batch.kwargs())
    rule = kernel.num_splits(len(case.q_lens), kernel.max_decode_keys(batch.block_table.shape[1]))
    rows = []
    original = kernel.num_splits
    try:
        for s in sorted({*CANDIDATES, rule}):
            if s > MAX_SPLITS:
                continue
            kernel.num_splits = lambda b, n, s=s: s  # instance attribute shadows the method
            # a plan of its own per count: the one-call form would reuse the stream's last plan (same metadata)
            plan = jitattn.plan(case.spec, batch.block_table, batch.seq_lens, batch.query_start_loc, max_query_len=1)
            call = lambda plan=plan: jitattn.run(batch.q, batch.kv_cache, plan, **batch.kwargs())  # noqa: E731
            err = relative_error(call(), ref)
            ms = time_graph_ms(call)
            rows.append({"case": case.name, "splits": s, "rule": s == rule, "ms": ms,
                         "tb_s": batch.kv_bytes_read / 1e12 / (ms / 1e3), "rel_err": err})
    finally:
        kernel.num_splits = original
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("cases", nargs="*", default=list(DEFAULT_CASES))
    parser.add_argument("--json")
    args = parser.parse_args()
    results = []
    for case in all_cases():
        if case.is_decode and any(n in case.name for n in args.cases):
            rows = sweep(case)
            results += rows
            best = min(rows, key=lambda r: r["ms"])
            print(case.name)
            for r in rows:
                bad = "" if r["rel_err"] < 1e-2 and not math.isnan(r["rel_err"]) else "  WRONG"
                print(f"  splits {r['splits']:3d}{'*' if r['rule'] else ' '} {r['ms']:.4f} ms {r['tb_s']:.2f} TB/s"
                      f"{'  <- best' if r is best else ''}{bad}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
