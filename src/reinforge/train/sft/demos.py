"""SFT on env tasks: reference episodes, played by the task's scripted policy or recorded in the
user's data, laid out the way RL records episodes, and the token lengths the memory planner
sizes env tasks from.

A demonstration is a whole episode: the opening prompt (the env's, tools rendered by the chat
template), then each assistant turn (its text's ids and the EOS that ends a turn: loss mask 1)
and each env reply (the chat template's delta, exactly as `episodes.environment_delta` gives it
during RL: loss mask 0). SFT so trains on the very ids RL will later see, with the env's tokens
out of the loss.

Recorded demonstrations (`name = "tools"` rows with a `messages` conversation, OpenAI format)
replay the conversation instead of a policy: an assistant turn's tool calls are written in the
env's tool-call format (`ToolEnv.write_calls`, the text its parser reads and the model will
write), the recorded tool results are the env replies.
"""

from __future__ import annotations

from collections.abc import Sequence

from reinforge.data.chat import eos_ids
from reinforge.envs.env_tasks import EnvTasks
from reinforge.errors import ConfigError
from reinforge.rollout.episodes import environment_delta, render
from reinforge.rollout.trajectories import tools_to_render
from reinforge.types import Message, Task


def demonstration(
    tokenizer, env_tasks: EnvTasks, task: Task
) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, completion ids, loss mask) of the scripted policy's episode of `task`."""
    policy = env_tasks.demonstration
    assert policy is not None, f"task {env_tasks.name!r} has no scripted policy"
    env, tools = env_tasks.env, tools_to_render(env_tasks)
    state = env.reset(task)
    prompt = render(tokenizer, state.messages, tools, add_generation_prompt=True)
    ids: list[int] = []
    mask: list[int] = []
    for _ in range(env_tasks.max_turns):
        assistant = Message("assistant", policy(state))
        history = list(state.messages)
        turn = tokenizer.encode(assistant.content, add_special_tokens=False) + eos_ids(tokenizer)
        ids += turn
        mask += [1] * len(turn)
        result = env.step(state, assistant)
        if result.done:
            break
        found = environment_delta(
            tokenizer, [*history, assistant], result.messages, tools, ended_with_stop=True
        )
        assert found is not None, "the chat template does not close turns with the EOS id"
        ids += found[0]
        mask += [0] * len(found[0])
    return prompt, ids, mask


def recorded_demonstration(
    tokenizer, env_tasks: EnvTasks, conversation: Sequence[Message]
) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, completion ids, loss mask) of a recorded conversation, replayed through the
    env's prompt and tool-call format."""
    env, tools = env_tasks.env, tools_to_render(env_tasks)
    first = next(i for i, m in enumerate(conversation) if m.role == "assistant")
    num_turns = sum(m.role == "assistant" for m in conversation)
    if num_turns > env_tasks.max_turns:
        raise ConfigError(
            f"a recorded demonstration has {num_turns} assistant turns, more than task.max_turns "
            f"= {env_tasks.max_turns} lets an episode have; raise task.max_turns to "
            f"{num_turns}, or shorten that conversation"
        )
    messages = env.reset(Task("demo", tuple(conversation[:first]), answer="")).messages
    prompt = render(tokenizer, messages, tools, add_generation_prompt=True)
    ids: list[int] = []
    mask: list[int] = []
    rest = list(conversation[first:])
    while rest:
        if rest[0].role == "assistant":
            text = env.write_calls(rest[0].content, rest[0].tool_calls)
            turn = tokenizer.encode(text, add_special_tokens=False) + eos_ids(tokenizer)
            ids, mask = ids + turn, mask + [1] * len(turn)
            messages.append(Message("assistant", text))
            rest = rest[1:]
            continue
        num_replies = next((i for i, m in enumerate(rest) if m.role == "assistant"), len(rest))
        replies = [Message(m.role, m.content) for m in rest[:num_replies]]
        found = environment_delta(tokenizer, messages, replies, tools, ended_with_stop=True)
        assert found is not None, "the chat template does not close turns with the EOS id"
        ids, mask = ids + found[0], mask + [0] * len(found[0])
        messages += replies
        rest = rest[num_replies:]
    return prompt, ids, mask


def recorded_demos(env_tasks: EnvTasks):
    """The task source when it holds recorded demonstrations (`ToolsTasks.demos`), else None."""
    return env_tasks.source if getattr(env_tasks.source, "demos", None) else None


def demo_episode(tokenizer, env_tasks: EnvTasks, index: int):
    """Reference episode `index` of the SFT stream: recorded, else played by the policy."""
    recorded = recorded_demos(env_tasks)
    if recorded is not None:
        return recorded_demonstration(tokenizer, env_tasks, recorded.demo(index))
    return demonstration(tokenizer, env_tasks, env_tasks.train_task(index))


def demonstration_examples(
    tokenizer, env_tasks: EnvTasks, start: int, count: int
) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """(prompts, completions, loss masks) of reference episodes start .. start + count - 1."""
    require_demonstrations(env_tasks)
    demos = [demo_episode(tokenizer, env_tasks, i) for i in range(start, start + count)]
    prompts, completions, masks = (list(column) for column in zip(*demos))
    return prompts, completions, masks


def require_demonstrations(env_tasks: EnvTasks) -> None:
    if env_tasks.demonstration is None and recorded_demos(env_tasks) is None:
        if env_tasks.name == "tools":
            raise ConfigError(
                "sft.steps > 0, but no training row of task.path "
                "records a conversation to learn from; give rows a messages column (the question, "
                "then assistant turns with tool_calls and tool results, OpenAI format), or set "
                "sft.steps = 0 (RL alone)"
            )
        raise ConfigError(
            f"task.name = {env_tasks.name!r} has no reference demonstrations for an SFT stage; "
            "set sft.steps = 0 (RL alone), or use a task that has them (tool_arithmetic, game)"
        )
