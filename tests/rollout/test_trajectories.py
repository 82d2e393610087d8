"""Env tasks through the trainer: reference episodes for SFT, multi-turn rollouts whose env tokens
are masked out of the loss and whose sampler logprobs line up with the trainer's, the step's
episode metrics, and held-out evaluation through the same episode code.

Rollouts play tic-tac-toe with the untrained micro model: its unreadable moves are answered
(`max_illegal_moves`) with the board again, so every episode runs several turns with env replies
between them, and no training is needed first.
"""

import json

import pytest
import torch

from reinforge.config import TrainConfig, load_config
from reinforge.engine.base import SamplingParams
from reinforge.engine.simple import SimpleEngine
from reinforge.errors import ConfigError
from reinforge.eval import evaluate, logged_metrics
from reinforge.models.loading import load_model, load_tokenizer
from reinforge.models.tiny import builtin_path
from reinforge.rollout.episodes import render
from reinforge.rollout.trajectories import episode_metrics, play, tool_use_notes
from reinforge.tasks import build_task_source
from reinforge.train.loop.advantage_step import build_step_batch
from reinforge.train.packing.forward import completion_rows
from reinforge.train.planner.lengths import probe_lengths
from reinforge.train.sft.demos import demonstration, demonstration_examples
from reinforge.types import Completion, Group, Task, Trajectory

GAME = [
    "task.name=game",
    "task.prompt_style=compact",
    "task.max_illegal_moves=3",
    "task.max_turns=4",
    "task.max_context=256",
]


def _tasks(overrides):
    return build_task_source(load_config(TrainConfig, None, overrides).task)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(str(builtin_path("micro", 0)))


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return load_model(str(builtin_path("micro", 0)), torch.device("cpu"), torch.float32)


def test_reference_episodes_are_the_template_render_with_env_tokens_masked(tok):
    tool_tasks = _tasks(["task.name=tool_arithmetic", "task.demo_tool_fraction=1.0"])
    prompt, ids, mask = demonstration(tok, tool_tasks, tool_tasks.train_task(3))
    state = tool_tasks.env.reset(tool_tasks.train_task(3))
    assert prompt == render(tok, state.messages, None, add_generation_prompt=True)
    text = tok.decode(prompt + ids)
    assert text.count("<tool_call>") == 1 and text.endswith(
        tool_tasks.train_task(3).answer + "<|im_end|>"
    )
    env_text = tok.decode([t for t, m in zip(ids, mask) if not m])
    assert (
        env_text
        == f"\n<|im_start|>tool\n{tool_tasks.train_task(3).answer}<|im_end|>\n<|im_start|>assistant\n"
    )


def test_sft_on_reference_games_masks_the_boards():
    cfg = load_config(TrainConfig, None, ["task.name=game", "task.prompt_style=compact"])
    games = build_task_source(cfg.task)
    tok = load_tokenizer(str(builtin_path("micro", 0)))
    _, completions, masks = demonstration_examples(tok, games, 0, 4)
    for completion, mask in zip(completions, masks):
        moves = tok.decode([t for t, m in zip(completion, mask) if m], skip_special_tokens=True)
        assert moves.isdigit() and len(moves) == sum(mask) // 2  # one digit and one EOS per move
        assert "Moves:" in tok.decode([t for t, m in zip(completion, mask) if not m])


def test_rollout_masks_env_tokens_and_lines_up_sampler_logprobs(tok, model):
    games = _tasks(GAME)
    params = SamplingParams(max_new_tokens=4, stop_token_ids=(tok.eos_token_id,), seed=3)
    tasks = [games.train_task(i) for i in range(4)]
    groups = play(SimpleEngine(model, tok), tok, games, tasks, 2, params)
    trajs = [t for g in groups for t in g.trajectories]
    for t in trajs:
        c = t.completion
        assert t.prompt_ids == render(tok, games.env.reset(t.task).messages, None, True)
        assert len(c.token_ids) == len(c.loss_mask) == len(c.logprobs)
        assert t.metrics["turns"] > 1 and 0 in c.loss_mask, c.text
        env_text = tok.decode([i for i, m in zip(c.token_ids, c.loss_mask) if not m])
        assert "Moves:" in env_text and "<|im_start|>user" in env_text  # the board, re-shown
        assert all(lp == 0.0 for lp, m in zip(c.logprobs, c.loss_mask) if not m)
    batch = build_step_batch(groups, load_config(TrainConfig, None, []).algorithm, "cpu")
    for b, t in enumerate(trajs):
        n = len(t.completion.token_ids)
        assert batch.mask_BT[b, :n].tolist() == [float(m) for m in t.completion.loss_mask]
    with torch.no_grad():
        rows = completion_rows(model, batch.prompts, batch.completions, 1.0)
    width = rows.logprobs_ST.shape[1]
    gap = (rows.logprobs_ST - batch.sampler_BT[:, :width]).abs() * batch.mask_BT[:, :width]
    assert gap.max() < 1e-3, gap.max()  # the trainer scores exactly the ids the sampler produced


def _traj(metrics, rewards, mask):
    completion = Completion([0] * len(mask), [0.0] * len(mask), "stop", "", loss_mask=mask)
    return Trajectory(Task("t", (), ""), [0], completion, rewards=rewards, metrics=metrics)


def test_episode_metrics_on_hand_counted_episodes():
    a = _traj(
        {"tool_calls": 2, "malformed_calls": 1, "turns": 3, "finish_context": 0},
        {"env": 1.0},
        [1, 1, 0, 1],
    )
    b = _traj(
        {"tool_calls": 0, "malformed_calls": 0, "turns": 1, "finish_context": 1},
        {"env": 0.0},
        [1, 1],
    )
    c = _traj(
        {"tool_calls": 1, "unknown_tool_calls": 2, "turns": 2, "finish_context": 0},
        {"env": 0.5},
        [1, 0, 0],
    )
    metrics = episode_metrics([Group(a.task, [a, b]), Group(c.task, [c])])
    assert metrics == pytest.approx(
        {
            "tool_call_rate": 2 / 3,
            "tool_calls_per_episode": 1.0,
            "malformed_calls": 1.0,
            "unknown_tool_calls": 2.0,
            "context_overflows": 1.0,
            "turns_per_episode": 2.0,
            "reward_env": 0.5,
            "assistant_tokens_per_episode": 2.0,
        }
    )
    single_turn = Trajectory(Task("t", (), ""), [0], Completion([1], [0.0], "stop"))
    assert episode_metrics([Group(single_turn.task, [single_turn])]) == {}


def test_evaluation_of_an_env_task_plays_episodes(tok, model):
    games = _tasks(GAME)
    tasks = games.eval_tasks()[:6]
    result = evaluate(SimpleEngine(model, tok), tok, games, tasks, 4)
    assert result.num_tasks == 6 and result.episode_metrics["turns_per_episode"] > 1.0
    logged = logged_metrics(result)
    assert logged["eval_loss_rate"] == result.episode_metrics["loss_rate"]
    assert logged["eval_accuracy"] == result.accuracy == result.episode_metrics["win_rate"]
    assert {row["task_id"] for row in result.samples} == {t.id for t in tasks}


def test_a_run_whose_tools_were_never_called_says_so(tmp_path):
    rows = [
        {"phase": "rl", "step": s, "tool_call_rate": 0.0, "malformed_calls": 2.0} for s in (1, 2)
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (note,) = tool_use_notes(tmp_path)
    assert note.startswith("TOOLS WERE NEVER CALLED") and "all 2 RL steps (4 malformed" in note
    rows[1]["tool_call_rate"] = 0.25
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    assert tool_use_notes(tmp_path) == []


TOOL_SFT = ["task.name=tool_arithmetic", "task.demo_tool_fraction=1.0", "sft.steps=1"]


@pytest.mark.parametrize(
    "overrides,message",
    [
        ([*TOOL_SFT, "rollout.max_new_tokens=40"], "set rollout.max_new_tokens >= 8"),
        ([*TOOL_SFT, "task.max_context=150"], "raise task.max_context"),
        ([*TOOL_SFT, "task.max_context=40"], "leaves no room in the episode context"),
        ([*TOOL_SFT, "task.max_context=4096"], "set task.max_context <= 256"),
        (
            ["model.path=builtin:tiny", "task.name=html", "sft.steps=1"],
            "has no reference demonstrations for an SFT stage; set sft.steps = 0",
        ),
    ],
)
def test_budgets_that_cannot_hold_the_episodes_are_refused_before_training(tok, overrides, message):
    cfg = load_config(TrainConfig, None, ["model.path=builtin:micro", *overrides])
    with pytest.raises(ConfigError, match=message):
        probe_lengths(cfg, tok)
