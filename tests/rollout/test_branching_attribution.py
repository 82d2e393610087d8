"""Advantage attribution of branched episodes, by hand-computed examples."""

import json

import pytest
import torch

from reinforge.config import GRPOAlgorithm, RolloutSection
from reinforge.errors import ExitCode
from reinforge.rollout.branching import Branching, shared_lengths, shared_token_advantages
from reinforge.train.loop.advantage_step import Algorithm, assign_advantages, build_step_batch
from reinforge.types import Completion, Group, Message, Task, Trajectory

from ..conftest import REPO, cli

TASK = Task("t", (Message("user", "q"),), "")


def test_shared_lengths_follow_the_lineage():
    # 0 and 1 from the prompt; 2 branches off 0 at 5 tokens; 3 off 2 at 8; 4 off 0 at 3
    lineage = [(None, 0), (None, 0), (0, 5), (2, 8), (0, 3)]
    assert shared_lengths(lineage) == [
        [-1, 0, 5, 5, 3],
        [0, -1, 0, 0, 0],
        [5, 0, -1, 8, 3],
        [5, 0, 8, -1, 3],
        [3, 0, 3, 3, -1],
    ]


def traj(reward: float, length: int, shared=()) -> Trajectory:
    completion = Completion(list(range(length)), [0.0] * length, "stop")
    return Trajectory(TASK, [1, 2], completion, reward=reward, shared_tokens=tuple(shared))


def test_hard_attribution_means_over_the_branches_sharing_a_token():
    # episode 2 branched off episode 0 after 2 tokens; episode 1 shares nothing
    rows = shared_lengths([(None, 0), (None, 0), (0, 2)])
    trajs = [traj(0, 4, rows[0]), traj(0, 4, rows[1]), traj(0, 4, rows[2])]
    plain = [traj(0, 3), traj(0, 3), traj(0, 3)]  # a group without branches
    advantages = torch.tensor([1.0, -1.0, 0.5, 0.2, 0.3, 0.4])
    out = shared_token_advantages(advantages, trajs + plain, width=4)
    expected = [
        [0.75, 0.75, 1.0, 1.0],  # tokens 0-1 shared with episode 2: (1 + 0.5) / 2
        [-1.0, -1.0, -1.0, -1.0],
        [0.75, 0.75, 0.5, 0.5],
        [0.2] * 4,
        [0.3] * 4,
        [0.4] * 4,
    ]
    torch.testing.assert_close(out, torch.tensor(expected))
    # soft attribution (no shared_tokens): every token keeps its sequence's advantage
    assert shared_token_advantages(advantages, plain + plain, 4) is advantages


def test_hard_attribution_through_the_step_with_grpo():
    """GRPO advantages (r - mean) / std over the group, then shared tokens averaged."""
    rows = shared_lengths([(None, 0), (None, 0), (0, 2), (0, 2)])
    rewards = [1.0, 0.0, 0.0, 1.0]
    group = Group(TASK, [traj(r, 3, row) for r, row in zip(rewards, rows)])
    a = GRPOAlgorithm()
    batch = build_step_batch([group], a, torch.device("cpu"))
    assign_advantages(batch, Algorithm(a), max_new_tokens=3)
    mean, std = 0.5, torch.tensor(rewards).std().item()
    adv = [(r - mean) / (std + a.advantage_eps) for r in rewards]
    shared = (adv[0] + adv[2] + adv[3]) / 3  # the first 2 tokens of episodes 0, 2, 3
    expected = [
        [shared, shared, adv[0]],
        [adv[1]] * 3,
        [shared, shared, adv[2]],
        [shared, shared, adv[3]],
    ]
    torch.testing.assert_close(batch.advantages, torch.tensor(expected), atol=1e-5, rtol=0)


def test_branching_section_and_its_budget_rule():
    section = RolloutSection(samples_per_prompt=4, branching={"enabled": True, "tools": ["x"]})
    b = Branching.of(section.branching)
    assert b is not None and b.tools == ("x",) and b.initial_samples == 2
    assert Branching.of(RolloutSection().branching) is None
    assert b.should_branch([1.0, 1.2], initial=1.0) and not b.should_branch([0.9], initial=1.0)
    assert b.branches_after({"x"}) and not b.branches_after({"y"})
    with pytest.raises(ValueError, match="initial_samples=8 exceeds the budget"):
        RolloutSection(samples_per_prompt=4, branching={"enabled": True, "initial_samples": 8})


def test_the_branching_example_trains_a_step(tmp_path):
    """configs/tools_branching.toml through `reinforge train` (micro model, one short step)."""
    out = cli(
        "train",
        str(REPO / "configs" / "tools_branching.toml"),
        "model.path=builtin:micro",
        f"run.output_dir={tmp_path}",
        "run.max_steps=1",
        "sft.steps=0",
        "eval.num_tasks=2",
        "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=4",
        "rollout.branching.initial_samples=2",
        "rollout.max_new_tokens=24",
        "task.max_turns=2",
        "task.max_context=256",
        "train.micro_batch_tokens=1024",
        cwd=REPO,
    )
    assert out.returncode == ExitCode.OK, out.stdout[-2000:] + out.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "tools_branching" / "metrics.jsonl").open()]
    steps = [r for r in rows if r.get("phase") == "rl" and "tool_call_rate" in r]
    assert len(steps) == 1 and "reward_env" in steps[0]
