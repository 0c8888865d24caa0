"""Property-based fuzzing (Hypothesis) of every env's ``step``, the action parsers and the tools.

Strategies and invariant checks live in ``tests/helpers/fuzz_actions.py`` and are shared
with ``benchmarks/fuzz.py`` (the same checks at volume). Every step of every example must
keep the invariants of :class:`fuzz_actions.Stepper`; the Workspace env must also leave
everything outside its root as it was, and nothing behind after ``close``.

``AGENTENV_FUZZ_EXAMPLES`` (default 200) scales the number of examples of every test; the
envs with costly steps (RAG, Workspace) run a fraction of it.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import time
from functools import partial

import fuzz_actions as fa
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import agentenv
from agentenv.env.executor import ToolExecutor, truncate
from agentenv.env.parsers import (
    MAX_JSON_DEPTH,
    HermesParser,
    ParsedAction,
    ReActParser,
    ToolCall,
)
from envs.calculator import CalculatorEnv, CalculatorError, calculator, evaluate, format_number
from envs.rag import generate
from envs.workspace import SandboxUnavailableError, detect_backend

EXAMPLES = int(os.environ.get("AGENTENV_FUZZ_EXAMPLES", "200"))
CALCULATOR_TIMEOUT_S = inspect.signature(CalculatorEnv).parameters["tool_timeout_s"].default
JSON_TYPES = (dict, list, str, int, float, bool, type(None))


def fuzz(share: float = 1.0) -> settings:
    """``share`` of ``AGENTENV_FUZZ_EXAMPLES`` examples; no deadline, no example database."""
    return settings(
        max_examples=max(1, round(EXAMPLES * share)),
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )


def json_problem(value: object) -> str | None:
    """Why ``value`` is no JSON value within ``MAX_JSON_DEPTH`` levels (iterative: a
    recursive check overflows the stack on deep values, and flakily, with the stack's depth)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth > MAX_JSON_DEPTH:
                return f"nested deeper than {MAX_JSON_DEPTH}"
            if isinstance(item, dict) and not all(isinstance(k, str) for k in item):
                return f"non-str key in {item!r:.80}"
            stack.extend(
                (v, depth + 1) for v in (item.values() if isinstance(item, dict) else item)
            )
        elif not isinstance(item, JSON_TYPES):
            return f"not JSON: {item!r:.80}"
    return None


def parse_problems(parser, parsed) -> list[str]:
    """What is wrong with ``parser.parse``'s result (see ``ToolCall`` and ``ParsedAction``)."""
    if not isinstance(parsed, ParsedAction) or not isinstance(parsed.tool_calls, list):
        return [f"not a ParsedAction: {parsed!r}"]
    out = []
    if parsed.answer is not None and not isinstance(parsed.answer, str):
        out.append(f"answer {parsed.answer!r}")
    extra = 2 if isinstance(parser, HermesParser) else 1  # "extra calls" (+ "never closed")
    if len(parsed.tool_calls) > parser.max_calls + extra:
        out.append(f"{len(parsed.tool_calls)} calls > {parser.max_calls} + {extra}")
    for call in parsed.tool_calls:
        if not isinstance(call, ToolCall) or not isinstance(call.raw, str):
            out.append(f"bad call {call!r}")
        elif call.error is None:  # parsed: a str name and the JSON arguments
            problem = json_problem(call.arguments)
            if not isinstance(call.name, str) or problem:
                out.append(f"parsed call {call.name!r:.80}: {problem}")
        elif call.name is not None or not isinstance(call.error, str) or not call.error:
            out.append(f"malformed call {call.name!r} with error {call.error!r}")
    return out


# ---- parsers --------------------------------------------------------------------------------
ANY_TEXT = (
    st.text() | fa.actions([calculator], HermesParser()) | fa.actions([calculator], ReActParser())
)


@pytest.mark.parametrize("parser", [HermesParser(), ReActParser()], ids=["hermes", "react"])
@fuzz()
@given(text=ANY_TEXT)
def test_parse_never_raises_and_returns_well_formed_calls(parser, text):
    assert parse_problems(parser, parser.parse(text)) == []


NO_TAG_TEXT = st.text(st.characters(blacklist_characters="<"), max_size=30)
LINE_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"  # what str.splitlines splits on
ONE_LINE = st.text(st.characters(blacklist_characters=LINE_BREAKS), max_size=20)
ROUND_TRIP_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
ROUND_TRIP_CALLS = st.lists(
    st.tuples(
        st.text(max_size=20), st.dictionaries(st.text(max_size=8), ROUND_TRIP_VALUES, max_size=3)
    ),
    max_size=12,
)


@fuzz()
@given(calls=ROUND_TRIP_CALLS, junk=st.lists(NO_TAG_TEXT, min_size=13, max_size=13),
       answer=st.none() | NO_TAG_TEXT, ascii_only=st.booleans())  # fmt: skip
def test_hermes_parses_back_what_was_written(calls, junk, answer, ascii_only):
    parser = HermesParser()
    parts = [junk[-1]]
    for (name, args), text in zip(calls, junk, strict=False):
        payload = json.dumps({"name": name, "arguments": args}, ensure_ascii=ascii_only)
        # tags inside JSON strings must be escaped: every "<" of JSON text is in a string,
        # where the escape \u003c means the same
        payload = payload.replace("<", "\\u003c")
        parts += [f"<tool_call>{payload}</tool_call>", text]
    if answer is not None:
        parts.append(f"<answer>{answer}</answer>")
    parsed = parser.parse("".join(parts))
    kept = calls[: parser.max_calls]
    assert [(c.name, c.arguments, c.error) for c in parsed.tool_calls[: len(kept)]] == [
        (name, args, None) for name, args in kept
    ]
    extra = parsed.tool_calls[len(kept) :]
    assert len(extra) == (len(calls) > parser.max_calls)
    assert all(c.name is None and "extra tool call" in c.error for c in extra)
    assert parsed.answer == (None if answer is None else answer.strip())


# a raw U+0085 in a JSON string: str.splitlines() split the Action Input line there
@example(calls=[("", {"": "\x85"})], names=[""] * 12, junk=[""] * 13, answer=None, ascii_only=False)
@fuzz()
@given(calls=ROUND_TRIP_CALLS, names=st.lists(ONE_LINE.map(str.strip), min_size=12, max_size=12),
       junk=st.lists(ONE_LINE, min_size=13, max_size=13), answer=st.none() | ONE_LINE,
       ascii_only=st.booleans())  # fmt: skip
def test_react_parses_back_what_was_written(calls, names, junk, answer, ascii_only):
    parser = ReActParser()
    junk = [j for j in junk if not j.strip().startswith(("Action", "Final Answer:"))]
    lines = junk[:1]
    for (_, args), name, text in zip(calls, names, junk[1:] + [""] * 12, strict=False):
        lines += [f"Action: {name}", f"Action Input: {json.dumps(args, ensure_ascii=ascii_only)}"]
        lines += [text] if text else []
    if answer is not None:
        lines.append(f"Final Answer: {answer}")
    parsed = parser.parse("\n".join(lines))
    kept = list(zip(names, (args for _, args in calls), strict=False))[: parser.max_calls]
    assert [(c.name, c.arguments, c.error) for c in parsed.tool_calls[: len(kept)]] == [
        (name, args, None) for name, args in kept
    ]
    assert len(parsed.tool_calls) - len(kept) == (len(calls) > parser.max_calls)
    assert parsed.answer == (None if answer is None else answer.strip())


# ---- tools ----------------------------------------------------------------------------------
@fuzz()
@given(expression=fa.argument_strings()["expression"])
def test_evaluate_gives_a_bounded_finite_number_or_a_calculator_error(expression):
    start = time.perf_counter()
    try:
        value = evaluate(expression)
    except CalculatorError as exc:
        assert str(exc)
    else:
        assert type(value) in (int, float)
        assert isinstance(value, int) or math.isfinite(value)
        assert len(format_number(value).lstrip("-")) <= 1001  # evaluate's max_digits=1000
    assert time.perf_counter() - start < CALCULATOR_TIMEOUT_S


@fuzz()
@given(name=st.just("calculator") | st.text(max_size=12), arguments=fa.json_values()
       | fa.arguments(calculator, fa.argument_strings()))  # fmt: skip
def test_executor_turns_any_call_into_a_short_result(name, arguments):
    executor = ToolExecutor([calculator], timeout_s=CALCULATOR_TIMEOUT_S, max_output_chars=300)
    result = executor.run_one(ToolCall(name, arguments))
    assert result.error in (None, "unknown_tool", "arguments", "calculator")
    assert len(result.content) <= 300 + len(truncate("xx", 1)) + 17  # see max_message_chars
    assert (result.error is None) == (not result.content.startswith("Error: "))


# ---- envs -----------------------------------------------------------------------------------
def found_bugs(env) -> list[list[str]]:
    """Episodes that once broke an invariant (found by this fuzzing), replayed every run."""
    call, answer = partial(fa.render_call, env.parser), partial(fa.render_answer, env.parser)
    episodes = [
        [answer("1" * 400 + "/1")],  # OverflowError escaped step (Calculator's parse_number)
        [answer("1" * 5000 + "/3")],  # ValueError: int() of over 4300 digits
        [call("\ud800", {})],  # "unknown tool '\ud800'": a lone surrogate in the observation
    ]
    if any(t.name == "run_python" for t in env.tools):  # tools crashed on lone surrogates
        episodes.append(
            [
                call("read_file", {"path": "\ud800"}),
                call("run_python", {"code": "print('\ud800')"}),
                call("run", {"command": "echo \ud800"}),
                call("run_python", {"code": "open(b'\\xff.txt', 'w')"}),
                call("list_files", {"path": "."}),  # lists the file as '\udcff.txt'
            ]
        )
    return episodes


def fuzz_env(stepper: fa.Stepper, share: float, guard=None, **strategy) -> None:
    """Replay :func:`found_bugs`, then play fuzzed episodes of 1-4 turns with ``stepper``;
    each must keep every invariant (and, with ``guard``, leave everything outside the
    Workspace root unchanged)."""
    env = stepper.env
    for turns in found_bugs(env):
        assert stepper.play(0, turns) == []
    turns = fa.actions(env.tools, env.parser, **strategy)

    @fuzz(share)
    @given(seed=st.integers(0, 2**16), turns=st.lists(turns, min_size=1, max_size=4))
    def episode(seed, turns):
        problems = stepper.play(seed, turns)
        if guard is not None:
            problems += guard.check(env.workspace)
        assert problems == []

    episode()


@pytest.mark.parametrize(
    ("parser", "share"), [(HermesParser(), 1.0), (ReActParser(), 0.5)], ids=["hermes", "react"]
)
def test_calculator_steps_keep_every_invariant(parser, share):
    env = agentenv.make("Calculator-v0", parser=parser, num_tasks=50)
    fuzz_env(fa.Stepper(env), share)
    env.close()


def test_rag_steps_keep_every_invariant(tmp_path):
    docs, qa = generate(num_per_type=6, seed=7)  # the small corpus of tests/envs/rag
    env = agentenv.make(
        "RAG-v0", corpus=docs, qa=qa, retriever="bm25", chroma="memory", cache_dir=str(tmp_path)
    )
    fuzz_env(fa.Stepper(env), 1.0)
    env.close()


@pytest.mark.parametrize("mode", ["bwrap", "rlimit"])
def test_workspace_steps_stay_inside_the_root_and_leave_nothing_behind(mode):
    try:
        detect_backend(mode)
    except SandboxUnavailableError as exc:
        pytest.skip(f"{mode} sandbox unavailable here: {exc}")
    children = fa.live_children()
    with fa.OutsideGuard() as guard:
        env = agentenv.make("Workspace-v0", sandbox=mode, limits=fa.WORKSPACE_LIMITS, num_tasks=16)
        by_name = fa.argument_strings(outside=[guard.canary, guard.parent])
        file_tools = [t for t in env.tools if t.name in ("list_files", "read_file", "write_file")]
        stepper = fa.Stepper(env)
        try:
            fuzz_env(stepper, 0.5, guard, by_name=by_name, cheap_tools=file_tools)
        finally:
            problems = fa.close_and_check(env, stepper, guard, children)
        assert stepper.uids  # every episode had its own sandbox uid, all checked
        assert problems == []


# ---- the checks themselves ------------------------------------------------------------------
TOO_LONG = "x" * 5000  # over Calculator-v0's bound (max_output_chars=500 plus the marker)


@pytest.mark.parametrize(
    ("result", "kinds"),
    [
        (ValueError("boom"), {"exception"}),
        (([{"role": "tool", "content": TOO_LONG}], 0.0, False, False, {}), {"obs_too_long"}),
        (["not", "a", "5-tuple"], {"bad_result"}),
        (([{"role": "tool", "content": "x"}] * 11, 0.0, False, False, {}), {"obs_too_many"}),
        (([{"role": "robot", "content": "x"}], 0.0, False, False, {}), {"obs_invalid"}),
        (
            ([{"role": "tool", "content": "\ud800"}], math.nan, 0, False, {}),
            {"obs_not_utf8", "reward_not_finite", "flags_not_bool"},
        ),
        (([], 1.0, True, False, {}), {"info_no_correct"}),
        (([], 1.0, False, False, {"tool_errors": {"exception": 1}}), {"tool_exception"}),
    ],
)
def test_stepper_flags_each_broken_invariant(monkeypatch, result, kinds):
    env = agentenv.make("Calculator-v0", num_tasks=5)
    stepper = fa.Stepper(env)
    assert stepper.reset(0) == []

    def step(action):
        if isinstance(result, Exception):
            raise result
        return result

    monkeypatch.setattr(env, "step", step)
    report = stepper.step("<answer>1</answer>")
    assert {v.split(":")[0] for v in report.violations} == kinds


def test_stepper_flags_slow_steps_and_failed_probes(monkeypatch):
    env = agentenv.make("Calculator-v0", num_tasks=5)
    stepper = fa.Stepper(env)
    stepper.reset(0)
    stepper.time_limit_s = 0.01
    real_step = env.step
    monkeypatch.setattr(env, "step", lambda action: (time.sleep(0.05), real_step(action))[1])
    assert [v.split(":")[0] for v in stepper.step("hi").violations] == ["over_time_limit"]
    stepper.time_limit_s = 10.0
    monkeypatch.setattr(env, "step", real_step)
    monkeypatch.setattr(env.executor, "tools", {})  # the probe's valid call now fails
    assert [v.split(":")[0] for v in stepper.probe()] == ["probe_failed"]


def test_outside_guard_sees_changes_next_to_the_root():
    with fa.OutsideGuard() as guard:
        assert guard.check(None) == []
        with open(guard.canary, "a") as f:
            f.write("x")
        os.mkdir(os.path.join(guard.parent, "agentenv-ws-stray"))
        problems = guard.check(None)
    assert [p.split(":")[0] for p in problems] == ["outside_changed", "leftover_dir"]
    assert "canary.txt" in problems[0] and "agentenv-ws-stray" in problems[1]
    assert not os.path.exists(guard.parent)
