import random

import pytest

from reinforge.envs.base import Env
from reinforge.envs.games import (
    CONNECT_FOUR,
    TIC_TAC_TOE,
    GameCase,
    GameCounters,
    GameEnv,
    GameTasks,
    IllegalMove,
    best_moves,
    load_game,
    minimax_opponent,
    parse_move,
    random_opponent,
)
from reinforge.envs.games.env import match_move
from reinforge.errors import ConfigError
from reinforge.types import Message

# --- rules ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rows, winner",
    [
        (["XXX", "OO.", "..."], 0),  # row
        (["XO.", "XO.", "X.."], 0),  # column
        (["XXO", "XO.", "O.."], 1),  # anti-diagonal
        (["X.O", "OX.", "..X"], 0),  # diagonal
        (["XO.", "...", "..."], None),  # still going
    ],
)
def test_tic_tac_toe_winner(rows, winner):
    board = TIC_TAC_TOE.from_rows(rows)
    assert TIC_TAC_TOE.winner(board) == winner
    assert TIC_TAC_TOE.is_over(board) == (winner is not None)


def test_tic_tac_toe_win_by_playing_and_draw():
    g = TIC_TAC_TOE
    board = g.initial_position()
    for cell in (0, 3, 1, 4):
        board = g.play(board, cell)
    assert g.legal_moves(board) == [2, 5, 6, 7, 8] and g.to_move(board) == 0
    board = g.play(board, 2)
    assert g.winner(board) == 0 and g.is_over(board) and g.legal_moves(board) == []

    draw = g.from_rows(["XOX", "XOO", "OXX"])
    assert g.is_over(draw) and g.winner(draw) is None and g.legal_moves(draw) == []


def test_tic_tac_toe_illegal_moves_raise():
    g = TIC_TAC_TOE
    board = g.play(g.initial_position(), 4)
    with pytest.raises(IllegalMove):
        g.play(board, 4)  # taken
    with pytest.raises(IllegalMove):
        g.play(board, 9)  # off the board
    with pytest.raises(IllegalMove):
        g.play(g.from_rows(["XXX", "OO.", "..."]), 8)  # game over


def test_connect_four_gravity_and_wins():
    g = CONNECT_FOUR
    board = g.play(g.play(g.initial_position(), 3), 3)
    assert board.at(5, 3) == 0 and board.at(4, 3) == 1
    assert g.render(board).splitlines()[-3:] == [
        "| . . . O . . . |",
        "| . . . X . . . |",
        "  1 2 3 4 5 6 7",
    ]
    empty = "." * 7
    cases = {
        "row": [empty] * 5 + ["XXXX..."],
        "column": [empty] * 2 + ["X......"] * 4,
        "diagonal": [empty] * 2 + ["...X...", "..XO...", ".XOO...", "XOOO..."],
        "anti-diagonal": [empty] * 2 + ["X......", "OX.....", "OOX....", "OOOX..."],
    }
    for name, rows in cases.items():
        assert g.winner(g.from_rows(rows)) == 0, name
    # Completing the diagonal by a move is detected the same way.
    before = g.from_rows([empty] * 2 + [".......", "..XO...", ".XOO...", "XOOOX.."])
    assert g.winner(g.play(before, 3)) == 0


def test_connect_four_full_column_is_illegal_and_full_board_draws():
    g = CONNECT_FOUR
    board = g.initial_position()
    for _ in range(6):
        board = g.play(board, 0)
    assert 0 not in g.legal_moves(board)
    with pytest.raises(IllegalMove):
        g.play(board, 0)
    rows = ["XXOOXXO", "OOXXOOX"] * 3  # no four in a row anywhere
    full = g.from_rows(rows)
    assert g.is_over(full) and g.winner(full) is None


# --- opponents --------------------------------------------------------------------------------


def _play(game, first, second, rng):
    position = game.initial_position()
    while not game.is_over(position):
        choose = first if game.to_move(position) == 0 else second
        position = game.play(position, choose(game, position, rng))
    return game.winner(position)


def test_minimax_takes_a_win_and_blocks_a_loss():
    g = TIC_TAC_TOE
    assert best_moves(g, g.from_rows(["XX.", "OO.", "..."])) == (2,)  # X to move wins
    assert best_moves(g, g.from_rows(["XX.", "O..", "..."])) == (2,)  # O to move must block
    c = CONNECT_FOUR
    board = c.from_rows(["......."] * 4 + ["X......", "OOO.XX."])  # X must block column 4
    assert c.to_move(board) == 0 and best_moves(c, board, depth=2) == (3,)


def test_tic_tac_toe_minimax_never_loses_to_random():
    rng = random.Random(0)
    minimax = minimax_opponent()
    results = [_play(TIC_TAC_TOE, minimax, random_opponent, rng) for _ in range(15)]
    results += [_play(TIC_TAC_TOE, random_opponent, minimax, rng) for _ in range(15)]
    assert results[:15].count(1) == 0 and results[15:].count(0) == 0
    assert results.count(None) < len(results)  # and it does win


def test_tic_tac_toe_minimax_against_itself_draws():
    rng = random.Random(1)
    minimax = minimax_opponent()
    assert [_play(TIC_TAC_TOE, minimax, minimax, rng) for _ in range(4)] == [None] * 4


def test_connect_four_minimax_beats_random():
    rng = random.Random(2)
    minimax = minimax_opponent(depth=3)
    first = [_play(CONNECT_FOUR, minimax, random_opponent, rng) for _ in range(5)]
    second = [_play(CONNECT_FOUR, random_opponent, minimax, rng) for _ in range(5)]
    assert first == [0] * 5 and second == [1] * 5


def test_unknown_game_and_bad_opponent_settings_name_the_fix():
    with pytest.raises(ConfigError, match="tic_tac_toe"):
        load_game("chess")
    with pytest.raises(ConfigError, match="depth"):
        minimax_opponent(0)
    with pytest.raises(ConfigError, match="mcts"):
        GameTasks([GameCase("tic_tac_toe", "mcts")])
    with pytest.raises(ConfigError, match="minimax"):
        GameTasks([GameCase("tic_tac_toe", "alphazero")])


# --- move parsing -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, label",
    [
        ("<move>5</move>", "5"),
        ("I take the centre. <move> 5 </move>", "5"),
        ("<move>1</move> no wait <move>9</move>", "9"),
        ("7", "7"),
        (" 7.\n", "7"),
        ("<move>x(1,1)</move>", "x(1,1)"),
        ("<move></move>", None),
        ("<move>5", None),
        ("I play 5", None),
        ("", None),
        ("x" * 40, None),
    ],
)
def test_parse_move(text, label):
    assert parse_move(text) == label


def test_match_move_ignores_case_and_spaces_and_rejects_illegal():
    g = TIC_TAC_TOE
    board = g.play(g.initial_position(), 4)
    assert match_move(g, board, " 1 ") == 0
    assert match_move(g, board, "5") is None  # taken
    assert match_move(g, board, "10") is None


# --- env episodes -----------------------------------------------------------------------------


def _ttt_task(opponent="random", model_player=0, depth=None):
    tasks = GameTasks([GameCase("tic_tac_toe", opponent, depth, model_player)], seed=3)
    return tasks.train_task(0)


def test_scripted_episode_messages_counters_and_reward():
    env: Env = GameEnv()
    task = _ttt_task()
    state = env.reset(task)
    assert state.messages == list(task.messages)
    assert "Legal moves: 1, 2, 3, 4, 5, 6, 7, 8, 9" in task.messages[0].content
    episode = state.info["game"]
    # A scripted policy: complete a line when it can, else take the first free cell.
    result = None
    while not state.done:
        moves = TIC_TAC_TOE.legal_moves(episode.position)
        winning = [m for m in moves if TIC_TAC_TOE.winner(TIC_TAC_TOE.play(episode.position, m))]
        move = (winning or moves)[0]
        result = env.step(state, Message("assistant", f"<move>{move + 1}</move>"))
        if not result.done:
            assert result.messages[0].role == "user"
            assert result.messages[0].content.startswith("Your opponent played")
    assert result is not None and episode.outcome in ("win", "draw", "loss")
    outcome = {"win": 1.0, "draw": 0.5, "loss": 0.0}[episode.outcome]
    legal = float(state.turn)
    assert result.rewards == {"reward": outcome, "outcome": outcome, "legal_moves": legal}
    assert result.metrics[episode.outcome] == 1.0
    assert episode.counters.illegal_moves == 0 and episode.counters.legal_moves == state.turn


def test_episode_win_and_loss_outcomes_are_rewarded():
    env = GameEnv()
    outcomes = []
    for seed in range(12):
        task = GameTasks([GameCase("tic_tac_toe", "random", model_player=0)], seed=seed)
        state = env.reset(task.train_task(0))
        result = None
        while not state.done:  # always the lowest free cell: wins some, loses some
            move = TIC_TAC_TOE.legal_moves(state.info["game"].position)[0]
            result = env.step(state, Message("assistant", str(move + 1)))
        outcomes.append((state.info["game"].outcome, result.rewards["reward"]))
    assert ("win", 1.0) in outcomes and ("loss", 0.0) in outcomes
    assert all(reward == {"win": 1.0, "draw": 0.5, "loss": 0.0}[o] for o, reward in outcomes)


def test_minimax_opponent_beats_a_bad_policy():
    env = GameEnv()
    state = env.reset(_ttt_task("minimax", model_player=1))
    assert state.info["game"].position.num_moves == 1  # the opponent opened
    result = None
    while not state.done:
        move = TIC_TAC_TOE.legal_moves(state.info["game"].position)[-1]
        result = env.step(state, Message("assistant", f"<move>{move + 1}</move>"))
    assert state.info["game"].outcome == "loss" and result.rewards["reward"] == 0.0
    assert result.metrics["loss"] == 1.0 and result.metrics["forfeit"] == 0.0


def test_illegal_move_forfeits_in_outcome_mode():
    env = GameEnv()
    state = env.reset(_ttt_task())
    first = env.step(state, Message("assistant", "<move>5</move>"))
    assert not first.done
    taken = env.step(state, Message("assistant", "<move>5</move>"))
    assert taken.done and taken.rewards == {"reward": 0.0, "outcome": 0.0, "legal_moves": 1.0}
    assert taken.metrics["illegal_moves"] == 1.0 and taken.metrics["forfeit"] == 1.0
    assert state.info["game"].counters == GameCounters(turns=2, legal_moves=1, illegal_moves=1)


def test_legality_mode_counts_legal_moves_and_retries_within_the_allowance():
    env = GameEnv(reward_mode="legality", max_illegal_moves=1)
    state = env.reset(_ttt_task())
    assert not env.step(state, Message("assistant", "<move>5</move>")).done
    retry = env.step(state, Message("assistant", "the centre, please"))
    assert not retry.done and retry.metrics["malformed_moves"] == 1.0
    assert retry.messages[0].content.startswith("No move found")
    assert "Legal moves:" in retry.messages[0].content
    end = env.step(state, Message("assistant", "<move>42</move>"))
    # one legal move made; the forfeit's outcome is reported too, as a component
    assert end.done and end.rewards == {"reward": 1.0, "outcome": 0.0, "legal_moves": 1.0}
    assert state.info["game"].counters == GameCounters(
        turns=3, legal_moves=1, illegal_moves=1, malformed_moves=1
    )


def test_env_settings_are_checked():
    with pytest.raises(ConfigError, match="reward_mode"):
        GameEnv(reward_mode="elo")
    with pytest.raises(ConfigError, match="max_illegal_moves"):
        GameEnv(max_illegal_moves=-1)


# --- task source ------------------------------------------------------------------------------


def test_tasks_are_deterministic_varied_and_held_out_by_seed():
    cases = [
        GameCase("tic_tac_toe", "random", num_random_plies=2),
        GameCase("connect_four", "minimax", opponent_depth=2, num_random_plies=3),
    ]
    tasks = GameTasks(cases, seed=7, num_eval_per_case=4)
    again = GameTasks(cases, seed=7, num_eval_per_case=4)
    assert [tasks.train_task(i) for i in range(6)] == [again.train_task(i) for i in range(6)]
    assert [t.info["case"] for t in (tasks.train_task(i) for i in range(4))] == [0, 1, 0, 1]
    openings = {tuple(tasks.train_task(i).info["moves"]) for i in range(0, 40, 2)}
    assert len(openings) > 5
    evals = tasks.eval_tasks()
    assert len(evals) == 8
    train_seeds = {tasks.train_task(i).info["seed"] for i in range(100)}
    assert not train_seeds & {t.info["seed"] for t in evals}
    env = GameEnv()
    for task in [*evals, tasks.train_task(5)]:
        state = env.reset(task)
        position = state.info["game"].position
        assert state.info["game"].game.to_move(position) == task.info["model_player"]


def test_single_turn_reward_is_first_move_legality():
    tasks = GameTasks([GameCase("connect_four", model_player=0)])
    task = tasks.train_task(0)
    assert tasks.reward("<move>4</move>", task) == 1.0
    assert tasks.reward("<move>8</move>", task) == 0.0
    assert tasks.reward("four", task) == 0.0


def test_compact_prompts_draw_one_character_per_cell():
    tasks = GameTasks([GameCase("tic_tac_toe", "random", model_player=0)], prompt_style="compact")
    env = GameEnv(prompt_style="compact")
    state = env.reset(tasks.train_task(0))
    assert state.messages[0].content == (
        "tic-tac-toe, you play X.\nMoves: 1 2 3 4 5 6 7 8 9\n123\n456\n789"
    )
    reply = env.step(state, Message("assistant", "5")).messages[0].content
    assert reply.count("\n") == 3 and "X" in reply.splitlines()[2] and "O" in reply
    assert not reply.startswith("Your opponent")  # the board shows the opponent's move


def test_best_move_demonstrations_never_lose_to_a_random_opponent():
    tasks = GameTasks(
        [GameCase("tic_tac_toe", "random")], prompt_style="compact", demo_best_move_fraction=1.0
    )
    env = GameEnv(prompt_style="compact")
    outcomes = []
    for i in range(20):
        state = env.reset(tasks.train_task(i))
        while not state.done:
            env.step(state, Message("assistant", tasks.demonstration(state)))
        outcomes.append(state.info["game"].outcome)
    assert "loss" not in outcomes and outcomes.count("win") >= 15, outcomes
