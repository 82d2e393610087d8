import json
import re

import pytest

from reinforge.envs.base import Env
from reinforge.envs.html_env import (
    MAX_ELEMENT_CHARS,
    HtmlEnv,
    HtmlTasks,
    exact_match_reward,
    find,
    get_attribute,
    get_text,
    page_context,
    select,
)
from reinforge.envs.tool_env import ToolCounters
from reinforge.envs.tools import ToolOutput
from reinforge.types import Message, Task


def _call(tool: str, **arguments) -> Message:
    body = json.dumps({"name": tool, "arguments": arguments})
    return Message("assistant", f"<tool_call>{body}</tool_call>")


def _plan(question: str) -> tuple[str, dict]:
    """The one tool call a scripted policy makes, read off the question text alone."""
    quoted = re.search(r'"([^"]+)"', question)
    if question.startswith("What is the price of"):
        product = f'div.product:has(h3.name:-soup-contains("{quoted[1]}"))'
        return "get_attribute", {"selector": product, "name": "data-price"}
    if question.startswith("What is the SKU"):
        product = f'div.product:has(h3.name:-soup-contains("{quoted[1]}"))'
        return "get_attribute", {"selector": product, "name": "data-sku"}
    if question.startswith("How many orders"):
        return "select", {"css": f'#orders tbody tr[data-status="{quoted[1]}"]'}
    if question.startswith("Which customer"):
        order = re.search(r"order (#\d+)", question)[1]
        row = f'#orders tr:has(td.order-id:-soup-contains("{order}"))'
        return "get_text", {"selector": f"{row} td.customer"}
    assert question.startswith("What is the href"), question
    return "get_attribute", {"selector": f'a:-soup-contains("{quoted[1]}")', "name": "href"}


def _read(tool: str, output: str) -> str:
    if tool == "select":  # "3 elements match ..." or "No elements match ..."
        first = output.split()[0]
        return "0" if first == "No" else first
    lines = output.splitlines()
    assert len(lines) == 2 and lines[0].startswith("1 element matches"), output
    return lines[1].removeprefix("[1] ")


def test_scripted_policy_solves_generated_tasks():
    env: Env = HtmlEnv()
    tasks = HtmlTasks(seed=1, num_eval=0)
    kinds = set()
    for i in range(20):
        task = tasks.train_task(i)
        kinds.add(task.info["kind"])
        state = env.reset(task)
        question = task.messages[-1].content.split("Question: ")[1]
        tool, arguments = _plan(question)
        step = env.step(state, _call(tool, **arguments))
        assert not step.done and step.messages[0].role == "tool"
        answer = _read(tool, step.messages[0].content)
        final = env.step(state, Message("assistant", f"<answer>{answer}</answer>"))
        assert final.done and final.rewards == {"reward": 1.0}, (question, answer, task.answer)
        assert state.info["counters"] == ToolCounters(turns=2, tool_calls=1)
    assert kinds == {"price", "sku", "count", "customer", "href"}


def test_malformed_selectors_come_back_as_error_messages():
    env = HtmlEnv()
    state = env.reset(HtmlTasks(num_eval=0).train_task(0))
    calls = [
        _call("select", css="div["),
        _call("get_text", selector=":::"),
        _call("get_attribute", selector="a[href", name="href"),
        _call("find", tag="<div>"),
        _call("select", css="table#nope"),
    ]
    replies = [env.step(state, call).messages[0].content for call in calls]
    assert [r.split(":")[0] for r in replies[:4]] == ["Error"] * 4
    assert "invalid CSS selector 'div['" in replies[0]
    assert replies[4] == "No elements match 'table#nope'."
    counters = state.info["counters"]
    assert counters.tool_calls == 5 and counters.tool_errors == 4


def test_tools_keep_their_output_short():
    html = HtmlTasks(num_eval=0).train_task(3).info["html"]
    with page_context(html):
        body = select("body").splitlines()
        assert body[0] == "1 element matches 'body':"
        assert len(body[1]) <= len("[1] ") + MAX_ELEMENT_CHARS and body[1].endswith("...")
        links = get_attribute("a", "href").splitlines()
        assert links[1] == "[1] /" and len(links) <= 11
        two = select("div.product", limit=2).splitlines()
        assert len(two) == 4 and two[-1].startswith("(") and "more not shown" in two[-1]
        assert find("div", {"class": "product"}, limit=1).count("[1] <div") == 1
        assert get_text("nav#top-nav") == "1 element matches 'nav#top-nav':\n[1] Home Catalog Cart"
        assert get_attribute("h2", "href").endswith("[2] (no href attribute)")
        assert isinstance(select("div["), ToolOutput) and select("div[").is_error


def test_tools_outside_an_episode_say_how_to_call_them():
    with pytest.raises(RuntimeError, match="page_context"):
        select("div")


@pytest.mark.parametrize(
    "completion, score",
    [
        ("<answer>12.50</answer>", 1.0),
        ("Thinking... <answer> 12.50. </answer>", 1.0),
        ('<answer>"12.50"</answer>', 1.0),
        ("12.50", 1.0),
        ("<answer>12.5</answer>", 0.0),
        ("<answer>$12.50</answer>", 0.0),
    ],
)
def test_exact_match_reward(completion, score):
    task = Task(id="t", messages=(), answer="12.50")
    assert exact_match_reward(completion, task) == score
    named = Task(id="t", messages=(), answer="Ada Park")
    assert exact_match_reward("<answer>ada  park</answer>", named) == 1.0


def test_task_source_is_deterministic_and_held_out():
    tasks = HtmlTasks(seed=2, num_eval=8)
    assert HtmlTasks(seed=2, num_eval=8).train_task(5) == tasks.train_task(5)
    eval_pages = {t.info["html"] for t in tasks.eval_tasks()}
    assert len(eval_pages) == 8
    assert not eval_pages & {tasks.train_task(i).info["html"] for i in range(50)}
    assert "<html>" not in tasks.train_task(0).messages[0].content
    shown = HtmlTasks(seed=2, num_eval=0, show_page=True).train_task(5)
    assert shown.info["html"] in shown.messages[0].content
    assert tasks.reward(f"<answer>{tasks.train_task(5).answer}</answer>", tasks.train_task(5))


def test_tool_schemas_for_the_chat_template():
    schemas = {s["function"]["name"]: s["function"] for s in HtmlEnv().tool_schemas}
    assert list(schemas) == ["find", "select", "get_text", "get_attribute"]
    assert schemas["find"]["parameters"]["required"] == ["tag"]
    assert schemas["get_attribute"]["parameters"]["required"] == ["selector", "name"]
