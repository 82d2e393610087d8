"""Game tasks: a list of cases (game, opponent, side, random opening plies), each drawn with
many seeds.

`train_task(i)` plays case `i % len(cases)` with a seed that is a pure function of (seed, i);
`eval_tasks()` holds `num_eval_per_case` tasks per case from a separate seed stream. The split is
by seed: it holds out the opponent's random choices and the random openings. With no random
opening plies every task of a case starts from the same board (or the opponent's first reply
to it), so there the eval split measures play, not unseen positions.

A task's `info` holds what the env replays: the game, the opponent, the model's side, the moves
made before the model's first turn, and the seed of the opponent's randomness. Its one user
message shows that position (envs/games/env.py `opening_prompt`), so trainers that measure
prompts see the real one. Run a task through `GameEnv`; `GameTasks.reward` scores a single
completion only (is it a legal first move), for single-turn use.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from reinforge.envs.base import EnvState
from reinforge.envs.games.catalog import load_game
from reinforge.envs.games.env import GameEpisode, match_move, opening_prompt, parse_move, replay
from reinforge.envs.games.opponents import best_moves, make_opponent
from reinforge.errors import ConfigError
from reinforge.types import Message, Task


@dataclass(frozen=True)
class GameCase:
    game: str = "tic_tac_toe"  # a built-in game or "openspiel:GAME_STRING"
    opponent: str = "random"  # "random", "minimax" or "mcts" (OpenSpiel games)
    opponent_depth: int | None = None  # minimax plies (None: full) or mcts simulations
    model_player: int | None = None  # 0 moves first, 1 second, None: drawn per task
    num_random_plies: int = 0  # random moves, by both sides, before the model's first turn


DEFAULT_CASES = (
    GameCase("tic_tac_toe", "random"),
    GameCase("tic_tac_toe", "minimax"),
    GameCase("connect_four", "random", num_random_plies=2),
    GameCase("connect_four", "minimax", opponent_depth=2, num_random_plies=2),
)


# Plies the demonstration player searches, scoring unfinished boards by their open lines. Not to
# the end of the game: a full search rates every move that does not lose alike (all draws, to a
# perfect opponent), so a teacher would pick among them at random; two plies take a win, block a
# loss and prefer the centre, and win over 90% of tic-tac-toe games against a random player.
DEMO_SEARCH_DEPTH: dict[str, int] = {"tic_tac_toe": 2}
DEMO_DEFAULT_DEPTH = 4


class GameTasks:
    name = "games"

    def __init__(
        self,
        cases: Sequence[GameCase] = DEFAULT_CASES,
        *,
        seed: int = 0,
        num_eval_per_case: int = 16,
        prompt_style: str = "full",
        demo_best_move_fraction: float = 0.5,
    ):
        """`prompt_style`: as `GameEnv`'s (the opening board is drawn here). The share
        `demo_best_move_fraction` of `demonstration`'s moves are best moves, the rest random."""
        if not cases:
            raise ConfigError("game tasks need at least one case, e.g. GameCase('tic_tac_toe')")
        for case in cases:
            _check_case(case)
        self.cases = tuple(cases)
        self.seed = seed
        self.prompt_style = prompt_style
        self.demo_best_move_fraction = demo_best_move_fraction
        self._eval = [
            self._make(case_index, f"{seed}/eval/{case_index}/{j}", f"eval-{case_index}-{j}")
            for case_index in range(len(self.cases))
            for j in range(num_eval_per_case)
        ]

    def train_task(self, index: int) -> Task:
        return self._make(index % len(self.cases), f"{self.seed}/train/{index}", f"train-{index}")

    def eval_tasks(self) -> list[Task]:
        return list(self._eval)

    def reward(self, completion: str, task: Task) -> float:
        """Single-turn use: 1.0 if the completion is a legal move in the opening position."""
        game = load_game(task.info["game"])
        label = parse_move(completion)
        position = replay(game, task.info["moves"])
        return float(label is not None and match_move(game, position, label) is not None)

    def demonstration(self, state: EnvState) -> str:
        """A scripted reference player's next message in a `GameEnv` episode: a best move (by
        depth-limited minimax, `DEMO_SEARCH_DEPTH`) or a random legal one, seeded by the task
        and the turn; a bare label in the compact style, else in <move> tags.

        Equally good moves are broken by legal-move order, not at random: the same board then
        always gets the same reply, a function a small model fits from a few hundred games
        (with random tie-breaks the tiny model measured no better than a board-blind player)."""
        episode: GameEpisode = state.info["game"]
        game, position = episode.game, episode.position
        rng = random.Random(f"{state.task.id}/demo/{state.turn}")
        if rng.random() < self.demo_best_move_fraction:
            depth = DEMO_SEARCH_DEPTH.get(game.name, DEMO_DEFAULT_DEPTH)
            move = best_moves(game, position, depth)[0]  # ties: the first, every time
        else:
            move = rng.choice(game.legal_moves(position))
        label = game.move_label(position, move)
        return label if self.prompt_style == "compact" else f"<move>{label}</move>"

    def _make(self, case_index: int, seed: str, task_id: str) -> Task:
        case = self.cases[case_index]
        game = load_game(case.game)
        rng = random.Random(f"{seed}/opening")
        player = rng.randrange(2) if case.model_player is None else case.model_player
        # Redraw the rare random opening that ends the game (or leaves no turn for the model).
        for _ in range(100):
            moves: list[int] = []
            position = game.initial_position()
            for _ in range(case.num_random_plies):
                if game.is_over(position):
                    break
                move = rng.choice(game.legal_moves(position))
                moves.append(move)
                position = game.play(position, move)
            if not game.is_over(position) and game.to_move(position) != player:
                opponent = make_opponent(case.opponent, case.opponent_depth)
                move = opponent(game, position, rng)
                moves.append(move)
                position = game.play(position, move)
            if not game.is_over(position):
                break
        else:
            raise ConfigError(f"{case}: every random opening ends the game; use fewer plies")
        return Task(
            id=task_id,
            messages=(Message("user", opening_prompt(game, position, player, self.prompt_style)),),
            answer="",
            info={
                "game": case.game,
                "opponent": case.opponent,
                "opponent_depth": case.opponent_depth,
                "model_player": player,
                "moves": moves,
                "seed": seed,
                "case": case_index,
            },
        )


def _check_case(case: GameCase) -> None:
    load_game(case.game)  # unknown games and opponents fail here, naming the choices
    make_opponent(case.opponent, case.opponent_depth)
    if case.opponent == "mcts" and not case.game.startswith("openspiel:"):
        raise ConfigError(
            f"{case}: the mcts opponent plays OpenSpiel games only; use opponent='minimax' or "
            f"game='openspiel:{case.game}'"
        )
    if case.model_player not in (None, 0, 1):
        raise ConfigError(
            f"{case}: model_player={case.model_player} must be 0 (first), 1 (second) or None"
        )
    if case.num_random_plies < 0:
        raise ConfigError(f"{case}: num_random_plies={case.num_random_plies} must be >= 0")
