"""Checkpoints a crash cannot corrupt: a crash at any point of a save leaves the previous complete
checkpoint as the one a resume loads; an asynchronous save writes the state as it was when the
save was asked for; a non-finite state is never written; resuming cleans what a crash left."""

import hashlib

import pytest
import torch

from reinforge.checkpoint import (
    NonFiniteState,
    TrainerState,
    load_trainer_state,
    save_checkpoint,
    wait_for_saves,
)
from reinforge.checkpoint.files import (
    TMP_PREFIX,
    Saved,
    checkpoints_dir,
    clean_incomplete,
    latest_checkpoint,
)
from reinforge.faults import FaultPlan, InjectedFault, install
from reinforge.models.loading import load_model, load_tokenizer
from reinforge.models.tiny import builtin_path
from reinforge.train.policy.optim import build_optimizer


@pytest.fixture
def trainer():
    src = str(builtin_path("micro", 0))
    model, tok = load_model(src, torch.device("cpu"), torch.float32), load_tokenizer(src)
    opt, sched = build_optimizer(model, 1e-3, (0.9, 0.99), 1e-8, 0.0, 0, 100, "constant", 1.0)
    return model, tok, opt, sched


def train_step(model, opt) -> None:
    loss = sum((p.float() ** 2).mean() for p in model.parameters())
    loss.backward()
    opt.step()
    opt.zero_grad()


def file_hash(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def save(tmp_path, trainer, step: int, **kwargs):
    model, tok, opt, sched = trainer
    state = TrainerState("rl", step, step * 4)
    saved = Saved(model, tok, state, opt, sched)
    return save_checkpoint(tmp_path, f"step_{step:06d}", saved, 2, **kwargs)


def crash_point(root) -> str:
    """Where the interrupted save stood, from what it left on disk."""
    tmp = list(root.glob(TMP_PREFIX + "*"))
    if tmp:
        return "before the rename" if (tmp[0] / "trainer_state.json").exists() else "after weights"
    return "before the pointer"


def test_a_crash_anywhere_in_a_save_leaves_the_previous_checkpoint(tmp_path, trainer):
    model, _, opt, _ = trainer
    root = checkpoints_dir(tmp_path)
    save(tmp_path, trainer, 0)
    good = {"step_000000": file_hash(root / "step_000000" / "model.safetensors")}
    install(FaultPlan(rates={"checkpoint": 0.3}, seed=3))
    crashes: dict[str, int] = {}
    num_picked_previous = 0
    try:
        for step in range(1, 16):
            train_step(model, opt)
            try:
                save(tmp_path, trainer, step)
                good[f"step_{step:06d}"] = file_hash(
                    root / f"step_{step:06d}" / "model.safetensors"
                )
                continue
            except InjectedFault:
                point = crash_point(root)
                crashes[point] = crashes.get(point, 0) + 1
            # a resume now: clean what the crash left, load the latest
            clean_incomplete(tmp_path)
            latest = latest_checkpoint(tmp_path)
            state = load_trainer_state(latest)
            previous = max(n for n in good if n != f"step_{step:06d}")
            num_picked_previous += (
                latest.name == previous
                and state.step == int(previous[5:])
                and file_hash(latest / "model.safetensors") == good[previous]
                and not list(root.glob(TMP_PREFIX + "*"))
                and not (root / f"step_{step:06d}").exists()
            )
    finally:
        install(None)
    num_crashes = sum(crashes.values())
    print(
        f"\ncrash during a save: {num_crashes} crashes ({crashes}); resume picked the previous "
        f"complete checkpoint {num_picked_previous}/{num_crashes}"
    )
    assert len(crashes) == 3  # every point of a save was hit
    assert num_picked_previous == num_crashes


def test_async_save_writes_the_state_it_was_given(tmp_path, trainer):
    model, _, opt, _ = trainer
    train_step(model, opt)
    save(tmp_path / "sync", trainer, 1)
    save(tmp_path / "async", trainer, 1, asynchronous=True)
    with torch.no_grad():  # training goes on at once, in place, while the save is in flight
        for p in model.parameters():
            p.add_(1.0)
    for group in opt.state.values():
        group["exp_avg"].add_(1.0)
    wait_for_saves()
    a, b = (p / "checkpoints" / "step_000001" for p in (tmp_path / "sync", tmp_path / "async"))
    assert file_hash(a / "model.safetensors") == file_hash(b / "model.safetensors")
    opt_a, opt_b = (torch.load(p / "optimizer.pt", weights_only=False) for p in (a, b))
    for key, state in opt_a["optimizer"]["state"].items():
        assert torch.equal(state["exp_avg"], opt_b["optimizer"]["state"][key]["exp_avg"])
    assert latest_checkpoint(tmp_path / "async").name == "step_000001"


def test_async_save_errors_surface_at_the_next_save(tmp_path, trainer):
    install(FaultPlan(rates={"checkpoint": 1.0}))
    try:
        path = save(tmp_path, trainer, 1, asynchronous=True)  # returns before writing
        with pytest.raises(InjectedFault):
            wait_for_saves()
    finally:
        install(None)
    assert not path.exists() and latest_checkpoint(tmp_path) is None


def test_a_non_finite_state_is_never_checkpointed(tmp_path, trainer):
    model = trainer[0]
    save(tmp_path, trainer, 1)
    with torch.no_grad():
        next(model.parameters())[0, 0] = float("nan")
    with pytest.raises(NonFiniteState, match="NaN or infinity"):
        save(tmp_path, trainer, 2)
    assert latest_checkpoint(tmp_path).name == "step_000001"
    assert sorted(p.name for p in checkpoints_dir(tmp_path).iterdir()) == ["latest", "step_000001"]


def test_resume_cleans_half_written_and_newer_folders(tmp_path, trainer):
    for step in (1, 2):
        save(tmp_path, trainer, step)
    root = checkpoints_dir(tmp_path)
    (root / "latest").write_text("step_000001")  # as if killed between rename and pointer
    (root / f"{TMP_PREFIX}step_000003").mkdir()
    (root / "latest.tmp").write_text("step_000003")
    removed = clean_incomplete(tmp_path)
    assert sorted(removed) == [f"{TMP_PREFIX}step_000003", "latest.tmp", "step_000002"]
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001"]
