#!/bin/bash
# Sixth session (2026-11-29), after the final call: explicit_twin made once per spec (host time of an eager
# cascade call). The cascade GPU tests and the cascade bench cases at HEAD.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl .whl_fi/*.whl
mkdir -p /tmp/src && tar -xf .snap_lead/src.tar -C /tmp/src && cd /tmp/src
export PYTHONPATH=/tmp/src:/tmp/site PYTHONUNBUFFERED=1 JITATTN_CACHE_DIR=/tmp/jc
{ date -u; cat .snap-commit; } > $OUT/device.txt 2>&1
T0=$(date +%s)
JITATTN_GPU_RESULTS=$OUT/gpu.jsonl timeout 150 python3 -m pytest -m gpu tests/test_gpu_cascade.py -q -p no:cacheprovider > $OUT/pytest.log 2>&1; echo "tests rc=$? $(( $(date +%s)-T0 )) s"; tail -1 $OUT/pytest.log
timeout 60 python3 -m jitattn bench --case cascade --anchors '' --json $OUT/bench.json > $OUT/bench.log 2>&1; echo "bench rc=$? $(( $(date +%s)-T0 )) s"
grep -h "^| cascade" $OUT/bench.log | cut -d'|' -f2,3,4,5,6,7
