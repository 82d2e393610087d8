"""The learning diagnostics: update size, clip fractions, headroom and the flat-reward note, on
hand-made numbers and groups; and the run that logs them."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from reinforge.algorithms.losses import LossInputs, PolicyLossSettings, ppo_clip_loss
from reinforge.eval.answers import answer_spread, question_blind
from reinforge.train.loop.diagnostics import (
    clip_fractions,
    headroom_metrics,
    headroom_text,
    policy_change,
    question_repeats,
    task_consistency,
)
from reinforge.train.loop.run_notes import explain_run, reward_trend

from ..conftest import TINY_RUN, cli


def test_policy_change_on_hand_computed_tokens():
    old_BT = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.2, 0.2, 0.2]]))
    new_BT = torch.log(torch.tensor([[0.25, 0.5, 0.9], [0.3, 0.2, 0.2]]))
    mask_BT = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])  # the third token is padding
    advantages_B = torch.tensor([-1.0, 2.0])
    got = policy_change(new_BT, old_BT, advantages_B, mask_BT, clip_low=0.2, clip_high=0.2)
    # ratios on the four counted tokens: 0.5, 1, 1.5, 1; k3 = r - 1 - log r
    k3 = [0.5 - 1 - math.log(0.5), 0.0, 0.5 - math.log(1.5), 0.0]
    assert got["policy_kl"] == pytest.approx(sum(k3) / 4)
    assert got["policy_kl_no_signal"] == 0.0  # every token had an advantage
    no_signal = policy_change(new_BT, old_BT, torch.tensor([0.0, 2.0]), mask_BT, 0.2, 0.2)
    assert no_signal["policy_kl_no_signal"] == pytest.approx(sum(k3[:2]) / 4)
    assert got["policy_ratio_low_frac"] == pytest.approx(1 / 4)  # 0.5 < 0.8
    assert got["policy_ratio_high_frac"] == pytest.approx(1 / 4)  # 1.5 > 1.2
    # the first sequence (advantage < 0) lost probability, the second (> 0) gained: both count
    assert got["policy_shift_signed"] == pytest.approx((math.log(2) + math.log(1.5)) / 4)


def test_unchanged_policy_has_zero_change():
    old_BT = torch.log(torch.full((2, 3), 0.4))
    got = policy_change(old_BT, old_BT, torch.tensor([1.0, -1.0]), torch.ones(2, 3), 0.2, 0.28)
    assert got == {
        "policy_kl": 0.0,
        "policy_kl_no_signal": 0.0,
        "policy_ratio_low_frac": 0.0,
        "policy_ratio_high_frac": 0.0,
        "policy_shift_signed": 0.0,
    }


def test_clip_fractions_split_the_losses_clip_frac():
    # ratios 1.5 (A > 0: cut high), 0.5 (A < 0: cut low), 0.5 (A > 0: not cut), 1.0
    old_BT = torch.zeros(4, 1)
    new_BT = torch.log(torch.tensor([[1.5], [0.5], [0.5], [1.0]]))
    x = LossInputs(
        logprobs_BT=new_BT.requires_grad_(),
        old_logprobs_BT=old_BT,
        advantages_B=torch.tensor([1.0, -1.0, 1.0, -1.0]),
        mask_BT=torch.ones(4, 1),
        num_tokens_total=8.0,  # this micro-batch is half of the step's tokens
        num_seqs_total=8.0,
    )
    s = PolicyLossSettings(clip_low=0.2, clip_high=0.2)
    got = clip_fractions(x, s)
    assert float(got["clip_low_frac"]) == pytest.approx(1 / 8)
    assert float(got["clip_high_frac"]) == pytest.approx(1 / 8)
    _, loss_metrics = ppo_clip_loss(x, s)
    total = float(got["clip_low_frac"] + got["clip_high_frac"])
    assert total == pytest.approx(float(loss_metrics["clip_frac"]))


def test_headroom_of_hand_made_groups():
    greedy = [[1.0], [0.0], [0.0]]
    sampled = [[1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.5, 0.0]]  # 0.5: no pass
    got = headroom_metrics(greedy, sampled, k=4)
    assert got["eval_sampled_pass@1"] == pytest.approx((0.5 + 0.25 + 0.0) / 3)
    assert got["eval_sampled_pass@4"] == pytest.approx(2 / 3)
    assert got["eval_headroom"] == pytest.approx(2 / 3 - 1 / 3)
    assert "pass@4 0.667 (headroom +0.333)" in headroom_text(got)
    # k = 2 of 4 samples: 1 - C(2,2)/C(4,2) = 5/6 for a task with 2 of 4 right
    assert headroom_metrics([[1.0]], [[1.0, 1.0, 0.0, 0.0]], k=2)["eval_sampled_pass@2"] == (
        pytest.approx(5 / 6)
    )


def test_reward_trend_tells_noise_from_change():
    noisy_flat = [0.30, 0.34, 0.28, 0.33, 0.29, 0.31, 0.35, 0.27, 0.32]
    assert reward_trend(noisy_flat)[0] == "flat"
    assert reward_trend([0.1, 0.12, 0.11, 0.2, 0.22, 0.21, 0.3, 0.33, 0.31])[0] == "rising"
    verdict, first, last = reward_trend([0.40, 0.41, 0.39, 0.35, 0.36, 0.34, 0.30, 0.31, 0.29])
    assert (verdict, first, last) == ("falling", pytest.approx(0.40), pytest.approx(0.30))


def _rows(rewards, zero_signal, policy_kl, evals, collateral=0.0):
    steps = [
        {"step": i + 1, "phase": "rl", "reward_mean": r, "zero_signal_groups": zero_signal}
        | {"policy_kl": policy_kl, "policy_kl_no_signal": collateral * policy_kl}
        | {"policy_shift_signed": 1e-3}
        for i, r in enumerate(rewards)
    ]
    return steps + [{"phase": "rl", **e} for e in evals]


def test_flat_reward_note_names_the_reasons():
    rows = _rows(
        [0.17, 0.2, 0.18, 0.19, 0.17, 0.2, 0.18, 0.19, 0.18],
        zero_signal=0.87,
        policy_kl=1e-5,
        evals=[
            {"step": 0, "eval_accuracy": 0.335, "eval_sampled_pass@1": 0.20}
            | {"eval_sampled_pass@8": 0.365, "eval_headroom": 0.03},
            {"step": 9, "eval_accuracy": 0.33, "eval_sampled_pass@1": 0.12}
            | {"eval_sampled_pass@8": 0.36, "eval_headroom": 0.03},
        ],
    )
    [note] = explain_run(rows)
    assert note.startswith("flat reward (0.18 -> 0.18 over 9 steps): ")
    assert "87% of groups had no signal" in note
    assert "pass@8 - pass@1 = 3 points at step 0: little for RL to sharpen" in note
    assert "raise optim.lr" in note
    assert "greedy pass@1 33% vs 12% sampled" in note


def test_held_out_drop_is_noted_even_with_a_rising_reward():
    rising = [0.3, 0.31, 0.3, 0.4, 0.41, 0.4, 0.5, 0.52, 0.5]
    evals = [{"step": 0, "eval_accuracy": 0.51}, {"step": 9, "eval_accuracy": 0.41}]
    [note] = explain_run(_rows(rising, 0.45, 0.05, evals, collateral=0.8))
    assert note.startswith("rising reward (0.30 -> 0.51 over 9 steps), held-out pass@1 fell")
    assert "lower optim.lr" in note
    assert "80% of that change fell on prompts whose groups had no signal" in note
    kept = [{"step": 0, "eval_accuracy": 0.51}, {"step": 9, "eval_accuracy": 0.60}]
    assert explain_run(_rows(rising, 0.45, 0.05, kept)) == []
    assert explain_run(_rows([0.98] * 9, 0.95, 1e-3, kept)) == []  # solved, not stuck
    assert explain_run(_rows([0.2] * 3, 0.9, 1e-3, kept)) == []  # too few steps to tell


def test_a_run_logs_the_diagnostics(tmp_path):
    """Two GRPO steps of the micro model: every step has the update's size and clip fractions,
    every evaluation the sampled pass@k and headroom, and the console line shows them."""
    result = cli(
        "train",
        "configs/quickstart.toml",
        *TINY_RUN,
        "sft.steps=0",
        "run.max_steps=2",
        "eval.every=0",
        "eval.headroom_tasks=8",
        "task.num_eval=24",  # enough held-out answers for their spread (answers.MIN_SAMPLES)
        "algorithm.entropy_coef=0.01",  # a gradient even where every sample scores alike
        "checkpoint.every=0",
        f"run.output_dir={tmp_path}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "quickstart" / "metrics.jsonl").open()]
    steps = [r for r in rows if "reward_mean" in r]
    evals = [r for r in rows if "eval_accuracy" in r]
    assert len(steps) == 2 and len(evals) == 2
    for r in steps:
        assert r["policy_kl"] > 0.0  # the update moved the policy
        assert 0.0 <= r["policy_ratio_low_frac"] <= 1.0
        assert r["clip_low_frac"] == r["clip_high_frac"] == 0.0  # on policy: ratio 1
    for r in evals:
        assert 0.0 <= r["eval_sampled_pass@1"] <= r["eval_sampled_pass@4"] <= 1.0
        assert 1 / 24 <= r["eval_top_answer_share"] <= 1.0
        assert 0.0 <= r["eval_top_answer_accuracy"] <= 1.0
        assert r["eval_distinct_answers"] * 24 == pytest.approx(
            round(r["eval_distinct_answers"] * 24)
        )
    assert "sampled pass@1" in result.stdout and "dKL" in result.stdout


def test_task_consistency_tells_guessing_from_known_answers():
    # each task always or never: 1; every task at the same rate: 0 (hand-computed)
    assert task_consistency([(8, 8), (8, 0), (8, 8), (8, 0)]) == pytest.approx(1.0)
    assert task_consistency([(4, 2), (4, 2)]) == pytest.approx(0.0)  # within 1/3 > 1/4: clipped
    # (4, 4), (4, 0), (4, 2): p = 1/2, within = (0 + 0 + 2*2/3) / 12 = 1/9 -> 1 - (1/9)/(1/4)
    assert task_consistency([(4, 4), (4, 0), (4, 2)]) == pytest.approx(1 - 4 / 9)
    assert task_consistency([(4, 0), (4, 0)]) is None  # no pass anywhere: undefined
    assert task_consistency([(1, 1), (1, 0)]) is None  # one sample per task says nothing
    # lucky guesses: 200 tasks, each sample right with chance 0.05 whatever the task
    rng = random.Random(0)
    guesses = [(8, sum(rng.random() < 0.05 for _ in range(8))) for _ in range(200)]
    assert task_consistency(guesses) < 0.05
    got = headroom_metrics([[0.0]] * 200, [[float(i < c) for i in range(8)] for _, c in guesses], 8)
    assert got["eval_task_consistency"] == pytest.approx(task_consistency(guesses))


def test_guessing_headroom_and_sharpening_are_noted():
    flat = [0.05, 0.04, 0.05, 0.05, 0.04, 0.05, 0.05, 0.04, 0.05]
    guessing = {"eval_sampled_pass@1": 0.05, "eval_sampled_pass@8": 0.30, "eval_headroom": 0.25}
    evals = [
        {"step": 0, "eval_accuracy": 0.05, "eval_task_consistency": 0.03} | guessing,
        {"step": 9, "eval_accuracy": 0.05} | guessing,
    ]
    [note] = explain_run(_rows(flat, 0.7, 1e-3, evals))
    assert "pass@8 - pass@1 = 25 points at step 0" in note
    assert "consistency 0.03; 0 is chance" in note and "lucky guesses among 8 tries" in note
    evals[0]["eval_task_consistency"] = 0.6  # known answers ranked low: no such phrase
    assert "lucky guesses" not in explain_run(_rows(flat, 0.7, 1e-3, evals))[0]

    rising = [0.42, 0.44, 0.43, 0.5, 0.52, 0.5, 0.56, 0.57, 0.56]
    sharp = [
        {
            "step": 0,
            "eval_accuracy": 0.58,
            "eval_sampled_pass@1": 0.42,
            "eval_sampled_pass@8": 0.89,
        },
        {
            "step": 9,
            "eval_accuracy": 0.58,
            "eval_sampled_pass@1": 0.58,
            "eval_sampled_pass@8": 0.58,
        },
    ]
    [note] = explain_run(_rows(rising, 0.7, 1e-3, sharp))
    assert note.startswith("rising reward (0.43 -> 0.56 over 9 steps): RL sharpened the samples")
    assert "pass@8 89% -> 58%, greedy pass@1 58% -> 58%" in note
    sharp[1]["eval_accuracy"] = 0.66  # greedy rose: learning, no note
    assert explain_run(_rows(rising, 0.7, 1e-3, sharp)) == []


def _answers(texts_and_passes):
    return [
        {"completion": f" {t}\n", "reward": float(p), "rewards": {}} for t, p in texts_and_passes
    ]


def test_answer_spread_of_hand_made_answers():
    """27 of 30 answers are "1" (15 of them right), three others: share 0.9, its accuracy 15/27,
    4 distinct texts of 30; an env verdict counts over the summed reward; under 20 samples: {}."""
    rows = _answers([("1", i < 15) for i in range(27)] + [("2", 1), ("3", 0), ("4 5", 1)])
    spread = answer_spread(rows)
    assert spread == {
        "eval_top_answer_share": 0.9,
        "eval_top_answer_accuracy": 15 / 27,
        "eval_distinct_answers": 4 / 30,
    }
    rows[0] |= {"reward": 1.2, "rewards": {"env": 0.0, "format": 1.2}}  # a wrong answer, formatted
    assert answer_spread(rows)["eval_top_answer_accuracy"] == 14 / 27
    assert answer_spread(rows[:19]) == {}


def test_question_blind_answers_are_noted():
    """A flat reward whose last evaluation gave one answer to 90% of the questions, right on 55%
    of them: the note says the answers ignore the question; a spread of answers, or one answer
    that is nearly always right (a yes/no task's), says nothing of it."""
    flat = [0.5, 0.52, 0.5, 0.51, 0.5, 0.52, 0.5, 0.51, 0.5]
    blind = [
        {"step": 0, "eval_accuracy": 0.54, "eval_top_answer_share": 0.6}
        | {"eval_top_answer_accuracy": 0.7},
        {"step": 9, "eval_accuracy": 0.54, "eval_top_answer_share": 0.9}
        | {"eval_top_answer_accuracy": 0.55},
    ]
    [note] = explain_run(_rows(flat, 0.8, 1e-3, blind))
    assert "answers barely depend on the question: 90% of them are one and the same answer" in note
    assert "(60% at step 0), right on 55%" in note
    alone = question_blind(blind[:1])  # one evaluation: no earlier share to compare with
    assert alone is not None and "60% of them" in alone and "at step" not in alone
    spread = [dict(e, eval_top_answer_share=0.3) for e in blind]
    assert question_blind(spread) is None
    known = [dict(e, eval_top_answer_accuracy=0.95) for e in blind]
    assert question_blind(known) is None


def test_reinforge_eval_says_when_one_answer_is_given_to_most_tasks():
    from reinforge.eval.run import blind_answers_line

    rows = _answers([("1", i < 11) for i in range(20)] + [("2", 1)] * 4)
    line = blind_answers_line(answer_spread(rows))
    assert line is not None and "83% of the answers are one and the same text, right on 55%" in line
    assert blind_answers_line(answer_spread(_answers([(str(i), 1) for i in range(24)]))) is None
    assert blind_answers_line({}) is None


def test_a_reward_of_partial_credit_is_noted():
    """caesar_cipher in the learning suite (session 13): every reply kept the cipher's period,
    the library's scorer gave 0.99 for the answer inside it, 1% of samples passed. A near-ceiling
    flat reward is otherwise 'solved'; here the note says the reward is not the pass."""
    evals = [{"step": 0, "eval_accuracy": 0.01}, {"step": 9, "eval_accuracy": 0.015}]
    rows = _rows([0.99] * 9, zero_signal=0.92, policy_kl=1e-3, evals=evals)
    for r in rows:
        if "reward_mean" in r:
            r["accuracy"] = 0.01
    [note] = explain_run(rows)
    assert note.startswith("flat reward (0.99 -> 0.99 over 9 steps): the reward is mostly")
    assert "mean 0.99 while 1% of samples pass" in note
    assert "task.partial_credit = false" in note
    for r in rows:  # the same reward, every sample passing: solved, nothing to say
        if "reward_mean" in r:
            r["accuracy"] = 0.99
    assert explain_run(rows) == []


def test_repeated_training_questions_are_measured_and_noted():
    """n_queens on a 5 x 5 board in the learning suite: few questions, trained again and again,
    training reward up while held-out pass@1 fell. The step metric counts a question seen at an
    earlier step (by its prompt messages, not its task id); the note names the fix."""
    from types import SimpleNamespace

    from reinforge.types import Message

    def groups(*questions):
        return [
            SimpleNamespace(task=SimpleNamespace(messages=(Message("user", q),))) for q in questions
        ]

    seen: set[int] = set()
    assert question_repeats(groups("a", "b", "c", "d"), seen) == {
        "train_repeat_share": 0.0,
        "train_distinct_questions": 4.0,
    }
    second = question_repeats(groups("a", "b", "e", "a"), seen)
    assert second == {"train_repeat_share": 0.75, "train_distinct_questions": 5.0}

    evals = [{"step": 0, "eval_accuracy": 0.62}, {"step": 30, "eval_accuracy": 0.555}]
    rows = _rows([0.40, 0.45, 0.55, 0.62, 0.70, 0.75, 0.80, 0.82], 0.6, 5e-3, evals)
    for i, r in enumerate(r for r in rows if "reward_mean" in r):
        r["train_repeat_share"] = min(0.2 * i, 0.95)
        r["train_distinct_questions"] = 40.0 + i
    [note] = explain_run(rows)
    assert "held-out pass@1 fell 62.0% -> 55.5%" in note
    assert "of the later steps' prompts repeat a question trained on before (47 distinct" in note
    assert "task.dataset_config" in note and "task.num_eval" in note
    for r in rows:  # fresh questions every step: nothing said about them
        r.pop("train_repeat_share", None)
        r.pop("train_distinct_questions", None)
    assert "repeat a question" not in explain_run(rows)[0]
