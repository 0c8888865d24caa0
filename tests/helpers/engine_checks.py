"""What the engine tests share: a tiny model vLLM accepts, prompts, and the trainer's
recomputation of a sampled turn's log-probs."""

from __future__ import annotations

import torch

from agentenv.lm.engine import SamplingConfig

SAMPLING = SamplingConfig(max_new_tokens=16, temperature=1.0, stop_strings=[])


def small(tokenizer, seed=0):
    """2 layers, head size 64 (vLLM's CPU attention refuses the default tiny model's 16)."""
    from agentenv.lm.models import tiny_model

    return tiny_model(tokenizer, hidden_size=128, num_heads=2, seed=seed)


def save_small(tokenizer, path) -> str:
    """:func:`small` and the tokenizer as a model folder vLLM can serve."""
    small(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def prompts(tokenizer):
    return [
        tokenizer.encode("Hello there, how are you today", add_special_tokens=False),
        tokenizer.encode("2 + 3 =", add_special_tokens=False),
    ]


def recomputed(model, prompt, generation, temperature=1.0):
    """The trainer's log-probs of ``generation``'s tokens (float32)."""
    ids = torch.tensor([[*prompt, *generation.token_ids]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt) :, None]).squeeze(1)
