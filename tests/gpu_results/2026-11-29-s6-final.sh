#!/bin/bash
# Sixth session's final device call (2026-11-29): every GPU test at HEAD (the breaker's fixes, transform_pair,
# rule_shape), then the issue-target bench cases and the cascade cases.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl .whl_fi/*.whl
mkdir -p /tmp/src && tar -xf .snap_lead/src.tar -C /tmp/src && cd /tmp/src
export PYTHONPATH=/tmp/src:/tmp/site PYTHONUNBUFFERED=1 JITATTN_CACHE_DIR=/tmp/jc
mkdir -p /tmp/logs
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; nvcc --version | tail -2;
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; cat .snap-commit; } > $OUT/device.txt 2>&1
T0=$(date +%s)
JITATTN_GPU_RESULTS=$OUT/gpu_final.jsonl timeout 260 python3 -m pytest -m gpu tests/ -q -p no:cacheprovider > /tmp/logs/pytest.log 2>&1; echo "tests rc=$? $(( $(date +%s)-T0 )) s"; tail -2 /tmp/logs/pytest.log; grep -E "^(FAILED|ERROR)" /tmp/logs/pytest.log | head -20
timeout 150 python3 -m jitattn bench --case prefill-hd128-causal --case prefill-gemma2 --case decode-hd128 --case decode-gemma2 --case mixed --json $OUT/bench-a.json > /tmp/logs/bench-a.log 2>&1; echo "bench-a rc=$? $(( $(date +%s)-T0 )) s"
timeout 90 python3 -m jitattn bench --case prefill-phi3 --case decode-gpt-oss-sliding-b256 --case cascade --anchors sdpa,flex --json $OUT/bench-b.json > /tmp/logs/bench-b.log 2>&1; echo "bench-b rc=$? $(( $(date +%s)-T0 )) s"
tar -cf $OUT/logs.tar -C /tmp logs
grep -h "^| " /tmp/logs/bench-a.log /tmp/logs/bench-b.log | grep -v "^| case\|^|---\|skipped" | cut -d'|' -f2,3,5,6,7
