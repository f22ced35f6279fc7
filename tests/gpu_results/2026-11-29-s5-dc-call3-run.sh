#!/bin/bash
set -u
exec > >(tee $OUT/log3.txt) 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl .whl_fi/*.whl > /dev/null 2>&1
mkdir -p /tmp/off /tmp/ovl; tar -xf .snap_dc/src.tar -C /tmp/off; tar -xf .snap_dc/src.tar -C /tmp/ovl
sed -i 's/^#define JITATTN_MERGE_OVERLAP 0/#define JITATTN_MERGE_OVERLAP 1/' /tmp/ovl/templates/decode.cuh; grep -c "^#define JITATTN_MERGE_OVERLAP 1" /tmp/ovl/templates/decode.cuh
export PYTHONUNBUFFERED=1; T0=$(date +%s)
cd /tmp/ovl; echo "== tests, merge overlap on"
PYTHONPATH=/tmp/ovl:/tmp/site JITATTN_CACHE_DIR=/tmp/jc_ovl JITATTN_GPU_RESULTS=$OUT/t3_ovl.jsonl timeout 40 python3 -m pytest -m gpu tests/test_gpu_kernels.py -k "splitkv or 32768 or graph" -q -p no:cacheprovider 2>&1 | tail -3
echo "t=$(( $(date +%s) - T0 ))"
for t in off ovl off ovl; do cd /tmp/$t; PYTHONPATH=/tmp/$t:/tmp/site JITATTN_CACHE_DIR=/tmp/jc_$t timeout 25 python3 -m jitattn bench --case decode-hd128-b1x32768 --anchors '' --no-check --json $OUT/b3_$t.json 2>&1 | grep "^| decode" | awk -F'|' -v t=$t '{print t, $2, $5, $6}'; done
echo "t=$(( $(date +%s) - T0 ))"
