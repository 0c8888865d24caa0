"""The loss math, as pure functions of tensors (hand-computed tests in tests/algorithms/).

- :func:`compute_advantages`: rewards ``(B, G)`` -> advantages ``(B, G)`` (group baseline,
  optional std normalisation; see :mod:`algorithms.grpo` for the choices).
- :func:`turn_advantages`: those plus each turn's return of per-turn rewards -> one
  advantage per turn of every episode (``credit="turn"``), against the group's turns or
  the other episodes' (leave-one-out).
- :func:`shaped_rewards`: the outcome plus weighted per-turn rewards (``bandit``'s shaping).
- :func:`gae_advantages`: a critic's values before each turn and the turns' rewards ->
  GAE advantages per turn and the critic's targets (``credit="gae"``).
- :func:`kl_estimate`: Schulman's k1 / k2 / k3 per token.
- :func:`policy_loss`: the clipped surrogate of each loss type, normalised over the batch.
- :func:`masked_nll`: SFT's loss over the policy's tokens only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from agentenv.errors import InvalidOptionError
from algorithms.config import (
    ADVANTAGE_BASELINES,
    ADVANTAGE_NORMS,
    KL_ESTIMATORS,
    TURN_BASELINES,
    GRPOConfig,
)


def compute_advantages(
    rewards: torch.Tensor,
    norm: str = "mean_std",
    eps: float = 1e-4,
    *,
    baseline: str = "group_mean",
    batch_mean_std: tuple[float, float] | None = None,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Advantages of rewards ``(B, G)``: one row per group; returns ``(B, G)``.

    The baseline is subtracted: the group's mean (``group_mean``) or median
    (``group_median``, the mean of the two middle values for even G), or the whole batch's
    mean (``global_mean``); :class:`~algorithms.grpo.GRPO` clips rewards before this.
    ``mean_std`` then divides by the population std plus ``eps``: the group's for group
    baselines, the batch's for ``global_mean``. With a group baseline, rows whose rewards
    are all equal get exactly 0. ``batch_mean_std`` gives the batch's mean and std when the
    batch is spread over processes (default: those of ``rewards``).

    ``valid`` (``(B, G)`` bool, default all true) marks the episodes that count: the
    others (an env that raised, a timeout) get advantage 0 and are left out of every
    mean, median and std, as if the group had only its valid members; a group with fewer
    than 2 valid members gets 0 throughout.
    """
    if rewards.dim() != 2 or norm not in ADVANTAGE_NORMS or baseline not in ADVANTAGE_BASELINES:
        raise InvalidOptionError(
            f"expected rewards (B, G), norm in {ADVANTAGE_NORMS} and baseline in "
            f"{ADVANTAGE_BASELINES}, got shape {tuple(rewards.shape)}, norm={norm!r}, "
            f"baseline={baseline!r}"
        )
    if valid is None:
        valid = torch.ones_like(rewards, dtype=torch.bool)
    elif valid.shape != rewards.shape or valid.dtype != torch.bool:
        raise InvalidOptionError(
            f"valid must be a bool tensor shaped like rewards {tuple(rewards.shape)}, got "
            f"{valid.dtype} {tuple(valid.shape)}"
        )
    if baseline == "global_mean":
        if batch_mean_std is None:
            kept = rewards[valid]
            batch_mean_std = (
                (kept.mean().item(), kept.std(correction=0).item()) if kept.numel() else (0.0, 0.0)
            )
        mean, std = batch_mean_std
        advantages = rewards - mean  # (B, G)
        if norm == "mean_std":
            advantages = advantages / (std + eps)
        return advantages.masked_fill(~valid, 0.0)
    if bool(valid.all()):  # every member counts: the plain group statistics
        if baseline == "group_median":
            base = rewards.quantile(0.5, dim=1, keepdim=True)  # (B, 1), interpolated
        else:
            base = rewards.mean(dim=1, keepdim=True)  # (B, 1)
        advantages = rewards - base  # (B, G)
        if norm == "mean_std":
            advantages = advantages / (rewards.std(dim=1, keepdim=True, correction=0) + eps)
        zero_std = (rewards == rewards[:, :1]).all(dim=1, keepdim=True)  # (B, 1)
        return advantages.masked_fill(zero_std, 0.0)
    # Some members do not count: each such group's valid members by themselves, through the
    # same kernels as a group of that size. Masked sums would be the same statistics in exact
    # arithmetic but not bitwise: the kernels may sum 4 values with a zero in another order
    # than the 3 values (an MKL build of torch gave a different last bit).
    advantages = torch.zeros_like(rewards)  # (B, G)
    for row in range(rewards.shape[0]):
        members = valid[row].nonzero().squeeze(1)  # (n,) indices of the valid members
        if members.numel() >= 2:  # fewer: no group to be relative to, 0 throughout
            alone = rewards[row, members].unsqueeze(0)  # (1, n)
            advantages[row, members] = compute_advantages(alone, norm, eps, baseline=baseline)[0]
    return advantages


def without_signal(rewards: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``(B,)`` bool: groups of ``rewards`` ``(B, G)`` whose ``valid`` members all have the
    same reward, or that have fewer than 2 valid members (no group-relative signal)."""
    high = rewards.masked_fill(~valid, float("-inf")).amax(dim=1)  # (B,)
    low = rewards.masked_fill(~valid, float("inf")).amin(dim=1)
    return (high == low) | (valid.sum(dim=1) < 2)


def turn_advantages(
    outcome: torch.Tensor,
    turn_rewards: Sequence[Sequence[Sequence[float]]],
    valid: torch.Tensor,
    weight: float,
    gamma: float = 1.0,
    norm: str = "mean_std",
    eps: float = 1e-4,
    baseline: str = "group",
) -> list[list[list[float]]]:
    """One advantage per policy turn: ``[b][g][k]`` for turn ``k`` of member ``g`` of group
    ``b``, from the outcome's advantages ``(B, G)`` (:func:`compute_advantages`) and each
    turn's rewards ``turn_rewards[b][g][k]`` (``Episode.turn_rewards``)::

        G[b][g][k] = r[b][g][k] + gamma * G[b][g][k + 1]        (return from turn k on)
        group: A[b][g][k] = outcome[b, g] + weight * (G[b][g][k] - mean) / (std + eps)
        loo:   A[b][g][k] = outcome[b, g] + weight * (G[b][g][k] - mean_without_g)

    ``group``: ``mean`` and ``std`` (population) are taken over every turn of the group's
    ``valid`` members: **one baseline per group**, the same for all its turns (``mean_only``
    does not divide by the std). A constant baseline is unbiased, but a return from turn k
    on holds fewer rewards the later k is, so a later turn's term is lower whatever the
    turn did (on RAG-v0's bridge questions: a first search's +1.2 on average, the second's
    -0.7 and an answer's -0.7). With two members, the std makes the term +-weight however
    little their returns differ.

    ``loo`` (RLOO's leave-one-out): member g's baseline is the mean over every turn of the
    *other* valid members, so an episode's own returns never lower its own term; nothing
    is divided, so the term keeps the size of the difference (two members whose one-turn
    returns are 0.5 and 0: +0.5 and -0.5). A member with no valid other gets no turn term.

    A group whose returns are all equal gets no turn term; invalid members (failed
    episodes) get 0 on every turn, as their outcome advantage is.
    """
    if norm not in ADVANTAGE_NORMS:
        raise InvalidOptionError(f"norm must be one of {ADVANTAGE_NORMS}, got {norm!r}")
    if baseline not in TURN_BASELINES:
        raise InvalidOptionError(f"baseline must be one of {TURN_BASELINES}, got {baseline!r}")
    out: list[list[list[float]]] = []
    for b, group in enumerate(turn_rewards):
        returns, kept = _group_returns(group, valid[b], gamma)
        differ = bool(kept.numel()) and _differ(kept)
        pool = None
        if differ and baseline == "group":
            std = kept.std(correction=0).item() + eps if norm == "mean_std" else 1.0
            pool = (kept.mean().item(), std)
        total, count = float(kept.sum()), kept.numel()
        out.append([])
        for g, rs in enumerate(returns):
            if not valid[b, g]:
                out[b].append([0.0] * len(rs))
                continue
            base = float(outcome[b, g])
            if baseline == "loo":
                others = count - len(rs)
                mean = (total - sum(rs)) / others if differ and others else None
                term = [weight * (x - mean) if mean is not None else 0.0 for x in rs]
                out[b].append([base + t for t in term])
            else:
                out[b].append(
                    [base + (weight * (x - pool[0]) / pool[1] if pool else 0.0) for x in rs]
                )
    return out


def shaped_rewards(
    outcome: torch.Tensor,
    turn_rewards: Sequence[Sequence[Sequence[float]]],
    weight: float,
    gamma: float = 1.0,
) -> torch.Tensor:
    """``outcome`` ``(B, G)`` plus ``weight`` times each episode's return of its per-turn
    rewards from the first turn (discounted by ``gamma``): ``credit="bandit"``'s shaping,
    the reward that ``gae`` sees summed over turns. ``weight`` 0 returns ``outcome``
    itself (not a copy)."""
    if weight == 0:
        return outcome
    first = torch.tensor(
        [[(_returns(rs, gamma) or [0.0])[0] for rs in group] for group in turn_rewards],
        dtype=torch.float64,
    )  # (B, G)
    return (outcome.double() + weight * first).to(outcome.dtype)


def turn_return_spread(
    turn_rewards: Sequence[Sequence[Sequence[float]]],
    valid: torch.Tensor,
    gamma: float = 1.0,
) -> torch.Tensor:
    """``(B,)`` bool: whether group ``b``'s valid members' per-turn returns hold different
    values (else :func:`turn_advantages` gives the group no turn term)."""
    spread = []
    for b, group in enumerate(turn_rewards):
        kept = _group_returns(group, valid[b], gamma)[1]
        spread.append(bool(kept.numel()) and _differ(kept))
    return torch.tensor(spread, dtype=torch.bool)


def _differ(kept: torch.Tensor) -> bool:
    """Whether a pool's returns (non-empty, 1-D) hold different values."""
    return bool((kept != kept[0]).any())


def _group_returns(
    group: Sequence[Sequence[float]], valid: torch.Tensor, gamma: float
) -> tuple[list[list[float]], torch.Tensor]:
    """One group's returns per member and turn, and every turn's return of its valid
    members (float64, flat)."""
    returns = [_returns(rewards, gamma) for rewards in group]
    kept = [x for g, rs in enumerate(returns) if valid[g] for x in rs]
    return returns, torch.tensor(kept, dtype=torch.float64)


def _returns(rewards: Sequence[float], gamma: float) -> list[float]:
    """Discounted returns-to-go of one episode's per-turn rewards."""
    out, ahead = [0.0] * len(rewards), 0.0
    for k in reversed(range(len(rewards))):
        ahead = float(rewards[k]) + gamma * ahead
        out[k] = ahead
    return out


def gae(
    rewards: Sequence[float], values: Sequence[float], gamma: float, lam: float
) -> tuple[list[float], list[float]]:
    """GAE over one episode's turns: ``(advantages, targets)``, one of each per turn::

        delta[k] = r[k] + gamma * V[k + 1] - V[k]        (V[K] = 0: nothing after the end)
        A[k]     = delta[k] + gamma * lam * A[k + 1]
        target[k] = A[k] + V[k]                           (the lambda-return)

    ``values[k]`` is the critic's estimate before turn ``k``. The episode's end is
    terminal whatever ended it, a truncation (max_turns, the token budget) included: an
    episode that runs out of turns has failed its task, and bootstrapping from the value
    of its last state would teach that never answering is as good as answering.
    """
    advantages, ahead = [0.0] * len(rewards), 0.0
    for k in reversed(range(len(rewards))):
        after = values[k + 1] if k + 1 < len(rewards) else 0.0
        ahead = float(rewards[k]) + gamma * after - values[k] + gamma * lam * ahead
        advantages[k] = ahead
    return advantages, [a + v for a, v in zip(advantages, values, strict=True)]


def gae_advantages(
    outcome: torch.Tensor,
    turn_rewards: Sequence[Sequence[Sequence[float]]],
    values: Sequence[Sequence[Sequence[float]]],
    valid: torch.Tensor,
    *,
    weight: float,
    gamma: float,
    lam: float,
    norm: str = "mean_std",
    eps: float = 1e-4,
) -> tuple[list[list[list[float]]], list[list[list[float]]]]:
    """Per-turn advantages ``[b][g][k]`` from a critic, and the critic's targets.

    Turn ``k`` of an episode with ``K`` turns is rewarded ``weight * turn_rewards[k]``,
    plus the episode's ``outcome[b, g]`` ``(B, G)`` at its last turn; :func:`gae` with
    the critic's ``values[b][g][k]`` gives each turn's advantage and target. ``mean_std``
    then whitens the advantages over every turn of the batch's ``valid`` episodes (PPO's
    and verl's whitening, per turn rather than per token: a turn is one decision);
    ``mean_only`` leaves them as they are (the critic is the baseline). Invalid episodes
    (failed) get advantage 0 on every turn and no targets (``[]``).
    """
    if norm not in ADVANTAGE_NORMS:
        raise InvalidOptionError(f"norm must be one of {ADVANTAGE_NORMS}, got {norm!r}")
    raw: list[list[list[float]]] = []
    targets: list[list[list[float]]] = []
    for b, group in enumerate(turn_rewards):
        raw.append([])
        targets.append([])
        for g, rewards in enumerate(group):
            if not valid[b, g]:
                raw[b].append([0.0] * len(rewards))
                targets[b].append([])
                continue
            r = [weight * float(x) for x in rewards]
            if r:
                r[-1] += float(outcome[b, g])
            a, t = gae(r, values[b][g], gamma, lam)
            raw[b].append(a)
            targets[b].append(t)
    kept = torch.tensor(
        [a for b, group in enumerate(raw) for g, turns in enumerate(group) if valid[b, g]
         for a in turns],
        dtype=torch.float64,
    )  # fmt: skip
    mean, scale = 0.0, 1.0
    if norm == "mean_std" and kept.numel():
        mean, scale = kept.mean().item(), kept.std(correction=0).item() + eps
    out = [
        [
            [(a - mean) / scale if valid[b, g] else 0.0 for a in turns]
            for g, turns in enumerate(group)
        ]
        for b, group in enumerate(raw)
    ]
    return out, targets


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL(pi || ref) estimate from log-probs of the sampled tokens (same shape).

    With ``d = logp - ref_logp``: ``k1 = d``, ``k2 = d^2 / 2``, ``k3 = exp(-d) + d - 1``.
    """
    delta = logp - ref_logp
    if estimator == "k1":
        return delta
    if estimator == "k2":
        return 0.5 * delta.square()
    if estimator == "k3":
        return torch.exp(-delta) + delta - 1
    raise InvalidOptionError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    config: GRPOConfig,
    ref_logp: torch.Tensor | None = None,
    *,
    entropy: torch.Tensor | None = None,
    num_tokens: float | None = None,
    num_sequences: float | None = None,
    completion_length: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped policy-gradient loss (+ beta * KL - entropy_coef * H) of ``config.loss_type``.

    Args:
        logp: Current log-probs ``(N, T)`` (with grad). old_logp, ref_logp: same shape.
        advantages: One advantage per sequence ``(N,)``, or per token ``(N, T)``
            (``credit="turn"``: each turn's advantage on its tokens).
        action_mask: ``(N, T)``, 1 on policy tokens; nothing else gets gradient.
        config: Supplies loss_type, epsilon_low/high, beta, kl_estimator, entropy_coef,
            max_completion_length.
        entropy: Per-token entropy ``(N, T)`` with grad, for ``config.entropy_coef > 0``.
        num_tokens, num_sequences, completion_length: Whole-batch normalisers when this is
            one micro-batch of several (default: this batch's own counts).

    Returns:
        ``(loss, metrics)``; metrics: loss, kl, clip_ratio/{low,high,region}_mean (means over
        this batch's policy tokens).
    """
    mask = action_mask.bool()  # (N, T)
    maskf = mask.to(logp.dtype)
    tokens_per_seq = maskf.sum(-1)  # (N,)
    logp, old_logp = logp.masked_fill(~mask, 0.0), old_logp.masked_fill(~mask, 0.0)
    log_ratio = logp - old_logp  # (N, T)
    if config.loss_type == "gspo":  # GSPO-token: value s_i, gradient s_i * grad(logp_t)
        seq_log_ratio = (log_ratio * maskf).sum(-1) / tokens_per_seq.clamp(min=1)  # (N,)
        log_ratio = seq_log_ratio.detach()[:, None] + logp - logp.detach()  # (N, T)
    ratio = torch.exp(log_ratio)  # (N, T)
    adv = advantages[:, None] if advantages.dim() == 1 else advantages  # (N, 1) or (N, T)
    adv = adv.to(logp.dtype)
    low, high = 1 - config.epsilon_low, 1 + config.epsilon_high
    if config.loss_type == "cispo":  # REINFORCE weighted by the clipped, detached ratio
        weight = torch.clamp(ratio, low, high).detach()  # (N, T)
        per_token_loss = -adv * weight * logp  # (N, T)
    else:
        pg_loss1 = -adv * ratio  # (N, T)
        pg_loss2 = -adv * torch.clamp(ratio, low, high)  # (N, T)
        per_token_loss = torch.maximum(pg_loss1, pg_loss2)  # (N, T)
    kl = torch.zeros_like(per_token_loss)
    if ref_logp is not None:
        kl = kl_estimate(logp, ref_logp.masked_fill(~mask, 0.0), config.kl_estimator)  # (N, T)
        per_token_loss = per_token_loss + config.beta * kl
    if entropy is not None and config.entropy_coef > 0:
        per_token_loss = per_token_loss - config.entropy_coef * entropy  # (N, T)
    masked_loss = per_token_loss * maskf  # (N, T)
    n_seq = num_sequences if num_sequences is not None else logp.shape[0]
    if config.loss_type in ("grpo", "gspo"):
        loss = (masked_loss.sum(-1) / tokens_per_seq.clamp(min=1)).sum() / n_seq
    elif config.loss_type in ("dapo", "cispo"):
        loss = masked_loss.sum() / (num_tokens or tokens_per_seq.sum().clamp(min=1))
    else:  # dr_grpo
        length = completion_length or config.max_completion_length or tokens_per_seq.max()
        loss = masked_loss.sum() / (n_seq * length)

    with torch.no_grad():
        n = maskf.sum().clamp(min=1)
        if config.loss_type == "cispo":  # the weight is clipped whatever the sign of A
            is_low, is_high = (ratio < low) & mask, (ratio > high) & mask
        else:  # the clip only binds where it lowers the objective
            is_low = (ratio < low) & (adv < 0) & mask
            is_high = (ratio > high) & (adv > 0) & mask
        metrics = {
            "loss": loss.item(),
            "kl": ((kl * maskf).sum() / n).item(),
            "clip_ratio/low_mean": (is_low.sum() / n).item(),
            "clip_ratio/high_mean": (is_high.sum() / n).item(),
            "clip_ratio/region_mean": ((is_low | is_high).sum() / n).item(),
        }
    return loss, metrics


def masked_nll(logp: torch.Tensor, action_mask: torch.Tensor, num_tokens: float) -> torch.Tensor:
    """``-sum(logp * mask) / num_tokens``; ``logp`` and ``action_mask`` are ``(N, T)``."""
    return -(logp * action_mask).sum() / num_tokens
