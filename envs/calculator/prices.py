"""Shopping problems whose prices only a lookup tool knows (Calculator-v0 ``source="prices"``).

"Maya buys 3 lanterns and 7 kettles at Hallow & Finch. How much does Maya pay in
total?" Each task's shop has its own invented prices (3 to 99 for each of four items),
never in the question, so no model knows them: the agent looks the items up with
``price(item)`` (one item per call, by its singular name), gives the calculator the
numbers the lookups returned (``3 * 41 + 7 * 18``), then answers. **One call cannot
solve a task**: the calculator needs two prices that only two lookups return, and a
lookup returns one item's price; the question's own numbers are the quantities alone.
A lookup by the plural the question uses misses (the tool then lists the shop's
items), which the re-query demonstrations recover from.

Problems are a pure function of ``(seed, index)``, like :mod:`~envs.calculator.word_problems`.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

from agentenv.env.splits import stable_fraction
from envs.calculator.word_problems import _NAMES

ITEMS = (
    "lantern", "kettle", "notebook", "candle", "blanket", "teapot", "compass", "basket",
    "mirror", "ladder", "bucket", "pillow", "scarf", "hammer", "saddle", "whistle",
    "goblet", "quilt", "chisel", "flask", "ribbon", "satchel", "trowel", "spindle",
)  # fmt: skip
SHOPS = (
    "Brindle's", "Hallow & Finch", "the Marrow Street market", "Quillon's",
    "the Tansy store", "Orrin & Vale", "Pellam's Goods", "the Wicket shop",
)  # fmt: skip
CATALOGUE = 4  # items each shop prices; a problem asks for two of them
REQUERY_FRACTION = 1 / 3
"""About this share of the demonstrations first looks an item up by its plural (a miss)."""


def plural(item: str) -> str:
    """``"lantern"`` -> ``"lanterns"``, ``"compass"`` -> ``"compasses"``."""
    return item + ("es" if item.endswith(("s", "sh", "ch", "x")) else "s")


@dataclass(frozen=True)
class PriceProblem:
    """One problem: the question, the shop's prices, the quantities asked, the expression
    the looked-up prices make and its value."""

    question: str
    prices: dict[str, int]
    quantities: dict[str, int]
    expression: str
    answer: int


def generate(size: int, seed: int = 0) -> list[PriceProblem]:
    """``size`` problems; problem ``i`` depends only on ``(seed, i)``."""
    out = []
    for i in range(size):
        r = random.Random(f"prices-{seed}-{i}")
        name, shop = r.choice(_NAMES), r.choice(SHOPS)
        catalogue = r.sample(ITEMS, CATALOGUE)
        prices = {item: r.randint(3, 99) for item in catalogue}
        asked = catalogue[:2]
        quantities = {item: r.randint(2, 9) for item in asked}
        (a, qa), (b, qb) = quantities.items()
        out.append(
            PriceProblem(
                f"{name} buys {qa} {plural(a)} and {qb} {plural(b)} at {shop}. How much does "
                f"{name} pay in total?",
                dict(sorted(prices.items())),  # the tool's listing shows no order of asking
                quantities,
                f"{qa} * {prices[a]} + {qb} * {prices[b]}",
                qa * prices[a] + qb * prices[b],
            )
        )
    return out


def lookup(prices: dict[str, int], item: str) -> str:
    """The ``price`` tool's answer for ``item`` (case and spaces ignored): ``"lantern:
    41"``, or, for an item the shop does not price, a line naming the ones it does."""
    key = " ".join(str(item).lower().split())
    if key in prices:
        return f"{key}: {prices[key]}"
    return f"no price for {item!r} here; this shop prices: {', '.join(prices)}"


def wants_requery(task_id: str) -> bool:
    """Whether the demonstration of ``task_id`` first looks an item up by its plural."""
    return stable_fraction(f"requery:{task_id}") < REQUERY_FRACTION


def demonstration(task_id: str, quantities: dict[str, int], prices: dict[str, int]) -> list[str]:
    """The expert's actions: look up each item asked for (first by its plural, which
    misses, for :func:`wants_requery` tasks), the calculator on the prices the lookups
    return, the answer."""
    (a, qa), (b, qb) = quantities.items()
    lookups = [_call("price", item=a), _call("price", item=b)]
    if wants_requery(task_id):
        lookups = [_call("price", item=plural(a)), *lookups]
    expression = f"{qa} * {prices[a]} + {qb} * {prices[b]}"
    total = qa * prices[a] + qb * prices[b]
    return [*lookups, _call("calculator", expression=expression), f"<answer>{total}</answer>"]


def _call(name: str, **arguments: str) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"
