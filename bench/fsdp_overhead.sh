#!/usr/bin/env bash
# FSDP2's own cost on one GPU (issue 8): G1 in one process, sharded over a world of one
# (bench/profile_train.py --fsdp1), and replicated over it (its once-a-step gradient
# all-reduce through NCCL), each with its step 3 under torch.profiler; logs, profiles and
# metrics to $OUT (one archive). Extra arguments are overrides for every run (k=v).
#   run(carry=[".whl"], command="bash bench/fsdp_overhead.sh")
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
bash bench/run_gpu.sh > "$OUT/setup.log" 2>&1 || { cat "$OUT/setup.log"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
one() {  # name, profile_train flags (quoted), overrides...
    local name=$1 flags=$2; shift 2
    timeout "${RUN_TIMEOUT:-170}" python3 bench/profile_train.py $flags 3 "$OUT/prof_$name.txt" \
        train configs/bench/g1.toml run.max_steps=5 "run.output_dir=/tmp/rb_$name" "$@" \
        > "$OUT/$name.log" 2>&1
    echo "$name: exit $?"
    cp "/tmp/rb_$name/g1/metrics.jsonl" "$OUT/$name.jsonl" 2>/dev/null || return
    python3 - "$OUT/$name.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if "train_s" in r:
        print(f"  step {r['step']}: generate {r['generate_s']:.2f} s, train {r['train_s']:.2f} s, "
              f"step {r['step_s']:.2f} s, peak {r.get('gpu_peak_gib', 0):.2f} GiB")
PY
}
export TORCH_LOGS=${TORCH_LOGS:-recompiles}
one plain "" "$@"
PROFILE_TRACE=${TRACE:-0} one fsdp1_per_micro_batch "--fsdp1" distributed.strategy=fsdp distributed.accumulate_unsharded=false "$@"
PROFILE_TRACE=${TRACE:-0} one fsdp1_accumulate "--fsdp1" distributed.strategy=fsdp distributed.accumulate_unsharded=true "$@"
one replicate1 "--fsdp1" distributed.strategy=replicate "$@"
[ -n "${EAGER:-}" ] && one fsdp1_eager "--fsdp1" train.compile=false "$@"
[ -n "${EAGER:-}" ] && one plain_eager "" train.compile=false "$@"
# the device tool brings back at most 8 files: everything but the summary goes in one archive
(cd "$OUT" && tar czf fsdp_overhead.tgz --remove-files ./*.log ./*.jsonl ./prof_*)
