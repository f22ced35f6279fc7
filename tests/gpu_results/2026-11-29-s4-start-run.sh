#!/bin/bash
# Session 4 first device call (2026-11-29): every GPU test at HEAD, then the decode-hd128 bench cases.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl .whl_fi/*.whl
mkdir -p /tmp/src && tar -xf .snap_lead/src.tar -C /tmp/src && cd /tmp/src
export PYTHONPATH=/tmp/src:/tmp/site PYTHONUNBUFFERED=1 JITATTN_CACHE_DIR=/tmp/jc
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; nvcc --version | tail -2;
  python3 -c "import torch; print('torch', torch.__version__)"; cat .snap-commit; } > $OUT/device.txt 2>&1
T0=$(date +%s)
JITATTN_GPU_RESULTS=$OUT/gpu_s4a.jsonl timeout 250 python3 -m pytest -m gpu tests/ -q -p no:cacheprovider > $OUT/pytest.log 2>&1; echo "tests rc=$? $(( $(date +%s)-T0 )) s"; tail -4 $OUT/pytest.log
timeout 150 python3 -m jitattn bench --case decode-hd128 --json $OUT/bench-a.json > $OUT/bench-a.log 2>&1; echo "bench-a rc=$? $(( $(date +%s)-T0 )) s"
grep -h "^| " $OUT/bench-a.log | grep -v "^| case\|^|---\|skipped" | cut -c1-150
