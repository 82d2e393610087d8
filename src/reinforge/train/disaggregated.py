"""The generator's whole run in the disaggregated mode (`distributed.mode = "disaggregated"`):
the last rank samples every step's rollout with its own copy of the weights and sends each
trainer its share; the protocol and the trainers' side are `rollout.sources`.

Off-policy by k steps (`distributed.rollout_staleness = k`): the generator keeps up to k sampled
rollouts queued ahead of the step the trainers are on, each tagged with the optimizer step whose
weights sampled it. Rollout(t) may be sampled once the generator holds the weights of step
t - 1 - k or later, so step s trains on samples at most k steps old; k = 0 waits for each step's
weights (on-policy). The messages keep one order on both sides (weights of step s - 1, then
rollout(s)); sampling ahead happens between them, while the trainers train. `kl_sampler`
measures the sampler/trainer gap and `algorithm.tis_cap` / `mis_low` / `mis_high` correct for it.

Both sides move the data position by the rollout's prompts; each rollout carries the position
after its own prompts, which the trainers take and checkpoint. Queued rollouts are not saved:
after a resume the generator starts from the checkpoint's weights and position and samples the
dropped steps again (their first rollout is then fresh, staleness 0).
"""

from __future__ import annotations

import time
from collections import deque

import torch

from reinforge import watchdog
from reinforge.distributed import rank, world_size
from reinforge.envs.env_tasks import single_turn_tasks
from reinforge.rollout.sources import Rollout, generator_rank, receive_weights, sample_groups
from reinforge.run import RunContext, Summary
from reinforge.tasks import task_source_for
from reinforge.train.session import load_policy


def generate_for_trainers(cfg, ctx: RunContext) -> Summary:
    """The generator's whole run: one rollout per step of the global batch, shared among the
    trainers (ranks 0 .. N - 2; this process is rank N - 1)."""
    assert rank() == 0 and world_size() == 1, "the generator samples the whole batch"
    policy, state, _ = load_policy(cfg, ctx)  # the latest checkpoint's weights on resume
    tasks = single_turn_tasks(task_source_for(cfg, policy.tokenizer), cfg.task.rewards)
    trainers = list(range(generator_rank()))
    summary = Summary("train", ctx.run_dir, final_step=state.step)
    first, k = state.step + 1, cfg.distributed.staleness
    ahead = Lookahead(cfg, policy, tasks, state, k)
    for step in range(first, cfg.run.max_steps + 1):
        if step > first:
            with watchdog.phase("generation"):  # waiting for the trainers' step
                if not receive_weights(policy.model):
                    break
            ahead.weights_step = step - 1
        ahead.sample_until(step)  # this step's rollout, unless sampled ahead already
        rollout = ahead.queue.popleft()
        assert rollout.step == step, (rollout.step, step)
        rollout.metrics["rollouts_queued"] = float(len(ahead.queue))
        send_shares(rollout, trainers)
        ahead.sample_until(step + k)  # while the trainers train this step
        summary.final_step, summary.steps_trained = step, step - first + 1
    return summary


class Lookahead:
    """The generator's queue of rollouts sampled ahead, and the weights it holds."""

    def __init__(self, cfg, policy, tasks, state, staleness: int) -> None:
        self.cfg, self.policy, self.tasks, self.state = cfg, policy, tasks, state
        self.staleness = staleness
        self.weights_step = state.step  # the optimizer step whose weights the model holds
        self.next_step = state.step + 1  # the next rollout to sample
        self.queue: deque[Rollout] = deque()

    def sample_until(self, last: int) -> None:
        """Sample rollouts up to step `last` (and run.max_steps) that the weights held may
        sample: rollout(t) needs the weights of step t - 1 - staleness or later."""
        last = min(last, self.cfg.run.max_steps)
        while self.next_step <= last and self.weights_step >= self.next_step - 1 - self.staleness:
            self.queue.append(self.sample(self.next_step))
            self.next_step += 1

    def sample(self, step: int) -> Rollout:
        start = time.perf_counter()
        _, groups, metrics = sample_groups(self.cfg, self.policy, self.tasks, self.state, step)
        seconds = time.perf_counter() - start
        tokens = sum(t.num_completion_tokens for g in groups for t in g.trajectories)
        metrics.update(sampler_generate_s=seconds, sampler_tokens_per_s=tokens / seconds)
        return Rollout(groups, metrics, self.state.data_position, self.weights_step, step)


def send_shares(rollout: Rollout, trainers: list[int]) -> None:
    """Each trainer its equal share of the rollout's groups, in rank order."""
    per_trainer = len(rollout.groups) // len(trainers)
    for index, trainer in enumerate(trainers):
        share = rollout.groups[index * per_trainer : (index + 1) * per_trainer]
        message = Rollout(
            share, rollout.metrics, rollout.data_position, rollout.weights_step, rollout.step
        )
        torch.distributed.send_object_list([message], dst=trainer)
