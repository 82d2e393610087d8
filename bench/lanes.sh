#!/usr/bin/env bash
# One call on a multi-GPU machine, several independent jobs at once: each line of the lanes file
# is `name | GPUs | seconds | command`; its command runs with CUDA_VISIBLE_DEVICES=GPUs under a
# `timeout` of that many seconds, output to $OUT/<name>.log (printed, prefixed, as it comes).
# The wheels are installed once, before the lanes start. Lanes sharing GPUs must not overlap:
# put work for the same GPUs in one lane, joined by `;`.
#
#   run(kind="nvidia-h100-x4", carry=[".whl"], command="bash bench/lanes.sh bench/lanes/s12a.txt")
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/gpu_env.sh
pids=()
names=()
while IFS='|' read -r name gpus secs cmd; do
    [[ "$name" =~ ^[[:space:]]*(#|$) ]] && continue  # a comment (quotes and all) or a blank line
    name=$(echo "$name" | xargs)
    [ -z "$name" ] || [ "${name:0:1}" = "#" ] && continue
    gpus=$(echo "$gpus" | xargs)
    secs=$(echo "$secs" | xargs)
    (
        export CUDA_VISIBLE_DEVICES=$gpus
        mkdir -p "$OUT/$name"
        OUT="$OUT/$name" timeout "$secs" bash -c "$cmd" 2>&1 | tee "$OUT/$name.log" \
            | sed -u "s/^/[$name] /"
        echo "[$name] exit ${PIPESTATUS[0]}"
    ) &
    pids+=($!)
    names+=("$name")
done < "$1"
for pid in "${pids[@]}"; do wait "$pid"; done
grep -h "exit" "$OUT"/*.log >/dev/null 2>&1
echo "lanes done: ${names[*]}"
