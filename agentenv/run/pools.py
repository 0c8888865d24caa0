"""Task difficulty pools: retire the train tasks a policy solves in every sample, or in none.

A task whose group is solved by all of its episodes, or by none, gives GRPO no signal
(:meth:`algorithms.grpo.GRPO.group_signal`); as a policy learns, more of the split
becomes such. With ``pools.enabled`` the run counts each train task's groups and solved
episodes, and retires a task once its last ``retire_after`` groups were all solved
("easy") or all unsolved ("hard"), as prime-rl's difficulty pools do. A step's tasks
are then drawn from the active tasks, and a ``readmit`` share of them from the retired
ones, so a task that became learnable (or was forgotten) can come back: a readmitted
task whose group is mixed is active again.

A step's task seeds still seed each episode; the pool picks the task
(``options={"task_id": i}``) as a pure function of the seed and the pool's state, which
every process updates with every process's groups and every checkpoint holds
(``task_pool.pt``), so a resumed run draws the tasks an uninterrupted one did.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from agentenv.errors import InvalidOptionError

EASY, HARD = "easy", "hard"


def solved(episode: Any) -> bool:
    """Whether an episode solved its task: ``info["correct"]`` where the env reports it,
    else a reward above 0."""
    info = getattr(episode, "info", {}) or {}
    return bool(info["correct"]) if "correct" in info else float(episode.reward) > 0


@dataclass
class TaskPool:
    """Per-task counts over a run and the tasks retired from it.

    Attributes:
        num_tasks: Tasks in the train split.
        retire_after: Groups in a row all solved (or all unsolved) that retire a task.
        readmit: Share of a step's tasks drawn from the retired ones (while there are any).
        groups: ``{task: groups drawn}``; ``solved``: ``{task: episodes solved}``;
            ``episodes``: ``{task: episodes drawn}``.
        streak: ``{task: (kind, n)}``: the task's last ``n`` groups were all ``kind``
            (``"easy"``: all solved, ``"hard"``: none), or ``("", 0)`` after a mixed group.
        retired: ``{task: "easy" | "hard"}``.
    """

    num_tasks: int
    retire_after: int = 2
    readmit: float = 0.1
    groups: dict[int, int] = field(default_factory=dict)
    episodes: dict[int, int] = field(default_factory=dict)
    solved: dict[int, int] = field(default_factory=dict)
    streak: dict[int, tuple[str, int]] = field(default_factory=dict)
    retired: dict[int, str] = field(default_factory=dict)

    def task_ids(self, task_seeds: Sequence[int]) -> list[int]:
        """The task of each seed: with probability ``readmit`` (while tasks are retired) a
        retired one, else an active one, uniformly, as a pure function of the seed and the
        pool (every process maps a seed to the same task)."""
        retired = sorted(self.retired)
        active = [t for t in range(self.num_tasks) if t not in self.retired]
        out = []
        for seed in task_seeds:
            rng = random.Random(f"pool-{seed}")
            readmit = bool(retired) and (not active or rng.random() < self.readmit)
            choices = retired if readmit else active
            out.append(choices[rng.randrange(len(choices))])
        return out

    def options(self, task_seeds: Sequence[int]) -> list[dict[str, int]]:
        """The reset options of a step's tasks (``{"task_id": i}``)."""
        return [{"task_id": task} for task in self.task_ids(task_seeds)]

    def update(self, results: Sequence[tuple[int, int, int]]) -> None:
        """Record groups ``(task, episodes, solved)`` (every process's, in one order):
        counts, streaks, retirements, and readmitted tasks that came back mixed."""
        for task, n, k in results:
            self.groups[task] = self.groups.get(task, 0) + 1
            self.episodes[task] = self.episodes.get(task, 0) + n
            self.solved[task] = self.solved.get(task, 0) + k
            kind = EASY if k == n else HARD if k == 0 else ""
            last, count = self.streak.get(task, ("", 0))
            count = count + 1 if kind and kind == last else (1 if kind else 0)
            self.streak[task] = (kind, count)
            if kind and count >= self.retire_after:
                self.retired[task] = kind
            elif not kind:
                self.retired.pop(task, None)

    def metrics(self) -> dict[str, float]:
        """``pools/*``: tasks active, retired easy and hard, seen, and the pass rate over
        every episode drawn so far."""
        kinds = list(self.retired.values())
        episodes = sum(self.episodes.values())
        return {
            "pools/active": float(self.num_tasks - len(kinds)),
            "pools/retired_easy": float(kinds.count(EASY)),
            "pools/retired_hard": float(kinds.count(HARD)),
            "pools/tasks_seen": float(len(self.groups)),
            "pools/pass_rate": sum(self.solved.values()) / episodes if episodes else 0.0,
        }

    def state_dict(self) -> dict[str, Any]:
        """The counts and retirements (torch-saveable: ints and strings)."""
        return {
            "num_tasks": self.num_tasks,
            "groups": dict(self.groups),
            "episodes": dict(self.episodes),
            "solved": dict(self.solved),
            "streak": {t: list(s) for t, s in self.streak.items()},
            "retired": dict(self.retired),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s values (the settings stay this run's)."""
        if state["num_tasks"] != self.num_tasks:
            raise InvalidOptionError(
                f"the checkpoint's task pool covers {state['num_tasks']} tasks, this env's "
                f"train split {self.num_tasks}: resume with the env kwargs it was saved with"
            )
        self.groups = {int(t): int(v) for t, v in state["groups"].items()}
        self.episodes = {int(t): int(v) for t, v in state["episodes"].items()}
        self.solved = {int(t): int(v) for t, v in state["solved"].items()}
        self.streak = {int(t): (str(s[0]), int(s[1])) for t, s in state["streak"].items()}
        self.retired = {int(t): str(v) for t, v in state["retired"].items()}


def group_results(groups: Sequence[Sequence[Any]], tasks: Sequence[int]) -> list[tuple]:
    """``(task, episodes, solved)`` of each group (failed episodes left out)."""
    out = []
    for group, task in zip(groups, tasks, strict=True):
        kept = [e for e in group if not getattr(e, "failed", False)]
        if kept:
            out.append((int(task), len(kept), sum(solved(e) for e in kept)))
    return out
