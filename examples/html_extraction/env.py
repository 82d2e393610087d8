"""A shop-page extraction environment for reinforge, written only against its public API.

Each task is a small HTML shop page the model does not see and a question about it ("Shop 4721:
is the lamp in stock? Answer yes or no."). The model has one tool, `find(text)`, which searches
the page with BeautifulSoup and returns the products whose entry contains `text` (name, price,
stock); a guess is right half the time, an answer read from the tool every time. The reward is 1
for the right answer.

Use it from a config (configs/env_html.toml):

    [task]
    name = "env"
    env = "examples/html_extraction/env.py:make_env"
    env_args = {demo_tool_fraction = 0.3}

With no `task.path`, reinforge reads the tasks from `rows(seed)` below; point `task.path` at a
JSONL file with the same columns (prompt, answer, html, product) to bring your own pages.
"""

from __future__ import annotations

import json
import random
import re

from bs4 import BeautifulSoup

from reinforge.envs import (
    EnvState,
    Message,
    ParseError,
    StepResult,
    Task,
    call_tool,
    get_parser,
    make_tools,
)

# What a task asks about its product: its price (a guess is right 1 time in 90) or its stock
# (a guess is right half the time); the tool's answer is right every time.
QUESTIONS = {
    "price": " What does it cost? Answer with the number.",
    "stock": " Is it in stock? Answer yes or no.",
}
YES_NO = ["yes", "no"]
PRODUCTS = ["lamp", "chair", "mug", "desk", "fan", "rug", "bag", "pen", "cup", "hat", "sofa", "bed"]


def rows(seed: int = 0):
    """Generated pages: four products with prices and stock, and for one of them the two
    questions (`make_env(question=...)` picks which one a task asks)."""
    rng = random.Random(seed)
    for _ in range(3000):
        names = rng.sample(PRODUCTS, 4)
        prices = [rng.randint(10, 99) for _ in names]
        stock = [rng.choice(["in stock", "sold out"]) for _ in names]
        items = "".join(
            f'<li class="product"><b>{n}</b> <span class="price">{p}</span> '
            f'<span class="stock">{s}</span></li>'
            for n, p, s in zip(names, prices, stock)
        )
        target = rng.randrange(len(names))
        yield {
            "prompt": f"Shop {rng.randint(1000, 9999)}, the {names[target]}.",
            "answer": str(prices[target]),
            "in_stock": "yes" if stock[target] == "in stock" else "no",
            "html": f"<html><body><ul>{items}</ul></body></html>",
            "product": names[target],
        }


def page_tools(page: BeautifulSoup) -> list:
    """The tools of one page (a fresh closure per episode: the page is the episode's state)."""

    def find(text: str) -> str:
        """Search the shop page for products.

        Args:
            text: A word the product's entry contains, e.g. "lamp".
        """
        hits = [li.get_text(" ", strip=True) for li in page.select("li.product")]
        hits = [h for h in hits if text.lower() in h.lower()]
        return "; ".join(hits) if hits else f"no product contains {text!r}"

    return [find]


class ShopPageEnv:
    name = "shop_page"
    counters = ("tool_calls", "malformed_calls", "tool_errors")

    def __init__(
        self,
        parser: str = "hermes",
        max_turns: int = 3,
        demo_tool_fraction: float = 0.5,
        question: str = "price",
    ):
        assert question in QUESTIONS, f"question must be one of {sorted(QUESTIONS)}"
        self.question = question
        self.parse = get_parser(parser)
        self.max_turns = max_turns
        self.demo_tool_fraction = demo_tool_fraction
        blank = BeautifulSoup("", "html.parser")
        self.tool_schemas = [t.schema for t in make_tools(page_tools(blank)).values()]

    def reset(self, task: Task) -> EnvState:
        system = Message(
            "system",
            'You can call find(text) as <tool_call>{"name": "find", '
            '"arguments": {"text": ...}}</tool_call>.',
        )
        page = BeautifulSoup(task.info["html"], "html.parser")
        asked = Message("user", task.messages[-1].content + QUESTIONS[self.question])
        return EnvState(task=task, messages=[system, asked], info={"page": page})

    def step(self, state: EnvState, assistant: Message) -> StepResult:
        state.messages.append(assistant)
        state.turn += 1
        calls = self.parse(assistant.content).items
        counts = {"tool_calls": 0.0, "malformed_calls": 0.0, "tool_errors": 0.0}
        if not calls or state.turn >= self.max_turns:
            state.done = True
            right = assistant.content.strip() == self.answer(state.task)
            return StepResult([], done=True, rewards={"reward": float(right)}, metrics=counts)
        tools = make_tools(page_tools(state.info["page"]))
        replies = []
        for call in calls:
            if isinstance(call, ParseError):  # the model's text was not a well-formed call
                counts["malformed_calls"] += 1
                replies.append(Message("tool", f"Error: {call.reason}"))
                continue
            counts["tool_calls"] += 1
            result = call_tool(tools, call.name, call.arguments)
            counts["tool_errors"] += float(result.status != "ok")
            replies.append(Message("tool", result.text))
        state.messages.extend(replies)
        return StepResult(replies, done=False, metrics=counts)

    def answer(self, task: Task) -> str:
        return task.answer if self.question == "price" else task.info["in_stock"]

    def demonstration(self, state: EnvState) -> str:
        """A scripted player for SFT: calls the tool on a share of the tasks and answers from its
        result; on the others it answers at once (a guess: it cannot see the page)."""
        task, guess = state.task, random.Random(f"guess/{state.task.id}")
        uses_tool = random.Random(task.id).random() < self.demo_tool_fraction
        if state.turn == 0 and uses_tool:
            call = {"name": "find", "arguments": {"text": task.info["product"]}}
            return f"<tool_call>{json.dumps(call)}</tool_call>"
        if state.turn == 0:
            return str(guess.randint(10, 99)) if self.question == "price" else guess.choice(YES_NO)
        found = state.messages[-1].content
        if self.question == "stock":
            return "yes" if "in stock" in found else "no"
        price = re.search(rf"{task.info['product']} (\d+)", found)
        return price.group(1) if price else "0"


def make_env(
    parser: str = "hermes",
    max_turns: int = 3,
    demo_tool_fraction: float = 0.5,
    question: str = "price",
):
    return ShopPageEnv(parser, max_turns, demo_tool_fraction, question)
