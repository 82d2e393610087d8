"""math-verify answer checking through the worker pool: equivalent forms, wrong answers,
pathological answers that must cost one timeout each, never a stalled caller, concurrent callers
checking in parallel, and a memory bomb killed by the workers' memory cap."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from reinforge.errors import ConfigError
from reinforge.rewards import math as math_rewards_module
from reinforge.rewards.math import MathVerifier, math_reward, math_rewards
from reinforge.types import Message, Task

TIMEOUT_S = 2.0
TOWER = r"\boxed{9^{9^{9^{9}}}}"  # sympy tries to evaluate this for minutes
FACTORIAL = r"The answer is $(10^{8})!$"
NUM_WORKERS = 4


@pytest.fixture(scope="module")
def verifier():
    with MathVerifier(num_workers=NUM_WORKERS, timeout_s=TIMEOUT_S) as v:
        yield v


def _task(answer: str) -> Task:
    return Task(id="t", messages=(Message("user", "?"),), answer=answer)


@pytest.mark.parametrize(
    ("completion", "answer"),
    [
        (r"So the answer is \boxed{\frac{1}{2}}.", "0.5"),
        (r"\boxed{0.5}", r"\frac{1}{2}"),
        ("We get 1/2", r"\frac{1}{2}"),
        (r"\boxed{\dfrac12}", "1/2"),
        ("x = 3", "x=3"),
        (r"The answer is $x=3$.", "3"),
        (r"\boxed{3}", "x=3"),
        (r"\boxed{2\sqrt3}", r"\sqrt{12}"),
        (r"\boxed{\frac{\pi}{2}}", r"\pi/2"),
        (r"\boxed{1000}", "1,000"),
        (r"\boxed{\{2, 1\}}", r"\{1,2\}"),
        # \boxed{} wins over a later number; without a box, the last number is the answer.
        (r"First \boxed{7}, then 8", "7"),
        ("I first thought 3 but finally 4", "4"),
    ],
)
def test_equivalent_forms_score_one(verifier, completion, answer):
    assert verifier.score(completion, answer) == 1.0


@pytest.mark.parametrize(
    ("completion", "answer"),
    [
        (r"\boxed{\frac{1}{3}}", "0.5"),
        (r"\boxed{0.51}", "1/2"),
        (r"First \boxed{7}, then 8", "8"),
        ("I first thought 3 but finally 4", "3"),
        (r"\boxed{x=4}", "x=3"),
        ("I do not know.", "3"),
        ("", "3"),
    ],
)
def test_different_answers_score_zero(verifier, completion, answer):
    assert verifier.score(completion, answer) == 0.0


def test_pathological_answers_time_out_while_the_rest_of_the_batch_scores(verifier):
    before = verifier.stats()
    pairs = [
        (TOWER, "1"),
        (r"\boxed{2}", "2"),
        ("0.25", r"\frac14"),
        (r"\boxed{5}", "6"),
        (FACTORIAL, "1"),
        ("x = -1", "-1"),
    ]
    start = time.monotonic()
    rewards = verifier.score_batch(pairs)
    elapsed = time.monotonic() - start
    assert rewards == [0.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    assert elapsed < 3 * TIMEOUT_S
    assert verifier.num_timeouts == before["num_timeouts"] + 2
    assert verifier.num_checked == before["num_checked"] + len(pairs)
    assert verifier.num_errors == before["num_errors"]
    # The killed workers were replaced: the pool keeps scoring.
    assert verifier.score_batch([(r"\boxed{4}", "4"), ("3", "2")]) == [1.0, 0.0]


def test_single_pathological_call_costs_one_timeout(verifier):
    timeouts = verifier.num_timeouts
    start = time.monotonic()
    assert verifier.score(TOWER, "1") == 0.0
    assert time.monotonic() - start < 3 * TIMEOUT_S
    assert verifier.num_timeouts == timeouts + 1


def test_unparsable_ground_truth_counts_an_error(verifier):
    errors = verifier.num_errors
    assert verifier.score_batch([(r"\boxed{1}", ""), (r"\boxed{1}", "1")]) == [0.0, 1.0]
    assert verifier.num_errors == errors + 1
    assert "ground-truth" in verifier.last_error


@pytest.mark.parametrize("index", [0, NUM_WORKERS - 1])
def test_worker_that_died_is_replaced(verifier, index):
    # Whether it died idle or while still starting (after an earlier test's timeout), a worker
    # killed from outside is replaced and the batch scores in full.
    worker = verifier._workers[index]
    worker.process.kill()
    worker.process.join()
    verifier.wait_until_ready()  # a worker killed while starting has a successor by now
    pairs = [(r"\boxed{2}", "2")] * (NUM_WORKERS + 2)  # takes every free worker, the dead one too
    assert verifier.score_batch(pairs) == [1.0] * len(pairs)
    assert worker not in verifier._workers


def _timed(results: dict, key: str, fn, *args) -> None:
    start = time.monotonic()
    value = fn(*args)
    results[key] = (value, time.monotonic() - start)


def test_concurrent_callers_check_in_parallel(verifier):
    # One thread per worker; three send an answer sympy chews on for minutes, one a batch of
    # ordinary answers. Taking turns (one lock) made this 3 timeouts + restarts long; in parallel
    # it is one timeout, and the ordinary batch never waits for the slow ones.
    verifier.wait_until_ready()
    timeouts = verifier.num_timeouts
    results: dict = {}
    calls = [(f"slow{i}", verifier.score, TOWER, "1") for i in range(NUM_WORKERS - 1)]
    calls.append(("batch", verifier.score_batch, [(r"\boxed{2}", "2"), ("3", "4")] * 2))
    threads = [threading.Thread(target=_timed, args=(results, *call)) for call in calls]
    start = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - start
    assert results["batch"][0] == [1.0, 0.0, 1.0, 0.0]
    assert results["batch"][1] < TIMEOUT_S
    assert all(results[f"slow{i}"][0] == 0.0 for i in range(NUM_WORKERS - 1))
    assert elapsed < TIMEOUT_S + 1.5, f"{elapsed:.1f} s for one {TIMEOUT_S} s timeout"
    assert verifier.num_timeouts == timeouts + NUM_WORKERS - 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the memory cap is Linux-only")
def test_memory_bomb_is_killed_and_the_pool_recovers():
    # 300,000 digits: sympy's integer takes ~160 MB to build, far past a 64 MB cap, in ~1 s.
    bomb = r"\boxed{" + "9" * 300_000 + "}"
    with MathVerifier(num_workers=1, timeout_s=30.0, memory_mb=64) as v:
        (worker,) = v._workers
        assert v.score(bomb, "1") == 0.0
        assert v.num_out_of_memory == 1 and v.num_timeouts == 0
        assert "64 MB" in v.last_error
        assert v.score(r"\boxed{2}", "2") == 1.0  # on the worker that replaced it
        assert worker not in v._workers and not worker.process.is_alive()


def test_math_reward_reads_task_answer(verifier, monkeypatch):
    monkeypatch.setattr(math_rewards_module, "_default", verifier)
    assert math_reward(r"Thus \boxed{\frac{3}{4}}.", _task("0.75")) == 1.0
    assert math_reward(r"Thus \boxed{\frac{3}{4}}.", _task("0.7")) == 0.0
    assert math_rewards(["1/2", "2"], [_task("0.5"), _task("3")]) == [1.0, 0.0]


def test_closed_verifier_refuses_work():
    v = MathVerifier(num_workers=1, timeout_s=TIMEOUT_S)
    processes = [w.process for w in v._workers]
    v.close()
    assert v.is_closed
    assert not any(p.is_alive() for p in processes)
    with pytest.raises(RuntimeError, match="closed"):
        v.score("1", "1")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_workers": 0}, "num_workers=2"),
        ({"timeout_s": 0}, "timeout_s=5.0"),
        ({"memory_mb": 8}, "memory_mb=1024"),
    ],
)
def test_bad_settings_name_a_working_value(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        MathVerifier(**kwargs)
