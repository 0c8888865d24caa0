"""BFCL v4 multi-turn tasks, tool docs and tool classes, read from the ``bfcl-eval`` package.

Nothing is copied into agentenv: the questions, initial states and ground truth come from
``bfcl_eval/data/`` (``BFCL_v4_multi_turn_<category>.json`` and
``possible_answer/``), each tool's description and parameters from
``data/multi_turn_func_doc/``, and the tools themselves are the package's classes
(``GorillaFileSystem``, ``TwitterAPI``, ``TradingBot``, ...), loaded with their initial
state as BFCL's own executor loads them.
"""

from __future__ import annotations

import ast
import copy
import functools
import importlib
import json
from pathlib import Path
from typing import Any

from agentenv.errors import InvalidOptionError

CATEGORIES = ("base", "miss_func", "miss_param", "long_context")
INSTALL = "pip install --no-deps bfcl-eval==2026.3.23 (install.sh does)"


def package_dir() -> Path:
    """The installed ``bfcl_eval`` package folder (a clear error when it is missing)."""
    try:
        import bfcl_eval
    except ImportError as exc:
        raise InvalidOptionError(f"BFCL-v0 needs the bfcl-eval package: {INSTALL} ({exc})") from exc
    return Path(bfcl_eval.__file__).parent


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@functools.cache
def load_category(category: str) -> tuple[dict[str, Any], ...]:
    """Every task of a multi-turn category: BFCL's entry with its ``ground_truth``."""
    if category not in CATEGORIES:
        raise InvalidOptionError(
            f"BFCL-v0 category must be one of {CATEGORIES}, got {category!r} (web_search needs "
            "the internet, memory and format_sensitivity are not multi-turn categories here)"
        )
    data = package_dir() / "data"
    entries = _jsonl(data / f"BFCL_v4_multi_turn_{category}.json")
    answers = {
        a["id"]: a["ground_truth"]
        for a in _jsonl(data / "possible_answer" / f"BFCL_v4_multi_turn_{category}.json")
    }
    out = []
    for entry in entries:
        if entry["id"] not in answers:
            raise InvalidOptionError(
                f"BFCL task {entry['id']}: no ground truth in possible_answer/"
            )
        if len(answers[entry["id"]]) != len(entry["question"]):
            raise InvalidOptionError(
                f"BFCL task {entry['id']}: {len(entry['question'])} user turns but "
                f"{len(answers[entry['id']])} ground-truth turns"
            )
        out.append({**entry, "ground_truth": answers[entry["id"]]})
    return tuple(out)


@functools.cache
def func_docs(class_name: str) -> tuple[dict[str, Any], ...]:
    """The tool docs (name, description, parameters) BFCL gives the model for a class."""
    from bfcl_eval.constants.executable_backend_config import MULTI_TURN_FUNC_DOC_FILE_MAPPING

    if class_name not in MULTI_TURN_FUNC_DOC_FILE_MAPPING:
        raise InvalidOptionError(f"BFCL has no tool class {class_name!r}")
    path = (
        package_dir()
        / "data"
        / "multi_turn_func_doc"
        / MULTI_TURN_FUNC_DOC_FILE_MAPPING[class_name]
    )
    return tuple(_jsonl(path))


def new_instance(class_name: str, initial_config: dict[str, Any], long_context: bool) -> Any:
    """An instance of a BFCL tool class in the task's initial state, as BFCL's executor
    builds it (a deep copy of the config; stateless classes get none)."""
    from bfcl_eval.constants.executable_backend_config import (
        CLASS_FILE_PATH_MAPPING,
        STATELESS_CLASSES,
    )

    module = importlib.import_module(CLASS_FILE_PATH_MAPPING[class_name])
    instance = getattr(module, class_name)()
    if class_name not in STATELESS_CLASSES:
        config = copy.deepcopy(initial_config.get(class_name, {}))
        instance._load_scenario(config, long_context=long_context)
    return instance


_TYPES = {"dict": "object", "float": "number", "tuple": "array", "any": None}


def json_schema(bfcl: dict[str, Any]) -> dict[str, Any]:
    """BFCL's parameter schema (types ``dict``, ``float``, ``tuple``, ``any``) as the JSON
    schema agentenv's tools use (``object``, ``number``, ``array``, no type)."""
    out = {k: v for k, v in bfcl.items() if k not in ("type", "properties", "items")}
    kind = bfcl.get("type")
    kind = _TYPES.get(kind, kind)
    if kind:
        out["type"] = kind
    if "properties" in bfcl:
        out["properties"] = {k: json_schema(v) for k, v in bfcl["properties"].items()}
    if "items" in bfcl:
        out["items"] = json_schema(bfcl["items"])
    return out


def parse_call(text: str) -> tuple[str, list[Any], dict[str, Any]]:
    """``"mv(source='a', destination='b')"`` -> ``("mv", [], {"source": "a", ...})``: a
    ground-truth call string (Python literals only)."""
    node = ast.parse(text.strip(), mode="eval").body
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise InvalidOptionError(f"not a BFCL call: {text!r}")
    args = [ast.literal_eval(a) for a in node.args]
    kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg}
    return node.func.id, args, kwargs


def call_string(name: str, arguments: dict[str, Any]) -> str:
    """A call as BFCL's decoder writes one from a tool call (``name(k=repr(v),...)``)."""
    return f"{name}({','.join(f'{k}={v!r}' for k, v in arguments.items())})"


def result_text(value: Any) -> str:
    """A call's result as BFCL's executor records it (str as is, dict as JSON, else str)."""
    if type(value) is str:
        return value
    if type(value) is dict:
        try:
            return json.dumps(value)
        except (TypeError, ValueError):
            return str(value)
    return str(value)
