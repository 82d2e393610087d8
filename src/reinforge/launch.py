"""`reinforge launch [torchrun options] -m reinforge train ...`: torchrun, with the workers' exit
codes passed on.

torchrun ends with 1 whenever a worker fails, so a scheduler cannot tell a run stopped after
saving (3) or hung (4) from a crash. This runs torchrun's own launcher (`torch.distributed.run`,
the same arguments) in this process, gives its workers a folder where each writes the code it
exits with (`errors.record_exit`), and returns this node's verdict:

- any worker's 4 (hang), 2 (config error), 1 (failure), then 6 (a peer lost), in that order;
- 1 when a worker wrote nothing (killed by a signal);
- else 3 (stopped after saving), 5 (nothing trained) or 0.

It also sets what torchrun leaves long: the rendezvous timeout from `distributed.
rendezvous_timeout_s` of the run's config (unless --rdzv-conf is given), and 600 s for the
workers to save and exit after a SIGTERM (torchrun's --shutdown-timeout, 30 s by default,
unless given). A rendezvous that times out becomes one line saying what to check.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from reinforge.errors import EXIT_DIR_ENV, ExitCode

FIRST = (ExitCode.HANG, ExitCode.CONFIG_ERROR, ExitCode.RUNTIME_FAILURE, ExitCode.PEER_LOST)
THEN = (ExitCode.STOPPED_AFTER_SAVE, ExitCode.NOTHING_TRAINED, ExitCode.OK)
SHUTDOWN_TIMEOUT_S = 600


def launch(argv: list[str], parse_command: Callable | None = None) -> int:
    """`parse_command`: the CLI parser's `parse_known_args`, to read the rendezvous timeout from
    the config the workers will run (the CLI hands it over; this module does not import it)."""
    from torch.distributed.run import parse_args

    from reinforge.cluster import LAUNCH_ARGS_ENV

    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        print("\ntorchrun's options: python -m torch.distributed.run --help")
        return ExitCode.OK
    args = parse_args(argv)
    script_at = len(argv) - len(args.training_script_args) - 1
    options = argv[: script_at - (1 if args.module else 0)]
    rendezvous_s = _rendezvous_timeout(args, parse_command)
    if not args.rdzv_conf:
        args.rdzv_conf = f"join_timeout={rendezvous_s:g},timeout={rendezvous_s:g}"
    if not any(a.startswith(("--shutdown-timeout", "--shutdown_timeout")) for a in options):
        args.shutdown_timeout = SHUTDOWN_TIMEOUT_S
    exit_dir = Path(tempfile.mkdtemp(prefix="reinforge-exit-"))
    os.environ[EXIT_DIR_ENV] = str(exit_dir)  # the workers inherit this process's environment
    os.environ[LAUNCH_ARGS_ENV] = shlex.join(options)
    try:
        return _run(args, exit_dir, rendezvous_s)
    finally:
        shutil.rmtree(exit_dir, ignore_errors=True)


def _run(args, exit_dir: Path, rendezvous_s: float) -> int:
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    try:
        run(args)
        failed = False
    except (ChildFailedError, SignalException):
        failed = True
    except Exception as e:
        if not _is_rendezvous_failure(e):
            raise
        if not any(exit_dir.iterdir()):  # no worker ran: the nodes never met, or the store went
            print(f"reinforge launch: {rendezvous_message(args, rendezvous_s, e)}", file=sys.stderr)
            return ExitCode.RUNTIME_FAILURE
        failed = True  # the workers ran and ended; the store went with another node's launcher
    codes = worker_codes(exit_dir, args)
    code = node_verdict(codes, failed)
    if code != ExitCode.OK:
        said = ", ".join(f"{r}: {'none (killed)' if c is None else c}" for r, c in codes.items())
        print(
            f"reinforge launch: workers on this node ended ({said}); exit code {int(code)}",
            file=sys.stderr,
        )
    return code


def worker_codes(exit_dir: Path, args) -> dict[str, int | None]:
    """Each worker's recorded exit code by rank; "others": None when fewer workers recorded one
    than this node started (the rest were killed)."""
    found: dict[str, int | None] = {
        f"rank {p.name[4:]}": int(p.read_text()) for p in sorted(exit_dir.glob("rank*"))
    }
    started = int(args.nproc_per_node) if str(args.nproc_per_node).isdigit() else len(found)
    if len(found) < started:
        found["others"] = None
    return found


def node_verdict(codes: dict[str, int | None], failed: bool) -> int:
    """One exit code for this node's workers (order in the module docstring)."""
    present = set(codes.values())
    for code in FIRST:
        if code in present:
            return int(code)
    if None in present or (failed and not present):
        return int(ExitCode.RUNTIME_FAILURE)
    for code in THEN:
        if code in present:
            return int(code)
    return int(ExitCode.RUNTIME_FAILURE if failed else ExitCode.OK)


def _is_rendezvous_failure(error: BaseException) -> bool:
    from torch.distributed import DistError
    from torch.distributed.elastic.rendezvous import RendezvousError

    return isinstance(error, (RendezvousError, DistError)) or "rendezvous" in str(error).lower()


def rendezvous_message(args, rendezvous_s: float, error: BaseException) -> str:
    from torch.distributed.elastic.rendezvous import RendezvousTimeoutError

    if args.rdzv_backend == "static":
        where = f"--master-addr {args.master_addr} --master-port {args.master_port}"
    else:
        where = f"--rdzv-endpoint {args.rdzv_endpoint} --rdzv-id {args.rdzv_id}"
    text = f"{type(error).__name__} {error}".lower()
    if isinstance(error, RendezvousTimeoutError) or "timeout" in text or "timed out" in text:
        what = f"the nodes did not meet within {rendezvous_s:g} s"
    else:
        what = "the rendezvous failed before any process started"
    return (
        f"{what} ({where}, --nnodes {args.nnodes}; {type(error).__name__}). No process "
        "started and nothing was written. Check that every node was started with the same "
        "endpoint (host:port; and --rdzv-id for c10d), that the port is free on the host and "
        "reachable from every node (firewall), and that all nodes started; the wait is "
        "distributed.rendezvous_timeout_s (or --rdzv-conf join_timeout=SECONDS)"
    )


def _rendezvous_timeout(args, parse_command) -> float:
    """distributed.rendezvous_timeout_s of the config the workers will run (its default when
    the command's config cannot be read here; the workers then report why)."""
    from reinforge.config import DistributedSection

    default = DistributedSection().rendezvous_timeout_s
    command = args.training_script_args[:1]
    if parse_command is None or not (
        args.module and args.training_script == "reinforge" and command == ["train"]
    ):
        return default
    try:
        from reinforge.config import ROOTS, load_config

        parsed, extra = parse_command(args.training_script_args)
        overrides = [*parsed.overrides, *extra]
        config = parsed.config
        if config and "=" in config and not Path(config).exists():
            config, overrides = None, [config, *overrides]
        if parsed.resume:
            config = str(Path(parsed.resume) / "config.toml")
        return load_config(ROOTS["train"], config, overrides).distributed.rendezvous_timeout_s
    except Exception:  # the workers load the config again and name its error
        return default
