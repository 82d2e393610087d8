"""The package's layers, checked on the static import graph: the allowed order is written once
(`LAYERS`, lowest first), a module imports only its own layer and those below, and no module
imports itself back through others. Imports inside functions and under `TYPE_CHECKING` count
too: they hide a dependency, they do not remove it. docs/architecture.md explains the layers."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import reinforge

PACKAGE = Path(reinforge.__file__).parent

# Lowest first. An entry names a module or a package (and everything under it); the longest entry
# that matches a module places it. A module of layer i may import layers 0..i.
LAYERS = [
    ["reinforge.errors", "reinforge.types"],
    # process-wide services: hang watchdog, fault drills, metrics sinks, torchrun helpers
    [
        "reinforge.watchdog",
        "reinforge.faults",
        "reinforge.metrics",
        "reinforge.distributed",
        "reinforge.sharding",
    ],
    # pure parts: tensors and text in, numbers out
    ["reinforge.algorithms", "reinforge.rewards", "reinforge.data"],
    [
        "reinforge.config",
        "reinforge.config.base",
        "reinforge.config.algorithm",
        "reinforge.config.data",
        "reinforge.config.envs",
        "reinforge.config.load",
        "reinforge.config.branching",
        "reinforge.config.resilience",
        "reinforge.config.rewards",
        "reinforge.config.tasks",
        "reinforge.config.docs",
        "reinforge.config.resume",
    ],
    ["reinforge.tasks", "reinforge.envs"],
    ["reinforge.engine"],
    # a run's saved state on disk (below models: `models` finds a run's checkpoints)
    [
        "reinforge.checkpoint",
        "reinforge.checkpoint.files",
        "reinforge.checkpoint.manifest",
        "reinforge.checkpoint.sharded",
    ],
    ["reinforge.models"],
    [
        "reinforge.rollout",
        # the OpenAI endpoint's serving parts: agent rollouts serve the policy through them in
        # process (server/loading.py, which loads a model for `reinforge serve`, stays above)
        "reinforge.server.app",
        "reinforge.server.backend",
        "reinforge.server.batching",
        "reinforge.server.detokenize",
        "reinforge.server.in_process",
        "reinforge.server.limits",
        "reinforge.server.protocol",
        "reinforge.server.recording",
        "reinforge.server.responses",
    ],
    ["reinforge.eval", "reinforge.eval.metrics"],
    # one run's process: its directory and summary, and the checks across a cluster's ranks
    ["reinforge.run", "reinforge.cluster", "reinforge.cluster_heartbeat"],
    ["reinforge.train"],
    # what one command adds on top of training and evaluation
    [
        "reinforge.preflight",
        "reinforge.estimate",
        "reinforge.doctor",
        "reinforge.export",
        "reinforge.server",
        "reinforge.eval.run",
        "reinforge.report",
        "reinforge.report.page",
    ],
    # the commands; `launch` (torchrun around them) is handed the CLI's parser, never imports it
    [
        "reinforge.cli",
        "reinforge.cli.models",
        "reinforge.cli.output",
        "reinforge.__main__",
        "reinforge.launch",
    ],
]


def module_paths(package: Path = PACKAGE, name: str = "reinforge") -> dict[str, Path]:
    """Every module under `package` by dotted name; the root package itself (which holds only the
    version) is left out, so `from reinforge import faults` is an edge to `reinforge.faults`."""
    modules = {}
    for path in package.rglob("*.py"):
        parts = (name, *path.relative_to(package).with_suffix("").parts)
        modules[".".join(parts).removesuffix(".__init__")] = path
    modules.pop(name)
    return modules


def imports_of(name: str, path: Path, modules: set[str]) -> set[str]:
    """The package's modules `name` imports, wherever the import statement stands."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, up level - 1
                here = name.split(".")[: len(name.split(".")) - node.level + is_package]
                base = ".".join([*here, *([node.module] if node.module else [])])
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}  # `from pkg import module`
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return {m for m in found if m in modules and m != name}


@functools.cache
def import_graph(package: Path = PACKAGE, name: str = "reinforge") -> dict[str, set[str]]:
    modules = module_paths(package, name)
    return {name: imports_of(name, path, set(modules)) for name, path in modules.items()}


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def layer_of(module: str, layers: list[list[str]] = LAYERS) -> int | None:
    """The layer of the longest entry that is `module` or a package above it."""
    best, best_len = None, -1
    for i, entries in enumerate(layers):
        for entry in entries:
            if (module == entry or module.startswith(entry + ".")) and len(entry) > best_len:
                best, best_len = i, len(entry)
    return best


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan). A package's `__init__` is a
    module like the others: a submodule that imports names from its own package while the
    package imports it is a cycle (one that import order alone keeps working)."""
    edges = {k: sorted(v) for k, v in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(edges[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    work.append((child, iter(edges[child])))
                elif child in stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def upward_imports(
    graph: dict[str, set[str]], layers: list[list[str]] = LAYERS
) -> list[tuple[str, str]]:
    return sorted(
        (a, b)
        for a, targets in graph.items()
        for b in targets
        if layer_of(b, layers) > layer_of(a, layers)
    )


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in import_graph() if layer_of(m) is None)
    assert not unplaced, f"add these modules to a layer in LAYERS: {unplaced}"


def test_no_module_imports_a_layer_above_its_own():
    graph = import_graph()
    assert all(layer_of(m) is not None for m in graph)
    bad = [
        f"{a} (layer {layer_of(a)}) imports {b} (layer {layer_of(b)})"
        for a, b in upward_imports(graph)
    ]
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    assert not cycles(import_graph())


def test_the_checks_catch_a_cycle_and_an_upward_import():
    """On a synthetic graph: the same functions fail what they should."""
    graph = {
        "reinforge.low": {"reinforge.high.a"},  # upward
        "reinforge.high": set(),
        "reinforge.high.a": {"reinforge.high.b"},
        "reinforge.high.b": {"reinforge.high.c"},
        "reinforge.high.c": {"reinforge.high.a", "reinforge.low", "reinforge.high"},
    }
    layers = [["reinforge.low"], ["reinforge.high"]]
    assert upward_imports(graph, layers) == [("reinforge.low", "reinforge.high.a")]
    assert cycles(graph) == [
        ["reinforge.high.a", "reinforge.high.b", "reinforge.high.c", "reinforge.low"]
    ]
    graph["reinforge.low"] = set()
    graph["reinforge.high.c"] = {"reinforge.low", "reinforge.high"}
    assert cycles(graph) == [] and upward_imports(graph, layers) == []
    graph["reinforge.high"] = {"reinforge.high.a"}  # the package re-exports what imports it
    assert cycles(graph) == [
        ["reinforge.high", "reinforge.high.a", "reinforge.high.b", "reinforge.high.c"]
    ]


def test_the_graph_reads_every_kind_of_import(tmp_path):
    """Relative, absolute, `from package import module`, inside a function, type-only."""
    files = {
        "__init__.py": "",
        "sub/__init__.py": "from .a import x\n",
        "sub/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.sub import b\n",
        "sub/b.py": "def f():\n    import pkg.sub.c\n    from . import a\n",
        "sub/c.py": "",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    graph = import_graph(tmp_path, "pkg")
    assert graph == {
        "pkg.sub": {"pkg.sub.a"},
        "pkg.sub.a": {"pkg.sub", "pkg.sub.b"},
        "pkg.sub.b": {"pkg.sub", "pkg.sub.a", "pkg.sub.c"},
        "pkg.sub.c": set(),
    }
    # importing from a package runs its __init__, which imports `a` back
    assert cycles(graph) == [["pkg.sub", "pkg.sub.a", "pkg.sub.b"]]


def test_rollout_imports_neither_training_nor_evaluation():
    graph = import_graph()
    rollout = [m for m in graph if m.startswith("reinforge.rollout")]
    assert len(rollout) >= 5, rollout
    forbidden = ("reinforge.train", "reinforge.eval")
    for module in rollout:
        bad = sorted(m for m in reachable(graph, module) if m.startswith(forbidden))
        assert not bad, f"{module} reaches {bad}"
    # and both of them do import it
    assert any(m.startswith("reinforge.rollout") for m in graph["reinforge.train.loop.rl"])
    assert any(m.startswith("reinforge.rollout") for m in graph["reinforge.eval"])
