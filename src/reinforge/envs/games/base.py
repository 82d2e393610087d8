"""The rules interface every game speaks, built-in or OpenSpiel.

A `Game` is stateless rules over immutable positions: `play` returns a new position and leaves
the old one as it was, so search (minimax, MCTS) and replays never copy by hand. Moves are ints
(a cell, a column, an OpenSpiel action id); `move_label` is the text the model reads and writes
for a move. Players are 0 (moves first) and 1.
"""

from __future__ import annotations

from typing import Any, Protocol

Position = Any  # a game's own immutable position type (a Board, an OpenSpiel state)


class IllegalMove(ValueError):
    """A move that is not legal in the position it was played in."""


class Game(Protocol):
    @property
    def name(self) -> str:
        """The name `load_game` knows it by."""
        ...

    @property
    def title(self) -> str:
        """For people and prompts: "tic-tac-toe"."""
        ...

    @property
    def rules(self) -> str:
        """One or two sentences the prompt states."""
        ...

    @property
    def player_names(self) -> tuple[str, str]: ...

    def __hash__(self) -> int: ...  # searches are cached per (game, position)

    def initial_position(self) -> Position: ...

    def to_move(self, position: Position) -> int: ...

    def legal_moves(self, position: Position) -> list[int]: ...

    def play(self, position: Position, move: int) -> Position:
        """The position after `move`; raises IllegalMove for a move not in legal_moves."""
        ...

    def is_over(self, position: Position) -> bool: ...

    def winner(self, position: Position) -> int | None:
        """The winning player of a finished game; None for a draw or a game still going."""
        ...

    def render(self, position: Position, player: int, compact: bool = False) -> str:
        """The position as text, as `player` sees it; `compact` asks for the fewest characters
        (games whose text is already terse ignore it)."""
        ...

    def move_label(self, position: Position, move: int) -> str: ...

    def heuristic(self, position: Position, player: int) -> int:
        """How good a position looks for `player` (|value| < 100_000), for depth-limited search;
        0 where the game has no heuristic."""
        ...
