"""The dependency direction of docs/design.md §2, checked on the source's imports."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP_LAYER = {"train", "sft", "cli"}  # the training loop and CLI import both sides
CONTRACTS = {
    "agentenv.rollout.episode",
    "agentenv.errors",
    "agentenv.config",
    "agentenv.lm.attention",
    "agentenv.lm.precision",
}


def imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_algorithms_import_only_agentenvs_contracts():
    for path in sorted((ROOT / "algorithms").glob("*.py")):
        used = {m for m in imports(path) if m.split(".")[0] == "agentenv"}
        assert used <= CONTRACTS, f"{path.name} imports {sorted(used - CONTRACTS)}"


def test_only_the_top_layer_of_agentenv_imports_algorithms():
    for path in sorted((ROOT / "agentenv").rglob("*.py")):  # integrations/ included
        used = {m for m in imports(path) if m.split(".")[0] == "algorithms"}
        assert not used or path.stem in TOP_LAYER, f"{path.name} imports {sorted(used)}"


def test_the_contracts_import_no_algorithm():
    for name in CONTRACTS:
        path = ROOT / (name.replace(".", "/") + ".py")
        assert not {m for m in imports(path) if m.split(".")[0] == "algorithms"}, name
