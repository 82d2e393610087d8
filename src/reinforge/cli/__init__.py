"""The `reinforge` command (`main`, here): arguments and config parsed before torch is imported,
one function per command, model commands (`models`) and the end-of-run output (`output`). The
top layer: it may import anything, and only `__main__` imports it.

`reinforge <command> CONFIG.toml [section.key=value ...]`.

Parses arguments and config before importing torch, so `--help` and config errors are instant.
Every command ends with a summary and a distinct exit code (see `reinforge.errors.ExitCode`).
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

from reinforge.cli import models as cli_models
from reinforge.errors import ConfigError, ExitCode, RunFailure, record_exit


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="reinforge",
        description="Train language models with reinforcement learning.",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"reinforge {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in [
        ("train", "SFT stage (optional) then RL"),
        ("sft", "supervised fine-tuning"),
    ]:
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument(
            "config",
            nargs="?",
            help="TOML config, e.g. configs/quickstart.toml (omit with --resume, or give "
            "section.key=value settings to start from the defaults)",
        )
        p.add_argument(
            "overrides",
            nargs="*",
            metavar="section.key=value",
            help="override a config value, e.g. rollout.temperature=0.7",
        )
        p.add_argument(
            "--dry-run",
            action="store_true",
            help="validate, print the resolved config and budgets, exit",
        )
        p.add_argument(
            "--resume",
            metavar="RUN_DIR",
            help="continue the run in RUN_DIR from its latest checkpoint, with its saved "
            "settings (RUN_DIR/config.toml); a config or overrides that change them are refused",
        )
        p.add_argument(
            "--allow-changes",
            action="store_true",
            help="with --resume: continue with the changed settings given (each is listed in "
            "the log and the summary)",
        )
    docs = sub.add_parser(
        "config-docs", help="print the config reference (Markdown) generated from the field docs"
    )
    docs.add_argument("--output", "-o", help="write to this file instead of stdout")
    doctor = sub.add_parser(
        "doctor",
        help="check this machine (and a config): versions, devices, disk, a smoke test",
        description="Check this machine, and with CONFIG whether it can run that config. Prints "
        "a table and a verdict; exits 1 when the machine cannot run reinforge, 2 when it cannot "
        "run the config.",
    )
    doctor.add_argument("config", nargs="?", help="TOML config to check (optional)")
    doctor.add_argument("overrides", nargs="*", metavar="section.key=value")
    doctor.add_argument(
        "--command",
        dest="command_name",
        choices=["train", "sft"],
        default="train",
        help="the command the config is for (default: train)",
    )
    doctor.add_argument("--no-smoke", action="store_true", help="skip the smoke test")
    report = sub.add_parser(
        "report",
        help="what a run did and why it stopped",
        description="Steps, final and best metrics, failure counters, plots, the last error and "
        "how to resume, from a run directory alone.",
    )
    report.add_argument("run_dir", metavar="RUN_DIR")
    report.add_argument(
        "--html",
        nargs="?",
        const="",
        metavar="OUT",
        help="also write the run as one self-contained HTML page (curves of every metric, "
        "config, failures, a sample browser) to OUT (default: RUN_DIR/report.html)",
    )
    cli_models.add_parsers(sub)  # eval, export, serve
    sub.add_parser(
        "launch",
        help="torchrun, returning the workers' exit codes (3, 4, 5, 6) instead of 1",
        description="`reinforge launch [torchrun options] -m reinforge train ...`: see "
        "docs/distributed.md",
    )
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("reinforge")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed)"


def set_allocator_default() -> None:
    """Expandable segments for PyTorch's CUDA allocator unless the user configured it: a step
    alternates the engine's KV pool (one large block, freed for the update) with the trainer's
    activations, and with fixed segments the update's freed blocks stay split, so the pool's
    next allocation found 30 GiB reserved but unusable (G3, 30B-A3B on one H200, step 2)."""
    import os

    if not (os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")):
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["launch"]:  # torchrun's own arguments follow: no parsing of ours
        from reinforge.launch import launch

        return launch(argv[1:], parse_command=build_parser().parse_known_args)
    code = run_main(argv)
    record_exit(code)  # for `reinforge launch`, which torchrun would otherwise tell only "1"
    return code


def run_main(argv: list[str]) -> int:
    set_allocator_default()
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    unknown = [x for x in extra if "=" not in x or x.startswith("-")]
    if unknown:
        parser.error(
            f"unrecognized arguments: {' '.join(unknown)} (overrides look like section.key=value)"
        )
    if extra:
        args.overrides = [*getattr(args, "overrides", []), *extra]
    if args.command == "config-docs":
        from reinforge.config.docs import render

        text = render()
        if args.output:
            Path(args.output).write_text(text)
        else:
            sys.stdout.write(text)
        return ExitCode.OK
    try:
        if args.command in ("doctor", "report"):
            return run_checkup(args)
        if args.command in cli_models.HANDLERS:
            return cli_models.HANDLERS[args.command](args)
        return run_command(args)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return ExitCode.CONFIG_ERROR
    except RunFailure as e:
        print(f"run failed: {e}", file=sys.stderr)
        return ExitCode.RUNTIME_FAILURE


EXIT_CODES_HELP = """exit codes (every command):
  0  success
  1  runtime failure (traceback in RUN_DIR/error.txt, error.rank{r}.txt for rank r)
  2  configuration error (the message names the setting and a value that works)
  3  stopped by a signal after saving a checkpoint (resume with --resume RUN_DIR)
  4  hang: no progress for watchdog.timeout_s (stacks in RUN_DIR/hang.txt)
  5  nothing trained: the run was already at run.max_steps
  6  another process of a torchrun job died or froze (checkpoints intact; resume on any number
     of nodes); `reinforge launch` passes 3, 4, 5 and 6 on, torchrun turns them into 1"""


def run_checkup(args) -> int:
    """`reinforge doctor` and `reinforge report`."""
    if args.command == "report":
        from reinforge.report import build_report, print_run_report

        print_run_report(build_report(Path(args.run_dir)))
        if args.html is not None:
            from reinforge.report.page import write_html_report

            page = write_html_report(Path(args.run_dir), Path(args.html) if args.html else None)
            print(f"html report: {page} (open it in a browser; one file, works offline)")
        return ExitCode.OK
    from reinforge.doctor import print_report, run_doctor

    config, overrides = args.config, list(args.overrides)
    if config and "=" in config and not Path(config).exists():
        config, overrides = None, [config, *overrides]
    report = run_doctor(config, overrides, args.command_name, smoke=not args.no_smoke)
    print_report(report)
    return report.exit_code


NO_CONFIG = (
    "reinforge {command} needs a config: e.g. `reinforge {command} configs/quickstart.toml` (the "
    "built-in demo, minutes on a CPU); continue a run with `reinforge {command} --resume "
    "RUN_DIR`; to start from the built-in defaults on purpose, give the settings you mean as "
    "section.key=value (e.g. `reinforge {command} model.path=Qwen/Qwen2.5-0.5B-Instruct`)"
)


def run_command(args) -> int:
    from reinforge.config import ROOTS, load_config

    overrides = list(args.overrides)
    config_path = args.config
    if config_path and "=" in config_path and not Path(config_path).exists():
        overrides.insert(0, config_path)
        config_path = None
    args.config_changes = []
    if args.resume:
        from reinforge.config.resume import resume_config

        cfg, args.config_changes = resume_config(
            args.command,
            ROOTS[args.command],
            Path(args.resume),
            config_path,
            overrides,
            args.allow_changes,
        )
    else:
        if args.allow_changes:
            raise ConfigError(
                "--allow-changes goes with --resume RUN_DIR (a new run has no "
                "earlier settings to change)"
            )
        if config_path is None and not overrides and not args.dry_run:
            raise ConfigError(NO_CONFIG.format(command=args.command))
        cfg = load_config(ROOTS[args.command], config_path, overrides)

    from reinforge import distributed
    from reinforge.preflight import run_preflight

    dist_cfg = distributed_settings(cfg)
    # under torchrun (one process: nothing)
    distributed.init_from_env(
        cfg.run.device,
        disaggregated=dist_cfg.mode == "disaggregated",
        timeout_s=dist_cfg.collective_timeout_s,
        generators=dist_cfg.generators,
    )
    try:
        if distributed.is_launched():  # every process runs the same settings, or none runs
            from reinforge.cluster import check_agreement, where_rank0_is

            args.node_labels = check_agreement(cfg)
            if distributed.local_rank() == 0:  # one line per node: where rank 0's output is
                print(where_rank0_is(args.node_labels), file=sys.stderr)
        pf = run_preflight(cfg)
        if args.dry_run:
            from reinforge.cli.output import annotated_toml, print_preflight

            print(annotated_toml(cfg))
            print_preflight(pf, cfg)
            pf.raise_if_failed()
            from reinforge.estimate import estimate_run

            print("\n".join(estimate_run(cfg).lines()))
            print("dry run: config and budgets OK; nothing was trained")
            return ExitCode.OK
        pf.raise_if_failed()
        if distributed.is_main():
            for warning in pf.warnings:
                print(f"warning: {warning}", file=sys.stderr)
        return execute(args, cfg)
    finally:
        distributed.shutdown()


def distributed_settings(cfg):
    """`[distributed]` of a config (its defaults for a root without the section)."""
    from reinforge.config import DistributedSection

    return getattr(cfg, "distributed", None) or DistributedSection()


def execute(args, cfg) -> int:
    from reinforge.config import to_toml
    from reinforge.distributed import is_main
    from reinforge.run import RunContext, guarded, run_dir_of

    ctx = RunContext(
        run_dir_of(cfg),
        resume=bool(args.resume),
        overwrite=cfg.run.overwrite,
        config_toml=to_toml(cfg),
        on_damaged=cfg.checkpoint.on_damaged,
    )
    ctx.install_signal_handlers()
    if args.config_changes and is_main():
        from reinforge.config.resume import record_changes

        record_changes(ctx.run_dir, args.config_changes)
    from reinforge import cluster_heartbeat

    labels = getattr(args, "node_labels", None)
    if labels:
        timeout = distributed_settings(cfg).heartbeat_timeout_s
        cluster_heartbeat.start(labels, timeout, ctx.run_dir, args.command)
    try:
        with guarded(cfg, ctx):
            code = finish(args, cfg, ctx)
    except BaseException as e:
        cluster_heartbeat.stop(f"{type(e).__name__}: {e}")
        raise
    failed = code not in (ExitCode.OK, ExitCode.STOPPED_AFTER_SAVE, ExitCode.NOTHING_TRAINED)
    cluster_heartbeat.stop(f"exit code {int(code)}" if failed else None)
    return code


def finish(args, cfg, ctx) -> int:
    """Run the command; every way it ends becomes a summary, a file in the run directory for
    `reinforge report`, and an exit code."""
    from reinforge.cli.output import print_summary
    from reinforge.config.resume import change_notes
    from reinforge.distributed import is_main
    from reinforge.report import headline_rows, run_counters
    from reinforge.run import Stopped

    try:
        if args.command == "train":
            from reinforge.train.loop.rl import train

            summary = train(cfg, ctx)
        else:
            from reinforge.train.loop.sft_run import run_sft

            summary = run_sft(cfg, ctx)
    except Stopped as stop:
        if is_main():  # one process speaks for the job
            print(f"\nstopped by {stop.signal_name}; checkpoint saved at {stop.checkpoint}")
            from reinforge.cluster import resume_line

            print(f"resume with: {resume_line(args.command, ctx.run_dir)}")
        return ExitCode.STOPPED_AFTER_SAVE
    except RunFailure as e:
        error_file(ctx).write_text(f"{type(e).__name__}: {e}\n")
        raise
    except ConfigError:
        raise
    except KeyboardInterrupt as e:
        print(
            f"\ninterrupted: {e}; no checkpoint was written for the current step", file=sys.stderr
        )
        return ExitCode.RUNTIME_FAILURE
    except (
        Exception
    ) as e:  # the one place a run's unexpected failure becomes a summary and an exit code
        from reinforge.cluster_heartbeat import explain_failure

        explained = explain_failure(e, ctx.run_dir, args.command)
        if explained is not None:  # a lost peer, a timeout, a mismatch: said in one line
            return explained[1]
        traceback.print_exc()
        error_file(ctx).write_text(traceback.format_exc())
        print(
            f"\nrun failed after {ctx.elapsed():.0f}s: {type(e).__name__}: {e}\n"
            f"run directory: {ctx.run_dir} (traceback in {error_file(ctx).name})",
            file=sys.stderr,
        )
        return ExitCode.RUNTIME_FAILURE
    summary.wall_s = ctx.elapsed()
    summary.counters = run_counters(ctx.run_dir)
    summary.extra["headlines"] = headline_rows(ctx.run_dir)
    summary.notes += change_notes(summary, args.config_changes)
    if not is_main():  # rank 0 speaks for the run
        return ExitCode.OK if summary.steps_trained else ExitCode.NOTHING_TRAINED
    print_summary(summary)
    if summary.steps_trained == 0:
        print(
            f"nothing was trained: the run is already at step {summary.final_step} of run.max_steps = "
            f"{cfg.run.max_steps}; raise run.max_steps to train further (reinforge {args.command} "
            f"--resume {ctx.run_dir} run.max_steps={cfg.run.max_steps * 2} --allow-changes)",
            file=sys.stderr,
        )
        return ExitCode.NOTHING_TRAINED
    return ExitCode.OK


def error_file(ctx) -> Path:
    """Where a failure's traceback goes: error.txt, error.rank{r}.txt for other global ranks
    (a disaggregated run's generator included)."""
    from reinforge.cluster import error_path

    return error_path(ctx.run_dir)


if __name__ == "__main__":
    sys.exit(main())
