#!/usr/bin/env bash
# One call on the GPU machine: install the carried wheels, print versions, optionally run the
# engine's GPU tests, then run bench/engine_bench.py (reinforge and HF generate in one job).
#
#   run(carry=[".whl"], command="RUN_TESTS=1 bash bench/run_gpu.sh --workload E1 --kernels")
#
# Logs and the JSON land in $OUT (tests.log, bench.log, engine_bench.json).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, \
'transformers', transformers.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0))"
nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,clocks.mem --format=csv,noheader
status=0
if [ "${RUN_TESTS:-0}" = 1 ]; then
    timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider -rfE \
        tests/engine/test_triton_kernels.py tests/engine/test_gpu_engine.py ${TEST_ARGS:-} \
        2>&1 | tee "$OUT/tests.log" | grep -v "^tests/.*PASSED"
    status=${PIPESTATUS[0]}
fi
timeout "${BENCH_TIMEOUT:-480}" python3 bench/engine_bench.py --out "$OUT" "$@" 2>&1 \
    | tee "$OUT/bench.log"
bench_status=${PIPESTATUS[0]}
echo "tests exit $status, bench exit $bench_status"
exit $(( status || bench_status ))
