"""Crash safety: SIGKILL a run 20 times, at random moments during steps and during saves,
resuming each time; the final weights must equal those of a run that was never killed.

Each killed process must first make progress (one more checkpoint than it started from), so every
kill lands in training, not in the interpreter's start. (The drill this replaces killed at 4-10 s
of wall time; on a loaded machine a start takes longer than that, so no kill reached training and
the final resume ran all 150 steps alone, over 300 s: the "stall" it was excluded for.) The killed
processes are forked from a server that has done the imports (`tests/forkserver.py`), which makes
the drill cheap enough for the default run; so are the uninterrupted run and the final resume
(through `conftest.cli`, from the session's server). Every process runs under the hang watchdog, so a true stall ends with
every thread's stack in its log instead of a test timeout. The killed run saves asynchronously
(`checkpoint.async_save`), the uninterrupted one synchronously: the kills land in background
writes too, and each checkpoint must still equal the synchronous one byte for byte.
"""

import hashlib
import os
import random
import signal
import time
from pathlib import Path

from reinforge.errors import ExitCode

from ..conftest import REPO, TINY_RUN, cli
from ..forkserver import ForkServer

NUM_KILLS = 20
# Steps for the kills to land in: each cycle advances one checkpoint or more (a random moment
# lands up to `KILL_WITHIN_S` later); at 60 steps of 0.03 s a faster rollout let 20 cycles reach
# step 59, and the last run ended by itself before the save it waited for (CI, session 22)
MAX_STEPS = 120
KILL_WITHIN_S = 0.15
STALL_S = 90.0  # the watchdog's limit in every process of the drill
ARGS = [
    "train",
    *TINY_RUN,
    f"run.max_steps={MAX_STEPS}",
    "sft.steps=2",
    "checkpoint.every=1",
    "checkpoint.keep_last=2",
    "eval.num_tasks=4",
    f"watchdog.timeout_s={STALL_S}",
]

KILLED = [*ARGS, "run.name=killed", "checkpoint.async_save=true"]


def latest(run: Path) -> str | None:
    pointer = run / "checkpoints" / "latest"
    return pointer.read_text().strip() if pointer.exists() else None


def order(name: str | None) -> tuple[int, int]:
    if name is None:
        return (-1, 0)
    if name == "sft_final":
        return (0, 0)
    return (1, int(name.rsplit("_", 1)[1]))


def saving(run: Path) -> bool:
    return any((run / "checkpoints").glob(".tmp-*"))


def wait_until(condition, log: Path, what: str) -> None:
    deadline = time.monotonic() + STALL_S + 30
    while not condition():
        assert time.monotonic() < deadline, f"no {what} in {STALL_S + 30:.0f}s:\n{log.read_text()}"
        time.sleep(0.002)


def kill_once(server: ForkServer, run: Path, cycle: int, rng: random.Random, log: Path) -> bool:
    """Start (or resume) the run, let it progress, SIGKILL it; True when a save was in flight."""
    start = latest(run)
    resume = ["--resume", str(run)] if start else ["run.overwrite=true"]
    pid = server.start([*KILLED, f"run.output_dir={run.parent}", *resume], log)
    if cycle == 0:  # during the save of the SFT result: the next start begins from scratch
        is_saving_sft = (run / "checkpoints" / ".tmp-sft_final").exists
        wait_until(lambda: is_saving_sft() or latest(run), log, "SFT save")
    else:
        wait_until(lambda: order(latest(run)) > order(start), log, "new checkpoint")
        if cycle % 2 == 0:  # during the next save
            wait_until(lambda: saving(run), log, "save")
        else:  # at a random moment of the next steps
            time.sleep(rng.uniform(0.0, KILL_WITHIN_S))
    os.kill(pid, signal.SIGKILL)
    during_save = saving(run)
    returncode = server.wait()
    assert returncode == -signal.SIGKILL, (
        f"the run ended by itself ({returncode}):\n{log.read_text()}"
    )
    return during_save


def weights_hash(ckpt: Path) -> str:
    return hashlib.sha256((ckpt / "model.safetensors").read_bytes()).hexdigest()


def same_as_straight(run: Path, straight: Path) -> bool:
    """The checkpoint a resume would load equals the uninterrupted run's at the same step."""
    name = latest(run)
    a, b = run / "checkpoints" / name, straight / "checkpoints" / name
    state = (a / "trainer_state.json").read_text() == (b / "trainer_state.json").read_text()
    return state and weights_hash(a) == weights_hash(b)


def test_twenty_kill9_resumes_reach_the_same_weights(tmp_path):
    began = time.perf_counter()
    straight = cli(
        *ARGS, f"run.output_dir={tmp_path}", "run.name=straight", "checkpoint.keep_last=1000"
    )
    assert straight.returncode == ExitCode.OK, straight.stderr
    server = ForkServer(env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=REPO)
    run, rng = tmp_path / "killed", random.Random(0)
    reached, num_during_save, num_same = [], 0, 0
    try:
        kill_once(server, run, 0, rng, tmp_path / "kill0.log")  # during the SFT result's save
        for cycle in range(1, NUM_KILLS + 1):
            num_during_save += kill_once(server, run, cycle, rng, tmp_path / f"kill{cycle}.log")
            reached.append(latest(run))
            num_same += same_as_straight(run, tmp_path / "straight")
    finally:
        server.close()
    resumed = cli(*KILLED, f"run.output_dir={tmp_path}", "--resume", str(run))
    assert resumed.returncode == ExitCode.OK, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    final = f"step_{MAX_STEPS:06d}"
    is_final_same = weights_hash(run / "checkpoints" / final) == weights_hash(
        tmp_path / "straight" / "checkpoints" / final
    )
    print(
        f"\nkill -9 drill: {NUM_KILLS} kills after progress ({num_during_save} with a save in "
        f"flight) plus one during the SFT result's save; the checkpoint each kill left equals the "
        f"uninterrupted run's at that step: {num_same}/{NUM_KILLS}; after the last resume, final "
        f"weights equal: {is_final_same}; reached {reached[0]} .. {reached[-1]}; "
        f"{time.perf_counter() - began:.0f}s"
    )
    assert 0 < num_during_save < NUM_KILLS
    assert order(reached[-1]) < (1, MAX_STEPS)  # the last kill still had steps to do
    assert num_same == NUM_KILLS and is_final_same
