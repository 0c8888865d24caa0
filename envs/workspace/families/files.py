"""Family ``files``: create or modify files to a spec.

* easy -- create a text file (possibly in a new folder) with exactly the given lines;
* hard -- apply 3-4 edits to a nested JSON config (set, add, delete, append), leave
  every other value unchanged, and keep the original as a backup file.
"""

from __future__ import annotations

import copy
import json
import random
from typing import Any

from envs.workspace.families._common import WORDS, call, parse_json, phrase
from envs.workspace.families.base import TaskSpec, ToolCallSpec
from envs.workspace.workspace import Workspace

_FOLDERS = ("", "notes/", "docs/", "out/", "data/text/")
_LEVELS_LOG = ("DEBUG", "INFO", "WARNING", "ERROR")


def _lookup(tree: dict[str, Any], path: list[str]) -> tuple[bool, Any]:
    node: Any = tree
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return False, None
        node = node[key]
    return True, node


def apply_ops(config: dict[str, Any], ops: list[list[Any]]) -> dict[str, Any]:
    """``config`` after the edit operations ``[op, path, value?]``."""
    out = copy.deepcopy(config)
    for op, path, *rest in ops:
        parent = out
        for key in path[:-1]:
            parent = parent[key]
        if op in ("set", "add"):
            parent[path[-1]] = rest[0]
        elif op == "delete":
            del parent[path[-1]]
        elif op == "append":
            parent[path[-1]].append(rest[0])
    return out


def _describe(op: str, path: list[str], value: Any = None) -> str:
    dotted = ".".join(path)
    return {
        "set": f"set `{dotted}` to {json.dumps(value)}",
        "add": f"add the key `{dotted}` with the value {json.dumps(value)}",
        "delete": f"delete the key `{dotted}`",
        "append": f"append {json.dumps(value)} to the list `{dotted}`",
    }[op]


class FilesFamily:
    """Create a file with exact lines (easy); edit a JSON config (hard)."""

    name = "files"

    def generate(self, rng: random.Random, level: str) -> TaskSpec:
        return self._easy(rng) if level == "easy" else self._hard(rng)

    def _easy(self, rng: random.Random) -> TaskSpec:
        path = f"{rng.choice(_FOLDERS)}{rng.choice(WORDS)}_{rng.choice(WORDS)}.txt"
        lines = [phrase(rng) for _ in range(rng.randint(2, 5))]
        body = "\n".join(lines)
        prompt = (
            f"Create the file `{path}` containing exactly these {len(lines)} lines, in this "
            f"order and with nothing else (a final newline is fine):\n\n{body}\n"
        )
        files = {"README.md": "Scratch workspace. Put new files where the task says.\n"}
        return TaskSpec(prompt, files, {"path": path, "lines": lines})

    def _hard(self, rng: random.Random) -> TaskSpec:
        app = f"{rng.choice(WORDS)}-{rng.choice(WORDS)}"
        config = {
            "name": app,
            "version": f"{rng.randint(0, 3)}.{rng.randint(0, 20)}.{rng.randint(0, 9)}",
            "server": {"host": "0.0.0.0", "port": rng.randint(3000, 9000), "workers": 4},
            "database": {"url": f"sqlite:///{rng.choice(WORDS)}.db", "pool": rng.randint(2, 20)},
            "features": rng.sample(WORDS, 3),
            "logging": {"level": rng.choice(_LEVELS_LOG), "file": f"{app}.log"},
        }
        level = "DEBUG" if config["logging"]["level"] != "DEBUG" else "ERROR"
        candidates = [
            ["set", ["server", "port"], rng.randint(9001, 9999)],
            ["set", ["server", "workers"], rng.randint(5, 32)],
            ["set", ["logging", "level"], level],
            ["add", ["database", "timeout_s"], rng.randint(5, 120)],
            ["add", ["server", "tls"], rng.choice([True, False])],
            ["delete", ["logging", "file"]],
            ["delete", ["database", "pool"]],
            ["append", ["features"], rng.choice([w for w in WORDS if w not in config["features"]])],
        ]  # fmt: skip
        ops = rng.sample(candidates, rng.randint(3, 4))
        folder = rng.choice(("config", "settings", "conf"))
        path, backup = f"{folder}/app.json", f"{folder}/app.orig.json"
        steps = "\n".join(f"{i}. {_describe(*op)}" for i, op in enumerate(ops, 1))
        prompt = (
            f"Edit the JSON config `{path}`:\n{steps}\n\nLeave every other key and value as it "
            f"is and keep the file valid JSON. Before editing, save an exact copy of the "
            f"original as `{backup}`."
        )
        files = {path: json.dumps(config, indent=2) + "\n"}
        params = {"path": path, "backup": backup, "config": config, "ops": ops}
        return TaskSpec(prompt, files, params)

    def check(self, params: dict[str, Any], ws: Workspace) -> list[tuple[str, bool]]:
        if "lines" in params:
            text = ws.text(params["path"])
            lines = None if text is None else text.replace("\r\n", "\n").removesuffix("\n")
            return [
                (f"`{params['path']}` exists", text is not None),
                (
                    f"`{params['path']}` holds exactly the requested lines",
                    lines is not None and lines.split("\n") == params["lines"],
                ),
            ]
        expected = apply_ops(params["config"], params["ops"])
        got = parse_json(ws.text(params["path"]))
        valid = isinstance(got, dict)
        checks = [(f"`{params['path']}` is a valid JSON object", valid)]
        for op in params["ops"]:
            want = _lookup(expected, op[1])
            checks.append((_describe(*op), valid and _lookup(got, op[1]) == want))
        checks.append(("no other value changed", valid and got == expected))
        backup = parse_json(ws.text(params["backup"]))
        checks.append((f"`{params['backup']}` equals the original", backup == params["config"]))
        return checks

    def solve(self, params: dict[str, Any], files: dict[str, str]) -> list[ToolCallSpec]:
        if "lines" in params:
            content = "\n".join(params["lines"]) + "\n"
            return [call("write_file", path=params["path"], content=content)]
        code = (
            "import json, shutil\n"
            f"path, backup = {params['path']!r}, {params['backup']!r}\n"
            "shutil.copyfile(path, backup)\n"
            "config = json.load(open(path))\n"
            f"for op, keys, *rest in json.loads({json.dumps(params['ops'])!r}):\n"
            "    parent = config\n"
            "    for key in keys[:-1]:\n"
            "        parent = parent[key]\n"
            "    if op in ('set', 'add'):\n"
            "        parent[keys[-1]] = rest[0]\n"
            "    elif op == 'delete':\n"
            "        del parent[keys[-1]]\n"
            "    else:\n"
            "        parent[keys[-1]].append(rest[0])\n"
            "json.dump(config, open(path, 'w'), indent=2)\n"
            "print('edited', path)\n"
        )
        return [call("read_file", path=params["path"]), call("run_python", code=code)]
