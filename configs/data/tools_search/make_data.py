"""Writes docs.jsonl and qa.jsonl beside this file: a lookup table of 800 parts and the bins they
are kept in (one of eight colours, drawn at random: no model can know them), one document per
part (title "part 117", text "bin green"), and questions "Bin of part 117?" whose training rows
carry a recorded conversation (OpenAI format) for the SFT stage.

A share of the training conversations (`--search-fraction`) call `search` with the part number
and answer with the bin the result names; the rest answer at once, from memory. Held-out rows
(extra_info.split = "test") ask about parts no training row mentions: only a search answers
them (a guess is right one time in eight).

The format is chosen for the tiny model's byte-level tokenizer: the part number is the only run
of digits in the question, and the search result is short ("1. [p117] part 117: bin green"),
its answer a word of its own. With bins of digits or of capital letters the SFT model did not
learn to read the bin out of the result within CPU minutes; with colours it does
(bench/results/2026-11-26-cpu-tools-examples-s13.md).

    python configs/data/tools_search/make_data.py
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from reinforge.envs.search_env import BM25Backend, Document, search_tools

HERE = Path(__file__).parent
BINS = ("red", "blue", "green", "black", "white", "gray", "pink", "brown")
QUESTIONS = (
    "Bin of part {}?",
    "Which bin is part {} in?",
    "Part {}: which bin?",
    "In which bin do we keep part {} now?",
    "Where is part {} kept? Name the bin.",
    "I need part {}. Which bin?",
)


def main(
    num_parts: int,
    digits: int,
    marker: str,
    distinct: bool,
    letters: int,
    num_questions: int,
    echo: bool,
    num_eval: int,
    search_fraction: float,
    seed: int,
    out: Path,
) -> None:
    rng = random.Random(seed)
    numbers = [str(n) for n in range(10 ** (digits - 1), 10**digits)]
    if distinct:
        numbers = [n for n in numbers if len(set(n)) == len(n)]
    parts = rng.sample(numbers, num_parts)
    if letters:
        alphabet = "abcdefghijklmnopqrstuvwxyz"
        parts = ["".join(rng.choices(alphabet, k=letters)) + " " + p for p in parts]
    bins = {p: rng.choice(BINS) for p in parts}
    docs = [Document(f"p{i}", f"part {p}", f"bin {bins[p]}") for i, p in enumerate(parts)]
    search = search_tools(BM25Backend(docs))[0]
    rows = []
    for i, part in enumerate(parts):
        split = "test" if i < num_eval else "train"
        messages = [
            {"role": "user", "content": rng.choice(QUESTIONS[:num_questions]).format(marker + part)}
        ]
        if split == "train":
            if rng.random() < search_fraction:
                arguments = {"query": marker + part, "k": 1}
                call = {"name": "search", "arguments": json.dumps(arguments)}
                messages += [
                    {
                        "role": "assistant",
                        "content": marker + part if echo else None,
                        "tool_calls": [{"id": f"call_{i}", "type": "function", "function": call}],
                    },
                    {"role": "tool", "tool_call_id": f"call_{i}", "content": search(**arguments)},
                ]
            messages.append({"role": "assistant", "content": bins[part]})
        rows.append({"messages": messages, "answer": bins[part], "extra_info": {"split": split}})
    out.mkdir(parents=True, exist_ok=True)
    (out / "docs.jsonl").write_text(
        "".join(json.dumps({"id": d.doc_id, "title": d.title, "text": d.text}) + "\n" for d in docs)
    )
    (out / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-parts", type=int, default=800)
    parser.add_argument("--digits", type=int, default=3)
    parser.add_argument("--marker", default="")
    parser.add_argument("--distinct", action="store_true")
    parser.add_argument("--letters", type=int, default=0)
    parser.add_argument("--num-questions", type=int, default=1)
    parser.add_argument("--echo", action="store_true")
    parser.add_argument("--num-eval", type=int, default=64)
    parser.add_argument("--search-fraction", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=HERE)
    a = parser.parse_args()
    main(
        a.num_parts,
        a.digits,
        a.marker,
        a.distinct,
        a.letters,
        a.num_questions,
        a.echo,
        a.num_eval,
        a.search_fraction,
        a.seed,
        a.out,
    )
