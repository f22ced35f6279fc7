#!/bin/bash
# Sixth session (2026-11-29), after the last read of the change: every GPU test at HEAD (runtime's
# _launch_prefill, sequence_ok's single return, the checks / cascade / testing refactors).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl .whl_fi/*.whl
mkdir -p /tmp/src && tar -xf .snap_lead/src.tar -C /tmp/src && cd /tmp/src
export PYTHONPATH=/tmp/src:/tmp/site PYTHONUNBUFFERED=1 JITATTN_CACHE_DIR=/tmp/jc
{ date -u; cat .snap-commit; } > $OUT/device.txt 2>&1
T0=$(date +%s)
JITATTN_GPU_RESULTS=$OUT/gpu.jsonl timeout 260 python3 -m pytest -m gpu tests/ -q -p no:cacheprovider > $OUT/pytest.log 2>&1; echo "tests rc=$? $(( $(date +%s)-T0 )) s"; tail -1 $OUT/pytest.log; grep -E "^(FAILED|ERROR)" $OUT/pytest.log | head
