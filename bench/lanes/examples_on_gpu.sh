#!/usr/bin/env bash
# The tools examples (issue 22, item 5) on one GPU with the tiny model and a long SFT stage (the
# CPU's 150-800 SFT steps did not teach it to copy: bench/results/2026-11-26-cpu-tools-examples-s12.md).
# Several runs side by side on the one GPU, each with a fixed KV pool and micro-batch budget; run
# directories under /tmp, only metrics.jsonl and the console log kept under $OUT.
#   bash bench/lanes/examples_on_gpu.sh SFT_STEPS RL_STEPS SEEDS...
set -uo pipefail
sft=$1 rl=$2
shift 2
common="run.device=cuda run.num_threads=2 rollout.kv_cache_bytes=1073741824 train.micro_batch_tokens=16384 train.compile=false run.overwrite=true sft.steps=$sft run.max_steps=$rl eval.every=$((rl / 2))"
for config in tools_search tools_branching; do
    for seed in "$@"; do
        name=$config-sft$sft-s$seed
        python3 -m reinforge train configs/$config.toml $common run.seed=$seed run.name=$name \
            run.output_dir=/tmp/examples >"$OUT/$name.log" 2>&1 &
        sleep 20  # the first builds the model cache; then side by side
    done
done
wait
mkdir -p /tmp/examples-out
for d in /tmp/examples/*/; do cp "$d/metrics.jsonl" "/tmp/examples-out/$(basename "$d").metrics.jsonl"; done
mv "$OUT"/*.log /tmp/examples-out/
tar czf "$OUT/examples.tgz" -C /tmp examples-out  # the device returns at most 8 files
for f in /tmp/examples-out/*.log; do echo "== $f"; tail -25 "$f"; done
