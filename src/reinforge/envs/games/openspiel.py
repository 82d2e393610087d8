"""OpenSpiel games behind the `Game` interface: `load_game("openspiel:connect_four")`.

Needs `pip install 'reinforge[games]'` (the `open_spiel` wheel, imported as `pyspiel`). Any
two-player, sequential, deterministic game loads by its OpenSpiel game string, parameters
included ("tic_tac_toe", "connect_four", "breakthrough(rows=6,columns=6)"). The model reads
`state.observation_string(player)` (or `str(state)` for games without one) and answers with an
action's `state.action_to_string` label, e.g. "x(1,1)" in tic_tac_toe or "x3" in connect_four.
"""

from __future__ import annotations

import random
from typing import Any

from reinforge.envs.games.base import IllegalMove
from reinforge.errors import ConfigError


def _pyspiel() -> Any:
    try:
        import pyspiel
    except ImportError as e:
        raise ConfigError(
            "OpenSpiel games need the open_spiel package: pip install 'reinforge[games]' "
            "(or use a built-in game: tic_tac_toe, connect_four)"
        ) from e
    return pyspiel


class OpenSpielGame:
    """Holds the loaded pyspiel game; positions are pyspiel states, cloned on every move."""

    def __init__(self, game_string: str):
        pyspiel = _pyspiel()
        try:
            self.game = pyspiel.load_game(game_string)
        except pyspiel.SpielError as e:
            raise ConfigError(
                f"OpenSpiel cannot load game {game_string!r}: {e}. Try 'tic_tac_toe' or "
                "'connect_four' (pyspiel.registered_names() lists them all)"
            ) from e
        kind = self.game.get_type()
        is_supported = (
            self.game.num_players() == 2
            and kind.dynamics == pyspiel.GameType.Dynamics.SEQUENTIAL
            and kind.chance_mode == pyspiel.GameType.ChanceMode.DETERMINISTIC
        )
        if not is_supported:
            raise ConfigError(
                f"OpenSpiel game {game_string!r} is not a two-player, sequential, "
                "deterministic game; the game env plays only those (e.g. 'tic_tac_toe', "
                "'connect_four', 'breakthrough')"
            )
        self.name = f"openspiel:{game_string}"
        self.title = kind.long_name
        self.rules = f"The rules are those of {kind.long_name}."
        self.player_names = ("player 0", "player 1")
        self._has_observation = kind.provides_observation_string

    def initial_position(self) -> Any:
        return self.game.new_initial_state()

    def to_move(self, position: Any) -> int:
        return position.current_player()

    def legal_moves(self, position: Any) -> list[int]:
        return [] if position.is_terminal() else list(position.legal_actions())

    def play(self, position: Any, move: int) -> Any:
        if move not in self.legal_moves(position):
            raise IllegalMove(f"{self.name}: action {move} is not legal here")
        after = position.clone()
        after.apply_action(move)
        return after

    def is_over(self, position: Any) -> bool:
        return position.is_terminal()

    def winner(self, position: Any) -> int | None:
        if not position.is_terminal():
            return None
        returns = position.returns()
        if returns[0] == returns[1]:
            return None
        return 0 if returns[0] > returns[1] else 1

    def render(self, position: Any, player: int, compact: bool = False) -> str:
        text = position.observation_string(player) if self._has_observation else str(position)
        return text.rstrip("\n")

    def move_label(self, position: Any, move: int) -> str:
        return position.action_to_string(position.current_player(), move)

    def heuristic(self, position: Any, player: int) -> int:
        return 0


def mcts_move(game: OpenSpielGame, position: Any, rng: random.Random, num_simulations: int) -> int:
    """OpenSpiel's MCTS bot (UCT, random rollouts), seeded from `rng`."""
    import numpy as np
    from open_spiel.python.algorithms import mcts

    random_state = np.random.RandomState(rng.getrandbits(32))
    bot = mcts.MCTSBot(
        game.game,
        uct_c=2.0,
        max_simulations=num_simulations,
        evaluator=mcts.RandomRolloutEvaluator(n_rollouts=1, random_state=random_state),
        random_state=random_state,
    )
    return int(bot.step(position))
