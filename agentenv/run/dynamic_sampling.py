"""Dynamic sampling: draw more tasks in place of the groups that carry no learning signal.

GRPO learns from the reward differences within a group; a group whose episodes all got
the same rewards teaches nothing (:meth:`algorithms.grpo.GRPO.group_signal` decides, as
``learn`` does), and on a hard multi-step env half of a step's groups can be such. With
``grpo.dynamic_sampling`` a step draws more tasks of the split until it has
``batch_size`` groups with a signal or has drawn ``grpo.max_extra_tasks x batch_size``
extra tasks (DAPO's dynamic sampling; verl's ``filter_groups``, which raises at its cap,
where this trains on what it found)::

    first draw (batch_size tasks) -> keep the groups with a signal
    -> while some are missing and the budget lasts: draw ceil(missing / keep rate) more
    -> train on the first batch_size kept groups (fewer if the budget ran out; none kept:
       the first draw, as a plain step)

Extra tasks' reset seeds are a pure function of ``(seed, step, round, rank)``
(:func:`extra_task_seeds`), so a resumed run draws what an uninterrupted one did. Under
several processes each fills its own share; the rounds are agreed on (a process that
needs no more draws nothing in a round another one needs), so every process runs the
same collectives.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

#: The keep rate assumed when sizing a round after a draw that kept (almost) nothing:
#: a round draws at most 4x the missing groups.
MIN_KEEP_RATE = 0.25


def extra_task_seeds(
    seed: int, step: int, round_: int, n: int, rank: int = 0, env: str = ""
) -> list[int]:
    """The reset seeds of round ``round_``'s ``n`` extra tasks of step ``step`` on process
    ``rank`` (a pure function: a resumed run draws the same); ``env``: a mixture's env
    (each fills its own quota from seeds of its own)."""
    rng = random.Random(f"{seed}-{step}-extra-{round_}-{rank}" + (f"-{env}" if env else ""))
    return [rng.randrange(2**31) for _ in range(n)]


def extra_budget(max_extra_tasks: float, batch_size: int, world: int = 1) -> int:
    """Extra tasks one of ``world`` processes may draw in a step: its share of
    ``max_extra_tasks x batch_size``, rounded up."""
    return math.ceil(max_extra_tasks * batch_size / world)


def fill_batch(
    groups: list[list[Any]],
    signal: Callable[[list[list[Any]]], list[bool]],
    draw: Callable[[int, int], list[list[Any]]],
    want: int,
    budget: int,
    any_process: Callable[[bool], bool] = bool,
) -> tuple[list[list[Any]], dict[str, float]]:
    """The groups a step trains on, and what filling them cost.

    Args:
        groups: The step's first draw (``want`` groups, this process's share).
        signal: Whether each of some groups has a learning signal
            (:meth:`~algorithms.grpo.GRPO.group_signal`).
        draw: ``draw(round, n)`` collects ``n`` more tasks' groups (round 1, 2, ...).
        want: The groups a step trains on (this process's share of ``batch_size``).
        budget: The most extra tasks this process draws (:func:`extra_budget`).
        any_process: Whether any process says True (the identity for one process; a max
            over processes for several): rounds go on while some process needs one.

    Returns:
        The kept groups in draw order (at most ``want``; the first draw if none was kept)
        and ``sampling/*`` metrics: ``tasks_drawn`` (first draw included),
        ``groups_with_signal`` (of all drawn), ``groups_trained``, ``rounds`` (extra
        draws) and ``episodes_per_trained_group`` (episodes drawn over groups trained).
    """
    size = len(groups[0]) if groups else 0
    kept = [g for g, ok in zip(groups, signal(groups), strict=True) if ok] if groups else []
    drawn, extra, rounds = len(groups), 0, 0
    while any_process(len(kept) < want and extra < budget):
        n = 0
        if len(kept) < want and extra < budget:
            rate = max(len(kept) / drawn if drawn else 0.0, MIN_KEEP_RATE)
            n = min(budget - extra, math.ceil((want - len(kept)) / rate))
        rounds += 1
        new = draw(rounds, n) if n else []
        size = size or (len(new[0]) if new else 0)
        extra, drawn = extra + n, drawn + n
        if new:
            kept += [g for g, ok in zip(new, signal(new), strict=True) if ok]
    with_signal = len(kept)
    trained = kept[:want] if kept else groups
    stats = {
        "sampling/tasks_drawn": float(drawn),
        "sampling/groups_with_signal": float(with_signal),
        "sampling/groups_trained": float(len(trained)),
        "sampling/rounds": float(rounds),
        "sampling/episodes_per_trained_group": drawn * size / max(min(with_signal, want), 1),
    }
    return trained, stats
