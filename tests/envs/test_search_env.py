import json
import re

import pytest

from reinforge.envs.base import Env, EnvState
from reinforge.envs.search_env import (
    BM25Backend,
    Document,
    Hit,
    SearchTasks,
    make_search_env,
    search_tools,
)
from reinforge.errors import ConfigError
from reinforge.types import Message


@pytest.fixture(scope="module")
def tasks() -> SearchTasks:
    return SearchTasks(seed=4, num_companies=40, num_eval_companies=10)


def _call(tool: str, **arguments) -> Message:
    body = json.dumps({"name": tool, "arguments": arguments})
    return Message("assistant", f"<tool_call>{body}</tool_call>")


def _tool(env: Env, state: EnvState, tool: str, **arguments) -> str:
    result = env.step(state, _call(tool, **arguments))
    assert not result.done and len(result.messages) == 1
    return result.messages[0].content


def _search_and_open(env: Env, state: EnvState, name: str) -> str:
    """Search a name, open the first hit, return its text."""
    results = _tool(env, state, "search", query=name, k=3)
    doc_id = re.match(r"1\. \[([^\]]+)\]", results)[1]
    return _tool(env, state, "open", doc_id=doc_id)


def _solve(env: Env, state: EnvState, question: str) -> str:
    """A scripted two-hop policy that reads only the question and the tools' replies."""
    company = re.search(r"(?:founder of|is) (.+?) (?:born|headquartered)\?", question)[1]
    page = _search_and_open(env, state, company)
    if "headquartered" in question:
        city = re.search(r"headquartered in (.+?)\.", page)[1]
        return re.search(r"is a city in (.+?) with", _search_and_open(env, state, city))[1]
    founder = re.search(r"founded in \d+ by (.+?)\.", page)[1]
    born = re.search(r"was born in (.+?) in (\d{4})", _search_and_open(env, state, founder))
    return born[2] if "what year" in question else born[1]


def test_scripted_two_hop_policy_solves_tasks(tasks):
    env = make_search_env(tasks.backend)
    picked = [tasks.train_task(i) for i in range(12)] + tasks.eval_tasks()[::4][:8]
    assert len(picked) == 20
    for task in picked:
        state = env.reset(task)
        question = task.messages[-1].content.split("Question: ")[1]
        answer = _solve(env, state, question)
        final = env.step(state, Message("assistant", f"<answer>{answer}</answer>"))
        assert final.done and final.rewards == {"reward": 1.0}, (question, answer, task.answer)
        assert state.info["counters"].tool_calls == 4 and state.info["counters"].tool_errors == 0
    assert {t.info["kind"] for t in picked} == {
        "founder_birth_city",
        "founder_birth_year",
        "headquarters_country",
    }


def test_bm25_ranks_the_exact_title_first(tasks):
    backend = tasks.backend
    for doc in tasks.documents:
        hits = backend.search(doc.title, 3)
        assert hits[0].doc_id == doc.doc_id, (doc.title, hits)
        assert hits[0].score > 0 and hits[0].title == doc.title
    assert backend.get(tasks.documents[0].doc_id).startswith(tasks.documents[0].title)
    assert backend.search("zzzz qqqq", 5) == []
    with pytest.raises(KeyError):
        backend.get("person/nobody")


def test_no_single_document_answers_a_question(tasks):
    people = {d.title: d for d in tasks.documents if d.doc_id.startswith("person/")}
    for company in tasks.world.companies:
        assert company.name not in people[company.founder].text


def test_eval_split_holds_out_companies(tasks):
    eval_names = {c.name for c in tasks.eval_companies}
    assert len(tasks.eval_tasks()) == 3 * len(eval_names)
    assert {t.info["company"] for t in tasks.eval_tasks()} == eval_names
    train_names = {tasks.train_task(i).info["company"] for i in range(300)}
    assert not train_names & eval_names and len(train_names) > 20
    assert SearchTasks(seed=4, num_companies=40, num_eval_companies=10).train_task(7) == (
        tasks.train_task(7)
    )


class DictSearch:
    """A user's own search: here, substring match over a dict (a web search would go here)."""

    def __init__(self, pages: dict[str, str]):
        self.pages = pages
        self.queries: list[str] = []

    def search(self, query: str, k: int) -> list[Hit]:
        self.queries.append(query)
        found = [url for url, text in self.pages.items() if query.lower() in text.lower()]
        return [Hit(url, url.rsplit("/", 1)[-1], self.pages[url][:40]) for url in found[:k]]

    def get(self, doc_id: str) -> str:
        return self.pages[doc_id]


def test_a_pluggable_backend_serves_the_env():
    backend = DictSearch(
        {
            "https://wiki.example/Zorblat": "Zorblat is a moon of Quux, discovered in 2031.",
            "https://wiki.example/Quux": "Quux is a gas giant.",
        }
    )
    env = make_search_env(backend)
    task = SearchTasks(seed=0, num_companies=4, num_eval_companies=1).train_task(0)
    state = env.reset(task)
    results = _tool(env, state, "search", query="moon of Quux", k=50)
    assert results == (
        "1. [https://wiki.example/Zorblat] Zorblat: Zorblat is a moon of Quux, discovered in"
    )
    page = _tool(env, state, "open", doc_id="https://wiki.example/Zorblat")
    assert page.endswith("discovered in 2031.")
    missing = _tool(env, state, "open", doc_id="https://wiki.example/Nope")
    assert missing.startswith("Error: no document")
    assert _tool(env, state, "search", query="saturn") == "No results for 'saturn'."
    assert _tool(env, state, "search", query="  ").startswith("Error: the query is empty")
    assert backend.queries == ["moon of Quux", "saturn"]
    assert state.info["counters"].tool_errors == 2


def test_tool_schemas_and_bad_settings():
    tools = search_tools(BM25Backend([Document("d1", "One", "the first document")]))
    assert [t.__name__ for t in tools] == ["search", "open"]
    schemas = {
        s["function"]["name"]: s["function"] for s in make_search_env(DictSearch({})).tool_schemas
    }
    assert schemas["search"]["parameters"]["required"] == ["query"]
    assert schemas["open"]["parameters"]["required"] == ["doc_id"]
    with pytest.raises(ConfigError, match="num_eval_companies"):
        SearchTasks(num_companies=10, num_eval_companies=10)
    with pytest.raises(ConfigError, match="doc_id"):
        BM25Backend([Document("d", "A", "x"), Document("d", "B", "y")])


def test_bm25_keeps_jax_on_the_cpu(monkeypatch):
    """bm25s imports JAX when installed: on a GPU machine JAX would claim 75% of the GPU at once
    (seen on an H200: a search-tool run held 107 GiB and every other run there failed). The
    backend points JAX at the CPU unless the user chose."""
    import os

    from reinforge.envs.search_env import BM25Backend, Document

    docs = [Document("a", "Alpha", "alpha text"), Document("b", "Beta", "beta text")]
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    BM25Backend(docs)
    assert os.environ["JAX_PLATFORMS"] == "cpu"
    assert os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    BM25Backend(docs)
    assert os.environ["JAX_PLATFORMS"] == "cuda"  # the user's choice stands
