"""The layers of docs/design.md §2, checked on every import the source makes.

Every ``import``/``from ... import`` counts, also those inside functions (lazy imports) and
``importlib.import_module("literal")``; the check follows them transitively, so a module that
reaches an upper layer through a chain of allowed-looking imports fails too.

``python tests/test_dependencies.py`` prints the layer graph (each edge with one import that
makes it).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("agentenv", "algorithms", "envs")

# Each layer and the layers it may import (itself included). Bottom to top.
ALLOWED: dict[str, set[str]] = {
    "base": {"base"},  # agentenv.errors, agentenv.config: shared by every layer
    "env": {"base", "env"},  # the env contract, torch-free
    "envs": {"base", "env", "envs"},  # the bundled environments
    "lm": {"base", "env", "lm"},  # model runtime: models, precision, attention, sampler
    "rollout": {"base", "env", "lm", "rollout"},  # episodes, collection
    "algorithms": {"base", "env", "lm", "rollout", "algorithms"},
    "integrations": {"base", "env", "lm", "rollout", "integrations"},  # other RL libraries
    "run": {"base", "env", "envs", "lm", "rollout", "algorithms", "run"},
    "cli": {"base", "env", "envs", "lm", "rollout", "algorithms", "run", "integrations", "cli"},
}


def layer(module: str) -> str:
    """The layer a dotted module name belongs to."""
    top, _, rest = module.partition(".")
    if top == "agentenv":
        sub = rest.split(".")[0]
        if sub in {"", "errors", "config"}:
            return "base" if sub else "api"
        return {"env": "env", "lm": "lm", "rollout": "rollout", "run": "run"}.get(
            sub, "integrations" if sub == "integrations" else "cli"
        )
    return top  # algorithms, envs


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the three packages, by dotted name."""
    found = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imports_of(name: str, path: Path, known: set[str]) -> dict[str, int]:
    """The project modules ``name`` imports anywhere in its source, with a line of each."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: dict[str, int] = {}

    def add(target: str, line: int) -> None:
        while target and target not in known:  # `from a.b import name`: the module a.b
            target = target.rpartition(".")[0]
        if target and target != name:
            found.setdefault(target, line)

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                add(f"{base}.{alias.name}", node.lineno)  # a submodule, or a name in base
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            add(node.args[0].value, node.lineno)
    return found


def import_graph(root: Path = ROOT) -> dict[str, dict[str, int]]:
    files = module_files(root)
    return {name: imports_of(name, path, set(files)) for name, path in files.items()}


def violations(graph: dict[str, dict[str, int]]) -> list[str]:
    """Each module that reaches, directly or not, a layer its own layer may not import."""
    found = []
    for start in sorted(graph):
        if layer(start) == "api":  # the facade: checked by test_import_agentenv_is_light
            continue
        allowed = ALLOWED[layer(start)]
        parent: dict[str, str] = {start: ""}
        todo = [start]
        while todo:
            here = todo.pop()
            for target in graph[here]:
                if target in parent or layer(target) == "api":
                    continue
                parent[target] = here
                if layer(target) not in allowed:
                    chain, step = [target], here
                    while step:
                        chain.append(step)
                        step = parent[step]
                    found.append(f"{start} ({layer(start)}) reaches " + " <- ".join(chain))
                    continue
                todo.append(target)
    return found


def layer_edges(graph: dict[str, dict[str, int]]) -> dict[tuple[str, str], str]:
    edges: dict[tuple[str, str], str] = {}
    for source, targets in graph.items():
        for target, line in targets.items():
            pair = (layer(source), layer(target))
            if pair[0] != pair[1]:
                edges.setdefault(pair, f"{source}:{line} -> {target}")
    return edges


def test_no_module_reaches_an_upper_layer():
    assert violations(import_graph()) == []


def test_the_layer_graph_has_no_cycle():
    edges = set(layer_edges(import_graph()))
    order = list(ALLOWED)  # bottom to top
    assert all(order.index(a) > order.index(b) for a, b in edges if "api" not in (a, b)), edges


def module_cycles(graph: dict[str, dict[str, int]]) -> list[set[str]]:
    """Groups of modules that import each other, directly or not (strongly connected)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while not group or w != v:
                w = stack.pop()
                group.add(w)
            if len(group) > 1:
                cycles.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_module_imports_itself_through_others():
    """Not even through a lazy or type-only import: a cycle is two modules that cannot be
    understood (or changed) one without the other."""
    assert module_cycles(import_graph()) == []


def test_a_planted_upward_import_fails(tmp_path):
    """The check itself: copy the tree, plant one lazy import deep in a chain, expect it."""
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            target = tmp_path / path.relative_to(ROOT)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(path.read_text())
    planted = tmp_path / "agentenv" / "errors.py"
    planted.write_text(planted.read_text() + "\n\ndef _f():\n    import agentenv.run.train\n")
    found = violations(import_graph(tmp_path))
    assert any(v.startswith("agentenv.errors (base) reaches agentenv.run.train") for v in found)
    # indirectly: an env module that only imports agentenv.errors now reaches the run layer
    assert any(v.startswith("envs.calculator.env (envs) reaches") for v in found)


def test_import_agentenv_is_light():
    """`import agentenv` (what another RL library does to get the envs) loads no torch, and
    the package's own eager imports stay in the base and env layers."""
    code = "import sys, agentenv; print([m for m in ('torch', 'transformers') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    tree = ast.parse((ROOT / "agentenv" / "__init__.py").read_text())
    eager = {n.module for n in tree.body if isinstance(n, ast.ImportFrom)}
    assert {layer(m) for m in eager} <= {"base", "env"}, eager


if __name__ == "__main__":
    for (source, target), example in sorted(layer_edges(import_graph()).items()):
        print(f"{source:>12} -> {target:<12} e.g. {example}")
