#!/bin/bash
# pf call 1: ncu of the hd128 causal prefill kernel at cab859b + knockout timings (diagnostic only).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl .whl_fi/*.whl >/dev/null 2>&1
S=$PWD/.snap_pf
mkdir -p /tmp/src && tar -xf $S/src.tar -C /tmp/src
F=templates/prefill_sm90.cuh
for v in nold noexp nopv nosm noepi dbl; do cp -r /tmp/src /tmp/v_$v; done
cp $S/dbl_prefill_sm90.cuh /tmp/v_dbl/$F  # recorded as 2026-11-29-s5-pf-call1-dbl_prefill_sm90.patch (against cab859b)
sed -i 's/^      loader.load(p, stage_k(s), stage_v(s), kv_head, n_first + j \* kN, kv_end, bad);$/      \/\/ knockout/' /tmp/v_nold/$F
sed -i 's/fast_exp2(kFoldScale ? fmaf(x, kScale, -m_use) : x - m_use)/(kFoldScale ? fmaf(x, kScale, -m_use) : x - m_use)/' /tmp/v_noexp/$F
sed -i 's/^        issue_pv(j - 1);$/        \/\/ knockout/' /tmp/v_nopv/$F
sed -i 's/^      \*reinterpret_cast<uint32_t\*>(out + d \* 8 + 2 \* tig) = pack2/      if (v0 == 1234.5f) *reinterpret_cast<uint32_t*>(out + d * 8 + 2 * tig) = pack2/' /tmp/v_noepi/$F
sed -i 's/^        softmax_tile(s, n_first + j \* kN, alpha);$/        alpha[0] = alpha[1] = 1.f;/' /tmp/v_nosm/$F
export PYTHONUNBUFFERED=1
C=prefill-hd128-causal-b4x8192
# builds in parallel (no GPU needed)
for v in src v_nold v_noexp v_nopv v_nosm v_noepi v_dbl; do
  d=/tmp/$v; [ $v = src ] && d=/tmp/src
  (cd $d && PYTHONPATH=$d:/tmp/site JITATTN_CACHE_DIR=/tmp/jc_$v timeout 120 python3 $S/build1.py /tmp/jc_$v $C > /tmp/build_$v.log 2>&1) &
done
wait
grep -h "Used\|spill" /tmp/build_*.log | head -20
run_t() { (cd $2 && PYTHONPATH=$2:/tmp/site JITATTN_CACHE_DIR=/tmp/jc_$3 timeout 90 python3 $S/pf_time.py $1 $C /tmp/ref.pt 2>&1 | grep -E "RES|Error|error" | tail -3 | tee -a /tmp/res.txt); }
run_t base /tmp/src src
for v in nold noexp nopv nosm noepi dbl; do run_t $v /tmp/v_$v v_$v; done
run_t base2 /tmp/src src
# one profiled launch of the base kernel
false && ncu --clock-control none --launch-count 1 --kernel-name regex:jitattn_prefill \
  --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section SchedulerStats \
  --section WarpStateStats --section InstructionStats --section SourceCounters --section LaunchStats --section Occupancy \
  --import-source no -o $OUT/pf-ncu -f python3 tests/profile_kernels.py $C > $OUT/ncu-run.log 2>&1
tail -3 $OUT/ncu-run.log
timeout 60 ncu --import $OUT/pf-ncu.ncu-rep --page details > $OUT/ncu-details.txt 2>&1
timeout 60 ncu --import $OUT/pf-ncu.ncu-rep --page source --csv --print-source sass > $OUT/ncu-source.csv 2>&1
ls -la $OUT
grep -E "Throughput|Duration|Frequency|Issue Slots|Issued Ipc|Eligible|Active Warps|No Eligible|Cycles Per Issued|Pipe" $OUT/ncu-details.txt | head -40
echo ==== RESULTS; grep -h Used /tmp/build_*.log; cat /tmp/res.txt; echo done
