"""Measure when cascade attention pays (not a test; run on a GPU): the cascade against the plain decode
call over a grid of (R requests, P shared prefix keys, s suffix keys), hd128 32/8 heads bf16, page 16.

Both by CUDA-graph replay in one process; the cascade planned ahead (jitattn.cascade.plan_cascade), the
plain call reading the shared prefix pages from every request's table (prefix caching's layout).

    python3 tools/tune_cascade_rule.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from jitattn import AttentionSpec
from jitattn.bench.harness import time_graph_ms
from jitattn.cascade import cascade_attention, cascade_pays, plain_metadata, plan_cascade
from jitattn.runtime import load_kernel
from jitattn.testing import random_cascade_batch, relative_error

GRID_R = (2, 4, 8, 16, 32, 64, 128)
GRID_P = (256, 1024, 4096, 8192)
GRID_S = (64, 512, 2048)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    a = ap.parse_args()
    spec = AttentionSpec(32, 8, 128)
    kernel = load_kernel(spec)
    load_kernel(spec.replace(query_positions="explicit"))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    print("| R | P | s | plain ms | cascade ms | speedup | rule says | err |")
    for r in GRID_R:
        for p in GRID_P:
            for s in GRID_S:
                cb = random_cascade_batch(spec, [p], [r], [s] * r, [1] * r, device="cuda", seed=r + p + s)
                args = (cb.q, cb.kv_cache, *plain_metadata(spec, cb.levels, r))
                plan = plan_cascade(spec, cb.levels, r, num_sms=sms)
                plain = lambda: kernel.paged_attention(*args, max_query_len=1)  # noqa: E731
                casc = lambda: cascade_attention(spec, cb.q, cb.kv_cache, cb.levels, plan=plan)  # noqa: E731
                err = relative_error(casc(), plain())
                tp, tc = time_graph_ms(plain), time_graph_ms(casc)
                row = {"R": r, "P": p, "s": s, "plain_ms": tp, "cascade_ms": tc, "speedup": tp / tc,
                       "rule": cascade_pays(r, p, s), "err": err, "states": plan.num_states}
                rows.append(row)
                print(f"| {r} | {p} | {s} | {tp:.4f} | {tc:.4f} | {tp / tc:.2f} | {row['rule']} | {err:.1e} |",
                      flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
