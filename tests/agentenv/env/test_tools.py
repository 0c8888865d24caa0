"""The @tool decorator: schema derivation, definition errors and argument validation."""

import json
from typing import Literal, Optional

import pytest

from agentenv.env.tools import Tool, tool
from agentenv.errors import ToolArgumentError, ToolDefinitionError


class Point:
    """A custom class, not a JSON type."""


@tool
def search(
    query: str,
    limit: int,
    scale: float,
    exact: bool,
    ids: list[int],
    mode: Literal["fast", "slow"],
    note: Optional[str],  # noqa: UP045 - testing the typing.Optional spelling
    page: int | None = None,
    verbose: bool = False,
) -> str:
    """Search the corpus for a query.

    Returns the best matches.

    Args:
        query: The text to look for.
        limit: Most results to return,
            counted after de-duplication.
        scale: Score multiplier.
        exact (bool): Whether to match exactly.
        ids: Document ids to restrict to.
        mode: Search speed.
        note: Free-form note.
        page: Result page.
        verbose: Print more.

    Returns:
        The matches, one a line.
    """
    return query


PROPS = search.parameters["properties"]


def test_tool_decorator_returns_tool_named_after_function():
    assert isinstance(search, Tool)
    assert search.name == "search"
    assert search.description == "Search the corpus for a query.\n\nReturns the best matches."


def test_tool_name_override():
    @tool(name="lookup")
    def f(q: str) -> str:
        """Look up.

        Args:
            q: Query.
        """
        return q

    assert f.name == "lookup"
    assert f.schema["function"]["name"] == "lookup"


def test_schema_layout():
    schema = search.schema
    assert schema["type"] == "function"
    assert set(schema["function"]) == {"name", "description", "parameters"}
    assert schema["function"]["parameters"]["type"] == "object"
    assert list(PROPS) == [
        "query",
        "limit",
        "scale",
        "exact",
        "ids",
        "mode",
        "note",
        "page",
        "verbose",
    ]


@pytest.mark.parametrize(
    ("param", "expected"),
    [
        ("query", {"type": "string"}),
        ("limit", {"type": "integer"}),
        ("scale", {"type": "number"}),
        ("exact", {"type": "boolean"}),
        ("ids", {"type": "array", "items": {"type": "integer"}}),
        ("mode", {"type": "string", "enum": ["fast", "slow"]}),
        ("note", {"type": "string", "nullable": True}),
        ("page", {"type": "integer", "nullable": True}),
        ("verbose", {"type": "boolean"}),
    ],
)
def test_schema_types(param, expected):
    got = {k: v for k, v in PROPS[param].items() if k != "description"}
    assert got == expected


def test_defaults_are_not_required():
    # Optional without a default is still required (it may be null, not omitted).
    assert search.parameters["required"] == [
        "query",
        "limit",
        "scale",
        "exact",
        "ids",
        "mode",
        "note",
    ]


@pytest.mark.parametrize(
    ("param", "description"),
    [
        ("query", "The text to look for."),
        ("limit", "Most results to return, counted after de-duplication."),
        ("exact", "Whether to match exactly."),
        ("verbose", "Print more."),
    ],
)
def test_descriptions_from_args_section(param, description):
    assert PROPS[param]["description"] == description


def test_returns_section_not_in_descriptions():
    assert "one a line" not in json.dumps(search.schema)


def test_schema_is_json_serialisable():
    text = json.dumps([search.schema])
    assert json.loads(text) == [search.schema]


def test_tool_is_callable_with_kwargs():
    assert search(query="q", limit=1, scale=1.0, exact=True, ids=[], mode="fast", note=None) == "q"


def test_tool_without_parameters():
    @tool
    def ping() -> str:
        """Ping the server."""
        return "pong"

    assert ping.parameters == {"type": "object", "properties": {}, "required": []}
    assert ping.validate({}) == {}


def test_continuation_line_with_colon_stays_in_description():
    @tool
    def move(distance: float) -> str:
        """Move.

        Args:
            distance: How far to go.
                Units: meters.
        """
        return ""

    assert move.parameters["properties"]["distance"]["description"] == (
        "How far to go. Units: meters."
    )


# --- definition errors ------------------------------------------------------------------


def _no_doc(x: int) -> int:
    return x


def _no_annotation(x) -> int:
    """F.

    Args:
        x: X.
    """
    return x


def _undocumented(x: int, y: int) -> int:
    """F.

    Args:
        x: X.
    """
    return x


def _star_args(x: int, *rest: int) -> int:
    """F.

    Args:
        x: X.
        rest: More.
    """
    return x


def _star_kwargs(x: int, **extra: int) -> int:
    """F.

    Args:
        x: X.
        extra: More.
    """
    return x


def _custom_class(p: Point) -> int:
    """F.

    Args:
        p: A point.
    """
    return 0


@pytest.mark.parametrize(
    ("fn", "fragments"),
    [
        (_no_doc, ["'_no_doc'", "no docstring", "Args:"]),
        (_no_annotation, ["parameter 'x'", "no type annotation"]),
        (_undocumented, ["parameter 'y'", "not described", "'y: ...'"]),
        (_star_args, ["parameter 'rest'", "*args"]),
        (_star_kwargs, ["parameter 'extra'", "**kwargs"]),
        (_custom_class, ["parameter 'p'", "unsupported type annotation", "Point"]),
    ],
)
def test_definition_errors_name_the_problem(fn, fragments):
    with pytest.raises(ToolDefinitionError) as info:
        tool(fn)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message


def test_definition_error_is_a_type_error():
    with pytest.raises(TypeError):
        tool(_no_doc)


# --- validate ---------------------------------------------------------------------------


@tool
def calc(n: int, x: float, flag: bool, op: Literal["add", "mul"] = "add") -> str:
    """Calculate.

    Args:
        n: A count.
        x: A value.
        flag: A switch.
        op: The operation.
    """
    return ""


VALID = {"n": 2, "x": 1.5, "flag": True}


def test_validate_returns_arguments():
    assert calc.validate(VALID) == VALID
    assert calc.validate({**VALID, "op": "mul"})["op"] == "mul"


def test_validate_widens_int_to_float():
    out = calc.validate({**VALID, "x": 3})
    assert out["x"] == 3.0
    assert type(out["x"]) is float


def test_validate_does_not_mutate_input():
    args = {**VALID, "x": 3}
    calc.validate(args)
    assert type(args["x"]) is int


def test_validate_missing_argument():
    with pytest.raises(
        ToolArgumentError, match=r"'calc' is missing required argument\(s\) \['n'\]"
    ):
        calc.validate({"x": 1.0, "flag": False})


def test_validate_unknown_argument_lists_accepted_ones():
    with pytest.raises(ToolArgumentError) as info:
        calc.validate({**VALID, "colour": "red"})
    message = str(info.value)
    assert "unexpected argument(s) ['colour']" in message
    assert "['flag', 'n', 'op', 'x']" in message


@pytest.mark.parametrize(
    ("arg", "value", "fragment"),
    [
        ("n", "2", "argument 'n' must be integer, got str '2'"),
        ("n", True, "argument 'n' must be integer, got bool True"),
        ("n", 2.0, "argument 'n' must be integer, got float 2.0"),
        ("x", "1.5", "argument 'x' must be number, got str"),
        ("x", False, "argument 'x' must be number, got bool"),
        ("flag", 1, "argument 'flag' must be boolean, got int 1"),
        ("op", "div", "argument 'op' must be one of ['add', 'mul'], got 'div'"),
        ("op", 1, "argument 'op' must be string, got int"),
    ],
)
def test_validate_wrong_type(arg, value, fragment):
    with pytest.raises(ToolArgumentError) as info:
        calc.validate({**VALID, arg: value})
    assert fragment in str(info.value)


def test_validate_long_value_is_shortened_in_message():
    with pytest.raises(ToolArgumentError) as info:
        calc.validate({**VALID, "n": "z" * 1000})
    assert len(str(info.value)) < 120
    assert "..." in str(info.value)


@pytest.mark.parametrize("arguments", [[1, 2], "n=2", None, 3])
def test_validate_rejects_non_dict(arguments):
    with pytest.raises(
        ToolArgumentError, match="must be a JSON object, got " + type(arguments).__name__
    ):
        calc.validate(arguments)


def test_validate_optional_accepts_none_and_value():
    assert search.parameters["properties"]["page"]["nullable"] is True
    base = {"query": "q", "limit": 1, "scale": 1, "exact": True, "ids": [], "mode": "fast"}
    assert search.validate({**base, "note": None})["note"] is None
    assert search.validate({**base, "note": "n", "page": 3})["page"] == 3
    with pytest.raises(ToolArgumentError, match="argument 'page' must be integer"):
        search.validate({**base, "note": None, "page": "3"})
    with pytest.raises(ToolArgumentError, match="argument 'limit' must be integer, got NoneType"):
        search.validate({**base, "note": None, "limit": None})


def test_validate_list_type():
    base = {"query": "q", "limit": 1, "scale": 1, "exact": True, "mode": "fast", "note": None}
    assert search.validate({**base, "ids": [1, 2]})["ids"] == [1, 2]
    with pytest.raises(ToolArgumentError, match="argument 'ids' must be array, got str"):
        search.validate({**base, "ids": "1,2"})


def test_validate_checks_list_items():
    base = {"query": "q", "limit": 1, "scale": 1, "exact": True, "mode": "fast", "note": None}
    with pytest.raises(ToolArgumentError, match="ids"):
        search.validate({**base, "ids": ["a"]})


def test_validate_huge_int_for_float_is_argument_error():
    with pytest.raises(ToolArgumentError, match="'x'"):
        calc.validate({**VALID, "x": 10**400})
