#!/bin/bash
# prefill helper, device call 2: split K/V barriers + cp.async mbarrier arrivals (V2); V2 with overlap at
# two stages (V2o, hd256); V2 + ping-pong (V2p); the committed 7d5b454 kernel as control (Ac).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
mkdir -p /tmp/src && tar -xf .snap_prefill/src.tar -C /tmp/src && cd /tmp/src
export PYTHONPATH=/tmp/src:/tmp/site PYTHONUNBUFFERED=1 JITATTN_CACHE_DIR=/tmp/jc
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; cat .snap-commit; } > $OUT/device.txt 2>&1
T0=$(date +%s); L=$OUT/log.txt
H=templates/prefill_sm90.cuh
cp $H /tmp/V2.cuh
sed 's/&& T::kStages >= 3;/\&\& T::kStages >= 2;/' /tmp/V2.cuh > /tmp/V2o.cuh
sed 's/constexpr bool kPrefillSm90PingPong = false;/constexpr bool kPrefillSm90PingPong = true;/' /tmp/V2.cuh > /tmp/V2p.cuh
grep -q "kStages >= 2;" /tmp/V2o.cuh || echo "V2o sed failed"; grep -q "PingPong = true" /tmp/V2p.cuh || echo "V2p sed failed"
HD="--case prefill-hd128-causal-b4x8192"; GE="--case prefill-gemma2"
JITATTN_GPU_RESULTS=$OUT/kernels-V2.jsonl timeout 90 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_kernels.py >> $L 2>&1; echo "V2 tests rc=$? $(( $(date +%s)-T0 )) s"; tail -1 $L
echo "= V2" >> $L; timeout 110 python3 -m jitattn bench $HD $GE --anchors sdpa,flex --json $OUT/bench-V2.json >> $L 2>&1; echo "V2 bench rc=$? $(( $(date +%s)-T0 )) s"
cp /tmp/V2o.cuh $H
echo "= V2o" >> $L; timeout 40 python3 -m jitattn bench $GE --anchors '' --json $OUT/bench-V2o.json >> $L 2>&1; echo "V2o bench rc=$? $(( $(date +%s)-T0 )) s"
JITATTN_GPU_RESULTS=$OUT/kernels-V2o.jsonl timeout 80 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_kernels.py >> $L 2>&1; echo "V2o tests rc=$? $(( $(date +%s)-T0 )) s"; tail -1 $L
cp /tmp/V2p.cuh $H
echo "= V2p" >> $L; timeout 40 python3 -m jitattn bench $HD --anchors '' --json $OUT/bench-V2p.json >> $L 2>&1; echo "V2p bench rc=$? $(( $(date +%s)-T0 )) s"
cp .snap_prefill_head.cuh $H
echo "= Ac" >> $L; timeout 50 python3 -m jitattn bench $HD $GE --anchors '' --json $OUT/bench-Ac.json >> $L 2>&1; echo "Ac bench rc=$? $(( $(date +%s)-T0 )) s"
cp /tmp/V2.cuh $H
grep -h "^| prefill\|^=\|passed\|failed" $L | grep -v skipped | cut -c1-150
