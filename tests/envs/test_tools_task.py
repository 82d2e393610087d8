"""`[task] name = "tools"`: the user's function, the sandboxed `python` and `search` over the
user's corpus in one env over the user's rows; mistakes refused before any model loads, naming
the file and the fix; one tiny `reinforge train` through the command line."""

from __future__ import annotations

import json

import pytest

from reinforge.config import TrainConfig, load_config
from reinforge.errors import ConfigError, ExitCode
from reinforge.tasks import build_task_source
from reinforge.types import Message

from ..conftest import cli

USER_TOOLS = '''
def lookup(key: str) -> str:
    """Look up a code name in the user's table.

    Args:
        key: The code name.
    """
    return {"alpha": "17", "beta": "25"}.get(key, "unknown")


def untyped(key):
    """No type hint: cannot become a schema."""
    return key


def web_search(query: str, k: int) -> list:
    return [{"id": "https://x.test/1", "title": "Hit", "text": f"about {query}"}][:k]
'''
DOCS = [
    {"id": "d1", "title": "Zorblat", "text": "The capital of Zorblat is Quenti."},
    {"id": "d2", "title": "Mivarn", "text": "The capital of Mivarn is Oslar."},
]
ROWS = [
    {"question": "Capital of Zorblat?", "answer": "Quenti"},
    {"question": "Capital of Mivarn?", "answer": "Oslar"},
]


def call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


@pytest.fixture
def user_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # tool paths and data are relative to the working directory
    (tmp_path / "my_tools.py").write_text(USER_TOOLS)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return tmp_path


def tools_config(*overrides: str, corpus: str | None = "docs.jsonl", path: str | None = "qa.jsonl"):
    base = [
        "task.name=tools",
        'task.tools=["my_tools.py:lookup", "python", "search"]',
        "task.reward=exact_match",
        'task.sandbox={backend="rlimit"}',
    ]
    base += [f"task.corpus={corpus}"] if corpus else []
    base += [f"task.path={path}"] if path else []
    return load_config(TrainConfig, None, [*base, *overrides])


def test_an_episode_calls_the_user_function_python_and_search_then_is_scored(user_files):
    tasks = build_task_source(tools_config().task)
    names = [s["function"]["name"] for s in tasks.tool_schemas]
    assert names == ["lookup", "python", "search"]
    lookup = tasks.tool_schemas[0]["function"]
    assert lookup["description"] == "Look up a code name in the user's table."
    task = next(t for t in map(tasks.train_task, range(4)) if t.answer == "Quenti")
    state = tasks.env.reset(task)
    replies = []
    for text in (
        call("lookup", key="alpha"),
        call("python", code="print(17 * 3)") + call("search", query="Zorblat capital"),
    ):
        result = tasks.env.step(state, Message("assistant", text))
        assert not result.done
        replies += [m.content for m in result.messages]
    assert replies[0] == "17" and "51" in replies[1]
    assert replies[2].startswith("1. [d1] Zorblat: The capital of Zorblat is Quenti.")
    result = tasks.env.step(state, Message("assistant", "Quenti"))
    assert result.done and result.rewards == {"reward": 1.0}
    counters = state.info["counters"]
    assert (counters.tool_calls, counters.tool_errors, counters.turns) == (3, 0, 3)
    total, components = tasks.scorer.score(result.rewards, "Quenti", task)
    assert total == 1.0 and components == {"env": 1.0}
    wrong = tasks.env.step(tasks.env.reset(task), Message("assistant", "Oslar"))
    assert wrong.rewards == {"reward": 0.0}


def test_a_user_search_function_and_a_folder_corpus(user_files):
    tasks = build_task_source(
        tools_config(
            'task.tools=["search", "open"]',
            "task.search_backend=my_tools.py:web_search",
            corpus=None,
        ).task
    )
    state = tasks.env.reset(tasks.train_task(0))
    (hits,) = tasks.env.step(state, Message("assistant", call("search", query="cats"))).messages
    assert hits.content == "1. [https://x.test/1] Hit: about cats"
    (page,) = tasks.env.step(
        state, Message("assistant", call("open", doc_id="https://x.test/1"))
    ).messages
    assert page.content == "about cats"

    (user_files / "notes").mkdir()
    (user_files / "notes" / "zorblat.md").write_text("# Zorblat\n\nIts capital is Quenti.")
    (user_files / "notes" / "empty.txt").write_text("  ")
    tasks = build_task_source(tools_config('task.tools=["search"]', corpus="notes").task)
    state = tasks.env.reset(tasks.train_task(0))
    (hits,) = tasks.env.step(state, Message("assistant", call("search", query="capital"))).messages
    assert hits.content == "1. [zorblat.md] Zorblat: # Zorblat\n\nIts capital is Quenti."


def test_corpus_bad_rows_are_reported_by_line_and_fatal_with_on_bad_row_error(user_files, capsys):
    with open(user_files / "docs.jsonl", "a") as f:
        f.write('{"id": "d3", "title": "no text"}\nnot json\n{"id": "d1", "text": "again"}\n')
    build_task_source(tools_config().task)
    out = capsys.readouterr().out
    assert "missing text: 1 at lines 3" in out and "invalid JSON: 1 at lines 4" in out
    assert "duplicate id: 1 at lines 5" in out
    with pytest.raises(ConfigError) as e:
        build_task_source(tools_config("task.on_bad_row=error").task)
    assert "docs.jsonl" in str(e.value) and "task.on_bad_row = 'skip'" in str(e.value)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (['task.tools=["my_tools.py:untyped", "search"]'], "task.tools[0] = 'my_tools.py:untyped'"),
        (['task.tools=["missing.py:lookup", "search"]'], "missing.py does not exist"),
        (['task.tools=["my_tools.py:lookupp", "search"]'], 'did you mean "lookup"'),
        (["task.corpus=nope.jsonl"], "task.corpus = 'nope.jsonl': no such file or folder"),
    ],
)
def test_tool_and_corpus_mistakes_name_the_file_and_the_fix(user_files, overrides, message):
    with pytest.raises(ConfigError) as e:
        build_task_source(tools_config(*overrides).task)
    assert message in str(e.value)
    if "untyped" in message:
        assert "type hint on every parameter" in str(e.value)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (['task.tools=["calculator"]'], "neither a built-in tool (python, search, open)"),
        (["task.search_backend="], "set corpus"),
        (['task.tools=["python"]'], 'tools has no "search"'),
        (["task.search_backend=my_tools.py:web_search"], "set only one"),
        (["task.path="], 'task.path is required with task.name = "tools"'),
    ],
)
def test_config_mistakes_are_refused_at_load(user_files, overrides, message):
    corpus = None if overrides == ["task.search_backend="] else "docs.jsonl"
    overrides = [] if corpus is None else overrides
    with pytest.raises(ConfigError) as e:
        tools_config(*overrides, corpus=corpus)
    assert message in str(e.value)


def test_a_tiny_train_run_with_a_tools_task_through_the_cli(user_files):
    demo = {
        "messages": [
            {"role": "user", "content": "Capital of Zorblat?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "type": "function",
                        "function": {"name": "search", "arguments": '{"query": "Zorblat"}'},
                    }
                ],
            },
            {"role": "tool", "content": "1. [d1] Zorblat: The capital of Zorblat is Quenti."},
            {"role": "assistant", "content": "Quenti"},
        ],
        "answer": "Quenti",
        "extra_info": {"split": "train"},
    }
    rows = [demo] + [  # one column for all rows: a conversation, here of the question alone
        {
            "messages": [{"role": "user", "content": r["question"]}],
            "answer": r["answer"],
            "extra_info": {"split": split},
        }
        for r, split in zip(ROWS, ("train", "test"))
    ]
    (user_files / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = cli(
        "train",
        "model.path=builtin:micro",
        "run.num_threads=1",
        "log.tensorboard=false",
        "log.plot=false",
        f"run.output_dir={user_files}",
        "run.name=tools",
        "run.max_steps=1",
        "task.name=tools",
        "task.path=qa.jsonl",
        'task.tools=["my_tools.py:lookup", "python", "search"]',
        "task.corpus=docs.jsonl",
        "task.reward=exact_match",
        "task.split_column=extra_info.split",
        "task.max_context=256",
        "task.max_turns=3",
        "sft.steps=1",
        "sft.batch_size=2",
        "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=2",
        "rollout.max_new_tokens=80",
        "train.micro_batch_tokens=1024",
        cwd=user_files,
    )
    assert out.returncode == ExitCode.OK, out.stdout[-2000:] + out.stderr[-2000:]
    rows = [json.loads(line) for line in (user_files / "tools" / "metrics.jsonl").open()]
    assert any(r.get("phase") == "sft" and "loss" in r for r in rows)
    steps = [r for r in rows if r.get("phase") == "rl" and "tool_call_rate" in r]
    assert len(steps) == 1 and "reward_env" in steps[0]
    assert any("eval_reward" in r for r in rows)


def test_the_shipped_example_config_passes_the_preflight():
    """configs/tools_search.toml as shipped: its rows, corpus, recorded demonstrations and
    budgets check out (`--dry-run`: nothing trains)."""
    out = cli("train", "configs/tools_search.toml", "--dry-run")
    assert out.returncode == ExitCode.OK, out.stdout[-2000:] + out.stderr[-2000:]
    assert "4064 documents, 0 bad rows" in out.stdout
    assert "4000 training tasks, 64 held-out" in out.stdout
