"""Attention for bfloat16 on a CPU, shared by the sampler and the learner.

PyTorch's fused CPU attention kernel is slow in bfloat16: about 8x slower than in float32
for a few query tokens over a long KV cache (1.6 ms vs 0.2 ms per layer at batch 8, 400
cached tokens, 9 query / 3 KV heads; that alone was half of a decode step), and its
backward is 3x slower than two plain matmuls for a GRPO micro-batch (27 ms vs 9 ms per
layer for 8 rows of 128 tokens over a 361-token cache). :func:`grouped_attention`
computes attention as two grouped matmuls instead; :func:`use_cpu_bf16_attention`
switches a model to it. The sampler and the learner computing attention the same way
also keeps the sampler's log-probs closer to the learner's.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

CPU_BF16_ATTENTION = "agentenv_cpu_bf16"  # registered with transformers on first use


def grouped_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention as two grouped matmuls (a transformers attention function).

    Each KV head's query group is one matmul against the keys (no repeated KV copies).
    The scores stay in the input dtype (the matmul rounds them to it anyway; the softmax
    accumulates in float32), so the backward pass keeps 2 bytes per score. Without a
    mask, several queries attend causally (the last query sees every key). Large problems
    go to the fused kernel; with gradients the limit is lower (the scores are kept).

    Shapes: query ``(b, h, q, d)``, key/value ``(b, kv, L, d)``, boolean mask
    ``(b or 1, 1, q, L)`` (True = attend); returns ``(b, q, h, d)``.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    b, h, q, d = query.shape
    kv, length = key.shape[1], key.shape[2]
    limit = 2**22 if torch.is_grad_enabled() else 2**24  # 4M scores: 8 MB kept per layer
    if h % kv or b * h * q * length > limit or dropout > 0 or q > length:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs
        )
    if attention_mask is None and q > 1:
        attention_mask = torch.ones((q, length), dtype=torch.bool, device=query.device)
        attention_mask = attention_mask.tril(length - q)[None, None]  # (1, 1, q, L)
    g = h // kv  # query heads per KV head; head i reads KV head i // g
    scores = torch.matmul(query.reshape(b, kv, g * q, d), key.transpose(-1, -2))
    scores = scores * (scaling if scaling is not None else d**-0.5)  # (b, kv, g*q, L)
    if attention_mask is not None:
        scores = scores.view(b, kv, g, q, length)
        scores = scores.masked_fill(~attention_mask[:, :, None].bool(), float("-inf"))
        scores = scores.view(b, kv, g * q, length)
    probs = torch.softmax(scores, dim=-1)  # float32 inside, the output in the input's dtype
    out = torch.matmul(probs, value)  # (b, kv, g*q, d)
    return out.view(b, h, q, d).transpose(1, 2).contiguous(), None


@functools.cache
def register() -> str:
    """Register :func:`grouped_attention` with transformers; return its name."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(CPU_BF16_ATTENTION, grouped_attention)
    AttentionMaskInterface.register(CPU_BF16_ATTENTION, sdpa_mask)
    return CPU_BF16_ATTENTION


def wants_grouped(model: torch.nn.Module, dtype: torch.dtype) -> bool:
    """Whether ``model`` computing in ``dtype`` should use :func:`grouped_attention`: a
    model on the CPU that uses SDPA attention, computing in bfloat16."""
    config = getattr(model, "config", None)
    device = next(model.parameters()).device
    return (
        config is not None
        and device.type == "cpu"
        and dtype == torch.bfloat16
        and getattr(config, "_attn_implementation", None) == "sdpa"
    )


def use_cpu_bf16_attention(model: torch.nn.Module, dtype: torch.dtype) -> bool:
    """Switch ``model`` (computing in ``dtype``) to :func:`grouped_attention` where that
    pays (:func:`wants_grouped`); return whether it did. The same values as SDPA up to
    float rounding; a peft model's layers follow its base model's config."""
    if not wants_grouped(model, dtype):
        return False
    model.config._attn_implementation = register()
    return True
