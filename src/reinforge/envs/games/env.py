"""Two-player board games as a multi-turn env: the model plays one side, an opponent the other.

Each user message shows the board as text and the legal moves; the model answers with a move;
`step` plays it, lets the opponent reply, and shows the new board, until the game ends. The
`prompt_style` "full" also states the rules and the answer format; "compact" lists the legal
moves and then draws the board with one character per cell, so a whole tic-tac-toe game fits in
a few hundred tokens (small models, short contexts) and each cell sits at a fixed distance from
the model's reply.

The move format: the text inside the last `<move>...</move>` tag of the message (reasoning may
come before it), e.g. `<move>5</move>`; a message with no tag counts as a bare move when it is
one short word, e.g. `5` or `5.`. The label is matched against the legal moves' labels, ignoring
case and spaces: "1".."9" (cells) in tic-tac-toe, "1".."7" (columns) in connect-four, OpenSpiel's
action strings ("x(1,1)") for OpenSpiel games. No move readable is a *malformed* move; a move
read but not legal here is an *illegal* one.

Rewards, reported once, at the step that ends the episode: both components, `rewards["outcome"]`
and `rewards["legal_moves"]`, and the one `reward_mode` picks as `rewards["reward"]`:
- "outcome": 1.0 win, 0.5 draw, 0.0 loss. A malformed or illegal move beyond
  `max_illegal_moves` (0: the first one) forfeits: the episode ends as a loss.
- "legality": the number of legal moves the model made (1 per legal move), for teaching the
  move format; the episode ends the same way.
A bad move within `max_illegal_moves` is answered with the error, the board and the legal moves.

Counters: `StepResult.metrics` holds this step's counts (summing them over the steps gives the
episode's; the last step adds win / draw / loss / forfeit), and `state.info["game"]` the
`GameEpisode` with running totals. A task names its game, opponent and opening moves in
`task.info` (envs/games/tasks.py); its messages already show the opening position, so the
episode is a pure function of the task and the model's moves.
"""

from __future__ import annotations

import random
import re
from dataclasses import asdict, dataclass, field

from reinforge.envs.base import EnvState, StepResult
from reinforge.envs.games.base import Game, Position
from reinforge.envs.games.catalog import load_game
from reinforge.envs.games.opponents import Opponent, make_opponent
from reinforge.errors import ConfigError
from reinforge.types import Message, Task

REWARD_MODES = ("outcome", "legality")
REWARD_OF_MODE = {"outcome": "outcome", "legality": "legal_moves"}  # the component "reward" is
PROMPT_STYLES = ("full", "compact")
OUTCOME_REWARDS = {"win": 1.0, "draw": 0.5, "loss": 0.0}
MAX_BARE_MOVE_CHARS = 16

_MOVE_TAG = re.compile(r"<move>(.*?)</move>", re.DOTALL)


def parse_move(text: str) -> str | None:
    """The move label the model wrote (see the module docstring), or None if there is none."""
    tagged = _MOVE_TAG.findall(text)
    if tagged:
        return tagged[-1].strip() or None
    if "<move>" in text:  # opened and never closed
        return None
    bare = text.strip().removesuffix(".")
    if not bare or len(bare) > MAX_BARE_MOVE_CHARS or any(ch.isspace() for ch in bare):
        return None
    return bare


def match_move(game: Game, position: Position, label: str) -> int | None:
    """The legal move whose label is `label` (ignoring case and spaces), or None."""
    key = _normalize_label(label)
    for move in game.legal_moves(position):
        if _normalize_label(game.move_label(position, move)) == key:
            return move
    return None


def _normalize_label(label: str) -> str:
    return "".join(label.split()).lower()


def board_prompt(game: Game, position: Position, player: int, style: str = "full") -> str:
    """The board as `player` sees it, the legal moves, and (in the full style) how to answer."""
    labels = [game.move_label(position, move) for move in game.legal_moves(position)]
    if style == "compact":  # the board last: each cell then sits a fixed distance from the reply
        return f"Moves: {' '.join(labels)}\n{game.render(position, player, compact=True)}"
    return (
        f"Board:\n{game.render(position, player)}\n\n"
        f"Legal moves: {', '.join(labels)}\n"
        f"Reply with your move as <move>MOVE</move>, e.g. <move>{labels[0]}</move>."
    )


def opening_prompt(game: Game, position: Position, player: int, style: str = "full") -> str:
    names = game.player_names
    if style == "compact":
        board = board_prompt(game, position, player, style)
        return f"{game.title}, you play {names[player]}.\n{board}"
    return (
        f"You are playing {game.title} as {names[player]}; your opponent plays "
        f"{names[1 - player]}. {game.rules}\n\n{board_prompt(game, position, player)}"
    )


@dataclass
class GameCounters:
    turns: int = 0
    legal_moves: int = 0
    illegal_moves: int = 0  # read, but not a legal move in the position
    malformed_moves: int = 0  # no move could be read

    @property
    def num_bad_moves(self) -> int:
        return self.illegal_moves + self.malformed_moves


@dataclass
class GameEpisode:
    game: Game
    position: Position
    model_player: int
    opponent: Opponent
    rng: random.Random  # the opponent's
    counters: GameCounters = field(default_factory=GameCounters)
    outcome: str | None = None  # "win", "draw" or "loss" for the model, once the game is over


def replay(game: Game, moves: list[int]) -> Position:
    position = game.initial_position()
    for move in moves:
        position = game.play(position, move)
    return position


class GameEnv:
    name = "game"

    def __init__(
        self,
        *,
        reward_mode: str = "outcome",
        max_illegal_moves: int = 0,
        system_prompt: str | None = None,
        prompt_style: str = "full",
    ):
        if prompt_style not in PROMPT_STYLES:
            raise ConfigError(
                f"game env prompt_style={prompt_style!r} is unknown; use one of {list(PROMPT_STYLES)}"
            )
        if reward_mode not in REWARD_MODES:
            raise ConfigError(
                f"game env reward_mode={reward_mode!r} is unknown; use one of {list(REWARD_MODES)}"
            )
        if max_illegal_moves < 0:
            raise ConfigError(
                f"game env max_illegal_moves={max_illegal_moves} must be >= 0; 0 ends the game "
                "at the first bad move"
            )
        self.reward_mode = reward_mode
        self.prompt_style = prompt_style
        self.max_illegal_moves = max_illegal_moves
        self.system_prompt = system_prompt

    def reset(self, task: Task) -> EnvState:
        info = task.info
        game = load_game(info["game"])
        position = replay(game, info["moves"])
        assert not game.is_over(position), f"task {task.id}: the opening ends the game"
        assert game.to_move(position) == info["model_player"], f"task {task.id}: not our turn"
        episode = GameEpisode(
            game=game,
            position=position,
            model_player=info["model_player"],
            opponent=make_opponent(info["opponent"], info.get("opponent_depth")),
            rng=random.Random(f"{info['seed']}/opponent"),
        )
        messages = list(task.messages)
        if self.system_prompt is not None:
            messages.insert(0, Message("system", self.system_prompt))
        return EnvState(task=task, messages=messages, info={"game": episode})

    def step(self, state: EnvState, assistant: Message) -> StepResult:
        assert not state.done, "step() after the episode ended"
        episode: GameEpisode = state.info["game"]
        game = episode.game
        state.messages.append(assistant)
        state.turn += 1
        step = GameCounters(turns=1)

        label = parse_move(assistant.content)
        move = None if label is None else match_move(game, episode.position, label)
        if move is None:
            if label is None:
                step.malformed_moves = 1
                problem = "No move found: write it as <move>MOVE</move>."
            else:
                step.illegal_moves = 1
                problem = f"{label!r} is not a legal move."
            if episode.counters.num_bad_moves + 1 > self.max_illegal_moves:
                return self._finish(state, episode, step, "loss", is_forfeit=True)
            return self._reply(state, episode, step, problem)

        step.legal_moves = 1
        episode.position = game.play(episode.position, move)
        if game.is_over(episode.position):
            return self._finish(state, episode, step, self._outcome(episode))
        reply = episode.opponent(game, episode.position, episode.rng)
        reply_label = game.move_label(episode.position, reply)
        episode.position = game.play(episode.position, reply)
        if game.is_over(episode.position):
            return self._finish(state, episode, step, self._outcome(episode))
        # The compact board shows the opponent's move; the full style also says it.
        note = "" if self.prompt_style == "compact" else f"Your opponent played {reply_label}."
        return self._reply(state, episode, step, note)

    def _reply(
        self, state: EnvState, episode: GameEpisode, step: GameCounters, note: str
    ) -> StepResult:
        _add(episode.counters, step)
        board = board_prompt(
            episode.game, episode.position, episode.model_player, self.prompt_style
        )
        separator = "\n" if self.prompt_style == "compact" else "\n\n"
        text = f"{note}{separator}{board}" if note else board
        message = Message("user", text)
        state.messages.append(message)
        return StepResult(messages=[message], done=False, metrics=_as_metrics(step))

    def _outcome(self, episode: GameEpisode) -> str:
        winner = episode.game.winner(episode.position)
        if winner is None:
            return "draw"
        return "win" if winner == episode.model_player else "loss"

    def _finish(
        self,
        state: EnvState,
        episode: GameEpisode,
        step: GameCounters,
        outcome: str,
        is_forfeit: bool = False,
    ) -> StepResult:
        _add(episode.counters, step)
        episode.outcome = outcome
        state.done = True
        rewards = {
            "outcome": OUTCOME_REWARDS[outcome],
            "legal_moves": float(episode.counters.legal_moves),
        }
        rewards["reward"] = rewards[REWARD_OF_MODE[self.reward_mode]]
        metrics = _as_metrics(step)
        metrics.update({name: float(name == outcome) for name in OUTCOME_REWARDS})
        metrics["forfeit"] = float(is_forfeit)
        return StepResult(messages=[], done=True, rewards=rewards, metrics=metrics)


def _add(total: GameCounters, step: GameCounters) -> None:
    for key, value in asdict(step).items():
        setattr(total, key, getattr(total, key) + value)


def _as_metrics(counters: GameCounters) -> dict[str, float]:
    return {key: float(value) for key, value in asdict(counters).items()}
