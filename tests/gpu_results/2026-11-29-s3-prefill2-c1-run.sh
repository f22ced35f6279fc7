#!/bin/bash
# prefill helper 2, device call 1: persistent prefill_sm90 (P: tests + bench with anchors) and HEAD control (H: bench).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
mkdir -p /tmp/P /tmp/H && tar -xf .snap_prefill2/new.tar -C /tmp/P && tar -xf .snap_prefill2/head.tar -C /tmp/H
export PYTHONUNBUFFERED=1
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; cat /tmp/P/.snap-commit; } > $OUT/device.txt 2>&1
T0=$(date +%s); L=$OUT/log.txt
HD="--case prefill-hd128-causal-b4x8192"; GE="--case prefill-gemma2"
cd /tmp/P
echo "= P tests" >> $L
PYTHONPATH=/tmp/P:/tmp/site JITATTN_CACHE_DIR=/tmp/jcP JITATTN_GPU_RESULTS=$OUT/kernels-P.jsonl timeout 75 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_kernels.py >> $L 2>&1; echo "P tests rc=$? $(( $(date +%s)-T0 )) s"; tail -1 $L
echo "= P bench" >> $L
PYTHONPATH=/tmp/P:/tmp/site JITATTN_CACHE_DIR=/tmp/jcP timeout 75 python3 -m jitattn bench $HD $GE --anchors sdpa,flex --json $OUT/bench-P.json >> $L 2>&1; echo "P bench rc=$? $(( $(date +%s)-T0 )) s"
cd /tmp/H
echo "= H bench" >> $L
PYTHONPATH=/tmp/H:/tmp/site JITATTN_CACHE_DIR=/tmp/jcH timeout 35 python3 -m jitattn bench $HD $GE --anchors '' --json $OUT/bench-H.json >> $L 2>&1; echo "H bench rc=$? $(( $(date +%s)-T0 )) s"
grep -h "^| prefill\|^=\|passed\|failed\|Error\|error" $L | grep -v "skipped:" | cut -c1-160 | tail -40
