"""SFT demonstrations with tool calls, from the user's `messages` rows (OpenAI format), checked
token by token on the real Qwen2.5 / Qwen3 / Llama 3.1 chat templates shipped in the trl wheel:
the assistant's tool calls and answer are in the loss, the tool results, system and user text
are not, and the call tokens are what the env's parser reads back."""

from __future__ import annotations

import json

import pytest

from reinforge.config import TrainConfig, load_config
from reinforge.data.chat import chat_example, eos_ids
from reinforge.envs.parsers import ToolCall
from reinforge.errors import ConfigError
from reinforge.tasks import build_task_source
from reinforge.train.sft.demos import demonstration_examples, recorded_demonstration
from reinforge.types import Message
from tests.rollout.test_episodes import TRL, tokenizer_with

pytestmark = pytest.mark.skipif(TRL is None, reason="templates from the trl wheel")

SYSTEM = "Answer with the capital alone."
RESULT = "1. [d1] Zorblat: The capital of Zorblat is Quenti."
CONVERSATION = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "What is the capital of Zorblat?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "search", "arguments": json.dumps({"query": "Zorblat"})},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": RESULT},
    {"role": "assistant", "content": "Quenti"},
]
PARSER = {"qwen2_5": "hermes", "qwen3": "hermes", "llama3_1": "llama3_json"}


def tools_task(tmp_path, parser: str, max_turns: int = 4):
    (tmp_path / "docs.jsonl").write_text(
        json.dumps({"id": "d1", "title": "Zorblat", "text": "The capital of Zorblat is Quenti."})
        + "\n"
    )
    rows = [
        {"messages": CONVERSATION, "answer": "Quenti"},
        {"prompt": "Capital of Mivarn?", "answer": "Oslar"},
    ]
    (tmp_path / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(
        TrainConfig,
        None,
        [
            "task.name=tools",
            f"task.path={tmp_path / 'qa.jsonl'}",
            f"task.corpus={tmp_path / 'docs.jsonl'}",
            'task.tools=["search"]',
            "task.reward=exact_match",
            f"task.parser={parser}",
            f"task.max_turns={max_turns}",
        ],
    )
    return build_task_source(cfg.task)


def spans(mask: list[int]) -> list[tuple[int, int]]:
    out, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


@pytest.mark.parametrize("name", ["qwen2_5", "qwen3", "llama3_1"])
def test_recorded_tool_calls_are_in_the_loss_and_tool_results_are_not(tmp_path, name):
    tok = tokenizer_with(name)
    tasks = tools_task(tmp_path, PARSER[name])
    (conversation,) = tasks.source.demos  # the row without assistant turns is no demo
    assert tasks.train_task(0).messages[-1].role == "user"  # the env's prompt stops before
    prompt, ids, mask = recorded_demonstration(tok, tasks, conversation)
    assert len(ids) == len(mask)
    assert "search" in tok.decode(prompt)  # the schemas, rendered by the template
    assert SYSTEM in tok.decode(prompt) and "Zorblat?" in tok.decode(prompt)
    call, answer = (ids[a:b] for a, b in spans(mask))
    eos = eos_ids(tok)
    assert call[-1:] == eos and answer == tok.encode("Quenti", add_special_tokens=False) + eos
    (parsed,) = tasks.env.parse(tok.decode(call[:-1])).items
    assert parsed == ToolCall("search", {"query": "Zorblat"})
    outside = tok.decode([t for t, m in zip(ids, mask) if not m])
    assert RESULT in outside and "Quenti" not in outside.replace(RESULT, "")
    if name != "qwen3":  # prefix-preserving templates: the same ids as the whole render
        as_text = [
            Message(m.role, m.content) for m in tasks.env.reset(tasks.train_task(0)).messages
        ]
        as_text += [
            Message("assistant", tok.decode(call[:-1])),
            Message("tool", RESULT),
            Message("assistant", "Quenti"),
        ]
        example = chat_example(tok, as_text, eos, tasks.env.tool_schemas)
        assert prompt + ids == example.ids
        assert [0] * len(prompt) + mask == example.loss_mask  # token by token


def test_the_template_renders_recorded_tool_calls_for_dataset_sft():
    """`name = "dataset"` SFT on the same conversation: Qwen2.5's template writes the recorded
    tool_calls itself, and they are in the loss."""
    from reinforge.data.schema import as_messages

    tok = tokenizer_with("qwen2_5")
    messages = as_messages(CONVERSATION, "messages")
    example = chat_example(tok, messages, eos_ids(tok))
    first = tok.decode(example.ids[slice(*example.spans[0])])
    assert (
        first
        == '<tool_call>\n{"name": "search", "arguments": {"query": "Zorblat"}}\n</tool_call><|im_end|>'
    )
    masked_out = tok.decode([t for t, m in zip(example.ids, example.loss_mask) if not m])
    assert RESULT in masked_out and SYSTEM in masked_out


def test_sft_examples_cycle_the_recorded_demos_and_refuse_demos_over_max_turns(tmp_path):
    tok = tokenizer_with("qwen2_5")
    prompts, completions, _ = demonstration_examples(tok, tools_task(tmp_path, "hermes"), 0, 3)
    assert len(prompts) == 3 and completions[0] == completions[2]
    with pytest.raises(ConfigError, match=r"raise task\.max_turns to 2,"):
        demonstration_examples(tok, tools_task(tmp_path, "hermes", max_turns=1), 0, 1)
