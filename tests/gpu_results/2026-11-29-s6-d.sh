#!/bin/bash
# Sixth session (2026-11-29): every GPU test at HEAD (cascade, explicit positions, the -inf sink fix), then
# gpt-oss sliding decode (finalize_state's new branch is on its path) and the cascade bench cases.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl .whl_fi/*.whl
mkdir -p /tmp/src && tar -xf .snap_lead/src.tar -C /tmp/src && cd /tmp/src
export PYTHONPATH=/tmp/src:/tmp/site PYTHONUNBUFFERED=1 JITATTN_CACHE_DIR=/tmp/jc
mkdir -p /tmp/logs
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv; cat .snap-commit; } > $OUT/device.txt 2>&1
T0=$(date +%s)
JITATTN_GPU_RESULTS=$OUT/gpu.jsonl timeout 260 python3 -m pytest -m gpu tests/ -q -p no:cacheprovider > /tmp/logs/pytest.log 2>&1; echo "tests rc=$? $(( $(date +%s)-T0 )) s"; tail -2 /tmp/logs/pytest.log; grep -E "^(FAILED|ERROR)" /tmp/logs/pytest.log | head -20
timeout 80 python3 -m jitattn bench --case decode-gpt-oss-sliding-b256 --case cascade --anchors '' --json $OUT/bench.json > /tmp/logs/bench.log 2>&1; echo "bench rc=$? $(( $(date +%s)-T0 )) s"
tar -cf $OUT/logs.tar -C /tmp logs
grep -h "^| " /tmp/logs/bench.log | grep -v "^| case\|^|---" | cut -d'|' -f2,3,5,6,7,8
