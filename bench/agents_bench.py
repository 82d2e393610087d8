"""Agent-path rollout throughput: the same episodes played by an agent function over the in-process
OpenAI endpoint (`rollout.agents.play_agents`) and by the built-in env loop (`rollout.trajectories
.play`, the env of bench/episodes_bench.py).

    python bench/agents_bench.py [--shape qwen2.5-0.5b] [--prompts 8] [--samples 8] [--turns 3]
        [--prompt-len 256] [--turn-tokens 128] [--tool-latency 0.05] [--sync]

Episodes: `--prompts` x `--samples` (64 agents at once by default), `--turns` assistant turns of
`--turn-tokens` tokens each (EOS ignored: every run does the same work), a simulated tool that
answers after `--tool-latency` seconds between turns. The agent is plain `openai` client code
(async, or sync on threads with --sync); its requests run batched continuously (where the engine
allows it: the paged engine with a fixed pool, as on a GPU) and in closed engine calls. The env is
`ToolTurnsEnv` on as many threads as episodes. The model has the shape's random weights (bf16 on
a GPU). Each path runs twice (the first a warm-up); printed: seconds, generated tokens/s, engine
calls (sessions in the continuous mode) and agent / env. The numbers go to JSON in $OUT (or
--out).

Needs the agent extra on the machine (fastapi, uvicorn, openai).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

from episodes_bench import ToolTurnsEnv, add_workload_args, load_shape, tasks_of  # noqa: E402

from reinforge.envs.agent_task import AgentEnv, AgentTasks, check_agent_extra  # noqa: E402
from reinforge.envs.env_tasks import EnvTasks, EpisodeScorer  # noqa: E402
from reinforge.rewards.mix import RewardSpec  # noqa: E402
from reinforge.rollout.agents import endpoint_for, play_agents  # noqa: E402
from reinforge.rollout.sampling import sampling_params  # noqa: E402
from reinforge.rollout.trajectories import play  # noqa: E402

REPLY = " ".join(f"t{i % 1000 + 1}" for i in range(32))  # ToolTurnsEnv's reply


async def async_agent(agent, turns: int, latency: float, max_tokens: int) -> float:
    messages = list(agent.messages)
    for turn in range(turns):
        response = await agent.client.chat.completions.create(
            model=agent.model, messages=messages, max_tokens=max_tokens
        )
        messages.append({"role": "assistant", "content": response.choices[0].message.content})
        if turn < turns - 1:
            await asyncio.sleep(latency)  # the tool
            messages.append({"role": "tool", "content": REPLY})
    return 1.0


def sync_agent(agent, turns: int, latency: float, max_tokens: int) -> float:
    messages = list(agent.messages)
    for turn in range(turns):
        response = agent.client.chat.completions.create(
            model=agent.model, messages=messages, max_tokens=max_tokens
        )
        messages.append({"role": "assistant", "content": response.choices[0].message.content})
        if turn < turns - 1:
            time.sleep(latency)
            messages.append({"role": "tool", "content": REPLY})
    return 1.0


def run(label, fn) -> dict:
    start = time.perf_counter()
    groups = fn()
    seconds = time.perf_counter() - start
    trajs = [t for g in groups for t in g.trajectories]
    generated = sum(sum(t.completion.loss_mask or []) for t in trajs)
    return {
        "path": label,
        "seconds": seconds,
        "generated_tokens": generated,
        "tokens_per_s": generated / seconds,
        "sequences": len(trajs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen2.5-0.5b")
    add_workload_args(parser, prompts=8, kv_gib=20.0)
    parser.add_argument("--sync", action="store_true", help="a sync agent on threads")
    parser.add_argument("--cpu-kv-mib", type=float, default=0.0, help="fixed KV pool on a CPU")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    args = parser.parse_args()
    check_agent_extra()  # fastapi, uvicorn, openai: carry their wheels to the GPU machine

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cpu_kv = int(args.cpu_kv_mib * 2**20) or None  # a fixed pool: the continuous mode on a CPU
    tok, model, engine = load_shape(args.shape, device, dtype, args.kv_gib, cpu_kv)
    tasks = tasks_of(args.prompts, args.prompt_len, model.config.vocab_size)
    n, episodes = args.samples, args.prompts * args.samples
    params = sampling_params(
        tok, max_new_tokens=args.turn_tokens, temperature=1.0, n=n, ignore_eos=True
    )
    scorer = EpisodeScorer([RewardSpec("env")], ())
    env = ToolTurnsEnv(args.turns - 1, args.tool_latency)  # turns - 1 tool replies
    env_tasks = EnvTasks(env.name, None, env, scorer, (), max_turns=args.turns + 1)
    agent_args = {
        "turns": args.turns,
        "latency": args.tool_latency,
        "max_tokens": args.turn_tokens,
    }
    agent_tasks = AgentTasks(
        "agent",
        None,
        AgentEnv(),
        scorer,
        (),
        max_turns=args.turns,
        max_context=args.prompt_len + args.turns * (args.turn_tokens + 64),
        agent=sync_agent if args.sync else async_agent,
        agent_args=agent_args,
        timeout_s=600.0,
        max_failed_share=0.0,
    )
    batcher = endpoint_for(engine, tok).batcher
    modes = (["continuous"] if batcher.is_continuous else []) + ["closed calls"]
    kind = "sync" if args.sync else "async"
    results = []
    for repeat in range(2):
        r = run("env loop", lambda: play(engine, tok, env_tasks, tasks, n, params, None, episodes))
        results.append({**r, "repeat": repeat})
        print(json.dumps(results[-1]), flush=True)
        for mode in modes:
            batcher.is_continuous = mode == "continuous"
            calls = batcher.num_calls
            r = run(
                f"agent ({kind}, {mode})",
                lambda: play_agents(engine, tok, agent_tasks, tasks, n, params, None, episodes),
            )
            results.append({**r, "repeat": repeat, "engine_calls": batcher.num_calls - calls})
            print(json.dumps(results[-1]), flush=True)
    last = [r for r in results if r["repeat"] == 1]
    env_r = last[0]
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    summary = {
        "device": device_name,
        "args": vars(args),
        "results": results,
        "agent_over_env_tokens_per_s": {
            r["path"]: r["tokens_per_s"] / env_r["tokens_per_s"] for r in last[1:]
        },
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "agents_bench.json").write_text(json.dumps(summary, indent=2))
    print(
        f"\nagent rollouts, {args.shape} shape, {device_name}: {episodes} concurrent episodes "
        f"({args.prompts} prompts x {n}), {args.turns} turns of {args.turn_tokens} tokens, "
        f"prompt {args.prompt_len}, tool latency {args.tool_latency * 1000:.0f} ms"
    )
    print(f"{'path':<34} {'seconds':>8} {'tokens/s':>9} {'sequences':>9} {'engine calls':>12}")
    for r in last:
        print(
            f"{r['path']:<34} {r['seconds']:>8.2f} {r['tokens_per_s']:>9.0f} "
            f"{r['sequences']:>9} {r.get('engine_calls', ''):>12}"
        )
    for path, ratio in summary["agent_over_env_tokens_per_s"].items():
        print(f"{path} / env loop, tokens/s: {ratio:.2f}")


if __name__ == "__main__":
    main()
