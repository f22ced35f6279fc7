#!/bin/bash
# Fifth session first device call (2026-11-29): every GPU test at HEAD (cab859b), then the issue-target bench cases.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl .whl_fi/*.whl
mkdir -p /tmp/src && tar -xf .snap_lead/src.tar -C /tmp/src && cd /tmp/src
export PYTHONPATH=/tmp/src:/tmp/site PYTHONUNBUFFERED=1 JITATTN_CACHE_DIR=/tmp/jc
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; nvcc --version | tail -2;
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; cat .snap-commit; } > $OUT/device.txt 2>&1
T0=$(date +%s)
# Warm the kernel cache for the tests on 16 cores first (the tests then load, not compile).
JITATTN_GPU_RESULTS=$OUT/gpu_final.jsonl timeout 170 python3 -m pytest -m gpu tests/ -q -p no:cacheprovider > $OUT/pytest.log 2>&1; echo "tests rc=$? $(( $(date +%s)-T0 )) s"; tail -3 $OUT/pytest.log
timeout 150 python3 -m jitattn bench --case prefill-hd128-causal --case prefill-gemma2 --case decode-hd128 --case decode-gemma2 --case mixed --json $OUT/bench-a.json > $OUT/bench-a.log 2>&1; echo "bench-a rc=$? $(( $(date +%s)-T0 )) s"
timeout 70 python3 -m jitattn bench --case prefill-phi3 --case decode-gpt-oss-sliding-b256 --anchors sdpa,flex --json $OUT/bench-b.json > $OUT/bench-b.log 2>&1; echo "bench-b rc=$? $(( $(date +%s)-T0 )) s"
grep -h "^| " $OUT/bench-a.log $OUT/bench-b.log | grep -v "^| case\|^|---\|skipped" | cut -d'|' -f2,3,5,6,7 
