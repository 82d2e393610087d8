"""Writes docs.jsonl and qa.jsonl beside this file: a lookup table of 160 parts and their bin
numbers (random: no model can know them), one document per part ("Part 117 is kept in bin 58."),
and questions "Bin of part 117?" whose training rows carry a recorded conversation (OpenAI
format) for the SFT stage.

A share of the training conversations (`--search-fraction`) call `search` with the part number
and answer with the bin the result names; the rest answer at once, from memory (right only for
parts seen in training). Held-out rows (extra_info.split = "test") ask about parts no training
row mentions: only a search answers them. Numbers keep the copying short for the tiny model's
byte-level tokenizer (a name of six letters is six tokens to copy, twice).

    python configs/data/tools_search/make_data.py
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from reinforge.envs.search_env import BM25Backend, Document, search_tools

HERE = Path(__file__).parent


def main(num_parts: int, num_eval: int, search_fraction: float, seed: int) -> None:
    rng = random.Random(seed)
    parts = rng.sample(range(100, 1000), num_parts)
    bins = {part: rng.randrange(10, 100) for part in parts}
    docs = [Document(f"p{p}", f"Part {p}", f"Part {p} is kept in bin {bins[p]}.") for p in parts]
    search = search_tools(BM25Backend(docs))[0]
    rows = []
    for i, part in enumerate(parts):
        split = "test" if i < num_eval else "train"
        messages = [{"role": "user", "content": f"Bin of part {part}?"}]
        if split == "train":
            if rng.random() < search_fraction:
                arguments = {"query": str(part), "k": 1}
                call = {"name": "search", "arguments": json.dumps(arguments)}
                messages += [
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [{"id": f"call_{i}", "type": "function", "function": call}],
                    },
                    {"role": "tool", "tool_call_id": f"call_{i}", "content": search(**arguments)},
                ]
            messages.append({"role": "assistant", "content": str(bins[part])})
        rows.append(
            {"messages": messages, "answer": str(bins[part]), "extra_info": {"split": split}}
        )
    (HERE / "docs.jsonl").write_text(
        "".join(json.dumps({"id": d.doc_id, "title": d.title, "text": d.text}) + "\n" for d in docs)
    )
    (HERE / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-parts", type=int, default=160)
    parser.add_argument("--num-eval", type=int, default=32)
    parser.add_argument("--search-fraction", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    a = parser.parse_args()
    main(a.num_parts, a.num_eval, a.search_fraction, a.seed)
