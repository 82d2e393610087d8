"""Disaggregated RL under torchrun (`distributed.mode = "disaggregated"`): the last rank generates
every rollout with its own copy of the weights; the other ranks train on them (FSDP2 among
themselves when there are several; rank 0, the first trainer, writes the run's files). The
two overlap: while the trainers run step s, the generator samples step s + 1's rollout with the
weights it has.

The protocol (blocking messages; rollouts point to point, weights broadcast from rank 0 to the
generator over `distributed.link_group`):

    generator, step s:  sample rollout(s); then, after the first step, receive the weights of
                        step s - 1 (or a stop); send each trainer its share of rollout(s)
    trainer, step s:    after the first step, send the weights of step s - 1 (all trainers
                        gather them; the first sends); receive rollout(s); train step s

So step s trains on samples from the weights of step s - 2: one optimizer step stale
(`rollout_staleness`: 0 on the first step after a start or resume, then 1). `kl_sampler`
measures the sampler/trainer gap and `algorithm.tis_cap` corrects for it (truncated importance
sampling, `algorithms.mismatch`). Only the trainable tensors travel: the whole model in full
fine-tuning, the adapters under LoRA. Both sides move the data position by the rollout's
prompts; the trainers' checkpoints hold it, and after a resume the generator starts from the
checkpoint's weights and position.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from reinforge import watchdog
from reinforge.checkpoint import TrainerState
from reinforge.distributed import full_weights, is_launched, is_main, link_group, rank, world_size
from reinforge.run import RunContext, Summary
from reinforge.types import Group

FIRST_TRAINER_RANK = 0  # it sends the weights


def generator_rank() -> int:
    return torch.distributed.get_world_size() - 1


@dataclass
class Rollout:
    """What the generator sends a trainer for one step."""

    groups: list[Group]  # this trainer's share
    metrics: dict[str, float]  # the sampling's own (rounds, reward errors, generation time)
    data_position: int  # after this step's prompts
    weights_step: int  # the optimizer step whose weights sampled it


class LocalRollouts:
    """Colocated (and one process): every rank samples its share of the step's prompts."""

    def sample(self, cfg, policy, tasks, state: TrainerState, step: int):
        from reinforge.train.rl import sample_groups

        return sample_groups(cfg, policy, tasks, state, step)

    def close(self) -> None:
        pass


class RemoteRollouts:
    """A trainer's side: the rollouts come from the generator, the weights go back to it."""

    def __init__(self, first_step: int, max_steps: int):
        self.first_step, self.max_steps = first_step, max_steps
        self.generator_waits = False  # for the weights of the last step trained

    def sample(self, cfg, policy, tasks, state: TrainerState, step: int):
        if step > self.first_step:
            send_weights(policy.model, go=True)
        self.generator_waits = False
        received: list = [None]
        torch.distributed.recv_object_list(received, src=generator_rank())
        rollout: Rollout = received[0]
        state.data_position = rollout.data_position
        self.generator_waits = step < self.max_steps
        metrics = {**rollout.metrics, "rollout_staleness": float(step - 1 - rollout.weights_step)}
        return rollout.groups, rollout.groups, metrics

    def close(self) -> None:
        """After the last step trained: a generator still waiting for weights is told to stop
        (the trainers stopped early, on a signal or a failure)."""
        if self.generator_waits:
            send_weights(None, go=False)
            self.generator_waits = False


def rollout_source(cfg, state: TrainerState) -> LocalRollouts | RemoteRollouts:
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


def receive_weights(model) -> bool:
    """The generator: the trainers' weights into its own model, in place (its engine reads them
    there); False when the trainers stopped instead."""
    flag = torch.tensor([0])
    torch.distributed.broadcast(flag, src=FIRST_TRAINER_RANK, group=link_group())
    if not flag.item():
        return False
    for tensor in trainable(model):
        torch.distributed.broadcast(tensor.data, src=FIRST_TRAINER_RANK, group=link_group())
    return True


def trainable(model) -> list[torch.Tensor]:
    """The tensors training changes, in the same order on both sides (the same config builds
    the same model)."""
    return [p for p in model.parameters() if p.requires_grad]


def generate_for_trainers(cfg, ctx: RunContext) -> Summary:
    """The generator's whole run: one rollout per step of the global batch, shared among the
    trainers (ranks 0 .. N - 2; this process is rank N - 1)."""
    from reinforge.tasks import task_source_for
    from reinforge.train.rl import sample_groups
    from reinforge.train.session import load_policy

    assert rank() == 0 and world_size() == 1, "the generator samples the whole batch"
    policy, state, _ = load_policy(cfg, ctx)  # the latest checkpoint's weights on resume
    tasks = task_source_for(cfg, policy.tokenizer)
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
