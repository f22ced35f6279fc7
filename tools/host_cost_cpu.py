"""Host cost of jitattn's per-layer call on a CPU box, with the launch itself replaced by a no-op.

What it isolates: the Python work of ``jitattn.run`` (with a plan) and of the one-call
``jitattn.paged_attention`` (checks, the plan reuse, packing ``Params``), next to ``torch.add`` of two
small tensors, in one process. The kernels come from ``JitKernel.from_module`` over a module whose
``launch`` does nothing, with the fixed geometry of tests/launch_cases.py, so no GPU and no nvcc is
needed. The GPU figure (``jitattn bench --case host``) adds ``cuLaunchKernel`` and torch's stream
lookup on top; this one tracks the Python side between GPU sessions.

Usage (from a checkout)::

    python tools/host_cost_cpu.py [--calls 2000] [--profile run|one-call]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import jitattn  # noqa: E402
from jitattn import runtime  # noqa: E402
from jitattn.spec import AttentionSpec  # noqa: E402
from jitattn.testing import random_paged_batch  # noqa: E402
from tests import launch_cases as lc  # noqa: E402


class _NoLaunch:
    def launch(self, *args):
        pass


def _install_fake_kernels() -> None:
    made: dict[str, runtime.JitKernel] = {}

    def load(spec, device=None):
        if spec.canonical_text not in made:
            kernel = runtime.JitKernel.from_module(
                spec, _NoLaunch(), lc.GEOMETRY, device=torch.device("cpu"), num_sms=lc.NUM_SMS,
                decode_blocks_per_sm=lc.DECODE_BLOCKS_PER_SM, stream_handle=lambda: lc.STREAM)
            kernel.mixed_on_two_streams = False  # the CPU has no streams to fork
            made[spec.canonical_text] = kernel
        return made[spec.canonical_text]

    runtime.load_kernel = load


def us_per_call(fn, calls: int, trials: int = 3) -> float:
    """Best of ``trials`` means over ``calls`` back-to-back calls, in µs (after a warm-up)."""
    for _ in range(200):
        fn()
    best = float("inf")
    for _ in range(trials):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--profile", choices=("run", "one-call"))
    args = parser.parse_args()
    _install_fake_kernels()
    # The decode probe of issue 18: 32/8 heads, hd128, page 16, batch 1, 512 keys.
    spec = AttentionSpec(32, 8, 128, page_size=16)
    b = random_paged_batch(spec, [1], [512], device="cpu")
    plan = jitattn.plan(spec, b.block_table, b.seq_lens, b.query_start_loc)
    out = torch.empty(1, 32, 128, dtype=torch.bfloat16)
    calls = {
        "run": lambda: jitattn.run(b.q, b.kv_cache, plan, out=out),
        "one-call": lambda: jitattn.paged_attention(spec, b.q, b.kv_cache, b.block_table, b.seq_lens,
                                                    b.query_start_loc, out=out, max_query_len=1),
        "torch.add": lambda: torch.add(out, out),
    }
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            calls[args.profile]()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    print("| call | µs per call (CPU, launch a no-op) |\n|---|---|")
    for name, fn in calls.items():
        print(f"| {name} | {us_per_call(fn, args.calls):.1f} |")


if __name__ == "__main__":
    main()
