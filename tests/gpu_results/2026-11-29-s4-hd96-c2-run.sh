#!/bin/bash
# hd96 helper, device call 2: GPU tests of a91f370 (three consumer warpgroups at hd 32/48/80/96/112),
# bench Phi-3 (anchors sdpa, flex); variants B4 (4 stages at 3 WGs) and B64 (64-key tiles at 3 WGs):
# subset tests + Phi-3; head-dim sweep 32/48/80/112 (4 x 4096, 32/8 heads) of B against A (2 WGs).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl .whl_fi/*.whl
mkdir -p /tmp/src && tar -xf .snap_hd96/src.tar -C /tmp/src && cp .snap_hd96/hdsweep.py /tmp/hdsweep.py && cd /tmp/src
export PYTHONPATH=/tmp/src:/tmp/site PYTHONUNBUFFERED=1 JITATTN_CACHE_DIR=/tmp/jc
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; cat $OLDPWD/.snap_hd96/commit.txt; } > $OUT/device.txt 2>&1
T0=$(date +%s); L=$OUT/log.txt; W=$OUT/sweep.txt
H=templates/prefill_sm90.cuh; cp $H /tmp/B.cuh
sed 's/kMaxStages < 3 ? 2 : 3;/kMaxStages < 3 ? 2 : kConsumerWGs == 3 ? 4 : 3;/' /tmp/B.cuh > /tmp/B4.cuh
sed 's/kConsumerWGs == 3 ? 96 :/kConsumerWGs == 3 ? 64 :/' /tmp/B.cuh > /tmp/B64.cuh
sed 's/kHeadDim % 64 != 0 \&\& kHeadDim <= 112 ? 3 : 2;/false ? 3 : 2;/' /tmp/B.cuh > /tmp/A.cuh
for v in B4 B64 A; do cmp -s /tmp/$v.cuh /tmp/B.cuh && echo "sed $v failed"; done
JITATTN_GPU_RESULTS=$OUT/kernels.jsonl timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_kernels.py tests/test_gpu_ragged.py > $OUT/pytest.txt 2>&1; echo "tests rc=$? $(( $(date +%s)-T0 )) s"; grep -E "FAILED|ERROR|passed|failed" $OUT/pytest.txt | cut -c1-200 | tail -25
echo "= B" >> $L; timeout 100 python3 -m jitattn bench --case prefill-phi3 --anchors sdpa,flex --json $OUT/bench-B.json >> $L 2>&1; echo "B bench rc=$? $(( $(date +%s)-T0 )) s"
K="hd96 or hd32 or hd48 or hd80 or hd112 or group7 or phi"
for v in B4 B64; do
  cp /tmp/$v.cuh $H
  echo "= $v tests" >> $L; timeout 60 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_kernels.py -k "$K" >> $L 2>&1; echo "$v tests rc=$? $(( $(date +%s)-T0 )) s"; tail -1 $L
  echo "= $v" >> $L; timeout 45 python3 -m jitattn bench --case prefill-phi3 --anchors '' --json $OUT/bench-$v.json >> $L 2>&1; echo "$v bench rc=$? $(( $(date +%s)-T0 )) s"
done
cp /tmp/B.cuh $H; timeout 60 python3 /tmp/hdsweep.py B 32 48 80 112 --sdpa >> $W 2>&1; echo "sweep B rc=$? $(( $(date +%s)-T0 )) s"
cp /tmp/A.cuh $H; timeout 50 python3 /tmp/hdsweep.py A 32 48 80 112 >> $W 2>&1; echo "sweep A rc=$? $(( $(date +%s)-T0 )) s"
cp /tmp/B.cuh $H
grep -h "^| prefill\|^= " $L | cut -c1-170; grep SWEEP $W | sort; grep -i "error\|Traceback" $W | head -5
