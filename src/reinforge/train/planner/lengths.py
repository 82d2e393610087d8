"""Token lengths the memory planner and the preflight size a run from, read before any weights
load: the model's context (its config.json or `model.max_context`), the longest prompt over the
held-out and first training tasks, the longest reference solution, and for env tasks the longest
opening prompt and reference episode (`demos`). Below `train.planner.memory` and `preflight`, which both
read it.
"""

from __future__ import annotations

from dataclasses import dataclass

from reinforge.envs.env_tasks import EnvTasks
from reinforge.errors import ConfigError
from reinforge.models.loading import model_source
from reinforge.rollout.episodes import render
from reinforge.rollout.trajectories import tools_to_render
from reinforge.train.sft.demos import demo_episode, require_demonstrations

NUM_TRAIN_PROMPTS_PROBED = 512
NUM_DEMOS_PROBED = 32  # reference episodes the planner measures


@dataclass(frozen=True)
class Lengths:
    longest_prompt: int
    longest_solution: int  # reference solution + EOS (what SFT trains on); 0 without solutions
    num_probed: int
    episode_context: int | None = None  # env tasks: an episode's tokens (task.max_context resolved)


def model_context(cfg) -> tuple[int, str]:
    from transformers import AutoConfig

    if cfg.model.max_context:
        return cfg.model.max_context, "model.max_context"
    source = model_source(cfg.model.path, cfg.run.seed)
    try:
        mcfg = AutoConfig.from_pretrained(source)
    except OSError as e:
        raise ConfigError(
            f"model.path = {cfg.model.path!r}: cannot read its config ({e}); "
            "give a local HF checkpoint folder or 'builtin:tiny'"
        ) from None
    context = getattr(mcfg, "max_position_embeddings", None)
    if context is None:
        raise ConfigError(
            f"model.path = {cfg.model.path!r} has no max_position_embeddings; set model.max_context"
        )
    return int(context), "max_position_embeddings"


def probe_lengths(cfg, tokenizer) -> Lengths:
    """Token lengths over the held-out tasks and the first `NUM_TRAIN_PROMPTS_PROBED` training
    tasks."""
    from reinforge.data.chat import eos_ids, render_prompt
    from reinforge.tasks import task_source_for

    tasks = task_source_for(cfg, tokenizer)
    if isinstance(tasks, EnvTasks):  # prompts as the env opens them; reference episodes for SFT
        return episode_lengths(cfg, tokenizer, tasks, model_context(cfg)[0])
    probe = tasks.eval_tasks() + [tasks.train_task(i) for i in range(NUM_TRAIN_PROMPTS_PROBED)]
    solutions = [t.solution for t in probe if t.solution is not None]
    return Lengths(
        max(len(render_prompt(tokenizer, t.messages)) for t in probe),
        max((len(tokenizer.encode(s, add_special_tokens=False)) for s in solutions), default=0)
        + len(eos_ids(tokenizer)),
        len(probe),
    )


def episode_lengths(cfg, tokenizer, env_tasks: EnvTasks, context: int):
    """The planner's `Lengths` for an env task: the longest opening prompt, and the longest
    reference episode when an SFT stage trains on them. Errors name the setting to change when
    the episode context is above the model's (`context`), or a demonstration does not fit it."""
    max_context = cfg.task.max_context or context
    if max_context > context:
        raise ConfigError(
            f"task.max_context = {max_context} is above the model's context ({context}); "
            f"set task.max_context <= {context}, or leave it unset"
        )
    tools = tools_to_render(env_tasks)
    probe = env_tasks.eval_tasks() + [
        env_tasks.train_task(i) for i in range(NUM_TRAIN_PROMPTS_PROBED)
    ]
    longest_prompt = max(
        len(render(tokenizer, env_tasks.env.reset(t).messages, tools, True)) for t in probe
    )
    if longest_prompt >= max_context:
        raise ConfigError(
            f"the longest opening prompt is {longest_prompt} tokens, which leaves no room in the "
            f"episode context ({max_context}); raise task.max_context (up to the model's "
            f"context, {context})"
        )
    longest_demo = longest_turn = 0
    if cfg.sft.steps > 0:
        require_demonstrations(env_tasks)
        for i in range(NUM_DEMOS_PROBED):
            prompt, ids, mask = demo_episode(tokenizer, env_tasks, i)
            if len(prompt) + len(ids) > max_context:
                raise ConfigError(
                    f"the reference episode of training task {i} runs to {len(prompt) + len(ids)} "
                    f"tokens, above the episode context ({max_context}); raise task.max_context "
                    "(up to the model's context) or shorten the episodes (task.max_turns)"
                )
            longest_demo = max(longest_demo, len(ids))
            longest_turn = max(longest_turn, *turn_lengths(mask))
    check_turn_budgets(cfg, longest_turn)
    return Lengths(longest_prompt, longest_demo, len(probe), max_context)


def turn_lengths(mask: list[int]) -> list[int]:
    """Lengths of the assistant turns (runs of 1) in an episode's loss mask."""
    lengths, run = [], 0
    for m in [*mask, 0]:
        if m:
            run += 1
        elif run:
            lengths.append(run)
            run = 0
    return lengths or [0]


def check_turn_budgets(cfg, longest_turn: int) -> None:
    """A model taught turns longer than its per-turn budget would be cut off mid-call every
    time: refuse that, naming the budget to raise."""
    rollout = getattr(cfg, "rollout", None)
    budgets = [("eval.max_new_tokens", cfg.eval.max_new_tokens)]
    if rollout is not None:
        budgets.append(("rollout.max_new_tokens", rollout.max_new_tokens))
    for setting, budget in budgets:
        if budget is not None and budget < longest_turn:
            raise ConfigError(
                f"{setting} = {budget} cannot hold the longest assistant turn of the SFT "
                f"reference episodes ({longest_turn} tokens with its end-of-turn id): every such "
                f"turn would be cut off; set {setting} >= {longest_turn}"
            )
