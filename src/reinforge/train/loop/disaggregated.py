"""The generator's whole run in the disaggregated mode (`distributed.mode = "disaggregated"`):
the last rank samples every step's rollout with its own copy of the weights and sends each
trainer its share; the protocol and the trainers' side are `rollout.sources`.

Off-policy by k steps (`distributed.rollout_staleness = k`): rollout(t) may be sampled once the
generator holds the weights of step t - 1 - k or later, so step s trains on samples at most k
steps old, and up to k rollouts wait in a queue, each tagged with the optimizer step whose
weights sampled it. k = 0 waits for each step's weights (on-policy).

Two threads, so that sampling never holds up the trainers' hand-over: the main thread samples
(with the newest weights received, copied into the model between rollouts) and queues; the link
thread talks to the trainers in the protocol's order (receive the weights of step s - 1 into a
staging copy of the trainable tensors, then send rollout(s) once it is queued). The staging copy
costs the generator one more copy of the trainable tensors when k > 0 (with k = 0 the weights
land in the model itself: it never samples while they arrive). `kl_sampler` measures the
sampler/trainer gap and `algorithm.tis_cap` / `mis_low` / `mis_high` correct for it.

Both sides move the data position by the rollout's prompts; each rollout carries the position
after its own prompts, which the trainers take and checkpoint. Queued rollouts are not saved:
after a resume the generator starts from the checkpoint's weights and position and samples the
dropped steps again (the first rollout is then fresh, staleness 0).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Iterator

import torch

from reinforge import watchdog
from reinforge.distributed import rank, world_size
from reinforge.engine.cuda_graphs import CAPTURE_LOCK
from reinforge.envs.env_tasks import single_turn_tasks
from reinforge.rollout.sources import (
    Rollout,
    generator_rank,
    receive_weights,
    sample_groups,
    trainable,
)
from reinforge.run import RunContext, Summary
from reinforge.train.loop.session import load_policy, run_tasks


def generate_for_trainers(cfg, ctx: RunContext) -> Summary:
    """The generator's whole run: one rollout per step of the global batch, shared among the
    trainers (ranks 0 .. N - 2; this process is rank N - 1)."""
    assert rank() == 0 and world_size() == 1, "the generator samples the whole batch"
    policy, state, _ = load_policy(cfg, ctx)  # the latest checkpoint's weights on resume
    tasks = single_turn_tasks(run_tasks(cfg, policy), cfg.task.rewards)
    summary = Summary("train", ctx.run_dir, final_step=state.step)
    first, last = state.step + 1, cfg.run.max_steps
    ahead = Lookahead(trainable(policy.model), state.step, cfg.distributed.staleness)
    link = threading.Thread(
        target=ahead.serve_trainers, args=(first, last), name="trainer-link", daemon=True
    )
    link.start()
    for step in range(first, last + 1):
        with watchdog.phase("generation"):  # waiting for the trainers' weights
            if not ahead.take_weights(step):
                break
        start = time.perf_counter()
        _, groups, metrics = sample_groups(cfg, policy, tasks, state, step)
        seconds = time.perf_counter() - start
        tokens = sum(t.num_completion_tokens for g in groups for t in g.trajectories)
        metrics.update(sampler_generate_s=seconds, sampler_tokens_per_s=tokens / seconds)
        ahead.put(Rollout(groups, metrics, state.data_position, ahead.weights_step, step))
        summary.final_step, summary.steps_trained = step, step - first + 1
    link.join()
    ahead.raise_link_error()
    return summary


class Lookahead:
    """What the sampling thread and the link thread share: the queue of rollouts sampled
    ahead, the weights received (staged) and those in the model, under one condition."""

    def __init__(self, model_tensors: list[torch.Tensor], weights_step: int, staleness: int):
        self.model_tensors = model_tensors
        # k = 0 never samples while weights arrive: they can land in the model itself
        self.staging = [t.detach().clone() for t in model_tensors] if staleness else model_tensors
        self.staleness = staleness
        self.on_gpu = bool(model_tensors) and model_tensors[0].is_cuda
        self.weights_step = weights_step  # the optimizer step whose weights the model holds
        self.staged_step = weights_step  # the newest weights received
        self.queue: deque[Rollout] = deque()
        self.is_stopped = False  # the trainers stopped, or the link failed
        self.link_error: BaseException | None = None
        self.changed = threading.Condition()

    def take_weights(self, step: int) -> bool:
        """The sampling thread, before rollout(step): wait for the weights of step
        step - 1 - staleness or later, and load the newest received into the model. False:
        the trainers stopped."""
        with self.changed:
            self.changed.wait_for(
                lambda: self.is_stopped or self.staged_step >= step - 1 - self.staleness
            )
            if self.is_stopped:
                return False
            if self.staged_step > self.weights_step:
                if self.staging is not self.model_tensors:
                    with torch.no_grad():
                        for tensor, staged in zip(self.model_tensors, self.staging):
                            tensor.copy_(staged)
                self.weights_step = self.staged_step
        return True

    def put(self, rollout: Rollout) -> None:
        with self.changed:
            self.queue.append(rollout)
            self.changed.notify_all()

    def serve_trainers(self, first: int, last: int) -> None:
        """The link thread: for each step, the weights of the step before (after the first),
        then the step's rollout to each trainer, in that order (the trainers' order)."""
        if self.on_gpu:
            torch.cuda.set_device(self.staging[0].device)
        try:
            for step in range(first, last + 1):
                if step > first and not receive_weights(
                    self.staging, self.receive_lock(), lambda step=step: self.staged(step - 1)
                ):
                    break
                with self.changed:
                    self.changed.wait_for(lambda: bool(self.queue))
                    rollout = self.queue.popleft()
                assert rollout.step == step, (rollout.step, step)
                rollout.metrics["rollouts_queued"] = float(len(self.queue))
                send_shares(rollout, list(range(generator_rank())))
        except BaseException as error:  # re-raised by the sampling thread
            self.link_error = error
        finally:
            with self.changed:
                self.is_stopped = True
                self.changed.notify_all()

    @contextlib.contextmanager
    def receive_lock(self) -> Iterator[None]:
        """Held while weights arrive: the condition (the sampling thread copies the staging
        tensors under it) and, on a GPU, the engine's capture lock (a CUDA graph captured by the
        sampling thread meanwhile would be invalid)."""
        with self.changed, CAPTURE_LOCK if self.on_gpu else contextlib.nullcontext():
            yield

    def staged(self, weights_step: int) -> None:
        """(Holding the condition) the staging tensors now hold the weights of this step."""
        self.staged_step = weights_step
        self.changed.notify_all()

    def raise_link_error(self) -> None:
        if self.link_error is not None:
            raise self.link_error


def send_shares(rollout: Rollout, trainers: list[int]) -> None:
    """Each trainer its equal share of the rollout's groups, in rank order."""
    per_trainer = len(rollout.groups) // len(trainers)
    for index, trainer in enumerate(trainers):
        share = rollout.groups[index * per_trainer : (index + 1) * per_trainer]
        message = Rollout(
            share, rollout.metrics, rollout.data_position, rollout.weights_step, rollout.step
        )
        torch.distributed.send_object_list([message], dst=trainer)
