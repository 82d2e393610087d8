"""The README's main job, exactly as a user runs it: held-out accuracy must rise through RL by at
least 20 points. It is the claim the quickstart makes. Beside other tests the demo runs in the
background from the start of the session, on one thread (`conftest`); alone, in line here."""

import json
import subprocess
import time

import pytest

from reinforge.errors import ExitCode

from .conftest import BACKGROUND, QUICKSTART_STEPS, REPO, quickstart_command


@pytest.mark.slow
def test_quickstart_rl_raises_held_out_accuracy(tmp_path):
    run = BACKGROUND.get("quickstart")  # started when collection ended (conftest), or run here
    if run is None:
        start = time.perf_counter()
        done = subprocess.run(
            quickstart_command(tmp_path),
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=1500,
        )
        output, returncode, run_dir = done.stdout + done.stderr, done.returncode, tmp_path
    else:
        start = run.started
        returncode = run.process.wait(timeout=max(1500 - (time.perf_counter() - start), 1))
        output, run_dir = run.log.read_text(), run.output_dir
    wall = time.perf_counter() - start
    assert returncode == ExitCode.OK, output[-6000:]
    rows = [
        json.loads(x) for x in (run_dir / "quickstart" / "metrics.jsonl").read_text().splitlines()
    ]
    evals = [(r["step"], r["eval_accuracy"]) for r in rows if "eval_accuracy" in r]
    before, after = evals[0][1], evals[-1][1]
    where = "in the background, one thread" if run is not None else "in line"
    print(
        f"quickstart ({where}): held-out accuracy {before:.3f} -> {after:.3f} in {wall:.0f} s; "
        f"curve {evals}"
    )
    assert evals[0][0] == 0 and evals[-1][0] == QUICKSTART_STEPS
    assert after - before >= 0.20, evals
    assert "held-out accuracy after" in output
