#!/bin/bash
# decode helper 2, call 2: the whole-window (split dims) GPU cases, new tree, precompiled cache.
S=$(pwd)/.snap_decode2
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
cp -r $S/trees/new /tmp/src_new; mkdir -p /tmp/jc_new; cp -r $S/cache_new/. /tmp/jc_new/
cd /tmp/src_new && PYTHONPATH=/tmp/src_new:/tmp/site JITATTN_CACHE_DIR=/tmp/jc_new JITATTN_TEST_CACHE=/tmp/jc_new \
  JITATTN_GPU_RESULTS=$OUT/gpu_ww.jsonl timeout 45 python3 -m pytest -m gpu tests/test_gpu_kernels.py -q -p no:cacheprovider \
  -k "whole-window or sinks-window or window100 or window-both or window64 or gpt-oss or splitkv or b129" 2>&1 | tail -15
