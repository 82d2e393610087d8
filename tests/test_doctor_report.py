"""`doctor` on this machine and a config; `report` on real run directories."""

import json

import pytest

from reinforge.cli import main
from reinforge.doctor import FAIL, run_doctor
from reinforge.errors import ExitCode
from reinforge.report import build_report

from .conftest import REPO, TINY_RUN, cli


def test_doctor_checks_this_machine_and_a_config():
    report = run_doctor(str(REPO / "configs" / "quickstart.toml"))
    names = {c.name for c in report.checks}
    assert {"python", "torch", "transformers", "cpu", "ram", "smoke cpu"} <= names
    assert report.is_ok, [c for c in report.checks if c.status == FAIL]
    assert any(c.name.startswith("preflight: longest prompt") for c in report.checks)


def test_doctor_fails_on_a_config_that_cannot_run():
    report = run_doctor(None, ["rollout.max_new_tokens=600"], smoke=False)
    assert not report.is_ok
    assert any("exceeds the model context" in c.value for c in report.checks if c.status == FAIL)


def test_report_of_finished_and_stopped_runs(tmp_path):
    out = cli("train", *TINY_RUN, f"run.output_dir={tmp_path}", "run.name=r", "run.max_steps=2")
    assert out.returncode == 0, out.stderr
    report = build_report(tmp_path / "r")
    assert report.status == "finished" and report.steps_done == 2 and report.resume_command is None
    assert "reward_mean" in report.final and "eval_accuracy" in report.best
    # the same run as if it had been stopped at step 1: a checkpoint, no end
    state = tmp_path / "r" / "checkpoints" / "step_000002" / "trainer_state.json"
    data = json.loads(state.read_text())
    data["step"] = 1
    state.write_text(json.dumps(data))
    report = build_report(tmp_path / "r")
    assert report.status.startswith("stopped at RL step 1") and "--resume" in report.resume_command
    (tmp_path / "r" / "error.txt").write_text("Traceback ...\nRuntimeError: boom\n")
    report = build_report(tmp_path / "r")
    assert (
        report.status == "failed: RuntimeError: boom" and report.last_error == "RuntimeError: boom"
    )
    assert report.resume_command == f"reinforge train --resume {tmp_path / 'r'}"


def test_doctor_command_prints_a_table_a_verdict_and_a_distinct_exit_code(capsys):
    assert main(["doctor", str(REPO / "configs" / "quickstart.toml"), "--no-smoke"]) == 0
    out = capsys.readouterr().out
    assert "reinforge doctor" in out and "free disk at runs" in out and "verdict: ready" in out
    # the machine is fine, the config is not: a configuration error, naming what fails
    assert main(["doctor", "rollout.max_new_tokens=600", "--no-smoke"]) == ExitCode.CONFIG_ERROR
    out = capsys.readouterr().out
    assert (
        "verdict: NOT ready: this machine cannot run this config (preflight)" in out
        and "exceeds the model context" in out
    )


def test_report_command_on_a_folder_that_is_not_a_run(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == ExitCode.CONFIG_ERROR
    assert "is not a run directory" in capsys.readouterr().err


def test_exit_codes_are_documented_in_help(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert all(f"  {int(code)}  " in out for code in ExitCode)
