#!/bin/bash
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl .whl_fi/*.whl
rm -rf /tmp/src; mkdir -p /tmp/src && tar -xf .snap_lead/src.tar -C /tmp/src && cd /tmp/src
export PYTHONPATH=/tmp/src:/tmp/site PYTHONUNBUFFERED=1 JITATTN_CACHE_DIR=/tmp/jc
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; cat .snap-commit; } > $OUT/device.txt 2>&1
T0=$(date +%s)
JITATTN_GPU_RESULTS=$OUT/gpu_final.jsonl timeout 400 python3 -m pytest -m gpu tests/ -q -p no:cacheprovider > $OUT/pytest.log 2>&1; echo "tests rc=$? $(( $(date +%s)-T0 )) s"; tail -25 $OUT/pytest.log | grep -v "^SKIPPED"
