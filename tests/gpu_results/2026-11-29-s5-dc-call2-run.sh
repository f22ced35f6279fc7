#!/bin/bash
set -u
exec > >(tee $OUT/log2.txt) 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl .whl_fi/*.whl 2>&1 | tail -2
mkdir -p /tmp/src2; tar -xf .snap_dc/src.tar -C /tmp/src2; cd /tmp/src2
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/src2:/tmp/site JITATTN_CACHE_DIR=/tmp/jc_src2
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
T0=$(date +%s)
echo "== tests, balanced forced (non-inlined pieces)"
JITATTN_DECODE_BALANCED=1 JITATTN_GPU_RESULTS=$OUT/t2_bal.jsonl timeout 150 python3 -m pytest -m gpu tests/test_gpu_kernels.py tests/test_gpu_fp8.py tests/test_gpu_merge.py -q -p no:cacheprovider 2>&1 | tail -6
echo "t=$(( $(date +%s) - T0 ))"
C="--case decode-hd128 --case decode-gpt-oss-sliding-b256"
echo "== bench balanced=1"; JITATTN_DECODE_BALANCED=1 timeout 80 python3 -m jitattn bench $C --anchors '' --no-check --json $OUT/b2_bal1.json > /tmp/b1.log 2>&1; tail -2 /tmp/b1.log
echo "== bench balanced=0"; JITATTN_DECODE_BALANCED=0 timeout 80 python3 -m jitattn bench $C --anchors '' --no-check --json $OUT/b2_bal0.json > /tmp/b0.log 2>&1; tail -2 /tmp/b0.log
echo "== bench auto + sdpa anchors"; timeout 150 python3 -m jitattn bench $C --anchors sdpa --json $OUT/b2_auto.json > /tmp/ba.log 2>&1; tail -2 /tmp/ba.log
echo "t=$(( $(date +%s) - T0 ))"
for f in b1 b0 ba; do echo "-- $f"; grep "^| " /tmp/$f.log | grep -v "^| case\|---\|skipped" | awk -F'|' '{print $2,$3,$5,$6,$7}'; done
