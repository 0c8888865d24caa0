"""Register your own tool-use environment and use it like a bundled one.

    python examples/custom_env.py

A ``ToolEnv`` subclass supplies tasks, tools and a scoring function; the tool
loop (parsing, timeouts, errors as observations, turn limit) comes for free.

Every ``agentenv`` command takes the env as ``MODULE:Name-v0`` (gymnasium's convention:
the module, here this file, is imported first, so its ``register`` call runs)::

    agentenv list --import examples/custom_env.py
    agentenv train examples/custom_env.py:Capitals-v0 --steps 10 --eval-tasks 2
"""

from __future__ import annotations

import json
from typing import Any

import gymnasium as gym
from gymnasium.utils.env_checker import check_env

import agentenv
from agentenv import Task, ToolEnv, tool

CAPITALS = {
    "France": "Paris",
    "Japan": "Tokyo",
    "Kenya": "Nairobi",
    "Peru": "Lima",
    "Canada": "Ottawa",
    "Egypt": "Cairo",
    "Norway": "Oslo",
    "Chile": "Santiago",
    "India": "New Delhi",
    "Spain": "Madrid",
}


@tool
def lookup_capital(country: str) -> str:
    """Look up the capital city of a country.

    Args:
        country: The country's English name, e.g. "France".
    """
    if country not in CAPITALS:
        raise ValueError(f"unknown country {country!r}")
    return CAPITALS[country]


class CapitalsEnv(ToolEnv):
    """Name the capital of a country; a ``lookup_capital`` tool is available."""

    def __init__(self, *, split: str = "train", max_turns: int = 3, **kwargs: Any):
        super().__init__([lookup_capital], split=split, max_turns=max_turns, **kwargs)
        countries = sorted(CAPITALS)
        # disjoint splits: every 5th country is a test task
        self._countries = [c for i, c in enumerate(countries) if (i % 5 == 0) == (split == "test")]

    @property
    def num_tasks(self) -> int:
        return len(self._countries)

    def get_task(self, index: int) -> Task:
        country = self._countries[index]
        return Task(
            id=country, prompt=f"What is the capital of {country}?", answer=CAPITALS[country]
        )

    def score(self, answer: str, task: Task) -> tuple[float, dict[str, Any]]:
        correct = answer.strip().lower() == task.answer.lower()
        return float(correct), {"correct": correct}


agentenv.register("Capitals-v0", entry_point=CapitalsEnv, override=True)


def scripted_policy(messages: list[dict[str, str]]) -> str:
    """Look the capital up, then answer with what the tool returned."""
    last = messages[-1]
    if last["role"] == "tool":
        return f"<answer>{last['content']}</answer>"
    country = last["content"].removeprefix("What is the capital of ").rstrip("?")
    call = {"name": "lookup_capital", "arguments": {"country": country}}
    return f"<tool_call>{json.dumps(call)}</tool_call>"


def main() -> float:
    check_env(gym.make("agentenv/Capitals-v0").unwrapped)  # gymnasium's own checker
    env = agentenv.make("Capitals-v0", split="test")
    total = 0.0
    for task_id in range(env.num_tasks):
        result = agentenv.play_episode(env, scripted_policy, options={"task_id": task_id})
        print(
            f"{result.messages[1]['content']:40s} -> {result.messages[-2]['content']}  "
            f"reward={result.reward}"
        )
        total += result.reward
    mean = total / env.num_tasks
    print(f"mean reward on the test split: {mean:.2f}")
    print("train a model on it: agentenv train examples/custom_env.py:Capitals-v0 --steps 10")
    return mean


if __name__ == "__main__":
    main()
