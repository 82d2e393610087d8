"""The generator's whole run in the disaggregated mode (`distributed.mode = "disaggregated"`):
the last rank samples every step's rollout with its own copy of the weights and sends each
trainer its share; the protocol and the trainers' side are `rollout.sources`. `kl_sampler`
measures the sampler/trainer gap and `algorithm.tis_cap` corrects for it. Both sides move the
data position by the rollout's prompts; the trainers' checkpoints hold it, and after a resume
the generator starts from the checkpoint's weights and position.
"""

from __future__ import annotations

import time

import torch

from reinforge import watchdog
from reinforge.distributed import rank, world_size
from reinforge.envs.env_tasks import single_turn_tasks
from reinforge.rollout.sources import Rollout, generator_rank, receive_weights, sample_groups
from reinforge.run import RunContext, Summary
from reinforge.train.session import load_policy, run_tasks


def generate_for_trainers(cfg, ctx: RunContext) -> Summary:
    """The generator's whole run: one rollout per step of the global batch, shared among the
    trainers (ranks 0 .. N - 2; this process is rank N - 1)."""
    assert rank() == 0 and world_size() == 1, "the generator samples the whole batch"
    policy, state, _ = load_policy(cfg, ctx)  # the latest checkpoint's weights on resume
    tasks = single_turn_tasks(run_tasks(cfg, policy), cfg.task.rewards)
    trainers = list(range(generator_rank()))
    summary = Summary("train", ctx.run_dir, final_step=state.step)
    first, weights_step = state.step + 1, state.step
    for step in range(first, cfg.run.max_steps + 1):
        start = time.perf_counter()
        _, groups, metrics = sample_groups(cfg, policy, tasks, state, step)
        seconds = time.perf_counter() - start
        tokens = sum(t.num_completion_tokens for g in groups for t in g.trajectories)
        metrics.update(sampler_generate_s=seconds, sampler_tokens_per_s=tokens / seconds)
        sampled_with = weights_step
        if step > first:
            with watchdog.phase("generation"):  # waiting for the trainers' step
                if not receive_weights(policy.model):
                    break
            weights_step = step - 1
        per_trainer = len(groups) // len(trainers)
        for index, trainer in enumerate(trainers):
            share = groups[index * per_trainer : (index + 1) * per_trainer]
            rollout = Rollout(share, metrics, state.data_position, sampled_with)
            torch.distributed.send_object_list([rollout], dst=trainer)
        summary.final_step, summary.steps_trained = step, step - first + 1
    return summary
