"""Action parsers: turn the model's text into tool calls and a final answer.

The default :class:`HermesParser` reads the Hermes/Qwen convention::

    <tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>
    <answer>4</answer>

Parsers are pluggable: anything with ``parse(text) -> ParsedAction`` and
``format_instructions(tools) -> str`` works (see :class:`ReActParser`). Parsing
never raises on model output; malformed calls become :class:`ToolCall` objects
with ``error`` set, which the executor reports back to the model.

Parsing uses ``str.find`` scans, linear in the text length, so a 1 MB action is
parsed in milliseconds (no regex backtracking).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from agentenv.env.tools import Tool

MAX_JSON_DEPTH = 64
"""Deepest nesting of lists/objects in a tool call's arguments (the arguments object is
level 1): deeper JSON is an error call. ``json`` parses ~1,000 levels, but tools, loggers
and JSONL writers that recurse over a value that deep overflow Python's stack."""


def _loads(text: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads``; raises ``RecursionError`` past ``max_depth`` levels."""
    value = json.loads(text)
    stack = [(value, 1)]
    while stack:  # iterative: the check itself must not recurse
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > max_depth:
                raise RecursionError(f"nested deeper than {max_depth} levels")
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return value


@dataclass
class ToolCall:
    """One tool call found in an action.

    Attributes:
        name: Tool name, or ``None`` when the call could not be parsed.
        arguments: Parsed arguments (normally a dict).
        raw: The text of the call as the model wrote it (possibly shortened).
        error: Why the call is malformed, or ``None``.
    """

    name: str | None
    arguments: Any = field(default_factory=dict)
    raw: str = ""
    error: str | None = None


@dataclass
class ParsedAction:
    """What a parser found in one action.

    Attributes:
        tool_calls: Calls in order of appearance (malformed ones included, with ``error``).
        answer: Text of the final answer, or ``None``.
    """

    tool_calls: list[ToolCall] = field(default_factory=list)
    answer: str | None = None


@runtime_checkable
class ActionParser(Protocol):
    """The interface an action parser implements.

    A parser may also have ``stop_strings``: strings after which the rest of a turn is
    never read (samplers end the turn there; see ``ToolEnv.stop_strings``).
    """

    def parse(self, text: str) -> ParsedAction:
        """Find the tool calls and final answer in ``text``. Never raises."""
        ...

    def format_instructions(self, tools: Sequence[Tool]) -> str:
        """Text for the system prompt telling the model how to call ``tools`` and answer."""
        ...


def _spans(text: str, open_tag: str, close_tag: str) -> tuple[list[str], bool]:
    """Contents of every ``open_tag ... close_tag`` span, and whether one was left unclosed."""
    out: list[str] = []
    pos = 0
    while True:
        start = text.find(open_tag, pos)
        if start < 0:
            return out, False
        end = text.find(close_tag, start + len(open_tag))
        if end < 0:
            return out, True
        out.append(text[start + len(open_tag) : end])
        pos = end + len(close_tag)


def _shorten(text: str, n: int = 80) -> str:
    text = text.strip()
    return text if len(text) <= n else text[: n - 3] + "..."


def _call_from_json(payload: str, example: str) -> ToolCall:
    """Build a ToolCall from a ``{"name": ..., "arguments": {...}}`` JSON payload."""
    raw = _shorten(payload)
    try:
        obj = _loads(payload, MAX_JSON_DEPTH + 1)  # the arguments sit inside the payload
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, over-long ints, deep nesting
        reason = getattr(exc, "msg", None) or (
            f"nested deeper than {MAX_JSON_DEPTH} levels"
            if isinstance(exc, RecursionError)
            else "number too long"
        )
        return ToolCall(None, raw=raw, error=f"tool call is not valid JSON ({reason}); {example}")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall(None, raw=raw, error=f'tool call needs a string "name"; {example}')
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models JSON-encode the arguments twice
        try:
            args = _loads(args) if args.strip() else {}
        except (ValueError, RecursionError):
            pass  # left as a string: the executor reports "must be a JSON object"
    return ToolCall(obj["name"], args, raw=raw)


@dataclass
class HermesParser:
    """``<tool_call>{json}</tool_call>`` calls and an ``<answer>...</answer>`` final answer.

    Args:
        max_calls: Most tool calls honoured in one message; extra ones get an error.
        answer_tag: Tag name of the final answer.
    """

    max_calls: int = 8
    answer_tag: str = "answer"

    @property
    def example(self) -> str:
        return 'write <tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>'

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """A turn may end once a call or the answer is closed (one call per turn then)."""
        return ("</tool_call>", f"</{self.answer_tag}>")

    def parse(self, text: str) -> ParsedAction:
        payloads, unclosed = _spans(text, "<tool_call>", "</tool_call>")
        calls = [_call_from_json(p, self.example) for p in payloads[: self.max_calls]]
        if len(payloads) > self.max_calls:
            calls.append(
                ToolCall(
                    None,
                    raw="",
                    error=(
                        f"{len(payloads) - self.max_calls} extra tool call(s) ignored: at most "
                        f"{self.max_calls} per message"
                    ),
                )
            )
        if unclosed:
            calls.append(
                ToolCall(
                    None,
                    raw="<tool_call>",
                    error=(
                        f"<tool_call> was opened but never closed with </tool_call>; {self.example}"
                    ),
                )
            )
        answers, _ = _spans(text, f"<{self.answer_tag}>", f"</{self.answer_tag}>")
        answer = answers[-1].strip() if answers else None
        return ParsedAction(tool_calls=calls, answer=answer)

    def format_action(self, tool_calls: Sequence[ToolCall] = (), answer: str | None = None) -> str:
        """The text that makes ``tool_calls`` (each one's ``name`` and ``arguments``) and
        gives ``answer``: :meth:`parse` reads back the same calls and answer. Used where
        actions arrive structured (``agentenv.integrations.openenv``)."""
        parts = []
        for call in tool_calls:
            payload = json.dumps({"name": call.name, "arguments": call.arguments})
            payload = payload.replace("<", "\\u003c")  # a "<" only occurs in JSON strings
            parts.append(f"<tool_call>{payload}</tool_call>")
        if answer is not None:
            parts.append(f"<{self.answer_tag}>{answer}</{self.answer_tag}>")
        return "\n".join(parts)

    def format_instructions(self, tools: Sequence[Tool]) -> str:
        lines = [
            "You can call these tools:",
            *(json.dumps(t.schema["function"]) for t in tools),
            "",
            "To call a tool, write exactly:",
            '<tool_call>{"name": "<tool name>", "arguments": {<arguments as JSON>}}</tool_call>',
            "The result comes back in the next message. When you know the final answer, "
            f"write it as <{self.answer_tag}>...</{self.answer_tag}>.",
        ]
        return "\n".join(lines)


@dataclass
class ReActParser:
    """ReAct style: ``Action: name`` / ``Action Input: {json}`` and ``Final Answer: ...``."""

    max_calls: int = 8

    @property
    def example(self) -> str:
        return 'write "Action: <tool>" then "Action Input: {...}" on the next line'

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """ReAct's classic stop: the model must not write the observation itself."""
        return ("Observation:",)

    def format_action(self, tool_calls: Sequence[ToolCall] = (), answer: str | None = None) -> str:
        """The text that makes ``tool_calls`` and gives ``answer`` (see
        :meth:`HermesParser.format_action`); ``answer`` must be one line."""
        lines = []
        for call in tool_calls:
            lines += [f"Action: {call.name}", f"Action Input: {json.dumps(call.arguments)}"]
        if answer is not None:
            lines.append(f"Final Answer: {answer}")
        return "\n".join(lines)

    def parse(self, text: str) -> ParsedAction:
        calls: list[ToolCall] = []
        answer: str | None = None
        lines = text.split("\n")  # not splitlines(): JSON strings may hold \x85, \u2028
        for i, line in enumerate(lines):
            stripped = line.strip()
            if stripped.startswith("Final Answer:"):
                answer = stripped[len("Final Answer:") :].strip()
            elif stripped.startswith("Action:") and len(calls) <= self.max_calls:
                name = stripped[len("Action:") :].strip()
                nxt = lines[i + 1].strip() if i + 1 < len(lines) else ""
                if not nxt.startswith("Action Input:"):
                    calls.append(
                        ToolCall(None, raw=stripped, error=f"missing Action Input; {self.example}")
                    )
                    continue
                args_text = nxt[len("Action Input:") :].strip() or "{}"
                try:
                    calls.append(ToolCall(name, _loads(args_text), raw=_shorten(stripped)))
                except (ValueError, RecursionError):
                    calls.append(
                        ToolCall(
                            None,
                            raw=_shorten(args_text),
                            error=(f"Action Input is not valid JSON; {self.example}"),
                        )
                    )
        if len(calls) > self.max_calls:
            calls = calls[: self.max_calls] + [
                ToolCall(
                    None, error=(f"extra tool calls ignored: at most {self.max_calls} per message")
                )
            ]
        return ParsedAction(tool_calls=calls, answer=answer)

    def format_instructions(self, tools: Sequence[Tool]) -> str:
        lines = [
            "You can call these tools:",
            *(json.dumps(t.schema["function"]) for t in tools),
            "",
            "To call a tool, write two lines:",
            "Action: <tool name>",
            "Action Input: <arguments as a JSON object>",
            "The result comes back in the next message. When you know the final answer, "
            "write: Final Answer: <answer>",
        ]
        return "\n".join(lines)
