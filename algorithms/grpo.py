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
* **Credit** (``credit``): ``bandit`` (the default) gives every policy token of an
  episode its one advantage. ``turn`` adds to a turn's tokens ``turn_weight`` times its
  return of the env's per-turn rewards (``Episode.turn_rewards``, from that turn on,
  discounted by ``turn_gamma``) less one baseline per group, normalised by the std of
  those returns (:func:`~algorithms.losses.turn_advantages`), or with ``turn_baseline=
  "loo"`` less the mean of the *other* episodes' returns, undivided (RLOO's leave-one-out).
  A group whose outcomes are all equal but whose turn returns differ still teaches under
  ``turn``. ``bandit`` with a ``turn_weight`` adds the weighted per-turn rewards to each
  episode's reward instead (the shaping without the turn credit,
  :func:`~algorithms.losses.shaped_rewards`), so the two can be measured apart.
  ``turn_rewards_when="terminated"`` counts an episode's per-turn rewards only if its env
  ended it (``stop_reason == "terminated"``): one cut at ``max_turns`` that gathered facts
  without answering then earns nothing from them (under any credit).
  ``gae`` asks a critic (:mod:`algorithms.critic`, a value head on the policy's hidden
  state before each turn, from one extra no-grad forward, or with
  ``critic_input="sampler"`` the states the sampler recorded) for each turn's value and gives
  the turn's tokens its GAE advantage over turns (:func:`~algorithms.losses.gae_advantages`:
  per-turn rewards weighted by ``turn_weight``, the outcome at the last turn, whitened
  over the batch's turns); the critic then fits the turns' lambda-returns. Its advantages are not
  group-relative, so no group is dropped for equal outcomes. One process only.
* **Entropy bonus**: ``- entropy_coef * H`` per policy token, aggregated like the loss; H
  comes from the same checkpointed logits chunks as the log-probs, with its gradient.
* **Zero-variance groups** carry no policy gradient under a group baseline. With
  ``beta == 0`` they are dropped before the forward pass and from every normaliser (DAPO's
  dynamic-sampling filter without resampling): the update equals that of the batch without
  them. With ``beta > 0`` they stay, since the KL term still applies.
  :meth:`GRPO.group_signal` makes the same decision before a step, for the training loop's
  dynamic sampling (``dynamic_sampling``: draw more tasks in place of those groups).
* **A zero gradient** (every advantage of the step 0 on every process, no KL term in the
  loss, no entropy bonus: ``gae`` before any episode earns a reward, a batch-mean baseline
  over equal rewards) skips the forward and backward passes; the optimizer still steps on
  zero gradients, so its moments and weight decay move the weights as the passes would.
* **Failed episodes** (``episode.failed``: the env raised, or the episode ran past its
  wall-clock limit) carry no learning signal: they are dropped like zero-variance groups,
  and their group's baseline and std come from its other members (a group left with fewer
  than 2 gets none). A flaky tool then neither rewards nor punishes the policy.
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
from typing import Any, Protocol

import torch
from accelerate import Accelerator
from peft import PeftModel, get_peft_model_state_dict, set_peft_model_state_dict

from agentenv.errors import InvalidOptionError
from agentenv.lm.precision import autocast
from agentenv.rollout.episode import mask_spans
from algorithms.batching import (
    EpisodeLike,
    MicroBatch,
    pack_prefix_trees,
    padding_micro_batch,
    token_advantages,
)
from algorithms.config import (
    GRPO_MICRO_BATCH_TOKENS,
    REFERENCE_ADAPTER,
    GRPOConfig,
)
from algorithms.critic import Critic
from algorithms.logprobs import forward_logprobs, hidden_before, plain_head_width, token_logprobs
from algorithms.lora import quiet_peft
from algorithms.losses import (
    compute_advantages,
    gae_advantages,
    kl_estimate,
    policy_loss,
    shaped_rewards,
    turn_advantages,
    turn_return_spread,
    without_signal,
)
from algorithms.rewards import episode_rewards
from algorithms.trainer import Trainer


def _turns(episode: EpisodeLike) -> tuple[list[tuple[int, int]], list[float]]:
    """An episode's policy turns: their token spans and per-turn rewards (``Episode``'s
    ``turn_spans`` and ``turn_rewards``; for an episode without them, the runs of its
    action mask and zeros)."""
    spans = getattr(episode, "turn_spans", None)
    if spans is None:
        spans = mask_spans(episode.action_mask)
    rewards = getattr(episode, "turn_rewards", None)
    return list(spans), list(rewards) if rewards is not None else [0.0] * len(spans)


def _failed(episode: EpisodeLike) -> bool:
    """Whether an episode ended by a failure (``Episode.failed``: its env raised, or it ran
    past its wall-clock limit); an episode without the attribute did not."""
    return bool(getattr(episode, "failed", False))


def _recorded_states(
    episodes: Sequence[EpisodeLike], idx: list[int], counts: list[int]
) -> torch.Tensor | None:
    """The sampler's states before each turn of episodes ``idx`` (``Episode.turn_hidden``,
    ``counts[r]`` of them each), stacked ``(M, H)`` float32; None if any episode has none."""
    states: list[torch.Tensor] = []
    for i, count in zip(idx, counts, strict=True):
        recorded = getattr(episodes[i], "turn_hidden", None)
        if recorded is None or len(recorded) != count:
            return None
        states += recorded
    return torch.stack(states).float() if states else None


_CLIP_KEYS = ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


class SamplingLike(Protocol):
    """What :class:`GRPO` reads from the sampler's settings (``agentenv.SamplingConfig``)."""

    temperature: float  # the learner divides logits by it, as the sampler did

    # optional: ``info["reward_components"]`` ({name: float}) for reward_combination


class GRPO(Trainer):
    """GRPO trainer: ``GRPO(model, tokenizer, config, sampling=...).learn(groups) -> metrics``.

    Values a run owns elsewhere are arguments, not config fields, so that each has one
    owner: ``sampling`` (required) is the sampler's own settings object (the learner reads
    its ``temperature`` at every step, so the two cannot disagree), ``total_steps`` the
    run's step count (the horizon of a decaying LR) and ``seed`` the run's seed (LoRA init).

    ``last_advantages`` holds the ``(B, G)`` advantages the last :meth:`learn` trained on
    (after reward combination, clipping, KL-in-reward and the baseline; 0 for a group
    dropped for zero variance): the training loop logs these, never a recomputation.
    With ``credit="turn"`` or ``"gae"`` ``last_turn_advantages`` holds each episode's
    per-turn advantages (the ones its turns' tokens trained with); with ``"gae"``
    ``critic`` is the value head (:class:`~algorithms.critic.Critic`, in checkpoints).

    Model preparation, optimizer, schedule and checkpoints are
    :class:`~algorithms.trainer.Trainer`'s; ``step`` counts ``learn()`` calls.
    """

    micro_batch_defaults = GRPO_MICRO_BATCH_TOKENS

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        config: GRPOConfig | None = None,
        accelerator: Accelerator | None = None,
        *,
        sampling: SamplingLike,
        total_steps: int | None = None,
        seed: int = 0,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.sampling = sampling
        self.temperature  # noqa: B018 - validated before any work
        self.last_advantages: torch.Tensor | None = None  # (B, G) of the last learn()
        # credit="turn": each episode's per-turn advantages (flat over groups), else None
        self.last_turn_advantages: list[list[float]] | None = None
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
        self.critic: Critic | None = None
        if self.config.credit == "gae":
            width = plain_head_width(self.model)
            if width is None or self.accelerator.num_processes > 1:
                raise InvalidOptionError(
                    "credit='gae' reads the hidden state under a plain linear LM head, on one "
                    f"process; got {self.accelerator.num_processes} process(es) and "
                    f"{'a' if width else 'no'} plain head: use credit='turn' (no critic), "
                    "or train on one process a model whose head is not adapted"
                )
            self.critic = Critic(
                width, self.config.value_lr, self.config.max_grad_norm, self.accelerator.device
            )

    def extra_state(self) -> dict[str, Any]:
        critic = {"critic": self.critic.state_dict()} if self.critic is not None else {}
        return {**super().extra_state(), **critic}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        super().load_extra_state(state)
        if self.critic is not None:
            self.critic.load_state_dict(state["critic"])

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
            with quiet_peft():
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
            if _failed(ep):  # left out of the update; may hold no tokens (a failed reset)
                continue
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

    def learn(self, groups: Sequence[Sequence[EpisodeLike]]) -> dict[str, float]:
        """One GRPO step on ``groups`` (one inner sequence of ``group_size`` episodes per task).

        Returns:
            Metrics averaged over the batch (and processes), slash-separated like TRL's.
        """
        start, cfg = time.perf_counter(), self.config
        episodes = self._flatten(groups)
        g = len(groups[0])
        rewards, component_stats, turn_rewards, shaped, valid = self._rewards(
            groups, episodes, lambda v: self._global(v, "sum")
        )
        group_baseline = cfg.advantage_baseline != "global_mean"
        zero_std = without_signal(rewards, valid)  # (B,) over the valid members
        no_signal = self._no_signal(shaped, turn_rewards, valid)  # (B,)
        # failed episodes teach nothing; groups without a signal under a group baseline
        # neither (the critic's advantages under gae are not relative to the group)
        drop = no_signal if group_baseline and cfg.credit != "gae" else torch.zeros_like(no_signal)
        keep = [
            i
            for i in range(len(episodes))
            if valid.view(-1)[i] and (cfg.beta > 0 or not drop[i // g])
        ]
        batches, totals, rows = self._micro_batches(episodes, keep)
        kl_stats: dict[str, float] = {}
        if cfg.beta > 0 and cfg.kl_placement == "reward":
            penalty, kl_stats = self._kl_penalty(batches, rows, len(episodes))
            rewards_for_advantages = shaped - cfg.beta * penalty.view_as(rewards)  # (B, G)
        else:
            rewards_for_advantages = shaped
        advantages = self._advantages(rewards_for_advantages, valid)  # (B, G)
        self.last_advantages = advantages  # what the loss sees; 0 for dropped episodes
        self.last_turn_advantages = None
        flat = advantages.flatten()
        if cfg.credit == "turn":  # one advantage per turn, on that turn's tokens
            per_turn = turn_advantages(
                advantages, turn_rewards, valid, cfg.turn_reward_weight, cfg.turn_gamma,
                cfg.advantage_norm, baseline=cfg.turn_baseline,
            )  # fmt: skip
            self.last_turn_advantages = [a for group in per_turn for a in group]
        critic_stats: dict[str, float] = {}
        if cfg.credit == "gae":  # the critic's values before each turn, then its fit
            t_critic = time.perf_counter()
            per_turn, critic_stats = self._critic_advantages(
                batches, rows, episodes, turn_rewards, rewards_for_advantages, valid
            )
            self.last_turn_advantages = [a for group in per_turn for a in group]
            critic_stats["time/critic_s"] = time.perf_counter() - t_critic
        for mb, idx in zip(batches, rows, strict=True):
            if not idx:  # a padding micro-batch keeps its zero advantage
                continue
            if self.last_turn_advantages is None:
                mb.advantages = flat[idx].to(mb.advantages)  # (N,)
            else:
                mb.advantages = token_advantages(
                    [_turns(episodes[i])[0] for i in idx],
                    [self.last_turn_advantages[i] for i in idx],
                    mb.input_ids.shape[1],
                ).to(mb.sampler_logprobs)  # (N, T)
        lr = self.scheduler.get_last_lr()[0]
        if totals["num_tokens"] == 0:  # every group dropped: no optimizer step
            sums = {}
        elif self._zero_gradient(batches):  # the step the passes would take, without them
            sums = self._zero_step()
        else:
            sums = self._optimize(batches, totals)
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
        trained = advantages.flatten()  # (B*G,): one per episode, or one per turn (turn, gae)
        if self.last_turn_advantages is not None:
            trained = torch.tensor([a for turns in self.last_turn_advantages for a in turns])
        metrics.update(self._batch_stats(rewards, trained, zero_std, no_signal, valid, episodes))
        metrics.update(kl_stats)
        metrics.update(component_stats)
        metrics.update(critic_stats)
        metrics["tokens_per_second"] = sums.get("processed", 0.0) / (time.perf_counter() - start)
        metrics["learning_rate"] = lr
        metrics["step"] = float(self.step)
        return metrics

    @property
    def _shaping_weight(self) -> float:
        """The weight of the per-turn rewards in a bandit episode's reward (0 otherwise:
        turn and gae credit them per turn)."""
        return self.config.turn_reward_weight if self.config.credit == "bandit" else 0.0

    def _rewards(
        self,
        groups: Sequence[Sequence[EpisodeLike]],
        episodes: list[EpisodeLike],
        global_sum: Any,
        gather: Any = None,
    ) -> tuple[torch.Tensor, dict[str, float], list, torch.Tensor, torch.Tensor]:
        """What advantages and the signal decision start from: the rewards ``(B, G)``
        after ``reward_combination`` and its stats, the per-turn rewards ``[b][g][k]``, the
        rewards with bandit shaping (the outcome plus ``turn_weight`` x the per-turn
        rewards; the rewards themselves otherwise) and the valid (not failed) episodes."""
        env_rewards = torch.tensor([[float(ep.reward) for ep in group] for group in groups])
        rewards, stats = episode_rewards(
            episodes, env_rewards, self.config.reward_combination, global_sum, gather
        )
        turn_rewards = [[self._turn_rewards(ep) for ep in group] for group in groups]
        shaped = shaped_rewards(rewards, turn_rewards, self._shaping_weight, self.config.turn_gamma)
        valid = ~torch.tensor([[_failed(ep) for ep in group] for group in groups])
        return rewards, stats, turn_rewards, shaped, valid

    def _turn_rewards(self, episode: EpisodeLike) -> list[float]:
        """An episode's per-turn rewards as they count: all 0 under ``turn_rewards_when=
        "terminated"`` when the env did not end it (no ``stop_reason``: it did)."""
        rewards = _turns(episode)[1]
        cut = getattr(episode, "stop_reason", "") not in ("", "terminated")
        if self.config.turn_rewards_when == "terminated" and cut:
            return [0.0] * len(rewards)
        return rewards

    def _no_signal(
        self,
        shaped: torch.Tensor,
        turn_rewards: list[list[list[float]]],
        valid: torch.Tensor,
    ) -> torch.Tensor:
        """``(B,)`` bool: groups whose valid members' rewards (with bandit shaping) are all
        equal and, under turn or gae credit with a turn weight, so are their per-turn
        returns (with the turn baselines of a group of 2+: a return that differs from the
        next turn's is a signal); or that have fewer than 2 valid members (turn and gae
        still credit a lone member's turns against each other, but loo has no baseline)."""
        cfg = self.config
        none = without_signal(shaped, valid)
        if cfg.credit != "bandit" and cfg.turn_reward_weight > 0:
            spread = turn_return_spread(turn_rewards, valid, cfg.turn_gamma)
            if cfg.credit == "turn" and cfg.turn_baseline == "loo":  # needs another member
                spread &= valid.sum(dim=1) >= 2
            none = none & ~spread
        return none

    def group_signal(self, groups: Sequence[Sequence[EpisodeLike]]) -> list[bool]:
        """Whether each group has a learning signal: its valid episodes' rewards differ
        (with ``bandit`` and a turn weight, the shaped rewards; with ``turn`` or ``gae``
        and a turn weight, their per-turn returns may differ instead). The groups without
        one are those :meth:`learn` drops under a group baseline with ``beta == 0``
        (``gae`` trains them on its critic's values alone), that ``frac_no_signal``
        counts and that dynamic sampling draws again for.

        This process's groups only, with no collective: ``reward_combination`` std / pca
        then scale by this process's episodes, which keeps equal rewards equal."""
        _, _, turn_rewards, shaped, valid = self._rewards(groups, self._flatten(groups), list, list)
        return (~self._no_signal(shaped, turn_rewards, valid)).tolist()

    def _batch_stats(
        self,
        rewards: torch.Tensor,
        advantages: torch.Tensor,
        zero_std: torch.Tensor,
        no_signal: torch.Tensor,
        valid: torch.Tensor,
        episodes: list[EpisodeLike],
    ) -> dict[str, float]:
        """Reward/advantage statistics over the whole batch (all processes, any split).

        ``advantages`` are the values the loss used: ``(B*G,)`` one per episode, or with
        ``credit`` turn or gae one per policy turn (0 for dropped and failed episodes).
        ``frac_reward_zero_std``: the groups whose valid members' rewards are all equal;
        ``frac_no_signal``: those with no learning signal under the run's credit (with
        ``turn`` or ``gae``, also equal per-turn returns; with ``bandit`` the same)."""
        r, a = rewards.double(), advantages.double()  # (B, G) and (A,)
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
                (~valid).sum(),
                no_signal.sum(),
                a.numel(),
            ],
            "sum",
        )
        n, m = s[4], max(s[11], 1)  # episodes; advantages
        return {
            "rewards/mean": s[0] / n,
            "rewards/std": max(s[1] / n - (s[0] / n) ** 2, 0.0) ** 0.5,
            "advantages/mean": s[2] / m,
            "advantages/std": max(s[3] / m - (s[2] / m) ** 2, 0.0) ** 0.5,
            "frac_reward_zero_std": s[5] / s[6],
            "frac_no_signal": s[10] / s[6],
            "trainable_ratio": s[7] / s[8],
            "frac_failed": s[9] / n,
            "num_sequences": n,
        }

    def _micro_batches(
        self, episodes: list[EpisodeLike], keep: list[int]
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
        packs = pack_prefix_trees(  # as the forward runs them: shared prefixes once
            [list(zip(episodes[i].input_ids, episodes[i].action_mask, strict=True)) for i in keep],
            self.micro_batch_tokens,
        )
        rows = [[keep[j] for j in pack] for pack in packs]
        batches = [
            MicroBatch.from_episodes(
                [episodes[i] for i in idx], [0.0] * len(idx), self.pad_token_id, device
            )
            for idx in rows
        ]
        num_batches = int(self._global([len(batches)], "max")[0])
        missing = num_batches - len(batches)  # same number of backward calls on every process
        batches += [padding_micro_batch(self.pad_token_id, device)] * missing
        rows += [[]] * missing
        totals = {
            "num_tokens": num_tokens,
            "num_sequences": num_sequences,
            "completion_length": length,
        }
        return batches, totals, rows

    def _advantages(self, rewards: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """``compute_advantages`` with this config; global_mean's stats over every process
        (valid episodes only)."""
        cfg = self.config
        if cfg.reward_clip is not None:  # clipped once, for the batch stats and the rest
            rewards = rewards.clamp(-cfg.reward_clip, cfg.reward_clip)
        batch_mean_std = None
        if cfg.advantage_baseline == "global_mean":
            r = rewards.double()[valid]
            total, squares, n = self._global([r.sum(), r.square().sum(), r.numel()], "sum")
            mean = total / n if n else 0.0
            batch_mean_std = (mean, max(squares / n - mean**2, 0.0) ** 0.5 if n else 0.0)
        return compute_advantages(
            rewards,
            cfg.advantage_norm,
            baseline=cfg.advantage_baseline,
            batch_mean_std=batch_mean_std,
            valid=valid,
        )

    def _critic_advantages(
        self,
        batches: list[MicroBatch],
        rows: list[list[int]],
        episodes: list[EpisodeLike],
        turn_rewards: list[list[list[float]]],
        rewards: torch.Tensor,
        valid: torch.Tensor,
    ) -> tuple[list[list[list[float]]], dict[str, float]]:
        """``credit="gae"``: each turn's advantage ``[b][g][k]`` from the critic's values
        of the hidden states before the turns, then the critic's fit to the turns'
        lambda-returns. The states: with ``critic_input="learner"`` one no-grad forward per
        micro-batch under the pre-update weights; with ``"sampler"`` the episodes' own
        ``turn_hidden`` (a micro-batch with an episode that has none runs the forward)."""
        cfg, critic = self.config, self.critic
        assert critic is not None
        hidden: dict[int, torch.Tensor] = {}  # episode -> (K, H), before each of its turns
        from_sampler = 0  # episodes whose states the sampler recorded
        for mb, idx in zip(batches, rows, strict=True):
            if not idx:
                continue
            spans = [_turns(episodes[i])[0] for i in idx]
            counts = [len(s) for s in spans]
            recorded = (  # stacked only when read: the learner default skips the copy
                _recorded_states(episodes, idx, counts) if cfg.critic_input == "sampler" else None
            )
            if recorded is not None:
                h = recorded  # (M, H), episode by episode, turn by turn
                from_sampler += len(idx)
            else:
                starts = torch.zeros(mb.input_ids.shape, dtype=torch.bool)  # (N, T)
                for r, row_spans in enumerate(spans):
                    for start, _ in row_spans:
                        starts[r, start] = True
                with torch.no_grad(), autocast(self.accelerator.device, self.dtype):
                    h = hidden_before(
                        self.model, mb.input_ids, mb.attention_mask, starts.to(mb.input_ids.device)
                    )  # (M, H), row by row, turn by turn
            hidden.update(zip(idx, h.split(counts), strict=True))
        g = rewards.shape[1]
        order = sorted(hidden)  # every valid episode is kept under gae
        states = torch.cat([hidden[i] for i in order]) if order else torch.zeros(0, 1)
        flat = critic.values(states) if order else torch.zeros(0)  # (M,)
        values: list[list[list[float]]] = [[[] for _ in range(g)] for _ in range(len(rewards))]
        for i, v in zip(order, flat.split([len(hidden[i]) for i in order]), strict=True):
            values[i // g][i % g] = v.tolist()
        if cfg.reward_clip is not None:
            rewards = rewards.clamp(-cfg.reward_clip, cfg.reward_clip)
        per_turn, targets = gae_advantages(
            rewards,
            turn_rewards,
            values,
            valid,
            weight=cfg.turn_reward_weight,
            gamma=cfg.turn_gamma,
            lam=cfg.gae_lambda,
            norm=cfg.advantage_norm,
        )
        flat_targets = torch.tensor([x for i in order for x in targets[i // g][i % g]])
        stats = critic.fit(states, flat_targets, cfg.value_epochs) if order else {}
        if order:
            stats["critic/sampler_states"] = from_sampler / len(order)
        return per_turn, stats

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

    def _zero_gradient(self, batches: list[MicroBatch]) -> bool:
        """Whether the loss's gradient is zero whatever the weights: every advantage of the
        step is 0 on every process (e.g. ``gae`` before any episode earns a reward, its
        critic still at 0), with no KL term in the loss and no entropy bonus."""
        cfg = self.config
        if (cfg.beta > 0 and cfg.kl_placement == "loss") or cfg.entropy_coef > 0:
            return False
        nonzero = sum(bool(mb.advantages.any()) for mb in batches)
        return self._global([nonzero], "sum")[0] == 0

    def _zero_step(self) -> dict[str, float]:
        """What :meth:`_optimize` does when the gradient is zero, without its forward and
        backward passes: each iteration steps the optimizer on zero gradients, so its state
        (Adam's moments, weight decay, the step count) moves exactly as it would. The
        entropy and sampler metrics are not measured (0, as for a step with no group)."""
        grad_norm = 0.0
        for _ in range(self.config.num_iterations):
            for param in self._params:
                param.grad = torch.zeros_like(param)
            grad_norm += self._clip_and_step(self.config.max_grad_norm)
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": grad_norm}

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
                    self._backward(loss)
                n = maskf.sum().item()
                local["loss"] += m["loss"]
                local["processed"] += mb.attention_mask.sum().item()
                for key in _CLIP_KEYS:
                    local[key] += m[key] * n
            grad_norm += self._clip_and_step(cfg.max_grad_norm)
        self.model.train(was_training)
        result = dict(zip(keys, self._global(list(local.values()), "sum"), strict=True))
        result["grad_norm"] = grad_norm
        return result
