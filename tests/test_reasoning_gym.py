"""`[task] name = "reasoning_gym"`: the library's datasets and its own `score_answer`, the
answer extraction, the held-out split, the config's refusals, and a training run through the CLI.
Skipped when reasoning-gym (the `reasoning` extra) is not installed."""

from __future__ import annotations

import json

import pytest

from reinforge.config.tasks import ReasoningGymTaskConfig
from reinforge.envs.env_tasks import single_turn_tasks
from reinforge.errors import ConfigError
from reinforge.faults import RewardErrors, guard_reward

pytest.importorskip("reasoning_gym", reason="reasoning-gym (the `reasoning` extra) not installed")

from reinforge.tasks import build_task_source
from reinforge.tasks.reasoning_gym_task import ReasoningGymTasks, extract_answer

from .conftest import TINY_RUN, cli

EASY = {
    "chain_sum": {"min_terms": 2, "max_terms": 2, "max_digits": 1},
    "spell_backward": {"min_word_len": 3, "max_word_len": 4},
}


def config(**kw) -> ReasoningGymTaskConfig:
    kw.setdefault("datasets", {"chain_sum": 1.0, "spell_backward": 1.0})
    kw.setdefault("dataset_config", EASY)
    return ReasoningGymTaskConfig(**kw)


def test_tasks_mix_datasets_by_weight_and_gold_answers_score_one():
    tasks = build_task_source(config(datasets={"chain_sum": 3.0, "spell_backward": 1.0}))
    assert isinstance(tasks, ReasoningGymTasks)
    train = [tasks.train_task(i) for i in range(200)]
    share = sum(t.info["data_source"] == "chain_sum" for t in train) / len(train)
    assert 0.65 < share < 0.85, share
    for t in train[:20]:
        assert t.messages[0].role == "system" and "<answer>" in t.messages[0].content
        assert t.solution == f"<answer>{t.answer}</answer>"
        assert tasks.reward(t.solution, t) == 1.0
        assert (
            tasks.reward(f"Thinking... <answer>x</answer> so <answer>{t.answer}</answer>", t) == 1
        )
        assert tasks.reward(t.answer, t) == 0.0  # no tag: nothing extracted
    wrong = next(t for t in train if t.info["data_source"] == "chain_sum")
    assert tasks.reward(f"<answer>{int(wrong.answer) + 1}</answer>", wrong) == 0.0


def test_extraction_modes():
    text = "Let me think.\n7 + 5 = 12\nanswer is 12\n\n"
    assert extract_answer(text, "whole") == text.strip()
    assert extract_answer(text, "last_line") == "answer is 12"
    assert extract_answer("<answer> 3 </answer> then <answer>4</answer>", "answer_tag") == "4"
    assert extract_answer("no tag", "answer_tag") is None and extract_answer(" ", "whole") is None
    import re

    assert extract_answer(text, "regex", re.compile(r"= (\d+)")) == "12"
    assert extract_answer(text, "regex", re.compile(r"\d+")) == "12"  # no group: the match
    tasks = ReasoningGymTasks(config(extract="last_line", system_prompt=""))
    t = tasks.train_task(0)
    assert len(t.messages) == 1 and t.solution == t.answer
    assert tasks.reward(f"I think\n{t.answer}\n", t) == 1.0


def test_partial_credit_kept_or_cut():
    """The library's own partial scores (here the default scorer: the answer inside a longer
    reply scores len(answer) / len(reply)) train as they come, or count 0 with partial_credit
    false, the criterion the evaluation's pass counts by."""
    one = {"datasets": {"chain_sum": 1.0}, "dataset_config": {"chain_sum": EASY["chain_sum"]}}
    on = ReasoningGymTasks(config(**one, extract="whole", partial_credit=True))
    off = ReasoningGymTasks(config(**one, extract="whole"))  # the default
    t = on.train_task(0)
    padded = f"{t.answer} ."
    assert on.reward(padded, t) == pytest.approx(len(t.answer) / len(padded))
    assert 0.0 < on.reward(padded, t) < 1.0
    assert off.reward(padded, off.train_task(0)) == 0.0
    assert off.reward(t.answer, off.train_task(0)) == 1.0


def test_datasets_with_many_valid_answers_train_on_their_example_or_refuse_sft():
    """reasoning-gym gives no answer (None) where many replies are right (graph_color checks a
    colouring by rule): SFT trains on the example its metadata keeps, which scores 1; a dataset
    with no example (boxnet) is refused for SFT by name, and runs RL alone."""
    graph = {"datasets": {"graph_color": 1.0}, "dataset_config": {}, "extract": "whole"}
    tasks = build_task_source(config(**graph), needs_solutions=True)
    for t in [tasks.train_task(i) for i in range(10)]:
        assert t.solution and t.solution != "None" and t.solution.startswith("{")
        assert tasks.reward(t.solution, t) == 1.0
        assert tasks.reward('{"0": 1}', t) < 1.0
    easy_sum = {"chain_sum": EASY["chain_sum"]}
    boxnet = {"datasets": {"boxnet": 1.0, "chain_sum": 1.0}, "dataset_config": easy_sum}
    with pytest.raises(ConfigError, match=r"'boxnet' gives no reference.*sft.steps = 0.*drop"):
        build_task_source(config(**boxnet), needs_solutions=True)
    rl_only = build_task_source(config(**boxnet), needs_solutions=False)
    box = next(t for t in map(rl_only.train_task, range(50)) if t.info["data_source"] == "boxnet")
    assert box.solution is None and box.answer == ""


def test_held_out_questions_never_train_and_draws_are_deterministic():
    cfg = config(num_eval=100)
    a, b = ReasoningGymTasks(cfg), ReasoningGymTasks(cfg)
    held_out = {t.info["key"] for t in a.eval_tasks()}
    assert len(held_out) > 50  # 1-digit sums and short words: some repeats among 100 draws
    train = [a.train_task(i) for i in range(1000)]
    assert not held_out & {t.info["key"] for t in train}
    assert [t.messages for t in train[:30]] == [b.train_task(i).messages for i in range(30)]
    other = ReasoningGymTasks(config(num_eval=100, seed=7))
    assert [t.messages for t in other.eval_tasks()] != [t.messages for t in a.eval_tasks()]


def test_config_mistakes_are_refused_with_the_fix():
    with pytest.raises(ConfigError, match=r"'chain_sums' is not a reasoning-gym.*'chain_sum'"):
        ReasoningGymTasks(config(datasets={"chain_sums": 1.0}, dataset_config={}))
    with pytest.raises(ConfigError, match=r"\['terms'\] are not settings of ChainSumConfig.*"):
        ReasoningGymTasks(config(dataset_config={"chain_sum": {"terms": 2}}))
    with pytest.raises(ConfigError, match="max_terms must be >= min_terms"):
        ReasoningGymTasks(config(dataset_config={"chain_sum": {"min_terms": 5, "max_terms": 2}}))
    with pytest.raises(ConfigError, match=r"could not generate an item.*weights"):
        # two operators but the three default operators_weights: the generator fails
        operators = {"operators": ["+", "-"]}
        ReasoningGymTasks(
            config(datasets={"simple_equations": 1}, dataset_config={"simple_equations": operators})
        )
    with pytest.raises(ConfigError, match="seed"):  # reinforge's task.seed, not the library's
        ReasoningGymTasks(config(dataset_config={"chain_sum": {"seed": 3}}))
    # a space smaller than the held-out split fails when built, not mid-run
    tiny_space = {"chain_sum": {"min_terms": 2, "max_terms": 2, "max_digits": 1}}
    with pytest.raises(ConfigError, match=r"lower task\.num_eval"):
        ReasoningGymTasks(
            config(datasets={"chain_sum": 1}, dataset_config=tiny_space, num_eval=5000)
        )
    with pytest.raises(ValueError, match="dataset_config names \\['gcd'\\]"):
        config(dataset_config={"gcd": {}})
    with pytest.raises(ValueError, match="weights must be above 0"):
        config(datasets={"chain_sum": 0.0})
    with pytest.raises(ValueError, match="answer_regex"):
        config(extract="regex")


def test_question_after_shows_the_data_alone_and_refuses_a_missing_marker():
    """Long library instructions cut for a short-context model; scoring and the split keep
    the whole question."""
    grid = {"shortest_path": {"min_rows": 3, "max_rows": 3, "min_cols": 3, "max_cols": 3}}
    marker = "in the following grid:"
    short = ReasoningGymTasks(
        config(
            datasets={"shortest_path": 1.0},
            dataset_config=grid,
            question_after={"shortest_path": marker},
        )
    )
    full = ReasoningGymTasks(config(datasets={"shortest_path": 1.0}, dataset_config=grid))
    for i in range(20):
        a, b = short.train_task(i), full.train_task(i)
        shown, whole = a.messages[-1].content, b.messages[-1].content
        assert whole.rstrip().endswith(shown) and marker in whole and marker not in shown
        assert set(shown) <= set("OX*#\n ") and len(shown) < len(whole) / 5, shown
        assert a.info["key"] == b.info["key"] and a.solution == b.solution
        assert short.reward(a.solution, a) == 1.0
    with pytest.raises(ConfigError, match=r"question_after.shortest_path='no such text'.*does not"):
        ReasoningGymTasks(
            config(
                datasets={"shortest_path": 1.0},
                dataset_config=grid,
                question_after={"shortest_path": "no such text"},
            )
        )
    with pytest.raises(ValueError, match=r"question_after names \['gcd'\]"):
        config(question_after={"gcd": "x"})
    with pytest.raises(ValueError, match="empty marker"):
        config(question_after={"chain_sum": " "})


def test_a_score_answer_that_raises_is_counted_not_a_crash():
    env_tasks = single_turn_tasks(ReasoningGymTasks(config()))
    task = env_tasks.train_task(0)
    broken = type(task)(task.id, task.messages, task.answer, task.solution, {**task.info})
    broken.info["entry"] = {"question": "?"}  # no answer, no metadata: score_answer raises
    errors = RewardErrors()
    total, parts = env_tasks.scorer.score(
        {}, f"<answer>{task.answer}</answer>", broken, None, errors
    )
    assert total == 0.0 and parts == {"env": 0.0}
    assert errors.metrics()["reward_errors"] == 1
    total, _ = env_tasks.scorer.score({}, f"<answer>{task.answer}</answer>", task, None, errors)
    assert total == 1.0


def test_trains_through_the_cli(tmp_path):
    overrides = [o for o in TINY_RUN if not o.startswith("task.")]
    cfg = tmp_path / "rg.toml"
    cfg.write_text(
        '[task]\nname = "reasoning_gym"\ndatasets = {chain_sum = 1.0, spell_backward = 1.0}\n'
        'extract = "whole"\nsystem_prompt = ""\nnum_eval = 8\n'
        "[task.dataset_config]\nchain_sum = {min_terms = 2, max_terms = 2, max_digits = 1}\n"
        "spell_backward = {min_word_len = 3, max_word_len = 3}\n"
    )
    result = cli(
        "train",
        str(cfg),
        *overrides,
        f"run.output_dir={tmp_path}",
        "run.name=rg",
        "run.max_steps=2",
        "sft.steps=2",
        "eval.every=2",
        "checkpoint.every=0",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "rg" / "metrics.jsonl").open()]
    evals = [r for r in rows if "eval_accuracy" in r]
    assert evals and all("eval_pass@1/chain_sum" in r for r in evals), evals[-1].keys()
    samples = [json.loads(line) for line in (tmp_path / "rg" / "samples.jsonl").open()]
    assert {s["data_source"] for s in samples} <= {"chain_sum", "spell_backward"}


QUEENS = {"n": 8, "min_remove": 2, "max_remove": 4}


def queens_and_countdown():
    """Two datasets whose scorers run answers as code: the tasks, an n_queens and a countdown
    task (answers scored as they come: `extract = "whole"`, no system prompt)."""
    tasks = build_task_source(
        config(
            datasets={"n_queens": 1.0, "countdown": 1.0},
            dataset_config={"n_queens": QUEENS},
            num_eval=8,
            extract="whole",
            system_prompt="",
        )
    )
    train = [tasks.train_task(i) for i in range(40)]
    queens = next(t for t in train if t.info["data_source"] == "n_queens")
    countdown = next(t for t in train if t.info["data_source"] == "countdown")
    return tasks, queens, countdown


def test_answers_that_look_like_code_never_reach_a_scorer_that_runs_them(tmp_path):
    """n_queens' scorer `eval`s an answer that is not one of its boards, countdown's runs it
    through sympy's parse_expr: an attack is refused unscored and counted (a reward error),
    whatever the extraction; boards and arithmetic are scored as before."""
    from reinforge.tasks.reasoning_gym_task import UnsafeAnswer

    marker = tmp_path / "pwned"
    tasks, queens, countdown = queens_and_countdown()
    assert tasks.reward(queens.solution, queens) == 1.0
    assert tasks.reward(countdown.solution, countdown) == 1.0
    attacks = [
        f"__import__('os').system('touch {marker}')",
        f"open('{marker}', 'w').write('x')",
        "exit()",
        f"lambdify(x, 'o' + 's' + chr(46) + 'system(\"touch {marker}\")')(1)",
        f'S("touch {marker}")',
        "().x",
    ]
    for task in (queens, countdown):
        for attack in attacks:
            with pytest.raises(UnsafeAnswer, match="was not scored"):
                tasks.reward(attack, task)
    assert not marker.exists()
    # through the rollout's scoring: each refusal is a counted zero, the rest scores
    errors = RewardErrors()
    reward = guard_reward(tasks.reward, errors)
    scored = [reward(a, queens) for a in [*attacks, queens.solution]]
    assert scored == [0.0] * len(attacks) + [1.0] and errors.counts["reward_errors"] == len(attacks)


def test_a_scorer_that_hangs_or_exits_costs_its_worker_not_the_run():
    """Past the screen, the scorer still runs in a worker: `exit()` in n_queens' `eval` kills
    only the worker (the call reports it, the pool replaces it), and a power tower that sympy
    would compute for ever (countdown) times out; the next answers score as usual."""
    import reinforge.tasks.reasoning_gym_scoring as scoring
    from reinforge.rewards.math import MathVerifier

    _, queens, countdown = queens_and_countdown()
    q = ("n_queens", json.dumps(QUEENS, sort_keys=True), 0, queens.info["entry"])
    c = ("countdown", "{}", 0, countdown.info["entry"])
    with MathVerifier(num_workers=1, timeout_s=3.0, checker=scoring.__name__, label="rg") as pool:
        results = pool.check_batch(
            [(*q, "exit()"), (*c, "9**9**9**9**9"), (*q, queens.solution), (*c, countdown.solution)]
        )
        assert results[0][0] == 0.0 and "died" in results[0][1]
        assert results[1] == (0.0, "ran past the 3 s timeout")
        assert results[2:] == [(1.0, None), (1.0, None)]
        assert pool.num_timeouts == 1


def test_the_screen_passes_answers_of_every_shape_and_flags_only_evaluating_scorers():
    from reasoning_gym.factory import DATASETS

    from reinforge.tasks.reasoning_gym_scoring import code_hazard, evaluates_code

    for answer in ["_ Q _ _\n_ _ _ Q", "1 2 3 4", "[[0, 1], [1, 0]]", "3*4+5", "EACADDE"]:
        assert code_hazard(answer) is None, answer
    for answer in ["x**3/3 + sin(x) + C", "['1', '2', '10']", "The sum is 5. So 5", "A → B"]:
        assert code_hazard(answer) is None, answer
    assert code_hazard("x.real") == "an attribute access"
    assert code_hazard("Function('f')(x)") == "a string literal beside a call"
    flagged = {n for n, (cls, _) in DATASETS.items() if evaluates_code(cls)}
    assert {"n_queens", "countdown", "spiral_matrix", "simple_integration"} <= flagged
    assert not flagged & {"graph_color", "shortest_path", "spell_backward", "chain_sum"}


def test_a_dataset_that_caps_its_size_draws_within_it():
    """word_ladder refuses more than 20,000 items; the task takes the largest index space the
    dataset accepts instead of failing, and its gold ladders score 1."""
    settings = {"min_word_length": 3, "max_word_length": 3}
    tasks = build_task_source(
        config(
            datasets={"word_ladder": 1.0},
            dataset_config={
                "word_ladder": settings | {"min_chain_length": 3, "max_chain_length": 4}
            },
            num_eval=16,
            extract="whole",
            system_prompt="",
        )
    )
    assert tasks.datasets["word_ladder"].config.size == 20_000
    train = [tasks.train_task(i) for i in range(8)]
    assert all(tasks.reward(t.solution, t) == 1.0 for t in train)
    with pytest.raises(ConfigError, match="max_chain_length cannot be -1"):  # not a size error
        build_task_source(
            config(
                datasets={"word_ladder": 1.0},
                dataset_config={"word_ladder": settings | {"min_chain_length": 3}},
            )
        )


class _Indices:
    """An rng whose draws are the given indices, in order."""

    def __init__(self, *indices: int):
        self.indices = list(indices)

    def randrange(self, _stop: int) -> int:
        return self.indices.pop(0)


MAZE = {"maze": {"min_grid_size": 5, "max_grid_size": 6, "min_dist": 2, "max_dist": 6}}


def test_an_item_the_generator_fails_on_is_a_counted_skip(capsys):
    # maze item 403 (seed 0, these settings) raises "Could not find suitable path cell after
    # 1000 attempts" inside reasoning-gym: it ended a learning-suite run in session 17
    tasks = ReasoningGymTasks(config(datasets={"maze": 1.0}, dataset_config=MAZE, seed=0))
    with pytest.raises(RuntimeError, match="suitable path cell"):
        tasks.datasets["maze"][403]
    entry = tasks._entry("maze", _Indices(403, 1439, 404))
    assert entry == tasks.datasets["maze"][404]
    assert tasks.skipped_items["maze"] == 2
    err = capsys.readouterr().err
    assert err.count("could not generate item") == 1 and "item 403" in err  # the first only
    [note] = tasks.notes()
    assert "maze: 2 item(s)" in note


def test_a_generator_that_always_fails_is_a_config_error(monkeypatch):
    tasks = ReasoningGymTasks(config(datasets={"maze": 1.0}, dataset_config=MAZE, seed=0))
    dataset = tasks.datasets["maze"]

    def broken(_index):
        raise RuntimeError("no grid")

    monkeypatch.setattr(type(dataset), "__getitem__", lambda self, i: broken(i))
    with pytest.raises(ConfigError, match=r"an item of maze on 20 indices in a row .*no grid"):
        tasks.train_task(10_000)


def _questions(tasks) -> list[str]:
    return [t.messages[-1].content for t in tasks]


def test_slow_generators_build_items_ahead_in_workers_and_the_tasks_are_the_same(monkeypatch):
    import reinforge.tasks.reasoning_gym_task as rg_task

    monkeypatch.setattr(rg_task, "SLOW_ITEM_S", float("inf"))
    plain = ReasoningGymTasks(config(num_eval=20))
    assert plain._ahead is None
    monkeypatch.setattr(rg_task, "SLOW_ITEM_S", 0.0)  # every dataset counts as slow
    ahead = ReasoningGymTasks(config(num_eval=20))
    assert ahead._slow == {"chain_sum", "spell_backward"}
    ahead.prefetch(range(100, 140))
    train = [ahead.train_task(i) for i in range(100, 140)]
    # built in worker processes: the held-out split, the early draws and these
    assert ahead._ahead.taken >= 20 + 40 - 2  # (a held-out collision redraws in-process)
    assert _questions(ahead.eval_tasks()) == _questions(plain.eval_tasks())
    assert _questions(train) == _questions(plain.train_task(i) for i in range(100, 140))
    assert [t.answer for t in train] == [plain.train_task(i).answer for i in range(100, 140)]


def test_an_item_a_worker_fails_to_generate_is_a_counted_skip(monkeypatch):
    import reinforge.tasks.reasoning_gym_task as rg_task

    monkeypatch.setattr(rg_task, "SLOW_ITEM_S", 0.0)
    tasks = ReasoningGymTasks(
        config(datasets={"maze": 1.0}, dataset_config=MAZE, num_eval=4, seed=0)
    )
    tasks._ahead.submit([("maze", 403), ("maze", 1439), ("maze", 404)])
    taken = tasks._ahead.taken
    entry = tasks._entry("maze", _Indices(403, 1439, 404))
    assert tasks._ahead.taken == taken + 3  # all three came from the workers
    assert entry == tasks.datasets["maze"][404]
    assert tasks.skipped_items["maze"] == 2


def test_an_item_that_cannot_come_back_from_a_worker_is_built_in_process():
    from reinforge.tasks.reasoning_gym_items import ItemsAhead

    # the worker cannot build this dataset (its create_dataset raises): the future fails, and
    # `take` says so with None, which `_entry` answers by building the item itself
    ahead = ItemsAhead({"no_such_dataset": "{}"}, 0)
    ahead.submit([("no_such_dataset", 1)])
    assert ahead.take(("no_such_dataset", 1)) is None
    assert ahead.take(("no_such_dataset", 2)) is None  # never submitted
    assert ahead.taken == 0
