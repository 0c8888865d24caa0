"""Run tool calls safely: per-call wall-clock timeout, truncated output, no exceptions.

:meth:`ToolExecutor.run` never raises. A malformed call, an unknown tool, bad
arguments, an exception in the tool or a timeout each become a
:class:`ToolResult` whose ``content`` is a short ``Error: ...`` line the model can
read and whose ``error`` names the failure kind (recorded in the env's ``info``).

Timeouts: each call runs in a daemon thread that is abandoned when it overruns
(Python cannot kill a thread). That bounds the *episode's* wait, not the
tool's CPU use: tools that run untrusted code must enforce their own limits in a
child process (the Workspace env does).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from agentenv.env.parsers import ToolCall
from agentenv.env.tools import Tool
from agentenv.errors import ToolError, ToolTimeoutError, UnknownToolError


@dataclass
class ToolResult:
    """The outcome of one tool call.

    Attributes:
        name: Tool name (``None`` when the call could not be parsed).
        content: What the model sees: the tool's output or ``Error: ...``.
        error: Failure kind (``"parse"``, ``"unknown_tool"``, ``"arguments"``,
            ``"exception"``, ``"timeout"``, or a tool's own) or ``None`` on success.
        elapsed_s: Wall-clock seconds spent.
    """

    name: str | None
    content: str
    error: str | None = None
    elapsed_s: float = 0.0


def truncate(text: str, max_chars: int) -> str:
    """Shorten ``text`` to ``max_chars``, keeping head and tail around a visible marker."""
    if len(text) <= max_chars:
        return text
    marker = f"\n[... {len(text) - max_chars} characters truncated ...]\n"
    head = max_chars // 2
    tail = max_chars - head
    return text[:head] + marker + (text[-tail:] if tail else "")


class ToolExecutor:
    """Executes parsed tool calls against a fixed set of tools.

    Args:
        tools: The tools on offer.
        timeout_s: Wall-clock limit per call, in seconds.
        max_output_chars: Longest output returned; longer output keeps head and tail.
        in_order: Run a message's calls one after another, in order (tools that share
            state, e.g. a stateful toolset's: ``cd`` then ``ls``), not concurrently.
    """

    def __init__(
        self,
        tools: Sequence[Tool],
        *,
        timeout_s: float = 10.0,
        max_output_chars: int = 2000,
        in_order: bool = False,
    ):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if max_output_chars < 1:
            raise ValueError(f"max_output_chars must be >= 1, got {max_output_chars}")
        self.tools = {t.name: t for t in tools}
        self.timeout_s = float(timeout_s)
        self.max_output_chars = int(max_output_chars)
        self.in_order = bool(in_order)

    def run(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """Run ``calls`` concurrently (``in_order``: one after another); results come back in
        call order."""
        if len(calls) <= 1 or self.in_order:
            return [self.run_one(c) for c in calls]
        with ThreadPoolExecutor(max_workers=len(calls)) as pool:
            return list(pool.map(self.run_one, calls))

    def run_one(self, call: ToolCall) -> ToolResult:
        """Run one call within the timeout; never raises."""
        start = time.perf_counter()
        try:
            if call.error is not None:
                return self._error(call.name, "parse", call.error, start)
            tool = self._lookup(call.name)
            kwargs = tool.validate(call.arguments)
            value = self._call_with_timeout(tool, kwargs)
        except ToolError as exc:
            return self._error(call.name, exc.kind, str(exc), start)
        except (Exception, SystemExit) as exc:  # the tool's own bug: reported, episode goes on
            msg = f"tool '{call.name}' raised {type(exc).__name__}: {exc}"
            return self._error(call.name, "exception", msg, start)
        text = value if isinstance(value, str) else _to_text(value)
        content = truncate(_encodable(text), self.max_output_chars)
        return ToolResult(call.name, content, None, time.perf_counter() - start)

    def _lookup(self, name: str | None) -> Tool:
        if name not in self.tools:
            raise UnknownToolError(
                f"unknown tool '{name}'; available tools: {', '.join(sorted(self.tools))}"
            )
        return self.tools[name]

    def _call_with_timeout(self, tool: Tool, kwargs: dict[str, Any]) -> Any:
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["value"] = tool.fn(**kwargs)
            except BaseException as exc:  # noqa: B036 - re-raised in the caller's thread
                box["error"] = exc

        thread = threading.Thread(target=target, name=f"tool-{tool.name}", daemon=True)
        thread.start()
        thread.join(self.timeout_s)
        if thread.is_alive():
            raise ToolTimeoutError(
                f"tool '{tool.name}' timed out after {self.timeout_s:g} s; try a smaller input"
            )
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def _error(self, name: str | None, kind: str, msg: str, start: float) -> ToolResult:
        content = truncate(_encodable(f"Error: {msg}"), max(200, min(self.max_output_chars, 500)))
        return ToolResult(name, content, kind, time.perf_counter() - start)


def _encodable(text: str) -> str:
    """``text`` with lone surrogates written as ``\\udXXX`` escapes: JSON arguments can hold
    them (``"\\ud800"``) and tools echo them, but no tokenizer accepts them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def _to_text(value: Any) -> str:
    if value is None:
        return "(no output)"
    return str(value)
