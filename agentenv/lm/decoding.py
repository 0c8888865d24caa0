"""A running batch that rows join and leave between decode steps (continuous batching).

:class:`Decoder` is how :class:`~agentenv.lm.sampler.TransformersPolicy` decodes, both for
one ``generate`` call (every prompt added at once, stepped until all are done) and for the
rollout engine (:mod:`agentenv.rollout.collect`), which adds an episode's next turn as soon
as its environment has answered, while other rows keep decoding::

    decoder = policy.decoder(sampling)
    decoder.add(key, prompt_ids, seed=..., max_new_tokens=...)   # any time
    for key, generation in decoder.step():   # admit queued rows, one token for every row
        ...                                   # rows whose turn ended this step

A row's tokens depend only on its prompt, its seed and the weights: rows that join are
prefilled together, then merged into the running batch (KV caches right-aligned after a
masked gap, positions counted by the attention mask, as in one ``generate`` call), so a
row sees exactly its own tokens whatever else is in the batch, up to the float rounding of
batched kernels. A row that ends keeps its KV cache in the policy until its episode's next
turn continues it (only the environment's new tokens are prefilled then).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from transformers import TopKLogitsWarper, TopPLogitsWarper

from agentenv.errors import InvalidOptionError
from agentenv.lm.attention import append_cache, cached_forward
from agentenv.lm.engine import Generation, SamplingConfig


@dataclass
class _Row:
    key: Any  # the caller's handle
    prompt: tuple[int, ...]
    max_new_tokens: int
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)


class Decoder:
    """Rows decoded together, one token per row per :meth:`step` (see the module docstring).

    Args:
        policy: The :class:`~agentenv.lm.sampler.TransformersPolicy` (model, tokenizer,
            stop tokens, the prefill and the saved KV caches).
        sampling: How every row samples; ``max_new_tokens`` is the most a row may take.
        keep_saved: Keep saved KV caches that this decoder's rows do not continue (the
            rollout engine: other episodes' turns arrive later). False: a prefill drops
            them (one ``generate`` call continues only the previous call's rows).
    """

    def __init__(self, policy: Any, sampling: SamplingConfig, *, keep_saved: bool = True):
        self.policy, self.sampling, self.keep_saved = policy, sampling, keep_saved
        self.warpers = _warpers(sampling)
        self.stop_ids = set(policy.stop_token_ids)
        self.stop_strings = list(sampling.stop_strings or [])
        # Stop strings ending in whitespace or a non-ASCII character are always checked:
        # a token's text alone may drop a leading space, or hold part of a character.
        finals: frozenset[str] | None = frozenset(s[-1] for s in self.stop_strings)
        if any(not c.isascii() or c.isspace() for c in finals):
            finals = None
        self.finals = finals
        self.queued: list[_Row] = []
        self.rows: list[_Row] = []  # the running batch, in cache order
        self.mergeable = True  # False once a prefill gives a cache rows cannot join
        self._cache: Any = None
        self._mask = self._logits = self._next_pos = torch.empty(0)

    def __len__(self) -> int:
        """Rows in flight: running plus queued."""
        return len(self.rows) + len(self.queued)

    def add(
        self,
        key: Any,
        prompt: Sequence[int],
        *,
        seed: int | None = None,
        max_new_tokens: int | None = None,
    ) -> None:
        """Queue a row; the next :meth:`step` prefills it and it joins the running batch.

        Args:
            key: Returned with the row's :class:`Generation` when its turn ends.
            prompt: Token ids (a continuation of a row this policy decoded before starts
                from that row's KV cache).
            seed: The row draws its tokens from a generator with this seed (None: the
                global RNG).
            max_new_tokens: The row's own limit (at most ``sampling.max_new_tokens``).
        """
        limit = self.sampling.max_new_tokens
        limit = limit if max_new_tokens is None else min(limit, max_new_tokens)
        if not prompt or limit < 1:
            raise InvalidOptionError(
                f"a row needs a non-empty prompt and max_new_tokens >= 1, got {len(prompt)} "
                f"prompt tokens and max_new_tokens={limit}"
            )
        generator = None if seed is None else torch.Generator().manual_seed(seed)
        self.queued.append(_Row(key, tuple(prompt), limit, generator))

    def step(self) -> list[tuple[Any, Generation]]:
        """Admit the queued rows (one batched prefill), draw one token for every running row,
        and return ``(key, Generation)`` for each row whose turn ended with it."""
        with self.policy.decoding():
            if self.queued and (self.mergeable or not self.rows):
                self._admit()
            return self._decode() if self.rows else []

    def _admit(self) -> None:
        new, self.queued = self.queued, []
        cache, mask, logits, next_pos = self.policy.prefill(
            [r.prompt for r in new], keep_saved=self.keep_saved
        )
        if self.rows:
            cache, mask = merge_caches(
                self.policy.model, [(self._cache, self._mask), (cache, mask)]
            )
            logits = torch.cat([self._logits, logits])
            next_pos = torch.cat([self._next_pos, next_pos])
        self.mergeable = plain_layers(cache)
        self._cache, self._mask, self._logits, self._next_pos = cache, mask, logits, next_pos
        self.rows += new

    def _decode(self) -> list[tuple[Any, Generation]]:
        policy, rows = self.policy, self.rows
        seeded = any(r.generator is not None for r in rows)
        rngs = [r.generator for r in rows] if seeded else None
        token, logp = _sample(self._logits, self.sampling.temperature, self.warpers, rngs)
        keep, ended = [], []
        for j, (t, lp) in enumerate(zip(token.tolist(), logp.tolist(), strict=True)):
            row = rows[j]
            row.tokens.append(t)
            row.logps.append(lp)
            if t in self.stop_ids:
                ended.append((j, "stop"))
            elif (
                self.stop_strings
                and policy.may_end(t, self.finals)
                and _has_stop(policy.tokenizer, row.tokens, self.stop_strings)
            ):
                ended.append((j, "stop_string"))
            elif len(row.tokens) >= row.max_new_tokens:
                ended.append((j, "length"))
            else:
                keep.append(j)
        out = []
        for j, reason in ended:  # their caches stay for the episode's next turn
            row = rows[j]
            policy.save(self._cache, j, self._mask[j], row.prompt + tuple(row.tokens[:-1]))
            text = policy.tokenizer.decode(row.tokens, skip_special_tokens=True)
            out.append((row.key, Generation(row.tokens, row.logps, text, reason)))
        if not keep:
            self.rows, self._cache = [], None
            return out
        if ended:  # drop ended rows and their cache
            index = torch.tensor(keep)
            self._cache.batch_select_indices(index.to(policy.device))
            self._mask, self._next_pos = self._mask[index], self._next_pos[index]
            token = token[index]
            self.rows = [rows[j] for j in keep]
        self._mask = torch.cat([self._mask, torch.ones((len(keep), 1), dtype=torch.long)], dim=1)
        logits, self._cache = cached_forward(
            policy.model,
            self._cache,
            input_ids=token[:, None].to(policy.device),
            attention_mask=self._mask.to(policy.device),
            position_ids=self._next_pos[:, None].to(policy.device),
        )
        self._logits, self._next_pos = logits[:, -1], self._next_pos + 1
        return out


def plain_layers(cache: Any) -> bool:
    """True for a cache of full-attention ``DynamicLayer`` s: rows of such caches can be
    saved, continued and merged (sliding-window and other layers cannot)."""
    layers = getattr(cache, "layers", None)
    plain = ("DynamicLayer", "AppendCacheLayer")
    return bool(layers) and all(type(layer).__name__ in plain for layer in layers)


def merge_caches(
    model: torch.nn.Module, parts: Sequence[tuple[Any, torch.Tensor]]
) -> tuple[Any, torch.Tensor]:
    """One batch from several ``(cache, mask (rows, slots))`` batches, rows in order.

    Each part's leading slots that no row uses are dropped; the narrower parts get a masked
    gap on the left, so every row stays right-aligned (its positions come from its mask).
    """
    trimmed = []
    for cache, mask in parts:
        used = mask.sum(0).nonzero()
        first = int(used[0]) if len(used) else mask.shape[1]
        trimmed.append((cache, mask[:, first:], first))
    width = max(m.shape[1] for _, m, _ in trimmed)
    merged = append_cache(model)
    if merged is None:
        from transformers import DynamicCache

        merged = DynamicCache()
    for i in range(len(trimmed[0][0].layers)):
        keys, values = [], []
        for cache, mask, first in trimmed:
            layer, gap = cache.layers[i], width - mask.shape[1]
            keys.append(F.pad(layer.keys[:, :, first:], (0, 0, gap, 0)))
            values.append(F.pad(layer.values[:, :, first:], (0, 0, gap, 0)))
        merged.update(torch.cat(keys), torch.cat(values), i)
    mask = torch.cat([F.pad(m, (width - m.shape[1], 0)) for _, m, _ in trimmed])
    return merged, mask


def _warpers(sampling: SamplingConfig) -> list[Any]:
    warpers = []
    if sampling.top_k > 0:
        warpers.append(TopKLogitsWarper(sampling.top_k))
    if sampling.top_p < 1:
        warpers.append(TopPLogitsWarper(sampling.top_p))
    return warpers


def _sample(
    logits: torch.Tensor,
    temperature: float,
    warpers: list[Any],
    generators: Sequence[torch.Generator | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of ``logits`` (r, V); return it and its log-prob, on the CPU.

    The log-prob is taken under the distribution sampled from: logits / temperature, then
    top-k, then top-p, in float32. Greedy decoding (temperature 0) takes the argmax and
    records its log-prob at temperature 1. With ``generators`` (CPU, one per row; None in
    the list: the global RNG), row ``j`` draws from ``generators[j]``.
    """
    scores = logits.float() / (temperature or 1.0)  # (r, V)
    for warp in warpers:
        scores = warp(None, scores)
    logp = torch.log_softmax(scores, dim=-1)  # (r, V)
    if temperature > 0:  # inverse-CDF draw: torch.multinomial spends ~8 ms/step on CPU RNG
        cdf = logp.double().exp().cumsum(dim=-1)  # (r, V), float64: no drift over the vocab
        if generators is None:
            u = torch.rand(cdf.shape[0], 1, dtype=torch.float64, device=cdf.device)
        else:
            u = torch.cat([torch.rand(1, 1, dtype=torch.float64, generator=g) for g in generators])
        u = 1 - u.to(cdf.device)  # (r, 1) in (0, 1]
        u = u * cdf[:, -1:]  # first index with cdf >= u > 0: never a zero-probability token
        token = torch.searchsorted(cdf, u).squeeze(1).clamp(max=cdf.shape[1] - 1)  # (r,)
    else:
        token = scores.argmax(dim=-1)
    return token.cpu(), logp.gather(1, token[:, None]).squeeze(1).cpu()


def _has_stop(tokenizer: Any, ids: list[int], stop_strings: list[str]) -> bool:
    """True if a stop string ends in the text of the newest token of ``ids``.

    Called as each token arrives, so an earlier match was already caught: only the last
    ``len(longest stop) + 1`` tokens (each decodes to at least one character) are decoded,
    not the whole turn at every step.
    """
    window = max(len(s) for s in stop_strings) + 1
    text = tokenizer.decode(ids[-window:], skip_special_tokens=False)
    return any(s in text for s in stop_strings)


def drain(decoder: Decoder) -> Iterator[tuple[Any, Generation]]:
    """Step ``decoder`` until no row is left; yield each row as its turn ends."""
    while len(decoder):
        yield from decoder.step()
