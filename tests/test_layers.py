"""The rollout package sits beside the engine: training and evaluation import it, never the
reverse, and no import cycle runs through it. Checked on the static import graph (imports inside
functions count too: they hide a cycle, they do not remove it)."""

from __future__ import annotations

import ast
from pathlib import Path

import reinforge

PACKAGE = Path(reinforge.__file__).parent


def import_graph() -> dict[str, set[str]]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("reinforge", *path.relative_to(PACKAGE).with_suffix("").parts)
        modules[".".join(parts).removesuffix(".__init__")] = path
    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module)
                found |= {f"{node.module}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def test_rollout_imports_neither_training_nor_evaluation():
    graph = import_graph()
    rollout = [m for m in graph if m.startswith("reinforge.rollout")]
    assert len(rollout) >= 5, rollout
    forbidden = ("reinforge.train", "reinforge.eval")
    for module in rollout:
        bad = sorted(m for m in reachable(graph, module) if m.startswith(forbidden))
        assert not bad, f"{module} reaches {bad}"
    # and both of them do import it
    assert any(m.startswith("reinforge.rollout") for m in graph["reinforge.train.rl"])
    assert any(m.startswith("reinforge.rollout") for m in graph["reinforge.eval"])


def test_no_import_cycle_runs_through_the_rollout_package():
    graph = import_graph()
    packages = {m for m in graph if (PACKAGE.parent / m.replace(".", "/")).is_dir()}
    edges = {k: v - packages for k, v in graph.items()}  # an __init__ re-export is no cycle
    for module in (m for m in graph if m.startswith("reinforge.rollout")):
        assert module not in reachable(edges, module), f"{module} imports itself back"
