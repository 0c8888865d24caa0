"""A tiny random model taught one conversation by heart, to drive other libraries' loops.

Other libraries (TRL, verifiers) run the model themselves, so a test cannot script the
policy's text. A 2-layer model trained for a few hundred steps on one chat-template
rendering continues that rendering exactly when given its prompt: a real model that makes
real tool calls, in seconds, without the hub.
"""

from __future__ import annotations

from typing import Any

import torch


def memorize(
    tokenizer: Any,
    text: str,
    prompt: str,
    *,
    max_steps: int = 400,
    hidden_size: int = 128,
    seed: int = 0,
) -> Any:
    """A tiny Llama that continues ``prompt`` (a prefix of ``text``) with the rest of ``text``.

    Trained on the continuation's tokens only, until its loss is below 0.01 nats per token
    (almost one-hot: sampling at temperature 1 then follows the text too).
    """
    from agentenv.lm.models import tiny_model

    assert text.startswith(prompt), "prompt must be a prefix of text"
    model = tiny_model(tokenizer, hidden_size=hidden_size, num_heads=4, seed=seed)
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    start = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    targets = ids[0, start:]  # (C,) the continuation
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(max_steps):
        # logits of the C positions that predict the continuation: (1, C, V)
        logits = model(input_ids=ids[:, :-1], logits_to_keep=len(targets)).logits
        loss = torch.nn.functional.cross_entropy(logits[0], targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if loss.item() < 0.01:
            break
    model.eval()
    return model
