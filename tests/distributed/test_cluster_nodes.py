"""Two nodes on one machine, as a cluster user meets them: two `reinforge launch` (torchrun)
launchers of one process each, meeting through a c10d rendezvous on localhost over gloo, each
with its own model cache (REINFORGE_CACHE) as two machines have.

- a fresh cache on both nodes: the built-in model is built on each (one builder per node) and
  the run trains;
- a different setting on one node, a run directory that is not the same folder on both, a
  killed peer and a wrong rendezvous port each fail within the configured time, with the message
  that says what happened and what to do, and `reinforge report` on what each left;
- exit codes 3 (stopped by SIGTERM after saving) and 4 (hang) reach the launcher's caller.

Start-up dominates (each launcher and worker imports torch); to keep the set short the
scenarios of a wave run at once: the waits (rendezvous, heartbeat, watchdog) overlap.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.distributed.test_torchrun import free_port

RUN = [
    "run.device=cpu",  # gloo, also on a machine with GPUs (two "nodes" would share GPU 0)
    "model.path=builtin:micro",
    "task.max_digits=1",
    "task.num_eval=4",
    "rollout.prompts_per_step=2",
    "rollout.samples_per_prompt=2",
    "rollout.max_new_tokens=4",
    "train.micro_batch_tokens=256",
    "run.num_threads=1",
    "run.max_steps=2",
    "checkpoint.every=1",
    "eval.before_train=false",
    "log.tensorboard=false",
    "log.plot=false",
    "distributed.heartbeat_timeout_s=3",
    "distributed.collective_timeout_s=30",
    "distributed.rendezvous_timeout_s=5",
]
LAUNCH = [sys.executable, "-m", "reinforge", "launch"]


@dataclass
class Node:
    proc: subprocess.Popen
    log: Path
    started: float = field(default_factory=time.monotonic)
    ended: float | None = None

    def wait(self, timeout: float = 240) -> int:
        code = self.proc.wait(timeout)
        self.ended = self.ended or time.monotonic()
        return code

    def poll(self) -> None:
        if self.ended is None and self.proc.poll() is not None:
            self.ended = time.monotonic()

    @property
    def output(self) -> str:
        return self.log.read_text()


def start(root: Path, name: str, argv: list[str], cache: str, cwd: Path = REPO) -> Node:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "REINFORGE_CACHE": str(root / cache),
    }
    log = root / f"{name}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
    return Node(proc, log)


def two_nodes(root: Path, name: str, *extra: str, node1: tuple = (), cwds=(REPO, REPO), port=None):
    """Launchers of nodes 0 and 1 (node 1 takes `node1` overrides after the common ones)."""
    port = port or (free_port(), None)
    nodes = []
    for n in (0, 1):
        endpoint = f"127.0.0.1:{port[n] or port[0]}"
        argv = [
            *LAUNCH,
            *("--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d"),
            *("--rdzv-endpoint", endpoint, "--rdzv-id", name),
            *("-m", "reinforge", "train", *RUN, *extra, *(node1 if n else ())),
        ]
        nodes.append(start(root, f"{name}.node{n}", argv, f"cache{n}", cwds[n]))
    return nodes


def static_nodes() -> list[list[str]]:
    """torchrun options of nodes 0 and 1 of a static rendezvous, node 1 given another port."""
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1"]
    return [[*common, "--node-rank", str(n), "--master-port", str(free_port())] for n in (0, 1)]


def run_args(root: Path, name: str) -> list[str]:
    return [f"run.output_dir={root / 'runs'}", f"run.name={name}"]


def report(run_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "reinforge", "report", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, "COLUMNS": "2000"},
    )


def wait_for(path: Path, nodes: list[Node], timeout: float = 240) -> None:
    """Until `path` exists, noting when each of `nodes` ends."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        watch(nodes, 0.2)


def watch(nodes: list[Node], seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for node in nodes:
            node.poll()
        time.sleep(0.05)


def wait_all(nodes: list[Node], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while any(n.ended is None for n in nodes):
        assert time.monotonic() < deadline, "a launcher did not end"
        watch(nodes, 0.2)


@pytest.fixture(scope="module")
def starts(tmp_path_factory):
    """Wave 1, all at once: a fresh cache trains; three jobs that must fail before training."""
    root = tmp_path_factory.mktemp("cluster")
    (root / "a").mkdir(), (root / "b").mkdir()
    began = time.monotonic()
    jobs = {
        "fresh": two_nodes(root, "fresh", *run_args(root, "fresh")),
        "settings": two_nodes(
            root, "settings", *run_args(root, "settings"), node1=("optim.lr=0.5",)
        ),
        # the same relative run.output_dir from different folders: as one path on two
        # machines whose disks are not shared
        "unshared": two_nodes(
            root,
            "unshared",
            "run.output_dir=runs",
            "run.name=unshared",
            cwds=(root / "a", root / "b"),
        ),
        "port": two_nodes(root, "port", *run_args(root, "port"), port=(free_port(), free_port())),
        "static_port": [  # the static rendezvous: node 0 keeps the store, node 1 misses it
            start(
                root,
                f"static_port.node{n}",
                [*LAUNCH, *static, "-m", "reinforge", "train", *RUN, *run_args(root, "static")],
                f"cache{n}",
            )
            for n, static in enumerate(static_nodes())
        ],
    }
    wait_all([n for nodes in jobs.values() for n in nodes])
    codes = {name: [n.wait() for n in nodes] for name, nodes in jobs.items()}
    print(f"\nwave 1 (5 two-node jobs at once): {time.monotonic() - began:.1f} s")
    for name, nodes in jobs.items():
        took = ", ".join(f"{n.ended - n.started:.1f} s" for n in nodes)
        print(f"  {name}: exit codes {codes[name]}, launchers ended after {took}")
    return root, jobs, codes


def test_fresh_caches_on_two_nodes_train(starts):
    root, jobs, codes = starts
    assert codes["fresh"] == [0, 0], jobs["fresh"][1].output[-3000:]
    rows = (root / "runs" / "fresh" / "metrics.jsonl").read_text().splitlines()
    assert sum('"loss"' in row for row in rows) == 2  # two steps, written once
    for n in (0, 1):  # each node built its own entry, whole
        (entry,) = (root / f"cache{n}").glob("builtin-micro-*")
        assert (entry / "model.safetensors").is_file() and (
            entry / "reinforge_entry.json"
        ).is_file()


def test_a_setting_that_differs_between_nodes_stops_both(starts):
    root, jobs, codes = starts
    assert codes["settings"] == [2, 2]
    for node in jobs["settings"]:
        assert "optim.lr = 5e-05 on rank 0 on node 0" in node.output  # the default
        assert "0.5 on rank 1 on node 1" in node.output
    said = report(root / "runs" / "settings")  # stopped before the run directory existed
    assert said.returncode == 2 and "not a run directory" in said.stderr


def test_a_run_directory_not_shared_by_the_nodes_stops_both(starts):
    root, jobs, codes = starts
    assert codes["unshared"] == [2, 2]
    for node in jobs["unshared"]:
        assert "the run directory is not shared by every node" in node.output
        assert f"looked in {root / 'b' / 'runs' / 'unshared'}" in node.output
    said = report(root / "a" / "runs" / "unshared")
    assert said.returncode == 0 and "not shared by every node" in said.stdout


@pytest.mark.parametrize("job", ["port", "static_port"])
def test_a_wrong_rendezvous_port_fails_within_the_timeout(starts, job):
    _, jobs, codes = starts
    assert codes[job] == [1, 1]
    for node in jobs[job]:
        assert "the nodes did not meet within 5 s" in node.output
        # 5 s of waiting, the rest is start-up (imports: up to a minute on a busy machine);
        # torchrun's own wait is 10 minutes
        assert node.ended - node.started < 120


@pytest.fixture(scope="module")
def failures(tmp_path_factory):
    """Wave 2, all at once: a peer killed mid-run, a SIGTERM, a hang."""
    root = tmp_path_factory.mktemp("cluster_failures")
    began = time.monotonic()
    long = ["run.max_steps=1000"]
    killed = two_nodes(root, "killed", *run_args(root, "killed"), *long)
    one = [*LAUNCH, "--standalone", "--nproc-per-node", "2", "-m", "reinforge", "train", *RUN]
    stopped = start(root, "stopped", [*one, *run_args(root, "stopped"), *long], "cache0")
    hang = ["faults.training=1.0", 'faults.kinds=["hang"]', "watchdog.timeout_s=3"]
    hung = start(root, "hung", [*one, *run_args(root, "hung"), *hang], "cache1")
    every = [*killed, stopped, hung]
    wait_for(root / "runs" / "killed" / "checkpoints" / "latest", every)
    worker = int(subprocess.check_output(["pgrep", "-P", str(killed[1].proc.pid)]).split()[0])
    os.kill(worker, signal.SIGKILL)
    killed_at = time.monotonic()
    wait_for(root / "runs" / "stopped" / "checkpoints" / "latest", every)
    stopped.proc.send_signal(signal.SIGTERM)  # as SLURM's --signal does before the time limit
    wait_all(every)
    codes = {
        "killed": [n.wait() for n in killed],
        "stopped": stopped.wait(),
        "hung": hung.wait(),
    }
    print(f"\nwave 2 (3 jobs at once): {time.monotonic() - began:.1f} s")
    print(
        f"  killed: exit codes {codes['killed']}, survivor ended {killed[0].ended - killed_at:.1f} s after the kill"
    )
    for name, node in (("stopped", stopped), ("hung", hung)):
        print(
            f"  {name}: exit code {codes[name]}, launcher ended after {node.ended - node.started:.1f} s"
        )
    return root, killed, killed_at, stopped, hung, codes


def test_a_killed_peer_is_named_within_the_heartbeat_timeout(failures):
    root, killed, killed_at, _, _, codes = failures
    assert codes["killed"] == [6, 1]  # the survivor: peer lost; the node whose process died: 1
    survivor = killed[0]
    assert survivor.ended - killed_at < 3 + 20  # heartbeat 3 s; gloo's own wait: 30 min
    line = "rank 1 on node 1"
    assert line in survivor.output and "stopped answering" in survivor.output
    run_dir = root / "runs" / "killed"
    resume = f"--rdzv-id killed -m reinforge train --resume {run_dir}"
    assert resume in survivor.output and "checkpoints are intact (latest: step_" in survivor.output
    said = report(run_dir)
    assert said.returncode == 0
    assert "failed: rank 1 on node 1" in said.stdout and resume in said.stdout


def test_exit_code_3_reaches_the_caller_of_the_launcher(failures):
    root, _, _, stopped, _, codes = failures
    assert codes["stopped"] == 3, stopped.output[-3000:]
    assert "stopped by SIGTERM; checkpoint saved" in stopped.output
    said = report(root / "runs" / "stopped")
    assert "stopped at RL step" in said.stdout


def test_exit_code_4_reaches_the_caller_of_the_launcher(failures):
    root, _, _, _, hung, codes = failures
    assert codes["hung"] == 4, hung.output[-3000:]
    said = report(root / "runs" / "hung")
    # which rank's watchdog fires first is timing: on a loaded machine rank 0 may hear of rank 1's
    # hang through the heartbeat before its own watchdog fires; the report names the hang either way
    assert said.returncode == 0, said.stdout + said.stderr
    assert "hung: reinforge watchdog" in said.stdout or "failed: hung in phase" in said.stdout, (
        said.stdout
    )
    # every rank's file: rank 1 hung too, or the heartbeat told it of rank 0's hang first
    if (root / "runs" / "hung" / "error.rank1.txt").exists():
        assert "error.rank1.txt" in said.stdout and "failed: hung in phase" in said.stdout
        assert "no checkpoint was saved yet: start the run again" in hung.output
    else:
        assert "hang.rank1.txt" in said.stdout
