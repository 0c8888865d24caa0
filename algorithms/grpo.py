"""Group Relative Policy Optimization (GRPO) on tokenized multi-turn episodes.

One :meth:`GRPO.learn` call is one training step and reads as one pass::

    rewards (B, G) -> compute_advantages -> pack micro-batches (MicroBatch.from_episodes)
    -> per iteration: token_logprobs -> policy_loss -> backward (accumulate) -> clip -> step
    -> LR scheduler step -> metrics

Design decisions:

* **Old-policy log-probs** (the ratio's denominator) are recomputed by the trainer, never
  taken from the sampler: generate() uses other kernels, batch shapes and a KV cache, and with
  top-p/top-k samples from a truncated distribution, so its log-probs differ from a training
  forward of the same weights (TRL and verl recompute too). Iteration 0's forward runs under
  the pre-update weights, so its detached log-probs *are* the old policy's: with
  ``num_iterations == 1`` the ratio is exactly 1 and no extra pass is made; with more
  iterations they are cached per micro-batch and reused (the values a separate no-grad pass
  would give, for free). The sampler gap is logged as ``sampler/logprob_abs_diff_mean``.
* **Normalisation** uses whole-batch counts summed over micro-batches and processes, so
  gradient accumulation gives the gradient of one big batch. ``grpo``/``gspo``: mean over each
  sequence's policy tokens, then over sequences. ``dapo``: sum over policy tokens / their
  number. ``dr_grpo``: sum / (sequences * ``max_completion_length``; default: the batch's
  largest policy-token count).
* **Advantages**: reward (optionally clipped) minus a baseline: the group's mean (GRPO),
  its median, or the whole batch's mean (reduced over processes); ``mean_std`` divides by
  the population std (``correction=0``: the normalised group has unit std for any G) plus
  eps, the group's or, with the batch mean, the batch's. Under a group baseline a group
  whose rewards are all equal gets exactly zero advantages.
* **KL** (``beta > 0``): Schulman's k1 / k2 / k3 estimate per policy token, either in the
  loss (GRPO's) or subtracted from each sequence's reward, summed over its tokens, before
  advantages (verl's ``use_kl_in_reward``): that needs the policy's and the reference's
  log-probs before the update, one extra no-grad forward of each.
* **cispo** (MiniMax-M1): ``-sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * log pi`` per
  token, normalised per token like ``dapo``: clipping bounds a token's weight but, unlike
  PPO's clip, never removes its gradient.
* **Entropy bonus**: ``- entropy_coef * H`` per policy token, aggregated like the loss; H
  comes from the same checkpointed logits chunks as the log-probs, with its gradient.
* **Zero-variance groups** carry no policy gradient under a group baseline. With
  ``beta == 0`` they are dropped before the forward pass and from every normaliser (DAPO's
  dynamic-sampling filter without resampling): the update equals that of the batch without
  them. With ``beta > 0`` they stay, since the KL term still applies.
* **Reference policy** (``beta > 0`` only): the policy as training starts. With a fresh
  LoRA adapter (B = 0) that is the same model under ``disable_adapter()``; with an adapter
  passed in (a warm start) a frozen copy of it, a second adapter on the same base (as
  AgileRL's separate reference adapter), so the KL is 0 at step 0 and not the distance to
  the base; with full fine-tuning a frozen copy of the model. ``reference="base"`` keeps
  the adapter-disabled base instead.
* **LR schedule** counts ``learn()`` calls; every iteration of one call uses the same LR. The
  scheduler is not given to ``accelerator.prepare``, which would step it once per process.
"""

from __future__ import annotations

import contextlib
import copy
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Protocol

import torch
from accelerate import Accelerator
from peft import PeftModel, get_peft_model_state_dict, set_peft_model_state_dict

from agentenv.config import option
from agentenv.errors import InvalidOptionError
from agentenv.lm.precision import autocast
from agentenv.rollout.episode import collate
from algorithms.logprobs import forward_logprobs, token_logprobs
from algorithms.rewards import REWARD_COMBINATIONS, combine_rewards
from algorithms.trainer import Trainer, TrainerConfig

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "gspo", "cispo")
ADVANTAGE_NORMS = ("mean_std", "mean_only")
ADVANTAGE_BASELINES = ("group_mean", "group_median", "global_mean")
KL_ESTIMATORS = ("k1", "k2", "k3")
KL_PLACEMENTS = ("loss", "reward")
REFERENCES = ("initial", "base")
REFERENCE_ADAPTER = "reference"  # the frozen copy of a warm-started adapter
_CLIP_KEYS = ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


class SamplingLike(Protocol):
    """What :class:`GRPO` reads from the sampler's settings (``agentenv.SamplingConfig``)."""

    temperature: float  # the learner divides logits by it, as the sampler did


class EpisodeLike(Protocol):
    """What :meth:`GRPO.learn` reads from an episode (``agentenv.rollout.episode.Episode``)."""

    input_ids: list[int]  # the whole episode: prompt, policy and environment tokens
    action_mask: list[int]  # 1 exactly on tokens the policy sampled
    sampler_logprobs: list[float]  # the sampler's log-prob at mask-1 positions, 0.0 elsewhere
    reward: float
    # optional: ``info["reward_components"]`` ({name: float}) for reward_combination


@dataclass
class GRPOConfig(TrainerConfig):
    """Hyper-parameters of :class:`GRPO` (with :class:`~algorithms.trainer.TrainerConfig`'s
    optimisation and LoRA settings); validated across fields on construction."""

    learning_rate: float | None = option(
        None, "Peak AdamW LR. None: 5e-5 with LoRA (adapters want a larger LR), 1e-5 full FT."
    )
    micro_batch_tokens: int = option(
        768,
        "Tokens per forward/backward: sequences x padded length, a group's shared prompt "
        "counted once. On a CPU 768-1024 is as fast as any and keeps a step near 3 GB "
        "(larger batches only add memory); on a GPU raise it (e.g. 16384) for speed.",
    )
    beta: float = option(0.0, "KL coefficient to the reference; 0: no reference at all.")
    kl_estimator: str = option(
        "k3",
        "k1: log(pi/ref); k2: log(pi/ref)^2 / 2; k3: ref/pi - log(ref/pi) - 1 (unbiased, >= 0; "
        "Schulman's estimators, per policy token).",
    )
    reference: str = option(
        "initial",
        "The KL reference (beta > 0). initial: the policy as training starts; a warm-started "
        "adapter (e.g. --init-from an SFT run) gets a frozen copy of itself as a second "
        "adapter on the same base. base: the adapter-disabled base model, even after a "
        "warm start.",
    )
    kl_placement: str = option(
        "loss",
        "loss: beta * KL per token in the loss (GRPO's); reward: the sequence reward minus "
        "beta * its summed KL before advantages (verl's use_kl_in_reward; one extra "
        "no-grad forward of policy and reference per step).",
    )
    epsilon_low: float = option(0.2, "Ratio clip below, 1 - epsilon_low (gspo: 3e-4).")
    epsilon_high: float = option(
        0.2, "Ratio clip above, 1 + epsilon_high. DAPO clip-higher: 0.28; gspo: 4e-4."
    )
    loss_type: str = option(
        "dapo",
        "grpo | dr_grpo | dapo | gspo | cispo. dapo (TRL's default) normalises per token: every "
        "policy token weighs the same, so long multi-turn episodes are not down-weighted. "
        "cispo (MiniMax-M1): REINFORCE on every token weighted by its importance ratio "
        "clipped to [1 - epsilon_low, 1 + epsilon_high] with no gradient through the weight "
        "(no token is dropped; normalised per token like dapo).",
    )
    advantage_norm: str = option(
        "mean_std",
        "mean_std: (r - baseline) / (std + eps); mean_only: r - baseline (Dr. GRPO's). The std "
        "is the group's, or the batch's with advantage_baseline=global_mean.",
    )
    advantage_baseline: str = option(
        "group_mean",
        "group_mean (GRPO) | group_median (robust to an outlier reward) | global_mean (the "
        "whole batch's mean and std, over processes: all-correct groups still get a signal).",
    )
    reward_clip: float | None = option(
        None, "Clip rewards to [-reward_clip, reward_clip] before advantages; None: no clip."
    )
    reward_combination: str = option(
        "weighted",
        "How an env's named reward components (info['reward_components'], e.g. RAG's answer "
        "/ retrieval / format) become the reward: weighted (the env's own weighted sum) | "
        "uniform (their mean) | std (each divided by its batch std, summed) | pca (projection "
        "on the batch's first principal component, sign-aligned with the sum) | l2 (norm).",
    )
    entropy_coef: float = option(
        0.0,
        "Entropy bonus: the loss minus entropy_coef x the policy tokens' entropy, aggregated "
        "like the loss (computed from the same logits chunks; no second forward).",
    )
    num_iterations: int = option(1, "Optimizer steps per batch (mu); > 1 reuses it, clipped.")
    max_completion_length: int | None = option(
        None, "dr_grpo's per-sequence denominator; None: the batch's max policy tokens."
    )

    def __post_init__(self) -> None:
        if self.learning_rate is None:
            self.learning_rate = 5e-5 if self.use_lora else 1e-5
        super().__post_init__()
        choices = {
            "loss_type": LOSS_TYPES,
            "advantage_norm": ADVANTAGE_NORMS,
            "advantage_baseline": ADVANTAGE_BASELINES,
            "kl_estimator": KL_ESTIMATORS,
            "kl_placement": KL_PLACEMENTS,
            "reference": REFERENCES,
            "reward_combination": REWARD_COMBINATIONS,
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise InvalidOptionError(
                    f"{name} must be one of {allowed}, got {getattr(self, name)!r}"
                )
        checks = [
            (self.beta >= 0, "beta", "must be >= 0 (0 disables the KL term)"),
            (0 <= self.epsilon_low < 1, "epsilon_low", "must be in [0, 1)"),
            (self.epsilon_high >= 0, "epsilon_high", "must be >= 0"),
            (self.num_iterations >= 1, "num_iterations", "must be >= 1"),
            (self.entropy_coef >= 0, "entropy_coef", "must be >= 0 (0 disables the bonus)"),
            (
                self.reward_clip is None or self.reward_clip > 0,
                "reward_clip",
                "must be None or > 0",
            ),
            (
                self.max_completion_length is None or self.max_completion_length >= 1,
                "max_completion_length",
                "must be None or >= 1",
            ),
        ]
        for ok, name, rule in checks:
            if not ok:
                raise InvalidOptionError(f"{name} {rule}, got {getattr(self, name)!r}")


def compute_advantages(
    rewards: torch.Tensor,
    norm: str = "mean_std",
    eps: float = 1e-4,
    *,
    baseline: str = "group_mean",
    reward_clip: float | None = None,
    batch_mean_std: tuple[float, float] | None = None,
) -> torch.Tensor:
    """Advantages of rewards ``(B, G)``: one row per group; returns ``(B, G)``.

    Rewards are first clipped to ``[-reward_clip, reward_clip]`` (if given). The baseline is
    subtracted: the group's mean (``group_mean``) or median (``group_median``, the mean of
    the two middle values for even G), or the whole batch's mean (``global_mean``).
    ``mean_std`` then divides by the population std plus ``eps``: the group's for group
    baselines, the batch's for ``global_mean``. With a group baseline, rows whose rewards
    are all equal get exactly 0. ``batch_mean_std`` gives the batch's mean and std when the
    batch is spread over processes (default: those of ``rewards``).
    """
    if rewards.dim() != 2 or norm not in ADVANTAGE_NORMS or baseline not in ADVANTAGE_BASELINES:
        raise InvalidOptionError(
            f"expected rewards (B, G), norm in {ADVANTAGE_NORMS} and baseline in "
            f"{ADVANTAGE_BASELINES}, got shape {tuple(rewards.shape)}, norm={norm!r}, "
            f"baseline={baseline!r}"
        )
    if reward_clip is not None:
        rewards = rewards.clamp(-reward_clip, reward_clip)
    if baseline == "global_mean":
        if batch_mean_std is None:
            batch_mean_std = (rewards.mean().item(), rewards.std(correction=0).item())
        mean, std = batch_mean_std
        advantages = rewards - mean  # (B, G)
        if norm == "mean_std":
            advantages = advantages / (std + eps)
        return advantages
    if baseline == "group_median":
        base = rewards.quantile(0.5, dim=1, keepdim=True)  # (B, 1), interpolated
    else:
        base = rewards.mean(dim=1, keepdim=True)  # (B, 1)
    advantages = rewards - base  # (B, G)
    if norm == "mean_std":
        advantages = advantages / (rewards.std(dim=1, keepdim=True, correction=0) + eps)
    zero_std = (rewards == rewards[:, :1]).all(dim=1, keepdim=True)  # (B, 1)
    return advantages.masked_fill(zero_std, 0.0)


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
        advantages: One advantage per sequence ``(N,)``.
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
    adv = advantages[:, None].to(logp.dtype)  # (N, 1)
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


def _prompt_length(action_mask: Sequence[int]) -> int:
    """Tokens before the first policy token (the episode's prompt)."""
    return next((t for t, m in enumerate(action_mask) if m), len(action_mask))


class GRPO(Trainer):
    """GRPO trainer: ``GRPO(model, tokenizer, config, sampling=...).learn(groups) -> metrics``.

    Values a run owns elsewhere are arguments, not config fields, so that each has one
    owner: ``sampling`` is the sampler's own settings object (the learner reads its
    ``temperature`` at every step, so the two cannot disagree), ``total_steps`` the run's
    step count (the horizon of a decaying LR) and ``seed`` the run's seed (LoRA init).

    Model preparation, optimizer, schedule and checkpoints are
    :class:`~algorithms.trainer.Trainer`'s; ``step`` counts ``learn()`` calls.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        config: GRPOConfig | None = None,
        accelerator: Accelerator | None = None,
        *,
        sampling: SamplingLike | None = None,
        total_steps: int | None = None,
        seed: int = 0,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.sampling = sampling or SimpleNamespace(temperature=1.0)
        self.temperature  # noqa: B018 - validated before any work
        self.ref_model = None
        self.reference_adapter: str | None = None
        super().__init__(
            model,
            tokenizer,
            config or GRPOConfig(),
            accelerator,
            total_steps=total_steps,
            seed=seed,
            dtype=dtype,
        )
        self.config: GRPOConfig
        pad = tokenizer.pad_token_id
        self.pad_token_id = pad if pad is not None else (tokenizer.eos_token_id or 0)

    def _before_adapters(self, model: torch.nn.Module) -> None:
        """The KL reference, seen before training starts (see the module docstring)."""
        cfg = self.config
        if cfg.beta == 0:
            return
        if not cfg.use_lora:  # full fine-tuning: a frozen copy of the model as passed in
            self.ref_model = copy.deepcopy(model).requires_grad_(False).eval()
            self.ref_model.to(self.accelerator.device)
        elif isinstance(model, PeftModel) and cfg.reference == "initial":
            active = model.active_adapter  # a warm-started adapter: freeze a copy of it
            model.add_adapter(REFERENCE_ADAPTER, copy.deepcopy(model.peft_config[active]))
            weights = get_peft_model_state_dict(model, adapter_name=active)
            set_peft_model_state_dict(model, weights, adapter_name=REFERENCE_ADAPTER)
            model.set_adapter(active)  # peft: the active adapter trains, the copy is frozen
            self.reference_adapter = REFERENCE_ADAPTER

    @property
    def temperature(self) -> float:
        """The sampler's temperature, read from its settings at every call."""
        temperature = self.sampling.temperature
        if temperature <= 0:
            raise InvalidOptionError(
                f"GRPO learns from sampled episodes, got sampling temperature {temperature}; "
                "greedy decoding (0) has no log-probs to learn from: set temperature > 0"
            )
        return temperature

    def _flatten(self, groups: Sequence[Sequence[EpisodeLike]]) -> list[EpisodeLike]:
        episodes = [ep for group in groups for ep in group]
        sizes = sorted({len(group) for group in groups})
        if not episodes or len(sizes) != 1 or sizes[0] < 2:
            raise InvalidOptionError(
                f"expected groups of >= 2 episodes, all the same size, got group sizes {sizes}; "
                "pass one inner sequence of G episodes per task (G = the rollout's group_size)"
            )
        for ep in episodes:
            n = len(ep.input_ids)
            if (
                n < 2
                or len(ep.action_mask) != n
                or len(ep.sampler_logprobs) != n
                or ep.action_mask[0]
            ):
                raise InvalidOptionError(
                    f"expected an episode with >= 2 tokens, equally long input_ids, "
                    f"action_mask and sampler_logprobs and action_mask[0] == 0, got lengths "
                    f"{n}/{len(ep.action_mask)}/{len(ep.sampler_logprobs)}; build it with "
                    "agentenv.rollout.episode"
                )
        return episodes

    def _reference_logprobs(self, mb: MicroBatch) -> torch.Tensor | None:
        if self.config.beta == 0:
            return None
        with torch.no_grad(), autocast(self.accelerator.device, self.dtype):
            if self.ref_model is not None:
                return token_logprobs(
                    self.ref_model,
                    mb.input_ids,
                    mb.attention_mask,
                    self.temperature,
                    action_mask=mb.action_mask,
                )
            policy = self.unwrapped_model
            with self._reference_weights(policy):
                return token_logprobs(
                    policy,
                    mb.input_ids,
                    mb.attention_mask,
                    self.temperature,
                    action_mask=mb.action_mask,
                )

    @contextlib.contextmanager
    def _reference_weights(self, policy: torch.nn.Module) -> Any:
        """The LoRA policy as its reference: the frozen reference adapter, else no adapter."""
        if self.reference_adapter is None:
            with policy.disable_adapter():
                yield
            return
        active = policy.active_adapter
        policy.set_adapter(self.reference_adapter)  # peft: only the active one is trainable
        try:
            yield
        finally:
            policy.set_adapter(active)  # the trained adapter active and trainable again

    def _global(self, values: list[float], reduction: str) -> list[float]:
        tensor = torch.tensor([float(v) for v in values], dtype=torch.float64)
        tensor = tensor.to(self.accelerator.device)
        return self.accelerator.reduce(tensor, reduction=reduction).tolist()

    def learn(self, groups: Sequence[Sequence[EpisodeLike]]) -> dict[str, float]:
        """One GRPO step on ``groups`` (one inner sequence of ``group_size`` episodes per task).

        Returns:
            Metrics averaged over the batch (and processes), slash-separated like TRL's.
        """
        start, cfg = time.perf_counter(), self.config
        episodes = self._flatten(groups)
        g = len(groups[0])
        env_rewards = torch.tensor([[float(ep.reward) for ep in group] for group in groups])
        rewards, component_stats = self._rewards(episodes, env_rewards)  # (B, G)
        group_baseline = cfg.advantage_baseline != "global_mean"
        zero_std = (rewards == rewards[:, :1]).all(dim=1)  # (B,)
        keep = [  # zero-variance groups carry no gradient under a group baseline
            i
            for i in range(len(episodes))
            if cfg.beta > 0 or not group_baseline or not zero_std[i // g]
        ]
        batches, totals, rows = self._micro_batches(episodes, keep, g)
        kl_stats: dict[str, float] = {}
        if cfg.beta > 0 and cfg.kl_placement == "reward":
            penalty, kl_stats = self._kl_penalty(batches, rows, len(episodes))
            rewards_for_advantages = rewards - cfg.beta * penalty.view_as(rewards)  # (B, G)
        else:
            rewards_for_advantages = rewards
        advantages = self._advantages(rewards_for_advantages)  # (B, G)
        flat = advantages.flatten()
        for mb, idx in zip(batches, rows, strict=True):
            if idx:  # a padding micro-batch keeps its zero advantage
                mb.advantages = flat[idx].to(mb.advantages)  # (N,)
        lr = self.scheduler.get_last_lr()[0]
        sums = self._optimize(batches, totals) if totals["num_tokens"] > 0 else {}
        with warnings.catch_warnings():  # no optimizer step when every group had zero std
            warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*")
            self.scheduler.step()
        self.step += 1

        tokens, iters = max(sums.get("tokens", 0.0), 1.0), cfg.num_iterations
        metrics = {key: sums.get(key, 0.0) / (tokens * iters) for key in _CLIP_KEYS}
        metrics["loss"] = sums.get("loss", 0.0) / iters
        metrics["entropy"] = sums.get("entropy", 0.0) / tokens
        if cfg.kl_placement == "reward":  # the loss has no KL term; the pre-pass measured it
            metrics["kl"] = kl_stats.get("kl", 0.0)
        metrics["sampler/logprob_abs_diff_mean"] = sums.get("sampler_diff", 0.0) / tokens
        metrics["grad_norm"] = sums.get("grad_norm", 0.0) / iters
        metrics.update(self._batch_stats(rewards, advantages, zero_std, episodes))
        metrics.update(kl_stats)
        metrics.update(component_stats)
        metrics["tokens_per_second"] = sums.get("processed", 0.0) / (time.perf_counter() - start)
        metrics["learning_rate"] = lr
        metrics["step"] = float(self.step)
        return metrics

    def _batch_stats(
        self,
        rewards: torch.Tensor,
        advantages: torch.Tensor,
        zero_std: torch.Tensor,
        episodes: list[EpisodeLike],
    ) -> dict[str, float]:
        """Reward/advantage statistics over the whole batch (all processes, any split)."""
        r, a = rewards.double(), advantages.double()  # (B, G)
        policy_tokens = sum(sum(ep.action_mask) for ep in episodes)
        all_tokens = sum(len(ep.input_ids) for ep in episodes)
        s = self._global(
            [
                r.sum(),
                r.square().sum(),
                a.sum(),
                a.square().sum(),
                r.numel(),
                zero_std.sum(),
                zero_std.numel(),
                policy_tokens,
                all_tokens,
            ],
            "sum",
        )
        n = s[4]
        return {
            "rewards/mean": s[0] / n,
            "rewards/std": max(s[1] / n - (s[0] / n) ** 2, 0.0) ** 0.5,
            "advantages/mean": s[2] / n,
            "advantages/std": max(s[3] / n - (s[2] / n) ** 2, 0.0) ** 0.5,
            "frac_reward_zero_std": s[5] / s[6],
            "trainable_ratio": s[7] / s[8],
            "num_sequences": n,
        }

    def _micro_batches(
        self, episodes: list[EpisodeLike], keep: list[int], g: int
    ) -> tuple[list[MicroBatch], dict[str, float], list[list[int]]]:
        """Pack the kept episodes by token budget; whole-batch normalisers over processes.

        Returns the micro-batches (advantages still 0), the normalisers, and each
        micro-batch's episode indices (empty for a padding micro-batch).
        """
        cfg, device = self.config, self.accelerator.device
        policy_counts = [sum(episodes[i].action_mask) for i in keep]
        num_tokens, num_sequences = self._global([sum(policy_counts), len(keep)], "sum")
        length = (
            cfg.max_completion_length or self._global([max(policy_counts, default=0)], "max")[0]
        )
        prompts = [  # a group's episodes share their prompt: pack them together
            (i // g, _prompt_length(episodes[i].action_mask)) for i in keep
        ]
        packs = pack_micro_batches(
            [len(episodes[i].input_ids) for i in keep], cfg.micro_batch_tokens, prompts
        )
        rows = [[keep[j] for j in pack] for pack in packs]
        batches = [
            MicroBatch.from_episodes(
                [episodes[i] for i in idx], [0.0] * len(idx), self.pad_token_id, device
            )
            for idx in rows
        ]
        num_batches = int(self._global([len(batches)], "max")[0])
        if num_batches > len(batches):  # same number of backward calls on every process
            pad = SimpleNamespace(
                input_ids=[self.pad_token_id] * 2,
                action_mask=[0, 0],
                sampler_logprobs=[0.0, 0.0],
                reward=0.0,
            )
            missing = num_batches - len(batches)
            batches += [MicroBatch.from_episodes([pad], [0.0], self.pad_token_id, device)] * missing
            rows += [[]] * missing
        totals = {
            "num_tokens": num_tokens,
            "num_sequences": num_sequences,
            "completion_length": length,
        }
        return batches, totals, rows

    def _rewards(
        self, episodes: list[EpisodeLike], env_rewards: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The rewards advantages start from ``(B, G)``, and each component's batch mean.

        ``weighted`` keeps the env's rewards; other combinations combine the episodes'
        ``info["reward_components"]`` over the global batch (missing components count 0;
        an env that reports none has one component, its reward).
        """
        from accelerate.utils import gather_object

        method = self.config.reward_combination
        found = [getattr(ep, "info", {}).get("reward_components") or {} for ep in episodes]
        names = sorted({n for names in gather_object([sorted(c) for c in found]) for n in names})
        if not names:
            if method == "weighted":
                return env_rewards, {}
            names, found = ["reward"], [{"reward": float(ep.reward)} for ep in episodes]
        x = torch.tensor([[float(c.get(n, 0.0)) for n in names] for c in found])  # (N, K)
        x = x.double()
        k = len(names)
        sums = self._global([*x.sum(0).tolist(), *(x.T @ x).flatten().tolist(), len(x)], "sum")
        n = sums[-1]
        mean = torch.tensor(sums[:k], dtype=torch.float64) / n  # (K,)
        cov = torch.tensor(sums[k:-1], dtype=torch.float64).view(k, k) / n - torch.outer(mean, mean)
        stats = {
            f"rewards/components/{name}": m for name, m in zip(names, mean.tolist(), strict=True)
        }
        if method == "weighted":
            return env_rewards, stats
        combined = combine_rewards(x, method, mean=mean, cov=cov)  # (N,)
        return combined.float().view_as(env_rewards), stats

    def _advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        """``compute_advantages`` with this config; global_mean's stats over every process."""
        cfg = self.config
        if cfg.reward_clip is not None:  # clipped once, for the batch stats and the rest
            rewards = rewards.clamp(-cfg.reward_clip, cfg.reward_clip)
        batch_mean_std = None
        if cfg.advantage_baseline == "global_mean":
            r = rewards.double()
            total, squares, n = self._global([r.sum(), r.square().sum(), r.numel()], "sum")
            mean = total / n
            batch_mean_std = (mean, max(squares / n - mean**2, 0.0) ** 0.5)
        return compute_advantages(
            rewards,
            cfg.advantage_norm,
            baseline=cfg.advantage_baseline,
            batch_mean_std=batch_mean_std,
        )

    def _kl_penalty(
        self, batches: list[MicroBatch], rows: list[list[int]], num_episodes: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Each episode's KL to the reference, summed over its policy tokens: ``(B*G,)``.

        One no-grad forward of the policy (its pre-update weights) and of the reference per
        micro-batch, before advantages (``kl_placement="reward"``).
        """
        penalty = torch.zeros(num_episodes, dtype=torch.float64)
        kl_sum = tokens = 0.0
        for mb, idx in zip(batches, rows, strict=True):
            with torch.no_grad(), autocast(self.accelerator.device, self.dtype):
                logp = token_logprobs(
                    self.model,
                    mb.input_ids,
                    mb.attention_mask,
                    self.temperature,
                    action_mask=mb.action_mask,
                )
            ref = self._reference_logprobs(mb)
            assert ref is not None  # beta > 0
            maskf = mb.action_mask.float()  # (N, T)
            kl = kl_estimate(logp.float(), ref.float(), self.config.kl_estimator) * maskf
            if idx:
                penalty[idx] = kl.sum(-1).double().cpu()[: len(idx)]
            kl_sum += kl.sum().item()
            tokens += maskf.sum().item()
        kl_sum, tokens, pen_sum, n = self._global(
            [kl_sum, tokens, penalty.sum().item(), num_episodes], "sum"
        )
        stats = {"kl": kl_sum / max(tokens, 1.0), "rewards/kl_penalty_mean": pen_sum / n}
        return penalty.float(), stats

    def _optimize(self, batches: list[MicroBatch], totals: dict[str, float]) -> dict[str, float]:
        """Run ``num_iterations`` accumulated optimizer steps; return global metric sums."""
        cfg, acc = self.config, self.accelerator
        old_logps: list[torch.Tensor] = []
        ref_logps: list[torch.Tensor | None] = []
        keys = ["loss", *_CLIP_KEYS, "entropy", "sampler_diff", "tokens", "processed"]
        local = dict.fromkeys(keys, 0.0)
        grad_norm = 0.0
        bonus = cfg.entropy_coef > 0  # the entropy joins the loss: it needs its gradient
        was_training = self.model.training
        self.model.train()
        for iteration in range(cfg.num_iterations):
            self.optimizer.zero_grad(set_to_none=True)
            for j, mb in enumerate(batches):
                last = j == len(batches) - 1
                with contextlib.nullcontext() if last else acc.no_sync(self.model):
                    with autocast(acc.device, self.dtype):
                        logp, entropy = forward_logprobs(
                            self.model,
                            mb.input_ids,
                            mb.attention_mask,
                            self.temperature,
                            action_mask=mb.action_mask,
                            with_entropy=iteration == 0 or bonus,
                            entropy_grad=bonus,
                        )
                    maskf = mb.action_mask.float()  # (N, T)
                    if iteration == 0:  # pre-update weights: this *is* the old policy
                        old_logps.append(logp.detach())
                        in_loss = cfg.kl_placement == "loss"
                        ref_logps.append(self._reference_logprobs(mb) if in_loss else None)
                        local["entropy"] += (entropy.detach() * maskf).sum().item()
                        diff = (logp.detach() - mb.sampler_logprobs).abs()  # (N, T)
                        local["sampler_diff"] += (diff * maskf).sum().item()
                        local["tokens"] += maskf.sum().item()
                    loss, m = policy_loss(
                        logp,
                        old_logps[j],
                        mb.advantages,
                        mb.action_mask,
                        cfg,
                        ref_logps[j],
                        entropy=entropy if bonus else None,
                        **totals,
                    )
                    acc.backward(loss * acc.num_processes)  # DDP averages; we want the sum
                n = maskf.sum().item()
                local["loss"] += m["loss"]
                local["processed"] += mb.attention_mask.sum().item()
                for key in _CLIP_KEYS:
                    local[key] += m[key] * n
            grad_norm += float(acc.clip_grad_norm_(self._params, cfg.max_grad_norm))
            self.optimizer.step()
        self.model.train(was_training)
        result = dict(zip(keys, self._global(list(local.values()), "sum"), strict=True))
        result["grad_norm"] = grad_norm
        return result
