"""The env reply's delta from a stand-in history equals the full re-render, turn by turn, with
the real Qwen2.5 / Qwen3 / Llama 3.1 templates; a template whose reply reads the history falls
back to the full render (counted), still exact."""

import pytest

from reinforge.envs.tool_env import ToolEnv
from reinforge.rollout.delta import DeltaRenderer, environment_delta
from reinforge.types import Message

from .test_episodes import CALL, add, tokenizer_with

pytestmark = pytest.mark.skipif(
    __import__("importlib").util.find_spec("trl") is None, reason="templates from the trl wheel"
)


def turns():
    """A conversation with three tool turns: (history ending in the model's turn, env reply)."""
    history = [Message("user", "What is 2+3, then 5+5, then 10+1? Use the tool.")]
    replies = ["5", "10", "11"]
    answers = [CALL, CALL.replace('"a": 2', '"a": 5'), "<think>\nok\n</think>\n\n" + CALL]
    for answer, reply in zip(answers, replies):
        history = [*history, Message("assistant", answer)]
        yield history, [Message("tool", reply)]
        history = [*history, Message("tool", reply)]


@pytest.mark.parametrize("name", ["qwen2_5", "qwen3", "llama3_1"])
@pytest.mark.parametrize("ended_with_stop", [True, False])
def test_stand_in_delta_equals_the_full_render_every_turn(name, ended_with_stop):
    tok = tokenizer_with(name)
    tools = ToolEnv([add], lambda c, t: 0.0).tool_schemas
    renderer = DeltaRenderer()
    fulls = []
    for conversation, reply in turns():
        (ids, _), _ = renderer.delta(tok, conversation, reply, tools, ended_with_stop)
        full, _ = environment_delta(tok, conversation, reply, tools, ended_with_stop)
        assert ids == full
        fulls.append(full)
    assert renderer.is_checked and renderer.is_exact
    assert tok.decode(fulls[-1]).count("11") == 1


def test_a_template_reading_the_history_keeps_the_full_render():
    tok = tokenizer_with("qwen2_5")
    # numbers each tool reply by its place in the conversation: the stand-in would get it wrong
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'tool' %}[{{ loop.index }}]{% endif %}"
        "{{ m['content'] }}<|im_end|>{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    )
    renderer = DeltaRenderer()
    for conversation, reply in turns():
        (ids, _), is_full = renderer.delta(tok, conversation, reply, None, True)
        assert is_full and ids == environment_delta(tok, conversation, reply, None, True)[0]
    assert renderer.is_checked and not renderer.is_exact
