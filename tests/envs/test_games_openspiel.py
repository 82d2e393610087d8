import random

import pytest

pytest.importorskip("pyspiel", reason="OpenSpiel is optional: pip install 'reinforge[games]'")

from reinforge.envs.games import GameCase, GameEnv, GameTasks, best_moves, load_game
from reinforge.envs.games.env import match_move
from reinforge.errors import ConfigError
from reinforge.types import Message


def test_tic_tac_toe_through_the_adapter():
    game = load_game("openspiel:tic_tac_toe")
    position = game.initial_position()
    assert game.render(position, 0) == "...\n...\n..."
    assert [game.move_label(position, m) for m in game.legal_moves(position)][:3] == [
        "x(0,0)",
        "x(0,1)",
        "x(0,2)",
    ]
    for label in ("x(0,0)", "o(1,0)", "x(0,1)", "o(1,1)"):
        move = match_move(game, position, label)
        assert move is not None, label
        before = position
        position = game.play(position, move)
        assert before is not position and not game.is_over(before)
    assert game.render(position, 1) == "xx.\noo.\n..."
    assert best_moves(game, position) == (2,)  # x completes the top row
    won = game.play(position, 2)
    assert game.is_over(won) and game.winner(won) == 0 and game.legal_moves(won) == []


def test_unsupported_and_unknown_games_name_the_fix():
    with pytest.raises(ConfigError, match="deterministic"):
        load_game("openspiel:kuhn_poker")
    with pytest.raises(ConfigError, match="registered_names"):
        load_game("openspiel:no_such_game")


def test_episode_against_mcts_in_connect_four():
    tasks = GameTasks(
        [GameCase("openspiel:connect_four", "mcts", opponent_depth=20, model_player=0)], seed=1
    )
    task = tasks.train_task(0)
    assert "Legal moves: x0, x1, x2, x3, x4, x5, x6" in task.messages[0].content
    env = GameEnv()
    state = env.reset(task)
    game = state.info["game"].game
    rng = random.Random(0)
    result = None
    while not state.done:
        position = state.info["game"].position
        label = game.move_label(position, rng.choice(game.legal_moves(position)))
        result = env.step(state, Message("assistant", f"<move>{label}</move>"))
    episode = state.info["game"]
    assert episode.outcome in ("win", "draw", "loss") and episode.counters.illegal_moves == 0
    assert result is not None and result.metrics["forfeit"] == 0.0
    assert result.rewards["reward"] == {"win": 1.0, "draw": 0.5, "loss": 0.0}[episode.outcome]


def test_minimax_opponent_on_openspiel_tic_tac_toe_is_never_beaten_by_random():
    env = GameEnv()
    tasks = GameTasks([GameCase("openspiel:tic_tac_toe", "minimax", model_player=0)])
    rng = random.Random(0)
    for i in range(3):
        state = env.reset(tasks.train_task(i))
        game = state.info["game"].game
        while not state.done:
            position = state.info["game"].position
            label = game.move_label(position, rng.choice(game.legal_moves(position)))
            env.step(state, Message("assistant", label))
        assert state.info["game"].outcome in ("draw", "loss")
