"""What a task family is (:class:`Family`) and what its generator returns (:class:`TaskSpec`).

The families (:mod:`envs.workspace.families`) build on this module and
:mod:`envs.workspace.tasks` draws splits from them, so imports run one way:
tasks -> families -> base.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Protocol

from envs.workspace.workspace import Workspace


@dataclass(frozen=True)
class TaskSpec:
    """What a family generator returns.

    Attributes:
        prompt: The instructions for the agent.
        files: Fixture files, ``{relative path: text}``.
        params: Everything the checker and the solver need (JSON-serialisable).
    """

    prompt: str
    files: dict[str, str]
    params: dict[str, Any] = field(default_factory=dict)


ToolCallSpec = dict[str, Any]
"""A scripted tool call: ``{"name": "write_file", "arguments": {...}}``."""


class Family(Protocol):
    """A task family: a generator, a checker and a scripted solver."""

    name: str

    def generate(self, rng: random.Random, level: str) -> TaskSpec:
        """A new task of ``level`` drawn with ``rng``."""
        ...

    def check(self, params: dict[str, Any], ws: Workspace) -> list[tuple[str, bool]]:
        """Named checks of the final state of ``ws``."""
        ...

    def solve(self, params: dict[str, Any], files: dict[str, str]) -> list[ToolCallSpec]:
        """Tool calls that solve the task (without the final answer)."""
        ...
