"""`[task] name = "reasoning_gym"`: reasoning-gym's procedural datasets as a generated task.

Every task draws a dataset by weight and one of its items by a random index, both from
(task.seed, the task's index); reasoning-gym builds an item from (seed + index) alone, so nothing
is stored or downloaded. The held-out tasks come from their own stream, and a training draw whose
question is a held-out one is drawn again (`ProceduralTasks`). An item is scored by its dataset's
own `score_answer` on the answer `task.extract` takes from the completion, in a worker process
under a timeout, with answers that look like code kept from scorers that run them
(`reasoning_gym_scoring`); a `score_answer` that raises, hangs or kills its worker, and a refused
answer, score 0 and are counted (`reward_errors`), as for any reward. An index the generator
itself fails on is skipped, counted, and replaced by another (`_entry`).
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import sys
import time
from collections import Counter

from reinforge.errors import ConfigError
from reinforge.tasks.procedural import ProceduralTasks
from reinforge.tasks.reasoning_gym_items import SLOW_ITEM_S, ItemsAhead
from reinforge.tasks.reasoning_gym_scoring import (
    code_hazard,
    create_dataset,
    evaluates_code,
    scorer_pool,
)
from reinforge.types import Message, Task

NUM_EARLY_DRAWS = 16  # training draws made at build time: a held-out split that covers a
# dataset's whole problem space fails then, not mid-run
MAX_ITEM_TRIES = 20  # indices drawn for one task before a generator's failures are a ConfigError
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# where a dataset whose items have no single answer (answer None: graph_color, rubiks_cube, ...)
# keeps one valid answer to learn from
_EXAMPLE_KEYS = ("possible_answer", "example_answer", "example_correct_answer")


def gold_answer(entry: dict) -> str | None:
    """The item's answer, or for a dataset with many valid answers (reasoning-gym's answer None)
    the example its metadata keeps, written as the scorer reads it (JSON for a mapping or list);
    None when the item has neither (boxnet, rush_hour: nothing for SFT to train on)."""
    if entry.get("answer") is not None:
        return str(entry["answer"])
    metadata = entry.get("metadata") or {}
    for key in _EXAMPLE_KEYS:
        example = metadata.get(key)
        if example is None:
            continue
        if isinstance(example, dict | list | tuple):
            if isinstance(example, dict):
                example = {str(k): v for k, v in example.items()}
            return json.dumps(example)
        return str(example)
    return None


def extract_answer(completion: str, how: str, pattern: re.Pattern | None = None) -> str | None:
    """The answer `how` (task.extract) takes from `completion`, or None when there is none."""
    if how == "whole":
        return completion.strip() or None
    if how == "last_line":
        lines = [line.strip() for line in completion.splitlines() if line.strip()]
        return lines[-1] if lines else None
    found = _ANSWER_TAG.findall(completion) if how == "answer_tag" else None
    if how == "regex":
        assert pattern is not None
        matches = list(pattern.finditer(completion))
        found = [m.group(1) if m.groups() else m.group(0) for m in matches]
    return found[-1].strip() if found else None


def format_answer(answer: str, how: str) -> str:
    """A gold answer written the way `how` extracts it (the SFT solution)."""
    return f"<answer>{answer}</answer>" if how == "answer_tag" else answer


class ReasoningGymTasks(ProceduralTasks):
    name = "reasoning_gym"

    def __init__(self, cfg):
        self.cfg = cfg
        self.datasets = {
            name: create_dataset(name, dict(cfg.dataset_config.get(name, {})), cfg.seed)
            for name in cfg.datasets
        }
        self.names = list(cfg.datasets)
        self.skipped_items: Counter[str] = Counter()
        self.weights = [cfg.datasets[n] for n in self.names]
        self.pattern = re.compile(cfg.answer_regex) if cfg.answer_regex else None
        # what a scoring worker rebuilds each dataset from (built once there, keyed by this)
        self.settings_json = {
            n: json.dumps(cfg.dataset_config.get(n, {}), sort_keys=True) for n in self.names
        }
        self._ahead: ItemsAhead | None = None
        self._slow = self._slow_datasets()
        if self._slow:  # the held-out items and the early draws, built in workers meanwhile
            self._ahead = ItemsAhead(self.settings_json, cfg.seed)
            self._ahead.submit(
                self._first_draw(f"{cfg.seed}/eval/{i}", f"eval-{i}") for i in range(cfg.num_eval)
            )
            self.prefetch(range(NUM_EARLY_DRAWS))
        try:  # the held-out items and a few training draws: a setting the generator chokes on
            super().__init__(cfg)  # fails here, before any model loads
            for index in range(NUM_EARLY_DRAWS):
                self.train_task(index)
        except (ArithmeticError, LookupError, TypeError, ValueError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(
                f"reasoning-gym could not generate an item of task.datasets={cfg.datasets} with "
                f"task.dataset_config={cfg.dataset_config}: {type(e).__name__}: {e}"
            ) from None

    def _make(self, rng: random.Random, task_id: str) -> Task:
        # the dataset by the task's own draw, so that redrawing a held-out question (a new rng
        # per attempt) keeps the dataset and the weights hold
        pick = random.Random(f"{self.cfg.seed}/{task_id}/dataset")
        name = pick.choices(self.names, self.weights)[0]
        entry = self._entry(name, rng)
        answer = gold_answer(entry)
        messages = (Message("user", self._shown_question(name, entry["question"])),)
        if self.cfg.system_prompt:
            messages = (Message("system", self.cfg.system_prompt), *messages)
        return Task(
            id=task_id,
            messages=messages,
            answer="" if answer is None else answer,  # scored by rules, not against a string
            solution=None if answer is None else format_answer(answer, self.cfg.extract),
            info={"key": f"{name}/{entry['question']}", "data_source": name, "entry": entry},
        )

    def _slow_datasets(self) -> set[str]:
        """The datasets whose generator takes over `SLOW_ITEM_S` for an item (two timed)."""
        slow = set()
        for name, dataset in self.datasets.items():
            start = time.perf_counter()
            for index in (0, 1):  # a failing item is _entry's to count, when a task draws it
                with contextlib.suppress(Exception):
                    dataset[index]
            if (time.perf_counter() - start) / 2 > SLOW_ITEM_S:
                slow.add(name)
        return slow

    def _first_draw(self, rng_seed: str, task_id: str) -> tuple[str, int]:
        """The (dataset, item index) `_make(random.Random(rng_seed), task_id)` asks for first."""
        pick = random.Random(f"{self.cfg.seed}/{task_id}/dataset")
        name = pick.choices(self.names, self.weights)[0]
        return name, random.Random(rng_seed).randrange(self.datasets[name].config.size)

    def prefetch(self, indices) -> None:
        """Start building the items training tasks `indices` will draw first (slow generators
        only; `reasoning_gym_items`): a caller passes the next step's indices with this one's."""
        if self._ahead is None:
            return
        draws = (self._first_draw(f"{self.cfg.seed}/train/{i}/0", f"train-{i}") for i in indices)
        self._ahead.submit(d for d in draws if d[0] in self._slow)

    def _entry(self, name: str, rng: random.Random) -> dict:
        """A random item of dataset `name`. An index the library's generator fails on (maze's
        "Could not find suitable path cell after 1000 attempts" on some 5 x 5 grids) is a
        counted skip, not the run's end: another index is drawn (the first skip of a dataset is
        printed; `skipped_items` counts them for the run's summary). A dataset that fails on
        MAX_ITEM_TRIES indices in a row is a `ConfigError` naming its settings."""
        dataset = self.datasets[name]
        for _ in range(MAX_ITEM_TRIES):
            index = rng.randrange(dataset.config.size)
            ahead = self._ahead.take((name, index)) if self._ahead is not None else None
            if ahead is not None and ahead[0]:
                return ahead[1]
            if ahead is not None:  # the generator raised in the worker
                error = str(ahead[1])
            else:
                try:
                    return dataset[index]
                except (ConfigError, KeyboardInterrupt, MemoryError):
                    raise
                except Exception as e:
                    error = f"{type(e).__name__}: {str(e)[:200]}"
            if not self.skipped_items[name]:
                print(
                    f"warning: reasoning-gym {name} could not generate item {index} "
                    f"({error}); drawing another (skips are counted in the run's summary)",
                    file=sys.stderr,
                )
            self.skipped_items[name] += 1
        raise ConfigError(
            f"reasoning-gym could not generate an item of {name} on {MAX_ITEM_TRIES} indices in "
            f"a row with "
            f"task.dataset_config.{name}={self.cfg.dataset_config.get(name, {})} (last: {error}); "
            f"widen the dataset's settings or drop it from task.datasets"
        )

    def notes(self) -> list[str]:
        """For the run's summary: the items the generators failed on (none: [])."""
        return [
            f"reasoning-gym {name}: {count} item(s) the library could not generate were "
            f"skipped (another index drawn each time)"
            for name, count in self.skipped_items.items()
            if count
        ]

    def _shown_question(self, name: str, question: str) -> str:
        """The question as the model sees it: after task.question_after's marker, if set."""
        marker = self.cfg.question_after.get(name)
        if marker is None:
            return question
        _, found, tail = question.rpartition(marker)
        if not found or not tail.strip():
            raise ConfigError(
                f"task.question_after.{name}={marker!r}: a {name} question "
                f"{'has no text after' if found else 'does not contain'} the marker; it ends "
                f"{question[-160:]!r}. Pick text every question has just before its data"
            )
        return tail.strip()

    def require_solutions(self) -> None:
        """A ConfigError when SFT is asked of a dataset whose items carry no answer to train on
        (its score_answer checks a reply by rules: boxnet, rush_hour)."""
        for name, dataset in self.datasets.items():
            if gold_answer(dataset[0]) is None:
                others = [n for n in self.names if n != name]
                fix = f"drop it from task.datasets (keeping {others})" if others else ""
                raise ConfigError(
                    f"task.datasets: reasoning-gym's {name!r} gives no reference answer to train "
                    f"on, and sft.steps > 0 trains on one; set sft.steps = 0 (RL alone) "
                    f"{'or ' + fix if fix else ''}".rstrip()
                )

    def train_task(self, index: int) -> Task:
        try:
            return super().train_task(index)
        except AssertionError:
            raise ConfigError(
                f"task.num_eval={self.cfg.num_eval} held-out questions cover every question the "
                f"training draws of task {index} found (task.datasets={self.cfg.datasets}); lower "
                f"task.num_eval or widen the datasets' task.dataset_config"
            ) from None

    def reward(self, completion: str, task: Task) -> float:
        """The dataset's own `score_answer` (0 to 1) on the extracted answer; with
        task.partial_credit false, a score under 1 is 0."""
        answer = extract_answer(completion, self.cfg.extract, self.pattern)
        if answer is None:
            return 0.0
        name = task.info["data_source"]
        if evaluates_code(type(self.datasets[name])):
            hazard = code_hazard(answer)
            if hazard:
                raise UnsafeAnswer(
                    f"reasoning-gym {name}: an answer with {hazard} was not scored (its scorer "
                    f"runs answers as code): {answer[:80]!r}"
                )
        item = (name, self.settings_json[name], self.cfg.seed, task.info["entry"], answer)
        [(score, failure)] = scorer_pool().check_batch([item])
        if failure is not None:
            raise RuntimeError(f"reasoning-gym {name} score_answer: {failure}")
        return score if self.cfg.partial_credit or score >= 1.0 else 0.0


class UnsafeAnswer(ValueError):
    """An answer kept from a scorer that would run it as code (scored 0, counted)."""
