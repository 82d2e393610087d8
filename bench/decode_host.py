"""The decode loop's host bookkeeping per step, without a model or a GPU: the scheduler and the
decode graphs' row filling at a workload's shape, driven through the overlapped protocol of
`PagedEngine.generate` (a decode chosen ahead, its rows, `launched`, the commit of the step before)
with tokens from a hash. On a slow host this Python, not the device, paces the decode (s25c: 176 of
G1's 512 steps waited for it on an H100 host), so it is worth measuring on any machine.

    python bench/decode_host.py [--seqs 256] [--prompt 128] [--new 512] [--page 16] [--rounds 3]
        [--records]

Prints microseconds a decode step for each part (the best of `--rounds` generations), and the
whole step's host time on the steps where every sequence takes a new page (all sequences of a
workload like G1 reach a page's end together: every `--page`-th step) against the others.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import numpy as np

from reinforge.engine.base import SamplingParams
from reinforge.engine.block_manager import BlockManager
from reinforge.engine.graph_rows import NUM_ROW_FIELDS, advance_rows, decode_rows
from reinforge.engine.scheduler import Scheduler
from reinforge.engine.sequence import Sequence

GROUP = 8


def one_generation(args) -> dict[str, float]:
    params = SamplingParams(max_new_tokens=args.new, n=GROUP, temperature=1.0, ignore_eos=True)
    pages = args.seqs * ((args.prompt + args.new) // args.page + 2)
    scheduler = Scheduler(BlockManager(pages, args.page), args.seqs, 8192)
    for g in range(args.seqs // GROUP):
        prompt = [1 + (g * 7919 + i) % 1000 for i in range(args.prompt)]
        scheduler.add([Sequence(prompt, params, group_id=g, sample_index=k) for k in range(GROUP)])

    def finish(seq: Sequence) -> str | None:
        return "length" if len(seq.output_ids) >= seq.params.max_new_tokens else None

    # as `PagedEngine._finish_rule` says of itself (G1: no stop ids, no stop strings)
    finish.stop_ids, finish.stop_strings = frozenset(), ()  # type: ignore[attr-defined]

    times: dict[str, float] = defaultdict(float)
    store = None
    if args.records:  # the engine's records (`engine.records`): their bookkeeping, not the copy
        import torch

        from reinforge.engine.records import HiddenStore

        store = HiddenStore(24, 896, torch.bfloat16, "cpu", 1 << 40)
        store._to_host = lambda *a: None  # (on CUDA: one device copy a step, queued)
        records = torch.empty((args.seqs, 24, 896), dtype=torch.bfloat16)
    rows = [np.zeros((NUM_ROW_FIELDS, args.seqs), dtype=np.int64) for _ in range(2)]
    inflight = scheduler.schedule()
    scheduler.launched(inflight)
    steps, last = 0, None
    per_step: list[float] = []
    while True:
        t0 = time.perf_counter()
        ahead = None if inflight.is_prefill else scheduler.schedule_next_decode()
        t1 = time.perf_counter()
        times["schedule_next_decode"] += t1 - t0
        if ahead is not None:
            out, previous = rows[steps % 2], rows[(steps - 1) % 2]
            same = last is not None and len(last) == len(ahead.leaders)
            if same and ahead.grown_rows is not None:
                advance_rows(previous, out, ahead.leaders, ahead.grown_rows, args.page)
            else:
                decode_rows(ahead.leaders, args.page, out)
            last = ahead.leaders
            t2 = time.perf_counter()
            times["rows (advance_rows / decode_rows)"] += t2 - t1
            if store is not None:  # what `ModelRunner.launch` does for a step's records
                t4 = time.perf_counter()
                store.write(records[: len(ahead.leaders)], ahead.groups, seqs=ahead.seqs)
                times["records (rows)"] += time.perf_counter() - t4
                t2 = time.perf_counter()
            scheduler.launched(ahead)
            times["launched"] += time.perf_counter() - t2
        n = len(inflight.seqs)
        tokens = [(steps * 31 + i) % 1000 for i in range(n)]
        t3 = time.perf_counter()
        scheduler.commit(inflight, tokens, [0.0] * n, finish)
        times["commit"] += time.perf_counter() - t3
        if ahead is None:
            if scheduler.is_finished():
                break
            ahead = scheduler.schedule()
            scheduler.launched(ahead)
            last = None
        inflight = ahead
        steps += 1
        per_step.append(time.perf_counter() - t0)
    out = {k: 1e6 * v / steps for k, v in times.items()}
    # a decode step chosen ahead at step i computes position prompt + i + 1: a new page when that
    # position starts one
    boundary = [(args.prompt + i + 1) % args.page == 0 for i in range(len(per_step))]
    on = [t for t, b in zip(per_step, boundary) if b]
    off = [t for t, b in zip(per_step, boundary) if not b]
    out["(a page step)"] = 1e6 * float(np.mean(on)) if on else 0.0
    out["(another step)"] = 1e6 * float(np.mean(off)) if off else 0.0
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=512)
    parser.add_argument("--page", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--records", action="store_true", help="with the records' bookkeeping")
    args = parser.parse_args()
    runs = [one_generation(args) for _ in range(args.rounds)]
    best = {k: min(r[k] for r in runs) for k in runs[0]}
    print(
        f"{args.seqs} sequences, prompt {args.prompt}, {args.new} new tokens, pages of {args.page}"
    )
    print("| part | us a decode step (best of rounds) |")
    print("|---|---|")
    for key, value in best.items():
        if not key.startswith("("):
            print(f"| {key} | {value:.0f} |")
    print(f"| all | {sum(v for k, v in best.items() if not k.startswith('(')):.0f} |")
    print(f"| whole step, every sequence taking a page | {best['(a page step)']:.0f} |")
    print(f"| whole step, the others | {best['(another step)']:.0f} |")


if __name__ == "__main__":
    main()
