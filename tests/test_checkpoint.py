import json
import shutil
import time

import pytest
import torch

from reinforge.checkpoint import (
    TrainerState,
    check_disk_room,
    checkpoint_bytes,
    load_trainer_state,
    prepare_resume,
    save_checkpoint,
)
from reinforge.checkpoint.files import TMP_PREFIX, Saved, latest_checkpoint
from reinforge.checkpoint.manifest import (
    MANIFEST,
    CheckpointDamaged,
    file_hash,
    find_damage,
)
from reinforge.errors import ConfigError
from reinforge.models.loading import load_model, load_tokenizer
from reinforge.models.tiny import builtin_path
from reinforge.train.policy.optim import build_optimizer


def test_save_is_atomic_pruned_and_loadable(tmp_path):
    src = str(builtin_path("micro", 0))
    model, tok = load_model(src, torch.device("cpu"), torch.float32), load_tokenizer(src)
    opt, sched = build_optimizer(model, 1e-3, (0.9, 0.99), 1e-8, 0.0, 0, 10, "constant", 1.0)
    (tmp_path / "checkpoints" / f"{TMP_PREFIX}step_000009").mkdir(parents=True)  # a crashed save
    for step in (1, 2, 3):
        saved = Saved(model, tok, TrainerState("rl", step, step * 4), opt, sched)
        save_checkpoint(tmp_path, f"step_{step:06d}", saved, keep_last=2)
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


@pytest.fixture
def three_saves(tmp_path):
    """A run directory with checkpoints step_000001..3 of the micro model (latest: 3)."""
    src = str(builtin_path("micro", 0))
    model, tok = load_model(src, torch.device("cpu"), torch.float32), load_tokenizer(src)
    opt, sched = build_optimizer(model, 1e-3, (0.9, 0.99), 1e-8, 0.0, 0, 10, "constant", 1.0)
    for step in (1, 2, 3):
        state = TrainerState("rl", step, step * 4)
        save_checkpoint(
            tmp_path, f"step_{step:06d}", Saved(model, tok, state, opt, sched), keep_last=3
        )
    return tmp_path, tmp_path / "checkpoints"


def flip_byte(path, offset_fraction=0.5):
    data = bytearray(path.read_bytes())
    data[int(len(data) * offset_fraction)] ^= 0x01
    path.write_bytes(bytes(data))


def test_the_manifest_hashes_every_file_and_names_each_kind_of_damage(three_saves):
    _, root = three_saves
    folder = root / "step_000003"
    files = json.loads((folder / MANIFEST).read_text())["files"]
    on_disk = {p.name for p in folder.iterdir() if p.name != MANIFEST}
    assert set(files) == on_disk >= {"model.safetensors", "optimizer.pt", "rng.pt"}
    weights = folder / "model.safetensors"
    assert files["model.safetensors"]["hash"] == file_hash(weights)
    assert find_damage(folder) == []
    flip_byte(weights)  # one bit, inside the tensors
    assert find_damage(folder) == [
        "model.safetensors: its bytes differ from the manifest's hash (altered on disk)"
    ]
    with open(folder / "optimizer.pt", "r+b") as f:
        f.truncate(100)
    (folder / "rng.pt").unlink()
    damage = find_damage(folder)
    assert len(damage) == 3
    assert any(d.startswith("optimizer.pt: 100 bytes, the manifest says") for d in damage)
    assert "rng.pt: missing" in damage


def test_a_damaged_latest_refuses_or_falls_back_to_the_previous_intact_one(three_saves):
    run_dir, root = three_saves
    flip_byte(root / "step_000003" / "model.safetensors")
    with open(root / "step_000002" / "model.safetensors", "r+b") as f:
        f.truncate(1000)
    with pytest.raises(CheckpointDamaged) as refused:
        prepare_resume(run_dir, "error")
    message = str(refused.value)
    assert "checkpoint step_000003" in message and "step_000002 is damaged too" in message
    assert "newest intact checkpoint is step_000001" in message
    assert "checkpoint.on_damaged=previous" in message
    assert latest_checkpoint(run_dir).name == "step_000003"  # refusing changes nothing

    notes = prepare_resume(run_dir, "previous")
    assert "resuming from step_000001" in notes[-1]
    assert latest_checkpoint(run_dir).name == "step_000001"
    kept = sorted(p.name for p in root.iterdir())
    assert kept == ["damaged-step_000002", "damaged-step_000003", "latest", "step_000001"]


def test_nothing_intact_means_nothing_to_resume(three_saves):
    run_dir, root = three_saves
    for step in (1, 2, 3):
        (root / f"step_{step:06d}" / "trainer_state.json").write_text("{}")
    with pytest.raises(CheckpointDamaged, match="no earlier checkpoint is intact"):
        prepare_resume(run_dir, "previous")


def test_a_checkpoint_without_a_manifest_resumes_unverified(three_saves):
    run_dir, root = three_saves
    (root / "step_000003" / MANIFEST).unlink()  # as written before manifests existed
    (notes,) = prepare_resume(run_dir, "error")
    assert "no manifest.json; loaded unverified" in notes
    assert latest_checkpoint(run_dir).name == "step_000003"


def test_hashing_costs_little_beside_the_save(tmp_path):
    # The manifest's hash reads back what the save just wrote (from the page cache): on a
    # 100 MB safetensors file it must cost a small fraction of writing it.
    from safetensors.torch import save_file

    path = tmp_path / "big.safetensors"
    tensors = {"w": torch.randn(25 << 20)}  # 100 MiB of float32
    start = time.perf_counter()
    save_file(tensors, path)
    save_s = time.perf_counter() - start
    start = time.perf_counter()
    file_hash(path)
    hash_s = time.perf_counter() - start
    assert hash_s < 0.5 * save_s, f"hash {hash_s:.3f} s vs save {save_s:.3f} s"
