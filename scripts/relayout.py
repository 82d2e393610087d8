"""Move reinforge's modules into the packages that name its architecture, and rewrite every
reference to them (issue 28). Run once, on a clean checkout, from the repository root:

    python scripts/relayout.py            # moves with `git mv`, rewrites, prints a summary
    python scripts/relayout.py --dry-run  # prints the moves and counts, changes nothing

The moves come from rules over the files present, so modules added since this script was written
move too: a top-level `config_X.py` becomes `config/X.py`, and likewise for the `cli`,
`checkpoint`, `eval` and `report` prefixes; a module named like its new package (`config.py`,
`train/packing.py`) becomes that package's `__init__.py`, so `reinforge.config`,
`reinforge.checkpoint`, `reinforge.eval` and `reinforge.cli:main` keep their names; `train/` is
split by the table `TRAIN` (and the prefixes `planner_`, `packing_`, `sft_`); a `train/` module
the table does not know stays where it is and is listed. Each new package gets an `__init__`
docstring saying what it owns and what it may import (`PACKAGE_DOCS`).

References are rewritten from one table (old dotted name -> new dotted name) in every text file
of the repository but this script: imports (`from reinforge.train import rl` becomes
`from reinforge.train.loop import rl`), dotted names anywhere (`mock.patch("reinforge.train.rl.x")`,
`python -m reinforge.x`, `reinforge.x:fn` paths, docs), file paths (`src/reinforge/train/rl.py`,
`train/rl.py`) and the short names the docs use (`train.memory`, `config_tasks`).

Second run: the script sees `src/reinforge/config/` and stops, changing nothing. Saved run
directories store no module path that moves (reward and env paths name `reinforge.rewards` /
`reinforge.envs`, which stay), so old runs resume as before.
"""

from __future__ import annotations

import argparse
import ast
import io
import re
import shutil
import subprocess
import sys
import tokenize
from pathlib import Path

SRC = Path("src/reinforge")
PREFIX_PACKAGES = ("config", "cli", "checkpoint", "eval", "report")
EXTRA_MOVES = {  # top-level files no prefix rule places, or places under a confusing name
    "resume_config.py": "config/resume.py",
    "report_html.py": "report/page.py",  # not `report.html`, the page a run writes
    "report_page.html": "report/page.html",
}
TRAIN = {
    "loop": [
        "rl",
        "session",
        "learner",
        "update",
        "advantage_step",
        "diagnostics",
        "disaggregated",
        "nonfinite",
        "sft_run",  # the `reinforge sft` run: built from the session, like the RL loop
    ],
    "packing": ["packing", "packing_plan", "packed_attention", "forward", "logprobs"],
    "planner": ["planner", "planner_rows", "planner_sizes", "memory", "lengths"],
    "policy": ["policy_model", "lora", "value", "optim", "moe"],
    "sft": ["sft", "demos"],
}
TRAIN_PREFIXES = ("planner", "packing", "sft")
TRAIN_NAMES = {  # a train module's name in its package, where not the prefix-less stem
    "packed_attention": "attention",
    "policy_model": "model",
}
STALE = {"reinforge.train.common": "reinforge.models.loading"}  # split before the move
TEXT_SUFFIXES = {".py", ".md", ".toml", ".txt", ".cfg", ".ini", ".sh", ".yml", ".yaml", ".json"}
SKIP_DIRS = {
    ".git",
    ".venv",
    "venv",
    "node_modules",
    "__pycache__",
    ".ruff_cache",
    "runs",
    "results",
}
SKIP_FILES = {"RESULTS.md"}  # measurement logs: they name the files as they were then

PACKAGE_DOCS = {
    "config": "The configuration: pydantic sections and one root per command (here, the import "
    "point), the `[algorithm]` union (`algorithm`), task sections (`tasks`, `data`, `envs`, "
    "`rewards`), loading with strict keys and overrides (`load`), a saved run's config for resume "
    "(`resume`) and the reference generator (`docs`). It may import `errors`, `types` and the pure "
    "parts' tables (`algorithms`, `data`), never torch, so `--help` and config errors are instant.",
    "cli": "The `reinforge` command (`main`, here): arguments and config parsed before torch is "
    "imported, one function per command, model commands (`models`) and the end-of-run output "
    "(`output`). The top layer: it may import anything, and only `__main__` imports it.",
    "checkpoint": "A run's saved state: atomic save and exact resume (here), the folder layout, "
    "`latest` pointer and publishing (`files`), per-file hashes (`manifest`) and the "
    "torch.distributed.checkpoint path (`sharded`). It may import `errors`, `faults` and "
    "`distributed`; it sits below `models`, which finds a run's checkpoints through it.",
    "eval": "Evaluation: `evaluate` (here) scores a policy on held-out tasks through the rollout "
    "package, `metrics` holds the estimators (pass@k, mean@n) and `run` the `reinforge eval` "
    "command. `eval` and `eval.metrics` may import `rollout`, `engine`, `envs` and below; "
    "`eval.run`, a command's module, also `models`, `server` and `config`.",
    "report": "The run report from a run directory alone: the summary (here) and one "
    "self-contained HTML page (`html`, `page.html`). It may import `metrics` and `errors`.",
    "train": "Training: the RL loop and its step (`loop`), packed micro-batches and their "
    "forward (`packing`), the memory plan made before any weights load (`planner`), the policy's "
    "parts (`policy`: model, LoRA, value head, optimizer) and SFT (`sft`). It may import every "
    "layer below it (`rollout`, `eval`, `run`, `models`, `engine`, ...), never a command's "
    "module (`cli`, `preflight`, `doctor`, `server`).",
    "train/loop": "The runs: `rl.train` and `rl.rl_step` (rollout, advantages, update, log, "
    "save), the `reinforge sft` run (`sft_run`), the session both build on (`session`: setup, "
    "the SFT phase, checkpoints), the learner and its update, the advantage step, diagnostics, "
    "the disaggregated mode and the non-finite policy. It may import the other `train` packages "
    "and every layer below `train`; they never import it.",
    "train/packing": "Padding-free packing: micro-batches by token budget (here and `plan`), "
    "the packed attention paths (`attention`), the packed forward (`forward`) and the chunked "
    "LM-head logprobs (`logprobs`). It may import `engine` (the varlen kernels), `distributed` and "
    "below; nothing else in `train`.",
    "train/planner": "The memory plan, made before any weights load: the planner's arithmetic "
    "(here, `sizes`, `rows`), what it is told and what the run takes from it (`memory`), and the "
    "token lengths it sizes from (`lengths`). It may import `train.packing` (the LM head's chunk "
    "size), `train.policy.lora` (an adapter bound on the meta device), `train.sft.demos` "
    "(reference episodes' lengths) and the layers below `train`.",
    "train/policy": "The policy's parts: loading it with its engine (`model`), LoRA (`lora`), "
    "PPO's value head (`value`) and the optimizer (`optim`). It may import `train.packing` and "
    "the layers below `train`.",
    "train/sft": "Supervised fine-tuning: the step and the validation loss (here) and reference "
    "episodes of env tasks (`demos`). It may import `train.packing`, `train.policy` and the "
    "layers below `train`.",
}

README_LAYOUT = """```
src/reinforge/
  config/          pydantic sections and roots (`reinforge.config`, the import point), the
                   [algorithm] union, task sections, loading (strict keys, overrides), resume
  cli/             thin entry point (torch is imported only when a command needs it)
  tasks/           built-in procedural tasks with held-out splits (arithmetic, countdown)
  models/          loading a model and tokenizer, the built-in tiny Qwen2 + byte-level tokenizer
  engine/          the Engine interface and factory, the simple engine, the paged engine
  algorithms/      advantages, losses, KL estimators: pure tensor functions
  rewards/         math-verify in killable workers, format rewards, weighted mixes
  envs/            the Env protocol (public API in envs/__init__), tools and parsers, the Python
                   sandbox, tool/game/HTML/search envs, `env_tasks.py` (an env with its tasks and
                   reward components), `sources.py` (the env variants of `[task]`), `user_env.py`
                   (`name = "env"`), `tools_task.py` (`name = "tools"`)
  rollout/         the one rollout path: sampling settings, the episode loop, trajectories,
                   where a step's groups come from (local or the disaggregated generator)
  train/           loop/ (the RL loop and step), packing/ (packed micro-batches and their
                   forward), planner/ (the memory plan), policy/ (model, LoRA, value head,
                   optimizer), sft/
  eval/            evaluation (pass@k, mean@n) and the `reinforge eval` command
  checkpoint/      atomic checkpoints and exact resume
  report/          `reinforge report`: the summary and the HTML page
  preflight.py     budgets checked before any model loads
  metrics.py       console, jsonl, TensorBoard, W&B, plots
```"""


# README cells that name modules relative to the one before them (`.packing_plan`), which no
# rule can read: (text after the rewrite, what it should say)
README_EDITS = [
    (
        "`reinforge.train.packing`, `.packing_plan`, `.packed_attention`, `.logprobs`, `.lora`, "
        "`.planner`",
        "`reinforge.train.packing` (`.plan`, `.attention`, `.logprobs`), "
        "`reinforge.train.policy.lora`, `reinforge.train.planner`",
    ),
    (
        "`reinforge.eval.metrics`, `.export`, `.server`",
        "`reinforge.eval.metrics`, `reinforge.export`, `reinforge.server`",
    ),
]


def plan_moves(root: Path) -> tuple[dict[str, str], dict[str, str], list[str]]:
    """(file moves relative to src/reinforge, module renames old -> new, train modules left)."""
    src = root / SRC
    moves: dict[str, str] = {}
    for path in sorted(src.glob("*.py")):
        for pkg in PREFIX_PACKAGES:
            if path.stem == pkg:
                moves[path.name] = f"{pkg}/__init__.py"
            elif path.stem.startswith(pkg + "_"):
                moves[path.name] = f"{pkg}/{path.stem.removeprefix(pkg + '_')}.py"
    moves |= {old: new for old, new in EXTRA_MOVES.items() if (src / old).exists()}
    known = {m: pkg for pkg, mods in TRAIN.items() for m in mods}
    left = []
    for path in sorted((src / "train").glob("*.py")):
        stem = path.stem
        if stem == "__init__":
            continue
        pkg = known.get(stem) or next((p for p in TRAIN_PREFIXES if stem.startswith(p + "_")), None)
        if pkg is None:
            left.append(f"train/{path.name}")
            continue
        name = TRAIN_NAMES.get(stem) or (
            "__init__" if stem == pkg else stem.removeprefix(pkg + "_")
        )
        moves[f"train/{path.name}"] = f"train/{pkg}/{name}.py"
    renames = dict(STALE)
    for old, new in moves.items():
        if old.endswith(".py") and module_name(old) != module_name(new):
            renames[module_name(old)] = module_name(new)
    assert not set(renames.values()) & set(renames), "a new name is an old one: ambiguous"
    return moves, renames, left


def module_name(rel: str) -> str:
    return "reinforge." + rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def rename(dotted: str, renames: dict[str, str]) -> str:
    """`dotted` with its longest renamed prefix replaced."""
    parts = dotted.split(".")
    for n in range(len(parts), 1, -1):
        head = ".".join(parts[:n])
        if head in renames:
            return ".".join([renames[head], *parts[n:]])
    return dotted


def rewrite_from_imports(text: str, renames: dict[str, str]) -> tuple[str, int]:
    """`from P import m` where P.m is a moved module: `from parent(new) import last(new) as m`.
    The module part of every other import is left to `rewrite_dotted`."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return text, 0
    lines = text.splitlines(keepends=True)
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line))
    edits = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module):
            continue
        moved = [a for a in node.names if f"{node.module}.{a.name}" in renames]
        if not moved:
            continue
        if "#" in text[offsets[node.lineno - 1] : offsets[node.end_lineno]]:
            print(f"  note: a comment inside a rewritten import was dropped (line {node.lineno})")
        statements = []
        kept = [a for a in node.names if a not in moved]
        if kept:
            names = ", ".join(a.name + (f" as {a.asname}" if a.asname else "") for a in kept)
            statements.append(f"from {node.module} import {names}")
        for a in moved:
            new = renames[f"{node.module}.{a.name}"]
            parent, _, last = new.rpartition(".")
            alias = a.asname or a.name
            statements.append(
                f"from {parent} import {last}" + (f" as {alias}" if alias != last else "")
            )
        indent = " " * node.col_offset
        start = offsets[node.lineno - 1] + node.col_offset
        end = offsets[node.end_lineno - 1] + node.end_col_offset
        edits.append((start, end, f"\n{indent}".join(statements)))
    for start, end, new in sorted(edits, reverse=True):
        text = text[:start] + new + text[end:]
    return text, len(edits)


DOTTED = re.compile(r"(?<![\w.])reinforge(?:\.[A-Za-z_]\w*)+")
PATH = re.compile(r"(?<![\w.-])(?:src/)?reinforge/([\w/]+\.(?:py|html))")


def rewrite_text(
    text: str, renames: dict[str, str], moves: dict[str, str], suffix: str
) -> tuple[str, int]:
    count = 0

    def sub(pattern, fn, s):
        nonlocal count

        def repl(m):
            nonlocal count
            new = fn(m)
            count += new != m.group(0)
            return new

        return pattern.sub(repl, s)

    text = sub(DOTTED, lambda m: rename(m.group(0), renames), text)

    def path_repl(m):
        rel = m.group(1)
        return m.group(0)[: m.start(1) - m.start(0)] + moves.get(rel, rel)

    text = sub(PATH, path_repl, text)
    # paths relative to the package (`train/rl.py`, `checkpoint_sharded.py` in prose)
    short_paths = {k: v for k, v in moves.items() if "/" in k or "_" in k}
    if short_paths:
        alternation = "|".join(sorted(map(re.escape, short_paths), key=len, reverse=True))
        short = re.compile(rf"(?<![\w/.-])({alternation})(?![\w/])")
        text = sub(short, lambda m: short_paths[m.group(1)], text)
    # short dotted names the docs use (`train.memory`, `config_tasks`): in prose only, never in
    # code, where `config_load` or `eval_metrics` may be a variable
    shorts = {
        k.removeprefix("reinforge."): v.removeprefix("reinforge.") for k, v in renames.items()
    }
    shorts = {k: v for k, v in shorts.items() if "." in k or "_" in k}
    if shorts and suffix in (".md", ".py"):
        alternation = "|".join(sorted(map(re.escape, shorts), key=len, reverse=True))
        short = re.compile(rf"(?<![\w.])({alternation})(?![\w])")
        if suffix == ".md":
            text = sub(short, lambda m: shorts[m.group(1)], text)
        else:
            text = in_prose(text, lambda part: sub(short, lambda m: shorts[m.group(1)], part))
    return text, count


def in_prose(source: str, fn) -> str:
    """`source` (Python) with `fn` applied to its comments and triple-quoted strings only."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError):
        return source
    lines = source.splitlines(keepends=True)
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line))
    spans = []
    for tok in tokens:
        is_doc = tok.type == tokenize.STRING and tok.string.lstrip("rRbBuUfF")[:3] in ('"""', "'''")
        if tok.type == tokenize.COMMENT or is_doc:
            start = offsets[tok.start[0] - 1] + tok.start[1]
            end = offsets[tok.end[0] - 1] + tok.end[1]
            spans.append((start, end))
    for start, end in reversed(spans):
        source = source[:start] + fn(source[start:end]) + source[end:]
    return source


def package_docstring(pkg: str) -> str:
    body = PACKAGE_DOCS[pkg]
    words, lines, line = body.split(), [], '"""'
    for word in words:
        if len(line) + 1 + len(word) > 96:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line != '"""' else f'"""{word}'
    lines.append(line + '"""')
    return "\n".join(lines) + "\n"


def add_package_doc(path: Path, pkg: str) -> None:
    """A new `__init__.py` gets the paragraph; a moved module's docstring gets it first."""
    doc = package_docstring(pkg)
    if not path.exists() or not path.read_text().strip():
        path.write_text(doc)
        return
    text = path.read_text()
    tree = ast.parse(text)
    first = tree.body[0] if tree.body else None
    if len(tree.body) == 1 and isinstance(first, ast.Expr):  # only a docstring: replaced
        path.write_text(doc)
    elif isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
        paragraph = doc.removesuffix('"""\n')
        path.write_text(paragraph + "\n\n" + text.removeprefix('"""').lstrip())
    else:
        path.write_text(doc + "\n" + text)


def text_files(root: Path) -> list[Path]:
    this = Path(__file__).resolve()
    out = []
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for rel in listed:
        path = root / rel
        if path.suffix not in TEXT_SUFFIXES or not path.is_file():
            continue
        if set(Path(rel).parts) & SKIP_DIRS or path.name in SKIP_FILES or path.resolve() == this:
            continue
        out.append(path)
    return out


def replace_readme_layout(root: Path) -> bool:
    readme = root / "README.md"
    text = readme.read_text()
    block = re.compile(r"(## Layout\n\n)```\nsrc/reinforge/\n.*?```", re.S)
    new, n = block.subn(lambda m: m.group(1) + README_LAYOUT, text, count=1)
    for old, fixed in README_EDITS:
        if old in new:
            new = new.replace(old, fixed)
        else:
            print(f"  note: README no longer says {old!r}; check that cell by hand")
    readme.write_text(new)
    return bool(n)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    parser.add_argument("--allow-dirty", action="store_true", help="run on uncommitted changes")
    args = parser.parse_args()
    root = Path.cwd()
    if not (root / SRC / "__init__.py").exists():
        print(f"run from the repository root (no {SRC}/__init__.py here)", file=sys.stderr)
        return 2
    if (root / SRC / "config").is_dir():
        print("already applied (src/reinforge/config/ exists): nothing to do")
        return 0
    dirty = subprocess.run(
        ["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True, check=True
    ).stdout.strip()
    if dirty and not args.allow_dirty and not args.dry_run:
        print("the working tree has uncommitted changes; commit them first (or --allow-dirty)")
        return 2
    moves, renames, left = plan_moves(root)
    for old, new in moves.items():
        print(f"  {SRC}/{old} -> {SRC}/{new}")
    if args.dry_run:
        print(f"{len(moves)} files would move; {len(renames)} module names would change")
        return 0
    for old, new in moves.items():
        (root / SRC / new).parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "mv", str(SRC / old), str(SRC / new)], cwd=root, check=True)
    for pkg in PACKAGE_DOCS:
        add_package_doc(root / SRC / pkg / "__init__.py", pkg)
    files = rewrite_files(root, renames, moves)
    readme = replace_readme_layout(root)
    top = [p.name for p in (root / SRC).iterdir() if p.suffix == ".py"]
    print(
        f"moved {len(moves)} files into {len({Path(n).parent for n in moves.values()})} packages; "
        f"rewrote {sum(files.values())} references in {len(files)} files"
        + ("; README layout replaced" if readme else "")
    )
    print(f"top-level modules in {SRC}: {len(top)} ({', '.join(sorted(top))})")
    if left:
        print(f"left in train/ (no rule places them): {', '.join(left)}")
    lint = [d for d in ("src", "tests", "bench", "scripts", "examples") if (root / d).is_dir()]
    if shutil.which("ruff"):  # rewritten imports: sorted and formatted as the rest
        subprocess.run(["ruff", "check", "-q", "--select", "I", "--fix", *lint], cwd=root)
        subprocess.run(["ruff", "format", "-q", *lint], cwd=root)
    else:
        print(f"ruff not found: run `ruff check --select I --fix {' '.join(lint)}` and format")
    subprocess.run(["git", "add", "-A", str(SRC)], cwd=root, check=True)  # the new __init__s
    print("next: ruff check, the test suite, and a look at `git diff`")
    return 0


def rewrite_files(root: Path, renames: dict[str, str], moves: dict[str, str]) -> dict[str, int]:
    changed = {}
    for path in text_files(root):
        text = path.read_text(encoding="utf-8", errors="surrogateescape")
        new, n_imports = rewrite_from_imports(text, renames) if path.suffix == ".py" else (text, 0)
        new, n_names = rewrite_text(new, renames, moves, path.suffix)
        if path.name == "pyproject.toml":
            new = new.replace('"src/reinforge/config*.py"', '"src/reinforge/config/*.py"')
            new = new.replace('"report_page.html"', '"report/page.html"')
        if new != text:
            path.write_text(new, encoding="utf-8", errors="surrogateescape")
            changed[str(path.relative_to(root))] = n_imports + n_names
    return changed


if __name__ == "__main__":
    sys.exit(main())
