#!/bin/bash
# prefill helper, device call 1: intra-warpgroup overlap in prefill_sm90.cuh (A), + ping-pong (B), HEAD (C).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
mkdir -p /tmp/src && tar -xf .snap_prefill/src.tar -C /tmp/src && cd /tmp/src
export PYTHONPATH=/tmp/src:/tmp/site PYTHONUNBUFFERED=1 JITATTN_CACHE_DIR=/tmp/jc
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; cat .snap-commit; } > $OUT/device.txt 2>&1
T0=$(date +%s)
H=templates/prefill_sm90.cuh
cp $H /tmp/A.cuh
sed 's/constexpr bool kPrefillSm90PingPong = false;/constexpr bool kPrefillSm90PingPong = true;/' /tmp/A.cuh > /tmp/B.cuh
grep -q "kPrefillSm90PingPong = true" /tmp/B.cuh || echo "B sed failed"
B="--case prefill-hd128-causal --case prefill-gemma2"
# A: overlap, ping-pong off (the committed candidate): GPU tests, then the bench with anchors.
JITATTN_GPU_RESULTS=$OUT/kernels-A.jsonl timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_kernels.py > $OUT/pytest-A.log 2>&1; echo "A tests rc=$? $(( $(date +%s)-T0 )) s"; tail -3 $OUT/pytest-A.log
timeout 120 python3 -m jitattn bench $B --anchors sdpa,flex --json $OUT/bench-A.json > $OUT/bench-A.log 2>&1; echo "A bench rc=$? $(( $(date +%s)-T0 )) s"
# B: overlap + ping-pong.
cp /tmp/B.cuh $H
timeout 60 python3 -m jitattn bench $B --anchors '' --json $OUT/bench-B.json > $OUT/bench-B.log 2>&1; echo "B bench rc=$? $(( $(date +%s)-T0 )) s"
JITATTN_GPU_RESULTS=$OUT/kernels-B.jsonl timeout 90 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_kernels.py > $OUT/pytest-B.log 2>&1; echo "B tests rc=$? $(( $(date +%s)-T0 )) s"; tail -2 $OUT/pytest-B.log
# C: HEAD's kernel (no overlap), as the control of this call.
cp .snap_prefill_head.cuh $H
timeout 60 python3 -m jitattn bench $B --anchors '' --json $OUT/bench-C.json > $OUT/bench-C.log 2>&1; echo "C bench rc=$? $(( $(date +%s)-T0 )) s"
cp /tmp/A.cuh $H
for v in A B C; do echo "== $v"; grep -h "^| prefill" $OUT/bench-$v.log | grep -v skipped | cut -c1-150; done
