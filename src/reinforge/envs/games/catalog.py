"""The games a config can name: the built-in ones by name, OpenSpiel's by "openspiel:GAME".

Above the rules modules (`base`, `in_a_row`, `openspiel`): it imports them, they never import it.
"""

from __future__ import annotations

import functools

from reinforge.envs.games.base import Game
from reinforge.envs.games.in_a_row import CONNECT_FOUR, TIC_TAC_TOE
from reinforge.errors import ConfigError

BUILTIN_GAMES = ("tic_tac_toe", "connect_four")


@functools.cache
def load_game(name: str) -> Game:
    """A built-in game by name ("tic_tac_toe", "connect_four"), or an OpenSpiel game by its game
    string after "openspiel:" ("openspiel:connect_four"); loaded once per process."""
    if name.startswith("openspiel:"):
        from reinforge.envs.games.openspiel import OpenSpielGame

        return OpenSpielGame(name.removeprefix("openspiel:"))
    builtin = {"tic_tac_toe": TIC_TAC_TOE, "connect_four": CONNECT_FOUR}
    if name not in builtin:
        raise ConfigError(
            f"game {name!r} is unknown; use one of {list(BUILTIN_GAMES)} or "
            '"openspiel:GAME" for an OpenSpiel game (e.g. "openspiel:connect_four")'
        )
    return builtin[name]
