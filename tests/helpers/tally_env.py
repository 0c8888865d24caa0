"""A test conversation registered on import: a tally the user adds to over two turns.

``Tally-v0``: each episode owns a fresh :class:`Tally` (its one tool, ``add``); the user
asks to add ``a``, then comes back and asks to add ``b`` more. Each answer is right when
it is the running total and the tally holds it, so the second turn depends on the state
the first left. Short enough for a tiny model to learn one conversation by heart in
seconds (tests/helpers/memorized.py). The env id is ``tally_env:Tally-v0``.
"""

from __future__ import annotations

import json
from typing import Any

import agentenv
from agentenv import ConversationEnv, Task, toolset


class Tally:
    """A running total: its public method is the agent's tool."""

    def __init__(self) -> None:
        self.total = 0

    def add(self, n: int) -> str:
        """Add a number to the tally.

        Args:
            n: The number to add.
        """
        self.total += int(n)
        return f"tally: {self.total}"


class TallyEnv(ConversationEnv):
    """Task ``i``: add ``i + 2``, then ``i + 3`` more (two user turns)."""

    def __init__(self, split: str = "test", **kwargs: Any):
        kwargs.setdefault("max_turns", 6)
        super().__init__(split=split, **kwargs)

    @property
    def num_tasks(self) -> int:
        return 4

    def get_task(self, index: int) -> Task:
        a, b = index + 2, index + 3
        return Task(
            id=f"tally-{self.split}-{index}",
            prompt=f"Add {a}.",
            answer=[a, a + b],
            metadata={"user_turns": [f"Add {b} more."], "adds": [a, b]},
        )

    def instructions(self) -> str:
        return "Keep the tally with its tool, then answer with the total."

    def episode_tools(self, task: Task) -> list[agentenv.Tool]:
        self.tally = Tally()  # this episode's own tally
        return toolset(self.tally)

    def score_turn(self, answer: str, task: Task, turn: int) -> tuple[float, dict[str, Any]]:
        right = answer.strip() == str(task.answer[turn]) == str(self.tally.total)
        return float(right), {"correct": right}

    def demonstration(self, task: Task) -> list[str]:
        actions = []
        for n, total in zip(task.metadata["adds"], task.answer, strict=True):
            call = json.dumps({"name": "add", "arguments": {"n": n}})
            actions += [f"<tool_call>{call}</tool_call>", f"<answer>{total}</answer>"]
        return actions


agentenv.register("Tally-v0", entry_point=TallyEnv, override=True)
