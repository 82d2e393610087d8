"""reasoning-gym datasets as reinforge tasks, the way a user brings their own: a Python generator
per dataset for `[task] name = "dataset"` (`task.path = "bench/learning_tasks.py:chain_sum"`) and
one reward by path (`task.reward = "bench/learning_tasks.py:score"`) that calls the library's own
`score_answer`. reasoning-gym generates every item procedurally from (seed, index): nothing is
downloaded.

Each dataset's settings keep answers short (a number or a word) and the questions within reach
of a small model after SFT on the gold answers; the first six are the learning suite's default
(bench/learning.py). A row carries its reasoning-gym index, so the reward rebuilds the exact
item (metadata included) that the library scores against.
"""

from __future__ import annotations

import functools

NUM_ROWS = 10_000  # per dataset: 500 SFT steps x 64 examples see each about three times

DATASETS: dict[str, dict] = {
    "basic_arithmetic": dict(max_terms=3, max_digits=2, operators=("+", "-", "*")),
    "chain_sum": dict(max_terms=4, max_digits=2),
    "leg_counting": dict(min_animals=1, max_animals=3, max_instances=5),
    "letter_counting": dict(min_words=3, max_words=6),
    "spell_backward": dict(min_word_len=3, max_word_len=6),
    "gcd": dict(max_value=100),
    "simple_equations": dict(max_terms=3, max_value=20),
    "word_sequence_reversal": dict(min_words=2, max_words=4),
}
DEFAULT_SUITE = list(DATASETS)[:6]

# Other settings of the same reasoning-gym datasets, under names of their own (the suite's
# `--datasets` takes them; a run's task is the reasoning-gym dataset named first). Arithmetic
# within one step of a 25M-parameter model answering at once, and short transform tasks (copy,
# reverse, shift) whose skill is one rule for every question.
VARIANTS: dict[str, tuple[str, dict]] = {
    "chain_sum_2x2": ("chain_sum", dict(min_terms=2, max_terms=2, max_digits=2)),
    "basic_arithmetic_1d": (
        "basic_arithmetic",
        dict(
            max_terms=2,
            max_digits=1,
            operators=("+", "-", "*"),
            allow_parentheses=False,
            allow_negation=False,
        ),
    ),
    "leg_counting_small": ("leg_counting", dict(min_animals=1, max_animals=2, max_instances=3)),
    "simple_equations_small": (
        "simple_equations",
        dict(max_terms=2, max_value=10, operators=("+", "-"), operators_weights=[0.5, 0.5]),
    ),
    "caesar_two_words": ("caesar_cipher", dict(min_words=2, max_words=2, max_rotation=3)),
    "base_conversion_small": ("base_conversion", dict(max_base=10, max_value=64)),
    "count_bits_byte": ("count_bits", dict(max_n=255)),
    # Many right answers, checked by rule (the gold is one of them): a sum or product of two
    # digits written either way round; a 2-colouring-or-more of a small graph (the gold is the
    # metadata's greedy colouring); a palindrome of 3-5 given letters.
    "countdown_pair": (
        "countdown",
        dict(min_numbers=2, max_numbers=2, min_value=1, max_value=9, min_target=1, max_target=81),
    ),
    "graph_color_small": (
        "graph_color",
        dict(min_num_vertices=4, max_num_vertices=5, num_colors=3, edge_probability=0.3),
    ),
    "palindrome_small": ("palindrome_generation", dict(min_length=3, max_length=5)),
    # any shortest path counts (the scorer walks it); queens on a 5 x 5 board with 1-3 given
    "shortest_path_small": (
        "shortest_path",
        dict(min_rows=3, max_rows=4, min_cols=3, max_cols=4),
    ),
    "n_queens_5": ("n_queens", dict(n=5, min_remove=1, max_remove=3)),
    # session 15: fewer blocked cells (the library's 0.4 made 22% of small grids "infeasible",
    # the answer RL collapsed onto in s14c); a 4 x 4 kakurasu (any grid meeting the sums);
    # the shortest button sequence of a one-step lock (the scorer replays it); a path in a small
    # star graph (unique, but found only by reading the edges)
    "shortest_path_open": (
        "shortest_path",
        dict(min_rows=3, max_rows=4, min_cols=3, max_cols=4, p_blocked=0.2),
    ),
    "kakurasu_4": ("kakurasu", dict(min_rows=4, max_rows=4, min_cols=4, max_cols=4)),
    "quantum_lock_easy": ("quantum_lock", dict(difficulty=1)),
    "path_star_small": ("path_star", dict(min_path_length=2, max_path_length=3, node_range=100)),
    # grids and lists a small model transforms after SFT, scored exactly (strict)
    # session 16: queens on an 8 x 8 board with 4-6 to place (any placement consistent with the
    # given queens scores 1; ~2 per board), the board alone shown
    "n_queens_8": ("n_queens", dict(n=8, min_remove=4, max_remove=6)),
    "mini_sudoku_easy": ("mini_sudoku", dict(min_empty=4, max_empty=8)),
    # session 16: one box on a 6 x 6 board (any move string that solves it scores 1: the scorer
    # plays it); a 4 x 4 futoshiki (a unique grid, like mini_sudoku)
    "sokoban_6": ("sokoban", dict(min_w=6, max_w=6, min_h=6, max_h=6, min_boxes=1, max_boxes=1)),
    "futoshiki_4": ("futoshiki", dict(min_board_size=4, max_board_size=4)),
    # session 16: a 3-letter word ladder of 3-4 words (any ladder of dictionary words scores)
    "word_ladder_3": (
        "word_ladder",
        dict(min_word_length=3, max_word_length=3, min_chain_length=3, max_chain_length=4),
    ),
    # session 16: the numbers alone to sort; a 3-4 x 3-4 matrix read in spiral order
    "number_sorting_small": (
        "number_sorting",
        dict(
            min_numbers=3, max_numbers=4, min_decimals=0, max_decimals=0, min_value=0, max_value=99
        ),
    ),
    "spiral_matrix_small": ("spiral_matrix", dict(min_n=3, max_n=4)),
    "rotate_matrix_small": ("rotate_matrix", dict(min_n=2, max_n=3, max_rotations=3)),
    # session 17: more reading tasks with a checked answer: the steps through a 5-6 cell maze (a
    # number), the largest island of a 4-5 x 4-5 grid (a number), any expression making 24 of four
    # numbers (the scorer evaluates it: answers pass the code screen of tasks.reasoning_gym_scoring)
    "maze_small": ("maze", dict(min_grid_size=5, max_grid_size=6, min_dist=2, max_dist=6)),
    "largest_island_small": (
        "largest_island",
        dict(min_rows=4, max_rows=5, min_cols=4, max_cols=5, max_num_islands=3, max_island_size=6),
    ),
    "puzzle24": ("puzzle24", dict()),
    "word_sorting_small": (
        "word_sorting",
        dict(min_words=3, max_words=4, min_word_length=3, max_word_length=6),
    ),
}
# Run settings a dataset needs beyond the config's (a JSON colouring of 5 vertices is ~40 tokens)
RUN_SETTINGS: dict[str, list[str]] = {
    "graph_color_small": ["rollout.max_new_tokens=56"],
    "shortest_path_small": ["rollout.max_new_tokens=32"],
    "shortest_path_open": [
        "rollout.max_new_tokens=40",
        'task.question_after={shortest_path = "in the following grid:"}',
    ],
    "kakurasu_4": ["rollout.max_new_tokens=40"],
    "quantum_lock_easy": [
        "rollout.max_new_tokens=40",
        'task.question_after={quantum_lock = "for example: A → B → C"}',
    ],
    "path_star_small": [
        "rollout.max_new_tokens=16",
        'task.question_after={path_star = "Solve the following task:"}',
    ],
    "n_queens_5": ["rollout.max_new_tokens=56"],
    "n_queens_8": [
        "rollout.max_new_tokens=136",
        'task.question_after={n_queens = "no two queens attack each other."}',
    ],
    "mini_sudoku_easy": [
        "rollout.max_new_tokens=40",
        'task.question_after={mini_sudoku = "Solve this 4x4 Mini Sudoku puzzle:"}',
    ],
    "rotate_matrix_small": ["rollout.max_new_tokens=24"],
    "word_ladder_3": ["rollout.max_new_tokens=24"],
    "sokoban_6": [
        "rollout.max_new_tokens=16",
        'task.question_after={sokoban = "Here is your puzzle:"}',
    ],
    "futoshiki_4": [
        "rollout.max_new_tokens=120",
        'task.question_after={futoshiki = "Futoshiki puzzle:"}',
    ],
    "number_sorting_small": [
        "rollout.max_new_tokens=40",
        'task.question_after={number_sorting = "Sort these numbers in"}',
    ],
    "spiral_matrix_small": [
        "rollout.max_new_tokens=48",
        'task.question_after={spiral_matrix = "what is the list of elements in spiral order?"}',
    ],
    "word_sorting_small": ["rollout.max_new_tokens=40"],
    "maze_small": ["rollout.max_new_tokens=8"],
    "largest_island_small": ["rollout.max_new_tokens=8"],
    "puzzle24": ["rollout.max_new_tokens=32"],
}


def resolve(name: str) -> tuple[str, dict]:
    """A suite dataset name as (reasoning-gym dataset, its settings)."""
    return VARIANTS.get(name) or (name, DATASETS[name])


@functools.cache
def dataset(name: str, seed: int):
    import reasoning_gym

    return reasoning_gym.create_dataset(name, size=NUM_ROWS, seed=seed, **DATASETS[name])


def rows(name: str, seed: int) -> list[dict]:
    """The dataset's items as prompt/answer/solution rows (SFT trains on the gold answer)."""
    ds = dataset(name, seed)
    return [
        {
            "prompt": item["question"],
            "answer": str(item["answer"]),
            "solution": str(item["answer"]),
            "data_source": name,
            "rg_index": i,
            "rg_seed": seed,
        }
        for i, item in enumerate(ds)
    ]


def score(completion: str, task) -> float:
    """reasoning-gym's own `score_answer` on the item the task came from, in [0, 1]."""
    info = task.info
    ds = dataset(info["data_source"], int(info["rg_seed"]))
    return float(ds.score_answer(completion.strip(), ds[int(info["rg_index"])]))


# One generator per dataset (`task.path` names a function; it receives task.seed).
def basic_arithmetic(seed: int) -> list[dict]:
    return rows("basic_arithmetic", seed)


def chain_sum(seed: int) -> list[dict]:
    return rows("chain_sum", seed)


def leg_counting(seed: int) -> list[dict]:
    return rows("leg_counting", seed)


def letter_counting(seed: int) -> list[dict]:
    return rows("letter_counting", seed)


def spell_backward(seed: int) -> list[dict]:
    return rows("spell_backward", seed)


def gcd(seed: int) -> list[dict]:
    return rows("gcd", seed)


def simple_equations(seed: int) -> list[dict]:
    return rows("simple_equations", seed)


def word_sequence_reversal(seed: int) -> list[dict]:
    return rows("word_sequence_reversal", seed)
