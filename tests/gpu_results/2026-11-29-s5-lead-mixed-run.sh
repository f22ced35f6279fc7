#!/bin/bash
# Fifth session (2026-11-29): mixed batch with the decode kernel on a side stream vs one stream, one call.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl .whl_fi/*.whl
mkdir -p /tmp/src && tar -xf .snap_lead/src.tar -C /tmp/src && cd /tmp/src
export PYTHONPATH=/tmp/src:/tmp/site PYTHONUNBUFFERED=1 JITATTN_CACHE_DIR=/tmp/jc
T0=$(date +%s); cat .snap-commit
JITATTN_GPU_RESULTS=$OUT/mixed-tests.jsonl timeout 150 python3 -m pytest -m gpu tests/test_gpu_kernels.py -q -p no:cacheprovider -k "mixed_batch or odd-lengths or chunk-after or zero-query or model-llama or model-gemma-2-9b or decode-b3 or graph" > $OUT/mixed-pytest.log 2>&1; echo "tests rc=$? $(( $(date +%s)-T0 )) s"; tail -2 $OUT/mixed-pytest.log
for r in 1 2; do
for two in True False; do
timeout 60 python3 -c "import sys, jitattn.runtime as r; r.MIXED_ON_TWO_STREAMS=$two; from jitattn.cli import app; sys.argv=['jitattn','bench','--case','mixed','--anchors','','--json','$OUT/mixed-$two-$r.json']; app()" > $OUT/mixed-$two-$r.log 2>&1; echo "bench two_streams=$two run $r rc=$? $(( $(date +%s)-T0 )) s"
grep -h "^| mixed" $OUT/mixed-$two-$r.log | cut -d'|' -f3,4,5,6
done; done
