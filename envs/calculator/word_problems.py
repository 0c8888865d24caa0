"""A small offline generator of two-step arithmetic word problems.

Each problem needs two operations on 2-3 digit numbers (e.g. ``a * b - c``), so a
small model cannot do it in its head but can with the calculator, once it learns to
turn the story into one expression. Every problem carries that expression, so the
env can produce an expert demonstration for supervised warm starts.

Problems are a pure function of ``(seed, index)``: the same call always gives the
same list, and growing ``size`` only appends.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

_NAMES = (
    "Ava",
    "Ben",
    "Chloe",
    "Dev",
    "Emma",
    "Finn",
    "Grace",
    "Hugo",
    "Iris",
    "Jack",
    "Kira",
    "Liam",
    "Maya",
    "Noah",
    "Omar",
    "Priya",
    "Quinn",
    "Rosa",
    "Sam",
    "Tara",
)


@dataclass(frozen=True)
class WordProblem:
    """One generated problem: question text, the expression that solves it, the answer."""

    question: str
    expression: str
    answer: int


def _shop(r: random.Random, name: str) -> WordProblem:
    a, b, c = r.randint(12, 99), r.randint(12, 60), r.randint(10, 400)
    c = min(c, a * b - 1)
    return WordProblem(
        f"A shop has {a} boxes with {b} pencils in each box. It sells {c} "
        "pencils. How many pencils are left?",
        f"{a} * {b} - {c}",
        a * b - c,
    )


def _savings(r: random.Random, name: str) -> WordProblem:
    a, b, c = r.randint(15, 95), r.randint(11, 52), r.randint(100, 900)
    return WordProblem(
        f"{name} saves {a} dollars every week for {b} weeks and already had "
        f"{c} dollars. How many dollars does {name} have now?",
        f"{a} * {b} + {c}",
        a * b + c,
    )


def _trip(r: random.Random, name: str) -> WordProblem:
    a, b, c = r.randint(45, 120), r.randint(3, 14), r.randint(20, 300)
    return WordProblem(
        f"A train travels {a} km each hour for {b} hours, then {c} km more. "
        "How many km does it travel in total?",
        f"{a} * {b} + {c}",
        a * b + c,
    )


def _share(r: random.Random, name: str) -> WordProblem:
    b, q, c = r.randint(3, 12), r.randint(12, 95), r.randint(2, 9)
    a = b * q
    return WordProblem(
        f"{a} stickers are shared equally among {b} children. Each child then "
        f"gets {c} more stickers. How many stickers does each child have?",
        f"{a} / {b} + {c}",
        q + c,
    )


def _tickets(r: random.Random, name: str) -> WordProblem:
    a, b, c, d = r.randint(12, 80), r.randint(11, 45), r.randint(10, 60), r.randint(8, 30)
    return WordProblem(
        f"{name} buys {a} adult tickets at {b} dollars each and {c} child "
        f"tickets at {d} dollars each. What is the total cost in dollars?",
        f"{a} * {b} + {c} * {d}",
        a * b + c * d,
    )


def _garden(r: random.Random, name: str) -> WordProblem:
    a, b, c = r.randint(11, 70), r.randint(11, 40), r.randint(5, 99)
    return WordProblem(
        f"A garden has {a} rows of {b} tulips. {c} tulips are picked. How many "
        "tulips remain in the garden?",
        f"{a} * {b} - {c}",
        a * b - c,
    )


def _pages(r: random.Random, name: str) -> WordProblem:
    a, b, c = r.randint(120, 900), r.randint(11, 35), r.randint(2, 9)
    c = min(c, a // b)
    return WordProblem(
        f"A book has {a} pages. {name} reads {b} pages a day for {c} days. How "
        "many pages are still unread?",
        f"{a} - {b} * {c}",
        a - b * c,
    )


def _crates(r: random.Random, name: str) -> WordProblem:
    a, b, c = r.randint(100, 999), r.randint(100, 999), r.randint(3, 12)
    return WordProblem(
        f"A farm picks {a} apples in the morning and {b} in the afternoon, and "
        f"packs them into {c} equal crates with the rest left over. How many "
        "apples go into each crate?",
        f"({a} + {b}) // {c}",
        (a + b) // c,
    )


TEMPLATES: tuple[Callable[[random.Random, str], WordProblem], ...] = (
    _shop,
    _savings,
    _trip,
    _share,
    _tickets,
    _garden,
    _pages,
    _crates,
)


def generate(size: int, seed: int = 0) -> list[WordProblem]:
    """``size`` problems; problem ``i`` depends only on ``(seed, i)``."""
    out = []
    for i in range(size):
        r = random.Random(f"word_problems-{seed}-{i}")
        out.append(r.choice(TEMPLATES)(r, r.choice(_NAMES)))
    return out
