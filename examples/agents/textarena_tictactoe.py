"""TicTacToe from textarena against a scripted opponent, written only against the `openai`
client: the model plays one side, `opponent` the other, and textarena keeps the board and the
rules. Nothing in it knows about reinforge; `[task] name = "agent"` trains it
(`agent = "examples/agents/textarena_tictactoe.py:run"`, rows from `rows`).

A malformed or illegal move is the game's to judge: textarena asks the player to move again once,
and a second bad move in a row loses the game (its error allowance). The reward is two named
components: `outcome` (1 a win, 0.5 a draw, 0 a loss) and `legal_moves` (the share of the
model's moves the game accepted), so a model that cannot play yet still learns the move format.

Play one game against any OpenAI-compatible server (`reinforge serve MODEL`, vLLM, OpenAI):

    python examples/agents/textarena_tictactoe.py http://127.0.0.1:8000/v1 MODEL
"""

from __future__ import annotations

import random
import re
import sys
from types import SimpleNamespace

import textarena as ta
from openai import OpenAI

GAME = "TicTacToe-v0"
SYSTEM = "You play tic-tac-toe as '{symbol}'. Reply with the number of a free cell in brackets, e.g. [4]."
_MOVES = re.compile(r"'(\[\d+\])'")
_SYMBOL = re.compile(r"you will be '(\w)'")


def run(agent, opponent: str = "random", history: str = "board", max_tokens: int = 8) -> dict:
    """One game. `agent.info` may set `game_seed` and `model_player` (0 moves first); by default
    they come from the sample's index. `opponent`: "random" (a uniformly drawn free cell) or
    "first" (the lowest free cell). `history`: "board" (each turn, a fresh request showing the
    current board) or "full" (one growing conversation of textarena's observations)."""
    seed = int(agent.info.get("game_seed", agent.sample_index))
    model_player = int(agent.info.get("model_player", agent.sample_index % 2))
    env = ta.make(GAME)
    env.reset(num_players=2, seed=seed)
    rng = random.Random(seed)
    messages: list[dict] = []
    moves = accepted = 0
    done = False
    while not done:
        player, observation = env.get_observation()
        if player != model_player:
            done, _ = env.step(opponent_move(observation, opponent, rng))
            continue
        if not messages:
            symbol = _SYMBOL.search(observation)
            text = SYSTEM.format(symbol=symbol.group(1) if symbol else "?")
            messages.append({"role": "system", "content": text})
        if history == "full":
            messages.append({"role": "user", "content": observation})
            request = messages
        else:
            request = [messages[0], {"role": "user", "content": board_view(observation)}]
        response = agent.client.chat.completions.create(
            model=agent.model, messages=request, max_tokens=max_tokens
        )
        move = response.choices[0].message.content or ""
        if history == "full":
            messages.append({"role": "assistant", "content": move})
        done, _ = env.step(move)
        moves += 1
        accepted += not refused(env, model_player, done)
    rewards, _ = env.close()
    outcome = {1: 1.0, 0: 0.5, -1: 0.0}[int(rewards[model_player])]
    legal = accepted / moves if moves else 0.0
    return {"reward": outcome, "outcome": outcome, "legal_moves": legal}  # "reward": the verdict


def opponent_move(observation: str, kind: str, rng: random.Random) -> str:
    """The scripted opponent's move among the free cells the observation lists."""
    free = free_cells(observation)
    assert free, f"no free cell listed in the opponent's observation: {observation[-200:]!r}"
    return rng.choice(free) if kind == "random" else min(free, key=lambda m: int(m[1:-1]))


def free_cells(observation: str) -> list[str]:
    """The moves of the last "Available Moves" line, e.g. ["[0]", "[4]"]."""
    lines = [line for line in observation.splitlines() if line.startswith("Available Moves")]
    return _MOVES.findall(lines[-1]) if lines else []


def board_view(observation: str) -> str:
    """The current board and the free cells, and the game's complaint when the last move was
    refused: what a turn needs, in a few lines."""
    board = observation[observation.rfind("Current Board:") :]
    complaint = [line for line in observation.splitlines() if "invalid move" in line]
    return "\n".join([*complaint[-1:], board.strip()])


def refused(env, player: int, done: bool) -> bool:
    """Whether the game refused the player's last move (textarena's own verdict): the game goes
    on with an error counted against the player, or it ended on the player's invalid move."""
    state = env.state
    return bool(state.game_info[player]["invalid_move"] if done else state.error_count > 0)


def rows(seed: int) -> list[dict]:
    """Rows for `[task] name = "agent"`: a game seed each, the model playing either side."""
    return [
        {"prompt": f"tic-tac-toe game {i}", "game_seed": seed * 100_000 + i, "model_player": i % 2}
        for i in range(2000)
    ]


if __name__ == "__main__":
    base_url, model = sys.argv[1], sys.argv[2]
    client = OpenAI(base_url=base_url, api_key="none")
    game = SimpleNamespace(client=client, model=model, info={}, sample_index=0)
    print(run(game))
