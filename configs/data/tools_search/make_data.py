"""Writes docs.jsonl and qa.jsonl beside this file: a lookup table of 4,064 parts and the bins they
are kept in (one of eight colours, drawn at random: no model can know them), one document per
part (title "part kqzv 2731", text "bin green"), and questions "Bin of part kqzv 2731?" whose
training rows carry a recorded conversation (OpenAI format) for the SFT stage.

Every training conversation (`--search-fraction`, 1.0 by default) calls
search(query="kqzv 2731", k=1) and answers with the bin the result names; the rest, if any,
answer at once, from memory. Held-out rows (extra_info.split = "test") ask about parts no
training row mentions: only a search answers them (a guess is right one time in eight).

The form is chosen for what the tiny model (byte-level tokenizer, 4 layers) can learn within CPU
minutes (bench/results/2026-11-26-cpu-tools-examples-s16.md):
- the hard part is copying the part code from the question into the query, about 70 tokens
  further on (past the Hermes call's fixed `<tool_call>\n{"name": "search", "arguments":
  {"query": "`); reading the bin out of the result, a few tokens back, is easy with colours;
- every training row is a different part (4,000 of them), so no part can be memorised, and every
  one searches, so every row has a query to copy;
- a code of two halves, 4 random letters and 4 digits, each a search term of its own: the
  search finds the part when either half is copied right, and the letters give the copy more
  to learn from per row than digits alone.

    python configs/data/tools_search/make_data.py
"""

from __future__ import annotations

import argparse
import json
import random
import string
from pathlib import Path

from reinforge.envs.search_env import BM25Backend, Document, search_tools

HERE = Path(__file__).parent
BINS = ("red", "blue", "green", "black", "white", "gray", "pink", "brown")


def part_codes(rng: random.Random, num_parts: int) -> list[str]:
    """`num_parts` codes "kqzv 2731": distinct numbers, each with 4 random letters."""
    numbers = rng.sample(range(1000, 10000), num_parts)
    return ["".join(rng.choices(string.ascii_lowercase, k=4)) + f" {n}" for n in numbers]


def main(num_parts: int, num_eval: int, search_fraction: float, seed: int, out: Path) -> None:
    rng = random.Random(seed)
    parts = part_codes(rng, num_parts)
    bins = {p: rng.choice(BINS) for p in parts}
    docs = [Document(f"p{i}", f"part {p}", f"bin {bins[p]}") for i, p in enumerate(parts)]
    search = search_tools(BM25Backend(docs))[0]
    rows = []
    for i, part in enumerate(parts):
        split = "test" if i < num_eval else "train"
        messages = [{"role": "user", "content": f"Bin of part {part}?"}]
        if split == "train":
            if rng.random() < search_fraction:
                arguments = {"query": part, "k": 1}
                call = {"name": "search", "arguments": json.dumps(arguments)}
                messages += [
                    {
                        "role": "assistant",
                        "content": None,
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
    parser.add_argument("--num-parts", type=int, default=4064)
    parser.add_argument("--num-eval", type=int, default=64)
    parser.add_argument("--search-fraction", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=HERE, help="folder to write (default: here)")
    a = parser.parse_args()
    main(a.num_parts, a.num_eval, a.search_fraction, a.seed, a.out)
