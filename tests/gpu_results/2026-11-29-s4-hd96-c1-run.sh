#!/bin/bash
# hd96 helper, device call 1: GPU tests of the new prefill_sm90 (every head dim multiple of 16), then
# bench phi3 hd96 + hd128 (anchors sdpa, flex), then hd96 tile variants (sed on the header) phi3 only.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl .whl_fi/*.whl
mkdir -p /tmp/src && tar -xf .snap_hd96/src.tar -C /tmp/src && cd /tmp/src
export PYTHONPATH=/tmp/src:/tmp/site PYTHONUNBUFFERED=1 JITATTN_CACHE_DIR=/tmp/jc
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; cat $OLDPWD/.snap_hd96/commit.txt; } > $OUT/device.txt 2>&1
T0=$(date +%s); L=$OUT/log.txt
H=templates/prefill_sm90.cuh; cp $H /tmp/A.cuh
sed 's/static constexpr int kStages = kMaxStages < 3 ? 2 : 3;/static constexpr int kStages = kMaxStages < 3 ? 2 : kHeadDim == 96 ? 4 : 3;/' /tmp/A.cuh > /tmp/st4.cuh
sed 's/static constexpr int kBlockN = kHeadDim <= 128 ? 128 : 64;/static constexpr int kBlockN = kHeadDim == 96 ? 160 : kHeadDim <= 128 ? 128 : 64;/' /tmp/A.cuh > /tmp/n160.cuh
sed -e 's/static constexpr int kConsumerWGs = 2;/static constexpr int kConsumerWGs = kHeadDim == 96 ? 3 : 2;/' \
    -e 's/static constexpr int kProducerRegs = 40;/static constexpr int kProducerRegs = kConsumerWGs == 3 ? 32 : 40;/' \
    -e 's/static constexpr int kConsumerRegs = 232;/static constexpr int kConsumerRegs = kConsumerWGs == 3 ? 160 : 232;/' \
    -e 's/static constexpr int kBlockN = kHeadDim <= 128 ? 128 : 64;/static constexpr int kBlockN = kHeadDim == 96 ? 96 : kHeadDim <= 128 ? 128 : 64;/' /tmp/A.cuh > /tmp/wg3n96.cuh
for v in st4 n160 wg3n96; do cmp -s /tmp/$v.cuh /tmp/A.cuh && echo "sed $v failed"; done
JITATTN_GPU_RESULTS=$OUT/kernels.jsonl timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_kernels.py tests/test_gpu_ragged.py > $OUT/pytest.txt 2>&1; echo "tests rc=$? $(( $(date +%s)-T0 )) s"; grep -E "FAILED|ERROR|passed|failed" $OUT/pytest.txt | cut -c1-200 | tail -25
echo "= A" >> $L; timeout 120 python3 -m jitattn bench --case prefill-phi3 --case prefill-hd128-causal-b4x8192 --anchors sdpa,flex --json $OUT/bench-A.json >> $L 2>&1; echo "A bench rc=$? $(( $(date +%s)-T0 )) s"
for v in st4 n160 wg3n96; do
  cp /tmp/$v.cuh $H
  echo "= $v" >> $L; timeout 45 python3 -m jitattn bench --case prefill-phi3 --anchors '' --json $OUT/bench-$v.json >> $L 2>&1; echo "$v bench rc=$? $(( $(date +%s)-T0 )) s"
done
cp /tmp/A.cuh $H
grep -h "^| prefill\|^= \|rel err\|error" $L | cut -c1-170
