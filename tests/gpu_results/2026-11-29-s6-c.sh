#!/bin/bash
# Sixth session (2026-11-29): cascade attention (#9) on the GPU: the explicit-position prefill kernels
# (tests/test_gpu_explicit_positions.py), the cascade against the un-split reference (tests/test_gpu_cascade.py),
# the rule sweep (tests/tune_cascade_rule.py) and the two cascade bench cases.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl .whl_fi/*.whl
mkdir -p /tmp/src && tar -xf .snap_lead/src.tar -C /tmp/src && cd /tmp/src
export PYTHONPATH=/tmp/src:/tmp/site PYTHONUNBUFFERED=1 JITATTN_CACHE_DIR=/tmp/jc JITATTN_TEST_CACHE=/tmp/jc
mkdir -p /tmp/logs
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv; cat .snap-commit; } > $OUT/device.txt 2>&1
T0=$(date +%s)
JITATTN_GPU_RESULTS=$OUT/gpu-cascade.jsonl timeout 240 python3 -m pytest -m gpu tests/test_gpu_cascade.py tests/test_gpu_explicit_positions.py -q -p no:cacheprovider --maxfail=20 > /tmp/logs/pytest.log 2>&1; echo "tests rc=$? $(( $(date +%s)-T0 )) s"; tail -3 /tmp/logs/pytest.log; grep -E "^(FAILED|ERROR)" /tmp/logs/pytest.log | head -10
timeout 150 python3 tests/tune_cascade_rule.py --json $OUT/rule.json > /tmp/logs/rule.log 2>&1; echo "rule rc=$? $(( $(date +%s)-T0 )) s"
timeout 90 python3 -m jitattn bench --case cascade --json $OUT/bench-cascade.json > /tmp/logs/bench.log 2>&1; echo "bench rc=$? $(( $(date +%s)-T0 )) s"
tar -cf $OUT/logs.tar -C /tmp logs
grep "^| " /tmp/logs/rule.log | awk -F'|' '{print $2,$3,$4,$7,$8}' | tr -s ' ' | head -90
grep -h "^| " /tmp/logs/bench.log | grep -v "^| case\|^|---" | cut -d'|' -f2,3,5,6,7,8,9
tail -5 /tmp/logs/rule.log
