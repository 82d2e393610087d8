"""How long a job will take, for `--dry-run`: measured, not guessed.

The config's own model is loaded on its device, with the memory plan a run would use, and one
step of each phase is timed at the config's full size on its own tasks (after a warm-up call on
one prompt): the generation of `rollout.prompts_per_step` x `samples_per_prompt` full-length
completions (`max_new_tokens` each, end of sequence ignored: the longest a step can sample), one
optimizer step (forward and backward) over those sequences, and one SFT step of `sft.batch_size`
reference solutions. Held-out evaluations take the measured generation time per sequence.

On a CPU a model above `CPU_MEASURE_MAX_PARAMS` is not loaded (a dry run stays short; loading
and stepping a billion-parameter model there takes minutes): the estimate says so instead. Not counted: checkpoint saves,
the reference model's forward (KL), extra turns of multi-turn episodes, and a first step's
warm-up (kernel compilation, CUDA graphs); responses that stop early make steps faster.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

CPU_MEASURE_MAX_PARAMS = 100_000_000


@dataclass
class Estimate:
    total_s: float
    parts: list[tuple[str, float]] = field(default_factory=list)  # (what, seconds)
    basis: str = ""

    def lines(self) -> list[str]:
        if not self.parts:
            return [f"estimated time: {self.basis}"]
        out = [f"estimated time: about {_duration(self.total_s)}"]
        out += [f"  {what}: {_duration(seconds)}" for what, seconds in self.parts]
        return [*out, f"  based on: {self.basis}"]


def estimate_run(cfg) -> Estimate:
    import torch

    from reinforge.data.chat import render_prompt
    from reinforge.engine.base import SamplingParams
    from reinforge.engine.factory import build_engine
    from reinforge.models.loading import (
        load_model,
        load_tokenizer,
        model_source,
        resolve_device,
        resolve_dtype,
    )
    from reinforge.tasks import task_source_for
    from reinforge.train.planner.lengths import probe_lengths
    from reinforge.train.planner.memory import plan_run
    from reinforge.train.policy.optim import build_optimizer
    from reinforge.train.sft import sft_examples, sft_step

    if cfg.run.num_threads:
        torch.set_num_threads(cfg.run.num_threads)
    device = resolve_device(cfg.run.device)
    source = model_source(cfg.model.path, cfg.run.seed)
    num_params = _num_params(source)
    if device.type == "cpu" and num_params > CPU_MEASURE_MAX_PARAMS:
        return Estimate(
            0.0,
            basis=f"not measured: a {num_params / 1e9:.1f}B-parameter model on a CPU (the "
            f"estimate times a real step of models up to {CPU_MEASURE_MAX_PARAMS / 1e6:.0f}M here)",
        )
    tokenizer = load_tokenizer(cfg.model.tokenizer or source)
    model = load_model(source, device, resolve_dtype(cfg.run.dtype, device))
    optimizer, scheduler = build_optimizer(
        model, 1e-9, (0.9, 0.999), 1e-8, 0.0, 0, 10, "constant", 1.0
    )
    tasks = task_source_for(cfg, tokenizer)
    choice, _ = plan_run(cfg, tokenizer, probe_lengths(cfg, tokenizer), None)
    tokens = choice.micro_batch_tokens
    parts, basis = [], []
    rollout = getattr(cfg, "rollout", None)
    gen_per_seq = None
    if rollout is not None and cfg.run.max_steps:
        n, new, k = rollout.samples_per_prompt, rollout.max_new_tokens, rollout.prompts_per_step
        prompts = [render_prompt(tokenizer, tasks.train_task(i).messages) for i in range(k)]
        engine = build_engine(
            model,
            tokenizer,
            rollout.engine,
            kv_cache_bytes=choice.kv_cache_bytes,
            setting="rollout.engine",
            lora_generation=choice.lora_generation,
        )
        params = SamplingParams(max_new_tokens=new, n=n, ignore_eos=True, seed=cfg.run.seed)
        gen_s, done = _timed(lambda ps: engine.generate(ps, params), prompts)
        seqs = [(p, c.token_ids) for p, group in zip(prompts, done) for c in group]
        train_s, _ = _timed(
            lambda ss: sft_step(
                model,
                tokenizer,
                optimizer,
                scheduler,
                [p for p, _ in ss],
                [r for _, r in ss],
                1.0,
                tokens,
            ),
            seqs,
        )
        gen_per_seq = gen_s / (k * n)
        step_s = gen_s + train_s
        parts.append(
            (f"RL: {cfg.run.max_steps} steps x {_duration(step_s)}", cfg.run.max_steps * step_s)
        )
        basis.append(
            f"one RL step's generation ({k} x {n} x {new} tokens) took {gen_s:.2f} s and its update {train_s:.2f} s"
        )
    sft = getattr(cfg, "sft", None)
    if sft is not None and sft.steps:
        batch = sft_examples(tokenizer, tasks, 0, sft.batch_size)
        step_s, _ = _timed(
            lambda b: sft_step(
                model, tokenizer, optimizer, scheduler, b[0], b[1], 1.0, tokens, masks=b[2]
            ),
            batch,
        )
        parts.append((f"SFT: {sft.steps} steps x {_duration(step_s)}", sft.steps * step_s))
        basis.append(f"an SFT step of {sft.batch_size} examples {step_s:.2f} s")
    if gen_per_seq is not None:
        evals = _num_evals(cfg)
        eval_s = (
            len(tasks.eval_tasks()[: cfg.eval.num_tasks or None])
            * cfg.eval.samples_per_task
            * gen_per_seq
        )
        if evals and eval_s:
            parts.append((f"held-out evaluation: {evals} x {_duration(eval_s)}", evals * eval_s))
    where = (
        f"{device.type} ({torch.get_num_threads()} threads)"
        if device.type == "cpu"
        else str(device)
    )
    basis_text = (
        "; ".join(basis) + f"; measured just now on {where}, excluding checkpoints and warm-up"
    )
    return Estimate(sum(s for _, s in parts), parts, basis_text)


def _num_params(source: str) -> int:
    from transformers import AutoConfig

    from reinforge.train.planner.sizes import ModelShape

    return ModelShape.from_hf_config(AutoConfig.from_pretrained(source).to_dict()).num_params


def _timed(fn, batch: list):
    """(seconds, result) of `fn(batch)`, after a warm-up call on its first item (first-call
    allocations and kernel choices are not a step's cost)."""
    fn([x[:1] for x in batch] if isinstance(batch, tuple) else batch[:1])
    start = time.perf_counter()
    result = fn(batch)
    return time.perf_counter() - start, result


def _num_evals(cfg) -> int:
    e, steps = cfg.eval, cfg.run.max_steps
    periodic = (steps - 1) // e.every if e.every else 0
    return int(e.before_train) + periodic + 1 + (1 if cfg.sft.steps else 0)


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
