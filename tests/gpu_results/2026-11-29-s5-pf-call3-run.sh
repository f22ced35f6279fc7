#!/bin/bash
# pf call 3: every test of tests/test_gpu_kernels.py and tests/test_gpu_ragged.py on h-pf HEAD; knockout of the K/V copies on it.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl .whl_fi/*.whl >/dev/null 2>&1
S=$PWD/.snap_pf
mkdir -p /tmp/src && tar -xf $S/src.tar -C /tmp/src
cp -r /tmp/src /tmp/v_nold && sed -i 's/^      loader.load(p, stage_k(s), stage_v(s), kv_head, n_first + j \* kN, kv_end, bad);$/      \/\/ knockout/' /tmp/v_nold/templates/prefill_sm90.cuh
grep -c knockout /tmp/v_nold/templates/prefill_sm90.cuh
export PYTHONUNBUFFERED=1
cd /tmp/src
PYTHONPATH=/tmp/src:/tmp/site JITATTN_CACHE_DIR=/tmp/jc_src JITATTN_GPU_RESULTS=$OUT/2026-11-29-s5-pf-tests.jsonl timeout 400 python3 -m pytest -m gpu tests/test_gpu_kernels.py tests/test_gpu_ragged.py -q -p no:cacheprovider 2>&1 | tail -25 | tee $OUT/2026-11-29-s5-pf-tests.log
C=prefill-hd128-causal-b4x8192
(cd /tmp/src && PYTHONPATH=/tmp/src:/tmp/site JITATTN_CACHE_DIR=/tmp/jc_src timeout 90 python3 $S/pf_time.py base $C /tmp/ref.pt 2>&1 | grep RES)
(cd /tmp/v_nold && PYTHONPATH=/tmp/v_nold:/tmp/site JITATTN_CACHE_DIR=/tmp/jc_nold timeout 90 python3 $S/pf_time.py nold $C /tmp/ref.pt 2>&1 | grep -E "RES|Error")
echo "elapsed $SECONDS s"
if [ $SECONDS -lt 120 ]; then
  cd /tmp/src && PYTHONPATH=/tmp/src:/tmp/site JITATTN_CACHE_DIR=/tmp/jc_src timeout 45 ncu --clock-control none --launch-count 1 --kernel-name regex:jitattn_prefill \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section SchedulerStats --section WarpStateStats --section SourceCounters \
    --import-source no -o /tmp/pf-ncu -f python3 tests/profile_kernels.py $C > /dev/null 2>&1
  timeout 20 ncu --import /tmp/pf-ncu.ncu-rep --page details > $OUT/2026-11-29-s5-pf-call3-ncu-details.txt 2>&1
  timeout 20 ncu --import /tmp/pf-ncu.ncu-rep --page source --csv --print-source sass > $OUT/ncu-source.csv 2>&1
  grep -E "Duration|SM Frequency|Compute \(SM\)|Issue Slots Busy|No Eligible" $OUT/2026-11-29-s5-pf-call3-ncu-details.txt
fi
echo "elapsed $SECONDS s"
