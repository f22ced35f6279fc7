"""Run one (variant, case) of tools/tune_decode_variants.py three times, for ncu (not a test; GPU).

    ncu -k regex:jitattn_decode -s 2 -c 1 python3 tools/ncu_decode_variant.py ROOT VARIANT CASE
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tune_decode_variants as tv  # noqa: E402
from jitattn import runtime  # noqa: E402
from jitattn.testing import random_paged_batch  # noqa: E402

root, variant, case = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
spec, b, n = tv.CASES[case]
tv.use(root, variant)
batch = random_paged_batch(spec, [1] * b, [n] * b, device="cuda", seed=1)
k = runtime.load_kernel(spec)
for _ in range(3):
    k.paged_attention(*batch.args(), **batch.kwargs(), max_query_len=1)
torch.cuda.synchronize()
