"""Tiny random models of architectures other than the default Llama (for the paths that
must notice another architecture)."""

from __future__ import annotations

from typing import Any

import torch


def tiny_qwen2(tokenizer: Any, **config: Any) -> torch.nn.Module:
    """A 2-layer random Qwen2 with the tokenizer's vocabulary (seed 0, eval mode); ``config``
    overrides or adds ``Qwen2Config`` fields."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    fields = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "pad_token_id": tokenizer.pad_token_id,
    }
    return Qwen2ForCausalLM(Qwen2Config(**{**fields, **config})).eval()
