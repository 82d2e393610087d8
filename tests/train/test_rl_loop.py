"""The RL loop's phases on the micro model with a dense reward: the reward rises."""

import torch

from reinforge.checkpoint import TrainerState
from reinforge.config import TrainConfig, load_config
from reinforge.data.chat import render_prompt
from reinforge.models.loading import load_model, load_tokenizer, model_source
from reinforge.rollout.sources import rollout_groups
from reinforge.run import RunContext
from reinforge.tasks.arithmetic import ArithmeticTasks
from reinforge.train.loop import rl
from reinforge.train.loop.advantage_step import Algorithm, assign_advantages, build_step_batch
from reinforge.train.loop.learner import build_learner
from reinforge.train.loop.session import Policy, RunSetup, policy_engine
from reinforge.train.planner.memory import MemoryChoice


class DigitTasks(ArithmeticTasks):
    """Arithmetic prompts rewarded by the fraction of digit characters in the completion: a dense
    signal a random model earns some of, so a few GRPO steps must raise it."""

    def reward(self, completion: str, task) -> float:
        text = completion[:6]
        return sum(ch.isdigit() for ch in text) / 6


def micro_step_config(*overrides: str) -> TrainConfig:
    """The micro model with a small RL step (4 prompts x 4 samples of at most 6 new tokens), then
    `overrides`."""
    return load_config(
        TrainConfig,
        None,
        [
            "model.path=builtin:micro",
            "rollout.prompts_per_step=4",
            "rollout.samples_per_prompt=4",
            "rollout.max_new_tokens=6",
            *overrides,
        ],
    )


def make_policy(cfg):
    source = model_source(cfg.model.path, cfg.run.seed)
    tok = load_tokenizer(source)
    model = load_model(source, torch.device("cpu"), torch.float32)
    engine = policy_engine(cfg, model, tok, None)  # rollout.engine: "auto" takes the paged one
    memory = MemoryChoice(cfg.train.micro_batch_tokens, False, None, "set by the test")
    return Policy(model, tok, engine, source, RunSetup(source, model.device, model.dtype, memory))


def make_learner(cfg, tmp_path, policy=None):
    """The learner `train` builds for a fresh run (reference, value head, optimizer)."""
    ctx = RunContext(tmp_path / "run", resume=False, overwrite=False, config_toml="")
    policy = policy or make_policy(cfg)
    return build_learner(cfg, ctx, policy, None, TrainerState("rl", 0, 0))


def step_with_grads(cfg, learner, tasks=None):
    """One RL step on `tasks` (`DigitTasks`): its metrics and the gradient its optimizer step was
    given."""
    params = list(learner.policy.model.parameters())
    grads = []
    step = learner.optimizer.step

    def recording_step(*args, **kwargs):
        grads.extend(p.grad.detach().clone() for p in params)
        return step(*args, **kwargs)

    learner.optimizer.step = recording_step
    tasks = tasks if tasks is not None else DigitTasks(cfg.task)
    m = rl.rl_step(cfg, learner, tasks, TrainerState("rl", 0, 0), 1, NullLogger())
    return m, grads


class NullLogger:
    def log_samples(self, *a):
        pass


def test_grpo_steps_raise_a_dense_reward(tmp_path):
    torch.manual_seed(0)
    cfg = load_config(
        TrainConfig,
        None,
        [
            "model.path=builtin:micro",
            "rollout.prompts_per_step=8",
            "rollout.samples_per_prompt=8",
            "rollout.max_new_tokens=6",
            "optim.lr=3e-3",
            "train.micro_batch_tokens=4096",
            "run.max_steps=25",
            "algorithm.kl_coef=0",  # the settings this test was written for, before presets
            "algorithm.loss_aggregation=token_mean",
        ],
    )
    learner = make_learner(cfg, tmp_path)
    tasks = DigitTasks(cfg.task)
    state = TrainerState("rl", 0, 0)
    rewards = []
    for step in range(1, 26):
        m = rl.rl_step(cfg, learner, tasks, state, step, NullLogger())
        rewards.append(m["reward_mean"])
        assert m["kl_sampler"] < 1e-4  # sampler and trainer score the same tokens alike
        assert m["nonfinite_skipped"] == 0.0
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    print(f"dense reward: first 5 steps {first:.3f}, last 5 steps {last:.3f}")
    assert last > first + 0.2, rewards
    assert state.data_position == 25 * 8  # one integer data position: 8 prompts per step


def test_advantages_follow_rewards_within_groups():
    cfg = load_config(
        TrainConfig,
        None,
        [
            "model.path=builtin:micro",
            "rollout.samples_per_prompt=4",
            "rollout.prompts_per_step=2",
            "rollout.max_new_tokens=3",
        ],
    )
    policy = make_policy(cfg)
    tasks = DigitTasks(cfg.task)
    groups = rollout_groups(cfg, policy, tasks, [tasks.train_task(0), tasks.train_task(1)], seed=3)
    batch = build_step_batch(groups, cfg.algorithm, policy.device)
    assign_advantages(batch, Algorithm(cfg.algorithm), cfg.rollout.max_new_tokens)
    for g in groups:
        assert len(g.trajectories) == 4
        advs = [t.advantage for t in g.trajectories]
        assert abs(sum(advs)) < 1e-4  # centred per group
        best = max(g.trajectories, key=lambda t: t.reward)
        assert best.advantage == max(advs)
        for t in (
            g.trajectories
        ):  # token-in/token-out: the ids the sampler produced, with their logprobs
            assert len(t.completion.token_ids) == len(t.completion.logprobs) >= 1
            assert t.prompt_ids == render_prompt(policy.tokenizer, g.task.messages)


def test_shared_prompts_give_the_update_of_whole_sequences(tmp_path, monkeypatch):
    """`train.share_prompts` changes what the trainer computes, not what it learns: one GRPO step
    (with a KL reference, scored through the same packing) from the same seed gives the same
    loss, gradient norm and gradients with the group prompts run once as with every sequence
    whole. The step's micro-batches do share (the packing tests cover values and gradients)."""
    from reinforge.train.loop import update
    from reinforge.train.packing import forward

    packed = []

    def recording_pack_one(*args, **kwargs):
        batch = real_pack_one(*args, **kwargs)
        packed.append((batch.num_tokens, batch.key_index_J is not None))
        return batch

    real_pack_one = forward.pack_one
    # the reference's scoring packs through forward, the update through update's own packing
    monkeypatch.setattr(forward, "pack_one", recording_pack_one)
    monkeypatch.setattr(update, "pack_one", recording_pack_one)
    results = {}
    for share in (True, False):
        packed.clear()
        torch.manual_seed(0)
        cfg = micro_step_config(
            "optim.lr=3e-3",
            "train.micro_batch_tokens=120",
            "algorithm.kl_coef=0.05",
            f"train.share_prompts={str(share).lower()}",
        )
        learner = make_learner(cfg, tmp_path / str(share))
        m, grads = step_with_grads(cfg, learner)
        assert len(grads) == len(list(learner.policy.model.parameters()))  # the step was taken
        results[share] = (m, grads)
        # reference scoring and the update, in more than one micro-batch each
        assert len(packed) >= 4
        assert all(shared for _, shared in packed) == share, packed
    (shared, shared_w), (whole, whole_w) = results[True], results[False]
    for key in ("loss", "grad_norm", "kl_ref", "reward_mean"):
        assert key in shared, sorted(shared)
        assert abs(shared[key] - whole[key]) <= 1e-5 + 1e-4 * abs(whole[key]), key
    for a, b in zip(shared_w, whole_w):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)


def test_the_steps_rows_are_the_same_from_arrays_lists_and_a_mix():
    """`to_rows` joins rows that are all numpy arrays (single-turn loss masks) without walking
    them element by element; lists (the sampler's logprobs) and a mix give the same rows."""
    import numpy as np

    from reinforge.train.loop.advantage_step import to_rows

    arrays = [np.ones(3, dtype=np.float32), np.array([0.5, 0.25]), np.ones(0, dtype=np.float32)]
    lists = [[float(x) for x in row] for row in arrays]
    expected = torch.tensor([[1.0, 1.0, 1.0], [0.5, 0.25, 0.0], [0.0, 0.0, 0.0]])
    for rows in (arrays, lists, [arrays[0], lists[1], arrays[2]]):
        got = to_rows(rows)
        assert got.dtype == torch.float32
        assert torch.equal(got, expected)
