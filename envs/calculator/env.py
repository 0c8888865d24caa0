"""The Calculator environment: math word problems solved with a safe ``calculator`` tool."""

from __future__ import annotations

import json
import math
import re
from typing import Any, SupportsFloat

from agentenv.env.core import Task, ToolEnv
from agentenv.env.parsers import ActionParser
from agentenv.env.spaces import Message
from agentenv.env.tools import Tool, tool
from envs.calculator import prices
from envs.calculator.safe_eval import evaluate, format_number
from envs.calculator.tasks import load_tasks

COMPACT_PROMPT = (
    "Solve the problem with the calculator tool. Call it like this:\n"
    '<tool_call>{"name": "calculator", "arguments": {"expression": "2 * (3 + 4)"}}</tool_call>\n'
    "When you have the result, reply with <answer>the number</answer>."
)
"""A ~50-token system prompt for small models and CPU training (``prompt_style="compact"``)."""

PRICES_COMPACT_PROMPT = (
    "Look up each item's price, one item per call, then add up with the calculator:\n"
    '<tool_call>{"name": "price", "arguments": {"item": "lamp"}}</tool_call>\n'
    '<tool_call>{"name": "calculator", "arguments": {"expression": "2 * 15 + 3 * 7"}}'
    "</tool_call>\n"
    "When you have the total, reply with <answer>the number</answer>."
)
"""The compact prompt of ``source="prices"`` (it shows both tools)."""

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return the result.

    Args:
        expression: Numbers with + - * / // % ** and parentheses, and the functions
            abs, round, min, max, sqrt. Example: "(12 + 30) * 3 / 4".
    """
    return format_number(evaluate(expression))


def parse_number(text: str) -> float | None:
    """The number a final answer states, or ``None``.

    Accepts ``"72"``, ``"1,234.5"``, ``"$18"``, ``"50%"``, ``"3/4"`` and, failing those,
    takes the last number in the text (``"The answer is 72 apples"`` -> 72).
    """
    cleaned = text.strip().replace(",", "").replace("$", "").rstrip("%").strip()
    try:
        return float(cleaned)
    except ValueError:
        pass
    frac = re.fullmatch(r"(-?\d+)\s*/\s*(\d+)", cleaned)
    # as floats: int() refuses over 4300 digits and int / int overflows past ~1e308
    if frac and float(frac.group(2)) != 0:
        return float(frac.group(1)) / float(frac.group(2))
    numbers = _NUMBER.findall(cleaned)
    return float(numbers[-1]) if numbers else None


class CalculatorEnv(ToolEnv):
    """Math word problems with a ``calculator`` tool (id ``agentenv/Calculator-v0``).

    Reward: 1.0 when the number in the final ``<answer>`` equals the gold answer
    within ``tolerance`` (relative, and absolute near zero), else 0.0. With
    ``format_bonus > 0``, an answer that states a number gets that bonus on top,
    right or wrong (a shaping term to teach the format; off by default).
    ``max_turns`` actions without an answer end the episode ``truncated`` with 0.

    ``info`` carries ``correct``, ``num_tool_calls``, ``num_tool_errors``,
    ``tool_errors`` (count per error kind), ``turn``, ``task_id``, ``task`` and,
    at the end, ``answer``, ``gold`` and ``parsed_answer``.

    ``source="prices"`` (shopping problems, :mod:`envs.calculator.prices`) adds a
    ``price(item)`` tool that knows the task's shop's prices: two lookups, then the
    calculator. Its steps also report ``prices_found`` (per item asked, in the
    question's order: looked up yet) and ``turn_reward``, the share of the asked items'
    prices first looked up by this step (a per-turn reward for ``credit="turn"`` /
    ``"gae"``; not part of the episode's reward).

    Args:
        split: ``"train"`` or ``"test"`` (disjoint).
        source: ``"gsm_symbolic"`` (default), ``"basic_arithmetic"``,
            ``"word_problems"``, ``"prices"`` or ``"gsm8k"``; see
            :mod:`envs.calculator.tasks`.
        num_tasks: Tasks in the split (default 2000 train / 500 test).
        path: Local GSM8K JSONL/Parquet file for ``source="gsm8k"``.
        source_config: Extra reasoning-gym config, e.g. ``{"max_terms": 4}``.
        data_seed: Seed of the task generator.
        max_turns: Actions per episode before ``truncated``.
        tolerance: Relative tolerance of the numeric comparison.
        format_bonus: Reward added for any numeric final answer (default 0).
        parser: Action parser (default Hermes ``<tool_call>`` / ``<answer>``).
        tool_timeout_s: Wall-clock limit per calculator call.
        max_output_chars: Longest tool output shown.
        prompt_style: ``"full"`` (instructions plus the tool's JSON schema) or
            ``"compact"`` (:data:`COMPACT_PROMPT`, a short example-based prompt).
        render_mode: ``None`` or ``"ansi"``.
    """

    def __init__(
        self,
        *,
        split: str = "train",
        source: str = "gsm_symbolic",
        num_tasks: int | None = None,
        path: str | None = None,
        source_config: dict[str, Any] | None = None,
        data_seed: int = 0,
        max_turns: int = 5,
        tolerance: float = 1e-4,
        format_bonus: float = 0.0,
        parser: ActionParser | None = None,
        tool_timeout_s: float = 2.0,
        max_output_chars: int = 500,
        prompt_style: str = "full",
        render_mode: str | None = None,
    ):
        self._looked_up: set[str] = set()  # this episode's items with a price returned
        tools = [calculator, self._make_price_tool()] if source == "prices" else [calculator]
        super().__init__(
            tools,
            split=split,
            parser=parser,
            max_turns=max_turns,
            tool_timeout_s=tool_timeout_s,
            max_output_chars=max_output_chars,
            prompt_style=prompt_style,
            render_mode=render_mode,
        )
        self.source = source
        self.tolerance = float(tolerance)
        self.format_bonus = float(format_bonus)
        self._tasks = load_tasks(
            source, split, num_tasks=num_tasks, path=path, config=source_config, seed=data_seed
        )

    @property
    def num_tasks(self) -> int:
        return len(self._tasks)

    def get_task(self, index: int) -> Task:
        return self._tasks[index]

    def _make_price_tool(self) -> Tool:
        def price(item: str) -> str:
            """Look up the price of one item at this task's shop.

            Args:
                item: The item's singular name, e.g. "lantern".
            """
            assert self.task is not None
            table = self.task.metadata["prices"]
            result = prices.lookup(table, item)
            if result.split(":", 1)[0] in table:
                self._looked_up.add(result.split(":", 1)[0])
            return result

        return tool(price, name="price")

    def on_reset(self, task: Task) -> None:
        self._looked_up = set()

    def step(self, action: str) -> tuple[list[Message], SupportsFloat, bool, bool, dict[str, Any]]:
        before = set(self._looked_up)
        obs, reward, terminated, truncated, info = super().step(action)
        if self.source == "prices":
            assert self.task is not None
            asked = list(self.task.metadata["quantities"])
            new = [item for item in asked if item in self._looked_up and item not in before]
            info["prices_found"] = [item in self._looked_up for item in asked]
            info["turn_reward"] = len(new) / len(asked)
        return obs, reward, terminated, truncated, info

    def instructions(self) -> str:
        if self.source == "prices":
            return (
                "You solve shopping problems. Look up the price of each item with the price "
                "tool (one item per call, by its singular name), compute the total with the "
                "calculator, then give only the final number in <answer></answer> tags."
            )
        return (
            "You solve math problems. Use the calculator tool for every arithmetic step, "
            "then give only the final number in <answer></answer> tags."
        )

    def compact_prompt(self) -> str:
        return PRICES_COMPACT_PROMPT if self.source == "prices" else COMPACT_PROMPT

    def demonstration(self, task: Task) -> list[str] | None:
        """One calculator call with the task's expression, then the answer; for
        ``source="prices"``, the two lookups first (a third, by the plural, that misses
        on about a third of the tasks: :func:`envs.calculator.prices.demonstration`).

        Available for sources whose tasks carry an expression (``word_problems``,
        ``basic_arithmetic``, ``prices``); ``None`` otherwise.
        """
        if "quantities" in task.metadata:
            return prices.demonstration(
                task.id, task.metadata["quantities"], task.metadata["prices"]
            )
        expression = task.metadata.get("expression")
        if not expression:
            return None
        payload = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
        return [
            f"<tool_call>{payload}</tool_call>",
            f"<answer>{format_number(evaluate(expression))}</answer>",
        ]

    def score(self, answer: str, task: Task) -> tuple[float, dict[str, Any]]:
        value = parse_number(answer)
        gold = float(task.answer)
        correct = value is not None and math.isclose(
            value, gold, rel_tol=self.tolerance, abs_tol=self.tolerance
        )
        reward = float(correct) + (self.format_bonus if value is not None else 0.0)
        return reward, {"correct": correct, "gold": task.answer, "parsed_answer": value}
