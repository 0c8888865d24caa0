"""Deterministic, verifiable workspace tasks.

Four families, each with an ``easy`` and a ``hard`` level (see
:mod:`envs.workspace.families`):

* ``files``  -- create or modify files to a spec (exact text file; JSON config edits);
* ``data``   -- compute an answer from a generated CSV / JSON file into an answer file;
* ``bugfix`` -- fix the bug(s) in a small module so its bundled test passes;
* ``rename`` -- rename a function (and, when hard, a module) across a small project.

A task is fixture files plus a prompt. Its checker inspects the *final workspace
state* -- files read by the host with the safe path functions, and code executed
only inside the sandbox -- never the agent's claims. A scripted solver per family
produces tool calls that solve the task (used by tests and benchmarks).

Splits: each candidate is assigned to ``train`` or ``test`` by a stable hash of its
prompt and files, so the splits are disjoint by construction; duplicates are dropped.
Task ``i`` of a split belongs to family/level combination ``i % len(combinations)``,
so every family and level is equally represented and ``task_id`` is deterministic.
"""

from __future__ import annotations

import functools
import json
import random
from dataclasses import dataclass

from agentenv.env.core import Task
from agentenv.env.splits import hashed_split
from agentenv.errors import InvalidOptionError, TaskSourceError
from envs.workspace.families import FAMILIES
from envs.workspace.families.base import TaskSpec, ToolCallSpec
from envs.workspace.workspace import Workspace

LEVELS = ("easy", "hard")
TEST_FRACTION = 0.2
DEFAULT_NUM_TASKS = {"train": 800, "test": 200}


@dataclass(frozen=True)
class CheckResult:
    """Named checks of a final workspace state and whether each passed."""

    checks: tuple[tuple[str, bool], ...]

    @property
    def passed(self) -> bool:
        """True when there is at least one check and all of them passed."""
        return bool(self.checks) and all(ok for _, ok in self.checks)

    @property
    def failed(self) -> list[str]:
        """Descriptions of the checks that failed."""
        return [name for name, ok in self.checks if not ok]

    @property
    def fraction(self) -> float:
        """Share of checks passed (for optional partial credit)."""
        return sum(ok for _, ok in self.checks) / len(self.checks) if self.checks else 0.0


def family_names() -> tuple[str, ...]:
    """Names of the bundled families, in order."""
    return tuple(FAMILIES)


def split_of(key: str, test_fraction: float = TEST_FRACTION) -> str:
    """``"test"`` or ``"train"``, from a stable hash of ``key``."""
    return hashed_split(key, test_fraction)


def _signature(spec: TaskSpec) -> str:
    return json.dumps([spec.prompt, sorted(spec.files.items())], sort_keys=True)


def load_tasks(
    split: str = "train",
    *,
    num_tasks: int | None = None,
    families: tuple[str, ...] | list[str] | None = None,
    levels: tuple[str, ...] | list[str] | None = None,
    seed: int = 0,
) -> tuple[Task, ...]:
    """The tasks of one split (cached).

    Args:
        split: ``"train"`` or ``"test"``.
        num_tasks: How many (default 800 train / 200 test).
        families: Subset of :func:`family_names` (default all).
        levels: Subset of ``("easy", "hard")`` (default both).
        seed: Generator seed; the split of a task does not depend on it.

    Raises:
        InvalidOptionError: unknown split, family or level, or ``num_tasks < 1``.
    """
    if split not in ("train", "test"):
        raise InvalidOptionError(f"split must be 'train' or 'test', got {split!r}")
    known = family_names()
    families = tuple(families) if families is not None else known
    levels = tuple(levels) if levels is not None else LEVELS
    bad = [f for f in families if f not in known]
    if bad or not families:
        raise InvalidOptionError(f"families must be a non-empty subset of {known}, got {bad}")
    bad = [level for level in levels if level not in LEVELS]
    if bad or not levels:
        raise InvalidOptionError(f"levels must be a non-empty subset of {LEVELS}, got {bad}")
    n = DEFAULT_NUM_TASKS[split] if num_tasks is None else num_tasks
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InvalidOptionError(f"num_tasks must be an int >= 1, got {num_tasks!r}")
    return _load_cached(split, n, families, levels, int(seed))


@functools.lru_cache(maxsize=16)
def _load_cached(
    split: str, n: int, families: tuple[str, ...], levels: tuple[str, ...], seed: int
) -> tuple[Task, ...]:
    combos = [(f, level) for f in families for level in levels]
    per_combo = [(n - i + len(combos) - 1) // len(combos) for i in range(len(combos))]
    streams = [
        _stream(split, f, level, seed, k) for (f, level), k in zip(combos, per_combo, strict=True)
    ]
    return tuple(streams[i % len(combos)][i // len(combos)] for i in range(n))


def _stream(split: str, family: str, level: str, seed: int, count: int) -> list[Task]:
    """The first ``count`` tasks of one family/level that fall in ``split``."""
    fam = FAMILIES[family]
    out: list[Task] = []
    seen: set[str] = set()
    j = 0
    while len(out) < count:
        if j > 100 * count + 1000:
            raise TaskSourceError(
                f"family {family!r} ({level}) produced only {len(out)} distinct {split} tasks "
                f"of the {count} asked for; ask for fewer tasks"
            )
        spec = fam.generate(random.Random(f"{seed}:{family}:{level}:{j}"), level)
        j += 1
        sig = _signature(spec)
        if sig in seen or split_of(sig) != split:
            continue
        seen.add(sig)
        out.append(
            Task(
                id=f"{family}-{level}-{len(out)}",
                prompt=spec.prompt,
                answer=None,
                metadata={
                    "family": family,
                    "level": level,
                    "files": spec.files,
                    "params": spec.params,
                },
            )
        )
    return out


def check_task(task: Task, ws: Workspace) -> CheckResult:
    """Run the task's checker on the final state of ``ws``."""
    fam = FAMILIES[task.metadata["family"]]
    return CheckResult(tuple(fam.check(task.metadata["params"], ws)))


def solve_task(task: Task) -> list[ToolCallSpec]:
    """The scripted solver's tool calls for ``task`` (the final answer not included)."""
    fam = FAMILIES[task.metadata["family"]]
    return fam.solve(task.metadata["params"], task.metadata["files"])


def as_actions(calls: list[ToolCallSpec], answer: str = "done") -> list[str]:
    """Tool calls as Hermes ``<tool_call>`` actions, one per step, then ``<answer>``."""
    actions = [f"<tool_call>{json.dumps(call)}</tool_call>" for call in calls]
    return [*actions, f"<answer>{answer}</answer>"]
