r"""A conversation with stateful tools: a shopper who edits a cart over two requests.

    python examples/conversation_env.py

The user asks for some items and their total; after the answer, the user comes back with
a change ("remove one pear") and asks again. The cart is a plain class whose public
methods are the tools (``agentenv.toolset``), one fresh cart per episode
(``episode_tools``); a ``ConversationEnv`` scores each answer (the cart's state and the
number) and sends the follow-up. Train on it like any env::

    E=examples/conversation_env.py:Shop-v0
    agentenv sft $E --num-demos 64 --output-dir runs/shop-sft
    agentenv train $E --init-from runs/shop-sft/checkpoint --max-turns 8 --credit turn
"""

from __future__ import annotations

import itertools
import json
import random
from typing import Any

import agentenv
from agentenv import ConversationEnv, Task, toolset

PRICES = {"apple": 2, "pear": 3, "melon": 7, "plum": 1}


class Cart:
    """A shopping cart: its public methods are the agent's tools."""

    def __init__(self) -> None:
        self.items: dict[str, int] = {}

    def add_item(self, item: str, quantity: int) -> str:
        """Put items in the cart.

        Args:
            item: The product: apple, pear, melon or plum.
            quantity: How many to add.
        """
        if item not in PRICES:
            raise ValueError(f"we sell no {item!r}; we sell {', '.join(PRICES)}")
        self.items[item] = self.items.get(item, 0) + quantity
        return f"{self.items[item]} x {item} in the cart"

    def remove_item(self, item: str, quantity: int) -> str:
        """Take items out of the cart.

        Args:
            item: The product.
            quantity: How many to take out.
        """
        left = self.items.get(item, 0) - quantity
        if left < 0:
            raise ValueError(f"the cart holds {self.items.get(item, 0)} x {item}")
        self.items[item] = left
        return f"{left} x {item} in the cart"

    def total(self) -> int:
        """The price of everything in the cart, in dollars."""
        return sum(PRICES[item] * n for item, n in self.items.items())


def call(name: str, **arguments: Any) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


class ShopEnv(ConversationEnv):
    """Two user turns per task: buy two kinds of items, then take one item out."""

    def __init__(self, split: str = "train", **kwargs: Any):
        kwargs.setdefault("max_turns", 8)
        super().__init__(split=split, **kwargs)
        pairs = list(itertools.permutations(PRICES, 2))
        tasks = [(a, b, n, m) for a, b in pairs for n in (1, 2, 3) for m in (2, 3)]
        random.Random(0).shuffle(tasks)
        self._tasks = (
            tasks[: len(tasks) * 3 // 4] if split == "train" else tasks[len(tasks) * 3 // 4 :]
        )

    @property
    def num_tasks(self) -> int:
        return len(self._tasks)

    def get_task(self, index: int) -> Task:
        a, b, n, m = self._tasks[index]
        first = {a: n, b: m}
        second = {a: n, b: m - 1}
        totals = [sum(PRICES[i] * q for i, q in cart.items()) for cart in (first, second)]
        return Task(
            id=f"shop-{self.split}-{index}",
            prompt=f"Please add {n} {a} and {m} {b} to my cart. What is the total?",
            answer=totals,
            metadata={
                "user_turns": [f"Actually, take one {b} out. What is the total now?"],
                "carts": [first, second],
            },
        )

    def instructions(self) -> str:
        return "You are a shop assistant. Use the cart's tools, then answer with the total."

    def episode_tools(self, task: Task) -> list[agentenv.Tool]:
        self.cart = Cart()  # this episode's own cart: the tools act on it
        return toolset(self.cart)

    def score_turn(self, answer: str, task: Task, turn: int) -> tuple[float, dict[str, Any]]:
        state_ok = {k: v for k, v in self.cart.items.items() if v} == task.metadata["carts"][turn]
        number_ok = answer.strip() == str(task.answer[turn])
        return float(state_ok and number_ok), {"correct": state_ok and number_ok}

    def demonstration(self, task: Task) -> list[str]:
        (a, n), (b, m) = task.metadata["carts"][0].items()
        return [
            call("add_item", item=a, quantity=n) + call("add_item", item=b, quantity=m),
            call("total"),
            f"<answer>{task.answer[0]}</answer>",
            call("remove_item", item=b, quantity=1) + call("total"),
            f"<answer>{task.answer[1]}</answer>",
        ]


agentenv.register("Shop-v0", entry_point=ShopEnv, override=True)


if __name__ == "__main__":
    env = agentenv.make("Shop-v0", render_mode="ansi")
    env.reset(seed=0)
    for action in env.unwrapped.demonstration(env.unwrapped.task):
        obs, reward, terminated, truncated, info = env.step(action)
        if "answered_turn" in info:
            print(f"user turn {info['answered_turn']} answered: reward {info['turn_reward']}")
    print(env.render())
    print(f"reward {reward}, correct {info['correct']}, {info['turns_correct']} of 2 turns")
