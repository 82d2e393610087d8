"""Opponents: functions `(game, position, rng) -> move` that choose the other side's moves.

- `random_opponent`: a uniformly random legal move.
- `minimax_opponent(depth)`: negamax with alpha-beta pruning to `depth` plies (None: to the end
  of the game, exact for tic-tac-toe), scoring unfinished positions with `game.heuristic`.
  Wins sooner and losses later score better, and ties between equally good moves are broken
  with `rng`, so a minimax opponent still varies its play.
- `mcts_opponent(num_simulations)`: OpenSpiel's MCTS bot with random rollouts (OpenSpiel games
  only).

`make_opponent(name, depth)` builds one from the names a task stores ("random", "minimax",
"mcts"); all randomness comes from the `rng` passed in, so an episode is a pure function of its
task.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable

from reinforge.envs.games.base import Game, Position
from reinforge.errors import ConfigError

Opponent = Callable[[Game, Position, random.Random], int]

WIN_SCORE = 1_000_000  # above any heuristic value
_INF = 10 * WIN_SCORE
_FULL_DEPTH = 1_000  # "to the end of the game" for any board we ship


def random_opponent(game: Game, position: Position, rng: random.Random) -> int:
    return rng.choice(game.legal_moves(position))


def minimax_opponent(depth: int | None = None) -> Opponent:
    if depth is not None and depth < 1:
        raise ConfigError(f"minimax depth={depth} must be >= 1 ply, or None for a full search")

    def choose(game: Game, position: Position, rng: random.Random) -> int:
        return rng.choice(best_moves(game, position, depth))

    return choose


# Positions recur across episodes (every tic-tac-toe game starts from one board, and a full
# search of it takes ~0.1 s), so searches are remembered; a game whose positions are not
# hashable by value (OpenSpiel states) just misses.
@functools.lru_cache(maxsize=16384)
def best_moves(game: Game, position: Position, depth: int | None = None) -> tuple[int, ...]:
    """Every move whose negamax value (to `depth` plies) is the best, in legal-move order."""
    depth = _FULL_DEPTH if depth is None else depth
    table: dict = {}  # one search's transposition table: (position, depth) -> (value, bound)
    best, moves = -_INF, []
    for move in game.legal_moves(position):
        # A window just under the best so far: moves that tie come back exact, worse ones cut.
        value = -_negamax(game, game.play(position, move), depth - 1, -_INF, 1 - best, table)
        if value > best:
            best, moves = value, [move]
        elif value == best:
            moves.append(move)
    assert moves, "best_moves() on a finished game"
    return tuple(moves)


_EXACT, _LOWER, _UPPER = 0, 1, -1  # what a stored value is: the value, or a bound on it


def _negamax(game: Game, position: Position, depth: int, alpha: int, beta: int, table: dict) -> int:
    """The value of `position` for the player to move, exact when it falls inside
    (alpha, beta), else a bound beyond the side it fell (fail-soft)."""
    if game.is_over(position):
        winner = game.winner(position)
        if winner is None:
            return 0
        score = WIN_SCORE + depth  # more plies left over: a quicker win
        return score if winner == game.to_move(position) else -score
    if depth == 0:
        return game.heuristic(position, game.to_move(position))
    key = (position, depth)
    if key in table:
        value, bound = table[key]
        if (
            bound == _EXACT
            or (bound == _LOWER and value >= beta)
            or (bound == _UPPER and value <= alpha)
        ):
            return value
    original_alpha, best = alpha, -_INF
    for move in game.legal_moves(position):
        best = max(
            best, -_negamax(game, game.play(position, move), depth - 1, -beta, -alpha, table)
        )
        alpha = max(alpha, best)
        if alpha >= beta:
            break
    bound = _LOWER if best >= beta else _UPPER if best <= original_alpha else _EXACT
    table[key] = (best, bound)
    return best


def mcts_opponent(num_simulations: int = 200) -> Opponent:
    if num_simulations < 1:
        raise ConfigError(f"mcts num_simulations={num_simulations} must be >= 1; 200 works")

    def choose(game: Game, position: Position, rng: random.Random) -> int:
        from reinforge.envs.games.openspiel import OpenSpielGame, mcts_move

        if not isinstance(game, OpenSpielGame):
            raise ConfigError(
                f"the mcts opponent plays OpenSpiel games only, not {game.name!r}; "
                'use opponent = "minimax" or game = "openspiel:' + game.name + '"'
            )
        return mcts_move(game, position, rng, num_simulations)

    return choose


OPPONENTS = ("random", "minimax", "mcts")


def make_opponent(name: str, depth: int | None = None) -> Opponent:
    """`depth`: minimax plies (None: full search), or MCTS simulations (None: 200)."""
    if name == "random":
        return random_opponent
    if name == "minimax":
        return minimax_opponent(depth)
    if name == "mcts":
        return mcts_opponent(200 if depth is None else depth)
    raise ConfigError(f"opponent {name!r} is unknown; use one of {list(OPPONENTS)}")
