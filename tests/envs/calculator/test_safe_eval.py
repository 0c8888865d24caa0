"""Tests for the safe arithmetic evaluator behind the Calculator env's ``calculator`` tool."""

from __future__ import annotations

import time

import pytest

from agentenv.errors import ToolError
from envs.calculator.errors import CalculatorError
from envs.calculator.safe_eval import evaluate, format_number


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("1 + 2 * 3", 7),
        ("(1 + 2) * 3", 9),
        ("2 * (3 + (4 - 1))", 12),
        ("-3 + 5", 2),
        ("-(2 + 3)", -5),
        ("--4", 4),
        ("+7", 7),
        ("-2 ** 2", -4),
        ("2 ** 3 ** 2", 512),
        ("7 / 2", 3.5),
        ("7 // 2", 3),
        ("-7 // 2", -4),
        ("-7 % 3", 2),
        ("7.5 % 2", 1.5),
        ("2 ** 10", 1024),
        ("2 ** -1", 0.5),
        ("(-2) ** 3", -8),
        ("(-8) ** 2.0", 64.0),
        ("0 ** 0", 1),
        ("1.5 * 4", 6.0),
        ("abs(-3)", 3),
        ("abs(-2.5)", 2.5),
        ("round(2.567, 2)", 2.57),
        ("round(2.5)", 2),
        ("round(3.7)", 4),
        ("round(1234, -2)", 1200),
        ("min(3, 1, 2)", 1),
        ("max(3, 1.5, 2)", 3),
        ("max(4)", 4),
        ("sqrt(16)", 4.0),
        ("sqrt(2) ** 2", pytest.approx(2.0)),
        ("3 × 4", 12),
        ("8 ÷ 2", 4.0),
        ("  1 + 1  \n", 2),
        ("1e3 + 1", 1001.0),
        ("10 ** 999 // 10 ** 998", 10),
        ("round(5, -10**30)", 0),
        ("0.5 ** 1e6", 0.0),
    ],
)
def test_evaluate_values(expression: str, expected: float) -> None:
    assert evaluate(expression) == expected


@pytest.mark.parametrize(
    ("expression", "expected_type"),
    [("7 / 2", float), ("6 / 2", float), ("7 // 2", int), ("2 ** 10", int), ("2 ** -1", float)],
)
def test_evaluate_keeps_python_types(expression: str, expected_type: type) -> None:
    assert type(evaluate(expression)) is expected_type


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (6.0, "6"),
        (0.1 + 0.2, "0.3"),
        (1 / 3, "0.333333333333"),
        (10**20, "100000000000000000000"),
        (-2.5, "-2.5"),
        (42, "42"),
        (-0.0, "0"),
        (2.5e-7, "2.5e-07"),
    ],
)
def test_format_number(value: float, text: str) -> None:
    assert format_number(value) == text


def test_format_number_of_evaluated_results() -> None:
    assert format_number(evaluate("3 × 4 ÷ 2")) == "6"
    assert format_number(evaluate("10 ** 20")) == "100000000000000000000"


HOSTILE = [
    ("9**9**9**9", "too large"),
    ("10**10**10", "too large"),
    ('"1"*10**6', "strings are not allowed"),
    ("__import__('os').system('x')", "not allowed"),
    ("__import__('os')", "calls to '__import__' are not allowed"),
    ("(lambda: 1)()", "lambda is not allowed"),
    ("lambda: 1", "lambda is not allowed"),
    ("().__class__", "attribute access is not allowed"),
    ("x", "name 'x' is not allowed"),
    ("a.b", "attribute access is not allowed"),
    ("[1,2]", "not allowed"),
    ("{1:2}", "not allowed"),
    ("1 if 1 else 2", "not allowed"),
    ("1 < 2", "not allowed"),
    ("f(1)", "calls to 'f' are not allowed"),
    ("sqrt", "must be called"),
    ("sqrt(-1)", "negative"),
    ("1/0", "division by zero"),
    ("1%0", "division by zero"),
    ("1//0", "division by zero"),
    ("1.5/0.0", "division by zero"),
    ("0**-1", "division by zero"),
    ("(-8)**0.5", "complex"),
    ("2^3", "**"),
    ("1 & 2", "'&' is not allowed"),
    ("~1", "'~' is not allowed"),
    ("1+" * 50000 + "1", "too long"),
    ("(" * 300 + "1" + ")" * 300, "too long"),
    ("True+1", "not allowed"),
    ("None", "not allowed"),
    ("1j", "complex numbers are not allowed"),
    ("1e308*10", "not a finite number"),
    ("1e999", "not a finite number"),
    ("10**999 * 10**999", "too large"),
    ("10.0**400", "too large"),
    ("max()", "at least 1 argument"),
    ("round(1, 2, 3)", "1 or 2 arguments"),
    ("round(2.5, 1.5)", "whole number"),
    ("sqrt(x=4)", "keyword arguments are not allowed"),
    ("max(*[1, 2])", "not allowed"),
    ("", "empty"),
    ("   ", "empty"),
    ("1 +", "invalid expression"),
]


@pytest.mark.parametrize(
    ("expression", "keyword"), HOSTILE, ids=[expr[:30] or "empty" for expr, _ in HOSTILE]
)
def test_hostile_inputs_are_refused_fast(expression: str, keyword: str) -> None:
    start = time.perf_counter()
    with pytest.raises(CalculatorError) as info:
        evaluate(expression)
    assert time.perf_counter() - start < 0.5
    message = str(info.value)
    assert keyword in message
    assert 0 < len(message) < 200


@pytest.mark.parametrize(
    "expression",
    [
        "(" * 300 + "1" + ")" * 300,
        "1+" * 50000 + "1",
        "-" * 100000 + "1",
        "2**" * 200 + "2",
        "1" * 5000,
    ],
    ids=["nested-parens", "long-sum", "many-minus", "power-tower", "huge-literal"],
)
def test_deep_or_huge_inputs_fail_cleanly_with_a_high_length_limit(expression: str) -> None:
    start = time.perf_counter()
    with pytest.raises(CalculatorError) as info:
        evaluate(expression, max_length=1_000_000)
    assert time.perf_counter() - start < 0.5
    assert len(str(info.value)) < 200


def test_too_long_message_names_the_lengths() -> None:
    with pytest.raises(CalculatorError, match=r"too long: 100001 characters \(limit 500\)"):
        evaluate("1+" * 50000 + "1")


def test_moderate_nesting_still_works() -> None:
    assert evaluate("(" * 100 + "1" + ")" * 100) == 1


def test_name_error_lists_what_is_allowed() -> None:
    with pytest.raises(CalculatorError) as info:
        evaluate("x + 1")
    assert "** and abs, round, min, max, sqrt" in str(info.value)


def test_max_digits_is_respected() -> None:
    assert evaluate("10 ** 20", max_digits=25) == 10**20
    with pytest.raises(CalculatorError, match="too large"):
        evaluate("10 ** 30", max_digits=25)
    with pytest.raises(CalculatorError, match="too large"):
        evaluate("10 ** 20 * 10 ** 20", max_digits=25)


def test_non_string_is_refused() -> None:
    with pytest.raises(CalculatorError, match="must be a string"):
        evaluate(12)  # type: ignore[arg-type]


def test_calculator_error_is_a_tool_error() -> None:
    with pytest.raises(ToolError):
        evaluate("1/0")
    with pytest.raises(ValueError):
        evaluate("1/0")
