#!/usr/bin/env bash
# Run a CPU example config under several seeds at once on a many-core machine (e.g. the GPU
# machine's 16 cores, `run.device=cpu`), then print each run's first and last held-out
# evaluation. How robust is an example's claim to the seed and to float-level changes?
#
#   bash scripts/example_seeds.sh configs/tictactoe.toml "0 1 2 3" 3 [extra overrides...]
#
# Arguments: config, seeds (quoted list), threads per run, then overrides for every run. With
# .whl/ present (the GPU machine), the wheels are installed to /tmp/site first. TAG (default
# "runs") names this batch, so that batches with other overrides can run beside it.
set -uo pipefail
cd "$(dirname "$0")/.."
config=$1 seeds=$2 threads=$3
shift 3
OUT=${OUT:-/tmp/example-seeds}/${TAG:=runs}
RUNS=/tmp/example-seeds-$TAG
mkdir -p "$OUT"
if [ -d .whl ]; then
    [ -d /tmp/site/pydantic ] ||
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD/src
fi
for seed in $seeds; do
    python3 -m reinforge.cli train "$config" run.device=cpu run.num_threads="$threads" \
        run.seed="$seed" run.output_dir="$RUNS/$seed" run.name=ex "$@" \
        > "$OUT/seed$seed.log" 2>&1 &
done
wait
for seed in $seeds; do
    python3 - "$seed" "$RUNS" "$TAG" <<'PY'
import json, sys
seed, runs, tag = sys.argv[1:]
path = f"{runs}/{seed}/ex/metrics.jsonl"
try:
    rows = [json.loads(line) for line in open(path)]
except FileNotFoundError:
    print(f"seed {seed}: no metrics (see seed{seed}.log)")
    sys.exit()
evals = [r for r in rows if r.get("phase") == "rl" and any(k.startswith("eval_") for k in r)]
keys = [k for k in ("eval_win_rate", "eval_forfeit_rate", "eval_reward", "eval_accuracy",
                    "eval_tool_call_rate") if k in evals[0]]
first, last = evals[0], evals[-1]
print(f"{tag} seed {seed}: step {first['step']} -> {last['step']}: "
      + ", ".join(f"{k[5:]} {first[k]:.3f} -> {last[k]:.3f}" for k in keys))
PY
done | tee "$OUT/summary.txt"
