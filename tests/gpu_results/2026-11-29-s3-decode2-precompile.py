import os, sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from jitattn.cache import KernelCache
from jitattn.bench import select_cases
specs = [c.spec for c in select_cases(["decode-gpt-oss-sliding-b256", "decode-hd128-b64x4096"], None)]
if sys.argv[2] == "tests":
    import tests.test_gpu_kernels as k, tests.test_gpu_integrations as i
    specs += [c.spec for c in k.CASES] + [m[1] for m in i.MATRIX] + i._hf_specs() + i.GRAPH_SPECS
cache = KernelCache(root=Path(sys.argv[1]), layers=())
specs = list(dict.fromkeys(specs))
print(len(specs), "specs")
with ThreadPoolExecutor(max_workers=os.cpu_count() or 4) as pool:
    list(pool.map(lambda s: cache.get_or_build(s, "sm_90a"), specs))
