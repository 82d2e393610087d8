"""The summary's note on a run that did not learn (`learning_notes`, `explain_run`): when the
training reward is flat or falling, held-out accuracy fell, RL only sharpened, or the reward is
mostly partial credit, what the logged diagnostics (train/loop/diagnostics.py) say about it, one
phrase each."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path

from reinforge.eval.answers import question_blind
from reinforge.metrics import read_metrics
from reinforge.train.loop.diagnostics import SAMPLED, sampled_k

# Heuristic thresholds of the notes (per token, per update): PPO practice keeps an update's KL
# near 0.01 (a "target KL" of 0.01-0.02 is the common early-stopping rule). Too small: the
# learning suite's runs that rose 10-35 points moved 7e-5 to 3e-4 per step (session 16, lr 5e-5),
# and doubling the lr (KL ~1e-3) lifted no dataset further: only far below that is lr the cause.
KL_TOO_SMALL = 2e-5
KL_TOO_LARGE = 0.02
SMALL_HEADROOM = 0.10  # pass@k - pass@1 below this leaves little to sharpen
CHANCE_CONSISTENCY = 0.15  # passes this independent of the task are guesses, not known answers
SHARPENED = 0.05  # sampled pass@1 up, pass@k down by at least this, greedy within MIN_CHANGE
TEMPERATURE_GAP = 0.15  # greedy pass@1 above sampled pass@1 by this much
PARTIAL_GAP = 0.25  # mean reward above the share of passing samples by this: partial credit

MIN_TREND_STEPS = 6  # fewer RL steps than this: no trend to speak of
MIN_CHANGE = 0.02  # a reward change below this (absolute) is no trend, whatever the noise
MAX_HELD_OUT_DROP = 0.02  # held-out accuracy falling by more than this is worth a note
CEILING = 0.95  # a reward this high that stays flat is solved, not stuck
MANY_REPEATS = 0.5  # over the later half of the steps, this share of prompts seen before


def reward_trend(rewards: Sequence[float]) -> tuple[str, float, float]:
    """("rising" | "flat" | "falling", first, last): the means of the first and the last third of
    the steps; a change counts when it exceeds MIN_CHANGE and twice its standard error."""
    assert rewards, "a trend needs at least one step"
    m = max(len(rewards) // 3, 1)
    first, last = list(rewards[:m]), list(rewards[-m:])
    change = statistics.fmean(last) - statistics.fmean(first)
    se = math.sqrt((statistics.pvariance(first) + statistics.pvariance(last)) / m)
    if abs(change) <= max(MIN_CHANGE, 2.0 * se):
        verdict = "flat"
    else:
        verdict = "rising" if change > 0 else "falling"
    return verdict, statistics.fmean(first), statistics.fmean(last)


def explain_run(rows: Sequence[dict]) -> list[str]:
    """The summary's note on a run whose training reward is flat or falling, or whose held-out
    accuracy fell, with the diagnostics' reading of it (none when it learned or ran too few
    steps). `rows`: metrics.jsonl's records."""
    steps = [r for r in rows if r.get("phase", "rl") == "rl" and "reward_mean" in r]
    evals = sorted(
        (r for r in rows if r.get("phase", "rl") == "rl" and "eval_accuracy" in r),
        key=lambda r: r["step"],
    )
    if len(steps) < MIN_TREND_STEPS:
        return []
    verdict, first, last = reward_trend([r["reward_mean"] for r in steps])
    drop = evals[0]["eval_accuracy"] - evals[-1]["eval_accuracy"] if len(evals) > 1 else 0.0
    is_stuck = verdict == "falling" or (verdict == "flat" and last < CEILING)
    sharpened = sharpening(evals)
    partial = partial_credit(steps)
    if partial and not is_stuck and drop <= MAX_HELD_OUT_DROP:
        return [f"{verdict} reward ({first:.2f} -> {last:.2f} over {len(steps)} steps): {partial}"]
    if not is_stuck and drop <= MAX_HELD_OUT_DROP and not sharpened:
        return []
    head = f"{verdict} reward ({first:.2f} -> {last:.2f} over {len(steps)} steps)"
    blind = question_blind(evals)
    if sharpened and not is_stuck and drop <= MAX_HELD_OUT_DROP:
        return [f"{head}: {sharpened}" + (f"; {blind}" if blind else "")]
    if drop > MAX_HELD_OUT_DROP:
        before, after = evals[0]["eval_accuracy"], evals[-1]["eval_accuracy"]
        head += f", held-out pass@1 fell {before:.1%} -> {after:.1%}"
    return [f"{head}: " + "; ".join([*([blind] if blind else []), *diagnosis(steps, evals)])]


def diagnosis(steps: Sequence[dict], evals: Sequence[dict]) -> list[str]:
    """What the step and evaluation diagnostics say, one phrase each."""
    said = []
    zero = _mean(steps, "zero_signal_groups")
    if zero is not None:
        said.append(f"{zero:.0%} of groups had no signal (every sample scored alike)")
    first = next((r for r in evals if "eval_headroom" in r), None)
    if first is not None:
        k = sampled_k(first)
        points = 100 * first["eval_headroom"]
        little = ": little for RL to sharpen" if first["eval_headroom"] < SMALL_HEADROOM else ""
        said.append(f"pass@{k} - pass@1 = {points:.0f} points at step {first['step']}{little}")
        chance = first.get("eval_task_consistency")
        if not little and chance is not None and chance < CHANCE_CONSISTENCY:
            said.append(
                f"but passes barely depend on the task (consistency {chance:.2f}; 0 is chance): "
                f"the headroom is lucky guesses among {k} tries, not answers RL can sharpen"
            )
    partial = partial_credit(steps)
    said += [partial] if partial else []
    repeats = few_questions(steps)
    said += [repeats] if repeats else []
    said += _update_size(steps)
    last = next((r for r in reversed(evals) if "eval_sampled_pass@1" in r), None)
    if last is not None and last["eval_accuracy"] - last["eval_sampled_pass@1"] > TEMPERATURE_GAP:
        said.append(
            f"greedy pass@1 {last['eval_accuracy']:.0%} vs {last['eval_sampled_pass@1']:.0%} "
            "sampled at the rollout temperature: RL trains the sampled policy, and its gains "
            "need not reach the greedy answer"
        )
    shift = _mean(steps, "policy_shift_signed")
    if shift is not None and shift <= 0:
        said.append(
            f"the updates did not favour what scored above its group (policy_shift_signed "
            f"{shift:.1e})"
        )
    return said or ["no diagnostics were logged"]


def partial_credit(steps: Sequence[dict]) -> str | None:
    """The note for a reward that is mostly partial credit (a scorer's 0 < score < 1): RL climbs
    a score that the pass rate (reward >= 1) does not count, e.g. reasoning-gym's 0.99 for the
    answer inside a reply one character longer."""
    reward, passed = _mean(steps, "reward_mean"), _mean(steps, "accuracy")
    if reward is None or passed is None or reward - passed < PARTIAL_GAP:
        return None
    return (
        f"the reward is mostly partial credit: mean {reward:.2f} while {passed:.0%} of samples "
        "pass (reward >= 1), so RL climbs a score the pass rate does not count (a stricter "
        "reward, e.g. task.partial_credit = false for reasoning-gym, trains for the pass)"
    )


def few_questions(steps: Sequence[dict]) -> str | None:
    """The note for training questions that keep coming back (`train_repeat_share`): RL can
    learn them by heart, which the held-out questions do not reward."""
    later = steps[len(steps) // 2 :]
    share = _mean(later, "train_repeat_share")
    if share is None or share < MANY_REPEATS:
        return None
    distinct = int(steps[-1].get("train_distinct_questions") or 0)
    return (
        f"{share:.0%} of the later steps' prompts repeat a question trained on before "
        f"({distinct} distinct in {len(steps)} steps): the dataset's question space is small, "
        "and RL can memorise it while the held-out questions gain nothing; widen the task's "
        "settings (task.dataset_config), or lower task.num_eval, which takes questions out of it"
    )


def sharpening(evals: Sequence[dict]) -> str | None:
    """The note for RL that only concentrated the samples on the greedy answers: sampled pass@1
    rose toward greedy pass@1 while pass@k fell toward it, and greedy pass@1 held still. The
    training reward rises, yet the model answers no held-out task it did not answer before."""
    scored = [r for r in evals if SAMPLED + "1" in r]
    if len(scored) < 2:
        return None
    first, last = scored[0], scored[-1]
    k = sampled_k(first)
    up = last[SAMPLED + "1"] - first[SAMPLED + "1"]
    down = first[SAMPLED + k] - last[SAMPLED + k]
    greedy = last["eval_accuracy"] - first["eval_accuracy"]
    if up < SHARPENED or down < SHARPENED or abs(greedy) > MIN_CHANGE:
        return None
    return (
        f"RL sharpened the samples onto the greedy answers: sampled pass@1 "
        f"{first[SAMPLED + '1']:.0%} -> {last[SAMPLED + '1']:.0%}, pass@{k} "
        f"{first[SAMPLED + k]:.0%} -> {last[SAMPLED + k]:.0%}, greedy pass@1 "
        f"{first['eval_accuracy']:.0%} -> {last['eval_accuracy']:.0%}: the model learnt no "
        "answer its greedy decoding lacked (more steps, or a task nearer its reach, can)"
    )


def _update_size(steps: Sequence[dict]) -> list[str]:
    """The update's size over the steps that updated (a step whose groups all scored alike
    has no gradient and moves nothing: that is the zero-signal share's story)."""
    steps = [r for r in steps if r.get("grad_norm", 1.0) > 0.0]
    kl = _mean(steps, "policy_kl")
    if kl is None:
        return []
    said = _update_size_phrase(steps, kl)
    collateral = _mean(steps, "policy_kl_no_signal")
    if collateral is not None and kl > 0 and collateral / kl > 0.5:
        said.append(
            f"{collateral / kl:.0%} of that change fell on prompts whose groups had no signal "
            "(drift the step had no evidence for)"
        )
    return said


def _update_size_phrase(steps: Sequence[dict], kl: float) -> list[str]:
    if kl < KL_TOO_SMALL:
        return [f"updates barely moved the policy (KL {kl:.1e} per token per step): raise optim.lr"]
    if kl > KL_TOO_LARGE:
        out = (_mean(steps, "policy_ratio_low_frac") or 0.0) + (
            _mean(steps, "policy_ratio_high_frac") or 0.0
        )
        return [
            f"updates moved the policy far (KL {kl:.3f} per token per step, {out:.0%} of tokens "
            "past the clip range in one step): lower optim.lr"
        ]
    return [f"update size KL {kl:.1e} per token per step"]


def _mean(rows: Sequence[dict], key: str) -> float | None:
    values = [r[key] for r in rows if key in r]
    return statistics.fmean(values) if values else None


def learning_notes(run_dir: Path) -> list[str]:
    """`explain_run` over the run's metrics.jsonl (rank 0 writes it; [] where it is absent)."""
    return explain_run(read_metrics(Path(run_dir) / "metrics.jsonl"))
