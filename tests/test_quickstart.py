"""The README's main job, exactly as a user runs it: held-out accuracy must rise through RL by at
least 20 points. Takes a few minutes on a 2-core CPU; it is the claim the quickstart makes."""

import json
import time

import pytest

from reinforge.errors import ExitCode

from .conftest import QUICKSTART_STEPS, cli


@pytest.mark.slow
def test_quickstart_rl_raises_held_out_accuracy(tmp_path):
    start = time.perf_counter()
    out = cli(
        "train", "configs/quickstart.toml", f"run.output_dir={tmp_path}", timeout=1500, fresh=True
    )
    wall = time.perf_counter() - start
    assert out.returncode == ExitCode.OK, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [
        json.loads(x) for x in (tmp_path / "quickstart" / "metrics.jsonl").read_text().splitlines()
    ]
    evals = [(r["step"], r["eval_accuracy"]) for r in rows if "eval_accuracy" in r]
    before, after = evals[0][1], evals[-1][1]
    print(
        f"quickstart: held-out accuracy {before:.3f} -> {after:.3f} in {wall:.0f} s; curve {evals}"
    )
    assert evals[0][0] == 0 and evals[-1][0] == QUICKSTART_STEPS
    assert after - before >= 0.20, evals
    assert "held-out accuracy after" in out.stdout
