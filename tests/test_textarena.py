"""The textarena agent example (examples/agents/textarena_tictactoe.py), written only against the
`openai` client, plays whole TicTacToe games against the tiny model behind reinforge's OpenAI
server (the app `reinforge serve` runs): the opponent moves, refused moves are the game's to
judge, and the reward components come back. Skipped when textarena is not installed."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("textarena", reason="textarena (the `libs` extra) not installed")
pytest.importorskip("uvicorn", reason="the server needs the `serve` extra")

import textarena as ta

from reinforge.models.tiny import builtin_path
from reinforge.server import load_served_model

from .conftest import cli
from .server.conftest import client, start_server

EXAMPLE = Path(__file__).parents[1] / "examples" / "agents" / "textarena_tictactoe.py"


def load_example():
    spec = importlib.util.spec_from_file_location("textarena_tictactoe", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_url():
    served = load_served_model(str(builtin_path("tiny", 0)), served_model_name="tiny")
    yield from start_server(served)


class Recording:
    """The openai client's `chat.completions.create`, keeping each request's messages."""

    def __init__(self, openai_client):
        self.requests: list[list[dict]] = []
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))
        self.inner = openai_client

    def create(self, **kwargs):
        self.requests.append(kwargs["messages"])
        return self.inner.chat.completions.create(**kwargs)


@pytest.mark.parametrize("model_player", [0, 1])
def test_games_play_to_the_end_against_the_served_tiny_model(tiny_url, model_player):
    game = load_example()
    recording = Recording(client(tiny_url))
    for seed in range(3):
        agent = SimpleNamespace(
            client=recording,
            model="tiny",
            info={"game_seed": seed, "model_player": model_player},
            sample_index=seed,
        )
        rewards = game.run(agent)
        assert set(rewards) == {"reward", "outcome", "legal_moves"}
        assert rewards["reward"] == rewards["outcome"]
        assert rewards["outcome"] in (0.0, 0.5, 1.0) and 0.0 <= rewards["legal_moves"] <= 1.0
    assert recording.requests, "the model was never asked for a move"
    first = recording.requests[0]
    assert first[0]["role"] == "system" and "[4]" in first[0]["content"]
    assert "Available Moves" in first[1]["content"]
    if model_player == 1:  # the opponent opened: the model sees its mark on the board
        assert "placed their symbol" not in first[1]["content"]  # the board view only
        assert first[1]["content"].count("O") >= 1


def test_refused_moves_follow_the_game_rules():
    """A scripted model that writes nonsense twice loses on the second (textarena's error
    allowance of one); one that plays the free cells always moves legally."""
    game = load_example()

    class Scripted:
        def __init__(self, moves):
            self.moves = iter(moves)
            self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

        def create(self, **kwargs):
            free = game.free_cells(kwargs["messages"][-1]["content"])
            move = next(self.moves) or random.Random(0).choice(free)
            message = SimpleNamespace(content=move)
            return SimpleNamespace(choices=[SimpleNamespace(message=message)])

    nonsense = SimpleNamespace(
        client=Scripted(["hello", "[9]"]), model="m", info={"model_player": 0}, sample_index=0
    )
    assert game.run(nonsense) == {"reward": 0.0, "outcome": 0.0, "legal_moves": 0.0}
    legal = SimpleNamespace(
        client=Scripted([None] * 9), model="m", info={"model_player": 0}, sample_index=1
    )
    rewards = game.run(legal, opponent="first")
    assert rewards["legal_moves"] == 1.0 and rewards["outcome"] in (0.0, 0.5, 1.0)
    once = SimpleNamespace(
        client=Scripted(["bad", *[None] * 9]), model="m", info={"model_player": 0}, sample_index=2
    )
    assert 0.0 < game.run(once)["legal_moves"] < 1.0  # refused once, then the game went on


def test_the_opponent_picks_free_cells():
    game = load_example()
    env = ta.make(game.GAME)
    env.reset(num_players=2, seed=0)
    env.step("[4]")
    _, observation = env.get_observation()
    assert "[4]" not in game.free_cells(observation) and len(game.free_cells(observation)) == 8
    assert game.opponent_move(observation, "first", random.Random(0)) == "[0]"


def test_the_game_trains_through_the_agent_task(tmp_path):
    """configs/agent_tictactoe.toml through `reinforge train`: two steps of whole games, each
    turn a request the agent task records (a fresh board each turn: one segment per move, a
    history break between them), the reward components logged, evaluation one sample per game."""
    out = cli(
        "train",
        "configs/agent_tictactoe.toml",
        "run.max_steps=2",
        "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=2",
        "eval.num_tasks=2",
        f"run.output_dir={tmp_path}",
        "run.num_threads=1",
        "log.tensorboard=false",
        "log.plot=false",
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    rows = [json.loads(x) for x in (tmp_path / "agent_tictactoe" / "metrics.jsonl").open()]
    steps = [r for r in rows if r.get("phase") == "rl" and "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:  # 4 games a step, each at least one move of the model's
        assert r["agent_requests"] >= 4 and r["agent_segments"] == r["agent_requests"]
        assert r["agent_history_breaks"] == r["agent_segments"] - 4
        assert {"reward_env", "reward_legal_moves"} <= set(r)
        assert sum(v for k, v in r.items() if k.startswith("agent_failed_")) == 0
    evals = [r for r in rows if "eval_accuracy" in r]
    assert evals and all(0.0 <= r["eval_accuracy"] <= 1.0 for r in evals)
