#!/bin/bash
# pf call 2: prefill GPU tests on h-pf's tree, then cab859b vs h-pf side by side (bench) + ping-pong probe.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl .whl_fi/*.whl >/dev/null 2>&1
S=$PWD/.snap_pf
mkdir -p /tmp/src /tmp/base && tar -xf $S/src.tar -C /tmp/src && tar -xf $S/base.tar -C /tmp/base
cp -r /tmp/src /tmp/v_pp && sed -i 's/^constexpr bool kPrefillSm90PingPong = false;/constexpr bool kPrefillSm90PingPong = true;/' /tmp/v_pp/templates/prefill_sm90.cuh
grep -c "kPrefillSm90PingPong = true" /tmp/v_pp/templates/prefill_sm90.cuh
export PYTHONUNBUFFERED=1
cd /tmp/src
PYTHONPATH=/tmp/src:/tmp/site JITATTN_CACHE_DIR=/tmp/jc_src JITATTN_GPU_RESULTS=$OUT/tests-pf.jsonl timeout 240 python3 -m pytest -m gpu tests/test_gpu_kernels.py tests/test_gpu_ragged.py -k prefill -q -p no:cacheprovider -x 2>&1 | tail -15 | tee $OUT/tests-pf.log
for t in base src; do
  cd /tmp/$t && PYTHONPATH=/tmp/$t:/tmp/site JITATTN_CACHE_DIR=/tmp/jc_$t timeout 150 python3 -m jitattn bench --case prefill-hd128-causal --case prefill-gemma2 --anchors flex --json $OUT/bench-$t.json > $OUT/bench-$t.log 2>&1; echo "bench $t rc=$?"
done
C=prefill-hd128-causal-b4x8192
(cd /tmp/src && PYTHONPATH=/tmp/src:/tmp/site JITATTN_CACHE_DIR=/tmp/jc_src timeout 90 python3 $S/pf_time.py base $C /tmp/ref.pt 2>&1 | grep RES)
(cd /tmp/v_pp && PYTHONPATH=/tmp/v_pp:/tmp/site JITATTN_CACHE_DIR=/tmp/jc_pp timeout 90 python3 $S/pf_time.py pingpong $C /tmp/ref.pt 2>&1 | grep -E "RES|Error")
for t in base src; do echo "== $t"; grep "^| " $OUT/bench-$t.log | grep -v "sdpa\|^| case\|^|--"; done
