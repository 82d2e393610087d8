"""Multi-turn rollouts, token-in/token-out, with the real Qwen2.5 / Qwen3 / Llama 3.1 chat
templates shipped in the `trl` wheel, and a micro model taught in the test to call a tool."""

import importlib.util
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from reinforge.engine.base import SamplingParams
from reinforge.engine.simple import SimpleEngine
from reinforge.envs.tool_env import ToolEnv
from reinforge.models.loading import load_model
from reinforge.models.tiny import builtin_path
from reinforge.rollout.episodes import (
    EpisodeLimits,
    check_episode,
    environment_delta,
    render,
    run_episodes,
)
from reinforge.train.policy.optim import build_optimizer
from reinforge.train.sft import sft_step
from reinforge.types import Message, Task

TRL = importlib.util.find_spec("trl")
pytestmark = pytest.mark.skipif(
    TRL is None, reason="the chat templates come from the trl wheel (pip install trl)"
)


def template(name: str) -> str:
    return (
        Path(TRL.submodule_search_locations[0]) / "chat_templates" / f"{name}.jinja"
    ).read_text()


def tokenizer_with(name: str):
    tok = AutoTokenizer.from_pretrained(builtin_path("micro", 0))
    if name.startswith("llama"):
        tok.add_special_tokens(
            {
                "additional_special_tokens": [
                    "<|begin_of_text|>",
                    "<|start_header_id|>",
                    "<|end_header_id|>",
                    "<|eot_id|>",
                ]
            }
        )
        tok.eos_token = "<|eot_id|>"
    tok.chat_template = template(name)
    return tok


def add(a: int, b: int) -> str:
    """Add two integers.

    Args:
        a: the first number
        b: the second number
    """
    return str(a + b)


CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
CONVERSATION = [Message("user", "What is 2+3? Use the tool."), Message("assistant", CALL)]


@pytest.mark.parametrize(
    "name,preserving", [("qwen2_5", True), ("qwen3", False), ("llama3_1", True)]
)
def test_environment_delta_is_the_suffix_the_template_adds(name, preserving):
    tok = tokenizer_with(name)
    tools = ToolEnv([add], lambda c, t: 0.0).tool_schemas
    delta, is_preserving = environment_delta(
        tok, CONVERSATION, [Message("tool", "5")], tools, ended_with_stop=True
    )
    assert is_preserving == preserving
    full = render(tok, [*CONVERSATION, Message("tool", "5")], tools, add_generation_prompt=True)
    assert full[len(full) - len(delta) :] == delta  # the delta is the render's own tail
    text = tok.decode(delta)
    assert "5" in text and "add" not in text  # the tool reply and the next prompt, not the call
    if preserving:  # generated ids (ending in EOS) + delta = the template's render
        base = render(tok, CONVERSATION, tools, add_generation_prompt=False)
        eos_at = max(i for i, t in enumerate(base) if t == tok.eos_token_id)
        assert base[: eos_at + 1] + delta == full


def test_qwen3_rerenders_history_across_a_new_user_turn():
    """Qwen3 drops the reasoning of assistant turns before the last user message."""
    tok = tokenizer_with("qwen3")
    convo = [Message("user", "hi"), Message("assistant", "<think>\nsecret plan\n</think>\n\nhello")]
    delta, is_preserving = environment_delta(
        tok, convo, [Message("user", "and now?")], None, ended_with_stop=True
    )
    assert not is_preserving and "and now?" in tok.decode(delta)


def taught_tool_caller(tok):
    """The micro model, trained for a few steps to call `add` and then answer with the result."""
    model = load_model(str(builtin_path("micro", 0)), torch.device("cpu"), torch.float32)
    user = [Message("user", "What is 2+3? Use the tool.")]  # tools described in words, not schemas:
    first = render(tok, user, None, True)  # short prompts keep this test fast
    second = render(tok, [*user, Message("assistant", CALL), Message("tool", "5")], None, True)
    eos = [tok.eos_token_id]
    prompts = [first, second]
    responses = [
        tok.encode(CALL, add_special_tokens=False) + eos,
        tok.encode("5", add_special_tokens=False) + eos,
    ]
    optimizer, scheduler = build_optimizer(
        model, 1e-2, (0.9, 0.99), 1e-8, 0.0, 10, 150, "constant", 1.0
    )
    torch.manual_seed(0)
    for _ in range(150):
        loss = sft_step(
            model, tok, optimizer, scheduler, prompts, responses, 1.0, micro_batch_size=2
        )["loss"]
        if loss < 2e-3:
            break
    return model


def test_tool_episode_records_exact_ids_and_masks_env_tokens():
    tok = tokenizer_with("qwen2_5")
    model = taught_tool_caller(tok)
    env = ToolEnv([add], lambda completion, task: float(completion.strip() == task.answer))
    task = Task("t0", (Message("user", "What is 2+3? Use the tool."),), answer="5")
    params = SamplingParams(temperature=0.0, stop_token_ids=(tok.eos_token_id,))
    (group,) = run_episodes(
        SimpleEngine(model, tok),
        tok,
        env,
        [task],
        2,
        params,
        EpisodeLimits(max_turns=4, max_tokens_per_turn=96, max_context=1024),
        render_tools=False,
    )
    for ep in group:
        assert ep.finish_reason == "done" and ep.num_turns == 2 and ep.reward == 1.0, tok.decode(
            ep.completion_ids
        )
        assert ep.metrics["tool_calls"] == 1 and ep.metrics["malformed_calls"] == 0
        assert len(ep.completion_ids) == len(ep.loss_mask) == len(ep.logprobs)
        # the trained-on spans are exactly the two assistant turns; the tool reply is masked out
        spans, current = [], []
        for tid, m in zip(ep.completion_ids, ep.loss_mask):
            if m:
                current.append(tid)
            elif current:
                spans.append(current)
                current = []
        spans.append(current)
        assert [tok.decode(s, skip_special_tokens=True) for s in spans] == [CALL, "5"]
        env_text = tok.decode([t for t, m in zip(ep.completion_ids, ep.loss_mask) if not m])
        assert "<tool_response>\n5\n</tool_response>" in env_text
        assert check_episode(tok, ep) is None  # recorded ids == template render


def test_context_limit_ends_episodes_loudly():
    tok = tokenizer_with("qwen2_5")
    model = load_model(str(builtin_path("micro", 0)), torch.device("cpu"), torch.float32)
    env = ToolEnv([add], lambda c, t: 0.0)
    task = Task("t0", (Message("user", "hi"),), answer="5")
    prompt_len = len(render(tok, list(task.messages), env.tool_schemas, True))
    params = SamplingParams(temperature=1.0, ignore_eos=True)
    (group,) = run_episodes(
        SimpleEngine(model, tok),
        tok,
        env,
        [task],
        1,
        params,
        EpisodeLimits(max_turns=3, max_tokens_per_turn=64, max_context=prompt_len + 10),
    )
    ep = group[0]
    assert ep.num_ids <= prompt_len + 10
    assert ep.finish_reason in {"done", "context"}
    assert (
        ep.metrics["turn_truncated"] == 1
    )  # the 10-token budget cut the turn: counted, not hidden
