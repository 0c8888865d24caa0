"""A minimal episode for algorithm tests (what ``GRPO.learn`` reads, nothing more), the
fixed batch the multi-process tests split between processes, and the sampler settings a
``GRPO`` is built with (its required ``sampling``)."""

import random
from dataclasses import dataclass, field
from typing import Any

from agentenv.lm.backend import SamplingConfig
from agentenv.rollout.episode import Episode

SAMPLING = SamplingConfig()  # temperature 1.0: what the toy episodes were "sampled" with


@dataclass
class Ep:
    """An ``EpisodeLike``: tokens, mask, the sampler's log-probs, reward, optional info."""

    input_ids: list[int]
    action_mask: list[int]
    sampler_logprobs: list[float]
    reward: float
    info: dict[str, Any] = field(default_factory=dict)


def make_groups(rewards: list[list[float]], seed: int = 0) -> list[list[Ep]]:
    """Episodes of 10-20 tokens: prompt, policy turn, environment turn, policy turn."""
    rng = random.Random(seed)
    groups = []
    for group in rewards:
        episodes = []
        for reward in group:
            p, a1, env, a2 = rng.randint(3, 5), rng.randint(2, 5), rng.randint(2, 4), 3
            mask = [0] * p + [1] * a1 + [0] * env + [1] * a2
            ids = [rng.randint(100, 5000) for _ in mask]
            logprobs = [-rng.uniform(8, 12) if m else 0.0 for m in mask]
            episodes.append(Ep(ids, mask, logprobs, float(reward)))
        groups.append(episodes)
    return groups


# the batch the multi-process tests split between processes: two zero-variance groups
TOY_REWARDS = [[0, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]]


def answer_episodes(tokenizer, n: int = 4) -> list[Episode]:
    """``n`` SFT demonstrations in SmolLM2's chat format: "add i and 1" -> ``<answer>i+1``."""
    out = []
    for i in range(n):
        prompt = tokenizer.encode(
            f"<|im_start|>user\nadd {i} and 1<|im_end|>\n<|im_start|>assistant\n",
            add_special_tokens=False,
        )
        answer = tokenizer.encode(f"<answer>{i + 1}</answer>", add_special_tokens=False) + [2]
        ids = prompt + answer
        out.append(Episode(ids, [0] * len(prompt) + [1] * len(answer), [0.0] * len(ids), 1.0))
    return out
