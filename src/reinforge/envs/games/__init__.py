"""Board games for RL: rules, opponents, a multi-turn env and a task source.

- `base`: the `Game` rules interface.
- `catalog`: `load_game(name)` ("tic_tac_toe", "connect_four", "openspiel:GAME").
- `in_a_row`: tic-tac-toe and connect-four in pure Python (`TIC_TAC_TOE`, `CONNECT_FOUR`).
- `opponents`: random, minimax (alpha-beta, depth-limited) and OpenSpiel MCTS opponents.
- `env`: `GameEnv`, where the model plays one side and answers `<move>MOVE</move>`.
- `tasks`: `GameTasks`, cases times seeds, with a held-out eval split.
- `openspiel`: the OpenSpiel adapter (needs `pip install 'reinforge[games]'`).
"""

from reinforge.envs.games.base import Game, IllegalMove
from reinforge.envs.games.catalog import load_game
from reinforge.envs.games.env import GameCounters, GameEnv, GameEpisode, parse_move
from reinforge.envs.games.in_a_row import CONNECT_FOUR, TIC_TAC_TOE, Board, InARow
from reinforge.envs.games.opponents import (
    best_moves,
    make_opponent,
    minimax_opponent,
    random_opponent,
)
from reinforge.envs.games.tasks import DEFAULT_CASES, GameCase, GameTasks

__all__ = [
    "CONNECT_FOUR",
    "DEFAULT_CASES",
    "TIC_TAC_TOE",
    "Board",
    "Game",
    "GameCase",
    "GameCounters",
    "GameEnv",
    "GameEpisode",
    "GameTasks",
    "IllegalMove",
    "InARow",
    "best_moves",
    "load_game",
    "make_opponent",
    "minimax_opponent",
    "parse_move",
    "random_opponent",
]
