"""Why a run learns, or does not: how far each update moves the policy, how much of the loss the
clip cuts, the held-out headroom RL can take (pass@k above pass@1), and the summary's note when
the reward has no trend.

Per RL step (metrics.jsonl, the console):
- `policy_kl`: KL(before || after) of the step's update, per token (k3, on the tokens the step
  sampled), measured by one no-grad forward after the optimizer step over at most
  `POLICY_PROBE_SEQS` sequences of the step's first micro-batch (a forward over 32 of G1's 256
  sequences: about 1/30 of the update's compute). "Before" is the sampler's logprobs: on one device with one
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

Per RL step, the question space (`question_repeats`): `train_repeat_share`, the share of the
step's prompts whose question an earlier step of the run already trained on (every rank's
groups; the keys kept in checkpoints), and
`train_distinct_questions`, the distinct questions so far. A procedural dataset with few
questions (5 x 5 queens with 1-3 given: 250, of which the held-out split takes 200) repeats them
from the first steps, and RL memorises them: training reward 0.40 -> 0.82 while held-out pass@1
fell 62 -> 55.5 (learning suite, session 14).

At the end: the summary's note (train/loop/run_notes.py) reads these.
"""

from __future__ import annotations

import hashlib
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from reinforge.algorithms.counts import at_least_one
from reinforge.algorithms.losses import MAX_LOG_RATIO, LossInputs, PolicyLossSettings
from reinforge.distributed import gather_objects
from reinforge.eval import EvalResult, evaluate
from reinforge.eval.metrics import pass_at_k
from reinforge.train.loop.advantage_step import select_rows
from reinforge.train.packing import PackedBatch, pack_one
from reinforge.train.packing.forward import completion_sequences, packed_rows

# sequences re-scored after each update to measure its size (G1: 32 x 512 tokens; 64 cost ~0.1 s
# of a 3 s step on an H100, the largest piece of the update outside its micro-batches)
POLICY_PROBE_SEQS = 32
SAMPLED = "eval_sampled_pass@"


# ------------------------------------------------------------------------ per-step, pure


MAX_QUESTIONS_SEEN = 1 << 20  # 8 MB of keys in a checkpoint; past it, new questions are not kept


def question_key(messages) -> int:
    """A question's key, the same in every process (Python's own str hash is salted per process,
    and the keys of the questions seen travel in checkpoints): 8 bytes of BLAKE2b, signed."""
    digest = hashlib.blake2b(repr(messages).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def question_repeats(groups: Sequence, seen: set[int]) -> dict[str, float]:
    """`train_repeat_share` and `train_distinct_questions` of a step's groups (one question
    each: its prompt messages), adding them to `seen`, the questions of the earlier steps. In a
    distributed run every rank counts every rank's groups, so all hold the same `seen`."""
    mine = [question_key(g.task.messages) for g in groups]
    keys = [k for part in gather_objects(mine) for k in part]
    repeats = sum(k in seen for k in keys)
    if len(seen) < MAX_QUESTIONS_SEEN:
        seen.update(keys)
    return {
        "train_repeat_share": repeats / max(len(keys), 1),
        "train_distinct_questions": float(len(seen)),
    }


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
        total = at_least_one(x.num_tokens_total)
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
    values = {
        "policy_kl": kl_BT,
        "policy_kl_no_signal": kl_BT * (adv_BT == 0),
        "policy_ratio_low_frac": (ratio_BT < 1.0 - clip_low).float(),
        "policy_ratio_high_frac": (ratio_BT > 1.0 + clip_high).float(),
        "policy_shift_signed": torch.sign(adv_BT) * log_ratio_BT,
    }
    sums = torch.stack([(v * mask_BT).sum() for v in values.values()])
    means = (sums / mask_BT.sum().clamp(min=1.0)).tolist()  # one read-back for all five
    return dict(zip(values, means, strict=True))


# ------------------------------------------------------------------------ per-step, device


@dataclass
class PolicyProbe:
    """The probe's sequences (`probe_sequences`): indices into the step and their packed row,
    already on its way to the device."""

    idx: list[int]
    packed: PackedBatch


def probe_sequences(cfg, batch, micro_batches: list[list[int]], device) -> PolicyProbe:
    """At most POLICY_PROBE_SEQS sequences of the first micro-batch, packed as the update saw
    them (with the sampler's experts under routing replay) and sent without waiting: the update
    packs them while the device still runs its last micro-batches (G1: ~7 ms of host work that
    otherwise left the GPU idle after the optimizer step, s25c)."""
    idx = micro_batches[0][:POLICY_PROBE_SEQS]
    seqs = completion_sequences(
        [batch.prompts[i] for i in idx],
        [batch.completions[i] for i in idx],
        [batch.routes[i] for i in idx] if cfg.algorithm.routing_replay else None,
    )
    packed = pack_one(seqs, range(len(seqs)), cfg.train.share_prompts)
    return PolicyProbe(idx, packed.to(device))


@torch.no_grad()
def measure_policy_change(cfg, learner, batch, probe: PolicyProbe) -> dict[str, float]:
    """`policy_change` of the update just taken, on the probe's sequences (one forward on every
    rank, so FSDP's collectives stay in step)."""
    rows = packed_rows(learner.policy.model, probe.packed, cfg.rollout.temperature or 1.0)
    idx = probe.idx
    width, device = rows.logprobs_ST.shape[1], rows.logprobs_ST.device
    advantages = batch.advantages
    assert advantages is not None, "advantages are assigned before the update"
    adv = select_rows(advantages, idx, None if advantages.dim() == 1 else width)
    s = learner.algorithm.settings
    return policy_change(
        rows.logprobs_ST,
        select_rows(batch.sampler_BT, idx, width).to(device),
        adv.to(device),
        select_rows(batch.mask_BT, idx, width).to(device),
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
