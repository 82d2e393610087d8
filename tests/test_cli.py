"""The command line, run as a user would: real subprocesses, real run directories."""

import json
import shutil
import subprocess
import sys

from reinforge.errors import ExitCode

from .conftest import REPO, TINY_RUN, cli


def test_help_is_instant_and_imports_no_torch():
    code = (
        "import sys\nfrom reinforge.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'torch imported by --help'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "train" in out.stdout and "sft" in out.stdout


def test_dry_run_prints_config_and_budgets(tmp_path):
    out = cli("train", "configs/quickstart.toml", "--dry-run", f"run.output_dir={tmp_path}")
    assert out.returncode == ExitCode.OK, out.stderr
    assert "[rollout]" in out.stdout and "prompt + rollout.max_new_tokens" in out.stdout
    assert "32 prompts x 8 samples = 256 sequences" in out.stdout
    # how long the job takes, from a step of each phase timed just now at the config's size
    assert "estimated time: about" in out.stdout and "RL: 60 steps x" in out.stdout
    assert "SFT: 500 steps x" in out.stdout and "generation (32 x 8 x 8 tokens) took" in out.stdout
    assert not any(tmp_path.iterdir())  # nothing trained, nothing written


def test_context_overflow_refused_before_loading(tmp_path):
    out = cli(
        "train",
        "configs/quickstart.toml",
        f"run.output_dir={tmp_path}",
        "rollout.max_new_tokens=500",
    )
    assert out.returncode == ExitCode.CONFIG_ERROR
    assert (
        "exceeds the model context (512)" in out.stderr
        and "set rollout.max_new_tokens <= 487" in out.stderr
    )
    assert not (tmp_path / "quickstart").exists()  # refused before any run directory or model load


def test_prompts_longer_than_the_context_are_refused_without_a_negative_budget(tmp_path):
    out = cli(
        "train",
        "configs/reasoning_gym_shortest_path.toml",
        f"run.output_dir={tmp_path}",
        "task.system_prompt=" + "Think about it. " * 40,
    )
    assert out.returncode == ExitCode.CONFIG_ERROR
    assert "leaves no room to answer in the model context (512" in out.stderr
    assert "task.system_prompt" in out.stderr and "builtin:small" in out.stderr
    assert "<= -" not in out.stderr  # no max_new_tokens can make it fit
    assert not any(tmp_path.iterdir())


def test_misplaced_key_exits_with_config_error(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[rollout]\nlr = 1e-5\n")
    out = cli("train", str(cfg))
    assert out.returncode == ExitCode.CONFIG_ERROR
    assert "'lr' belongs in [sft] or [optim]" in out.stderr


def test_train_end_to_end_then_zero_step_resume_fails(tmp_path):
    args = [
        "train",
        *TINY_RUN,
        f"run.output_dir={tmp_path}",
        "run.name=e2e",
        "run.max_steps=3",
        "sft.steps=2",
        "checkpoint.every=2",
        "log.plot=true",
        "log.tensorboard=true",
    ]
    out = cli(*args)
    assert out.returncode == ExitCode.OK, out.stdout + out.stderr
    run = tmp_path / "e2e"
    assert "held-out accuracy before" in out.stdout and str(run) in out.stdout
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rl_steps = [r["step"] for r in rows if r["phase"] == "rl" and "reward_mean" in r]
    assert rl_steps == [1, 2, 3]
    assert [r["step"] for r in rows if r["phase"] == "sft"] == [1, 2]
    for key in (
        "reward_mean",
        "accuracy",
        "response_len",
        "entropy",
        "tokens_per_s",
        "step_s",
        "kl_sampler",
    ):
        assert key in rows[-2] or key in rows[-1], key
    assert (run / "config.toml").exists() and (run / "curves.png").stat().st_size > 1000
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert samples and {"prompt", "completion", "reward"} <= set(samples[0])
    final = run / "checkpoints" / "step_000003"
    assert (final / "model.safetensors").exists() and (final / "optimizer.pt").exists()
    assert (final / "tokenizer.json").exists() and (final / "rng.pt").exists()
    assert json.loads((final / "trainer_state.json").read_text())["data_position"] == 2 * 64 + 3 * 4
    assert (run / "checkpoints" / "sft_final" / "config.json").exists()

    again = cli(*args, "--resume", str(run))
    assert again.returncode == ExitCode.NOTHING_TRAINED
    assert "nothing was trained" in again.stderr and "raise run.max_steps" in again.stderr

    # stopped between SFT and RL's first checkpoint: the resume starts RL from sft_final and
    # does not log the before-RL evaluation a second time
    for step in run.glob("checkpoints/step_*"):
        shutil.rmtree(step)
    (run / "checkpoints" / "latest").write_text("sft_final")
    resumed = cli(*args, "--resume", str(run))
    assert resumed.returncode == ExitCode.OK, resumed.stdout + resumed.stderr
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["phase"] == "rl" and "reward_mean" in r] == [1, 2, 3]
    before_rl = [r for r in rows if r["phase"] == "rl" and r["step"] == 0 and "eval_accuracy" in r]
    assert len(before_rl) == 1


def test_existing_run_dir_is_not_clobbered(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "metrics.jsonl").write_text("{}\n")
    out = cli("train", f"run.output_dir={tmp_path}", "run.name=x", *TINY_RUN)
    assert out.returncode == ExitCode.CONFIG_ERROR
    assert "--resume" in out.stderr and "run.overwrite=true" in out.stderr


def test_config_docs_command_matches_committed_reference():
    out = cli("config-docs")
    assert out.returncode == 0
    assert out.stdout == (REPO / "docs" / "config.md").read_text()


def test_runtime_failure_exits_nonzero_with_summary(tmp_path):
    """A checkpoint folder with a config but no weights passes preflight and fails at load:
    exit code 1, a one-line reason, the traceback kept in the run directory."""
    from reinforge.models.tiny import builtin_path

    broken = tmp_path / "broken-model"
    broken.mkdir()
    src = builtin_path("micro", 0)
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (broken / f.name).write_bytes(f.read_bytes())
    out = cli(
        "train", *TINY_RUN, f"run.output_dir={tmp_path}", "run.name=fail", f"model.path={broken}"
    )
    assert out.returncode == ExitCode.RUNTIME_FAILURE, out.stdout + out.stderr
    assert "run failed after" in out.stderr and "error.txt" in out.stderr
    assert (tmp_path / "fail" / "error.txt").read_text().strip()


def test_no_config_is_refused_pointing_at_the_quickstart(tmp_path):
    out = cli("train", cwd=tmp_path)
    assert out.returncode == ExitCode.CONFIG_ERROR
    assert "configs/quickstart.toml" in out.stderr and "--resume RUN_DIR" in out.stderr
    assert not any(tmp_path.iterdir())


def test_resume_keeps_the_saved_settings_and_refuses_or_lists_changes(tmp_path):
    """`--resume RUN_DIR` alone continues with RUN_DIR/config.toml; a config or overrides that
    change it are refused, naming each key, unless --allow-changes, which lists them and drops
    an evaluation before the change (other tasks) from the summary's comparison."""
    run = tmp_path / "r"
    start = ["train", *TINY_RUN, f"run.output_dir={tmp_path}", "run.name=r", "run.max_steps=1"]
    assert cli(*start).returncode == ExitCode.OK

    refused = cli("train", "configs/quickstart.toml", "--resume", str(run))
    assert refused.returncode == ExitCode.CONFIG_ERROR
    assert (
        "run.max_steps: 1 -> 60" in refused.stderr and "task.num_eval: 16 -> 200" in refused.stderr
    )
    assert "--allow-changes" in refused.stderr
    refused = cli("train", "--resume", str(run), "run.max_steps=2")
    assert refused.returncode == ExitCode.CONFIG_ERROR and "run.max_steps: 1 -> 2" in refused.stderr

    same = cli("train", "--resume", str(run))  # the saved settings: already at run.max_steps
    assert same.returncode == ExitCode.NOTHING_TRAINED, same.stdout + same.stderr
    assert f"resuming {run} after RL step 1 (checkpoint step_000001" in same.stdout
    assert "--allow-changes" in same.stderr

    changes = ["run.max_steps=2", "task.num_eval=8"]
    changed = cli("train", "--resume", str(run), *changes, "--allow-changes")
    assert changed.returncode == ExitCode.OK, changed.stdout + changed.stderr
    assert "run.max_steps: 1 -> 2" in changed.stdout and "task.num_eval: 16 -> 8" in changed.stdout
    assert "settings changed on resume" in changed.stdout
    assert "held-out accuracy before RL │ -" in changed.stdout  # 16 tasks then, 8 now
    assert "task.num_eval=8" not in (run / "config.toml").read_text()
    assert "num_eval = 8" in (run / "config.toml").read_text()
    assert len((run / "config_changes.txt").read_text().splitlines()) == 2


def test_version_and_null_override(tmp_path):
    out = cli("--version")
    assert out.returncode == 0 and out.stdout.startswith("reinforge ")
    from reinforge.config import TrainConfig, load_config

    cfg = load_config(
        TrainConfig, None, ["task.name=dataset", "task.path=a.jsonl", "task.eval_path=null"]
    )
    assert cfg.task.eval_path is None
    cfg = load_config(TrainConfig, None, ["model.tokenizer='null'"])
    assert cfg.model.tokenizer == "null"
