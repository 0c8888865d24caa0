"""Combining a multi-component reward into the scalar GRPO's advantages are computed from.

An env may report named reward components at the end of an episode
(``info["reward_components"]``, e.g. RAG-v0's ``answer`` / ``retrieval`` / ``format``);
its own reward is then its weighted sum (``weighted``, the default: nothing is combined
here). The other methods look at the whole batch's component matrix ``X (N, K)``:

* ``uniform``: the mean of the components (every component weighs the same).
* ``std``: each component divided by its batch std, then summed: a component's weight no
  longer depends on its scale. A component with zero variance in the batch contributes 0
  (it carries no signal, and a constant divided by ~0 would swamp the others).
* ``pca``: the projection of the centred components on the first principal component of
  the batch covariance, the direction in which episodes differ most; its sign is chosen so
  that it correlates positively with the plain sum (``v . C 1 >= 0``), so "more of every
  component" is never penalised. All-constant components give 0.
* ``l2``: the Euclidean norm of each episode's component vector.

Batch statistics (means, covariance) are arguments so that several processes can pass the
statistics of the global batch (sums reduced over processes) and combine identically.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from agentenv.errors import InvalidOptionError
from algorithms.config import REWARD_COMBINATIONS

_EPS = 1e-8


def batch_moments(components: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean ``(K,)`` and population covariance ``(K, K)`` of ``components`` ``(N, K)``."""
    x = components.double()
    mean = x.mean(0)
    centred = x - mean
    return mean, centred.T @ centred / x.shape[0]


def combine_rewards(
    components: torch.Tensor,
    method: str,
    *,
    mean: torch.Tensor | None = None,
    cov: torch.Tensor | None = None,
) -> torch.Tensor:
    """One reward per episode from its components ``(N, K)``; returns ``(N,)`` float64.

    Args:
        components: One row per episode, one column per named component.
        method: ``uniform`` | ``std`` | ``pca`` | ``l2`` (``weighted`` is the env's own
            reward and is never computed here).
        mean, cov: The batch's component mean ``(K,)`` and population covariance
            ``(K, K)``; default: those of ``components`` (see :func:`batch_moments`).
    """
    if components.dim() != 2 or method not in REWARD_COMBINATIONS[1:]:
        raise InvalidOptionError(
            f"expected components (N, K) and method in {REWARD_COMBINATIONS[1:]}, got shape "
            f"{tuple(components.shape)} and method={method!r}"
        )
    x = components.double()  # (N, K)
    if method == "uniform":
        return x.mean(-1)
    if method == "l2":
        return x.norm(dim=-1)
    if mean is None or cov is None:
        mean, cov = batch_moments(x)
    mean, cov = mean.double(), cov.double()
    if method == "std":
        std = cov.diagonal().clamp(min=0).sqrt()  # (K,)
        scale = torch.where(std > _EPS, 1 / std.clamp(min=_EPS), torch.zeros_like(std))
        return (x * scale).sum(-1)
    # pca: the top eigenvector of the covariance (eigh sorts eigenvalues ascending)
    values, vectors = torch.linalg.eigh(cov)
    if values[-1] <= _EPS:  # every component constant over the batch
        return torch.zeros(x.shape[0], dtype=torch.float64)
    v = vectors[:, -1]  # (K,)
    if v @ cov.sum(-1) < 0:  # cov(score, sum of components) = v . C 1
        v = -v
    return (x - mean) @ v


def episode_rewards(
    episodes: Sequence[Any],
    env_rewards: torch.Tensor,
    method: str,
    global_sum: Callable[[list[float]], list[float]],
    gather: Callable[[list[Any]], list[Any]] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The rewards advantages start from (shaped like ``env_rewards``, ``(B, G)``), and
    each component's batch mean (``rewards/components/<name>``).

    ``weighted`` keeps the env's rewards; the other methods combine the episodes'
    ``info["reward_components"]`` over the global batch (missing components count 0; an
    env that reports none has one component, its reward). ``global_sum`` sums a list of
    floats over every process (the identity for one process), ``gather`` concatenates a
    list over every process (default: accelerate's ``gather_object``; the identity gives
    this process's statistics alone, with no collective).
    """
    from accelerate.utils import gather_object

    gather = gather or gather_object
    found = [getattr(ep, "info", {}).get("reward_components") or {} for ep in episodes]
    names = sorted({n for names in gather([sorted(c) for c in found]) for n in names})
    if not names:
        if method == "weighted":
            return env_rewards, {}
        names, found = ["reward"], [{"reward": float(ep.reward)} for ep in episodes]
    x = torch.tensor([[float(c.get(n, 0.0)) for n in names] for c in found]).double()  # (N, K)
    k = len(names)
    sums = global_sum([*x.sum(0).tolist(), *(x.T @ x).flatten().tolist(), len(x)])
    n = sums[-1]
    mean = torch.tensor(sums[:k], dtype=torch.float64) / n  # (K,)
    cov = torch.tensor(sums[k:-1], dtype=torch.float64).view(k, k) / n - torch.outer(mean, mean)
    stats = {f"rewards/components/{name}": m for name, m in zip(names, mean.tolist(), strict=True)}
    if method == "weighted":
        return env_rewards, stats
    combined = combine_rewards(x, method, mean=mean, cov=cov)  # (N,)
    return combined.float().view_as(env_rewards), stats
