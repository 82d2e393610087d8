"""Whether the held-out answers depend on the question. A small model can score well above zero
by giving most questions the same answer (the dataset's commonest: reasoning-gym's
letter_counting is "1" for 55% of its questions, and the tiny model's 54% greedy accuracy was
that answer given to nearly every question); RL then sharpens the samples onto it and the
greedy accuracy cannot rise. The evaluation logs how concentrated its answers are, and the
summary's note says so.

At each evaluation, over its samples (the completion's text, whitespace collapsed):
- `eval_top_answer_share`: the share of samples whose text is the commonest text;
- `eval_top_answer_accuracy`: the share of those that pass (verdict >= 1);
- `eval_distinct_answers`: distinct texts / samples.
Long free-form completions are nearly all distinct (share ~0), so the note stays silent there.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

MIN_SAMPLES = 20  # fewer samples than this: no share worth a note
TOP_SHARE = 0.5  # one answer to at least half of the questions ...
TOP_ACCURACY = 0.8  # ... and wrong on more than a fifth of them: it ignores the question


def answer_text(completion: str) -> str:
    return " ".join(completion.split())


def answer_spread(samples: Sequence[dict]) -> dict[str, float]:
    """The three `eval_*answer*` metrics of an evaluation's sample rows (`EvalResult.samples`:
    "completion", and "rewards"["env"] or "reward"); {} below MIN_SAMPLES."""
    rows = [r for r in samples if isinstance(r.get("completion"), str)]
    if len(rows) < MIN_SAMPLES:
        return {}
    texts = [answer_text(r["completion"]) for r in rows]
    top, count = Counter(texts).most_common(1)[0]
    passed = [
        r.get("rewards", {}).get("env", r["reward"]) >= 1.0
        for r, text in zip(rows, texts)
        if text == top
    ]
    return {
        "eval_top_answer_share": count / len(texts),
        "eval_top_answer_accuracy": sum(passed) / len(passed),
        "eval_distinct_answers": len(set(texts)) / len(texts),
    }


def question_blind(evals: Sequence[dict]) -> str | None:
    """The note's phrase when the last evaluation gave one answer to most questions and that
    answer is often wrong (metrics.jsonl's evaluation rows, oldest first); None otherwise."""
    scored = [r for r in evals if "eval_top_answer_share" in r]
    if not scored:
        return None
    last = scored[-1]
    share, right = last["eval_top_answer_share"], last["eval_top_answer_accuracy"]
    if share < TOP_SHARE or right >= TOP_ACCURACY:
        return None
    first = scored[0]
    since = (
        "" if first is last else f" ({first['eval_top_answer_share']:.0%} at step {first['step']})"
    )
    return (
        f"the held-out answers barely depend on the question: {share:.0%} of them are one and the "
        f"same answer{since}, right on {right:.0%} of the questions it was given to, so the "
        "accuracy is that answer's share of the data, not a skill; RL sharpens the samples onto "
        "it. Check that the task is within the model's reach (a larger model, more SFT on the "
        "skill, easier settings)"
    )
