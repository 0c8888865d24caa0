"""How a token is drawn: the one draw every decoding path of :mod:`agentenv.lm` shares.

:func:`sample` draws a row's token from its logits (temperature, then top-k and top-p,
then an inverse-CDF draw with the row's own generator) and records its log-prob under the
distribution drawn from; :func:`has_stop` tells when a turn's text holds a stop string.
The fast sampler (:mod:`agentenv.lm.decoding`) and the reference path
(:mod:`agentenv.lm.reference`) both draw here, so given the same logits and seed they draw
the same token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from transformers import TopKLogitsWarper, TopPLogitsWarper

from agentenv.lm.backend import SamplingConfig

__all__ = ["Buffers", "has_stop", "sample", "warpers"]


def warpers(sampling: SamplingConfig) -> list[Any]:
    """transformers' top-k and top-p logits warpers the sampling asks for, in that order."""
    warpers = []
    if sampling.top_k > 0:
        warpers.append(TopKLogitsWarper(sampling.top_k))
    if sampling.top_p < 1:
        warpers.append(TopPLogitsWarper(sampling.top_p))
    return warpers


def sample(
    logits: torch.Tensor,
    temperature: float,
    warpers: list[Any],
    generators: Sequence[torch.Generator | None] | None = None,
    buffers: Buffers | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of ``logits`` (r, V); return it and its log-prob, on the CPU.

    The log-prob is taken under the distribution sampled from: logits / temperature, then
    top-k, then top-p, in float32. Greedy decoding (temperature 0) takes the argmax and
    records its log-prob at temperature 1. With ``generators`` (CPU, one per row; None in
    the list: the global RNG), row ``j`` draws from ``generators[j]``. ``buffers``: where
    the vocabulary-sized intermediates go (None: fresh tensors).
    """
    buffers = Buffers() if buffers is None else buffers
    shape, device = logits.shape, logits.device
    scores = buffers.take("scores", shape, torch.float32, device).copy_(logits)  # (r, V)
    if temperature not in (0, 1):  # (x / 1 is x: no pass over the vocabulary for it)
        scores.div_(temperature)
    for warp in warpers:
        scores = warp(None, scores)
    logp = torch.log_softmax(scores, dim=-1, out=buffers.take("logp", shape, scores.dtype, device))
    if temperature > 0:  # inverse-CDF draw: torch.multinomial spends ~8 ms/step on CPU RNG
        # (r, V), float64: no drift over the vocabulary; exponentiated and summed in place
        cdf = buffers.take("cdf", shape, torch.float64, device).copy_(logp).exp_().cumsum_(-1)
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


class Buffers:
    """Tensors kept from one decode step to the next, by name, for intermediates of the
    same shape every step: the draw's float32 scores and log-probs and float64 CDF, each
    the size of the vocabulary per row. Allocated fresh each step they cost more than
    their arithmetic (at 64 rows: 50 MB a step, zeroed page by page by the OS)."""

    def __init__(self) -> None:
        self._kept: dict[tuple, torch.Tensor] = {}

    def take(
        self, name: str, shape: Sequence[int], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """A contiguous tensor of ``shape`` (contents undefined), the named buffer's front."""
        inference = torch.is_inference_mode_enabled()  # (one kind cannot stand in for the other)
        key = (name, dtype, device, inference)
        size = math.prod(shape)
        kept = self._kept.get(key)
        if kept is None or kept.numel() < size:
            kept = self._kept[key] = torch.empty(size, dtype=dtype, device=device)
        return kept[:size].view(shape)


def has_stop(tokenizer: Any, ids: list[int], stop_strings: list[str]) -> bool:
    """True if a stop string ends in the text of the newest token of ``ids``.

    Called as each token arrives, so an earlier match was already caught: only the last
    ``len(longest stop) + 1`` tokens (each decodes to at least one character) are decoded,
    not the whole turn at every step.
    """
    window = max(len(s) for s in stop_strings) + 1
    text = tokenizer.decode(ids[-window:], skip_special_tokens=False)
    return any(s in text for s in stop_strings)
