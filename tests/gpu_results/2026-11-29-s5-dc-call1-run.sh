#!/bin/bash
# s5-dc call 1 (device tool, repo root = /work/main copy; .snap_dc/src.tar = h-dc 95950b4 + the CPU test commit,
# base.tar = cab859b; the "nan" tree is src with JITATTN_FP8_NAN's default set to 1).
set -u
exec > >(tee $OUT/log.txt) 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl .whl_fi/*.whl 2>&1 | tail -2
mkdir -p /tmp/src /tmp/base /tmp/nan
tar -xf .snap_dc/src.tar -C /tmp/src; tar -xf .snap_dc/base.tar -C /tmp/base; tar -xf .snap_dc/src.tar -C /tmp/nan
sed -i 's/^#define JITATTN_FP8_NAN 0/#define JITATTN_FP8_NAN 1/' /tmp/nan/templates/common.cuh
export PYTHONUNBUFFERED=1
cd /tmp/src
PYTHONPATH=/tmp/src:/tmp/site JITATTN_CACHE_DIR=/tmp/jc_src JITATTN_DECODE_BALANCED=1 JITATTN_GPU_RESULTS=$OUT/t_bal.jsonl \
  timeout 240 python3 -m pytest -m gpu tests/test_gpu_kernels.py tests/test_gpu_fp8.py tests/test_gpu_merge.py -q -p no:cacheprovider
PYTHONPATH=/tmp/src:/tmp/site JITATTN_CACHE_DIR=/tmp/jc_src JITATTN_GPU_RESULTS=$OUT/t_auto.jsonl \
  timeout 120 python3 -m pytest -m gpu tests/test_gpu_kernels.py -k "decode or graph" tests/test_gpu_fp8.py -q -p no:cacheprovider
cd /tmp/nan
PYTHONPATH=/tmp/nan:/tmp/site JITATTN_CACHE_DIR=/tmp/jc_nan JITATTN_GPU_RESULTS=$OUT/t_nan.jsonl \
  timeout 100 python3 -m pytest -m gpu tests/test_gpu_fp8.py -q -p no:cacheprovider
C="--case decode-hd128 --case decode-gpt-oss-sliding-b256"
cd /tmp/base; PYTHONPATH=/tmp/base:/tmp/site JITATTN_CACHE_DIR=/tmp/jc_base python3 -m jitattn bench $C --anchors sdpa --json $OUT/b_base.json
cd /tmp/src; PYTHONPATH=/tmp/src:/tmp/site JITATTN_CACHE_DIR=/tmp/jc_src python3 -m jitattn bench $C --anchors '' --json $OUT/b_new.json
PYTHONPATH=/tmp/src:/tmp/site JITATTN_CACHE_DIR=/tmp/jc_src JITATTN_DECODE_BALANCED=0 python3 -m jitattn bench $C --anchors '' --no-check --json $OUT/b_new0.json
cd /tmp/nan; PYTHONPATH=/tmp/nan:/tmp/site JITATTN_CACHE_DIR=/tmp/jc_nan python3 -m jitattn bench --case decode-hd128-b64x4096-fp8 --anchors '' --no-check --json $OUT/b_nan.json
