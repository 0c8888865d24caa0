"""Hostile actions for fuzzing envs, parsers and tools, and the invariants every step keeps.

Shared by ``tests/envs/test_fuzz.py`` (Hypothesis, a few hundred examples) and
``benchmarks/fuzz.py`` (the same strategies and checks, 10,000 actions per env).

Strategies: :func:`actions` draws whole policy turns in the env's parser format: tool
calls with hostile arguments (huge strings, NUL bytes, ``..``/absolute paths, links the
sandboxed code planted, JSON-escaped lone surrogates, deep nesting, 1e308/NaN/-0,
wrong types), broken JSON, unclosed tags, too many calls, answers with junk, empty text.

Checks: :class:`Stepper` runs ``reset``/``step`` and returns the broken invariants as
``"kind: detail"`` strings (nothing escapes ``step``; the observation is in the space,
bounded and valid UTF-8; the reward is a finite float; the flags are bools; the step
ends within the tool time limit; the env stays usable). :class:`OutsideGuard` watches
what the Workspace env's tools and code could reach outside the workspace root.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import json
import math
import os
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psutil
from hypothesis import strategies as st

from agentenv.env.executor import truncate
from agentenv.env.parsers import ReActParser
from agentenv.env.tools import Tool
from envs.workspace import SandboxLimits

SLACK_S = 5.0
"""Seconds a step may take beyond its tool time limit: parsing, threads and process
start-up on a loaded 2-core machine."""
CHECKER_RUNS = 2
"""Most sandboxed programs a Workspace checker runs for the answer (bugfix, rename)."""
SCRATCH_DIRS = ("/tmp", "/var/tmp", "/dev/shm")  # where an rlimit sandbox uid may write

# ---- strategies ---------------------------------------------------------------------------
SPECIAL_STRINGS = (
    "", " ", "\n", "\x00", "a\x00b", "\t\r\n", "..", ".", "./", "/", "//", "~", "~root",
    "../../etc/passwd", "/etc/passwd", "a/../../b", "\\..\\..\\windows", "%2e%2e/x",
    "1e308", "-1e308", "-0", "0", "NaN", "nan", "Infinity", "-inf", "1e999", "9" * 400,
    "null", "true", "[]", "{}", "{", '"', "\\", "\ud800", "\udcff", "\ud83d", "\u202e",
    "\ufeff", "\u2028", "\x85", "\U0001f600" * 8, "é/ü.txt", "CON", "</tool_call>",
    "<tool_call>", "</answer>", "<answer>", "Action:", "Final Answer:", "\\u0000",
)  # fmt: skip
EXPRESSIONS = (
    "1+1", "9**9**9**9", "2**10000000", "10**1000", "10**999*10", "1e308*10", "-0", "0/0",
    "1/0", "(-8)**(1/3)", "sqrt(-1)", "round(1, -10**9)", "round(2**3000, -5000)", "max()",
    "min(1)", "abs()", "__import__('os')", "().__class__", "1 if 1 else 2", "[1]", "'a'",
    "2^3", "×÷", "٣+٤", "1_000", "0x10", "1j", "True", "lambda: 1", "f'{1}'", "9" * 499,
    "1" * 501, "1+" * 240 + "1", "-" * 400 + "1", "sqrt(" * 60 + "4" + ")" * 60,
)  # fmt: skip
ANSWERS = (
    "42", "-0", "1e308", "1e999", "nan", "inf", "-inf", "1/0", "0/0", "3/4", "$1,234.5",
    "50%", "1" * 400 + "/1", "1" * 5000, "1" * 5000 + "/3", "done", "unknown", " ",
)  # fmt: skip
PYTHON_CODE = (
    "print('hi')",
    "import os; os.symlink('/', 'root_link')",
    "import os; os.symlink('..', 'up'); os.symlink('../..', 'upup')",
    "import os; os.symlink('/etc/passwd', 'passwd_link')",
    "import os; open('f.txt', 'w').write('x'); os.link('f.txt', 'hard')",
    "import os; os.mkfifo('fifo')",
    "import os; os.chmod('.', 0)",
    "import os; os.makedirs('d/' * 40)",
    "open(b'\\xff\\xfe.txt', 'w').write('x')",
    "open('../escape.txt', 'w').write('x')",
    "open('../../escape.txt', 'w').write('x')",
    "open('/tmp/agentenv-fuzz-escape.txt', 'w').write('x')",
    "[open(f'f{i}', 'w') for i in range(2000)]",
    "print('x' * 10_000_000)",
    "import sys; sys.stdout.buffer.write(bytes(range(256)) * 64)",
    "while True: pass",
    "import subprocess; subprocess.Popen(['sleep', '30'])",
    "import os\nfor _ in range(40):\n    try: os.fork()\n    except OSError: break",
    "x = ' ' * (1 << 30)",
    "raise SystemExit(3)",
    "import os; os.kill(os.getppid(), 9)",
    "print('\\u2028\\x85\\udcff'.encode('utf-8', 'surrogateescape'))",
)
SHELL_COMMANDS = (
    "ls -la /", "cat /etc/shadow", "ln -s / r", "echo x > ../escape", "cd .. && touch escape",
    "sleep 30 &", "yes | head -c 10000000", "printf '\\377' > \"$(printf '\\377')\"",
    "rm -rf /workspace/* 2>&1", "ln -s .. up", "mkfifo p", "", "exit 7", "kill -9 $$",
)  # fmt: skip
PATHS = (
    "../../etc/passwd", "/etc/passwd", "~/x", "root_link/etc/passwd", "up/x", "upup/canary.txt",
    "passwd_link", "canary_link", "hard", "fifo", "p", "r", ".", "", "a/", "d/" * 300, "a\x00b",
    "x" * 2000, "\ud800", "\udcff.txt", "\udcff\udcfe.txt", "\xff\xfe.txt", "f.txt",
    "notes/new.txt", "é/ü.txt",
)  # fmt: skip
TAG_PIECES = (
    "<tool_call>", "</tool_call>", "<answer>", "</answer>", "Action: ", "\nAction Input: ",
    "Final Answer: ", "Observation:", '{"name": ', '"calculator"', ', "arguments": ', "{", "}",
    '{"expression": "1+1"}', "\n", "[", "]", '"', "null",
)  # fmt: skip


# Small sandbox limits keep runaway code (infinite loops, big output) cheap on 2 cores.
WORKSPACE_LIMITS = SandboxLimits(
    timeout_s=1.0,
    memory_bytes=256 << 20,
    file_size_bytes=4 << 20,
    max_processes=12,
    max_open_files=64,
    max_output_bytes=16 << 10,
)


@functools.cache  # one strategy object each: Hypothesis validates every new one
def huge_strings() -> st.SearchStrategy[str]:
    """1k to 300k characters: a short random unit repeated (drawn cheaply)."""
    return st.builds(
        lambda unit, n: (unit or "A") * n, st.text(max_size=3), st.integers(1_000, 300_000)
    )


@functools.cache
def hostile_strings() -> st.SearchStrategy[str]:
    """Random unicode, known-nasty strings, huge strings and deep parentheses."""
    special = st.sampled_from(SPECIAL_STRINGS)
    return st.one_of(
        st.text(max_size=40),
        special,
        huge_strings(),
        st.integers(10, 20_000).map(lambda n: "(" * n + "1" + ")" * n),
        st.lists(special | st.text(max_size=5), max_size=6).map("".join),
    )


@functools.cache
def hostile_ints() -> st.SearchStrategy[int]:
    return st.integers() | st.sampled_from([0, -1, 2**31, 2**63, -(2**63) - 1, 10**30, 10**400])


@functools.cache
def json_values() -> st.SearchStrategy[Any]:
    """Any JSON value (NaN and infinities included: Python's json reads them)."""
    leaves = st.none() | st.booleans() | hostile_ints() | st.floats() | hostile_strings()
    return st.recursive(
        leaves,
        lambda inner: (
            st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
        ),
        max_leaves=8,
    )


def _mostly(curated: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    """``curated`` three times in four, else any hostile string."""
    return st.integers(0, 3).flatmap(lambda i: hostile_strings() if i == 0 else curated)


def argument_strings(outside: Sequence[str] = ()) -> dict[str, st.SearchStrategy[str]]:
    """String strategies by argument name (``path``, ``code``, ...); ``outside``: paths
    outside the workspace (e.g. a canary file) for paths and planted links."""
    links = tuple(f"import os; os.symlink({p!r}, 'canary_link')" for p in outside)
    arithmetic = st.text("0123456789+-*/%(). e", max_size=60)
    return {
        "expression": _mostly(st.sampled_from(EXPRESSIONS) | arithmetic),
        "path": _mostly(st.sampled_from(PATHS + tuple(outside))),
        "code": _mostly(st.sampled_from(PYTHON_CODE + links)),
        "command": _mostly(st.sampled_from(SHELL_COMMANDS)),
    }


def _value(name: str, schema: dict[str, Any], by_name: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Mostly a value of the declared type (so the tool really runs), sometimes any JSON."""
    typed = {
        "string": by_name.get(name, hostile_strings()),
        "integer": hostile_ints(),
        "number": st.floats() | hostile_ints(),
        "boolean": st.booleans(),
    }.get(schema.get("type"), json_values())
    if schema.get("nullable"):
        typed = st.none() | typed
    return st.integers(0, 3).flatmap(lambda i: json_values() if i == 0 else typed)


def arguments(tool: Tool, by_name: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Arguments for ``tool``: typed hostile values, wrong keys, or not an object at all."""
    props: dict[str, Any] = tool.parameters["properties"]
    required = list(tool.parameters.get("required", []))
    typed = st.fixed_dictionaries(
        {p: _value(p, props[p], by_name) for p in required},
        optional={p: _value(p, s, by_name) for p, s in props.items() if p not in required},
    )
    wrong = st.dictionaries(
        st.sampled_from(sorted(props)) | st.text(max_size=8), json_values(), max_size=4
    )
    return st.integers(0, 5).flatmap(
        lambda i: typed if i < 4 else wrong if i == 4 else json_values()
    )


def render_call(
    parser: Any, name: str, args: Any, *, ascii_only: bool = True, twice: bool = False
) -> str:
    """One call in ``parser``'s format; ``twice``: the arguments JSON-encoded twice."""
    if twice:
        args = json.dumps(args, ensure_ascii=ascii_only)
    if isinstance(parser, ReActParser):
        return f"Action: {name}\nAction Input: {json.dumps(args, ensure_ascii=ascii_only)}"
    payload = json.dumps({"name": name, "arguments": args}, ensure_ascii=ascii_only)
    return f"<tool_call>{payload}</tool_call>"


def tool_calls(
    tools: Sequence[Tool], parser: Any, by_name: dict[str, Any]
) -> st.SearchStrategy[str]:
    """Well-formed calls (known tools with hostile arguments, or unknown/hostile names)."""
    odd_names = st.sampled_from(["", " calculator", "Search", "../run", "\ud800", "__import__"])
    unknown = st.tuples(st.text(max_size=20) | odd_names | huge_strings(), json_values())
    pairs = st.one_of(*(st.tuples(st.just(t.name), arguments(t, by_name)) for t in tools), unknown)
    return st.builds(
        lambda pair, ascii_only, twice: render_call(
            parser, *pair, ascii_only=ascii_only, twice=twice
        ),
        pairs,
        st.booleans(),
        st.integers(0, 9).map(lambda i: i == 0),
    )


REACT_BROKEN = (
    "Action:", "Action: calculator", "Action Input: {}", "Action: x\nAction Input: {",
    "Action: x\nAction: y\nAction Input: []", "Action: x\nAction Input: " + "1" * 5000,
    "Final Answer:", 'Action: x\nAction Input: "{\\"a\\": "', "Observation: 4",
)  # fmt: skip
HERMES_BROKEN = (
    "<tool_call>", "</tool_call>", "<tool_call></tool_call>", "<tool_call>{}</tool_call>",
    '<tool_call>{"name": 5}</tool_call>', "<tool_call>[]</tool_call>",
    "<tool_call>null</tool_call>", '<tool_call>{"name": "x", "arguments": {</tool_call>',
    '<tool_call>{"name": "x", "arguments": "{\\"a\\": "}</tool_call>',
    '<tool_call>{"name": "x", "arguments": ' + "1" * 5000 + "}</tool_call>",
    "<tool_call><tool_call></tool_call></tool_call>", "</tool_call><tool_call>",
    "<answer>", "</answer><answer>", "<answer><answer>1</answer></answer>",
)  # fmt: skip


def malformed(parser: Any, calls: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    """Broken JSON, unclosed or misnested tags, over-long numbers, deep nesting, cut calls."""
    if isinstance(parser, ReActParser):
        fixed, head, tail = REACT_BROKEN, "Action: x\nAction Input: ", ""
    else:
        fixed, head, tail = HERMES_BROKEN, '<tool_call>{"name": "x", "arguments": ', "}</tool_call>"
    deep = st.integers(50, 100_000).map(lambda n: head + "[" * n + "]" * n + tail)
    cut = st.builds(lambda text, f: text[: int(len(text) * f)], calls, st.floats(0, 1))
    return st.one_of(st.sampled_from(fixed), deep, cut)


def render_answer(parser: Any, text: str) -> str:
    """A final answer in ``parser``'s format."""
    return (
        f"Final Answer: {text}" if isinstance(parser, ReActParser) else f"<answer>{text}</answer>"
    )


def answers(parser: Any) -> st.SearchStrategy[str]:
    return (st.sampled_from(ANSWERS) | hostile_strings()).map(lambda b: render_answer(parser, b))


def actions(
    tools: Sequence[Tool],
    parser: Any,
    by_name: dict[str, Any] | None = None,
    cheap_tools: Sequence[Tool] | None = None,
) -> st.SearchStrategy[str]:
    """Whole policy turns for an env with ``tools`` read by ``parser``.

    Args:
        tools: The env's tools.
        parser: The env's parser (Hermes or ReAct format).
        by_name: String strategies by argument name (default :func:`argument_strings`).
        cheap_tools: Tools used for the "more calls than ``max_calls``" turns (default all).
    """
    by_name = argument_strings() if by_name is None else by_name
    calls = tool_calls(tools, parser, by_name)
    many = tool_calls(cheap_tools or tools, parser, by_name)
    max_calls = getattr(parser, "max_calls", 8)
    piece = st.one_of(
        calls,
        malformed(parser, calls),
        answers(parser),
        st.text(max_size=30),
        st.sampled_from(TAG_PIECES),
    )
    return st.one_of(
        st.lists(calls, min_size=1, max_size=3).map("\n".join),
        st.lists(piece, max_size=6).map("".join),
        st.lists(many, min_size=max_calls + 1, max_size=max_calls + 4).map("\n".join),
        answers(parser),
        st.sampled_from(["", " ", "\n", "\x00"]) | st.text(),
        st.builds(lambda p, n: p * n, st.sampled_from(TAG_PIECES) | st.text(max_size=8),
                  st.integers(100, 20_000)),
    )  # fmt: skip


# ---- invariants ------------------------------------------------------------------------------
def max_message_chars(env: Any) -> int:
    """Longest ``content`` of one message ``ToolEnv.step`` may return.

    Tool output is cut by :func:`~agentenv.env.executor.truncate` to ``max_output_chars``
    plus a marker naming the dropped count (fewer than 10**18 characters: at most 17 digits
    more than the marker for one); error lines to ``max(200, min(max_output_chars, 500))``
    plus the marker. The only other message is the format reminder.
    """
    marker_1 = len(truncate("xx", 1)) - 1  # the marker for one dropped character
    cut = max(env.executor.max_output_chars, 200) + marker_1 + 17
    return max(cut, len(env.format_reminder()))


def max_messages(env: Any) -> int:
    """``max_calls`` calls plus the "extra calls ignored" and "never closed" errors."""
    return getattr(env.parser, "max_calls", 8) + 2


def step_time_limit(env: Any) -> float:
    """Seconds a step may take: the executor's per-call limit (a message's calls run
    concurrently); for the Workspace answer, the checker's sandboxed runs; plus slack."""
    limit = env.executor.timeout_s
    sandbox = getattr(env, "limits", None)
    if sandbox is not None:
        limit = max(limit, CHECKER_RUNS * sandbox.timeout_s)
    return limit + SLACK_S


def probe_action(env: Any) -> tuple[str, frozenset[str]]:
    """A valid call for ``env`` and the error kinds it may still meet (RAG's search limit)."""
    names = {t.name for t in env.tools}
    if "calculator" in names:
        return render_call(env.parser, "calculator", {"expression": "1+1"}), frozenset()
    if "search" in names:
        query = env.task.prompt[:200]
        return render_call(env.parser, "search", {"query": query}), frozenset({"search_limit"})
    if "list_files" in names:
        return render_call(env.parser, "list_files", {"path": "."}), frozenset()
    raise ValueError(f"no probe call for an env with tools {sorted(names)}")


def short(text: str, n: int = 120) -> str:
    return repr(text) if len(text) <= n else f"{text[: n // 2]!r}...({len(text)} chars)"


@dataclass
class StepReport:
    """One checked step: its wall time and the invariants it broke (``"kind: detail"``)."""

    action: str
    elapsed_s: float
    violations: list[str]


class Stepper:
    """Drives one env through fuzzed steps and checks every invariant of each step."""

    def __init__(self, env: Any):
        self.env = env
        self.time_limit_s = step_time_limit(env)
        self.max_chars = max_message_chars(env)
        self.max_messages = max_messages(env)
        self.done = True
        self.errors: Counter[str] = Counter()  # the env's tool_errors so far this episode
        self.new_errors: Counter[str] = Counter()  # those the last step added
        self.num_calls = 0  # the env's num_tool_calls so far this episode
        self.episodes = 0  # resets done
        self.uids: list[int] = []  # private sandbox uids of every Workspace episode

    def reset(self, seed: int | None = None) -> list[str]:
        try:
            obs, info = self.env.reset(seed=seed)
        except Exception as exc:  # noqa: BLE001 - reported as a violation
            return [f"reset_failed: {type(exc).__name__}: {exc}"[:300]]
        self.done, self.errors, self.num_calls = False, Counter(), 0
        self.episodes += 1
        ws = getattr(self.env, "workspace", None)
        if ws is not None and ws.uid is not None:
            self.uids.append(ws.uid)
        valid = self.env.observation_space.contains(obs) and isinstance(info, dict)
        if not valid or [m["role"] for m in obs] != ["system", "user"]:
            return [f"reset_invalid: {short(repr(obs))}"]
        return []

    def step(self, action: str) -> StepReport:
        start = time.perf_counter()
        try:
            result = self.env.step(action)
        except Exception as exc:  # noqa: BLE001 - the first invariant: nothing escapes step
            self.done = True  # the env's state is unknown: start a new episode
            detail = f"exception: {type(exc).__name__}: {exc}"[:300]
            return StepReport(action, time.perf_counter() - start, [detail])
        elapsed = time.perf_counter() - start
        violations = self._check(result)
        if elapsed > self.time_limit_s:
            violations.append(f"over_time_limit: {elapsed:.2f} s > {self.time_limit_s:.2f} s")
        return StepReport(action, elapsed, violations)

    def _check(self, result: Any) -> list[str]:
        if not (isinstance(result, tuple) and len(result) == 5):
            self.done = True
            return [f"bad_result: step returned {type(result).__name__}"]
        obs, reward, terminated, truncated, info = result
        out = []
        if not self.env.observation_space.contains(obs):
            out.append(f"obs_invalid: {short(repr(obs))}")
        else:
            if len(obs) > self.max_messages:
                out.append(f"obs_too_many: {len(obs)} messages > {self.max_messages}")
            for m in obs:
                if len(m["content"]) > self.max_chars:
                    out.append(f"obs_too_long: {len(m['content'])} chars > {self.max_chars}")
                try:  # tokenizers refuse lone surrogates (TypeError): a rollout would crash
                    m["content"].encode("utf-8")
                except UnicodeEncodeError:
                    out.append(f"obs_not_utf8: {short(m['content'])}")
        if (
            isinstance(reward, bool)
            or not isinstance(reward, int | float)
            or not math.isfinite(reward)
        ):
            out.append(f"reward_not_finite: {reward!r}")
        if type(terminated) is not bool or type(truncated) is not bool:
            out.append(f"flags_not_bool: {terminated!r}, {truncated!r}")
        self.done = bool(terminated) or bool(truncated)
        if terminated and truncated:
            out.append("flags_both_true")
        if not isinstance(info, dict):
            return [*out, f"info_not_dict: {type(info).__name__}"]
        if self.done and "correct" not in info:
            out.append("info_no_correct: an ended episode's info lacks 'correct'")
        errors = Counter(info.get("tool_errors", {}))
        if errors["exception"] > self.errors["exception"]:  # a tool crashed; the executor caught it
            crashed = (
                [m["content"] for m in obs if " raised " in m["content"]]
                if isinstance(obs, list)
                else []
            )
            out.append(f"tool_exception: {short(crashed[0] if crashed else '?', 200)}")
        self.new_errors = errors - self.errors
        self.errors = errors
        self.num_calls = info.get("num_tool_calls", 0)
        return out

    def probe(self) -> list[str]:
        """After a fuzzed step: a valid step works, or (when the episode ended) a reset does."""
        if self.done:
            return self.reset()
        action, tolerated = probe_action(self.env)
        report = self.step(action)
        out = [f"probe_{v}" for v in report.violations]
        unexpected = (
            {k: n for k, n in self.new_errors.items() if k not in tolerated} if not out else {}
        )
        if unexpected:
            out.append(f"probe_failed: tool errors {unexpected} on {short(action)}")
        return out

    def play(self, seed: int, turns: Sequence[str]) -> list[str]:
        """One episode: reset, the fuzzed turns (until it ends), then :meth:`probe`."""
        out = self.reset(seed)
        for i, action in enumerate(turns):
            if self.done:
                break
            out += [f"{v} [turn {i}: {short(action)}]" for v in self.step(action).violations]
        return out + self.probe()


# ---- the Workspace's surroundings ------------------------------------------------------------
class OutsideGuard:
    """A private parent folder for workspaces (``tempfile.tempdir`` while entered) holding a
    canary file and a sentinel folder; :meth:`check` lists what changed outside the root."""

    def __init__(self) -> None:
        self.parent = os.path.realpath(tempfile.mkdtemp(prefix="agentenv-fuzz-"))
        os.chmod(self.parent, 0o711)  # like /tmp for the sandbox uids: traverse, not list
        self.canary = os.path.join(self.parent, "canary.txt")
        with open(self.canary, "w") as f:
            f.write("canary: nothing may change this file\n")
        os.makedirs(os.path.join(self.parent, "sentinel", "inner"))
        with open(os.path.join(self.parent, "sentinel", "inner", "keep.txt"), "w") as f:
            f.write("keep\n")
        self.initial = self._snapshot()
        self._saved: str | None = None

    def __enter__(self) -> OutsideGuard:
        self._saved, tempfile.tempdir = tempfile.tempdir, self.parent
        return self

    def __exit__(self, *exc: object) -> None:
        tempfile.tempdir = self._saved
        shutil.rmtree(self.parent, ignore_errors=True)

    def _snapshot(self) -> dict[str, tuple]:
        """Every entry under the parent except workspaces: mode, owner, size, mtime, hash."""
        out: dict[str, tuple] = {}
        for dirpath, dirnames, filenames in os.walk(self.parent):
            if dirpath == self.parent:
                dirnames[:] = [d for d in dirnames if not d.startswith("agentenv-ws-")]
            for name in dirnames + filenames:
                path = os.path.join(dirpath, name)
                st_ = os.lstat(path)
                digest = ""
                if os.path.isfile(path) and not os.path.islink(path):
                    with open(path, "rb") as f:
                        digest = hashlib.sha256(f.read()).hexdigest()
                key = os.path.relpath(path, self.parent)
                out[key] = (st_.st_mode, st_.st_uid, st_.st_size, st_.st_mtime_ns, digest)
        return out

    def workspace_dirs(self) -> set[str]:
        return set(glob.glob(os.path.join(self.parent, "agentenv-ws-*")))

    def check(self, workspace: Any) -> list[str]:
        """What changed outside ``workspace.root`` (an open Workspace, or ``None``)."""
        out = []
        now = self._snapshot()
        if now != self.initial:
            changed = sorted(
                k for k in now.keys() | self.initial.keys() if now.get(k) != self.initial.get(k)
            )
            out.append(f"outside_changed: {changed[:10]}")
        expected = set()
        if workspace is not None and not workspace.closed:
            home = os.path.dirname(workspace.root)
            expected = {home}
            if sorted(os.listdir(home)) != ["bin", "work"]:
                out.append(
                    f"outside_changed: the workspace folder holds {sorted(os.listdir(home))}"
                )
            python = workspace.sandbox.backend.python
            links = {
                n: os.readlink(os.path.join(home, "bin", n))
                for n in os.listdir(os.path.join(home, "bin"))
            }
            if links != {"python": python, "python3": python}:
                out.append(f"outside_changed: bin/ holds {links}")
        if self.workspace_dirs() != expected:
            out.append(f"leftover_dir: {sorted(self.workspace_dirs() - expected)}")
        return out


def live_children() -> set[int]:
    """Pids of this process's live (non-zombie) descendants."""
    out = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                out.add(child.pid)
        except psutil.NoSuchProcess:
            continue
    return out


def scratch_files_of(uids: Sequence[int]) -> list[str]:
    """Entries owned by ``uids`` in the world-writable scratch folders."""
    found = []
    for folder in SCRATCH_DIRS:
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.stat(follow_symlinks=False).st_uid in uids:
                    found.append(entry.path)
            except OSError:
                continue
    return found


def close_and_check(
    env: Any, stepper: Stepper, guard: OutsideGuard, children: set[int]
) -> list[str]:
    """Close a Workspace env; then its folder, processes and scratch files must be gone
    (waiting up to 3 s for killed processes) and nothing outside may have changed."""
    from envs.workspace import _procs

    env.close()
    deadline = time.monotonic() + 3.0
    while True:
        out = guard.check(None)
        procs = live_children() - children
        if procs:
            out.append(f"leftover_process: children {sorted(procs)}")
        by_uid = {uid: pids for uid in stepper.uids if (pids := _procs.live_pids_of_uid(uid))}
        if by_uid:
            out.append(f"leftover_process: sandbox uid pids {by_uid}")
        scratch = scratch_files_of(stepper.uids)
        if scratch:
            out.append(f"leftover_file: {scratch[:5]}")
        if not out or time.monotonic() > deadline:
            return out
        time.sleep(0.05)
