"""Family ``data``: compute an answer from a generated data file, into an answer file.

* easy -- ``sales.csv``: a filtered sum or count, written as one number to ``answer.txt``;
* hard -- ``orders.json`` (nested orders with line items): an aggregate over a filtered
  subset, written as a small JSON report (``report.json``).

The answer is read back from the file, never from the agent's final message.
"""

from __future__ import annotations

import csv
import io
import json
import random
from collections import defaultdict
from typing import Any

from envs.workspace.families._common import NAMES, WORDS, call, parse_json, parse_number
from envs.workspace.families.base import TaskSpec, ToolCallSpec
from envs.workspace.workspace import Workspace

REGIONS = ("north", "south", "east", "west", "central", "coast", "valley", "highlands")
STATUSES = ("shipped", "pending", "cancelled")


def _sales(rng: random.Random) -> list[dict[str, Any]]:
    regions = rng.sample(REGIONS, 4)
    products = rng.sample(WORDS, 5)
    rows = []
    for _ in range(rng.randint(15, 30)):
        rows.append(
            {
                "date": f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}",
                "region": rng.choice(regions),
                "product": rng.choice(products),
                "units": rng.randint(1, 20),
                "unit_price": round(rng.uniform(1, 99), 2),
            }
        )
    return rows


def _easy_question(rng: random.Random, rows: list[dict[str, Any]]) -> tuple[str, float, int, str]:
    """(question, answer, decimals, expression): ``expression`` computes the answer in Python
    from ``rows = list(csv.DictReader(open('sales.csv')))``, for the demonstration."""
    row = rng.choice(rows)
    kind = rng.choice(("revenue", "units", "count"))
    if kind == "revenue":
        region = row["region"]
        value = sum(r["units"] * r["unit_price"] for r in rows if r["region"] == region)
        return (
            f"What is the total revenue (units × unit_price, summed over rows) in the region "
            f"`{region}`? Write it rounded to 2 decimal places.",
            round(value, 2),
            2,
            f"sum(int(r['units']) * float(r['unit_price']) for r in rows "
            f"if r['region'] == {region!r})",
        )
    if kind == "units":
        product = row["product"]
        value = sum(r["units"] for r in rows if r["product"] == product)
        return (
            f"How many units of `{product}` were sold in total?",
            value,
            0,
            f"sum(int(r['units']) for r in rows if r['product'] == {product!r})",
        )
    threshold = rng.randint(5, 15)
    region = row["region"]
    value = sum(1 for r in rows if r["region"] == region and r["units"] >= threshold)
    return (
        f"How many rows (sales) in the region `{region}` have at least {threshold} units?",
        value,
        0,
        f"sum(1 for r in rows if r['region'] == {region!r} and int(r['units']) >= {threshold})",
    )


def _orders(rng: random.Random) -> tuple[list[dict[str, Any]], dict[str, float]]:
    customers = rng.sample(NAMES, 5)
    prices = {
        f"{w[:3].upper()}-{rng.randint(100, 999)}": round(rng.uniform(2, 80), 2)
        for w in rng.sample(WORDS, 6)
    }
    orders = []
    for i in range(rng.randint(15, 30)):
        items = [
            {"sku": sku, "qty": rng.randint(1, 5), "price": prices[sku]}
            for sku in rng.sample(sorted(prices), rng.randint(1, 3))
        ]
        orders.append(
            {
                "id": f"ORD-{1000 + i}",
                "customer": rng.choice(customers),
                "status": rng.choices(STATUSES, weights=(6, 2, 2))[0],
                "items": items,
            }
        )
    return orders, prices  # fmt: skip


def _hard_answer(orders: list[dict[str, Any]], kind: str) -> dict[str, Any] | None:
    """The expected report, or ``None`` when the top two tie (the draw is then retried)."""
    totals: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for order in orders:
        if kind == "customer" and order["status"] == "shipped":
            totals[order["customer"]] += sum(i["qty"] * i["price"] for i in order["items"])
            counts[order["customer"]] += 1
        elif kind == "sku" and order["status"] != "cancelled":
            for item in order["items"]:
                totals[item["sku"]] += item["qty"]
                counts[item["sku"]] += 1
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])
    if len(ranked) < 2 or abs(ranked[0][1] - ranked[1][1]) < 0.01:
        return None
    key, total = ranked[0]
    if kind == "customer":
        return {"customer": key, "total": round(total, 2), "orders": counts[key]}
    return {"sku": key, "units": int(total), "orders": counts[key]}


_HARD_QUESTIONS = {
    "customer": (
        'Among the orders with status "shipped", find the customer who spent the most '
        "(sum of qty × price over all items of their shipped orders). Write `report.json` "
        'as a JSON object {"customer": <name>, "total": <amount rounded to 2 decimals>, '
        '"orders": <number of their shipped orders>}.'
    ),
    "sku": (
        'Ignoring orders with status "cancelled", find the SKU with the most units ordered '
        "(sum of qty). Write `report.json` as a JSON object "
        '{"sku": <sku>, "units": <total units>, "orders": <number of orders containing it>}.'
    ),
}


class DataFamily:
    """Answer a question about a CSV (easy) or nested JSON (hard) file, into a file."""

    name = "data"

    def generate(self, rng: random.Random, level: str) -> TaskSpec:
        if level == "easy":
            rows = _sales(rng)
            question, answer, decimals, expression = _easy_question(rng, rows)
            buf = io.StringIO()
            writer = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
            writer.writeheader()
            writer.writerows(rows)
            prompt = (
                f"The file `sales.csv` lists sales. {question} Write only the number to "
                "`answer.txt`."
            )
            params = {
                "rows": rows,
                "answer": answer,
                "decimals": decimals,
                "question": question,
                "expression": expression,
            }
            return TaskSpec(prompt, {"sales.csv": buf.getvalue()}, params)
        while True:
            orders, _ = _orders(rng)
            kind = rng.choice(sorted(_HARD_QUESTIONS))
            report = _hard_answer(orders, kind)
            if report is not None:
                break
        prompt = f"The file `data/orders.json` holds a list of orders. {_HARD_QUESTIONS[kind]}"
        files = {"data/orders.json": json.dumps(orders, indent=1) + "\n"}
        return TaskSpec(prompt, files, {"kind": kind, "report": report})

    def check(self, params: dict[str, Any], ws: Workspace) -> list[tuple[str, bool]]:
        if "rows" in params:
            text = ws.text("answer.txt")
            value = parse_number(text)
            tolerance = 0.011 if params["decimals"] else 1e-9
            return [
                ("`answer.txt` exists", text is not None),
                ("`answer.txt` holds a single number", value is not None),
                (
                    "the number is correct",
                    value is not None and abs(value - params["answer"]) <= tolerance,
                ),
            ]
        want = params["report"]
        got = parse_json(ws.text("report.json"))
        checks = [("`report.json` is a JSON object", isinstance(got, dict))]
        got = got if isinstance(got, dict) else {}
        for key, value in want.items():
            ok = key in got and not isinstance(got[key], bool)
            if ok and isinstance(value, float):
                ok = isinstance(got[key], int | float) and abs(got[key] - value) <= 0.011
            elif ok:
                ok = got[key] == value
            checks.append((f'"{key}" is correct', ok))
        return checks

    def solve(self, params: dict[str, Any], files: dict[str, str]) -> list[ToolCallSpec]:
        if "rows" in params:
            # Computed from the file by code, never the stored answer: a demonstration that
            # wrote the number down would teach a model to make one up.
            text = "f'{value:.2f}'" if params["decimals"] else "str(value)"
            code = (
                "import csv\n"
                "rows = list(csv.DictReader(open('sales.csv')))\n"
                f"value = {params['expression']}\n"
                f"open('answer.txt', 'w').write({text})\n"
                "print(value)\n"
            )
            return [call("run_python", code=code)]
        code = (
            "import json\n"
            "orders = json.load(open('data/orders.json'))\n"
            f"kind = {params['kind']!r}\n"
            "totals, counts = {}, {}\n"
            "for o in orders:\n"
            "    if kind == 'customer' and o['status'] == 'shipped':\n"
            "        key = o['customer']\n"
            "        spent = sum(i['qty'] * i['price'] for i in o['items'])\n"
            "        totals[key] = totals.get(key, 0) + spent\n"
            "        counts[key] = counts.get(key, 0) + 1\n"
            "    elif kind == 'sku' and o['status'] != 'cancelled':\n"
            "        for i in o['items']:\n"
            "            totals[i['sku']] = totals.get(i['sku'], 0) + i['qty']\n"
            "            counts[i['sku']] = counts.get(i['sku'], 0) + 1\n"
            "best = max(totals, key=totals.get)\n"
            "if kind == 'customer':\n"
            "    total = round(totals[best], 2)\n"
            "    report = {'customer': best, 'total': total, 'orders': counts[best]}\n"
            "else:\n"
            "    report = {'sku': best, 'units': totals[best], 'orders': counts[best]}\n"
            "json.dump(report, open('report.json', 'w'))\n"
            "print(report)\n"
        )  # fmt: skip
        return [call("list_files", path="."), call("run_python", code=code)]
