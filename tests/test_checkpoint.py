import shutil

import pytest
import torch

from reinforge.checkpoint import (
    TMP_PREFIX,
    TrainerState,
    check_disk_room,
    checkpoint_bytes,
    latest_checkpoint,
    load_trainer_state,
    save_checkpoint,
)
from reinforge.errors import ConfigError
from reinforge.models.tiny import builtin_path
from reinforge.train.common import load_model, load_tokenizer
from reinforge.train.optim import build_optimizer


def test_save_is_atomic_pruned_and_loadable(tmp_path):
    src = str(builtin_path("micro", 0))
    model, tok = load_model(src, torch.device("cpu"), torch.float32), load_tokenizer(src)
    opt, sched = build_optimizer(model, 1e-3, (0.9, 0.99), 1e-8, 0.0, 0, 10, "constant", 1.0)
    (tmp_path / "checkpoints" / f"{TMP_PREFIX}step_000009").mkdir(parents=True)  # a crashed save
    for step in (1, 2, 3):
        save_checkpoint(
            tmp_path,
            f"step_{step:06d}",
            model,
            tok,
            opt,
            sched,
            TrainerState("rl", step, step * 4),
            keep_last=2,
        )
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["latest", "step_000002", "step_000003"]  # pruned, half-written folder removed
    latest = latest_checkpoint(tmp_path)
    assert latest.name == "step_000003" and load_trainer_state(latest).data_position == 12
    reloaded = load_model(str(latest), torch.device("cpu"), torch.float32)  # a plain HF checkpoint
    for (n, a), (_, b) in zip(model.state_dict().items(), reloaded.state_dict().items()):
        assert torch.equal(a, b), n


def test_a_checkpoint_that_cannot_fit_on_the_disk_is_refused_before_training(tmp_path):
    model = torch.nn.Linear(10, 10)  # 110 float32 parameters
    model.bias.requires_grad_(False)
    assert checkpoint_bytes(model, optimizer_state_bytes=8) == 110 * 4 + 100 * 8
    run_dir = tmp_path / "runs" / "not_yet_created"  # the nearest existing folder is measured
    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(ConfigError) as err:
        check_disk_room(run_dir, need=free + (1 << 40), keep_last=2)
    message = str(err.value)
    assert "GiB (weights and optimizer states)" in message
    assert str(tmp_path) in message and "set run.output_dir to a folder on a disk" in message
    # room for two while keep_last = 2 needs three at the moment a new one is written
    warning = check_disk_room(run_dir, need=free // 2 - (64 << 20), keep_last=2)
    assert warning is not None and "room for 2 checkpoint(s)" in warning
    assert "set checkpoint.keep_last = 1" in warning
    assert check_disk_room(run_dir, need=1 << 20, keep_last=2) is None
