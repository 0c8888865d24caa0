"""Episodes into micro-batches, shared by GRPO and SFT.

An episode (:class:`EpisodeLike`) becomes right-padded tensors (:class:`MicroBatch`);
:func:`pack_micro_batches` (SFT) and :func:`pack_prefix_trees` (GRPO, whose forward runs a
micro-batch's shared prefixes once) group episodes so each forward/backward stays within a
token budget.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
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


def token_advantages(
    spans: Sequence[Sequence[tuple[int, int]]],
    per_turn: Sequence[Sequence[float]],
    width: int,
) -> torch.Tensor:
    """``(N, width)``: row ``i`` holds ``per_turn[i][k]`` on the positions ``spans[i][k]``
    (``[start, end)`` of turn ``k``'s tokens: ``Episode.turn_spans``), 0 elsewhere."""
    out = torch.zeros(len(spans), width)
    for i, (row, values) in enumerate(zip(spans, per_turn, strict=True)):
        for (start, end), value in zip(row, values, strict=True):
            out[i, start:end] = value
    return out


def pack_micro_batches(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Group indices, longest first, while a micro-batch's ``len(batch) * longest`` (its
    padded rows) stays within ``token_budget``. A sequence over the budget gets a
    micro-batch of its own (SFT's packing)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        last = batches[-1] if batches else None
        if last is not None and (len(last) + 1) * lengths[last[0]] <= token_budget:
            last.append(i)
        else:
            batches.append([i])
    return batches


def pack_prefix_trees(rows: Sequence[Sequence[Hashable]], token_budget: int) -> list[list[int]]:
    """Group indices of ``rows`` so that each micro-batch's prefix tree (the rows with
    their shared prefixes counted once, :class:`~algorithms.prefix_tree.PrefixTree`: how
    GRPO's forward runs them) holds at most ``token_budget`` tokens.

    Rows are taken in sorted order, so those that share a prefix (a GRPO group's
    episodes) sit side by side and share a micro-batch; a row costs its length less its
    longest common prefix with an earlier row of the micro-batch (in sorted order, the
    one just before it). A row over the budget gets a micro-batch of its own. Compare
    ``(token, action mask)`` pairs, as the tree does, for its exact size.
    """
    keyed = [tuple(row) for row in rows]
    batches: list[list[int]] = []
    size, previous = 0, ()
    for i in sorted(range(len(keyed)), key=lambda i: (keyed[i], i)):
        row = keyed[i]
        cost = len(row) - _common_prefix(row, previous)
        if batches and size + cost <= token_budget:
            batches[-1].append(i)
            size += cost
        else:
            batches.append([i])
            size = len(row)
        previous = row
    return batches


def _common_prefix(a: Sequence[Hashable], b: Sequence[Hashable]) -> int:
    """Length of the longest common prefix of ``a`` and ``b``."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


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
