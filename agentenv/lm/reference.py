"""The reference decoding path: transformers' own forward and KV cache, nothing else.

:class:`ReferencePolicy` continues a batch of token-id prompts the plain way: the prompts
left-padded into one batch, one forward over them into a ``DynamicCache``, then one
forward per token for every row until each row's turn ends. It samples from the model it
is given, as it is (a peft model's LoRA unmerged; no copy, no packed weights, no private
ops, no cache subclasses, no re-implemented forward), in the compute dtype by
``torch.autocast``. Each token is drawn by :func:`agentenv.lm.draw.sample`, the draw the
fast sampler (:mod:`agentenv.lm.sampler`) uses too, so given a seed per row the two paths
draw the same tokens wherever float rounding of their logits cannot flip a draw, with
log-probs equal to rounding (tests/agentenv/lm/test_reference.py).

It keeps no KV cache between calls: an episode's next turn (the same prompt extended)
is prefilled whole, which gives the tokens a continued cache would. Finished rows stay in
the batch (fed padding) until the last row ends. That is all: it is slower than the
fast sampler (docs/benchmarks.md, "the reference decoding path") and is there to read, to
trust, to compare against, and to fall back to (``--engine reference``;
:func:`agentenv.lm.engines.make_policy` picks it when the fast sampler cannot run here).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from agentenv.errors import InvalidOptionError
from agentenv.lm.attention import cached_forward
from agentenv.lm.backend import Generation, SamplingConfig, check_batch, stop_and_pad_ids
from agentenv.lm.draw import has_stop, sample, warpers
from agentenv.lm.hidden import recording_head_input
from agentenv.lm.precision import autocast, resolve_dtype


class ReferencePolicy:
    """A ``transformers`` causal LM as a batched policy, decoded the plain way (see the
    module docstring).

    Args:
        model: The causal LM being trained or evaluated (a peft ``PeftModel`` works too).
        tokenizer: Its tokenizer (decodes turns and stop strings; pad id for padding).
        dtype: Compute dtype: ``"auto"`` (:func:`~agentenv.lm.precision.resolve_dtype`),
            a name or a ``torch.dtype``; anything but float32 runs under ``torch.autocast``.
        stop_token_ids: Ids that end a turn (default: the tokenizer's and generation
            config's EOS ids).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        dtype: str | torch.dtype = "auto",
        stop_token_ids: Sequence[int] | None = None,
        record_hidden: bool = False,
    ):
        self.model = model
        self.record_hidden = record_hidden  # Generation.hidden (agentenv.lm.hidden)
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.dtype = resolve_dtype(dtype, self.device)
        self.stop_token_ids, self.pad_token_id = stop_and_pad_ids(model, tokenizer, stop_token_ids)

    def refresh(self) -> None:
        """Nothing to do: this path samples from the trained model itself."""

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        *,
        seeds: Sequence[int | None] | None = None,
        max_new_tokens: Sequence[int] | None = None,
    ) -> list[Generation]:
        """One continuation per prompt, in order.

        With ``seeds``, row ``i`` draws from a generator seeded ``seeds[i]`` (one float64
        uniform number per token), so its tokens do not depend on the rest of the batch.
        ``max_new_tokens``: each row's own limit (at most ``sampling.max_new_tokens``).
        """
        check_batch(prompts, seeds)
        n = len(prompts)
        limits = [sampling.max_new_tokens] * n
        if max_new_tokens is not None:
            limits = [min(sampling.max_new_tokens, m) for m in max_new_tokens]
        if min(limits) < 1:
            raise InvalidOptionError(f"max_new_tokens must be >= 1 for every row, got {limits}")
        generators = None
        if seeds is not None:  # (a None seed: that row draws from the global RNG)
            generators = [None if s is None else torch.Generator().manual_seed(s) for s in seeds]
        stop_ids, stop_strings = set(self.stop_token_ids), list(sampling.stop_strings or [])
        warp = warpers(sampling)
        tokens: list[list[int]] = [[] for _ in range(n)]
        logps: list[list[float]] = [[] for _ in range(n)]
        reasons: list[str | None] = [None] * n

        # the prompts, left-padded: (n, L) ids and mask; positions count each row's tokens
        width = max(len(p) for p in prompts)
        ids = torch.full((n, width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, prompt in enumerate(prompts):
            ids[i, width - len(prompt) :] = torch.tensor(list(prompt))
            mask[i, width - len(prompt) :] = 1
        was_training = self.model.training
        self.model.eval()  # no dropout (LoRA's) while sampling
        try:
            cache = DynamicCache()
            with recording_head_input(self.model, self.record_hidden) as states:
                logits = self._forward(ids, mask, cache)  # (n, V): each row's next-token logits
            hidden = states[-1] if states else None  # (n, H): what the logits came from
            while True:
                running = [i for i in range(n) if reasons[i] is None]
                rngs = None if generators is None else [generators[i] for i in running]
                token, logp = sample(logits[running], sampling.temperature, warp, rngs)
                for i, t, lp in zip(running, token.tolist(), logp.tolist(), strict=True):
                    tokens[i].append(t)
                    logps[i].append(lp)
                    reasons[i] = self._end_reason(tokens[i], limits[i], stop_ids, stop_strings)
                if all(r is not None for r in reasons):
                    break
                # one more token a row: the drawn one, or padding (masked) for ended rows
                fed = torch.full((n, 1), self.pad_token_id, dtype=torch.long)
                fed[running, 0] = token
                alive = torch.tensor([[int(r is None) for r in reasons]])
                mask = torch.cat([mask, alive.T], dim=1)
                logits = self._forward(fed, mask, cache)
        finally:
            self.model.train(was_training)
        return [
            Generation(
                t,
                lp,
                self.tokenizer.decode(t, skip_special_tokens=True),
                str(r),
                None if hidden is None else hidden[i],
            )
            for i, (t, lp, r) in enumerate(zip(tokens, logps, reasons, strict=True))
        ]

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, cache: Any) -> torch.Tensor:
        """The last position's logits (n, V) after feeding ``ids`` (n, w) to the model with
        ``cache`` (extended in place); ``mask`` (n, L) covers the cache and ``ids``."""
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1] :]
        dev = self.device
        with autocast(dev, self.dtype):  # the cache's argument is named as the model says
            logits, _ = cached_forward(
                self.model,
                cache,
                input_ids=ids.to(dev),
                attention_mask=mask.to(dev),
                position_ids=positions.to(dev),
                logits_to_keep=1,
            )
        return logits[:, -1].float()

    def _end_reason(
        self, tokens: list[int], limit: int, stop_ids: set[int], stop_strings: list[str]
    ) -> str | None:
        """Why a turn ending in ``tokens[-1]`` ends (the fast sampler's order), or None."""
        if tokens[-1] in stop_ids:
            return "stop"
        if stop_strings and has_stop(self.tokenizer, tokens, stop_strings):
            return "stop_string"
        if len(tokens) >= limit:
            return "length"
        return None

    def decoder(self, sampling: SamplingConfig) -> TurnBatch:
        """A running batch for the rollout engine whose every step decodes the rows added
        since the last step to the end of their turns (:class:`TurnBatch`)."""
        return TurnBatch(self, sampling)


@dataclass
class _Queued:
    key: Any
    prompt: Sequence[int]
    seed: int | None
    max_new_tokens: int


class TurnBatch:
    """The reference path's running batch (``RolloutConfig.batching="continuous"``): rows
    added between steps; each :meth:`step` generates all of them to the end of their
    turns in one :meth:`ReferencePolicy.generate` call and returns them all."""

    def __init__(self, policy: ReferencePolicy, sampling: SamplingConfig):
        self.policy, self.sampling = policy, sampling
        self.queued: list[_Queued] = []

    def __len__(self) -> int:
        return len(self.queued)

    def add(
        self,
        key: Any,
        prompt: Sequence[int],
        *,
        seed: int | None = None,
        max_new_tokens: int | None = None,
    ) -> None:
        limit = self.sampling.max_new_tokens if max_new_tokens is None else max_new_tokens
        self.queued.append(_Queued(key, prompt, seed, limit))

    def step(self) -> list[tuple[Any, Generation]]:
        rows, self.queued = self.queued, []
        if not rows:
            return []
        seeded = any(r.seed is not None for r in rows)
        generations = self.policy.generate(
            [r.prompt for r in rows],
            self.sampling,
            seeds=[r.seed for r in rows] if seeded else None,
            max_new_tokens=[r.max_new_tokens for r in rows],
        )
        return [(r.key, g) for r, g in zip(rows, generations, strict=True)]
