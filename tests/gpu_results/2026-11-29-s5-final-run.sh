#!/bin/bash
# Fifth session's final device call (2026-11-29): every GPU test at HEAD, the issue-target bench cases,
# then the 16-bit decode with JITATTN_DECODE_MMA_LOADER=1 (a copy of the tree with that default flipped):
# test_gpu_kernels.py on it and the decode-hd128 cases beside cuDNN.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl .whl_fi/*.whl
mkdir -p /tmp/src && tar -xf .snap_lead/src.tar -C /tmp/src
cp -r /tmp/src /tmp/var && sed -i 's/^#define JITATTN_DECODE_MMA_LOADER 0$/#define JITATTN_DECODE_MMA_LOADER 1/' /tmp/var/templates/decode_mma.cuh
echo "variant switch lines: $(grep -c '^#define JITATTN_DECODE_MMA_LOADER 1$' /tmp/var/templates/decode_mma.cuh)"
cd /tmp/src
export PYTHONPATH=/tmp/src:/tmp/site PYTHONUNBUFFERED=1 JITATTN_CACHE_DIR=/tmp/jc
mkdir -p /tmp/logs
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; nvcc --version | tail -2;
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; cat .snap-commit; } > $OUT/device.txt 2>&1
T0=$(date +%s)
JITATTN_GPU_RESULTS=$OUT/gpu_final.jsonl timeout 170 python3 -m pytest -m gpu tests/ -q -p no:cacheprovider > /tmp/logs/pytest.log 2>&1; echo "tests rc=$? $(( $(date +%s)-T0 )) s"; tail -2 /tmp/logs/pytest.log; grep -E "^(FAILED|ERROR)" /tmp/logs/pytest.log | head -20
timeout 150 python3 -m jitattn bench --case prefill-hd128-causal --case prefill-gemma2 --case decode-hd128 --case decode-gemma2 --case mixed --json $OUT/bench-a.json > /tmp/logs/bench-a.log 2>&1; echo "bench-a rc=$? $(( $(date +%s)-T0 )) s"
( cd /tmp/var && PYTHONPATH=/tmp/var:/tmp/site JITATTN_CACHE_DIR=/tmp/jcv JITATTN_GPU_RESULTS=$OUT/var-tests.jsonl timeout 120 python3 -m pytest -m gpu tests/test_gpu_kernels.py -q -p no:cacheprovider > /tmp/logs/var-pytest.log 2>&1; echo "var tests rc=$? $(( $(date +%s)-T0 )) s"; tail -1 /tmp/logs/var-pytest.log; grep -E "^(FAILED|ERROR)" /tmp/logs/var-pytest.log | head
  PYTHONPATH=/tmp/var:/tmp/site JITATTN_CACHE_DIR=/tmp/jcv timeout 80 python3 -m jitattn bench --case decode-hd128 --anchors sdpa --json $OUT/var-bench.json > /tmp/logs/var-bench.log 2>&1; echo "var bench rc=$? $(( $(date +%s)-T0 )) s" )
timeout 70 python3 -m jitattn bench --case prefill-phi3 --case decode-gpt-oss-sliding-b256 --anchors sdpa,flex --json $OUT/bench-b.json > /tmp/logs/bench-b.log 2>&1; echo "bench-b rc=$? $(( $(date +%s)-T0 )) s"
tar -cf $OUT/logs.tar -C /tmp logs
echo "== default tree"; grep -h "^| " /tmp/logs/bench-a.log /tmp/logs/bench-b.log | grep -v "^| case\|^|---\|skipped" | cut -d'|' -f2,3,5,6,7
echo "== JITATTN_DECODE_MMA_LOADER=1"; grep -h "^| " /tmp/logs/var-bench.log | grep -v "^| case\|^|---\|skipped" | cut -d'|' -f2,3,5,6,7
