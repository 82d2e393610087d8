"""Why a run learns, or does not: how far each update moves the policy, how much of the loss the
clip cuts, the held-out headroom RL can take (pass@k above pass@1), and the summary's note when
the reward has no trend.

Per RL step (metrics.jsonl, the console):
- `policy_kl`: KL(before || after) of the step's update, per token (k3, on the tokens the step
  sampled), measured by one no-grad forward after the optimizer step over at most
  `POLICY_PROBE_SEQS` sequences of the step's first micro-batch (about 1/12 of the update's
  compute at 64 of 256 sequences). "Before" is the sampler's logprobs: on one device with one
  update per step that is the policy before the update (`kl_sampler` is their difference; in a
  disaggregated run they are up to `distributed.rollout_staleness` steps older, so the figure
  holds that many more steps' change).
  `policy_ratio_low_frac` / `policy_ratio_high_frac`: tokens whose probability moved below
  1 - clip_low / above 1 + clip_high times its old value in that one step (a second epoch on the
  batch would clip them; with one update per step the clip never acts, so nothing but the
  learning rate bounds this). `policy_kl_no_signal`: the part of `policy_kl` on tokens whose
  advantage is 0, the drift of what the step had nothing to teach. `policy_shift_signed`: mean over tokens of sign(advantage) x log(new /
  old), positive when the update raised what scored above its group and lowered the rest.
- `clip_low_frac` / `clip_high_frac`: tokens whose PPO clip cut the loss's gradient in this step
  (advantage < 0 and ratio below 1 - clip_low; advantage > 0 and ratio above 1 + clip_high; they
  add up to the loss's `clip_frac`). On policy with one update per step the ratio is 1 and both
  are 0; they count when old logprobs are the sampler's or a step old.

At each evaluation (`headroom_eval`): the first `eval.headroom_tasks` held-out tasks get k =
rollout.samples_per_prompt samples at the rollout's temperature, the distribution RL learns
from: `eval_sampled_pass@1`, `eval_sampled_pass@k`, and `eval_headroom` = sampled pass@k minus
the evaluation's own pass@1 (greedy by default) on the same tasks.

At the end (`learning_notes`): a note when the training reward is flat or falling, or held-out
accuracy fell, with what the logged diagnostics say about it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path

import torch

from reinforge.algorithms.losses import MAX_LOG_RATIO, LossInputs, PolicyLossSettings
from reinforge.eval import EvalResult, evaluate
from reinforge.eval.answers import question_blind
from reinforge.eval.metrics import pass_at_k
from reinforge.metrics import read_metrics
from reinforge.train.packing.forward import completion_rows

POLICY_PROBE_SEQS = 64  # sequences re-scored after each update to measure its size
SAMPLED = "eval_sampled_pass@"

# Heuristic thresholds of the notes (per token, per update): PPO practice keeps an update's KL
# near 0.01 (a "target KL" of 0.01-0.02 is the common early-stopping rule).
KL_TOO_SMALL = 1e-4
KL_TOO_LARGE = 0.02
FEW_SIGNAL_GROUPS = 0.5  # zero-signal share above which most of the batch teaches nothing
SMALL_HEADROOM = 0.10  # pass@k - pass@1 below this leaves little to sharpen
CHANCE_CONSISTENCY = 0.15  # passes this independent of the task are guesses, not known answers
SHARPENED = 0.05  # sampled pass@1 up, pass@k down by at least this, greedy within MIN_CHANGE
TEMPERATURE_GAP = 0.15  # greedy pass@1 above sampled pass@1 by this much
PARTIAL_GAP = 0.25  # mean reward above the share of passing samples by this: partial credit


# ------------------------------------------------------------------------ per-step, pure


def clip_fractions(x: LossInputs, s: PolicyLossSettings) -> dict[str, torch.Tensor]:
    """The loss's clipped tokens, low and high apart, as shares of the step's tokens (summed
    over micro-batches like the loss's metrics)."""
    with torch.no_grad():
        log_ratio_BT = (x.logprobs_BT.detach() - x.old_logprobs_BT).clamp(max=MAX_LOG_RATIO)
        ratio_BT = log_ratio_BT.exp()
        adv = x.advantages_B
        adv_BT = adv[:, None].expand_as(x.mask_BT) if adv.dim() == 1 else adv
        low_BT = (adv_BT < 0) & (ratio_BT < 1.0 - s.clip_low)
        high_BT = (adv_BT > 0) & (ratio_BT > 1.0 + s.clip_high)
        total = max(x.num_tokens_total, 1.0)
        return {
            "clip_low_frac": (low_BT * x.mask_BT).sum() / total,
            "clip_high_frac": (high_BT * x.mask_BT).sum() / total,
        }


def policy_change(
    new_logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages: torch.Tensor,
    mask_BT: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> dict[str, float]:
    """How far one update moved the policy on tokens drawn from the old one: k3 KL(old || new)
    per token, the shares of tokens whose ratio new/old left [1 - clip_low, 1 + clip_high], and
    the advantage-signed mean log-ratio. Means over the mask's tokens; `policy_kl_no_signal` is
    the part of `policy_kl` from tokens whose advantage is 0 (groups that scored alike: the step
    had nothing to teach there, so their change is collateral)."""
    log_ratio_BT = (new_logprobs_BT - old_logprobs_BT).clamp(max=MAX_LOG_RATIO)
    ratio_BT = log_ratio_BT.exp()
    # k3: unbiased under the old policy and never negative (the clamp: float rounding near r = 1)
    kl_BT = (ratio_BT - 1.0 - log_ratio_BT).clamp(min=0.0)
    adv_BT = advantages[:, None].expand_as(mask_BT) if advantages.dim() == 1 else advantages
    num_tokens = max(float(mask_BT.sum()), 1.0)

    def mean(values_BT: torch.Tensor) -> float:
        return float((values_BT * mask_BT).sum()) / num_tokens

    return {
        "policy_kl": mean(kl_BT),
        "policy_kl_no_signal": mean(kl_BT * (adv_BT == 0)),
        "policy_ratio_low_frac": mean((ratio_BT < 1.0 - clip_low).float()),
        "policy_ratio_high_frac": mean((ratio_BT > 1.0 + clip_high).float()),
        "policy_shift_signed": mean(torch.sign(adv_BT) * log_ratio_BT),
    }


# ------------------------------------------------------------------------ per-step, device


@torch.no_grad()
def measure_policy_change(cfg, learner, batch, micro_batches: list[list[int]]) -> dict[str, float]:
    """`policy_change` of the update just taken, on at most POLICY_PROBE_SEQS sequences of the
    first micro-batch (one forward on every rank, so FSDP's collectives stay in step)."""
    idx = micro_batches[0][:POLICY_PROBE_SEQS]
    rows = completion_rows(
        learner.policy.model,
        [batch.prompts[i] for i in idx],
        [batch.completions[i] for i in idx],
        cfg.rollout.temperature or 1.0,
        share_prompts=cfg.train.share_prompts,
        # as the update saw them: with the sampler's experts under routing replay
        routes=[batch.routes[i] for i in idx] if cfg.algorithm.routing_replay else None,
    )
    width, device = rows.logprobs_ST.shape[1], rows.logprobs_ST.device
    advantages = batch.advantages
    assert advantages is not None, "advantages are assigned before the update"
    adv = advantages[idx] if advantages.dim() == 1 else advantages[idx, :width]
    s = learner.algorithm.settings
    return policy_change(
        rows.logprobs_ST,
        batch.sampler_BT[idx, :width].to(device),
        adv.to(device),
        batch.mask_BT[idx, :width].to(device),
        s.clip_low,
        s.clip_high,
    )


# ------------------------------------------------------------------------ evaluation headroom


def headroom_metrics(
    eval_rewards: Sequence[Sequence[float]], sampled_rewards: Sequence[Sequence[float]], k: int
) -> dict[str, float]:
    """Per task (the same tasks, in the same order): the evaluation's rewards and k sampled
    rewards -> sampled pass@1, sampled pass@k and headroom (sampled pass@k - the evaluation's
    pass@1). A sample passes at reward >= 1."""
    assert len(eval_rewards) == len(sampled_rewards) > 0, "one entry per task, in both"
    eval_pass1 = statistics.fmean(
        pass_at_k(len(r), sum(x >= 1.0 for x in r), 1) for r in eval_rewards
    )
    passes = [(len(r), sum(x >= 1.0 for x in r)) for r in sampled_rewards]
    pass1 = statistics.fmean(pass_at_k(n, c, 1) for n, c in passes)
    passk = statistics.fmean(pass_at_k(n, c, k) for n, c in passes)
    consistency = task_consistency(passes)
    return {
        SAMPLED + "1": pass1,
        f"{SAMPLED}{k}": passk,
        "eval_headroom": passk - eval_pass1,
    } | ({} if consistency is None else {"eval_task_consistency": consistency})


def task_consistency(passes: Sequence[tuple[int, int]]) -> float | None:
    """The intra-task correlation of passes, (samples, passes) per task: the ANOVA estimator of
    a beta-binomial's rho, 1 - within-task variance / total variance of the pass indicator,
    clipped to [0, 1]. 0: passing does not depend on the task (every task at the same rate, as
    chance gives); 1: each task passes always or never. None where it is undefined (fewer than
    two tasks of two or more samples, or every sample alike)."""
    passes = [(n, c) for n, c in passes if n >= 2]
    total = sum(n for n, _ in passes)
    if len(passes) < 2:
        return None
    p = sum(c for _, c in passes) / total
    if p in (0.0, 1.0):
        return None
    # unbiased within-task variance of the pass indicator (n p_i (1 - p_i) / (n - 1) per task)
    within = sum(c * (n - c) / (n - 1) for n, c in passes) / total
    return min(max(1.0 - within / (p * (1.0 - p)), 0.0), 1.0)


def headroom_eval(cfg, policy, tasks, max_new_tokens: int, result: EvalResult) -> dict[str, float]:
    """k = rollout.samples_per_prompt samples of each of the first eval.headroom_tasks held-out
    tasks at the rollout's sampling settings; {} when off, k < 2, nothing was scored, or the
    command samples nothing to sharpen (`reinforge sft` has no [rollout])."""
    rollout = getattr(cfg, "rollout", None)
    if rollout is None:
        return {}
    k, num_tasks = rollout.samples_per_prompt, cfg.eval.headroom_tasks
    chosen = held_out_tasks(cfg, tasks)[:num_tasks]
    if k < 2 or not num_tasks or not chosen:
        return {}
    sampled = evaluate(
        policy.engine,
        policy.tokenizer,
        tasks,
        chosen,
        max_new_tokens,
        seed=cfg.run.seed + 1,
        samples_per_task=k,
        temperature=rollout.temperature,
        top_p=rollout.top_p,
    )
    return headroom_metrics(
        rewards_by_task(result.samples, chosen), rewards_by_task(sampled.samples, chosen), k
    )


def held_out_tasks(cfg, tasks) -> list:
    all_eval = tasks.eval_tasks()
    return all_eval[: cfg.eval.num_tasks] if cfg.eval.num_tasks else all_eval


def rewards_by_task(rows: list[dict], tasks) -> list[list[float]]:
    by_id: dict[str, list[float]] = {}
    for row in rows:  # the task's verdict ("env") where the reward has components
        verdict = row.get("rewards", {}).get("env", row["reward"])
        by_id.setdefault(row["task_id"], []).append(verdict)
    return [by_id[t.id] for t in tasks]


# ------------------------------------------------------------------------ the summary's note

MIN_TREND_STEPS = 6  # fewer RL steps than this: no trend to speak of
MIN_CHANGE = 0.02  # a reward change below this (absolute) is no trend, whatever the noise
MAX_HELD_OUT_DROP = 0.02  # held-out accuracy falling by more than this is worth a note
CEILING = 0.95  # a reward this high that stays flat is solved, not stuck


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


def headroom_text(headroom: dict[str, float]) -> str:
    """The evaluation line's tail: "; sampled pass@1 0.310, pass@8 0.620 (headroom +0.180)"."""
    if not headroom:
        return ""
    k = sampled_k(headroom)
    return (
        f"; sampled pass@1 {headroom['eval_sampled_pass@1']:.3f}, pass@{k} "
        f"{headroom[SAMPLED + k]:.3f} (headroom {headroom['eval_headroom']:+.3f})"
    )


def sampled_k(metrics: dict) -> str:
    """k of the `eval_sampled_pass@k` key in an evaluation's metrics."""
    return next(
        key.removeprefix(SAMPLED)
        for key in metrics
        if key.startswith(SAMPLED) and key != SAMPLED + "1"
    )
