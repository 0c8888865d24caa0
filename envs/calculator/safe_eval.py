"""A safe arithmetic evaluator: the ``calculator`` tool of the Calculator env.

The expression is parsed with :func:`ast.parse` and the tree is walked by hand; nothing is
ever passed to ``eval``/``exec``. Only numbers, ``+ - * / // % **``, unary ``+``/``-``,
parentheses and the functions ``abs``, ``round``, ``min``, ``max`` and ``sqrt`` are allowed.
Every operation is guarded so that hostile input (``9**9**9**9``, huge strings, deep nesting)
is refused in milliseconds with a short :class:`~envs.calculator.errors.CalculatorError`.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable

from envs.calculator.errors import CalculatorError

_ALLOWED = "only numbers, + - * / // % ** and abs, round, min, max, sqrt"
_MAX_EXPONENT = 1_000_000  # |b| above this in a ** b is refused outright

_BINOPS: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_OP_SYMBOLS: dict[type[ast.AST], str] = {
    ast.BitXor: "^",
    ast.BitAnd: "&",
    ast.BitOr: "|",
    ast.LShift: "<<",
    ast.RShift: ">>",
    ast.MatMult: "@",
    ast.Invert: "~",
    ast.Not: "not",
}
_REFUSED: dict[type[ast.AST], str] = {
    ast.Attribute: "attribute access",
    ast.Lambda: "lambda",
    ast.List: "lists",
    ast.Tuple: "tuples",
    ast.Dict: "dicts",
    ast.Set: "sets",
    ast.Subscript: "indexing",
    ast.IfExp: "conditional expressions (if/else)",
    ast.Compare: "comparisons",
    ast.BoolOp: "'and'/'or'",
    **dict.fromkeys((ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp), "comprehensions"),
    ast.NamedExpr: "assignment (:=)",
    ast.JoinedStr: "f-strings",
    ast.Starred: "starred arguments",
}
_CONSTANT_KINDS: dict[type, str] = {
    bool: "booleans (True/False) are",
    str: "strings are",
    bytes: "bytes are",
    complex: "complex numbers are",
    type(None): "None is",
}


def _sqrt(x: float) -> float:
    if x < 0:
        raise CalculatorError(f"sqrt of a negative number ({format_number(x)}) is not real")
    return math.sqrt(x)


def _round(x: float, ndigits: float | None = None) -> float:
    if ndigits is None:
        return round(x)
    if not isinstance(ndigits, int):
        raise CalculatorError("round() needs a whole number of digits, e.g. round(x, 2)")
    if isinstance(x, int) and ndigits < -(x.bit_length() * 0.30103 + 1):
        return 0  # Python would compute 10 ** -ndigits first, which can take forever
    return round(x, ndigits)


# name -> (function, min args, max args or None for no limit)
_FUNCTIONS: dict[str, tuple[Callable[..., float], int, int | None]] = {
    "abs": (abs, 1, 1),
    "round": (_round, 1, 2),
    "min": (lambda *args: min(args), 1, None),
    "max": (lambda *args: max(args), 1, None),
    "sqrt": (_sqrt, 1, 1),
}


def _refusal(node: ast.AST) -> CalculatorError:
    """Builds the error for a construct that is never allowed."""
    what = _REFUSED.get(type(node), type(node).__name__)
    verb = "is" if what in ("attribute access", "lambda", "indexing") else "are"
    return CalculatorError(f"{what} {verb} not allowed; {_ALLOWED}")


class _Evaluator:
    """Walks a parsed expression tree and computes its value with size guards."""

    def __init__(self, max_digits: int) -> None:
        self.max_digits = max_digits

    def check(self, value: float) -> float:
        """Refuses non-finite floats and ints with more than ``max_digits`` digits."""
        if isinstance(value, float) and not math.isfinite(value):
            raise CalculatorError("result is not a finite number (too large or undefined)")
        if isinstance(value, int) and value.bit_length() * 0.30103 > self.max_digits:
            raise CalculatorError(f"result too large: exceeds {self.max_digits} digits")
        return value

    def visit(self, node: ast.AST) -> float:
        """Returns the value of ``node`` or raises :class:`CalculatorError`."""
        if isinstance(node, ast.Expression):
            return self.visit(node.body)
        if isinstance(node, ast.Constant):
            if type(node.value) not in (int, float):
                kind = _CONSTANT_KINDS.get(type(node.value), f"{node.value!r} is")
                raise CalculatorError(f"{kind} not allowed; {_ALLOWED}")
            return self.check(node.value)
        if isinstance(node, ast.BinOp):
            return self.binop(node)
        if isinstance(node, ast.UnaryOp):
            if isinstance(node.op, (ast.UAdd, ast.USub)):
                value = self.visit(node.operand)
                return -value if isinstance(node.op, ast.USub) else +value
            raise CalculatorError(f"operator '{_OP_SYMBOLS[type(node.op)]}' is not allowed")
        if isinstance(node, ast.Call):
            return self.call(node)
        if isinstance(node, ast.Name):
            if node.id in _FUNCTIONS:
                raise CalculatorError(f"{node.id} must be called, e.g. {node.id}(2)")
            raise CalculatorError(f"name '{node.id}' is not allowed; {_ALLOWED}")
        raise _refusal(node)

    def binop(self, node: ast.BinOp) -> float:
        """Applies a binary operator, estimating the size of powers before computing them."""
        func = _BINOPS.get(type(node.op))
        if func is None:
            symbol = _OP_SYMBOLS.get(type(node.op), type(node.op).__name__)
            hint = "; use ** for powers" if symbol == "^" else ""
            raise CalculatorError(f"operator '{symbol}' is not allowed{hint}")
        left, right = self.visit(node.left), self.visit(node.right)
        if isinstance(node.op, ast.Pow):
            self.check_power(left, right)
        try:
            return self.check(func(left, right))
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("result too large for a floating-point number") from None

    def check_power(self, base: float, exponent: float) -> None:
        """Refuses ``base ** exponent`` when the result would be huge or complex."""
        if base < 0 and isinstance(exponent, float) and not exponent.is_integer():
            raise CalculatorError("a negative number to a fractional power is not real (complex)")
        if abs(base) not in (0, 1):
            try:
                digits = exponent * math.log10(abs(base))
            except OverflowError:
                digits = math.inf
            if digits > self.max_digits:
                about = f"about {digits:.4g} digits, " if math.isfinite(digits) else ""
                raise CalculatorError(f"result too large: {about}exceeds {self.max_digits} digits")
        if abs(exponent) > _MAX_EXPONENT:
            raise CalculatorError(f"exponent too large: limit is {_MAX_EXPONENT:,}")

    def call(self, node: ast.Call) -> float:
        """Calls one of the allowed functions after checking its name and arguments."""
        if not isinstance(node.func, ast.Name):
            if type(node.func) in _REFUSED:
                raise _refusal(node.func)
            raise CalculatorError("only calls to abs, round, min, max, sqrt are allowed")
        name = node.func.id
        if name not in _FUNCTIONS:
            raise CalculatorError(
                f"calls to '{name}' are not allowed; only abs, round, min, max, sqrt"
            )
        if node.keywords:
            raise CalculatorError(f"keyword arguments are not allowed in {name}()")
        if any(isinstance(arg, ast.Starred) for arg in node.args):
            raise CalculatorError(f"starred arguments are not allowed in {name}()")
        func, low, high = _FUNCTIONS[name]
        n = len(node.args)
        if n < low or (high is not None and n > high):
            expected = {1: "1 argument", 2: "1 or 2 arguments"}.get(high, "at least 1 argument")
            raise CalculatorError(f"{name}() takes {expected}, got {n}")
        args = [self.visit(arg) for arg in node.args]
        try:
            return self.check(func(*args))
        except OverflowError:
            raise CalculatorError(f"result of {name}() is too large") from None


def evaluate(expression: str, *, max_length: int = 500, max_digits: int = 1000) -> int | float:
    """Safely evaluates an arithmetic expression.

    Args:
        expression: The expression, e.g. ``"(3 + 4) * 2 ** 10"``. ``×`` and ``÷`` are accepted
            as ``*`` and ``/``; surrounding whitespace is ignored.
        max_length: Longest accepted expression, in characters (checked before parsing).
        max_digits: Largest accepted integer result (and intermediate result), in decimal digits.

    Returns:
        The value: an ``int`` when every step stays integral, otherwise a ``float``.

    Raises:
        CalculatorError: The expression is too long, empty, malformed, uses anything beyond
            numbers, ``+ - * / // % **`` and ``abs, round, min, max, sqrt``, divides by zero,
            or its result is too large or not finite.
    """
    if not isinstance(expression, str):
        raise CalculatorError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > max_length:
        raise CalculatorError(
            f"expression is too long: {len(expression)} characters (limit {max_length})"
        )
    text = expression.strip().replace("×", "*").replace("÷", "/")
    if not text:
        raise CalculatorError("expression is empty; write e.g. 2 + 3 * 4")
    if "^" in text:
        raise CalculatorError("'^' is not supported; use ** for powers, e.g. 2**3")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError) as exc:
        reason = str(getattr(exc, "msg", None) or exc).split(";")[0][:100]
        raise CalculatorError(f"invalid expression: {reason}") from None
    except (RecursionError, MemoryError):
        raise CalculatorError("invalid expression: too deeply nested") from None
    try:
        return _Evaluator(max_digits).visit(tree)
    except RecursionError:
        raise CalculatorError("invalid expression: too deeply nested") from None


def format_number(value: int | float) -> str:
    """Formats a result the way the calculator tool prints it.

    Args:
        value: An ``int`` or ``float`` result of :func:`evaluate`.

    Returns:
        Ints in full (``"100000000000000000000"``); floats with up to 12 significant digits and
        no trailing zeros (``0.1 + 0.2`` -> ``"0.3"``, ``6.0`` -> ``"6"``, ``1e20`` -> ``"1e+20"``).
    """
    if isinstance(value, int):
        return str(value)
    text = f"{value:.12g}"
    return "0" if text == "-0" else text
