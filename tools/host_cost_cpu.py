"""Host cost of jitattn's per-layer call on a CPU box, with the launch itself replaced by a no-op.

What it isolates: the Python work of ``jitattn.run`` (with a plan) and of the one-call
``jitattn.paged_attention`` (checks, the plan reuse, packing ``Params``), and of ``jitattn.append_kv``
on a decode step (64 tokens, 8 KV heads, hd128, bf16, NHD page 16: the memoised layout, and with the
memo cleared before each call), next to ``torch.add`` of two small tensors and ``index_copy_`` of
append_kv's bytes into a flat view of the cache, in one process. The kernels come from
``JitKernel.from_module`` / ``AppendKvKernel.from_module`` over a module whose ``launch`` does
nothing, with the fixed geometry of tests/launch_cases.py, so no GPU and no nvcc is needed; append_kv
takes its CPU tensors as a CUDA call's (the kernel's CPU refusal and the CPU-only slot-value read
dropped). The GPU figure (``jitattn bench --case host``) adds ``cuLaunchKernel`` and torch's stream
lookup on top; this one tracks the Python side between GPU sessions. (On the CPU ``index_copy_``
really moves its 262 KB; on a GPU it is one launch.)

Usage (from a checkout)::

    python tools/host_cost_cpu.py [--calls 2000] [--profile run|one-call|append_kv]
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
from jitattn import append_kv_module, kv_write, runtime  # noqa: E402
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

    appenders: dict[tuple[str, str], kv_write.AppendKvKernel] = {}

    def load_append(dtype, kv_dtype, device=None):
        module = append_kv_module.AppendKvModule(str(dtype), str(kv_dtype))
        key = (module.dtype, module.kv_dtype)
        if key not in appenders:
            appenders[key] = kv_write.AppendKvKernel.from_module(module, _NoLaunch(), device=torch.device("cpu"),
                                                                 stream_handle=lambda: lc.STREAM)
        return appenders[key]

    reasons = kv_write.kernel_reasons
    kv_write.load_append_kv_kernel = load_append
    kv_write.kernel_reasons = lambda *a: [r for r in reasons(*a) if "needs CUDA tensors" not in r]
    kv_write._check_slot_values = lambda *a: None  # a CUDA slot_mapping's values are never read (a sync)


def _append_calls() -> dict:
    """append_kv of issue 19's decode step, memoised and not, and index_copy_ of its bytes (K and V rows
    stacked, their flat row indices made once)."""
    tokens, heads, dim, page = 64, 8, 128, 16
    cache = torch.zeros(tokens * 4, 2, page, heads, dim, dtype=torch.bfloat16)
    k, v = (torch.randn(tokens, heads, dim).to(torch.bfloat16) for _ in range(2))
    slots = torch.arange(tokens) * 4 * page + 3  # each sequence's next slot, one page per sequence apart
    rows = (slots // page) * 2 * page + slots % page  # K's row of the cache seen as (pages * 2 * page, H, D)
    flat, src, index = cache.view(-1, heads, dim), torch.cat([k, v]), torch.cat([rows, rows + page])

    def unmemoised():
        kv_write.clear_launch_memo()
        jitattn.append_kv(k, v, cache, slots)

    return {"append_kv": lambda: jitattn.append_kv(k, v, cache, slots), "append_kv (memo cleared)": unmemoised,
            "index_copy_ (append_kv's bytes)": lambda: flat.index_copy_(0, index, src)}


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
    parser.add_argument("--profile", choices=("run", "one-call", "append_kv"))
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
        **_append_calls(),
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
