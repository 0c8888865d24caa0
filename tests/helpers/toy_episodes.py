"""A minimal episode for algorithm tests (what ``GRPO.learn`` reads, nothing more), and
the fixed batch the multi-process tests split between processes."""

import random
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Ep:
    """An ``EpisodeLike``: tokens, mask, the sampler's log-probs, reward, optional info."""

    input_ids: list[int]
    action_mask: list[int]
    sampler_logprobs: list[float]
    reward: float
    info: dict[str, Any] = field(default_factory=dict)


# rewards of the 4 groups of :func:`toy_groups`: two of them have zero variance
TOY_REWARDS = [[0, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]]


def toy_groups() -> list[list[Ep]]:
    """4 groups x 4 two-turn episodes (prompt, policy, env, policy tokens), always the same."""
    rng = random.Random(0)
    out = []
    for group in TOY_REWARDS:
        eps = []
        for reward in group:
            p, a1, env, a2 = rng.randint(3, 6), rng.randint(2, 6), rng.randint(2, 4), 3
            mask = [0] * p + [1] * a1 + [0] * env + [1] * a2
            ids = [rng.randint(100, 5000) for _ in mask]
            eps.append(Ep(ids, mask, [-1.0 if m else 0.0 for m in mask], float(reward)))
        out.append(eps)
    return out
