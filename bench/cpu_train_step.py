"""The trainer's packed attention on CPU: padded varlen rows against the block-diagonal mask.

    python bench/cpu_train_step.py [--threads 2] [--micro-tokens 512 2048] [--steps 8] [--profile]

The quickstart's SFT step (the built-in tiny model, float32, 64 arithmetic examples of its
config, token-mean NLL, AdamW) runs with each attention path at each micro-batch budget, the
paths interleaved round after round (a shared machine's drift hits both alike). Printed: the
median step time of each, the ratio mask / padded (above 1: padded is faster), and the step's
matmul floor (6 x linear parameters x tokens, over a matmul rate measured here on the same
shapes' largest GEMM). `--profile` adds torch.profiler's top operators for one padded step.
Not a timed test: nothing fails for being slow.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

from reinforge.config import TrainConfig
from reinforge.models.loading import load_model, load_tokenizer, model_source
from reinforge.tasks import build_task_source
from reinforge.train.packing.attention import select_packed_attention
from reinforge.train.sft import sft_examples, sft_step

REPO = Path(__file__).resolve().parents[1]
PATHS = ("mask", "padded")


def matmul_rate(hidden: int, intermediate: int, tokens: int) -> float:
    """FLOP/s of the step's largest GEMM shape ([tokens, hidden] x [hidden, intermediate])."""
    a, b = torch.randn(tokens, hidden), torch.randn(hidden, intermediate)
    for _ in range(3):
        a @ b
    start, reps = time.perf_counter(), 20
    for _ in range(reps):
        a @ b
    return 2 * tokens * hidden * intermediate * reps / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--micro-tokens", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--steps", type=int, default=8, help="timed steps per path and budget")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = TrainConfig.model_validate(tomllib.loads((REPO / "configs/quickstart.toml").read_text()))
    source = model_source(cfg.model.path, cfg.run.seed)
    tokenizer = load_tokenizer(source)
    tasks = build_task_source(cfg.task, tokenizer, needs_answers=True, needs_solutions=True)
    batch_size = cfg.sft.batch_size
    models = {}
    for path in PATHS:
        torch.manual_seed(0)
        model = load_model(source, "cpu", torch.float32, False)
        select_packed_attention(model, path)
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.sft.lr)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        models[path] = (model, optimizer, scheduler)
    prompts, responses, _ = sft_examples(tokenizer, tasks, 0, batch_size)
    tokens = sum(len(p) + len(r) for p, r in zip(prompts, responses))
    config = models["mask"][0].config
    linear = sum(
        p.numel() for n, p in models["mask"][0].named_parameters() if "layers" in n and p.dim() == 2
    )
    rate = matmul_rate(config.hidden_size, config.intermediate_size, min(tokens, 2048))
    print(
        f"{args.threads} thread(s); SFT step of {batch_size} sequences, {tokens} tokens "
        f"(longest {max(len(p) + len(r) for p, r in zip(prompts, responses))}); matmul floor "
        f"{6 * linear * tokens / rate:.3f} s ({6 * linear * tokens / 1e9:.1f} GFLOP at "
        f"{rate / 1e9:.0f} GFLOP/s)"
    )

    def step(path: str, micro_tokens: int, index: int) -> float:
        model, optimizer, scheduler = models[path]
        p, r, m = sft_examples(tokenizer, tasks, batch_size * index, batch_size)
        start = time.perf_counter()
        sft_step(model, tokenizer, optimizer, scheduler, p, r, 1.0, micro_tokens, masks=m)
        return time.perf_counter() - start

    for micro_tokens in args.micro_tokens:
        times: dict[str, list[float]] = {path: [] for path in PATHS}
        for index in range(args.steps + 2):
            for path in PATHS:
                elapsed = step(path, micro_tokens, index)
                if index >= 2:  # the first two warm up
                    times[path].append(elapsed)
        medians = {path: statistics.median(times[path]) for path in PATHS}
        print(
            f"micro-batches of <= {micro_tokens:>5} tokens: mask {medians['mask']:.3f} s, padded "
            f"{medians['padded']:.3f} s, mask / padded {medians['mask'] / medians['padded']:.2f}x"
        )
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step("padded", max(args.micro_tokens), 0)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
