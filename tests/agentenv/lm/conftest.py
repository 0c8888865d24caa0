"""Fixtures of the decoding tests."""

import pytest
import torch


@pytest.fixture(scope="module")
def sharp_model(tokenizer):
    """The tiny random model with large attention weights: its next token depends on which
    earlier tokens it attends to (the plain tiny model's attention barely moves its
    logits, so a misaligned KV cache would go unnoticed)."""
    from agentenv.lm.models import tiny_model as build

    model = build(tokenizer)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if any(k in name for k in ("q_proj", "k_proj")):
                param.mul_(12)
            elif any(k in name for k in ("v_proj", "o_proj")):
                param.mul_(6)
    return model
