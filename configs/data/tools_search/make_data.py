"""Writes docs.jsonl and qa.jsonl beside this file: fictional countries and their capitals (no
model can know them), one document each, and questions "What is the capital of X?" whose
training rows carry a recorded conversation (OpenAI format) for the SFT stage.

A share of the training conversations (`--search-fraction`) call `search` and answer with the
capital the result names; the rest answer at once with a capital of the model's memory, right
only for countries seen in training. Held-out rows (extra_info.split = "test") ask about
countries no training row mentions: only a search answers them.

    python configs/data/tools_search/make_data.py
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from reinforge.envs.search_env import BM25Backend, Document, search_tools

HERE = Path(__file__).parent
SYLLABLES = ["ka", "lo", "mi", "ra", "te", "vu", "zo", "ne", "pa", "si", "do", "fe", "gu", "ri"]


def word(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(n)).capitalize()


def main(num_countries: int, num_eval: int, search_fraction: float, seed: int) -> None:
    rng = random.Random(seed)
    countries: dict[str, str] = {}
    while len(countries) < num_countries:
        capital = word(rng, 3)
        if capital not in countries.values():
            countries.setdefault(word(rng, 3), capital)
    docs = [
        Document(f"c{i}", name, f"The capital of {name} is {capital}.")
        for i, (name, capital) in enumerate(countries.items())
    ]
    search = search_tools(BM25Backend(docs))[0]
    rows = []
    for i, (name, capital) in enumerate(countries.items()):
        split = "test" if i < num_eval else "train"
        messages = [{"role": "user", "content": f"Capital of {name}?"}]
        if split == "train":
            if rng.random() < search_fraction:
                arguments = {"query": name, "k": 1}
                messages += [
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {
                                "id": f"call_{i}",
                                "type": "function",
                                "function": {"name": "search", "arguments": json.dumps(arguments)},
                            }
                        ],
                    },
                    {"role": "tool", "tool_call_id": f"call_{i}", "content": search(**arguments)},
                ]
            messages.append({"role": "assistant", "content": capital})
        rows.append({"messages": messages, "answer": capital, "extra_info": {"split": split}})
    (HERE / "docs.jsonl").write_text(
        "".join(json.dumps({"id": d.doc_id, "title": d.title, "text": d.text}) + "\n" for d in docs)
    )
    (HERE / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-countries", type=int, default=160)
    parser.add_argument("--num-eval", type=int, default=32)
    parser.add_argument("--search-fraction", type=float, default=0.3)
    parser.add_argument("--seed", type=int, default=0)
    a = parser.parse_args()
    main(a.num_countries, a.num_eval, a.search_fraction, a.seed)
