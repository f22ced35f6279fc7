#!/bin/bash
# #7 verification: runtime through the ctypes driver binding (jitattn/cuda_driver.py), no CuPy import.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
mkdir -p /tmp/src && tar -xf .snap_lead/src.tar -C /tmp/src && cd /tmp/src
export PYTHONPATH=/tmp/src:/tmp/site PYTHONUNBUFFERED=1 JITATTN_CACHE_DIR=/tmp/jc
unset PYTHONDONTWRITEBYTECODE
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; cat .snap-commit; echo "PYTHONDONTWRITEBYTECODE was: ${PDWB_WAS:-unset}"; } > $OUT/device.txt
python3 -c "import sys; print('dont_write_bytecode', sys.dont_write_bytecode)" >> $OUT/device.txt
python3 -m compileall -q /tmp/src/jitattn /tmp/site > /dev/null
T0=$(date +%s)
python3 -m jitattn warmup --spec '{"num_qo_heads":32,"num_kv_heads":8,"head_dim_qk":128}' --spec '{"num_qo_heads":32,"num_kv_heads":8,"head_dim_qk":128,"kv_dtype":"float8_e4m3fn"}' --arch sm_90a > $OUT/warmup.log 2>&1; echo "warmup rc=$? $(( $(date +%s)-T0 )) s"
for i in 1 2 3; do JITATTN_DISABLE_JIT=1 timeout 30 python3 - <<'PY' 2>&1 | tee $OUT/warm_load_$i.txt | head -2
import time
t_torch = time.perf_counter(); import torch; t0 = time.perf_counter()
import jitattn; from jitattn.runtime import load_kernel; t1 = time.perf_counter()
torch.empty(1, device="cuda"); torch.cuda.synchronize(); t2 = time.perf_counter()
k = load_kernel(jitattn.AttentionSpec(32, 8, 128)); torch.cuda.synchronize(); t3 = time.perf_counter()
k2 = load_kernel(jitattn.AttentionSpec(32, 8, 128, kv_dtype="float8_e4m3fn")); torch.cuda.synchronize(); t4 = time.perf_counter()
import sys
print(f"import jitattn {1e3*(t1-t0):.1f} ms | first kernel load {1e3*(t3-t2):.1f} ms | import+first {1e3*(t1-t0+t3-t2):.1f} ms | "
      f"second kernel {1e3*(t4-t3):.1f} ms | (import torch {1e3*(t0-t_torch):.0f} ms, CUDA init {1e3*(t2-t1):.0f} ms) | "
      f"cupy imported: {any(m.startswith('cupy') for m in sys.modules)}")
PY
done
JITATTN_DISABLE_JIT=1 timeout 30 python3 - > $OUT/warm_profile.txt 2>&1 <<'PY'
import cProfile, pstats, torch, jitattn
from jitattn.runtime import load_kernel
torch.empty(1, device="cuda"); torch.cuda.synchronize()
pr = cProfile.Profile(); pr.enable(); k = load_kernel(jitattn.AttentionSpec(32, 8, 128)); torch.cuda.synchronize(); pr.disable()
pstats.Stats(pr).sort_stats("cumulative").print_stats(20)
PY
python3 -c "import time; t=time.perf_counter(); import cuda.bindings.driver as d; print('cuda.bindings.driver import', round(1e3*(time.perf_counter()-t),1), 'ms')" >> $OUT/device.txt 2>&1
JITATTN_GPU_RESULTS=$OUT/kernels.jsonl timeout 230 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_kernels.py tests/test_gpu_merge.py tests/test_gpu_ragged.py tests/test_cuda_driver.py > $OUT/pytest.log 2>&1; echo "tests rc=$? $(( $(date +%s)-T0 )) s"; tail -3 $OUT/pytest.log
cat $OUT/device.txt
