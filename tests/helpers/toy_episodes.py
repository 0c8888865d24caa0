"""A minimal episode for algorithm tests (what ``GRPO.learn`` reads, nothing more)."""

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
