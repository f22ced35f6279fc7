#!/bin/bash
# prefill helper, device call 3: F = 7d5b454 without the consumer-side proxy fence after each full-barrier
# wait (the producer fences before arriving); G = split K/V barriers with one consumer fence per round;
# A = 7d5b454 as control.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
mkdir -p /tmp/src && tar -xf .snap_prefill/src.tar -C /tmp/src && cd /tmp/src
export PYTHONPATH=/tmp/src:/tmp/site PYTHONUNBUFFERED=1 JITATTN_CACHE_DIR=/tmp/jc
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; cat .snap-commit; } > $OUT/device.txt 2>&1
T0=$(date +%s); L=$OUT/log.txt; H=templates/prefill_sm90.cuh
HD="--case prefill-hd128-causal-b4x8192"; GE="--case prefill-gemma2"
cp .snap_prefill_F.cuh $H
JITATTN_GPU_RESULTS=$OUT/kernels-F.jsonl timeout 80 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_kernels.py >> $L 2>&1; echo "F tests rc=$? $(( $(date +%s)-T0 )) s"; tail -1 $L
echo "= F" >> $L; timeout 100 python3 -m jitattn bench $HD $GE --anchors sdpa,flex --json $OUT/bench-F.json >> $L 2>&1; echo "F bench rc=$? $(( $(date +%s)-T0 )) s"
cp .snap_prefill_G.cuh $H
JITATTN_GPU_RESULTS=$OUT/kernels-G.jsonl timeout 45 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_kernels.py >> $L 2>&1; echo "G tests rc=$? $(( $(date +%s)-T0 )) s"; tail -1 $L
echo "= G" >> $L; timeout 30 python3 -m jitattn bench $HD --anchors '' --json $OUT/bench-G.json >> $L 2>&1; echo "G bench rc=$? $(( $(date +%s)-T0 )) s"
grep -h "^| prefill\|^=\|passed\|failed" $L | grep -v skipped | cut -c1-150
