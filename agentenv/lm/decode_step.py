"""One decode step of the sampler: a new token per row through the model, without
transformers' per-call machinery where the model's architecture is known.

A decode step of a small model carries much overhead: SmolLM2-135M at 8 rows on a
2-core CPU spends about a tenth of its ~40 ms in transformers' forward itself (argument
and output handling, a causal mask built per step, the attention function looked up per
layer) rather than in tensor operations. For a Llama-architecture model,
:func:`decode_logits` runs the decoder layers itself: the same tensor operations in the
same order and dtypes, calling the model's own embedding, rotary, norm, linear and MLP
modules (their hooks run) and the same attention function, so its logits are bitwise
those of ``model(...)`` (tested). Any other model, a model whose skipped modules carry
hooks or a replaced ``forward``, and a cache that is not all in-place layers
(:class:`~agentenv.lm.attention.AppendCacheLayer`) run the model's own forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.modules import module as nn_module
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama import modeling_llama as llama

from agentenv.lm.attention import (
    CACHE_ATTENTION,
    CPU_BF16_ATTENTION,
    AppendCacheLayer,
    cached_forward,
)


def decode_logits(
    model: torch.nn.Module,
    cache: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
) -> tuple[torch.Tensor, Any]:
    """Logits ``(b, V)`` for one new token per row, and the cache with it appended.

    Args:
        model: The sampler's model (the sampling copy).
        cache: The batch's KV cache, ``L - 1`` slots per row.
        input_ids: ``(b, 1)``: each row's newest token.
        attention_mask: ``(b, L)``: the slots each row attends to, the new token's last.
        position_ids: ``(b, 1)``: the new token's position in its row.
    """
    if _direct(model, cache, input_ids, attention_mask):
        return _llama_step(model, cache, input_ids, attention_mask, position_ids), cache
    logits, cache = cached_forward(
        model, cache, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
    )
    return logits[:, -1], cache


def _direct(
    model: torch.nn.Module, cache: Any, input_ids: torch.Tensor, mask: torch.Tensor
) -> bool:
    """Whether :func:`_llama_step` computes exactly what ``model``'s forward would."""
    if type(model) is not llama.LlamaForCausalLM or input_ids.shape[1] != 1:
        return False
    config, inner = model.config, model.model
    if config._attn_implementation not in (CPU_BF16_ATTENTION, CACHE_ATTENTION):
        return False
    layers = list(inner.layers)
    if len(layers) != config.num_hidden_layers or len(getattr(cache, "layers", ())) != len(layers):
        return False
    if any(type(c) is not AppendCacheLayer for c in cache.layers):
        return False
    if mask.dim() != 2 or mask.shape[1] != cache.get_seq_length() + 1:
        return False
    if type(inner) is not llama.LlamaModel or _global_hooks():
        return False
    skipped: list[torch.nn.Module] = [model, inner]
    for layer in layers:
        if type(layer) is not llama.LlamaDecoderLayer:
            return False
        if type(layer.self_attn) is not llama.LlamaAttention:
            return False
        skipped += [layer, layer.self_attn]
    return not any(_intercepted(m) for m in skipped)


def _intercepted(module: torch.nn.Module) -> bool:
    """Whether calling ``module`` would run more than its class's ``forward``."""
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or "forward" in module.__dict__
    )


def _global_hooks() -> bool:
    return bool(nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks)


def _llama_step(
    model: torch.nn.Module,
    cache: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
) -> torch.Tensor:
    """``LlamaForCausalLM.forward`` for one token per row over an in-place cache, as
    transformers computes it (``modeling_llama``): logits ``(b, V)``."""
    inner = model.model
    attention = ALL_ATTENTION_FUNCTIONS[model.config._attn_implementation]
    hidden = inner.embed_tokens(input_ids)  # (b, 1, H)
    cos, sin = inner.rotary_emb(hidden, position_ids=position_ids)  # (b, 1, d) each
    # transformers' mask for one query per row over every slot: the 2-D mask as booleans
    mask = attention_mask.bool()[:, None, None, :]  # (b, 1, 1, L)
    b = hidden.shape[0]
    for i, layer in enumerate(inner.layers):
        att = layer.self_attn
        x = layer.input_layernorm(hidden)
        shape = (b, 1, -1, att.head_dim)
        query = att.q_proj(x).view(shape).transpose(1, 2)  # (b, heads, 1, d)
        key = att.k_proj(x).view(shape).transpose(1, 2)  # (b, kv heads, 1, d)
        value = att.v_proj(x).view(shape).transpose(1, 2)
        query, key = llama.apply_rotary_pos_emb(query, key, cos, sin)
        key, value = cache.update(key, value, i)  # (b, kv heads, slots, d)
        out, _ = attention(
            att,
            query,
            key,
            value,
            mask,
            dropout=att.attention_dropout if att.training else 0.0,
            scaling=att.scaling,
        )  # (b, 1, heads, d)
        hidden = hidden + att.o_proj(out.reshape(b, 1, -1).contiguous())
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return model.lm_head(inner.norm(hidden))[:, -1]
