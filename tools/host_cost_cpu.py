"""Host cost of jitattn's per-layer call on a CPU box, launching into a fake driver library.

What it isolates: the Python work of ``jitattn.run`` (with a plan) and of the one-call
``jitattn.paged_attention`` (checks, the plan reuse, packing ``Params``, the ctypes launch) on issue
18's decode probe and its mixed probe (2 prefill rows of 64 + 30 decode rows; on the CPU both kernels
go to one stream: the side-stream fork and join only exist on a GPU; one record-and-wait, two driver
calls, is a row of its own, and a fork plus its join make two), the one-call as the GPU bench calls it (no ``out``, no
``max_query_len``: both kernels), one layer of transformers' attention function on a ``PagedCache``
decode step (``update`` + :func:`jitattn.integrations.transformers.attention_forward`, batch 8, the step's
first layer planning it: µs per layer over a step of 4 layers, the bench's generate model), and of
``jitattn.append_kv`` on a decode step (64 tokens, 8 KV heads, hd128, bf16, NHD page 16: the memoised layout, and with the
memo cleared before each call), next to ``torch.add`` of two small tensors and ``index_copy_`` of
append_kv's bytes into a flat view of the cache, in one process. The kernels come from
``JitKernel.from_module`` / ``AppendKvKernel.from_module`` with the fixed geometry of
tests/launch_cases.py, over a module that launches through :class:`jitattn.cuda_driver.CudaDriver`
bound on tests/fake_cuda_driver.py's library (built with the C compiler; its ``cuLaunchKernelEx``
records and returns; without a compiler the launch is a no-op), so no GPU and no nvcc is needed;
append_kv takes its CPU tensors as a CUDA call's (the kernel's CPU refusal and the CPU-only
slot-value read dropped). The GPU figure (``jitattn bench --case host``) adds the driver's own launch
work, the context check and torch's stream lookup on top; this one tracks the Python side between
GPU sessions. (On the CPU ``index_copy_`` really moves its 262 KB; on a GPU it is one launch.)

Usage (from a checkout)::

    python tools/host_cost_cpu.py [--calls 2000] [--profile NAME]  (NAME: a row of the table)
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

torch.set_num_threads(1)  # the small CPU ops of one call: no thread pool to wake

import jitattn  # noqa: E402
from jitattn import append_kv_module, cuda_driver, kv_write, runtime  # noqa: E402
from jitattn.spec import AttentionSpec  # noqa: E402
from jitattn.testing import random_paged_batch  # noqa: E402
from tests import fake_cuda_driver, launch_cases as lc  # noqa: E402


class _NoLaunch:
    def launch(self, *args):
        pass


class _FakeDriverLaunch:
    """CubinModule's launch on the ctypes binding of a fake driver library (tests/fake_cuda_driver.py: its
    cuLaunchKernelEx records its arguments and returns), without the context check (no CUDA here)."""

    def __init__(self, drv: cuda_driver.CudaDriver):
        self._launch = drv.launch_kernel
        self.functions = {"decode": 0x7F0000001000, "prefill": 0x7F0000002000, "append_kv": 0x7F0000003000}

    def launch(self, kernel, grid, block, smem, params, stream):
        self._launch(self.functions[kernel], grid, (block, 1, 1), smem, stream, params)


def _fake_driver(directory: Path) -> cuda_driver.CudaDriver | None:
    lib = fake_cuda_driver.build(directory)
    return None if lib is None else cuda_driver.CudaDriver(str(lib))  # loaded: the file may go after


def _install_fake_kernels(drv: cuda_driver.CudaDriver | None) -> None:
    made: dict[str, runtime.JitKernel] = {}
    module = launcher = _NoLaunch() if drv is None else _FakeDriverLaunch(drv)

    def load(spec, device=None):
        if spec.canonical_text not in made:
            kernel = runtime.JitKernel.from_module(
                spec, module, lc.GEOMETRY, device=torch.device("cpu"), num_sms=lc.NUM_SMS,
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
            appenders[key] = kv_write.AppendKvKernel.from_module(module, launcher, device=torch.device("cpu"),
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


def _transformers_calls() -> dict:
    """One decode step of a PagedCache through transformers' attention function, per layer: Llama-3-8B's layer
    shape (32/8 heads, hd128) and Gemma-2-9B's (16/8, hd256, soft-cap 50, every other layer sliding over 4096),
    batch 8, :data:`STEP_LAYERS` layers a step (the step's first layer plans it). The backend is taken as
    "jit" (on the CPU the selector would pick sdpa / the reference); the caches hold 64 positions, the step's
    position alternates (so each step plans anew, as a real one does)."""
    try:
        from transformers import LlamaConfig
    except ImportError:
        return {}
    from jitattn.integrations import transformers as jt

    jt._backend = lambda *a: "jit"
    jt._runs_planned = lambda backend, query: True
    calls = {}
    for name, (heads, kv_heads, dim, softcap, window) in {"llama": (32, 8, 128, None, None),
                                                          "gemma-2": (16, 8, 256, 50.0, 4096)}.items():
        config = LlamaConfig(num_hidden_layers=STEP_LAYERS, num_attention_heads=heads, num_key_value_heads=kv_heads,
                             head_dim=dim, hidden_size=heads * dim)
        cache = jt.PagedCache(config, max_batch_size=8, max_cache_len=64)
        q = torch.randn(8, heads, 1, dim).to(torch.bfloat16)
        k, v = (torch.randn(8, kv_heads, 1, dim).to(torch.bfloat16) for _ in range(2))
        module = torch.nn.Module()
        module.is_causal = True
        windows = [window if window and i % 2 == 0 else None for i in range(STEP_LAYERS)]
        for layer in range(STEP_LAYERS):  # allocate the pages outside the timing
            cache.update(k, v, layer)
            jt.attention_forward(module, q, k, v, None, scaling=dim ** -0.5, softcap=softcap,
                                 sliding_window=windows[layer])
        state = {"step": 0}

        def step(cache=cache, q=q, k=k, v=v, module=module, windows=windows, dim=dim, softcap=softcap):
            state["step"] ^= 1
            for layer in cache.layers:
                layer.cumulative_length = 32 + state["step"]
            for i in range(STEP_LAYERS):
                key, value = cache.update(k, v, i)
                jt.attention_forward(module, q, key, value, None, scaling=dim ** -0.5, softcap=softcap,
                                     sliding_window=windows[i])

        calls[f"transformers layer, {name} decode b8 (per layer)"] = (step, STEP_LAYERS)
    return calls


#: Layers of a step in the transformers case (the bench's generate model has 4).
STEP_LAYERS = 4


def us_per_call(fn, calls: int, trials: int = 15) -> float:
    """Best of ``trials`` means over ``calls`` back-to-back calls, in µs (after a warm-up); many short
    trials, so that a shared machine's other work misses some of them."""
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
    parser.add_argument("--sort", default="tottime", help="the profile's order (pstats: tottime, cumulative)")
    parser.add_argument("--profile", help="a row's name: cProfile of that call, then the table")
    parser.add_argument("--count", action="store_true",
                        help="Python function calls per call of each row (cProfile's count: unlike the time, "
                             "the same on a busy machine), instead of the table")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="jitattn-fake-driver-") as directory:
        drv = _fake_driver(Path(directory))
    _install_fake_kernels(drv)
    # The decode probe of issue 18: 32/8 heads, hd128, page 16, batch 1, 512 keys.
    spec = AttentionSpec(32, 8, 128, page_size=16)
    b = random_paged_batch(spec, [1], [512], device="cpu")
    plan = jitattn.plan(spec, b.block_table, b.seq_lens, b.query_start_loc)
    out = torch.empty(1, 32, 128, dtype=torch.bfloat16)
    # The mixed probe: 2 sequences of 64 queries and 30 of one, 512 keys each.
    m = random_paged_batch(spec, [64] * 2 + [1] * 30, [512] * 32, device="cpu")
    mixed_plan = jitattn.plan(spec, m.block_table, m.seq_lens, m.query_start_loc)
    mixed_out = torch.empty(m.q.shape[0], 32, 128, dtype=torch.bfloat16)
    calls = {
        "run": lambda: jitattn.run(b.q, b.kv_cache, plan, out=out),
        "one-call": lambda: jitattn.paged_attention(spec, b.q, b.kv_cache, b.block_table, b.seq_lens,
                                                    b.query_start_loc, out=out, max_query_len=1),
        "one-call (no out, no max_query_len)": lambda: jitattn.paged_attention(spec, *b.args()),
        "run, mixed": lambda: jitattn.run(m.q, m.kv_cache, mixed_plan, out=mixed_out),
        "one-call, mixed": lambda: jitattn.paged_attention(spec, m.q, m.kv_cache, m.block_table, m.seq_lens,
                                                           m.query_start_loc, out=mixed_out, max_query_len=64),
        **_transformers_calls(),
        **_append_calls(),
        "torch.add": lambda: torch.add(out, out),
    }
    if drv is not None:  # the binding's per-layer calls alone, on the fake library
        params = bytes(plan.for_spec(None).layout.size)  # the probe's Params
        calls["driver: cuLaunchKernel"] = lambda: drv.launch_kernel(0x7F0000001000, (8, 2, 1), (128, 1, 1), 49152,
                                                                    lc.STREAM, params)
        calls["driver: cuEventRecord + cuStreamWaitEvent"] = lambda: drv.record_and_wait(0x5E0000000001, lc.STREAM,
                                                                                         lc.STREAM + 16)
    per = {name: (fn if isinstance(fn, tuple) else (fn, 1)) for name, fn in calls.items()}
    if args.profile:
        if args.profile not in per:
            parser.error(f"--profile {args.profile!r}: one of {sorted(per)}")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls // per[args.profile][1]):
            per[args.profile][0]()
        prof.disable()
        pstats.Stats(prof).sort_stats(args.sort).print_stats(30)
    if args.count:
        print("| call | Python function calls per call |\n|---|---|")
        for name, (fn, n) in per.items():
            fn()
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(max(1, 200 // n)):
                fn()
            prof.disable()
            total = sum(v[1] for v in pstats.Stats(prof).stats.values())  # primitive + recursive calls
            print(f"| {name} | {total / (max(1, 200 // n) * n):.1f} |")
        return
    launch = "the fake driver's cuLaunchKernelEx" if drv is not None else "launch a no-op"
    print(f"| call | µs per call (CPU, {launch}) |\n|---|---|")
    for name, (fn, n) in per.items():
        print(f"| {name} | {us_per_call(fn, max(1, args.calls // 5 // n)) / n:.1f} |")


if __name__ == "__main__":
    main()
