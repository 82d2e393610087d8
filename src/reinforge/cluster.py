"""The processes of a torchrun job checked against each other, watched, and their failures
said in one line.

Contract (all of it is inactive in a single process):
- `check_agreement`, right after the process group starts: every process's resolved settings
  and run directory are gathered; any difference stops every process at once (a ConfigError,
  exit code 2) naming the keys and the nodes. `agree_on_problems` does the same for a check
  one process failed alone (a --resume folder another node lacks). `check_shared_run_dir`, once
  rank 0 has made the run directory: rank 0 writes a token there, every other process reads it
  at its own path; a node that does not see it is on other storage, and every process stops.
- `Heartbeat`: a thread per process beats through the job's store (torchrun's TCPStore, its
  address in MASTER_ADDR/MASTER_PORT). Each process watches the next one in rank order, so the
  store sees O(processes) requests per beat. A process that misses its beats for
  `distributed.heartbeat_timeout_s`, or that fails, is named in a verdict every process reads;
  each then writes the verdict (what happened, which node, the checkpoints, the resume command)
  to the console and its error file and exits with `ExitCode.PEER_LOST`. It runs beside the
  main thread, so it speaks even while the main thread waits in a collective for the lost peer.
- `explain_failure`: the main thread's exception from a collective (a peer's closed connection,
  a timeout, a mismatch of shapes) as (one line, exit code); a lost peer waits for the
  heartbeat's verdict, which names it.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import sys
import uuid
from pathlib import Path

from reinforge.errors import ConfigError

# Set by `reinforge launch` for its workers: its torchrun options, for the resume command.
LAUNCH_ARGS_ENV = "REINFORGE_LAUNCH_ARGS"
TOKEN_FILE = ".reinforge_shared_check"
MAX_KEYS_SHOWN = 6


def global_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def node_label(rank: int | None = None, node: str | None = None) -> str:
    """'rank 1 on node 1 (host-b)': torchrun's node number (GROUP_RANK) and the host name."""
    rank = global_rank() if rank is None else rank
    return f"rank {rank} on {node or _node()}"


def _node() -> str:
    return f"node {os.environ.get('GROUP_RANK', '0')} ({socket.gethostname()})"


def flat_settings(cfg) -> dict[str, str]:
    """`cfg` as dotted keys -> JSON values (what two processes must agree on)."""
    out: dict[str, str] = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict) and value:
            for key, inner in value.items():
                walk(f"{prefix}.{key}" if prefix else key, inner)
        else:
            out[prefix] = json.dumps(value, sort_keys=True)

    walk("", cfg.model_dump(mode="json"))
    return out


def _gather(obj) -> list:
    import torch.distributed as dist

    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, obj)
    return parts


def check_agreement(cfg) -> list[str]:
    """Stop every process unless all resolved the same settings (the run directory's path
    among them; `check_shared_run_dir` checks it is one folder). Returns each rank's node label,
    in rank order."""
    mine = {"node": _node(), "settings": flat_settings(cfg)}
    everyone = _gather(mine)
    labels = [node_label(r, p["node"]) for r, p in enumerate(everyone)]
    keys = dict.fromkeys(k for p in everyone for k in p["settings"])
    first = everyone[0]["settings"]
    differing = [k for k in keys if any(p["settings"].get(k) != first.get(k) for p in everyone)]
    if differing:
        lines = []
        for key in differing[:MAX_KEYS_SHOWN]:
            values = ", ".join(
                f"{p['settings'].get(key, '(unset)')} on {label}"
                for p, label in zip(everyone, labels)
            )
            lines.append(f"{key} = {values}")
        more = len(differing) - MAX_KEYS_SHOWN
        raise ConfigError(
            "the processes of this job resolved different settings, so they would train "
            f"different things: {'; '.join(lines)}{f' (and {more} more keys)' if more > 0 else ''}. "
            "Start every node with the same config file and the same section.key=value overrides"
        )
    return labels


def agree_on_problems(problem: str | None) -> None:
    """Raise a ConfigError on every process when any process found `problem` (so none waits at a
    barrier for one that stopped)."""
    everyone = _gather((node_label(), problem))
    found = [(label, p) for label, p in everyone if p]
    if not found:
        return
    said = "; ".join(f"{label}: {p}" for label, p in found)
    if everyone[0][1] is None:
        said += (
            ". rank 0 saw no such problem: if the nodes see different "
            "files at this path, put run.output_dir on a filesystem every node mounts at the "
            "same path (NFS, Lustre, a ReadWriteMany volume)"
        )
    raise ConfigError(said)


def check_shared_run_dir(run_dir: Path, is_writer: bool) -> None:
    """Rank 0 (`is_writer`) writes a token into `run_dir`; every process reads it at its own
    `run_dir`. Any process that does not find rank 0's token stops every process."""
    token = uuid.uuid4().hex if is_writer else None
    path = Path(run_dir) / TOKEN_FILE
    if is_writer:
        path.write_text(token)
    import torch.distributed as dist

    shared = [token]
    dist.broadcast_object_list(shared, src=0)
    try:
        seen = path.read_text()
    except OSError:
        seen = None
    # every process has read the token once the gather returns; no collective follows, so a
    # process that stops at once leaves none waiting
    everyone = _gather((node_label(), str(Path(run_dir).absolute()), seen == shared[0]))
    if is_writer:
        path.unlink(missing_ok=True)
    blind = [(label, where) for label, where, ok in everyone if not ok]
    if blind:
        who = "; ".join(f"{label} looked in {where}" for label, where in blind)
        problem = (
            f"the run directory is not shared by every node: rank 0 wrote a token into "
            f"{everyone[0][1]}, and {who} and did not find it. Every rank writes its own "
            "checkpoint shards there, so every node must see the same folder: put "
            "run.output_dir on a filesystem every node mounts at the same path (NFS, Lustre, a "
            "ReadWriteMany volume) and give it as an absolute path, or run on one node"
        )
        if is_writer:  # for `reinforge report` on rank 0's side
            error_path(run_dir).write_text(f"ConfigError: {problem}\n")
        raise ConfigError(problem)


def resume_command(run_dir: Path, command: str) -> str:
    """The command that continues the run, on this or any other number of nodes and
    processes (checkpoints reshard on load)."""
    launcher = os.environ.get(LAUNCH_ARGS_ENV)
    prefix = f"reinforge launch {launcher}" if launcher else "torchrun <your launcher options>"
    return f"{prefix} -m reinforge {command} --resume {shlex.quote(str(run_dir))}"


def resume_line(command: str, run_dir: Path) -> str:
    """How to continue a stopped run: under torchrun the launcher's command, else ours."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return resume_command(run_dir, command)
    return f"reinforge {command} --resume {run_dir}"


def where_rank0_is(labels: list[str]) -> str:
    """Where rank 0 (the console, the metrics, the summary) runs: with the c10d rendezvous
    torchrun numbers the nodes itself. Said once per node."""
    return (
        f"reinforge: {len(labels)} processes; {labels[0]} prints and writes the run's files "
        f"(said by {labels[global_rank()]})"
    )


def what_now(run_dir: Path, command: str) -> str:
    """The end of a distributed failure's line: the checkpoints, and the resume command (on
    this or any other number of nodes) when there is one."""
    from reinforge.checkpoint.files import latest_checkpoint

    try:
        latest = latest_checkpoint(run_dir)
    except (AssertionError, OSError):
        latest = None
    if latest is None:
        return "no checkpoint was saved yet: start the run again"
    return (
        f"checkpoints are intact (latest: {latest.name}). Resume on this or any number of "
        f"nodes with: {resume_command(run_dir, command)}"
    )


def error_path(run_dir: Path) -> Path:
    """error.txt for global rank 0, error.rank{r}.txt for the others."""
    rank = global_rank()
    return Path(run_dir) / ("error.txt" if rank == 0 else f"error.rank{rank}.txt")


def announce(line: str, run_dir: Path | None, detail: str = "") -> None:
    """`line` on stderr (every process may speak on failure) and as the last line of this
    process's error file, which `reinforge report` shows."""
    print(f"\nreinforge: {line}", file=sys.stderr, flush=True)
    if run_dir is not None and Path(run_dir).is_dir():
        error_path(run_dir).write_text(f"{detail.rstrip()}\n{line}\n".lstrip())
