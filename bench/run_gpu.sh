#!/usr/bin/env bash
# One call on the GPU machine: install the carried wheels, print versions, optionally run the
# GPU tests, then run a benchmark with its peer in the same job: bench/engine_bench.py (E1/E2,
# reinforge vs HF generate; the default) or, with BENCH=grpo, bench/grpo_bench.py (G1/G2,
# `reinforge train` vs TRL's GRPOTrainer).
#
#   run(carry=[".whl"], command="RUN_TESTS=1 bash bench/run_gpu.sh --workload E1 --kernels")
#   run(carry=[".whl"], command="BENCH=grpo bash bench/run_gpu.sh --workload G1")
#
# RUN_TESTS=1 runs every `gpu`-marked test (TESTS=... narrows it to some files).
# Logs and the JSON land in $OUT (tests.log, bench.log, <bench>_bench.json).
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,clocks.mem --format=csv,noheader
status=0
if [ "${RUN_TESTS:-0}" = 1 ]; then
    # the server tests need the `serve` extra (fastapi, uvicorn), which the wheels leave out
    python3 -c "import uvicorn" 2>/dev/null || TEST_ARGS="${TEST_ARGS:-} --ignore=tests/server"
    timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider -rfE -s -m gpu \
        ${TESTS:-tests} ${TEST_ARGS:-} \
        2>&1 | tee "$OUT/tests.log" | grep -v "^tests/.*PASSED"
    status=${PIPESTATUS[0]}
fi
[ "$#" -eq 0 ] && { echo "tests exit $status (no benchmark asked for)"; exit $status; }
timeout "${BENCH_TIMEOUT:-480}" python3 "bench/${BENCH:-engine}_bench.py" --out "$OUT" "$@" 2>&1 \
    | tee "$OUT/bench.log"
bench_status=${PIPESTATUS[0]}
echo "tests exit $status, bench exit $bench_status"
exit $(( status || bench_status ))
