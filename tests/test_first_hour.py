"""What a new user meets in the first hour, in small pieces: quiet output (no library warnings),
the tool task's headline figures, the curves' panels, exported files' modes, where a resume
starts. The commands around them are run end to end in test_cli, test_base_install and
test_report_html."""

import json
import os
import warnings

import torch

from reinforge.metrics import format_line, plot_curves
from reinforge.report import headline_rows


def _tiny():
    from reinforge.models.loading import load_model, load_tokenizer
    from reinforge.models.tiny import builtin_path

    path = str(builtin_path("micro", 0))
    return load_model(path, torch.device("cpu"), torch.float32), load_tokenizer(path)


def test_skipped_first_step_advances_the_schedule_without_a_warning():
    """A first step whose gradient is not finite skips optimizer.step(); the schedule still
    advances (it counts trainer steps), which torch would report as a wrong call order."""
    from reinforge.train.policy.optim import build_optimizer
    from reinforge.train.sft import sft_step

    model, tok = _tiny()
    optimizer, scheduler = build_optimizer(
        model, 1e-3, (0.9, 0.99), 1e-8, 0.0, 2, 10, "cosine", 0.1
    )
    ids = tok.encode("1+1=2", add_special_tokens=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        metrics = sft_step(model, tok, optimizer, scheduler, [ids[:3]], [ids[3:]], 1.0, poison=True)
    assert metrics["nonfinite_skipped"] == 1.0 and scheduler.last_epoch == 1
    assert not [w for w in seen if "lr_scheduler" in str(w.message)], [str(w.message) for w in seen]


def test_simple_engine_generates_without_a_future_warning():
    from reinforge.engine.base import SamplingParams
    from reinforge.engine.simple import SimpleEngine

    model, tok = _tiny()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = SimpleEngine(model, tok).generate(
            [tok.encode("1+1=", add_special_tokens=False)],
            SamplingParams(max_new_tokens=3, ignore_eos=True),
        )
    assert len(out[0][0].token_ids) == 3
    assert not [w for w in seen if issubclass(w.category, FutureWarning)], [
        str(w.message) for w in seen
    ]


def _write_metrics(run_dir, rows):
    run_dir.mkdir(exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_tool_call_rate_in_the_step_line_the_summary_and_the_curves(tmp_path):
    rows = [
        {"step": 1, "phase": "sft", "loss": 2.0},
        {"step": 2, "phase": "sft", "loss": 1.0},
        {"step": 0, "phase": "rl", "eval_accuracy": 0.1, "eval_tool_call_rate": 0.2},
        {"step": 1, "phase": "rl", "reward_mean": 0.2, "accuracy": 0.2, "tool_call_rate": 0.14},
        {"step": 2, "phase": "rl", "reward_mean": 0.9, "accuracy": 0.9, "tool_call_rate": 1.0},
        {"step": 2, "phase": "rl", "eval_accuracy": 0.8, "eval_tool_call_rate": 0.95},
    ]
    _write_metrics(tmp_path, rows)
    assert "tools 1.00" in format_line(2, rows[4])
    assert headline_rows(tmp_path) == [
        ("tool-call rate, RL steps", "0.14 (step 1) -> 1.00 (step 2)"),
        ("tool-call rate, held-out", "0.20 (step 0) -> 0.95 (step 2)"),
    ]
    import matplotlib.image

    image = matplotlib.image.imread(plot_curves(tmp_path))
    assert image.shape[1] == 3 * 420  # reward, rates, SFT loss: three panels side by side


def test_exported_files_get_the_users_file_mode(tmp_path):
    from reinforge.export import _give_default_modes

    (tmp_path / "model.safetensors").write_bytes(b"x")
    (tmp_path / "model.safetensors").chmod(0o600)  # as safetensors writes it
    _give_default_modes(tmp_path)
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask


def test_doctor_names_each_command_and_the_serve_extra():
    from reinforge.doctor import OK, run_doctor

    report = run_doctor(smoke=False)
    checks = {c.name: c for c in report.checks}
    assert checks["commands"].value.startswith("train, sft, eval, export, report")
    assert "reinforge serve" in checks
    if not torch.cuda.is_available():  # no GPU: triton is not needed, so not a warning
        assert checks["triton"].status == OK
