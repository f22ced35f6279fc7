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
    lines = [f"{len(rows)} tests: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())),
             f"max relative error vs fp32 reference: {max(errs):.2e} (over {len(errs)} kernel-vs-reference cases)"
             if errs else "", "", "| test | outcome | rel err | lse max abs err | splits |", "|---|---|---|---|---|"]
    for r in rows:
        name = r["test"].split("::")[-1]
        rel = f"{r['rel_err']:.2e}" if "rel_err" in r else "-"
        lse = f"{r['lse_max_abs_err']:.1e}" if "lse_max_abs_err" in r else "-"
        lines.append(f"| {name} | {r['outcome']} | {rel} | {lse} | {r.get('splits', '-')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(sys.argv[1]))
