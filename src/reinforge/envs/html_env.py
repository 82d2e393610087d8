"""HTML extraction: answer a question about a generated web page by querying it with tools.

Each task carries a procedurally generated shop page (`task.info["html"]`: a product grid of
nested divs with `data-price` / `data-sku` attributes, an orders table with headers and a status
column, a sidebar of links) and a question whose answer must be pulled out of it: a price, a
SKU, how many orders have a status, which customer placed an order, where a link points.

`HtmlEnv` is a `ToolEnv` (envs/tool_env.py: parsing, counters, turn limits, scoring) whose tools
read the episode's page, parsed once at `reset` with BeautifulSoup:
`find(tag, attrs)`, `select(css)`, `get_text(selector)` and `get_attribute(selector, name)`.
They return short text: at most `MAX_MATCHES` elements, each cut at `MAX_ELEMENT_CHARS`; a bad
selector or tag comes back as an error message, never an exception. The tools find the page in
a context variable that `HtmlEnv.step` sets around the tool env's step, because ToolEnv's tools
are shared by every episode and take only the model's arguments.

The answer format: a message without a tool call ends the episode; its answer is the text inside
the last `<answer>...</answer>` (else the whole message). `exact_match_reward` compares it with
`task.answer` ignoring case, surrounding space and quotes, runs of spaces and a final period.

`HtmlTasks` is the task source: `train_task(i)` and `eval_tasks()` come from separate seed
streams, every task with a page of its own.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from html import escape
from typing import Any

from bs4 import BeautifulSoup, Tag
from soupsieve import SelectorSyntaxError

from reinforge.envs.base import EnvState, StepResult
from reinforge.envs.tool_env import ToolEnv
from reinforge.envs.tools import ToolOutput
from reinforge.types import Message, Task

MAX_MATCHES = 10
MAX_ELEMENT_CHARS = 300

# --- answers ----------------------------------------------------------------------------------

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def extract_answer(completion: str) -> str:
    """The text of the last `<answer>...</answer>`, or the whole completion without one."""
    tagged = _ANSWER_TAG.findall(completion)
    return tagged[-1] if tagged else completion


def normalize_answer(text: str) -> str:
    text = " ".join(text.split()).lower()
    return text.strip("\"'`").removesuffix(".").strip()


def exact_match_reward(completion: str, task: Task) -> float:
    """1.0 when the extracted answer equals `task.answer` after normalization, else 0.0."""
    return float(normalize_answer(extract_answer(completion)) == normalize_answer(task.answer))


# --- tools ------------------------------------------------------------------------------------

_PAGE: ContextVar[BeautifulSoup] = ContextVar("reinforge_html_page")


@contextmanager
def page_context(page: BeautifulSoup | str) -> Iterator[BeautifulSoup]:
    """Run the HTML tools against `page` (HtmlEnv does this for each step)."""
    soup = page if isinstance(page, BeautifulSoup) else BeautifulSoup(page, "html.parser")
    token = _PAGE.set(soup)
    try:
        yield soup
    finally:
        _PAGE.reset(token)


def _page() -> BeautifulSoup:
    page = _PAGE.get(None)
    if page is None:
        raise RuntimeError(
            "the HTML tools read the page of the current episode: call them through "
            "HtmlEnv.step, or inside `with page_context(html):`"
        )
    return page


def find(
    tag: str, attrs: dict[str, str] | None = None, limit: int = MAX_MATCHES
) -> str | ToolOutput:
    """Find elements by tag name and attribute values, and show their HTML.

    Args:
        tag: A tag name, e.g. "a", "div" or "tr".
        attrs: Attribute values the elements must have, e.g. {"class": "product"}.
        limit: Show at most this many elements (1 to 10).
    """
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9-]*", tag):
        return ToolOutput(f'Error: {tag!r} is not a tag name; try "div" or "a".', is_error=True)
    wanted: dict[str, Any] = dict(attrs or {})
    elements = _page().find_all(tag, attrs=wanted)
    what = f"<{tag}>" + (f" with {attrs}" if attrs else "")
    return _show(elements, what, limit, _outer_html)


def select(css: str, limit: int = MAX_MATCHES) -> str | ToolOutput:
    """Find elements matching a CSS selector, and show their HTML.

    Args:
        css: A CSS selector, e.g. "table#orders tbody tr" or "div.product[data-price]".
        limit: Show at most this many elements (1 to 10).
    """
    elements = _select(css)
    if isinstance(elements, ToolOutput):
        return elements
    return _show(elements, repr(css), limit, _outer_html)


def get_text(selector: str) -> str | ToolOutput:
    """The text of every element matching a CSS selector, one element per line.

    Args:
        selector: A CSS selector, e.g. "h3.name" or "#orders td.status".
    """
    elements = _select(selector)
    if isinstance(elements, ToolOutput):
        return elements
    return _show(
        elements, repr(selector), MAX_MATCHES, lambda e: _clip(e.get_text(" ", strip=True))
    )


def get_attribute(selector: str, name: str) -> str | ToolOutput:
    """The value of one attribute of every element matching a CSS selector, one per line.

    Args:
        selector: A CSS selector, e.g. "a" or "div.product".
        name: The attribute, e.g. "href" or "data-price".
    """
    elements = _select(selector)
    if isinstance(elements, ToolOutput):
        return elements

    def value(element: Tag) -> str:
        found = element.get(name)
        if found is None:
            return f"(no {name} attribute)"
        return _clip(" ".join(found) if isinstance(found, list) else str(found))

    return _show(elements, repr(selector), MAX_MATCHES, value)


HTML_TOOLS = (find, select, get_text, get_attribute)


def _select(css: str) -> list[Tag] | ToolOutput:
    try:
        return _page().select(css)
    except SelectorSyntaxError as e:
        first_line = str(e).splitlines()[0]
        return ToolOutput(f"Error: invalid CSS selector {css!r}: {first_line}", is_error=True)


def _show(elements: list[Tag], what: str, limit: int, render: Callable[[Tag], str]) -> str:
    if not elements:
        return f"No elements match {what}."
    limit = max(1, min(limit, MAX_MATCHES))
    matches = "element matches" if len(elements) == 1 else "elements match"
    lines = [f"{len(elements)} {matches} {what}:"]
    lines += [f"[{i}] {render(e)}" for i, e in enumerate(elements[:limit], 1)]
    if len(elements) > limit:
        lines.append(f"({len(elements) - limit} more not shown; narrow the selector)")
    return "\n".join(lines)


def _outer_html(element: Tag) -> str:
    return _clip(re.sub(r">\s+<", "><", " ".join(str(element).split())))


def _clip(text: str) -> str:
    return text if len(text) <= MAX_ELEMENT_CHARS else text[: MAX_ELEMENT_CHARS - 3] + "..."


# --- env --------------------------------------------------------------------------------------


class HtmlEnv:
    name = "html"

    def __init__(
        self, *, parser: str = "hermes", max_turns: int = 8, system_prompt: str | None = None
    ):
        self.tool_env = ToolEnv(
            HTML_TOOLS,
            exact_match_reward,
            parser=parser,
            system_prompt=system_prompt,
            max_turns=max_turns,
        )

    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        return self.tool_env.tool_schemas

    def reset(self, task: Task) -> EnvState:
        state = self.tool_env.reset(task)
        state.info["page"] = BeautifulSoup(task.info["html"], "html.parser")
        return state

    def step(self, state: EnvState, assistant: Message) -> StepResult:
        with page_context(state.info["page"]):
            return self.tool_env.step(state, assistant)


# --- pages and questions ----------------------------------------------------------------------

_ADJECTIVES = [
    "Amber",
    "Brisk",
    "Cobalt",
    "Dusty",
    "Elder",
    "Gilded",
    "Hollow",
    "Ivory",
    "Jade",
    "Lunar",
    "Misty",
    "Noble",
    "Opal",
    "Rustic",
    "Silver",
    "Tidal",
    "Umber",
    "Vivid",
    "Woven",
    "Zesty",
]
_NOUNS = [
    "Kettle",
    "Lantern",
    "Satchel",
    "Compass",
    "Blanket",
    "Teapot",
    "Notebook",
    "Candle",
    "Backpack",
    "Mug",
    "Scarf",
    "Umbrella",
    "Journal",
    "Planter",
    "Clock",
    "Pillow",
]
_FIRST = [
    "Ada",
    "Bruno",
    "Chen",
    "Dara",
    "Emil",
    "Fatima",
    "Goran",
    "Hana",
    "Ivan",
    "Jonas",
    "Kira",
    "Leila",
    "Mateo",
    "Nia",
    "Omar",
]
_LAST = [
    "Park",
    "Okafor",
    "Lindqvist",
    "Moreau",
    "Tanaka",
    "Novak",
    "Reyes",
    "Haddad",
    "Brandt",
    "Costa",
    "Iyer",
    "Walsh",
]
_STATUSES = ("active", "pending", "shipped", "cancelled")
_LINKS = (
    "Shipping policy",
    "Size guide",
    "Gift cards",
    "Careers",
    "Press kit",
    "Store locator",
    "Privacy notice",
    "Warranty",
    "Bulk orders",
    "Accessibility",
)
_SECTIONS = ("help", "info", "pages", "company")

INSTRUCTIONS = (
    "Answer a question about a web page. The page is loaded in your tools (find, select, "
    "get_text, get_attribute); inspect it with them. When you know the answer, reply without a "
    "tool call, with the answer alone inside <answer></answer>."
)


def make_page(rng: random.Random) -> tuple[str, dict[str, Any]]:
    """A shop page's HTML and the facts in it (products, orders, links)."""
    names = rng.sample([f"{a} {n}" for a in _ADJECTIVES for n in _NOUNS], rng.randint(4, 8))
    skus = rng.sample(range(1000, 10000), len(names))
    products = [
        {"name": name, "price": f"{rng.randint(300, 9999) / 100:.2f}", "sku": f"SKU-{sku}"}
        for name, sku in zip(names, skus)
    ]
    order_ids = rng.sample(range(1000, 10000), rng.randint(5, 12))
    orders = [
        {
            "id": f"#{order_id}",
            "customer": f"{rng.choice(_FIRST)} {rng.choice(_LAST)}",
            "status": rng.choice(_STATUSES),
            "total": f"{rng.randint(500, 50000) / 100:.2f}",
        }
        for order_id in order_ids
    ]
    links = [
        {"label": label, "href": f"/{rng.choice(_SECTIONS)}/{_slug(label)}-{rng.randint(10, 99)}"}
        for label in rng.sample(_LINKS, rng.randint(4, 7))
    ]
    return _render_page(products, orders, links), {
        "products": products,
        "orders": orders,
        "links": links,
    }


def _render_page(products: list[dict], orders: list[dict], links: list[dict]) -> str:
    e = escape
    product_divs = "\n".join(
        f'<div class="product" id="p-{i}" data-price="{p["price"]}" data-sku="{p["sku"]}">'
        f'<div class="info"><h3 class="name">{e(p["name"])}</h3>'
        f'<p class="desc">A {e(p["name"].split()[1].lower())} for every day.</p></div>'
        f'<span class="price">${p["price"]}</span></div>'
        for i, p in enumerate(products, 1)
    )
    rows = "\n".join(
        f'<tr data-status="{o["status"]}"><td class="order-id">{o["id"]}</td>'
        f'<td class="customer">{e(o["customer"])}</td><td class="status">{o["status"]}</td>'
        f'<td class="total">{o["total"]}</td></tr>'
        for o in orders
    )
    items = "\n".join(
        f'<li><a href="{e(link["href"])}">{e(link["label"])}</a></li>' for link in links
    )
    return f"""<html><head><title>Shop</title></head><body>
<nav id="top-nav"><a href="/">Home</a> <a href="/catalog">Catalog</a> <a href="/cart">Cart</a></nav>
<main>
<section id="catalog"><h2>Products</h2><div class="grid">
{product_divs}
</div></section>
<section id="recent"><h2>Recent orders</h2>
<table id="orders"><thead><tr><th>Order</th><th>Customer</th><th>Status</th><th>Total</th></tr></thead>
<tbody>
{rows}
</tbody></table></section>
</main>
<aside class="sidebar"><div class="widget"><h4>Help</h4><ul class="links">
{items}
</ul></div></aside>
<footer><p>Questions? <a href="mailto:help@shop.example">Write to us</a></p></footer>
</body></html>"""


def _slug(label: str) -> str:
    return label.lower().replace(" ", "-")


def make_question(rng: random.Random, facts: dict[str, Any]) -> tuple[str, str, dict[str, str]]:
    """(question, answer, what the question is about) for one of the page's facts."""
    kind = rng.choice(("price", "sku", "count", "customer", "href"))
    if kind in ("price", "sku"):
        product = rng.choice(facts["products"])
        if kind == "price":
            question = (
                f'What is the price of "{product["name"]}"? Give the number in its data-price '
                "attribute, e.g. 12.50."
            )
        else:
            question = f'What is the SKU (the data-sku attribute) of "{product["name"]}"?'
        return question, product[kind], {"kind": kind, "target": product["name"]}
    if kind == "count":
        status = rng.choice(_STATUSES)
        num = sum(o["status"] == status for o in facts["orders"])
        question = f'How many orders in the orders table have the status "{status}"?'
        return f"{question} Give a number.", str(num), {"kind": kind, "target": status}
    if kind == "customer":
        order = rng.choice(facts["orders"])
        question = f"Which customer placed order {order['id']}? Give the name."
        return question, order["customer"], {"kind": kind, "target": order["id"]}
    link = rng.choice(facts["links"])
    question = f'What is the href of the link labelled "{link["label"]}"?'
    return question, link["href"], {"kind": kind, "target": link["label"]}


class HtmlTasks:
    name = "html"

    def __init__(self, *, seed: int = 0, num_eval: int = 64, show_page: bool = False):
        """`show_page`: also put the page's HTML in the prompt (an easier variant)."""
        self.seed = seed
        self.show_page = show_page
        self._eval = [self._make(f"{seed}/eval/{i}", f"eval-{i}") for i in range(num_eval)]

    def train_task(self, index: int) -> Task:
        return self._make(f"{self.seed}/train/{index}", f"train-{index}")

    def eval_tasks(self) -> list[Task]:
        return list(self._eval)

    def reward(self, completion: str, task: Task) -> float:
        return exact_match_reward(completion, task)

    def _make(self, seed: str, task_id: str) -> Task:
        rng = random.Random(seed)
        html, facts = make_page(rng)
        question, answer, about = make_question(rng, facts)
        page = f"\n\nThe page:\n{html}" if self.show_page else ""
        prompt = f"{INSTRUCTIONS}{page}\n\nQuestion: {question}"
        return Task(
            id=task_id,
            messages=(Message("user", prompt),),
            answer=answer,
            info={"html": html, **about},
        )
