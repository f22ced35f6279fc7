"""A warm load in a fresh process: ``python -m jitattn.bench.warm_load SPEC_JSON`` prints one JSON line.

Run by :func:`jitattn.bench.compile_figures.warm_load` with ``JITATTN_DISABLE_JIT=1`` on a cache
that holds the spec's kernel. The line's milliseconds: ``import_ms`` (torch, jitattn and
jitattn.runtime), ``jitattn_import_ms`` (of those, jitattn's part), ``cuda_init_ms`` (the CUDA
context), ``load_ms`` (:func:`jitattn.runtime.load_kernel` and a synchronize) and ``reload_ms`` (the
same module loaded again in this process: the per-kernel cost alone); ``entry``: the cache entry.
The imports are timed, so they happen inside :func:`measure`, not at the top of this module.
``python -m`` imports the packages above this module first (``jitattn``'s top level and
``jitattn.bench``'s, neither of which imports torch or the runtime): their milliseconds count in the
caller's total only.
"""

import json
import sys
import time


def measure(spec_json: str) -> dict:
    """The figures above for the spec given as canonical JSON (:meth:`AttentionSpec.canonical_json`)."""
    t0 = time.perf_counter()
    import torch
    tt = time.perf_counter()
    import jitattn  # already imported by `python -m` (light: the spec and variant modules)
    from jitattn.runtime import load_kernel
    t1 = time.perf_counter()
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    kernel = load_kernel(jitattn.AttentionSpec.from_json(spec_json))
    torch.cuda.synchronize()
    t3 = time.perf_counter()
    type(kernel)(kernel.spec, kernel.device)  # a second module load: the per-kernel part alone
    torch.cuda.synchronize()
    t4 = time.perf_counter()
    return {"import_ms": (t1 - t0) * 1e3, "jitattn_import_ms": (t1 - tt) * 1e3, "cuda_init_ms": (t2 - t1) * 1e3,
            "load_ms": (t3 - t2) * 1e3, "reload_ms": (t4 - t3) * 1e3, "entry": str(kernel.entry.path)}


if __name__ == "__main__":
    print(json.dumps(measure(sys.argv[1])))
