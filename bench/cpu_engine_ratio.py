"""The paged engine against the simple engine on CPU, in one process, on an RL-like batch.

    python bench/cpu_engine_ratio.py [--rounds 3] [--new-tokens 16 64] [--threads 1] [--lora 0]

The built-in tiny model (Qwen2, 3.3M parameters, float32) generates for 32 arithmetic prompts x 8
samples at temperature 1, forced to full length, once per new-token budget. The two engines run
interleaved, round after round (the machine may be shared: a ratio from neighbouring runs is
fair where absolute times are not), and the script prints each round's wall and CPU seconds
(process time: what this process computed, less disturbed by neighbours than the wall clock)
and the median ratios simple / paged (above 1: paged is faster). One torch thread by default: on
a shared machine, two threads spin-wait on each other and the wall clock swings several-fold.
Not a timed test: nothing fails for being slow.
`--lora R` wraps the model with a rank-R all-linear PEFT adapter (B made non-zero) first.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from reinforge.data.chat import render_prompt
from reinforge.engine.base import SamplingParams
from reinforge.engine.paged import PagedEngine
from reinforge.engine.simple import SimpleEngine
from reinforge.models.loading import load_model, load_tokenizer, model_source
from reinforge.tasks import build_task_source


def build(lora_rank: int):
    from reinforge.config import ArithmeticTaskConfig

    source = model_source("builtin:tiny", 0)
    tokenizer = load_tokenizer(source)
    model = load_model(source, torch.device("cpu"), torch.float32)
    if lora_rank:
        from reinforge.train.policy.lora import apply_lora

        model, _ = apply_lora(model, rank=lora_rank)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.02)
    tasks = build_task_source(ArithmeticTaskConfig())
    prompts = [render_prompt(tokenizer, tasks.train_task(i).messages) for i in range(32)]
    return model, tokenizer, prompts


def time_once(engine, prompts, params) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds, tokens generated)."""
    wall, cpu = time.perf_counter(), time.process_time()
    outputs = engine.generate(prompts, params)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return wall, cpu, sum(len(c.token_ids) for group in outputs for c in group)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    parser.add_argument("--lora", type=int, default=0, help="LoRA rank (0: none)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer, prompts = build(args.lora)
    engines = {"simple": SimpleEngine(model, tokenizer), "paged": PagedEngine(model, tokenizer)}
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; 32 prompts "
        f"(~{statistics.mean(map(len, prompts)):.0f} tokens) x 8 samples; lora rank {args.lora}"
    )
    for new_tokens in args.new_tokens:
        params = SamplingParams(max_new_tokens=new_tokens, n=8, ignore_eos=True, seed=1)
        for engine in engines.values():  # warm-up: allocator, lazy imports
            engine.generate(prompts[:2], SamplingParams(max_new_tokens=2, n=2))
        wall_ratios, cpu_ratios = [], []
        for round_index in range(args.rounds):
            wall, cpu = {}, {}
            for name, engine in engines.items():
                wall[name], cpu[name], num_tokens = time_once(engine, prompts, params)
            wall_ratios.append(wall["simple"] / wall["paged"])
            cpu_ratios.append(cpu["simple"] / cpu["paged"])
            print(
                f"new_tokens {new_tokens:>3} round {round_index}: simple {wall['simple']:.2f} s "
                f"(cpu {cpu['simple']:.2f}), paged {wall['paged']:.2f} s (cpu {cpu['paged']:.2f}; "
                f"{num_tokens / wall['paged']:,.0f} tok/s); ratio wall {wall_ratios[-1]:.2f}, "
                f"cpu {cpu_ratios[-1]:.2f}"
            )
        print(
            f"new_tokens {new_tokens:>3}: median ratio simple/paged: wall "
            f"{statistics.median(wall_ratios):.2f}, cpu {statistics.median(cpu_ratios):.2f}"
        )


if __name__ == "__main__":
    main()
