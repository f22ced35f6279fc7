#!/bin/bash
# decode helper 2: GPU tests on the new tree, then bench base / new / new5 side by side.
S=$(pwd)/.snap_decode2
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
for t in base new new5; do cp -r $S/trees/$t /tmp/src_$t; mkdir -p /tmp/jc_$t; [ -d $S/cache_$t ] && cp -r $S/cache_$t/. /tmp/jc_$t/; done
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
bench() {  # tree anchors tag
  cd /tmp/src_$1 && PYTHONPATH=/tmp/src_$1:/tmp/site JITATTN_CACHE_DIR=/tmp/jc_$1 timeout 45 python3 -m jitattn bench \
    --case decode-gpt-oss-sliding-b256 $4 --anchors "$2" --json $OUT/b_$3.json > /tmp/b_$3.txt 2>&1
  echo "bench $3 rc=$?"; tail -12 /tmp/b_$3.txt
}
cd /tmp/src_new && PYTHONPATH=/tmp/src_new:/tmp/site JITATTN_CACHE_DIR=/tmp/jc_new JITATTN_TEST_CACHE=/tmp/jc_new \
  JITATTN_GPU_RESULTS=$OUT/gpu_new.jsonl timeout 110 python3 -m pytest -m gpu tests/test_gpu_kernels.py \
  tests/test_gpu_integrations.py -q -p no:cacheprovider > $OUT/pytest_new.txt 2>&1
echo "pytest rc=$?"; tail -30 $OUT/pytest_new.txt
bench base '' base1 '--case decode-hd128-b64x4096'
bench new 'sdpa,flex' new1 '--case decode-hd128-b64x4096'
bench new5 '' new5
bench base '' base2
bench new '' new2
