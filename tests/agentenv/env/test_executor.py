"""ToolExecutor: results, error kinds, timeouts, truncation and concurrency. It never raises."""

import sys
import threading
import time

import pytest

from agentenv.env.executor import ToolExecutor, ToolResult, truncate
from agentenv.env.parsers import HermesParser, ToolCall
from agentenv.env.tools import tool
from agentenv.errors import ToolError

RELEASE = threading.Event()  # lets abandoned "hanging" tool threads finish at teardown


class QuotaError(ToolError):
    kind = "quota"


@tool
def echo(text: str) -> str:
    """Echo the text back.

    Args:
        text: What to echo.
    """
    return text


@tool
def add(a: int, b: float = 0.5) -> float:
    """Add two numbers.

    Args:
        a: First.
        b: Second.
    """
    return a + b


@tool
def nothing() -> None:
    """Return nothing."""
    return None


@tool
def boom(message: str) -> str:
    """Raise ValueError.

    Args:
        message: The error message.
    """
    raise ValueError(message)


@tool
def over_quota() -> str:
    """Raise a ToolError subclass with its own kind."""
    raise QuotaError("daily quota of 10 calls used up")


@tool
def nap(seconds: float) -> str:
    """Sleep, then say how long.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return f"slept {seconds}"


@tool
def hang() -> str:
    """Block for up to 5 seconds."""
    RELEASE.wait(5)
    return "woke up"


@tool
def flood(n: int) -> str:
    """Return n characters, with recognisable head and tail.

    Args:
        n: Total length.
    """
    return "<HEAD>" + "x" * (n - 12) + "<TAIL>"


@tool
def bye() -> str:
    """Call sys.exit."""
    sys.exit(3)


TOOLS = [echo, add, nothing, boom, over_quota, nap, hang, flood, bye]


@pytest.fixture
def executor() -> ToolExecutor:
    return ToolExecutor(TOOLS, timeout_s=2.0)


@pytest.fixture(autouse=True, scope="module")
def _release_hanging_threads():
    yield
    RELEASE.set()


# --- success ----------------------------------------------------------------------------


def test_success_returns_tool_output(executor):
    result = executor.run_one(ToolCall("echo", {"text": "hello"}))
    assert isinstance(result, ToolResult)
    assert result.name == "echo"
    assert result.content == "hello"
    assert result.error is None
    assert 0 <= result.elapsed_s < 1


def test_non_string_output_is_converted_and_args_validated(executor):
    # b=1 is widened to 1.0, so the float sum is returned as text.
    assert executor.run_one(ToolCall("add", {"a": 2, "b": 1})).content == "3.0"
    assert executor.run_one(ToolCall("add", {"a": 2})).content == "2.5"


def test_none_output(executor):
    assert executor.run_one(ToolCall("nothing", {})).content == "(no output)"


def test_empty_run(executor):
    assert executor.run([]) == []


def test_run_single_call(executor):
    [result] = executor.run([ToolCall("echo", {"text": "x"})])
    assert (result.content, result.error) == ("x", None)


def test_parsed_action_end_to_end(executor):
    action = HermesParser().parse(
        '<tool_call>{"name": "echo", "arguments": {"text": "hi"}}</tool_call>'
        "<tool_call>{oops}</tool_call>"
    )
    results = executor.run(action.tool_calls)
    assert [(r.name, r.error) for r in results] == [("echo", None), (None, "parse")]
    assert results[0].content == "hi"
    assert "not valid JSON" in results[1].content


# --- failures ---------------------------------------------------------------------------


def test_unknown_tool_lists_available_tools(executor):
    result = executor.run_one(ToolCall("rm_rf", {}))
    assert result.error == "unknown_tool"
    assert result.name == "rm_rf"
    assert result.content.startswith("Error: unknown tool 'rm_rf'")
    assert "available tools: add, boom, bye, echo, flood, hang, nap, nothing, over_quota" in (
        result.content
    )


@pytest.mark.parametrize(
    ("arguments", "fragment"),
    [
        ({}, "missing required argument(s) ['text']"),
        ({"text": "a", "loud": True}, "unexpected argument(s) ['loud']"),
        ({"text": 5}, "argument 'text' must be string, got int"),
        (["a"], "must be a JSON object, got list"),
        ("a", "must be a JSON object, got str"),
    ],
)
def test_bad_arguments(executor, arguments, fragment):
    result = executor.run_one(ToolCall("echo", arguments))
    assert result.error == "arguments"
    assert result.content.startswith("Error: ")
    assert fragment in result.content


def test_tool_exception_is_reported_not_raised(executor):
    result = executor.run_one(ToolCall("boom", {"message": "bad input 7"}))
    assert result.error == "exception"
    assert result.content == "Error: tool 'boom' raised ValueError: bad input 7"


def test_tool_error_subclass_keeps_its_kind(executor):
    result = executor.run_one(ToolCall("over_quota", {}))
    assert result.error == "quota"
    assert result.content == "Error: daily quota of 10 calls used up"


def test_parse_error_call(executor):
    call = ToolCall(None, raw="{oops", error="tool call is not valid JSON (Expecting value)")
    result = executor.run_one(call)
    assert result.name is None
    assert result.error == "parse"
    assert result.content == "Error: tool call is not valid JSON (Expecting value)"


def test_parse_error_wins_over_name(executor):
    # A call carrying an error is never executed, even if it names a real tool.
    result = executor.run_one(ToolCall("echo", {"text": "x"}, error="extra tool call"))
    assert result.error == "parse"
    assert result.content == "Error: extra tool call"


def test_timeout_returns_quickly():
    executor = ToolExecutor(TOOLS, timeout_s=0.3)
    start = time.perf_counter()
    result = executor.run_one(ToolCall("hang", {}))
    elapsed = time.perf_counter() - start
    assert elapsed < 1.0
    assert result.error == "timeout"
    assert result.content == "Error: tool 'hang' timed out after 0.3 s; try a smaller input"
    assert 0.3 <= result.elapsed_s < 1.0


def test_call_within_timeout_succeeds():
    executor = ToolExecutor(TOOLS, timeout_s=1.0)
    result = executor.run_one(ToolCall("nap", {"seconds": 0.05}))
    assert (result.content, result.error) == ("slept 0.05", None)
    assert result.elapsed_s >= 0.05


def test_long_error_message_is_truncated(executor):
    result = executor.run_one(ToolCall("boom", {"message": "e" * 100_000}))
    assert result.error == "exception"
    assert result.content.startswith("Error: tool 'boom' raised ValueError: eee")
    assert "characters truncated" in result.content
    assert len(result.content) < 600


def test_tool_calling_sys_exit_does_not_raise(executor):
    result = executor.run_one(ToolCall("bye", {}))
    assert result.error == "exception"


# --- run(): concurrency, order, never raises --------------------------------------------


def test_run_is_concurrent_and_keeps_order(executor):
    calls = [ToolCall("nap", {"seconds": 0.3 + i / 1000}) for i in range(4)]
    start = time.perf_counter()
    results = executor.run(calls)
    elapsed = time.perf_counter() - start
    assert elapsed < 0.9
    assert [r.content for r in results] == [
        "slept 0.3",
        "slept 0.301",
        "slept 0.302",
        "slept 0.303",
    ]
    assert all(r.elapsed_s >= 0.3 for r in results)


def test_run_order_is_call_order_not_finish_order(executor):
    calls = [
        ToolCall("nap", {"seconds": 0.2}),
        ToolCall("echo", {"text": "fast"}),
        ToolCall("nap", {"seconds": 0.1}),
    ]
    results = executor.run(calls)
    assert [r.content for r in results] == ["slept 0.2", "fast", "slept 0.1"]


def test_run_mixed_failures_never_raises():
    executor = ToolExecutor(TOOLS, timeout_s=0.3)
    calls = [
        ToolCall("echo", {"text": "ok"}),
        ToolCall(None, error="bad JSON"),
        ToolCall("nope", {}),
        ToolCall("echo", {}),
        ToolCall("boom", {"message": "x"}),
        ToolCall("over_quota", {}),
        ToolCall("hang", {}),
        ToolCall(None, {}),
    ]
    start = time.perf_counter()
    results = executor.run(calls)
    assert time.perf_counter() - start < 1.0
    assert [r.error for r in results] == [
        None,
        "parse",
        "unknown_tool",
        "arguments",
        "exception",
        "quota",
        "timeout",
        "unknown_tool",
    ]
    assert results[0].content == "ok"
    for r in results[1:]:
        assert r.content.startswith("Error:")


# --- output truncation ------------------------------------------------------------------


def test_ten_megabyte_output_is_truncated():
    executor = ToolExecutor(TOOLS, max_output_chars=1000)
    n = 10_000_000
    result = executor.run_one(ToolCall("flood", {"n": n}))
    assert result.error is None
    marker = f"\n[... {n - 1000} characters truncated ...]\n"
    assert marker in result.content
    assert len(result.content) == 1000 + len(marker)
    assert result.content.startswith("<HEAD>" + "x" * 100)
    assert result.content.endswith("x" * 100 + "<TAIL>")
    head, tail = result.content.split(marker)
    assert (len(head), len(tail)) == (500, 500)


def test_output_at_limit_is_not_truncated():
    executor = ToolExecutor(TOOLS, max_output_chars=1000)
    result = executor.run_one(ToolCall("flood", {"n": 1000}))
    assert len(result.content) == 1000
    assert "truncated" not in result.content


@pytest.mark.parametrize(
    ("text", "max_chars", "expected"),
    [
        ("", 5, ""),
        ("abc", 5, "abc"),
        ("abcde", 5, "abcde"),
        ("abcdef", 5, "ab\n[... 1 characters truncated ...]\ndef"),
        ("abcdefghij", 4, "ab\n[... 6 characters truncated ...]\nij"),
        ("abcdefghij", 1, "\n[... 9 characters truncated ...]\nj"),
        ("abcdefghij", 0, "\n[... 10 characters truncated ...]\n"),
    ],
)
def test_truncate(text, max_chars, expected):
    assert truncate(text, max_chars) == expected


def test_truncate_keeps_head_and_tail_of_long_text():
    text = "".join(chr(ord("a") + i % 26) for i in range(10_000))
    out = truncate(text, 100)
    assert out.startswith(text[:50])
    assert out.endswith(text[-50:])
    assert "[... 9900 characters truncated ...]" in out


# --- constructor ------------------------------------------------------------------------


@pytest.mark.parametrize("timeout_s", [0, -1, -0.5])
def test_rejects_non_positive_timeout(timeout_s):
    with pytest.raises(ValueError, match=f"timeout_s must be > 0, got {timeout_s}"):
        ToolExecutor(TOOLS, timeout_s=timeout_s)


@pytest.mark.parametrize("max_output_chars", [0, -10])
def test_rejects_max_output_chars_below_one(max_output_chars):
    with pytest.raises(ValueError, match=f"max_output_chars must be >= 1, got {max_output_chars}"):
        ToolExecutor(TOOLS, max_output_chars=max_output_chars)


def test_constructor_stores_settings():
    executor = ToolExecutor([echo], timeout_s=3, max_output_chars=10)
    assert executor.tools == {"echo": echo}
    assert executor.timeout_s == 3.0
    assert executor.max_output_chars == 10
