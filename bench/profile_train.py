"""`reinforge train` with one RL step's policy update under torch.profiler (a bench tool; the
trainer itself carries no profiling code).

    python bench/profile_train.py STEP OUT_FILE train CONFIG [k=v ...]

Writes the update's device time by operator (sorted by CUDA time) to OUT_FILE.
"""

from __future__ import annotations

import sys

import torch

import reinforge.train.rl as rl
from reinforge.cli import main


def profiled(update, step: int, out_file: str):
    calls = {"n": 0}

    def wrapper(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] != step:
            return update(*args, **kwargs)
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            result = update(*args, **kwargs)
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=45)
        with open(out_file, "w") as f:
            f.write(table)
        return result

    return wrapper


if __name__ == "__main__":
    step, out_file, argv = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    rl.update_policy = profiled(rl.update_policy, step, out_file)
    sys.exit(main(argv))
