"""Every algorithm preset trains through the real loop (rollout, score, reference and values,
advantages, update) on the micro model and raises a dense reward; dynamic sampling drops and
counts zero-signal groups; a value head and an EMA baseline survive a checkpoint."""

import pytest
import torch

from reinforge.algorithms.table import PRESETS
from reinforge.checkpoint import TrainerState, latest_checkpoint, load_trainer_state
from reinforge.config import TrainConfig, load_config
from reinforge.run import RunContext
from reinforge.tasks.arithmetic import ArithmeticTasks
from reinforge.train import rl
from reinforge.train.learner import build_learner

from .test_rl_loop import DigitTasks, NullLogger, make_learner

NUM_STEPS = 10
# what each preset needs to fit this 6-token budget; everything else is the preset's own
FITS_THE_BUDGET = {"dapo": ["algorithm.overlong_buffer=2"]}


def micro_cfg(*overrides: str) -> TrainConfig:
    return load_config(
        TrainConfig,
        None,
        [
            "model.path=builtin:micro",
            "rollout.prompts_per_step=8",
            "rollout.samples_per_prompt=8",
            "rollout.max_new_tokens=6",
            "optim.lr=1e-2",
            "train.micro_batch_tokens=4096",
            f"run.max_steps={NUM_STEPS}",
            *overrides,
        ],
    )


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_raises_a_dense_reward(name, tmp_path):
    torch.manual_seed(0)
    cfg = micro_cfg(f"algorithm.name={name}", *FITS_THE_BUDGET.get(name, []))
    learner = make_learner(cfg, tmp_path)
    assert (learner.reference is not None) == (PRESETS[name]["kl_coef"] > 0)
    assert (learner.value_head is not None) == PRESETS[name]["value_model"]
    tasks, state = DigitTasks(cfg.task), TrainerState("rl", 0, 0)
    rewards = []
    for step in range(1, NUM_STEPS + 1):
        metrics = rl.rl_step(cfg, learner, tasks, state, step, NullLogger())
        assert metrics["nonfinite_skipped"] == 0.0
        rewards.append(metrics["reward_mean"])
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    print(f"{name}: dense reward {first:.3f} -> {last:.3f}")
    assert last > first + 0.2, rewards
    if PRESETS[name]["kl_coef"] > 0:
        assert "kl_ref" in metrics
    if PRESETS[name]["value_model"]:
        assert metrics["value_loss"] > 0 and "value_clip_frac" in metrics
    if PRESETS[name]["dynamic_sampling"]:
        assert metrics["sampling_rounds"] >= 1 and "dropped_groups" in metrics


class HalfFlatTasks(ArithmeticTasks):
    """Even-numbered training prompts earn 1.0 whatever the completion (a group with no signal);
    odd ones earn a completion-dependent reward (signal, almost surely)."""

    def reward(self, completion: str, task) -> float:
        if int(task.id.rsplit("-", 1)[1]) % 2 == 0:
            return 1.0
        return sum(map(ord, completion)) % 7 / 7


@pytest.mark.parametrize("max_rounds", [4, 1])
def test_dynamic_sampling_drops_flat_groups_and_counts_them(max_rounds):
    cfg = micro_cfg(
        "rollout.prompts_per_step=4",
        "rollout.samples_per_prompt=4",
        "algorithm.dynamic_sampling=true",
        f"algorithm.max_sampling_rounds={max_rounds}",
    )
    from .test_rl_loop import make_policy

    policy, tasks = make_policy(cfg), HalfFlatTasks(cfg.task)
    state = TrainerState("rl", 0, 0)
    sampled, chosen, metrics = rl.sample_groups(cfg, policy, tasks, state, step=1)
    flat = [len({t.reward for t in g.trajectories}) == 1 for g in chosen]
    if max_rounds == 4:
        # round 1: 4 prompts, 2 flat; round 2 samples 2 missing / keep rate 1/2 = 4 prompts
        assert metrics == {"sampling_rounds": 2.0, "dropped_groups": 4.0, "filled_groups": 0.0}
        assert len(sampled) == 8 and state.data_position == 8
        assert len(chosen) == 4 and not any(flat)
    else:  # capped after one round: the two flat groups fill the batch, and say so
        assert metrics == {"sampling_rounds": 1.0, "dropped_groups": 2.0, "filled_groups": 2.0}
        assert len(chosen) == 4 and sum(flat) == 2 and state.data_position == 4


def test_value_head_and_ema_baseline_are_saved_and_restored(tmp_path):
    cfg = micro_cfg("algorithm.name=ppo", "run.max_steps=2")
    learner = make_learner(cfg, tmp_path)
    tasks, state = DigitTasks(cfg.task), TrainerState("rl", 0, 0)
    for step in (1, 2):
        rl.rl_step(cfg, learner, tasks, state, step, NullLogger())
        state.step = step
    ctx = RunContext(tmp_path / "ppo-run", resume=False, overwrite=False, config_toml="")
    rl.save_rl(ctx, cfg, learner, state)
    ckpt = latest_checkpoint(ctx.run_dir)
    resumed = build_learner(cfg, ctx, learner.policy, ckpt, load_trainer_state(ckpt))
    head, again = learner.value_head.state_dict(), resumed.value_head.state_dict()
    assert head["proj.weight"].abs().sum() > 0  # it trained
    assert all(torch.equal(head[k], again[k]) for k in head)
    saved_groups = learner.optimizer.state_dict()["param_groups"]
    assert [g["lr"] for g in resumed.optimizer.state_dict()["param_groups"]] == [
        g["lr"] for g in saved_groups
    ]

    ema_cfg = micro_cfg("algorithm.advantage=ema_baseline", "algorithm.kl_coef=0")
    learner = make_learner(ema_cfg, tmp_path / "ema")
    for step in (1, 2):
        rl.rl_step(ema_cfg, learner, tasks, state, step, NullLogger())
    baseline = learner.algorithm.estimator.baseline.value
    assert baseline != 0.0
    ema_ctx = RunContext(tmp_path / "ema-run", resume=False, overwrite=False, config_toml="")
    rl.save_rl(ema_ctx, ema_cfg, learner, TrainerState("rl", 2, state.data_position))
    ckpt = latest_checkpoint(ema_ctx.run_dir)
    resumed = build_learner(ema_cfg, ema_ctx, learner.policy, ckpt, load_trainer_state(ckpt))
    assert resumed.algorithm.estimator.baseline.value == baseline
