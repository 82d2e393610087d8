"""`reinforge eval MODEL [CONFIG.toml] [section.key=value ...] [--data PATH ...]`: score a model
on held-out tasks or data files; print a table, write JSON.

MODEL is anything `reinforge.models.inference.resolve_model` reads. When it is a run or one of
its checkpoints, the config starts from the run's own `config.toml`: its `[task]`, its `[eval]`
sampling settings, `rollout.max_new_tokens` as the generation budget, its seed and device. A
CONFIG file's sections replace those whole; overrides change single keys. `--data PATH` scores
data files instead of the run's task (`task.name = "dataset"`, columns found by their usual
names, `task.columns.*` overrides for others).

The tasks scored are the task's held-out tasks; for a dataset that selects none (no eval_path,
eval_split or eval_fraction), every row of its files: nothing is trained here, so the file is
the evaluation set. Scoring is `reinforge.eval.evaluate`, the code training validates with.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

from reinforge.errors import ConfigError, ExitCode
from reinforge.eval.answers import TOP_ACCURACY, TOP_SHARE, answer_spread

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEFAULT_MAX_NEW_TOKENS = 512
INHERITED_RUN_KEYS = ("seed", "device", "dtype", "num_threads")


def run_eval_command(args) -> int:
    from reinforge.config import EvalConfig, load_config
    from reinforge.models.inference import resolve_model

    ref = resolve_model(args.model)
    base = run_config_base(ref.run_dir) if ref.run_dir is not None else {}
    if args.data:
        if args.config and "task" in tomllib.loads(Path(args.config).read_text()):
            raise ConfigError(
                f"--data and the [task] of {args.config} both choose what to evaluate; use one"
            )
        base["task"] = {"name": "dataset", "path": list(args.data)}
    config = args.config
    if config is not None and is_training_config(Path(config)):
        # the TOML the model was trained with: its task and evaluation settings, the rest ignored
        base = {**base, **eval_sections(tomllib.loads(Path(config).read_text()))}
        if args.data:
            base["task"] = {"name": "dataset", "path": list(args.data)}
        print(f"{config}: a training config; evaluating with its [task] and [eval] sampling")
        config = None
    cfg = load_config(EvalConfig, config, args.overrides, base)
    result, budget, source_name = score(args, cfg)
    print(result.table, end="")
    blind = blind_answers_line(answer_spread(result.samples))
    if blind:
        print(blind)
    if result.episode_metrics:
        print(", ".join(f"{k} {v:.3g}" for k, v in sorted(result.episode_metrics.items())))
    out = Path(args.output) if args.output else default_output(ref, source_name)
    write_results(out, args.model, ref, cfg, budget, result)
    print(f"results: {out}")
    return ExitCode.OK


def score(args, cfg):
    """(EvalResult, the generation budget used, the task source's name)."""
    import torch

    from reinforge.eval import evaluate
    from reinforge.server.loading import load_served_model
    from reinforge.tasks import build_task_source

    if cfg.run.num_threads:
        torch.set_num_threads(cfg.run.num_threads)
    served = load_served_model(args.model, args.engine, device=cfg.run.device, dtype=cfg.run.dtype)
    source = build_task_source(cfg.task, served.tokenizer, needs_answers=True)
    tasks = tasks_to_score(source)[: cfg.eval.num_tasks]
    budget = generation_budget(cfg, served, tasks)
    e = cfg.eval
    print(
        f"evaluating {args.model} on {len(tasks)} tasks x {e.samples_per_task} samples "
        f"(max_new_tokens {budget}, temperature {e.temperature}, {type(served.engine).__name__})"
    )
    result = evaluate(
        served.engine,
        served.tokenizer,
        source,
        tasks,
        budget,
        seed=cfg.run.seed,
        samples_per_task=e.samples_per_task,
        temperature=e.temperature,
        top_p=e.top_p,
    )
    return result, budget, source.name


def blind_answers_line(spread: dict[str, float]) -> str | None:
    """A warning when one answer was given to most tasks and is often wrong (eval/answers.py)."""
    if not spread or spread["eval_top_answer_share"] < TOP_SHARE:
        return None
    if spread["eval_top_answer_accuracy"] >= TOP_ACCURACY:
        return None
    return (
        f"note: {spread['eval_top_answer_share']:.0%} of the answers are one and the same text, "
        f"right on {spread['eval_top_answer_accuracy']:.0%} of those tasks: the model's answers "
        "barely depend on the question"
    )


def run_config_base(run_dir: Path) -> dict[str, Any]:
    """The sections of a run's config that evaluating it starts from."""
    from reinforge.config.load import read_saved_config

    path = run_dir / "config.toml"
    if not path.exists():
        return {}
    return eval_sections(read_saved_config(path))


def is_training_config(path: Path) -> bool:
    """A TOML with sections or [run] keys only training has (`reinforge train`'s config given to
    `reinforge eval`), as opposed to an evaluation config; a missing or broken file is not
    (load_config says what is wrong with it)."""
    try:
        raw = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return False
    run_keys = set(raw.get("run", {})) if isinstance(raw.get("run"), dict) else set()
    return bool(set(raw) - {"run", "task", "eval"} or run_keys - set(INHERITED_RUN_KEYS))


def eval_sections(trained: dict[str, Any]) -> dict[str, Any]:
    """What evaluating takes from a training config's table: [run]'s seed, device, dtype and
    threads, the [task], the [eval] settings that sample, and rollout.max_new_tokens as the
    budget unless [eval] sets one."""
    from reinforge.config import EvalSamplingSection

    base: dict[str, Any] = {
        "run": {k: v for k, v in trained.get("run", {}).items() if k in INHERITED_RUN_KEYS}
    }
    if "task" in trained:
        base["task"] = trained["task"]
    sampling = EvalSamplingSection.model_fields
    base["eval"] = {k: v for k, v in trained.get("eval", {}).items() if k in sampling}
    rollout_budget = trained.get("rollout", {}).get("max_new_tokens")
    if rollout_budget is not None:
        base["eval"].setdefault("max_new_tokens", rollout_budget)
    return base


def tasks_to_score(source) -> list:
    held_out = source.eval_tasks()
    # a dataset with no held-out selection: its rows, in file order, are the evaluation set
    return held_out if held_out else list(getattr(source, "train", []))


def generation_budget(cfg, served, tasks) -> int:
    """eval.max_new_tokens, or the default cut to what the context leaves; a set budget that
    does not fit the longest prompt is an error naming the value that would."""
    from reinforge.data.chat import render_prompt

    longest = max(len(render_prompt(served.tokenizer, t.messages)) for t in tasks)
    room = served.max_model_len - longest
    if room < 1:
        raise ConfigError(
            f"the longest prompt has {longest} tokens, the model's whole context "
            f"({served.max_model_len}); set task.max_prompt_tokens to skip such rows"
        )
    if cfg.eval.max_new_tokens is None:
        return min(DEFAULT_MAX_NEW_TOKENS, room)
    if cfg.eval.max_new_tokens > room:
        raise ConfigError(
            f"eval.max_new_tokens = {cfg.eval.max_new_tokens} does not fit: the longest prompt "
            f"has {longest} tokens of the model's {served.max_model_len}; set "
            f"eval.max_new_tokens <= {room}"
        )
    return cfg.eval.max_new_tokens


def default_output(ref, source_name: str) -> Path:
    """`RUN_DIR/eval/<checkpoint>_<task>.json` for a run's checkpoint, else
    `eval_<task>.json` in the working directory."""
    task = re.sub(r"[^\w.+-]", "_", source_name)
    if ref.run_dir is not None:
        return ref.run_dir / "eval" / f"{ref.checkpoint.name}_{task}.json"
    return Path(f"eval_{task}.json")


def write_results(out: Path, model: str, ref, cfg, budget: int, result) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    step = None
    if ref.checkpoint is not None and (ref.checkpoint / "trainer_state.json").exists():
        step = json.loads((ref.checkpoint / "trainer_state.json").read_text())
    doc = {
        "model": model,
        "checkpoint": str(ref.checkpoint) if ref.checkpoint else None,
        "trainer_state": step,
        "config": cfg.model_dump(mode="json"),
        "max_new_tokens": budget,
        "num_tasks": result.num_tasks,
        "samples_per_task": result.samples_per_task,
        "metrics": result.metrics,
        "episode_metrics": result.episode_metrics,  # env tasks: tool-call rate, win rate, ...
        "samples": result.samples,
    }
    out.write_text(json.dumps(doc, indent=2) + "\n")
