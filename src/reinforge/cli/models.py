"""The commands around a trained model: `reinforge eval`, `reinforge export`, `reinforge serve`.

Argument parsing and dispatch only; each command imports its machinery when it runs, so
`--help` stays instant. `eval` takes a config (its `[task]` is the one training uses, with a
dataset's columns and rewards, and evaluating a run starts from the run's own config); `export`
and `serve` are one-shot tools with a handful of flags, as `vllm serve` has, so they take
options, not a config file.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from reinforge.engine.factory import ENGINES
from reinforge.errors import ConfigError

MODEL_HELP = (
    "a run directory (its latest checkpoint), a checkpoint (RUN_DIR/step_000040 or its "
    "folder; a LoRA adapter is merged into its base), an HF model folder or hub name, or "
    "builtin:tiny"
)


def add_parsers(sub) -> None:
    _add_eval(sub)
    _add_export(sub)
    _add_serve(sub)


def _add_eval(sub) -> None:
    p = sub.add_parser(
        "eval",
        help="score a model on held-out tasks or data files: pass@k, mean@n, by data source",
        description="Score MODEL: n samples per task, pass@k (unbiased) and mean@n, accuracy by "
        "data_source, response lengths, truncation rate. Prints a table and writes JSON. A "
        "run's own [task] and [eval] are the starting config.",
    )
    p.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    p.add_argument("config", nargs="?", help="TOML config with [run], [task], [eval] (optional)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value")
    p.add_argument(
        "--data",
        action="append",
        metavar="PATH",
        help="score every row of this data file instead of the task (repeat for several)",
    )
    p.add_argument(
        "--output",
        "-o",
        help="JSON file to write (default: RUN_DIR/eval/<checkpoint>_<task>.json for a run, "
        "else eval_<task>.json here)",
    )
    p.add_argument("--engine", choices=ENGINES, default="auto", help="generation engine")


def _add_export(sub) -> None:
    p = sub.add_parser(
        "export",
        help="write a checkpoint as a standalone HF model (or a PEFT adapter), checked",
        description="Export SOURCE to OUT with weights, config, tokenizer and chat template. "
        "The export is reloaded with transformers and must reproduce the trainer's next-token "
        "distributions (and, for LoRA, differ from the base); else nothing is written.",
    )
    p.add_argument("source", metavar="RUN_DIR[/step]", help="a run directory or checkpoint")
    p.add_argument("out", metavar="OUT", help="folder to write (must not exist, or be empty)")
    p.add_argument(
        "--mode",
        choices=["merged", "adapter", "full"],
        default="merged",
        help="merged: a standalone model (LoRA merged into its base in float32); adapter: the "
        "PEFT adapter alone; full: a full-model checkpoint as it is (default: merged)",
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        help="dtype of the saved weights (default: the base model's)",
    )
    p.add_argument("--base", help="base model of a LoRA adapter, when it has moved")
    p.add_argument("--tolerance", type=float, help="largest KL allowed to the trainer's model")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it holds files")
    p.add_argument("--device", default="cpu", help="device for the check (default: cpu)")


def _add_serve(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve MODEL at /v1/chat/completions (tools, n, temperature, top_p, "
        "max_tokens, stop, logprobs, streaming), /v1/completions and /v1/models.",
    )
    p.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--engine", choices=ENGINES, default="auto", help="generation engine")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    p.add_argument("--served-model-name", help="the model name clients send (default: MODEL)")
    p.add_argument(
        "--tool-parser",
        default="auto",
        help="hermes, llama3_json or mistral (default: auto, from the chat template)",
    )
    p.add_argument("--max-model-len", type=int, help="context limit per request")
    p.add_argument(
        "--max-request-mb",
        type=float,
        help="largest request body in MiB; a larger one gets 413 (default: 8)",
    )
    p.add_argument(
        "--max-completions-per-request",
        type=int,
        help="most completions (prompts x n) one request may ask for; more get 400 (default: 256)",
    )
    p.add_argument("--log-level", default="info", help="uvicorn log level")


def run_eval(args) -> int:
    from reinforge.eval.run import run_eval_command

    if args.config and "=" in args.config and not Path(args.config).exists():
        args.overrides, args.config = [args.config, *args.overrides], None
    return run_eval_command(args)


def run_export(args) -> int:
    from reinforge.export import export

    _refuse_overrides(args, "--mode, --dtype, --base, --tolerance, --overwrite, --device")
    report = export(
        args.source,
        args.out,
        args.mode,
        base=args.base,
        dtype=args.dtype,
        tolerance=args.tolerance,
        overwrite=args.overwrite,
        device=args.device,
    )
    print(report.summary())
    return 0


def run_serve(args) -> int:
    from reinforge.server import serve

    _refuse_overrides(
        args,
        "--host, --port, --engine, --device, --dtype, --max-model-len, --max-request-mb, "
        "--max-completions-per-request",
    )
    serve(
        args.model,
        args.host,
        args.port,
        args.engine,
        device=args.device,
        dtype=args.dtype,
        served_model_name=args.served_model_name,
        tool_parser=args.tool_parser,
        max_model_len=args.max_model_len,
        log_level=args.log_level,
        limits=server_limits(args),
    )
    return 0


def server_limits(args):
    """`ServerLimits` from the flags given (its own defaults for the others)."""
    from reinforge.server.limits import ServerLimits

    given = {}
    if args.max_request_mb is not None:
        if not args.max_request_mb > 0:
            raise ConfigError(f"--max-request-mb {args.max_request_mb:g} must be > 0; e.g. 8")
        given["max_request_bytes"] = int(args.max_request_mb * 2**20)
    if args.max_completions_per_request is not None:
        if args.max_completions_per_request < 1:
            raise ConfigError(
                f"--max-completions-per-request {args.max_completions_per_request} must be "
                ">= 1; e.g. 256"
            )
        given["max_completions"] = args.max_completions_per_request
    return ServerLimits(**given)


def _refuse_overrides(args, options: str) -> None:
    extra = getattr(args, "overrides", None)
    if extra:
        raise ConfigError(
            f"reinforge {args.command} takes no config settings ({' '.join(extra)}); its "
            f"options are {options} (see reinforge {args.command} --help)"
        )


HANDLERS: dict[str, Callable[[argparse.Namespace], int]] = {
    "eval": run_eval,
    "export": run_export,
    "serve": run_serve,
}
