"""The README's base install (`pip install -e .`: no dev or serve extras) runs every command
but `serve`. CI builds such an environment (.ci/run: a venv with `torch` and `-e .` alone) and
points REINFORGE_BASE_PYTHON at its python; without it this test skips, saying so.

The commands run as `reinforge.cli.main([...])` one after another in one process of that
python (the same code the console script calls; one start instead of six)."""

import os
import subprocess
import textwrap
from pathlib import Path

import pytest

from .conftest import REPO, TINY_RUN

BASE_PYTHON = os.environ.get("REINFORGE_BASE_PYTHON")

SCRIPT = textwrap.dedent(
    """
    import sys
    from reinforge.cli import main

    run, out = sys.argv[1], sys.argv[2]
    tiny = sys.argv[3:]
    for argv, want in [
        (["train", *tiny, f"run.output_dir={out}", "run.name=r"], 0),
        (["eval", run, "eval.num_tasks=4", "-o", f"{out}/eval.json"], 0),
        (["export", run, f"{out}/exported"], 0),
        (["report", run, "--html"], 0),
        (["doctor", "--no-smoke"], 0),
        (["serve", run], 2),  # its extra is missing: a config error naming the install
    ]:
        print("=== reinforge", " ".join(argv), flush=True)
        code = main(argv)
        assert code == want, f"reinforge {argv[0]} exited {code}, expected {want}"
    print("all commands ran")
    """
)


@pytest.mark.skipif(
    not BASE_PYTHON,
    reason="REINFORGE_BASE_PYTHON is not set (CI sets it to a venv with the base install only: "
    "python -m venv V && V/bin/pip install torch -e .)",
)
def test_every_command_but_serve_runs_on_the_base_install(tmp_path):
    probe = subprocess.run([BASE_PYTHON, "-c", "import fastapi"], capture_output=True)
    assert probe.returncode != 0, f"{BASE_PYTHON} has fastapi: not a base install"
    script = Path(BASE_PYTHON).parent / "reinforge"
    version = subprocess.run([str(script), "--version"], capture_output=True, text=True)
    assert version.returncode == 0 and version.stdout.startswith("reinforge ")

    run = tmp_path / "r"
    tiny = [*TINY_RUN, "run.max_steps=1", "sft.steps=1"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # its own install only
    out = subprocess.run(
        [BASE_PYTHON, "-c", SCRIPT, str(run), str(tmp_path), *tiny],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
        env=env,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "all commands ran" in out.stdout
    assert "pip install 'reinforge[serve]'" in out.stderr
    assert "FutureWarning" not in out.stderr and "lr_scheduler" not in out.stderr
    assert (tmp_path / "eval.json").is_file() and (run / "report.html").is_file()
    umask = os.umask(0)
    os.umask(umask)
    mode = (tmp_path / "exported" / "model.safetensors").stat().st_mode & 0o777
    assert mode == 0o666 & ~umask  # as the other files a user writes (was 0600)
