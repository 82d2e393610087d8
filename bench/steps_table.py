"""Print chosen metrics of each RL step of a run (a bench tool): where a step's time and memory
went, per step, from the run's metrics.jsonl.

    python bench/steps_table.py RUN_DIR [key ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

KEYS = [
    "step_s",
    "generate_s",
    "train_s",
    "gen_engine_s",
    "gen_restore_s",
    "gen_graph_capture_s",
    "gpu_peak_generate_gib",
    "gpu_peak_train_gib",
    "graph_eager",
    "graph_capture",
    "graph_replay",
    "graph_launched",
    "gpu_pool_update_gib",
    "gpu_pool_decode_gib",
    "gpu_kv_gib",
]


def main() -> None:
    run = Path(sys.argv[1])
    keys = sys.argv[2:] or KEYS
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("phase") == "rl" and "step_s" in r]
    print(f"{run.name}: " + " | ".join(["step", *keys]))
    for r in rows:
        cells = [f"{r[k]:.3f}" if isinstance(r.get(k), float) else str(r.get(k, "-")) for k in keys]
        print(" | ".join([str(r["step"]), *cells]))


if __name__ == "__main__":
    main()
