"""Exact resume at an epoch boundary: a dataset run that ends where its first epoch ends and is
resumed into the second epoch (which visits the rows in a new seeded order) trains on the same
tasks and ends with the same weights as a run that never stopped."""

from safetensors.torch import load_file

from reinforge.config import TrainConfig, load_config, to_toml
from reinforge.metrics import read_metrics
from reinforge.run import RunContext
from reinforge.train.loop.rl import train

from ..conftest import TINY_RUN
from ..data.conftest import write_jsonl


def config(tmp_path, name: str, max_steps: int) -> TrainConfig:
    rows = [{"prompt": f"{i} + 1 =", "answer": str(i + 1)} for i in range(10)]
    data = write_jsonl(tmp_path / "sums.jsonl", rows)
    settings = [
        *[s for s in TINY_RUN if not s.startswith("task.")],
        "task.name=dataset",
        f"task.path={data}",
        "task.eval_fraction=0.2",  # 8 training rows: 2 steps of 4 prompts are one epoch
        "task.reward=exact_match",
        "eval.before_train=false",
        "checkpoint.every=0",
        f"run.max_steps={max_steps}",
        f"run.output_dir={tmp_path}",
        f"run.name={name}",
    ]
    return load_config(TrainConfig, None, settings)


def prompts_by_step(run_dir) -> list[tuple[int, str]]:
    rows = read_metrics(run_dir / "samples.jsonl")
    return [(r["step"], r["prompt"]) for r in rows]


def test_resume_exactly_at_an_epoch_boundary(tmp_path):
    cfg = config(tmp_path, "straight", 4)
    train(cfg, RunContext(tmp_path / "straight", False, False, to_toml(cfg)))
    cfg = config(tmp_path, "resumed", 2)  # ends at data position 8: the end of epoch 0
    train(cfg, RunContext(tmp_path / "resumed", False, False, to_toml(cfg)))
    cfg = config(tmp_path, "resumed", 4)
    train(cfg, RunContext(tmp_path / "resumed", True, False, to_toml(cfg)))

    straight, resumed = (tmp_path / name for name in ("straight", "resumed"))
    assert prompts_by_step(resumed) == prompts_by_step(straight)
    epochs = [{p for s, p in prompts_by_step(straight) if (s - 1) // 2 == e} for e in (0, 1)]
    assert epochs[0] == epochs[1] and len(epochs[0]) >= 4  # the second epoch: the same rows
    a, b = (
        load_file(r / "checkpoints" / "step_000004" / "model.safetensors")
        for r in (straight, resumed)
    )
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
