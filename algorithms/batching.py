"""Episodes into micro-batches, shared by GRPO and SFT.

An episode (:class:`EpisodeLike`) becomes right-padded tensors (:class:`MicroBatch`);
:func:`pack_micro_batches` groups episodes so each forward/backward stays within a token
budget, counting a GRPO group's shared prompt once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from agentenv.rollout.episode import collate


class EpisodeLike(Protocol):
    """What :meth:`GRPO.learn` reads from an episode (``agentenv.rollout.episode.Episode``).

    An episode may also have a ``failed`` attribute: when true (its env raised, or it ran
    past its time limit) it is left out of the update and of its group's baseline.
    """

    input_ids: list[int]  # the whole episode: prompt, policy and environment tokens
    action_mask: list[int]  # 1 exactly on tokens the policy sampled
    sampler_logprobs: list[float]  # the sampler's log-prob at mask-1 positions, 0.0 elsewhere
    reward: float


@dataclass
class MicroBatch:
    """Right-padded tensors of a few episodes."""

    input_ids: torch.Tensor  # (N, T)
    attention_mask: torch.Tensor  # (N, T)
    action_mask: torch.Tensor  # (N, T)
    sampler_logprobs: torch.Tensor  # (N, T)
    advantages: torch.Tensor  # (N,)

    @classmethod
    def from_episodes(
        cls,
        episodes: Sequence[EpisodeLike],
        advantages: Sequence[float],
        pad_token_id: int,
        device: torch.device | str | None = None,
    ) -> MicroBatch:
        """Right-padded tensors of :func:`agentenv.rollout.episode.collate` (the one collate), on
        ``device``."""
        batch = collate(episodes, advantages, pad_token_id)
        return cls(
            input_ids=batch["input_ids"].to(device),
            attention_mask=batch["attention_mask"].to(device),
            action_mask=batch["action_mask"].long().to(device),
            sampler_logprobs=batch["sampler_logprobs"].to(device),
            advantages=batch["advantages"].to(device),
        )


def pack_micro_batches(
    lengths: Sequence[int],
    token_budget: int,
    shared: Sequence[tuple[int, int]] | None = None,
) -> list[list[int]]:
    """Group indices, longest first, while a micro-batch's cost stays within ``token_budget``.

    Without ``shared`` the cost is ``len(batch) * longest``. With ``shared[i] = (key,
    prefix)``, sequences with the same key begin with the same ``prefix`` tokens (a GRPO
    group's prompt); only they are packed together, and the prefix is counted once:
    ``prefix + len(batch) * (longest - prefix)`` (it runs once, see
    :func:`algorithms.logprobs.forward_logprobs`). A sequence over the budget gets a
    micro-batch of its own.
    """
    keys = [(k, p) for k, p in shared] if shared is not None else [(0, 0)] * len(lengths)
    order = sorted(range(len(lengths)), key=lambda i: (keys[i][0], -lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        key, prefix = keys[i]
        last = batches[-1] if batches else None
        if (
            last is not None
            and keys[last[0]][0] == key
            and prefix + (len(last) + 1) * (lengths[last[0]] - prefix) <= token_budget
        ):
            last.append(i)
        else:
            batches.append([i])
    return batches


def padding_micro_batch(pad_token_id: int, device: torch.device | str | None = None) -> MicroBatch:
    """A micro-batch with no policy token (loss 0, zero gradient).

    DDP all-reduces gradients on a process's last backward of a step, and every process must
    make the same number of backward calls: a process with fewer micro-batches than another
    runs these until the counts match (GRPO and SFT both do).
    """
    pad = _Padding([pad_token_id] * 2, [0, 0], [0.0, 0.0], 0.0)
    return MicroBatch.from_episodes([pad], [0.0], pad_token_id, device)


@dataclass
class _Padding:
    input_ids: list[int]
    action_mask: list[int]
    sampler_logprobs: list[float]
    reward: float


def prompt_length(action_mask: Sequence[int]) -> int:
    """Tokens before the first policy token (the episode's prompt)."""
    return next((t for t, m in enumerate(action_mask) if m), len(action_mask))
