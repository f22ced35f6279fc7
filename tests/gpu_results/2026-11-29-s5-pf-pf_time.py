# Times one bench case's jitattn kernel in this tree (PYTHONPATH), compares its output with a saved one.
import sys, statistics, time, torch
from jitattn.bench import all_cases, time_ms
from jitattn.runtime import load_kernel
from jitattn.testing import random_paged_batch
tag, name, ref = sys.argv[1], sys.argv[2], sys.argv[3]
case = next(c for c in all_cases() if c.name == name)
b = random_paged_batch(case.spec, case.q_lens, case.kv_lens, device="cuda")
k = load_kernel(case.spec)
fn = lambda: k.paged_attention(*b.args(), **b.kwargs())
out = fn(); torch.cuda.synchronize()
if tag == "base":
    torch.save(out, ref)
    err = 0.0
else:
    r = torch.load(ref)
    err = ((out.float() - r.float()).norm() / r.float().norm()).item()
ms = [time_ms(fn, warmup=3, rep=10, trials=5) for _ in range(3)]
print(f"RES {tag:10s} {name:32s} ms {' '.join(f'{m:.3f}' for m in ms)}  TFLOP/s {b.flops/1e12/(statistics.median(ms)/1e3):.1f}  err_vs_base {err:.2e}", flush=True)
