"""Tools: typed Python callables with a JSON schema derived from their signature.

>>> @tool
... def add(a: int, b: int) -> int:
...     '''Add two integers.
...
...     Args:
...         a: The first addend.
...         b: The second addend.
...     '''
...     return a + b
>>> add.schema["function"]["parameters"]["required"]
['a', 'b']

The schema uses the OpenAI/Hugging Face "function" format, so ``[t.schema for t in
tools]`` can be passed straight to ``tokenizer.apply_chat_template(tools=...)``.

The schema is built here, not by ``transformers.utils.get_json_schema`` (same output, see
``tests/agentenv/integrations/test_trl.py``), because importing that loads no torch but took
0.45 s and 485 modules (transformers 5.24, 2 CPU cores) against 0.1 s for all of ``import
agentenv``, and ``envs.calculator`` builds its tool at import time.
"""

from __future__ import annotations

import inspect
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agentenv.errors import ToolArgumentError, ToolDefinitionError

_JSON_TYPES: dict[type, str] = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    list: "array",
    tuple: "array",
    dict: "object",
}


def _type_schema(tp: Any, where: str) -> dict[str, Any]:
    """JSON schema of one annotation (str, int, float, bool, list[X], dict, Literal, Optional)."""
    origin = typing.get_origin(tp)
    if tp in _JSON_TYPES:
        return {"type": _JSON_TYPES[tp]}
    if origin is typing.Literal:
        values = list(typing.get_args(tp))
        return {"type": _JSON_TYPES[type(values[0])], "enum": values}
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return {**_type_schema(args[0], where), "nullable": True}
        return {"anyOf": [_type_schema(a, where) for a in args]}
    if origin in (list, tuple):
        args = typing.get_args(tp)
        return {"type": "array", **({"items": _type_schema(args[0], where)} if args else {})}
    if origin is dict:
        return {"type": "object"}
    raise ToolDefinitionError(
        f"{where}: unsupported type annotation {tp!r}; use str, int, float, bool, "
        "list[...], dict, Literal[...] or Optional[...]"
    )


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """Split a Google-style docstring into (description, {arg: description})."""
    doc = inspect.cleandoc(doc)
    parts = re.split(r"^\s*(?:Args|Arguments|Parameters):\s*$", doc, maxsplit=1, flags=re.M)
    description = parts[0].strip()
    args: dict[str, str] = {}
    if len(parts) == 2:
        section = re.split(
            r"^\s*(?:Returns|Raises|Yields|Examples?|Notes?):\s*$", parts[1], maxsplit=1, flags=re.M
        )[0]
        current = None
        indent = None  # argument lines sit at the section's base indent; deeper = continuation
        for line in section.splitlines():
            if not line.strip():
                continue
            depth = len(line) - len(line.lstrip())
            m = re.match(r"^\s*(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$", line)
            if m and (indent is None or depth <= indent):
                indent = depth
                current = m.group(1)
                args[current] = m.group(2).strip()
            elif current:
                args[current] += " " + line.strip()
    return description, args


@dataclass(frozen=True)
class Tool:
    """A callable the agent can invoke, with the JSON schema shown to the model.

    Build one with the :func:`tool` decorator rather than by hand.

    Attributes:
        name: The name the model uses in a tool call.
        description: What the tool does (first part of the docstring).
        parameters: JSON schema ``{"type": "object", "properties": ..., "required": ...}``.
        fn: The Python callable, called with keyword arguments.
    """

    name: str
    description: str
    parameters: dict[str, Any]
    fn: Callable[..., Any] = field(repr=False)

    @property
    def schema(self) -> dict[str, Any]:
        """The OpenAI / Hugging Face chat-template function schema."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }

    def validate(self, arguments: Any) -> dict[str, Any]:
        """Check ``arguments`` against the schema and return them, ints widened to float.

        Raises:
            ToolArgumentError: with a short message naming the argument and the fix.
        """
        if not isinstance(arguments, dict):
            raise ToolArgumentError(
                f"arguments of '{self.name}' must be a JSON object, got {type(arguments).__name__}"
            )
        props: dict[str, Any] = self.parameters["properties"]
        unknown = sorted(set(arguments) - set(props))
        if unknown:
            raise ToolArgumentError(
                f"'{self.name}' got unexpected argument(s) {unknown}; it takes {sorted(props)}"
            )
        missing = [a for a in self.parameters.get("required", []) if a not in arguments]
        if missing:
            raise ToolArgumentError(f"'{self.name}' is missing required argument(s) {missing}")
        out = dict(arguments)
        for name, value in arguments.items():
            out[name] = _check_value(self.name, name, value, props[name])
        return out

    def __call__(self, **kwargs: Any) -> Any:
        return self.fn(**kwargs)


def _check_value(tool_name: str, arg: str, value: Any, schema: dict[str, Any]) -> Any:
    if value is None and schema.get("nullable"):
        return value
    if "anyOf" in schema:
        for option in schema["anyOf"]:
            try:
                return _check_value(tool_name, arg, value, option)
            except ToolArgumentError:
                continue
        raise ToolArgumentError(f"'{tool_name}' argument '{arg}' has the wrong type")
    expected = schema.get("type")
    ok = {
        "string": isinstance(value, str),
        "integer": isinstance(value, int) and not isinstance(value, bool),
        "number": isinstance(value, int | float) and not isinstance(value, bool),
        "boolean": isinstance(value, bool),
        "array": isinstance(value, list),
        "object": isinstance(value, dict),
    }.get(expected, True)
    if not ok:
        raise ToolArgumentError(
            f"'{tool_name}' argument '{arg}' must be {expected}, got {type(value).__name__} "
            f"{_short(value)}"
        )
    if expected == "array" and "items" in schema:
        value = [
            _check_value(tool_name, f"{arg}[{i}]", v, schema["items"]) for i, v in enumerate(value)
        ]
    if "enum" in schema and value not in schema["enum"]:
        raise ToolArgumentError(
            f"'{tool_name}' argument '{arg}' must be one of {schema['enum']}, got {_short(value)}"
        )
    if expected == "number":
        try:
            return float(value)
        except OverflowError:
            raise ToolArgumentError(
                f"'{tool_name}' argument '{arg}' is too large for a number"
            ) from None
    return value


def _short(value: Any, n: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= n else text[: n - 3] + "..."


def tool(fn: Callable[..., Any] | None = None, *, name: str | None = None) -> Any:
    """Turn a typed, Google-docstring'd function into a :class:`Tool`.

    Every parameter needs a type annotation and an ``Args:`` entry; parameters
    with defaults are optional in the schema.

    Args:
        fn: The function (when used as ``@tool``).
        name: Tool name; defaults to ``fn.__name__``.

    Raises:
        ToolDefinitionError: if an annotation or docstring entry is missing.
    """

    def build(f: Callable[..., Any]) -> Tool:
        tool_name = name or f.__name__
        if not f.__doc__:
            raise ToolDefinitionError(
                f"tool '{tool_name}' has no docstring; add one that describes it, with an "
                "'Args:' section naming each parameter"
            )
        description, arg_docs = _parse_docstring(f.__doc__)
        try:
            hints = typing.get_type_hints(f)
        except NameError as exc:
            raise ToolDefinitionError(
                f"tool '{tool_name}': cannot resolve a type annotation ({exc}); define the type "
                "at module level or use a built-in type"
            ) from exc
        properties: dict[str, Any] = {}
        required: list[str] = []
        for p in inspect.signature(f).parameters.values():
            where = f"tool '{tool_name}', parameter '{p.name}'"
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise ToolDefinitionError(f"{where}: *args/**kwargs are not supported")
            if p.name not in hints:
                raise ToolDefinitionError(f"{where} has no type annotation; add one")
            if p.name not in arg_docs:
                raise ToolDefinitionError(
                    f"{where} is not described in the docstring; add '{p.name}: ...' under Args:"
                )
            properties[p.name] = {
                **_type_schema(hints[p.name], where),
                "description": arg_docs[p.name],
            }
            if p.default is inspect.Parameter.empty:
                required.append(p.name)
        params = {"type": "object", "properties": properties, "required": required}
        return Tool(name=tool_name, description=description, parameters=params, fn=f)

    return build(fn) if fn is not None else build


def toolset(
    obj: object,
    *,
    include: Sequence[str] | None = None,
    rename: Mapping[str, str] | None = None,
) -> list[Tool]:
    """The public methods of ``obj`` as tools, bound to it: a stateful toolset.

    Each method becomes a :class:`Tool` as :func:`tool` builds one (schema from its type
    hints and Google docstring); a call runs on ``obj``, so the tools share its state
    (a file system's current folder, a cart's items). Build one object per episode
    (:meth:`agentenv.ToolEnv.episode_tools`) and episodes never share state.

    Args:
        obj: Any object.
        include: The methods to expose, in this order (default: every public method
            of its class, by name).
        rename: ``{method: tool name}`` for methods whose tool name differs.

    Raises:
        ToolDefinitionError: a method that ``include`` or ``rename`` names is missing,
            or one lacks type hints or docstring entries (as :func:`tool` says).
    """
    cls = type(obj)
    public = sorted(
        n for n, v in inspect.getmembers(cls, inspect.isfunction) if not n.startswith("_")
    )
    names = list(public if include is None else include)
    rename = dict(rename or {})
    for name in [*names, *rename]:
        if name not in public:
            raise ToolDefinitionError(
                f"{cls.__name__} has no public method {name!r}; its methods: {', '.join(public)}"
            )
    return [tool(getattr(obj, n), name=rename.get(n, n)) for n in names]
