"""The host's share of one RL step around generation, without a GPU: a config's rollout with an
engine that hands back canned completions (random ids of the model's vocabulary, texts decoded
as the paged engine decodes them), then the step's batch and advantages. What is left is what
the device waits on between the last decode step and the update's first micro-batch (G1's
timeline, s26b on an H200: episodes opened 22 ms, texts 25, env steps 22, trajectories 5, the
step's batch 22).

    python bench/rollout_host.py configs/bench/g1.toml [k=v ...] [--repeat 3] [--cprofile]

Prints each phase's milliseconds (median of the repeats) and, with --cprofile, the functions by
own time over one more repeat. Needs no model weights: a `shape:` model's tokenizer is built
from its shape file.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import time
from collections import defaultdict
from types import SimpleNamespace

import torch

import reinforge.rollout.episodes as episodes
import reinforge.rollout.trajectories as trajectories
from reinforge.checkpoint.files import TrainerState
from reinforge.config import TrainConfig
from reinforge.config.load import load_config
from reinforge.engine.base import GenerationStats
from reinforge.engine.detokenize import decode_many
from reinforge.envs.env_tasks import single_turn_tasks
from reinforge.models.loading import load_tokenizer
from reinforge.models.shapes import is_shape, shape_source
from reinforge.rollout.sources import sample_groups
from reinforge.tasks import task_source_for
from reinforge.train.loop.advantage_step import Algorithm, assign_advantages, build_step_batch
from reinforge.train.loop.update import pack_micro_batch
from reinforge.train.packing.forward import micro_batches
from reinforge.types import Completion

TIMES: dict[str, list[float]] = defaultdict(list)
MICRO_BATCH_TOKENS = [12288]  # G1's on an H200 (the planner's choice there)


class CannedEngine:
    """`params.n` completions of `params.max_new_tokens` random ids per prompt, as the paged
    engine returns them (texts by `decode_many`); the time of the texts is recorded."""

    def __init__(self, tokenizer, vocab: int, seed: int = 0):
        self.tokenizer, self.vocab, self.rng = tokenizer, vocab, random.Random(seed)
        self.stats = GenerationStats()
        self.model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=1 << 20))

    def generate(self, prompts, params):
        ids = [
            [self.rng.randrange(self.vocab) for _ in range(params.max_new_tokens)]
            for _ in range(len(prompts) * params.n)
        ]
        start = time.perf_counter()
        texts = iter(decode_many(self.tokenizer, ids, skip_special_tokens=True))
        TIMES["completions' texts"].append(time.perf_counter() - start)
        rows = iter(ids)
        return [
            [
                Completion(row, [-1.0] * len(row), "length", next(texts))
                for row in (next(rows) for _ in range(params.n))
            ]
            for _ in prompts
        ]

    def release_memory(self) -> None:
        pass


def timed(fn, label: str):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[label].append(time.perf_counter() - start)

    return wrapper


def one_step(cfg, policy, tasks, algorithm, step: int) -> None:
    state = TrainerState(phase="rl", step=step, data_position=step * cfg.rollout.prompts_per_step)
    for label in ("episodes opened", "env steps", "steps taken", "trajectories"):
        TIMES[label].append(0.0)
    start = time.perf_counter()
    _, groups, _ = sample_groups(cfg, policy, tasks, state, step)
    TIMES["rollout (all)"].append(time.perf_counter() - start)
    start = time.perf_counter()
    batch = build_step_batch(groups, cfg.algorithm, torch.device("cpu"))
    TIMES["step batch"].append(time.perf_counter() - start)
    start = time.perf_counter()
    assign_advantages(batch, algorithm, cfg.rollout.max_new_tokens)
    TIMES["advantages"].append(time.perf_counter() - start)
    # the update's host work before its first micro-batch can be queued: the plan and the first
    # micro-batch's packed row (the engine's records aside: the canned engine keeps none)
    start = time.perf_counter()
    plan = micro_batches(batch.prompts, batch.completions, MICRO_BATCH_TOKENS[0])
    packed = pack_micro_batch(cfg, batch, plan[0])
    TIMES["first micro-batch"].append(time.perf_counter() - start)
    start = time.perf_counter()
    for idx in plan[1:]:
        pack_micro_batch(cfg, batch, idx)
    TIMES[f"the other {len(plan) - 1} packed"].append(time.perf_counter() - start)
    assert packed.input_ids_L.numel() <= MICRO_BATCH_TOKENS[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--cprofile", action="store_true")
    parser.add_argument("--micro-batch-tokens", type=int, default=MICRO_BATCH_TOKENS[0])
    args = parser.parse_args()
    MICRO_BATCH_TOKENS[0] = args.micro_batch_tokens
    cfg = load_config(TrainConfig, args.config, args.overrides)
    path = cfg.model.path
    folder = shape_source(path, cfg.run.seed) if is_shape(path) else path
    # the trainer's loader: AutoTokenizer alone misreads a shape's word tokenizer
    tokenizer = load_tokenizer(str(folder))
    tasks = single_turn_tasks(task_source_for(cfg, tokenizer), cfg.task.rewards)
    engine = CannedEngine(tokenizer, len(tokenizer))
    policy = SimpleNamespace(engine=engine, tokenizer=tokenizer, model=torch.nn.Linear(1, 1))
    algorithm = Algorithm(cfg.algorithm)

    # each phase's time summed over its calls in one step (the last entry of each list)
    def add_to_last(fn, label):
        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                TIMES[label][-1] += time.perf_counter() - start

        return wrapper

    episodes.open_episodes = add_to_last(episodes.open_episodes, "episodes opened")
    episodes._run_env_steps = add_to_last(episodes._run_env_steps, "env steps")
    episodes._take_step = add_to_last(episodes._take_step, "steps taken")
    trajectories.to_trajectory = add_to_last(trajectories.to_trajectory, "trajectories")
    one_step(cfg, policy, tasks, algorithm, 0)  # warm-up (imports, caches, thread pools)
    TIMES.clear()
    for step in range(1, args.repeat + 1):
        one_step(cfg, policy, tasks, algorithm, step)
    print(
        f"{cfg.rollout.prompts_per_step} prompts x {cfg.rollout.samples_per_prompt} samples x "
        f"{cfg.rollout.max_new_tokens} tokens, median of {args.repeat}:"
    )
    for label, values in TIMES.items():
        print(f"  {label:20s} {1000 * statistics.median(values):8.1f} ms")
    if args.cprofile:
        profiler = cProfile.Profile()
        profiler.runcall(one_step, cfg, policy, tasks, algorithm, args.repeat + 1)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
