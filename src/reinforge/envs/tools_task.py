"""`[task] name = "tools"`: the user's questions answered through the user's tools and built-in
ones, in one `ToolEnv` (envs/tool_env.py).

`build_tools_task(cfg)` resolves everything before any model loads, each mistake a
`ConfigError` naming the setting and the fix: the tools (`task.tools`: "file.py:function" or
"package.module:function", whose signature and docstring become the schema, and the built-ins
"python", "search", "open"), the documents `search` looks through (`task.corpus`,
envs/corpus.py, or the user's `task.search_backend`), and the rows, read like
`name = "dataset"`'s (tasks/dataset.py: any format, `columns.*`, `on_bad_row`, held-out rows by
file, fraction or `split_column`). An episode's env score is the row's reward by data_source
(math, exact_match or the user's) on the last assistant message; `task.rewards` weighs it with
further components (envs/sources.py `EpisodeScorer`).

A row whose conversation (a `messages` column) holds assistant turns is also an SFT
demonstration: the prompt is the conversation before its first assistant turn, and the rest,
tool calls and tool results in the OpenAI format, is replayed for the SFT stage
(train/sft/demos.py `recorded_demonstration`).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

from reinforge.errors import ConfigError
from reinforge.types import Message, Task

Conversation = tuple[Message, ...]


class ToolsTasks:
    """The rows as env tasks (prompts up to the first assistant turn), and the recorded
    conversations of the training rows that have one."""

    def __init__(self, rows, seed: int = 0):
        self.rows = rows  # data.source.DatasetTasks
        self.name = rows.name
        self.seed = seed
        self._prompts: dict[str, Task] = {}
        self.demos: list[Conversation] = []  # training rows' recorded conversations
        for task in rows.train:
            conversation = self._split(task)
            if conversation is not None:
                self.demos.append(conversation)
        self._eval = [self._prompt(t) for t in rows.eval]

    def _split(self, task: Task) -> Conversation | None:
        """Keep `task`'s prompt (messages before its first assistant turn); return its whole
        conversation when it has assistant turns."""
        conversation = task.messages
        if task.solution is not None:
            conversation = (*conversation, Message("assistant", task.solution))
        first = next((i for i, m in enumerate(conversation) if m.role == "assistant"), None)
        prompt = conversation if first is None else conversation[:first]
        self._prompts[task.id] = dataclasses.replace(task, messages=prompt, solution=None)
        return None if first is None else conversation

    def _prompt(self, task: Task) -> Task:
        if task.id not in self._prompts:
            self._split(task)
        return self._prompts[task.id]

    def train_task(self, index: int) -> Task:
        return self._prompt(self.rows.train_task(index))

    def eval_tasks(self) -> list[Task]:
        return list(self._eval)

    def reward(self, completion: str, task: Task) -> float:
        return self.rows.reward(completion, task)

    def demo(self, index: int) -> Conversation:
        """Recorded conversation `index` of the SFT stream: epoch `index // n` visits the n
        demonstrations in its own seeded order."""
        assert self.demos, "no recorded demonstrations; check demos first"
        epoch, position = divmod(index, len(self.demos))
        order = list(range(len(self.demos)))
        random.Random(f"{self.seed}/demos/{epoch}").shuffle(order)
        return self.demos[order[position]]


def build_tools_task(cfg):
    """The `EnvTasks` of a `ToolsTaskConfig`."""
    from reinforge.envs.env_tasks import EnvTasks, EpisodeScorer, env_tasks_of
    from reinforge.envs.tool_env import ToolCounters, ToolEnv
    from reinforge.tasks.dataset import load_dataset_source

    tools = resolve_tools(cfg)
    rows = load_dataset_source(cfg, None, needs_answers=cfg.require_answer is not False)
    if not rows.can_score:
        raise ConfigError(
            f'task.name = "tools" scores each episode against its row\'s answer, and the rows of '
            f"{cfg.path} have none; set task.columns.answer to the column holding it"
        )
    tasks = ToolsTasks(rows, cfg.seed)
    env = ToolEnv(
        tools,
        rows.reward,
        parser=cfg.parser,
        system_prompt=cfg.system_prompt,
        max_turns=cfg.max_turns,
        max_calls_per_turn=cfg.max_calls_per_turn,
        max_output_chars=cfg.max_tool_output_chars,
    )
    counters = tuple(f.name for f in fields(ToolCounters))
    scorer = EpisodeScorer(cfg.rewards, ())
    return EnvTasks(cfg.name, tasks, env, scorer, counters, **env_tasks_of(cfg))


def resolve_tools(cfg) -> list[Callable[..., Any]]:
    """The functions `task.tools` names, each checked to make a tool schema."""
    from reinforge.envs.search_env import search_tools
    from reinforge.envs.tools import tool_schema
    from reinforge.rewards.mix import load_callable

    backend = search_backend(cfg) if {"search", "open"} & set(cfg.tools) else None
    builtins = {"python": lambda: python_tool(cfg.sandbox)}
    if backend is not None:
        search, open_ = search_tools(backend)
        builtins.update(search=lambda: search, open=lambda: open_)
    fns = []
    for i, ref in enumerate(cfg.tools):
        setting = f"task.tools[{i}]"
        if ref in builtins:
            fns.append(builtins[ref]())
            continue
        fn = load_callable(ref, setting=setting)
        try:
            tool_schema(fn)
        except ConfigError as e:
            raise ConfigError(f"{setting} = {ref!r}: {e}") from None
        fns.append(fn)
    names = [getattr(fn, "__name__", "") for fn in fns]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(
            f"task.tools = {cfg.tools} gives two tools the name {twice[0]!r} (the model calls "
            "tools by name); rename your function"
        )
    return fns


_CORPORA: dict[tuple[str, str], Any] = {}  # (corpus, on_bad_row) -> its BM25 index


def search_backend(cfg):
    """BM25 over `task.corpus` (read, reported and indexed once per process: a command builds
    its task source more than once), or the user's `task.search_backend` function."""
    from reinforge.envs.corpus import FunctionBackend, load_corpus
    from reinforge.envs.search_env import BM25Backend
    from reinforge.metrics import console
    from reinforge.rewards.mix import load_callable

    if cfg.search_backend is not None:
        fn = load_callable(cfg.search_backend, setting="task.search_backend")
        return FunctionBackend(fn, cfg.search_backend)
    key = (str(Path(cfg.corpus).expanduser().resolve()), cfg.on_bad_row)
    if key not in _CORPORA:
        documents, report = load_corpus(cfg.corpus, cfg.on_bad_row)
        console.print(f"corpus: {report.summary()}", markup=False)
        _CORPORA[key] = BM25Backend(documents)
    return _CORPORA[key]


def python_tool(s) -> Callable[..., Any]:
    """The sandboxed `python(code)` tool with the limits of a `[task.sandbox]` section."""
    from reinforge.envs.sandbox import make_python_tool, sandbox_from_config

    return make_python_tool(sandbox_from_config(s))
