#!/usr/bin/env bash
# Run the GPU tests (and the benchmark with --bench) on a CUDA machine, e.g. through the device tool.
# Writes logs and the per-test JSON lines to $OUT (default ./gpu_out). Wheels found in .whl/ are
# installed first (packages the machine lacks; it has no network). PYTEST_PATHS narrows the test files,
# PYTEST_ARGS adds pytest options, BENCH_ARGS passes options to `python3 -m jitattn.bench`.
set -uo pipefail
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export JITATTN_CACHE_DIR=${JITATTN_CACHE_DIR:-/tmp/jitattn-cache}
export JITATTN_GPU_RESULTS=$OUT/gpu_results.jsonl
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv;
  nvcc --version | tail -2; python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; } \
  > "$OUT/device.txt" 2>&1
cat "$OUT/device.txt"
rc=0
if [ "${1:-}" != "--bench-only" ]; then
  python3 -m pytest -m gpu ${PYTEST_PATHS:-tests/} -q -p no:cacheprovider --timeout 900 ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest.log" | tail -40
  rc=${PIPESTATUS[0]}
fi
if [ "${1:-}" = "--bench" ] || [ "${1:-}" = "--bench-only" ]; then
  python3 -m jitattn.bench ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -60
fi
exit $rc
