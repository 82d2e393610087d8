"""Where a step's groups come from: this process's engine, or the generator rank.

`sample_groups` is the one rollout of a training step, whatever the task: the step's prompts
(this rank's share, or this generator's), `rollout.samples_per_prompt` episodes of each through
`trajectories.play`, scored; with dynamic sampling (DAPO) rounds of it until enough groups carry
signal. `LocalRollouts` runs it here; `RemoteRollouts` is a trainer's side of the disaggregated
mode (`distributed.mode = "disaggregated"`), where the last `distributed.generators` ranks run it
for everyone, each for its slice of the prompts, and the trainers send their weights back (the
generators' loop: `train/loop/disaggregated.py`).

The disaggregated protocol (blocking messages in one order on both sides; rollouts point to
point, weights broadcast from rank 0 to every generator over `distributed.link_group`):

    trainer, step s:    after the first step, send the weights of step s - 1 (all trainers
                        gather them; the first sends); receive rollout(s) from each generator
                        in rank order (the groups of its slice that fall in this trainer's
                        share, possibly none); train step s
    generator, step s:  (its link thread) after the first step, receive the weights of step
                        s - 1 (or a stop); send each trainer, in rank order, its part of the
                        generator's slice of rollout(s) once it is sampled; meanwhile its
                        sampling thread samples ahead

Generator g's sends wait only on trainers receiving from generators before g, and those on
sends to trainers before, so the order cannot deadlock.

With k = `distributed.rollout_staleness`, rollout(t) is sampled from the weights of step
t - 1 - k or later (the newest received), so step s trains on samples up to k optimizer steps
old (`rollout_staleness` = s - 1 - `rollout_weights_step`, over the generators' oldest: 0 on the
first step after a start or resume). k = 0 is on-policy. Only the trainable tensors travel: the
whole model in full fine-tuning, the adapters under LoRA. The generators' side:
`train/loop/disaggregated.py`.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from reinforge import faults
from reinforge.algorithms.dapo import filter_zero_variance_groups
from reinforge.distributed import (
    combine_metrics,
    generator_ranks,
    is_launched,
    is_main,
    link_group,
    share,
)
from reinforge.engine.lora_merge import note_weights_changed
from reinforge.envs.agent_task import AgentTasks
from reinforge.envs.env_tasks import EnvTasks, single_turn_tasks
from reinforge.rollout.agents import play_agents
from reinforge.rollout.branching import Branching
from reinforge.rollout.sampling import rollout_sampling
from reinforge.rollout.trajectories import play
from reinforge.sharding import full_weights
from reinforge.types import Group

FIRST_TRAINER_RANK = 0  # it sends the weights


def sample_groups(
    cfg, policy, tasks: EnvTasks, state, step: int
) -> tuple[list[Group], list[Group], dict[str, float]]:
    """(every group sampled, the step's groups, metrics). Without dynamic sampling: one rollout of
    rollout.prompts_per_step prompts. With it (DAPO): rounds of rollouts, keeping only groups whose
    rewards differ, until the step has that many; each further round samples the prompts still
    missing divided by the keep rate so far. After algorithm.max_sampling_rounds the batch is
    filled with dropped groups (they add no advantage; `filled_groups` counts them).
    `state.data_position` moves past the prompts drawn."""
    want, a = cfg.rollout.prompts_per_step, cfg.algorithm
    tasks = single_turn_tasks(tasks, cfg.task.rewards)
    sampled: list[Group] = []
    kept: list[Group] = []
    errors = faults.RewardErrors()
    for round_index in range(a.max_sampling_rounds if a.dynamic_sampling else 1):
        missing = want - len(kept)
        num = want if not kept else min(want, math.ceil(missing * len(sampled) / len(kept)))
        mine = share(num)  # this rank's prompts of the round (all of them in one process)
        # this round's tasks and the next's: slow generators build them meanwhile, in workers
        tasks.prefetch([state.data_position + offset + i for offset in (0, num) for i in mine])
        batch_tasks = [tasks.train_task(state.data_position + i) for i in mine]
        state.data_position += num
        seed = rollout_seed(cfg, step, round_index)
        groups = rollout_groups(cfg, policy, tasks, batch_tasks, seed, mine.start, errors)
        sampled += groups
        if not a.dynamic_sampling:
            return sampled, groups, errors.metrics()
        kept += [g for g, keep in zip(groups, has_signal(groups)) if keep]
        if len(kept) >= want:
            break
    kept_ids = {id(g) for g in kept}
    chosen = (kept + [g for g in sampled if id(g) not in kept_ids])[:want]
    num_filled = max(want - len(kept), 0)
    return (
        sampled,
        chosen,
        {
            "sampling_rounds": float(round_index + 1),
            "dropped_groups": float(len(sampled) - len(kept)),
            "filled_groups": float(num_filled),
            **errors.metrics(),
        },
    )


def rollout_groups(
    cfg,
    policy,
    tasks,
    batch_tasks: list,
    seed: int,
    first_prompt_index: int = 0,
    errors: faults.RewardErrors | None = None,
) -> list[Group]:
    """`rollout.samples_per_prompt` scored episodes of each of `batch_tasks` (a task source
    without an env plays single-turn); `first_prompt_index`: where `batch_tasks` start in the
    step's prompts (this rank's share), so each prompt samples the same on any rank. Fails the
    run when every reward call of the rollout failed (`RewardErrors.check`)."""
    tasks = single_turn_tasks(tasks, cfg.task.rewards)
    errors = errors if errors is not None else faults.RewardErrors()
    params = rollout_sampling(cfg.rollout, policy.tokenizer, seed, first_prompt_index)
    num_failed_before = errors.num_failed
    with faults.site("generation"), full_weights(policy.model):
        args = (policy.engine, policy.tokenizer, tasks, batch_tasks, params.n, params, errors)
        if isinstance(tasks, AgentTasks):  # the user's agent plays (rollout/agents.py)
            groups = play_agents(*args, cfg.rollout.max_concurrent_agents)
        else:
            groups = play(
                *args,
                cfg.rollout.env_workers,
                continuous=cfg.rollout.continuous_episodes,
                branching=Branching.of(cfg.rollout.branching),
            )
    num_calls = sum(len(g.trajectories) for g in groups)
    errors.check(num_calls, errors.num_failed - num_failed_before)
    return groups


def rollout_seed(cfg, step: int, round_index: int) -> int:
    """Sampling seed of a step's rollout round: a pure function of (seed, step, round)."""
    return cfg.run.seed * 1_000_003 + step + round_index * 1_000_000_007


def has_signal(groups: list[Group]) -> list[bool]:
    rewards_B = torch.tensor([t.reward for g in groups for t in g.trajectories])
    sizes = [len(g.trajectories) for g in groups]
    return filter_zero_variance_groups(rewards_B, group_sizes=sizes).tolist()


@dataclass
class Rollout:
    """What the generator sends a trainer for one step."""

    groups: list[Group]  # this trainer's share (of one generator's slice)
    metrics: dict[str, float]  # the sampling's own (rounds, reward errors, generation time)
    data_position: int  # after this step's prompts
    weights_step: int  # the optimizer step whose weights sampled it
    step: int  # the training step it is for


class LocalRollouts:
    """Colocated (and one process): every rank samples its share of the step's prompts."""

    def sample(self, cfg, policy, tasks: EnvTasks, state, step: int):
        return sample_groups(cfg, policy, tasks, state, step)

    def close(self) -> None:
        pass


class RemoteRollouts:
    """A trainer's side: the rollouts come from the generator, the weights go back to it."""

    def __init__(self, first_step: int, max_steps: int):
        self.first_step, self.max_steps = first_step, max_steps
        self.generator_waits = False  # for the weights of the last step trained

    def sample(self, cfg, policy, tasks: EnvTasks, state, step: int):
        if step > self.first_step:
            send_weights(policy.model, go=True)
        self.generator_waits = False
        parts = [receive_rollout(generator) for generator in generator_ranks()]
        assert all(part.step == step for part in parts), ([p.step for p in parts], step)
        state.data_position = parts[0].data_position
        self.generator_waits = step < self.max_steps
        groups = [group for part in parts for group in part.groups]
        weights_step = min(part.weights_step for part in parts)  # the oldest samples
        # the generators' own metrics once, on the main trainer (the others add nothing to them)
        sampler = [part.metrics for part in parts] if is_main() else []
        metrics = {
            **combine_metrics(sampler, SAMPLER_SUMMED, SAMPLER_MAXED),
            "rollout_staleness": float(step - 1 - weights_step),
            "rollout_weights_step": float(weights_step),
        }
        return groups, groups, metrics

    def close(self) -> None:
        """After the last step trained: a generator still waiting for weights is told to stop
        (the trainers stopped early, on a signal or a failure)."""
        if self.generator_waits:
            send_weights(None, go=False)
            self.generator_waits = False


# How the generators' metrics of one rollout combine (the rest: means).
SAMPLER_SUMMED = {"sampler_tokens_per_s", "reward_errors", "reward_nonfinite"}
SAMPLER_MAXED = {"sampler_generate_s", "rollouts_queued"}


def receive_rollout(generator: int) -> Rollout:
    received: list = [None]
    torch.distributed.recv_object_list(received, src=generator)
    return received[0]


def rollout_source(cfg, state) -> LocalRollouts | RemoteRollouts:
    """Where a trainer's rollouts come from: its own engine, or (disaggregated, under torchrun)
    the generator, from the step after `state.step` on."""
    if is_launched() and cfg.distributed.mode == "disaggregated":
        return RemoteRollouts(state.step + 1, cfg.run.max_steps)
    return LocalRollouts()


def send_weights(model, go: bool) -> None:
    """Every trainer: gather the trainable weights; the first broadcasts them to the generator
    after a flag (1: weights follow, 0: stop)."""
    if is_main():
        torch.distributed.broadcast(
            torch.tensor([int(go)]), src=FIRST_TRAINER_RANK, group=link_group()
        )
    if not go:
        return
    with full_weights(model):
        if is_main():
            for tensor in trainable(model):
                torch.distributed.broadcast(tensor.data, src=FIRST_TRAINER_RANK, group=link_group())


def receive_weights(tensors: list[torch.Tensor], lock=None, on_received=None) -> bool:
    """The generator: the trainers' weights into `tensors` (the model's own trainable tensors,
    which its engine reads in place, or a staging copy of them); False when the trainers
    stopped instead. The tensors arrive holding `lock`, and `on_received` runs before it is
    released (the generator's link thread marks the staged weights' step)."""
    flag = torch.tensor([0])
    torch.distributed.broadcast(flag, src=FIRST_TRAINER_RANK, group=link_group())
    if not flag.item():
        return False
    with lock if lock is not None else contextlib.nullcontext():
        for tensor in tensors:
            torch.distributed.broadcast(tensor.data, src=FIRST_TRAINER_RANK, group=link_group())
        note_weights_changed()  # `.data` bumps no version: a merged LoRA copy is rebuilt
        if on_received is not None:
            on_received()
    return True


def trainable(model) -> list[torch.Tensor]:
    """The tensors training changes, in the same order on both sides (the same config builds
    the same model)."""
    return [p for p in model.parameters() if p.requires_grad]
