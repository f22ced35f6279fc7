"""Summarise a GPU test run (the JSON lines tests/conftest.py writes) as markdown, for GPU_TESTS.md.

    python -m tests.gpu_report results/gpu-tests.jsonl
"""

from __future__ import annotations

import json
import sys
from collections import Counter


def report(path: str) -> str:
    rows = [json.loads(line) for line in open(path)]
    counts = Counter(r["outcome"] for r in rows)
    errs = [r["rel_err"] for r in rows if "rel_err" in r]
    sessions = sorted({r["session_seed"] for r in rows if "session_seed" in r})
    unseeded = sum("seed" not in r for r in rows)
    lines = [f"{len(rows)} tests: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())),
             f"max relative error vs fp32 reference: {max(errs):.2e} (over {len(errs)} kernel-vs-reference cases)"
             if errs else "",
             f"session seed(s): {', '.join(map(str, sessions)) or 'none recorded'} (JITATTN_TEST_SEED=<seed> replays "
             f"the inputs)" + (f"; {unseeded} lines without a seed" if unseeded else ""),
             "", "| test | outcome | rel err | lse max abs err | splits | seed |", "|---|---|---|---|---|---|"]
    for r in rows:
        name = r["test"].split("::")[-1]
        rel = f"{r['rel_err']:.2e}" if "rel_err" in r else "-"
        lse = f"{r['lse_max_abs_err']:.1e}" if "lse_max_abs_err" in r else "-"
        lines.append(f"| {name} | {r['outcome']} | {rel} | {lse} | {r.get('splits', '-')} | {r.get('seed', '-')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(sys.argv[1]))
