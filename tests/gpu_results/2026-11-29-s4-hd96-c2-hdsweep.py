"""Times jitattn prefill (paged, page 16, causal, bf16, 32/8 heads, 4 x 4096) at several head dims and
prints one line per case: `hd<D> <label> <TFLOP/s> <graph ms>`. argv: label, head dims..., [--sdpa]."""
import sys
from jitattn import AttentionSpec
from jitattn.bench import BenchCase, run_case

label = sys.argv[1]
anchors = ("sdpa",) if "--sdpa" in sys.argv else ()
for hd in [int(a) for a in sys.argv[2:] if a.isdigit()]:
    case = BenchCase(f"prefill-hd{hd}-causal-b4x4096", AttentionSpec(32, 8, hd), [4096] * 4, [4096] * 4, "prefill")
    for r in run_case(case, check=False, anchors=anchors):
        print(f"SWEEP hd{hd} {label if r.impl == 'jitattn' else r.impl} {r.rate:.1f} {r.graph_ms:.3f} {r.note}", flush=True)
