"""Multi-turn episodes: a group's first turn as one prompt with n samples (its KV pages shared)
against every episode sent alone, through the same rollout code (`rollout.trajectories.play`).

    python bench/episodes_bench.py [--shape qwen2.5-0.5b] [--prompts 64] [--samples 8]
        [--turns 3] [--prompt-len 256] [--turn-tokens 128] [--tool-latency 0.05]

The model has the shape's random weights (bf16 on a GPU); every turn is forced to full length
(EOS ignored) and the env answers each turn with a simulated tool result after `--tool-latency`
seconds, for `--turns` tool turns, then ends the episode: every run does the same work. Both modes
run twice in one process (the first a warm-up); printed: seconds, generated tokens/s, prefill
tokens computed, the first turn's peak KV pages, and the ratio; the full numbers go to JSON in
$OUT (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

from reinforge.engine.paged import PagedEngine  # noqa: E402
from reinforge.envs import EnvState, Message, StepResult, Task  # noqa: E402
from reinforge.envs.env_tasks import EnvTasks, EpisodeScorer  # noqa: E402
from reinforge.models.loading import load_model, load_tokenizer, model_source  # noqa: E402
from reinforge.rewards.mix import RewardSpec  # noqa: E402
from reinforge.rollout import episodes  # noqa: E402
from reinforge.rollout.sampling import sampling_params  # noqa: E402

# The shape tokenizer's template joins contents; this one closes each turn with EOS, as real
# chat templates do (the episode loop finds where a turn ends by it).
TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }} [EOS] {% endfor %}"
    "{% if add_generation_prompt %}t0{% endif %}"
)


class ToolTurnsEnv:
    """Answers `turns` assistant turns with a tool result of `reply_words` words, then ends."""

    name = "tool_turns"

    def __init__(self, turns: int, latency: float, reply_words: int = 32):
        self.turns, self.latency, self.reply_words = turns, latency, reply_words

    def reset(self, task: Task) -> EnvState:
        return EnvState(task=task, messages=list(task.messages))

    def step(self, state: EnvState, assistant: Message) -> StepResult:
        state.messages.append(assistant)
        state.turn += 1
        if state.turn > self.turns:
            return StepResult([], True, rewards={"reward": 1.0})
        time.sleep(self.latency)
        reply = Message("tool", " ".join(f"t{i % 1000 + 1}" for i in range(self.reply_words)))
        state.messages.append(reply)
        return StepResult([reply], False, metrics={"tool_calls": 1.0})


def tasks_of(num: int, prompt_len: int, vocab: int) -> list[Task]:
    rng = random.Random(0)
    return [
        Task(
            f"p{i}",
            (
                Message(
                    "user", " ".join(f"t{rng.randrange(1, vocab - 4)}" for _ in range(prompt_len))
                ),
            ),
            "",
        )
        for i in range(num)
    ]


def run(engine, tok, env_tasks, tasks, args, share: bool) -> dict:
    params = sampling_params(
        tok, max_new_tokens=args.turn_tokens, temperature=1.0, n=args.samples, ignore_eos=True
    )
    limits = episodes.EpisodeLimits(args.turns + 1, args.turn_tokens, 1 << 20)
    first_turn_pages: list[float] = []
    generate_seconds = [0.0]
    generate = engine.generate

    def recording_generate(prompts, p):
        start = time.perf_counter()
        out = generate(prompts, p)
        generate_seconds[0] += time.perf_counter() - start
        if not first_turn_pages:
            first_turn_pages.append(engine.stats.extra.get("kv_blocks_peak", 0.0))
        return out

    engine.generate = recording_generate
    start = time.perf_counter()
    try:
        groups = episodes.run_episodes(
            engine,
            tok,
            env_tasks.env,
            tasks,
            args.samples,
            params,
            limits,
            False,
            share,
            args.env_workers,
        )
    finally:
        engine.generate = generate
    seconds = time.perf_counter() - start
    generated = sum(sum(e.loss_mask) for g in groups for e in g)
    return {
        "mode": ("shared first turn" if share else "separate episodes")
        + f", {args.env_workers} env threads",
        "seconds": seconds,
        "generated_tokens": generated,
        "tokens_per_s": generated / seconds,
        "first_turn_kv_pages_peak": first_turn_pages[0] if first_turn_pages else 0.0,
        "generate_s": generate_seconds[0],
        "env_and_tokens_s": seconds - generate_seconds[0],
    }


def add_workload_args(parser, prompts: int, kv_gib: float) -> None:
    """The multi-turn workload's settings, shared by the episode benches (this one, e3_bench,
    agents_bench)."""
    parser.add_argument("--prompts", type=int, default=prompts)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--turn-tokens", type=int, default=128)
    parser.add_argument("--tool-latency", type=float, default=0.05)
    parser.add_argument("--kv-gib", type=float, default=kv_gib)


def load_shape(shape: str, device, dtype, kv_gib: float, cpu_kv_bytes: int | None = None):
    """(tokenizer with the benches' chat template, random-weight model of `bench/shapes/<shape>`,
    its paged engine): a `kv_gib` pool on a GPU, `cpu_kv_bytes` (None: grown per call) on a CPU."""
    source = model_source(f"shape:{HERE / 'shapes' / shape}.json", 0)
    tok = load_tokenizer(source)
    tok.chat_template = TEMPLATE
    model = load_model(source, device, dtype).eval()
    kv = int(kv_gib * 2**30) if device.type == "cuda" else cpu_kv_bytes
    return tok, model, PagedEngine(model, tok, kv_cache_bytes=kv)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen2.5-0.5b")
    add_workload_args(parser, prompts=64, kv_gib=20.0)
    parser.add_argument("--env-workers", type=int, default=32, help="threads for env steps")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tok, model, engine = load_shape(args.shape, device, dtype, args.kv_gib)
    env = ToolTurnsEnv(args.turns, args.tool_latency)
    env_tasks = EnvTasks(env.name, None, env, EpisodeScorer([RewardSpec("env")], ()), ())
    tasks = tasks_of(args.prompts, args.prompt_len, model.config.vocab_size)
    results = []
    with torch.inference_mode():
        for repeat in range(2):
            for share in (False, True):
                r = run(engine, tok, env_tasks, tasks, args, share)
                r["repeat"] = repeat
                results.append(r)
                print(json.dumps(r), flush=True)
    last = {r["mode"].split(",")[0]: r for r in results if r["repeat"] == 1}
    shared, alone = last["shared first turn"], last["separate episodes"]
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    summary = {
        "device": device_name,
        "args": vars(args),
        "results": results,
        "speedup": alone["seconds"] / shared["seconds"],
        "first_turn_pages_ratio": alone["first_turn_kv_pages_peak"]
        / max(shared["first_turn_kv_pages_peak"], 1.0),
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "episodes_bench.json").write_text(json.dumps(summary, indent=2))
    print(
        f"\nmulti-turn episodes, {args.shape} shape, {device_name}: {args.prompts} prompts x "
        f"{args.samples} samples, {args.turns} tool turns of {args.turn_tokens} tokens, "
        f"prompt {args.prompt_len}, tool latency {args.tool_latency * 1000:.0f} ms"
    )
    header = f"{'mode':<36} {'seconds':>8} {'generate s':>10} {'tokens/s':>9} {'KV pages t1':>11}"
    print(header)
    for r in (alone, shared):
        print(
            f"{r['mode']:<36} {r['seconds']:>8.2f} {r['generate_s']:>10.2f} "
            f"{r['tokens_per_s']:>9.0f} {r['first_turn_kv_pages_peak']:>11.0f}"
        )
    print(
        f"shared / separate: {summary['speedup']:.2f}x faster, "
        f"{summary['first_turn_pages_ratio']:.2f}x fewer first-turn pages"
    )


if __name__ == "__main__":
    main()
