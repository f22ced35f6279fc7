set -u
R=$(pwd)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
rm -rf /tmp/src /tmp/base /tmp/jc /tmp/tv /tmp/tc; mkdir -p /tmp/src /tmp/base && tar -xf .snap_dec/src.tar -C /tmp/src && tar -xf .snap_dec/base.tar -C /tmp/base
cp -r .snap_dec/jc /tmp/jc && cp -r .snap_dec/tv /tmp/tv && cp -r .snap_dec/tc /tmp/tc
cd /tmp/src
export PYTHONPATH=/tmp/src:/tmp/site PYTHONUNBUFFERED=1 JITATTN_CACHE_DIR=/tmp/jc
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
date -u
timeout 120 python3 tests/tune_decode_variants.py time /tmp/tv --json $OUT/sweep.json --rounds 3 > $OUT/sweep.log 2>&1; echo "sweep rc $?"
python3 $R/.snap_dec/adopt.py $OUT/sweep.json /tmp/src/templates 2>&1 | tee $OUT/adopt.log || echo "adopt failed"
cd /tmp/src; (cd templates && sha256sum decode.cuh decode_mma.cuh attention.cu.j2) > $OUT/templates.sha256
date -u
JITATTN_TEST_CACHE=/tmp/tc JITATTN_GPU_RESULTS=$OUT/tests.jsonl timeout 200 python3 -m pytest -m gpu tests/test_gpu_kernels.py tests/test_gpu_merge.py -q -p no:cacheprovider > $OUT/tests.log 2>&1; echo "tests rc $?"
date -u
JITATTN_CACHE_DIR=/tmp/jcn timeout 150 python3 -m jitattn bench --case decode-hd128-b64x4096 --case decode-hd128-b1x32768 --case decode-gemma2 --case decode-gpt-oss-sliding-b256 --anchors sdpa,flex --json $OUT/bench-new.json > $OUT/bench-new.log 2>&1; echo "bench new rc $?"
date -u
cd /tmp/base && PYTHONPATH=/tmp/base:/tmp/site JITATTN_CACHE_DIR=/tmp/jcb timeout 100 python3 -m jitattn bench --case decode-hd128-b64x4096 --case decode-hd128-b1x32768 --case decode-gemma2 --case decode-gpt-oss-sliding-b256 --anchors '' --json $OUT/bench-old.json > $OUT/bench-old.log 2>&1; echo "bench old rc $?"
date -u
tail -3 $OUT/tests.log
cat $OUT/adopt.log
grep "^|" $OUT/sweep.log
echo NEW; grep "^| " $OUT/bench-new.log | grep -v "skipped\|sdpa-flash"
echo OLD; grep "^| " $OUT/bench-old.log | grep jitattn
