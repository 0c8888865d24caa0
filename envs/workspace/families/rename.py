"""Family ``rename``: rename across the files of a small Python project.

* easy -- rename a function (definition, import, calls, comments) in a 3-file package;
* hard -- rename a function *and* its module in a 5-file package that imports it in
  three different styles.

Checks: the old names are gone from every ``.py`` file, the new ones are defined where
they should be, ``python main.py`` (run in the sandbox) prints exactly what it printed
before, and the renamed function gives the right results on hidden inputs.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from typing import Any

from envs.workspace.families._common import call, last_json_line
from envs.workspace.families.base import TaskSpec, ToolCallSpec
from envs.workspace.workspace import Workspace

_PACKAGES = ("shop", "metrics", "textproc", "ledger", "inventory", "analytics", "billing")
_MODULES = (("helpers", "utils"), ("calc", "arith"), ("funcs", "library"), ("tools", "common"))


@dataclass(frozen=True)
class _Func:
    old: tuple[str, ...]
    new: tuple[str, ...]
    source: str  # with {name}
    compute: Any  # the reference, on the host
    args: Any  # rng -> tuple of arguments


_FUNCS = (
    _Func(
        ("calc_total", "get_total", "tot_price"),
        ("compute_total", "order_total"),
        'def {name}(items):\n    """Sum of quantity * price over [quantity, price] pairs."""\n'
        "    return round(sum(q * p for q, p in items), 2)\n",
        lambda items: round(sum(q * p for q, p in items), 2),
        lambda rng: ([[rng.randint(1, 5), round(rng.uniform(1, 20), 2)] for _ in range(3)],),
    ),
    _Func(
        ("avg", "get_avg", "calc_mean"),
        ("mean_of", "average_value"),
        'def {name}(values):\n    """Mean of `values`, rounded to 2 decimals."""\n'
        "    return round(sum(values) / len(values), 2)\n",
        lambda values: round(sum(values) / len(values), 2),
        lambda rng: ([rng.randint(0, 100) for _ in range(rng.randint(2, 6))],),
    ),
    _Func(
        ("norm", "clean_str", "fix_text"),
        ("normalize_text", "canonical_text"),
        'def {name}(text):\n    """Lower-case `text` and collapse runs of whitespace."""\n'
        '    return " ".join(text.lower().split())\n',
        lambda text: " ".join(text.lower().split()),
        lambda rng: (
            "  ".join(rng.choice(("Alpha", "BETA", "gamma", "Delta", "EPSILON")) for _ in range(3)),
        ),
    ),
)


def _project(pkg: str, mod: str, name: str, func: _Func, data: list, hard: bool) -> dict:
    helper = (
        f'"""Helpers for the {pkg} package."""\n\n\n{func.source.format(name=name)}\n\n'
        f'def describe(value):\n    """Format a result (computed with {name})."""\n'
        '    return f"result={value!r}"\n'
    )
    files = {f"{pkg}/__init__.py": f'"""The {pkg} package."""\n', f"{pkg}/{mod}.py": helper}
    if not hard:
        files["main.py"] = (
            f'"""Print a few results computed with {name}."""\n\n'
            f"from {pkg}.{mod} import {name}, describe\n\nDATA = {data!r}\n\n\n"
            f"def main():\n    for args in DATA:\n        print(describe({name}(*args)))\n\n\n"
            'if __name__ == "__main__":\n    main()\n'
        )
        return files
    files[f"{pkg}/report.py"] = (
        f"from . import {mod}\n\n\ndef report(rows):\n"
        f"    # one line per row, through {mod}.{name}\n"
        f"    return [{mod}.describe({mod}.{name}(*row)) for row in rows]\n"
    )
    files[f"{pkg}/cli.py"] = (
        f"import {pkg}.{mod} as hm\n\n\ndef first(rows):\n    return hm.{name}(*rows[0])\n"
    )
    files["main.py"] = (
        f"from {pkg}.cli import first\nfrom {pkg}.report import report\n"
        f"from {pkg}.{mod} import {name}\n\nDATA = {data!r}\n\n"
        'if __name__ == "__main__":\n    print("\\n".join(report(DATA)))\n'
        '    print("first:", first(DATA))\n'
        f'    print("direct:", {name}(*DATA[-1]))\n'
    )
    return files


def _expected_output(func: _Func, data: list, hard: bool) -> str:
    lines = [f"result={func.compute(*args)!r}" for args in data]
    if hard:
        lines += [f"first: {func.compute(*data[0])}", f"direct: {func.compute(*data[-1])}"]
    return "\n".join(lines) + "\n"


class RenameFamily:
    """Rename a function (easy) or a function and its module (hard) everywhere."""

    name = "rename"

    def generate(self, rng: random.Random, level: str) -> TaskSpec:
        hard = level == "hard"
        func = rng.choice(_FUNCS)
        old, new = rng.choice(func.old), rng.choice(func.new)
        pkg = rng.choice(_PACKAGES)
        mod, new_mod = rng.choice(_MODULES)
        data = [list(func.args(rng)) for _ in range(rng.randint(2, 4))]
        files = _project(pkg, mod, old, func, data, hard)
        if hard:
            task = (
                f"rename the module `{pkg}/{mod}.py` to `{pkg}/{new_mod}.py` and the function "
                f"`{old}` to `{new}`"
            )
        else:
            task = f"rename the function `{old}` (defined in `{pkg}/{mod}.py`) to `{new}`"
        prompt = (
            f"Refactor this project: {task}, updating every definition, import, call and "
            f"comment in all .py files, so that no .py file mentions the old name"
            f"{'s' if hard else ''}. `python main.py` must print exactly what it prints now."
        )
        hidden = [list(func.args(rng)) for _ in range(4)]
        params = {
            "pkg": pkg,
            "old": old,
            "new": new,
            "mod": mod,
            "new_mod": new_mod if hard else mod,
            "output": _expected_output(func, data, hard),
            "hidden": [[args, func.compute(*args)] for args in hidden],
        }
        return TaskSpec(prompt, files, params)

    def check(self, params: dict[str, Any], ws: Workspace) -> list[tuple[str, bool]]:
        pkg, old, new, mod, new_mod = (params[k] for k in ("pkg", "old", "new", "mod", "new_mod"))
        names = ws.file_names()
        sources = {n: ws.text(n) or "" for n in names if n.endswith(".py")}
        target = f"{pkg}/{new_mod}.py"
        checks = []
        if mod != new_mod:
            checks.append((f"`{pkg}/{mod}.py` no longer exists", f"{pkg}/{mod}.py" not in names))
            mentions = [n for n, s in sources.items() if re.search(rf"\b{mod}\b", s)]
            checks.append((f"no .py file mentions the module `{mod}`", not mentions))
        mentions = [n for n, s in sources.items() if re.search(rf"\b{old}\b", s)]
        checks.append((f"no .py file mentions `{old}`", not mentions))
        defined = re.search(rf"^def {new}\(", sources.get(target, ""), re.M) is not None
        checks.append((f"`{target}` defines `{new}`", defined))
        run = ws.run_shell("python main.py")
        same = run.ok and run.output == params["output"]
        checks.append(("`python main.py` prints the same as before", same))
        probe = (
            f"import json\nfrom {pkg}.{new_mod} import {new}\n"
            f"cases = json.loads({json.dumps([a for a, _ in params['hidden']])!r})\n"
            f"print()\nprint(json.dumps([{new}(*args) for args in cases]))\n"
        )
        result = ws.run_python(probe)
        got = last_json_line(result.output) if result.ok else None
        want = [value for _, value in params["hidden"]]
        checks.append((f"`{new}` still computes the same results", got == want))
        return checks

    def solve(self, params: dict[str, Any], files: dict[str, str]) -> list[ToolCallSpec]:
        pkg, old, new, mod, new_mod = (params[k] for k in ("pkg", "old", "new", "mod", "new_mod"))
        if mod == new_mod:
            calls = [call("list_files", path=".")]
            for path, text in sorted(files.items()):
                if re.search(rf"\b{old}\b", text):
                    calls.append(
                        call("write_file", path=path, content=re.sub(rf"\b{old}\b", new, text))
                    )
            return [*calls, call("run", command="python main.py")]
        code = (
            "import os, re\n"
            f"os.rename({f'{pkg}/{mod}.py'!r}, {f'{pkg}/{new_mod}.py'!r})\n"
            "for folder, _, names in os.walk('.'):\n"
            "    for name in names:\n"
            "        if name.endswith('.py'):\n"
            "            path = os.path.join(folder, name)\n"
            "            text = open(path).read()\n"
            f"            text = re.sub(r'\\b{old}\\b', {new!r}, text)\n"
            f"            text = re.sub(r'\\b{mod}\\b', {new_mod!r}, text)\n"
            "            open(path, 'w').write(text)\n"
        )
        return [call("run_python", code=code), call("run", command="python main.py")]
