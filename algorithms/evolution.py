"""One evolution of a population: tournament selection with elitism, then mutations.

Pure and torch-free: :func:`next_generation` takes the members' fitness and hyper-parameters
and a seeded ``random.Random``, and returns, for each slot of the population, which member
it becomes a copy of and with which hyper-parameters. :mod:`algorithms.population` carries
that out on the adapters and optimizers.

The recipe is AgileRL's (``TournamentSelection`` and ``Mutations.rl_hyperparam``):

* **Elitism**: the fittest member is the first parent, kept as it is.
* **Tournaments** fill the other places: ``tournament_size`` members drawn without
  replacement, the fittest of them wins (ties: the lower index). A member may win many.
* **Slots**: a member chosen as a parent keeps its own slot for its first place; the
  remaining places go to the slots of the members nobody chose (the losers), in index
  order. So only losers are overwritten, and a winner is never copied onto itself. A
  copy gets a fresh lineage id (:mod:`algorithms.population`), which seeds its draws: even
  unmutated it samples other episodes than its parent, so it does not repeat it.
* **Mutation**: every new member but the elite, with probability ``mutation_prob``, has
  one hyper-parameter (drawn from ``mutate``, skipping any at 0) multiplied by a factor
  drawn from ``mutation_factors`` and clipped to its bounds.

The caller seeds the ``random.Random`` from ``(seed, step)``, so an evolution is a pure
function of the run's seed, the step and the fitness: a resumed run evolves the same way.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from algorithms.config import EvolutionConfig


@dataclass(frozen=True)
class Child:
    """What slot ``slot`` of the next generation becomes.

    Attributes:
        slot: The member index it occupies (the same ``slot`` as before the evolution).
        parent: The member it is a copy of (``parent == slot``: it stays itself).
        elite: The fittest member, kept unmutated.
        hyperparameters: Its hyper-parameters (the parent's, after any mutation).
        mutation: ``{name: (old, new)}`` of its one mutation, or empty.
    """

    slot: int
    parent: int
    elite: bool
    hyperparameters: dict[str, float]
    mutation: dict[str, tuple[float, float]] = field(default_factory=dict)


def _fittest(candidates: Sequence[int], fitness: Sequence[float]) -> int:
    """The candidate with the highest fitness; among equals, the lowest index."""
    return max(candidates, key=lambda i: (fitness[i], -i))


def tournament(
    fitness: Sequence[float], rng: random.Random, tournament_size: int, elitism: bool
) -> list[int]:
    """The parents of the next generation, one per member: the elite first (if
    ``elitism``), then the winner of each tournament of ``tournament_size`` members drawn
    without replacement (all of them, if the population is smaller)."""
    n = len(fitness)
    everyone = range(n)
    parents = [_fittest(everyone, fitness)] if elitism else []
    while len(parents) < n:
        parents.append(_fittest(rng.sample(everyone, min(tournament_size, n)), fitness))
    return parents


def assign_slots(parents: Sequence[int]) -> list[int]:
    """The parent of each slot: each chosen member keeps its own slot for its first place
    in ``parents``; its other places go to the unchosen members' slots, in index order."""
    chosen = set(parents)
    free = [i for i in range(len(parents)) if i not in chosen]
    of_slot: dict[int, int] = {}
    for parent in parents:
        of_slot[parent if parent not in of_slot else free.pop(0)] = parent
    return [of_slot[slot] for slot in range(len(parents))]


def mutate(
    hyperparameters: Mapping[str, float],
    rng: random.Random,
    names: Sequence[str],
    factors: Sequence[float],
    bounds: Mapping[str, Sequence[float]],
) -> tuple[dict[str, float], dict[str, tuple[float, float]]]:
    """``hyperparameters`` with one of ``names`` (those above 0) multiplied by a factor
    from ``factors`` and clipped to ``bounds[name]``; and ``{name: (old, new)}``, empty if
    no name can change."""
    new = dict(hyperparameters)
    movable = [name for name in names if new[name] > 0]
    if not movable:
        return new, {}
    name = rng.choice(movable)
    low, high = bounds.get(name, (0.0, float("inf")))
    old = new[name]
    new[name] = min(max(old * rng.choice(list(factors)), low), high)
    return new, {name: (old, new[name])}


def next_generation(
    fitness: Sequence[float],
    hyperparameters: Sequence[Mapping[str, float]],
    rng: random.Random,
    config: EvolutionConfig,
) -> list[Child]:
    """The next generation, slot by slot (see the module docstring for the rules).

    Args:
        fitness: Each member's fitness (higher is better).
        hyperparameters: Each member's current hyper-parameters.
        rng: Seeded by the caller (e.g. from the run's seed and the step).
        config: Tournament size, elitism and the mutation settings.
    """
    if len(fitness) != len(hyperparameters):
        raise ValueError(
            f"got {len(fitness)} fitness values for {len(hyperparameters)} members; pass one each"
        )
    parents = tournament(fitness, rng, config.tournament_size, config.elitism)
    elite = parents[0] if config.elitism else None
    children = []
    for slot, parent in enumerate(assign_slots(parents)):
        is_elite = slot == elite  # the elite keeps its own slot (its first place)
        hp, change = dict(hyperparameters[parent]), {}
        if not is_elite and rng.random() < config.mutation_prob:
            hp, change = mutate(
                hp, rng, config.mutate, config.mutation_factors, config.mutation_bounds
            )
        children.append(Child(slot, parent, is_elite, hp, change))
    return children
