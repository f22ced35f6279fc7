"""Launch one call of selected bench cases, for Nsight Compute (not a test; run on a GPU).

    ncu --clock-control none --kernel-name regex:jitattn_ --section SpeedOfLight \
        --section Occupancy --section WarpStateStats python3 tools/profile_kernels.py decode-gpt-oss prefill-hd128
"""

from __future__ import annotations

import sys

import torch

from jitattn.bench.cases import all_cases
from jitattn.runtime import load_kernel
from jitattn.testing import random_paged_batch


def main(names: list[str]) -> None:
    for case in all_cases():
        if not any(n in case.name for n in names):
            continue
        batch = random_paged_batch(case.spec, case.q_lens, case.kv_lens, device="cuda")
        kernel = load_kernel(case.spec)
        kernel.paged_attention(*batch.args(), **batch.kwargs(), max_query_len=1 if case.is_decode else None)
        torch.cuda.synchronize()
        print("ran", case.name, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
