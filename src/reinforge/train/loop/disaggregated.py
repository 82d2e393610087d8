"""A generator's whole run in the disaggregated mode (`distributed.mode = "disaggregated"`):
the last `distributed.generators` ranks sample every step's rollout, each its slice of the
prompts (`distributed.generator_share`) with its own copy of the weights, and send each trainer
the part of the slice that falls in the trainer's share; the protocol and the trainers' side
are `rollout.sources`. A prompt samples the same on any generator (the sampler keys its noise by
the global prompt index), so the rollout does not depend on how many generators there are.

Off-policy by k steps (`distributed.rollout_staleness = k`, per generator): rollout(t) may be
sampled once a generator holds the weights of step t - 1 - k or later, so step s trains on
samples at most k steps old, and up to k rollouts wait in a queue, each tagged with the
optimizer step whose weights sampled it. k = 0 waits for each step's weights (on-policy).

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
from reinforge.distributed import generator_ranks, rank, share, world_size
from reinforge.engine.cuda_graphs import CAPTURE_LOCK
from reinforge.envs.env_tasks import single_turn_tasks
from reinforge.rollout.sources import Rollout, receive_weights, sample_groups, trainable
from reinforge.run import RunContext, Summary
from reinforge.train.loop.session import load_policy, run_tasks


def generate_for_trainers(cfg, ctx: RunContext) -> Summary:
    """A generator's whole run: its slice of every step's rollout, shared among the trainers
    (ranks 0 .. N - G - 1; the generators are the last G)."""
    assert rank() == 0 and world_size() == 1, "a generator trains with no one"
    policy, state, _ = load_policy(cfg, ctx)  # the latest checkpoint's weights on resume
    tasks = single_turn_tasks(run_tasks(cfg, policy), cfg.task.rewards)
    summary = Summary("train", ctx.run_dir, final_step=state.step)
    first, last = state.step + 1, cfg.run.max_steps
    count = cfg.rollout.prompts_per_step
    ahead = Lookahead(
        trainable(policy.model), state.step, cfg.distributed.staleness, share(count), count
    )
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

    def __init__(
        self,
        model_tensors: list[torch.Tensor],
        weights_step: int,
        staleness: int,
        prompts: range = range(0),
        count: int = 0,
    ):
        self.model_tensors = model_tensors
        # k = 0 never samples while weights arrive: they can land in the model itself
        self.staging = [t.detach().clone() for t in model_tensors] if staleness else model_tensors
        self.staleness = staleness
        self.on_gpu = bool(model_tensors) and model_tensors[0].is_cuda
        self.prompts, self.count = prompts, count  # this generator's slice of a step's prompts
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
                send_shares(rollout, self.prompts, self.count, min(generator_ranks()))
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


def send_shares(rollout: Rollout, prompts: range, count: int, num_trainers: int) -> None:
    """Each trainer (ranks 0 .. num_trainers - 1, in order) the groups of this generator's
    slice (`prompts`, of the step's `count`) that fall in its equal share, possibly none."""
    assert len(rollout.groups) == len(prompts), (len(rollout.groups), prompts)
    for trainer, part in enumerate(trainer_parts(prompts, count, num_trainers)):
        message = Rollout(
            rollout.groups[part.start : part.stop],
            rollout.metrics,
            rollout.data_position,
            rollout.weights_step,
            rollout.step,
        )
        torch.distributed.send_object_list([message], dst=trainer)


def trainer_parts(prompts: range, count: int, num_trainers: int) -> list[range]:
    """Per trainer, which of a generator's groups (indices into its slice `prompts` of a step's
    `count` prompts) fall in the trainer's equal share of the step."""
    per_trainer = count // num_trainers
    parts = []
    for trainer in range(num_trainers):
        first = max(prompts.start, trainer * per_trainer)
        last = min(prompts.stop, (trainer + 1) * per_trainer)
        parts.append(range(first - prompts.start, max(last, first) - prompts.start))
    return parts
