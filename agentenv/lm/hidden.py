"""The hidden state each policy turn is sampled from, recorded while sampling.

A turn's first token is drawn from the LM head's output at its prompt's last position;
the head's input there (the model's last hidden state) is what the ``gae`` critic reads
(:func:`algorithms.logprobs.hidden_before` computes the same state from the episode's
tokens, in the learner's forward). The local engines (``agentenv`` and ``reference``)
record it at every prefill when asked (``record_hidden=True``, which ``agentenv train``
sets only under ``credit="gae"`` with ``critic_input="sampler"``, the one reader), one
``(H,)`` float32 vector a turn, in
:attr:`~agentenv.lm.backend.Generation.hidden`; the rollout keeps it in
:attr:`~agentenv.rollout.episode.Episode.turn_hidden`, so the learner can skip its own
forward for it (``GRPOConfig.critic_input="sampler"``). The vLLM and server engines
return no hidden states.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


@contextlib.contextmanager
def recording_head_input(
    model: torch.nn.Module, enabled: bool = True
) -> Iterator[list[torch.Tensor]]:
    """Within the block, every call of ``model``'s LM head appends a copy of its input at
    the last position, ``(n, H)`` float32 on the CPU, to the yielded list (nothing for a model
    without an output embedding, or when not ``enabled``). The head sees only the positions
    whose logits are kept, so with ``logits_to_keep=1`` that is each row's last token's
    state."""
    seen: list[torch.Tensor] = []
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if get_head is not None and enabled else None
    if head is None:
        yield seen
        return

    def record(_module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        # a copy: the head's input is a view of the whole forward's last hidden states
        seen.append(args[0][:, -1].detach().to("cpu", torch.float32, copy=True))

    handle = head.register_forward_pre_hook(record)
    try:
        yield seen
    finally:
        handle.remove()
