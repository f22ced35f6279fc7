"""One prefill and one decode step of every attention layer kind of Gemma-2-9B and gpt-oss-20b.

On a CUDA GPU each layer kind's spec runs through jitattn's kernels
(``jitattn.runtime.load_kernel(spec).paged_attention``, compiled on first use or loaded from the
cache) and the script prints the error against the fp32 reference (``jitattn.reference``) and the
kernel time. Without a GPU it says why and runs the reference path alone, on the CPU.

    python examples/run_models.py                        # both models
    python examples/run_models.py examples/models/gemma-3-1b.json

Inputs are fresh random paged batches (``jitattn.testing.random_paged_batch``): the prefill step is
a chunk of new tokens after a cached prefix plus a whole prompt, the decode step one new token for
sequences of mixed lengths, some longer than the sliding window; none a multiple of the page size.
Exit code 1 when an error is above the bf16 / fp16 tolerance.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

from jitattn import reference
from jitattn.models import load_model_config
from jitattn.testing import PagedBatch, random_paged_batch, relative_error

MODELS = Path(__file__).resolve().parent / "models"
DEFAULT_CONFIGS = (MODELS / "gemma-2-9b.json", MODELS / "gpt-oss-20b.json")
#: (phase, query lengths, KV lengths): sequence b brings q_lens[b] queries and reads kv_lens[b] keys.
STEPS = (
    ("prefill", [700, 333], [5000, 333]),
    ("decode", [1] * 8, [4500, 17, 1000, 4097, 333, 8000, 1, 2049]),
)
TOLERANCE = {"bfloat16": 1e-2, "float16": 5e-3}  # relative error (norm-wise) against the fp32 reference


def gpu_problem() -> str | None:
    """Why the kernels cannot run here, or None."""
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    return None


def time_ms(fn, device: str, reps: int = 5) -> float:
    """Median milliseconds of ``fn()`` after one warm-up call (CUDA events on a GPU)."""
    fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run_step(batch: PagedBatch, device: str) -> dict:
    """Reference (and, on a GPU, the kernel) on one batch: errors and times."""
    spec = batch.spec
    t0 = time.perf_counter()
    ref_out, ref_lse = reference.paged_attention(spec, *batch.args(), **batch.kwargs(), return_lse=True)
    if device == "cuda":
        torch.cuda.synchronize()
    row = {"ref_ms": (time.perf_counter() - t0) * 1e3}
    if device != "cuda":
        return row
    from jitattn.runtime import load_kernel

    kernel = load_kernel(spec)
    out, lse = kernel.paged_attention(*batch.args(), **batch.kwargs(), return_lse=True)
    torch.cuda.synchronize()
    finite = torch.isfinite(ref_lse)
    row.update(
        max_abs_err=(out.float() - ref_out.float()).abs().max().item(),
        rel_err=relative_error(out, ref_out),
        lse_err=(lse[finite] - ref_lse[finite]).abs().max().item() if finite.any() else 0.0,
        ms=time_ms(lambda: kernel.paged_attention(*batch.args(), **batch.kwargs()), device),
        arch=kernel.entry.arch,
    )
    return row


def main(argv: list[str]) -> int:
    configs = [Path(a) for a in argv] or list(DEFAULT_CONFIGS)
    problem = gpu_problem()
    device = "cpu" if problem else "cuda"
    if problem:
        print(f"No GPU here ({problem}): running the reference path only, on the CPU.\n")
    else:
        print(f"GPU: {torch.cuda.get_device_name()}; jitattn kernels against the fp32 reference.\n")
    header = f"{'model':<14} {'layer kind':<18} {'step':<8} {'q / kv tokens':>14}"
    header += f" {'max abs err':>12} {'rel err':>9} {'lse err':>9} {'kernel ms':>10} {'ref ms':>9}" if not problem \
        else f" {'ref ms':>9}"
    print(header)
    failed = 0
    for config in configs:
        model = load_model_config(config)
        for kind in model.layer_kinds:
            for seed, (phase, q_lens, kv_lens) in enumerate(STEPS):
                batch = random_paged_batch(kind.spec, q_lens, kv_lens, device=device, seed=seed)
                row = run_step(batch, device)
                line = f"{config.stem:<14} {kind.name:<18} {phase:<8} {f'{sum(q_lens)} / {sum(kv_lens)}':>14}"
                if problem:
                    print(f"{line} {row['ref_ms']:>9.1f}")
                    continue
                bad = not row["rel_err"] < TOLERANCE[kind.spec.q_dtype]
                failed += bad
                print(f"{line} {row['max_abs_err']:>12.2e} {row['rel_err']:>9.2e} {row['lse_err']:>9.2e} "
                      f"{row['ms']:>10.3f} {row['ref_ms']:>9.1f}" + ("  <- above tolerance" if bad else ""))
    if failed:
        print(f"\n{failed} step(s) above tolerance {TOLERANCE}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
