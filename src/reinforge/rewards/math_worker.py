"""The worker side of `reinforge.rewards.math`: one process that checks answers until its parent
says stop, under an address-space cap.

The checker is a module with `check(*item)` (a bool or a score) and `warm_up()` (imports what
check needs, so no item's clock pays for it; ImportError when a package is missing): this one for
math-verify, `reinforge.tasks.reasoning_gym_scoring` for reasoning-gym's scorers. The worker
answers each item with ("ok", value), ("error", message) when the check raised, or ("memory",
message) when the item hit the memory cap, after which the process exits for the parent to
replace it. Its first message is ("ready", has_memory_limit) or ("failed", why).
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import sys
from multiprocessing.connection import Connection

MEMORY_ALARM = 0.75  # of memory_mb: an item whose peak got this far ran into the cap


def check(completion: str, answer: str) -> bool:
    """Whether the completion's final answer equals `answer`. No timeout of its own: call it only
    inside a worker that the parent can kill."""
    from math_verify import (  # type: ignore[import-untyped]
        ExprExtractionConfig,
        LatexExtractionConfig,
        parse,
        verify,
    )

    # A bare ground truth is boxed so that LaTeX like `\sqrt{2}` or `\{1,2\}` parses whole.
    gold_text = answer if ("\\boxed" in answer or "$" in answer) else f"\\boxed{{{answer}}}"
    gold = parse(gold_text, parsing_timeout=None)
    if not gold:
        raise ValueError(f"math-verify cannot parse the ground-truth answer {answer!r}")
    pred_config = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    pred = parse(completion, extraction_config=pred_config, parsing_timeout=None)
    return bool(pred) and verify(gold, pred, timeout_seconds=None)


def warm_up() -> None:
    try:
        check("$1$", "1")
    except ImportError as e:
        raise ImportError(f"{e}; install it with: pip install 'math-verify>=0.7'") from None


def _peak_rss_mb() -> float:
    """This process image's peak resident memory (Linux's VmHWM; not `ru_maxrss`, which keeps
    the peak of the parent it was forked from across the exec)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    raise AssertionError("no VmHWM in /proc/self/status")


def _limit_memory(memory_mb: int) -> float | None:
    """Cap this process's address space at its present size plus `memory_mb`; returns the peak
    RSS (MiB) past which an item counts as having hit the cap, or None where there is no cap."""
    if not sys.platform.startswith("linux"):
        return None
    import resource

    with open("/proc/self/statm") as f:
        size_bytes = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    limit = size_bytes + memory_mb * 2**20
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    return _peak_rss_mb() + MEMORY_ALARM * memory_mb


def worker_main(conn: Connection, memory_mb: int, checker: str = __name__) -> None:
    # Ctrl-C belongs to the parent, which kills its workers on close.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Disabling math-verify's signal timeout logs a warning; here the parent's kill is the timeout.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    module = importlib.import_module(checker)
    try:
        module.warm_up()  # import and warm up now, so no item's clock pays for it
    except ImportError as e:
        conn.send(("failed", str(e)))
        return
    alarm_mb = _limit_memory(memory_mb)
    conn.send(("ready", alarm_mb is not None))
    while True:
        try:
            item = conn.recv()
        except EOFError:  # the parent is gone
            return
        if item is None:
            return
        # Model output is arbitrary text and sympy raises anything on some of it; such an item is
        # an error to count, not a reason to lose the worker.
        try:
            reply = ("ok", module.check(*item))
        except MemoryError:
            reply = ("memory", f"an allocation failed under the {memory_mb} MB limit")
        except Exception as e:
            reply = ("error", f"{type(e).__name__}: {e}")
        if alarm_mb is not None and reply[0] != "memory" and _peak_rss_mb() > alarm_mb:
            reply = ("memory", f"the worker reached the {memory_mb} MB limit")
        conn.send(reply)
        if reply[0] == "memory":
            return  # the parent replaces this worker: its heap may stay large or fragmented
