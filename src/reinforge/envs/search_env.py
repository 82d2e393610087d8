"""Local search: answer multi-hop questions by searching and opening documents.

The search sits behind a `SearchBackend` (`search(query, k) -> list[Hit]`, `get(doc_id) -> str`,
raising KeyError for an unknown id), so a web search or a company index plugs in where the
built-in `BM25Backend` (bm25s over an in-memory corpus) stands. `search_tools(backend)` makes
the two tools the model calls, `search(query, k)` (ids, titles and snippets) and
`open(doc_id)` (a document's full text); `make_search_env(backend)` is the `ToolEnv` around them
(envs/tool_env.py: parsing, counters, turn limits), scored by exact match on
`<answer>...</answer>` (envs/html_env.py `exact_match_reward`).

`SearchTasks` generates a world of fictional people, cities and companies, one document each,
and questions that need two lookups: "In which city was the founder of Vantor Labs born?"
needs the company's document (its founder) and then the founder's (a birthplace). No document
names what points at it (a person's page does not mention the company they founded), so no
single search answers a question. The eval split holds out whole companies, and with them their
founders: the facts an eval question needs are never the answer of a training question.
"""

from __future__ import annotations

import functools
import os
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from reinforge.envs.html_env import exact_match_reward
from reinforge.envs.tool_env import ToolEnv
from reinforge.envs.tools import ToolOutput
from reinforge.errors import ConfigError
from reinforge.types import Message, Task

MAX_RESULTS = 10
SNIPPET_CHARS = 100


@dataclass(frozen=True)
class Document:
    doc_id: str
    title: str
    text: str


@dataclass(frozen=True)
class Hit:
    doc_id: str
    title: str
    snippet: str
    score: float = 0.0


class SearchBackend(Protocol):
    def search(self, query: str, k: int) -> list[Hit]:
        """The best `k` hits for `query`, best first (fewer when fewer match)."""
        ...

    def get(self, doc_id: str) -> str:
        """The full text of a document; raises KeyError for an id it does not know."""
        ...


class BM25Backend:
    """BM25 (bm25s, Lucene's variant) over documents held in memory; a document is indexed by
    its title and text."""

    def __init__(self, documents: Sequence[Document]):
        # bm25s uses JAX when installed; on a GPU machine JAX would claim 75% of the device at
        # import. The index is on the host: JAX on the CPU unless the user chose (its own vars).
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        import bm25s

        if not documents:
            raise ConfigError("BM25Backend needs at least one document")
        self.documents = list(documents)
        self._by_id = {doc.doc_id: doc for doc in self.documents}
        if len(self._by_id) != len(self.documents):
            raise ConfigError("BM25Backend: two documents share a doc_id; ids must be unique")
        self._bm25s = bm25s
        self._index = bm25s.BM25()
        corpus = [f"{doc.title}\n{doc.text}" for doc in self.documents]
        self._index.index(self._tokenize(corpus), show_progress=False)

    def _tokenize(self, texts: list[str]) -> list[list[str]]:
        return self._bm25s.tokenize(texts, stopwords="en", return_ids=False, show_progress=False)

    def search(self, query: str, k: int) -> list[Hit]:
        k = min(k, len(self.documents))
        indices, scores = self._index.retrieve(self._tokenize([query]), k=k, show_progress=False)
        return [
            Hit(doc.doc_id, doc.title, snippet(doc.text), float(score))
            for index, score in zip(indices[0], scores[0])
            if score > 0
            for doc in (self.documents[int(index)],)
        ]

    def get(self, doc_id: str) -> str:
        doc = self._by_id[doc_id]
        return f"{doc.title}\n\n{doc.text}"


def snippet(text: str) -> str:
    if len(text) <= SNIPPET_CHARS:
        return text
    return text[:SNIPPET_CHARS].rsplit(" ", 1)[0] + " ..."


def search_tools(backend: SearchBackend) -> list[Callable[..., Any]]:
    """The `search` and `open` tools over `backend`."""

    def search(query: str, k: int = 5) -> str | ToolOutput:
        """Search the document collection; returns document ids, titles and snippets.

        Args:
            query: What to search for, e.g. a name.
            k: How many results to return (1 to 10).
        """
        if not query.strip():
            return ToolOutput("Error: the query is empty; search for a name.", is_error=True)
        hits = backend.search(query, max(1, min(k, MAX_RESULTS)))
        if not hits:
            return f"No results for {query!r}."
        return "\n".join(f"{i}. [{h.doc_id}] {h.title}: {h.snippet}" for i, h in enumerate(hits, 1))

    def open(doc_id: str) -> str | ToolOutput:
        """Open a document and return its full text.

        Args:
            doc_id: A document id from the search results, e.g. "person/ada-quorin".
        """
        try:
            return backend.get(doc_id.strip().strip("[]"))
        except KeyError:
            return ToolOutput(
                f"Error: no document {doc_id!r}; use an id from the search results.", is_error=True
            )

    return [search, open]


def make_search_env(
    backend: SearchBackend,
    *,
    parser: str = "hermes",
    max_turns: int = 8,
    system_prompt: str | None = None,
) -> ToolEnv:
    return ToolEnv(
        search_tools(backend),
        exact_match_reward,
        parser=parser,
        max_turns=max_turns,
        system_prompt=system_prompt,
    )


# --- a world of fictional entities ------------------------------------------------------------


@dataclass(frozen=True)
class Person:
    name: str
    birth_year: int
    birth_city: str
    occupation: str


@dataclass(frozen=True)
class City:
    name: str
    country: str
    population: int


@dataclass(frozen=True)
class Company:
    name: str
    industry: str
    founded: int
    founder: str
    headquarters: str


@dataclass(frozen=True)
class World:
    people: tuple[Person, ...]
    cities: tuple[City, ...]
    companies: tuple[Company, ...]


_ONSETS = [
    "b",
    "br",
    "c",
    "d",
    "dr",
    "f",
    "g",
    "gr",
    "h",
    "k",
    "kl",
    "l",
    "m",
    "n",
    "p",
    "pr",
    "r",
    "s",
    "st",
    "t",
    "tr",
    "v",
    "z",
]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ei", "ou"]
_CODAS = ["n", "r", "l", "s", "x", "m", "th", ""]
_FIRST_NAMES = [
    "Ada",
    "Bruno",
    "Chiara",
    "Dmitri",
    "Elif",
    "Farid",
    "Greta",
    "Hugo",
    "Ines",
    "Jonah",
    "Kaia",
    "Lorenz",
    "Mira",
    "Nils",
    "Odile",
    "Pavel",
    "Quinn",
    "Rosa",
    "Soren",
    "Talia",
    "Uma",
    "Viktor",
    "Wren",
    "Yusuf",
    "Zora",
]
_COUNTRIES = ("Arvenia", "Belmora", "Castovia", "Dravland", "Estoria", "Felmark", "Galdria")
_CITY_SUFFIXES = ("vale", "port", "ford", "holm", "by", "stad", "mouth", "wick")
_COMPANY_SUFFIXES = ("Labs", "Systems", "Dynamics", "Foods", "Works", "Motors", "Analytics")
_INDUSTRIES = ("robotics", "food", "textile", "software", "biotech", "energy", "logistics")
_OCCUPATIONS = ("engineer", "chemist", "economist", "architect", "designer", "physician")


def _word(rng: random.Random, num_syllables: int) -> str:
    syllables = [rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(num_syllables)]
    return ("".join(syllables) + rng.choice(_CODAS)).capitalize()


def _unique(make: Callable[[], str], count: int) -> list[str]:
    names: dict[str, None] = {}
    while len(names) < count:
        names.setdefault(make(), None)
    return list(names)


def make_world(rng: random.Random, num_companies: int = 60, num_cities: int = 24) -> World:
    """Cities, one founder per company plus as many other people, and companies; some share
    a surname or a name root, so a search has near misses to rank below the right document."""
    city_names = _unique(lambda: _word(rng, 2) + rng.choice(_CITY_SUFFIXES), num_cities)
    cities = tuple(
        City(name, rng.choice(_COUNTRIES), rng.randrange(20, 3000) * 1000) for name in city_names
    )
    surnames = _unique(lambda: _word(rng, rng.randint(2, 3)), num_companies)
    people_names = _unique(
        lambda: f"{rng.choice(_FIRST_NAMES)} {rng.choice(surnames)}", 2 * num_companies
    )
    people = tuple(
        Person(name, rng.randint(1940, 1995), rng.choice(city_names), rng.choice(_OCCUPATIONS))
        for name in people_names
    )
    roots = _unique(lambda: _word(rng, 2), (num_companies + 1) // 2)
    company_names = _unique(
        lambda: f"{rng.choice(roots)} {rng.choice(_COMPANY_SUFFIXES)}", num_companies
    )
    companies = tuple(
        Company(
            name,
            rng.choice(_INDUSTRIES),
            founded=rng.randint(max(1960, p.birth_year + 22), 2020),
            founder=p.name,
            headquarters=rng.choice(city_names),
        )
        for name, p in zip(company_names, people)  # people[:num_companies] found companies
    )
    return World(people, cities, companies)


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def _a(noun: str) -> str:
    return f"{'an' if noun[0] in 'aeiou' else 'a'} {noun}"


def world_documents(world: World) -> list[Document]:
    docs = [
        Document(
            f"city/{slug(c.name)}",
            c.name,
            f"{c.name} is a city in {c.country} with a population of {c.population:,}. "
            f"It is known for its markets and its old harbour district.",
        )
        for c in world.cities
    ]
    docs += [
        Document(
            f"person/{slug(p.name)}",
            p.name,
            f"{p.name} is {_a(p.occupation)}. {p.name.split()[0]} was born in {p.birth_city} in "
            f"{p.birth_year} and has given many talks about their work.",
        )
        for p in world.people
    ]
    docs += [
        Document(
            f"company/{slug(c.name)}",
            c.name,
            f"{c.name} is {_a(c.industry)} company. It was founded in {c.founded} by {c.founder}. "
            f"The company is headquartered in {c.headquarters}.",
        )
        for c in world.companies
    ]
    return docs


# --- questions --------------------------------------------------------------------------------

INSTRUCTIONS = (
    "Answer the question using the search tools: search(query, k) finds documents and "
    "open(doc_id) reads one. The answer takes more than one search. When you know it, reply "
    "without a tool call, with the answer alone inside <answer></answer>."
)
QUESTION_KINDS = ("founder_birth_city", "founder_birth_year", "headquarters_country")


def make_question(world: World, company: Company, kind: str) -> tuple[str, str]:
    """(question, answer): two hops, from the company to its founder or its city."""
    founder = next(p for p in world.people if p.name == company.founder)
    if kind == "founder_birth_city":
        return f"In which city was the founder of {company.name} born?", founder.birth_city
    if kind == "founder_birth_year":
        return f"In what year was the founder of {company.name} born?", str(founder.birth_year)
    assert kind == "headquarters_country", kind
    city = next(c for c in world.cities if c.name == company.headquarters)
    return f"In which country is {company.name} headquartered?", city.country


class SearchTasks:
    name = "search"

    def __init__(self, *, seed: int = 0, num_companies: int = 60, num_eval_companies: int = 15):
        if not 1 <= num_eval_companies < num_companies:
            raise ConfigError(
                f"num_eval_companies={num_eval_companies} must be between 1 and "
                f"num_companies - 1 = {num_companies - 1}; e.g. a quarter of them"
            )
        rng = random.Random(f"{seed}/world")
        self.world = make_world(rng, num_companies)
        self.documents = world_documents(self.world)
        companies = list(self.world.companies)
        rng.shuffle(companies)
        self.eval_companies = companies[:num_eval_companies]
        self.train_companies = companies[num_eval_companies:]
        self.seed = seed
        self._eval = [
            self._make(company, kind, f"eval-{i}-{kind}")
            for i, company in enumerate(self.eval_companies)
            for kind in QUESTION_KINDS
        ]

    @functools.cached_property
    def backend(self) -> BM25Backend:
        """BM25 over this world's documents: `make_search_env(tasks.backend)`."""
        return BM25Backend(self.documents)

    def train_task(self, index: int) -> Task:
        rng = random.Random(f"{self.seed}/train/{index}")
        company = rng.choice(self.train_companies)
        return self._make(company, rng.choice(QUESTION_KINDS), f"train-{index}")

    def eval_tasks(self) -> list[Task]:
        return list(self._eval)

    def reward(self, completion: str, task: Task) -> float:
        return exact_match_reward(completion, task)

    def _make(self, company: Company, kind: str, task_id: str) -> Task:
        question, answer = make_question(self.world, company, kind)
        return Task(
            id=task_id,
            messages=(Message("user", f"{INSTRUCTIONS}\n\nQuestion: {question}"),),
            answer=answer,
            info={"kind": kind, "company": company.name},
        )
