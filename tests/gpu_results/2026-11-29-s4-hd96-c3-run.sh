#!/bin/bash
# hd96 helper, device call 3: ragged (contiguous varlen) K/V on prefill_sm90: GPU tests (kernels +
# ragged files), then the hd128 paged-vs-ragged bench case (jitattn only).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl .whl_fi/*.whl 2>/dev/null
rm -rf /tmp/src; mkdir -p /tmp/src && tar -xf .snap_hd96/src.tar -C /tmp/src && cd /tmp/src
export PYTHONPATH=/tmp/src:/tmp/site PYTHONUNBUFFERED=1 JITATTN_CACHE_DIR=/tmp/jc3
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; cat $OLDPWD/.snap_hd96/commit.txt; } > $OUT/device.txt 2>&1
T0=$(date +%s); L=$OUT/log.txt
JITATTN_GPU_RESULTS=$OUT/kernels.jsonl timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_kernels.py tests/test_gpu_ragged.py > $OUT/pytest.txt 2>&1; echo "tests rc=$? $(( $(date +%s)-T0 )) s"; grep -E "FAILED|ERROR|passed|failed" $OUT/pytest.txt | cut -c1-200 | tail -25
echo "= R" >> $L; timeout 50 python3 -m jitattn bench --case prefill-hd128-causal-b4x8192-vs-ragged --anchors '' --json $OUT/bench-R.json >> $L 2>&1; echo "R bench rc=$? $(( $(date +%s)-T0 )) s"
grep -h "^| prefill\|^= " $L | cut -c1-170
