"""Family ``bugfix``: fix a small module so that its bundled unittest passes.

* easy -- one function with one bug;
* hard -- two functions with a bug each, in one module.

The checker (1) confirms the test file is unchanged, (2) runs the bundled test in the
sandbox, and (3) calls the functions on *hidden* inputs in the sandbox and compares
the results with the reference implementation computed on the host. (3) is what
gives the reward its teeth: a module that fakes the test run (e.g. ``os._exit(0)`` on
import) still has to return the right values on inputs it has never seen.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from typing import Any

from envs.workspace.families._common import WORDS, call, last_json_line
from envs.workspace.families.base import TaskSpec, ToolCallSpec
from envs.workspace.workspace import Workspace

_MODULES = ("utils", "helpers", "toolkit", "core", "mathx", "textkit", "calc", "ops")


@dataclass(frozen=True)
class _Template:
    names: tuple[str, ...]
    reference: str  # source with {fn}
    buggy: str
    args: Any  # rng -> tuple of arguments
    exposing: tuple[tuple[Any, ...], ...]  # arguments that show the bug


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


_TEMPLATES = (
    _Template(
        ("window_sums", "moving_sum", "rolling_total"),
        'def {fn}(values, width):\n    """Sums of every run of `width` consecutive values."""\n'
        "    return [sum(values[i : i + width]) for i in range(len(values) - width + 1)]\n",
        'def {fn}(values, width):\n    """Sums of every run of `width` consecutive values."""\n'
        "    return [sum(values[i : i + width]) for i in range(len(values) - width)]\n",
        lambda rng: ([rng.randint(-9, 20) for _ in range(rng.randint(3, 8))], rng.randint(1, 3)),
        (([1, 2, 3, 4], 2),),
    ),
    _Template(
        ("count_vowels", "vowel_count", "num_vowels"),
        'def {fn}(text):\n    """Number of vowels (a, e, i, o, u) in `text`, ignoring case."""\n'
        '    return sum(1 for ch in text.lower() if ch in "aeiou")\n',
        'def {fn}(text):\n    """Number of vowels (a, e, i, o, u) in `text`, ignoring case."""\n'
        '    return sum(1 for ch in text if ch in "aeiou")\n',
        lambda rng: (_words(rng, 3).title(),),
        (("AEIOU and Ice",),),
    ),
    _Template(
        ("mean", "average", "arithmetic_mean"),
        'def {fn}(values):\n    """Arithmetic mean of `values`; 0.0 for an empty list."""\n'
        "    if not values:\n        return 0.0\n    return sum(values) / len(values)\n",
        'def {fn}(values):\n    """Arithmetic mean of `values`; 0.0 for an empty list."""\n'
        "    if not values:\n        return 0.0\n    return sum(values) // len(values)\n",
        lambda rng: ([rng.randint(0, 50) for _ in range(rng.randint(2, 6))],),
        (([1, 2],),),
    ),
    _Template(
        ("last_items", "tail", "take_last"),
        'def {fn}(items, n):\n    """The last `n` items of `items` (none when n == 0)."""\n'
        "    if n <= 0:\n        return []\n    return items[-n:]\n",
        'def {fn}(items, n):\n    """The last `n` items of `items` (none when n == 0)."""\n'
        "    return items[-n:]\n",
        lambda rng: ([rng.randint(0, 9) for _ in range(rng.randint(2, 6))], rng.randint(0, 3)),
        (([1, 2, 3], 0),),
    ),
    _Template(
        ("word_lengths", "lengths_of_words", "measure_words"),
        'def {fn}(sentence):\n    """Length of each whitespace-separated word, in order."""\n'
        "    return [len(word) for word in sentence.split()]\n",
        'def {fn}(sentence):\n    """Length of each whitespace-separated word, in order."""\n'
        '    return [len(word) for word in sentence.split(" ")]\n',
        lambda rng: ("  ".join(_words(rng, rng.randint(2, 4)).split(" ")),),
        (("one  two",),),
    ),
    _Template(
        ("is_leap_year", "leap_year", "is_leap"),
        'def {fn}(year):\n    """Whether `year` is a leap year in the Gregorian calendar."""\n'
        "    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)\n",
        'def {fn}(year):\n    """Whether `year` is a leap year in the Gregorian calendar."""\n'
        "    return year % 4 == 0 and year % 100 != 0\n",
        lambda rng: (rng.choice((1600, 1900, 2000, 2023, 2024, 2100, 2400, 1996)),),
        ((2000,),),
    ),
    _Template(
        ("merge_counts", "add_counts", "combine_counts"),
        'def {fn}(a, b):\n    """A new dict with the counts of `a` and `b` added per key."""\n'
        "    result = dict(a)\n    for key, value in b.items():\n"
        "        result[key] = result.get(key, 0) + value\n    return result\n",
        'def {fn}(a, b):\n    """A new dict with the counts of `a` and `b` added per key."""\n'
        "    result = dict(a)\n    for key, value in b.items():\n"
        "        result[key] = value\n    return result\n",
        lambda rng: (
            {w: rng.randint(1, 5) for w in rng.sample(WORDS, 2)},
            {w: rng.randint(1, 5) for w in rng.sample(WORDS, 2)},
        ),
        (({"x": 1}, {"x": 2}),),
    ),
    _Template(
        ("to_fahrenheit", "celsius_to_fahrenheit", "c_to_f"),
        'def {fn}(celsius):\n    """Degrees Celsius converted to degrees Fahrenheit."""\n'
        "    return celsius * 9 / 5 + 32\n",
        'def {fn}(celsius):\n    """Degrees Celsius converted to degrees Fahrenheit."""\n'
        "    return (celsius + 32) * 9 / 5\n",
        lambda rng: (rng.randint(-40, 100),),
        ((100,),),
    ),
)


def _load(source: str, fn: str) -> Any:
    namespace: dict[str, Any] = {}
    exec(compile(source, f"<reference {fn}>", "exec"), namespace)  # our own source only
    return namespace[fn]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, int | float) and isinstance(b, int | float) and math.isclose(a, b)
    return a == b


class BugfixFamily:
    """Fix one (easy) or two (hard) bugs so the bundled test passes."""

    name = "bugfix"

    def generate(self, rng: random.Random, level: str) -> TaskSpec:
        module = rng.choice(_MODULES)
        templates = rng.sample(_TEMPLATES, 1 if level == "easy" else 2)
        functions = []
        for t in templates:
            fn = rng.choice(t.names)
            ref = _load(t.reference.format(fn=fn), fn)
            shown = [*t.exposing, *(t.args(rng) for _ in range(2))]
            hidden = [t.args(rng) for _ in range(6)]
            hidden += [a for a in t.exposing if a not in hidden]
            functions.append(
                {
                    "fn": fn,
                    "reference": t.reference.format(fn=fn),
                    "buggy": t.buggy.format(fn=fn),
                    "shown": [[list(a), ref(*a)] for a in shown],
                    "hidden": [[list(a), ref(*a)] for a in hidden],
                }
            )
        source = "\n\n".join(f["buggy"] for f in functions)
        test_name = f"test_{module}"
        files = {f"{module}.py": source, f"{test_name}.py": _test_source(module, functions)}
        names = " and ".join(f"`{f['fn']}`" for f in functions)
        prompt = (
            f"The unit test `{test_name}.py` fails: {names} in `{module}.py` "
            f"{'has a bug' if len(functions) == 1 else 'each have a bug'}. Fix `{module}.py` "
            f"so that `python -m unittest {test_name}` passes, and the functions do what "
            "their docstrings say for every input. Do not change the test file."
        )
        params = {"module": module, "test": test_name, "functions": functions}
        params["test_source"] = files[f"{test_name}.py"]
        return TaskSpec(prompt, files, params)

    def check(self, params: dict[str, Any], ws: Workspace) -> list[tuple[str, bool]]:
        module, test = params["module"], params["test"]
        checks = [(f"`{test}.py` is unchanged", ws.text(f"{test}.py") == params["test_source"])]
        run = ws.run_shell(f"python -m unittest -q {test} 2>&1")
        checks.append((f"`python -m unittest {test}` passes", run.ok))
        cases = [[f["fn"], args] for f in params["functions"] for args, _ in f["hidden"]]
        probe = (
            "import json, sys\n"
            f"import {module} as m\n"
            "out = []\n"
            f"for name, args in json.loads({json.dumps(cases)!r}):\n"
            "    try:\n"
            "        out.append(['ok', getattr(m, name)(*args)])\n"
            "    except Exception as exc:\n"
            "        out.append(['error', type(exc).__name__])\n"
            "print()\n"
            "print(json.dumps(out, default=repr))\n"
        )
        result = ws.run_python(probe)
        got = last_json_line(result.output) if result.ok else None
        got = got if isinstance(got, list) and len(got) == len(cases) else [None] * len(cases)
        i = 0
        for f in params["functions"]:
            ok = True
            for _, want in f["hidden"]:
                item = got[i]
                i += 1
                ok = ok and isinstance(item, list) and item[0] == "ok" and _same(item[1], want)
            checks.append((f"`{f['fn']}` is right on hidden inputs", ok))
        return checks

    def solve(self, params: dict[str, Any], files: dict[str, str]) -> list[ToolCallSpec]:
        module, test = params["module"], params["test"]
        fixed = "\n\n".join(f["reference"] for f in params["functions"])
        return [
            call("read_file", path=f"{module}.py"),
            call("write_file", path=f"{module}.py", content=fixed),
            call("run", command=f"python -m unittest {test}"),
        ]


def _test_source(module: str, functions: list[dict[str, Any]]) -> str:
    names = ", ".join(f["fn"] for f in functions)
    lines = ["import unittest", "", f"from {module} import {names}", "", ""]
    lines.append(f"class Test{module.capitalize()}(unittest.TestCase):")
    for f in functions:
        lines.append(f"    def test_{f['fn']}(self):")
        for args, want in f["shown"]:
            call_text = f"{f['fn']}({', '.join(repr(a) for a in args)})"
            method = "assertAlmostEqual" if isinstance(want, float) else "assertEqual"
            lines.append(f"        self.{method}({call_text}, {want!r})")
        lines.append("")
    lines += ["", 'if __name__ == "__main__":', "    unittest.main()", ""]
    return "\n".join(lines)
