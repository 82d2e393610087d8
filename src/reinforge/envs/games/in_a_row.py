"""k-in-a-row games on a grid: tic-tac-toe (3x3, three in a row) and connect-four (6x7, four in a
row, pieces drop to the lowest empty cell of a column).

A position is a frozen `Board`; the rules are an `InARow` (envs/games/base.py `Game`). Moves:
- tic-tac-toe: a cell, 0..8 row-major from the top left, labelled "1".."9" (the prompt shows
  the number in every empty cell);
- connect-four: a column, 0..6 from the left, labelled "1".."7".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from reinforge.envs.games.base import IllegalMove

EMPTY = -1
MARKS = ("X", "O")
_MARK_OF = {EMPTY: ".", 0: "X", 1: "O"}
_WINDOW_WEIGHTS = (0, 1, 4, 32, 256)  # heuristic value of a window holding n pieces of one side


@dataclass(frozen=True)
class Board:
    rows: int
    cols: int
    cells: tuple[int, ...]  # row-major, row 0 at the top: EMPTY or the player (0, 1) there
    to_move: int = 0
    winner: int | None = None
    num_moves: int = 0

    def at(self, row: int, col: int) -> int:
        return self.cells[row * self.cols + col]

    @property
    def is_full(self) -> bool:
        return EMPTY not in self.cells


@dataclass(frozen=True)
class InARow:
    name: str
    title: str
    rows: int
    cols: int
    k: int  # pieces in a line that win
    has_gravity: bool  # a move names a column; the piece drops to its lowest empty cell
    player_names: tuple[str, str] = field(default=MARKS)

    @property
    def rules(self) -> str:
        if self.has_gravity:
            return (
                f"Players take turns dropping a piece into one of the {self.cols} columns; it "
                f"falls to the lowest empty cell. The first to get {self.k} in a row "
                "horizontally, vertically or diagonally wins."
            )
        return (
            "Players take turns marking an empty cell. The first to get "
            f"{self.k} in a row horizontally, vertically or diagonally wins."
        )

    @cached_property
    def lines(self) -> tuple[tuple[int, ...], ...]:
        """Every window of k cells in a row, column or diagonal, as cell indices."""
        windows = []
        for row in range(self.rows):
            for col in range(self.cols):
                for d_row, d_col in ((0, 1), (1, 0), (1, 1), (1, -1)):
                    end_row, end_col = row + d_row * (self.k - 1), col + d_col * (self.k - 1)
                    if 0 <= end_row < self.rows and 0 <= end_col < self.cols:
                        windows.append(
                            tuple(
                                (row + d_row * i) * self.cols + col + d_col * i
                                for i in range(self.k)
                            )
                        )
        return tuple(windows)

    @cached_property
    def lines_through(self) -> tuple[tuple[tuple[int, ...], ...], ...]:
        """For each cell, the windows that hold it: a move can only complete one of these."""
        return tuple(
            tuple(line for line in self.lines if cell in line)
            for cell in range(self.rows * self.cols)
        )

    def initial_position(self) -> Board:
        return Board(self.rows, self.cols, (EMPTY,) * (self.rows * self.cols))

    def to_move(self, position: Board) -> int:
        return position.to_move

    def legal_moves(self, position: Board) -> list[int]:
        if self.is_over(position):
            return []
        if self.has_gravity:
            return [col for col in range(self.cols) if position.cells[col] == EMPTY]
        return [cell for cell, owner in enumerate(position.cells) if owner == EMPTY]

    def play(self, position: Board, move: int) -> Board:
        if not self._is_legal(position, move):
            raise IllegalMove(
                f"{self.title}: move {move} is not legal here; legal: {self.legal_moves(position)}"
            )
        cell = self._landing_cell(position, move) if self.has_gravity else move
        player = position.to_move
        cells = list(position.cells)
        cells[cell] = player
        has_won = any(all(cells[i] == player for i in line) for line in self.lines_through[cell])
        return Board(
            self.rows,
            self.cols,
            tuple(cells),
            to_move=1 - player,
            winner=player if has_won else None,
            num_moves=position.num_moves + 1,
        )

    def _is_legal(self, position: Board, move: int) -> bool:
        if self.is_over(position):
            return False
        num_choices = self.cols if self.has_gravity else self.rows * self.cols
        # A column is open while its top cell is: the same test as an empty cell.
        return 0 <= move < num_choices and position.cells[move] == EMPTY

    def _landing_cell(self, position: Board, col: int) -> int:
        for row in reversed(range(self.rows)):
            if position.at(row, col) == EMPTY:
                return row * self.cols + col
        raise AssertionError("legal_moves offered a full column")

    def is_over(self, position: Board) -> bool:
        return position.winner is not None or position.is_full

    def winner(self, position: Board) -> int | None:
        return position.winner

    def render(self, position: Board, player: int = 0, compact: bool = False) -> str:
        """A drawn grid, or with `compact` one character per cell and no separators."""
        space = "" if compact else " "
        if self.has_gravity:
            marks = [
                space.join(_MARK_OF[position.at(r, c)] for c in range(self.cols))
                for r in range(self.rows)
            ]
            labels = space.join(str(c + 1) for c in range(self.cols))
            if compact:
                return "\n".join([*marks, labels])
            return "\n".join([*(f"| {line} |" for line in marks), f"  {labels}"])
        rows = [
            [self._cell_text(position, r * self.cols + c) for c in range(self.cols)]
            for r in range(self.rows)
        ]
        if compact:
            return "\n".join("".join(row) for row in rows)
        return ("\n" + "---+" * (self.cols - 1) + "---\n").join(" " + " | ".join(r) for r in rows)

    def _cell_text(self, position: Board, cell: int) -> str:
        owner = position.cells[cell]
        return str(cell + 1) if owner == EMPTY else MARKS[owner]

    def move_label(self, position: Board, move: int) -> str:
        return str(move + 1)

    def heuristic(self, position: Board, player: int) -> int:
        """Open windows: each window holding only `player`'s pieces counts for them by how full it
        is, each holding only the opponent's counts against."""
        score = 0
        cells = position.cells
        for line in self.lines:
            mine = theirs = 0
            for i in line:
                owner = cells[i]
                if owner == player:
                    mine += 1
                elif owner != EMPTY:
                    theirs += 1
            if not theirs:
                score += _WINDOW_WEIGHTS[min(mine, 4)]
            elif not mine:
                score -= _WINDOW_WEIGHTS[min(theirs, 4)]
        return score

    def from_rows(self, rows: list[str]) -> Board:
        """A board from text rows of "X", "O" and "." (top row first), for tests and examples;
        the player to move follows from the piece counts (X moves first)."""
        assert len(rows) == self.rows and all(len(r) == self.cols for r in rows), rows
        owner_of = {".": EMPTY, "X": 0, "O": 1}
        cells = tuple(owner_of[ch] for row in rows for ch in row)
        num_moves = sum(owner != EMPTY for owner in cells)
        winners = {
            cells[line[0]]
            for line in self.lines
            if cells[line[0]] != EMPTY and all(cells[i] == cells[line[0]] for i in line)
        }
        assert len(winners) <= 1, f"both players have {self.k} in a row"
        return Board(
            self.rows,
            self.cols,
            cells,
            to_move=num_moves % 2,
            winner=winners.pop() if winners else None,
            num_moves=num_moves,
        )


TIC_TAC_TOE = InARow(
    name="tic_tac_toe", title="tic-tac-toe", rows=3, cols=3, k=3, has_gravity=False
)
CONNECT_FOUR = InARow(
    name="connect_four", title="connect-four", rows=6, cols=7, k=4, has_gravity=True
)
