"""One decode step of the sampler: new tokens for every row through the model (one, or a
few where drafted tokens are verified), without transformers' per-call machinery where
the model's architecture is known.

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

Within that, three exact shortcuts: the query, key and value projections come from one
packed matrix product where the sampling copy has one that gives their outputs bitwise
(:class:`~agentenv.lm.weights.PackedConcat`); the rotary embedding rotates query and
key heads together, as a roll of each head's halves times a signed sine (the same
products and sums as transformers' ``rotate_half``); the mask is widened over the
cache's spare slots once a step, not once a layer. The three took SmolLM2's fixed work
at 8 rows from 225 to 239 tok/s (2-core bf16 CPU, one process alternating with and
without them: medians of 6; the same tokens and log-probs).
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
    _over_spare_slots,
    cached_forward,
)
from agentenv.lm.weights import _LoRALinear


def decode_logits(
    model: torch.nn.Module,
    cache: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    *,
    direct: bool = True,
) -> tuple[torch.Tensor, Any]:
    """Logits ``(b, q, V)`` after each of ``q`` new tokens per row (causal among them),
    and the cache with them appended.

    Args:
        model: The sampler's model (the sampling copy).
        cache: The batch's KV cache, ``L - q`` slots per row.
        input_ids: ``(b, q)``: each row's newest tokens (q > 1: a token and the drafted
            tokens after it, :mod:`agentenv.lm.drafting`).
        attention_mask: ``(b, L)``: the slots each row attends to, the new tokens' last.
        position_ids: ``(b, q)``: the new tokens' positions in their row.
        direct: Run :func:`_llama_step` where it computes exactly the model's forward;
            False: always the model's forward.
    """
    if direct and _direct(model, cache, input_ids, attention_mask):
        return _llama_step(model, cache, input_ids, attention_mask, position_ids), cache
    return cached_forward(
        model, cache, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
    )


def _direct(
    model: torch.nn.Module, cache: Any, input_ids: torch.Tensor, mask: torch.Tensor
) -> bool:
    """Whether :func:`_llama_step` computes exactly what ``model``'s forward would."""
    if type(model) is not llama.LlamaForCausalLM:
        return False
    config, inner = model.config, model.model
    if config._attn_implementation not in (CPU_BF16_ATTENTION, CACHE_ATTENTION):
        return False
    layers = list(inner.layers)
    if len(layers) != config.num_hidden_layers or len(getattr(cache, "layers", ())) != len(layers):
        return False
    if any(type(c) is not AppendCacheLayer for c in cache.layers):
        return False
    if mask.dim() != 2 or mask.shape[1] != cache.get_seq_length() + input_ids.shape[1]:
        return False
    if type(inner) is not llama.LlamaModel or _global_hooks():
        return False
    if getattr(model, "_use_kernels", False):  # hub kernels may replace the rotary function
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
    """``LlamaForCausalLM.forward`` for ``q`` tokens per row over an in-place cache, as
    transformers computes it (``modeling_llama``): logits ``(b, q, V)``."""
    inner = model.model
    attention = ALL_ATTENTION_FUNCTIONS[model.config._attn_implementation]
    hidden = inner.embed_tokens(input_ids)  # (b, q, H)
    cos, sin = inner.rotary_emb(hidden, position_ids=position_ids)  # (b, q, d) each
    cos, sin = cos[:, None], _signed(sin)[:, None]  # (b, 1, q, d): the same for every head
    b, q = input_ids.shape
    # transformers' mask (sdpa_mask): the 2-D mask as booleans, causal among the new
    # tokens (query i sees slots up to L - q + i), widened once over the cache's spare
    # slots (as the attention function would per layer)
    mask = attention_mask.bool()[:, None, None, :]  # (b, 1, 1, L)
    if q > 1:
        length = mask.shape[-1]
        slots = torch.arange(length, device=mask.device)
        last = torch.arange(length - q, length, device=mask.device)
        mask = mask & (slots[None, :] <= last[:, None])  # (b, 1, q, L)
    for i, layer in enumerate(inner.layers):
        att = layer.self_attn
        query, key, value = _projections(att, layer.input_layernorm(hidden), cos, sin)
        key, value = cache.update(key, value, i)  # (b, kv heads, slots, d)
        if mask.shape[-1] != key.shape[2]:
            mask = _over_spare_slots(mask, key.shape[2])
        out, _ = attention(
            att,
            query,
            key,
            value,
            mask,
            dropout=att.attention_dropout if att.training else 0.0,
            scaling=att.scaling,
        )  # (b, q, heads, d)
        hidden = hidden + att.o_proj(out.reshape(b, q, -1).contiguous())
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return model.lm_head(inner.norm(hidden))


def _projections(
    att: torch.nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The attention layer's query ``(b, heads, q, d)`` and key and value ``(b, kv heads,
    q, d)`` for ``x`` ``(b, q, H)``, rotary embedding applied (``sin`` signed by
    :func:`_signed`). From the three projections packed as one
    (:class:`~agentenv.lm.weights.PackedConcat`, its outputs bitwise theirs; an unmerged
    LoRA update added to its part as the LoRA layer adds it) where the sampling copy has
    it, else from each."""
    b, q, d = x.shape[0], x.shape[1], att.head_dim
    projections = (att.q_proj, att.k_proj, att.v_proj)
    fused = getattr(att, "packed_qkv", None)
    updates = None if fused is None else _updates(fused, projections)
    if updates is not None and fused.exact(b * q):
        qkv = fused(x)  # (b, q, (heads + 2 kv heads) d)
        start = 0
        for lora, layer in zip(updates, fused.layers, strict=True):
            if lora is not None:  # (in float32, rounded once into the bf16 slice)
                lora.add_to(qkv[..., start : start + layer.out_features], x)
            start += layer.out_features
        values = fused.layers[2].out_features
        # query and key rotated together: one set of operations for both
        qk = _rotate(qkv[..., :-values].view(b, q, -1, d).transpose(1, 2), cos, sin)
        heads = fused.layers[0].out_features // d
        return qk[:, :heads], qk[:, heads:], qkv[..., -values:].view(b, q, -1, d).transpose(1, 2)
    shape = (b, q, -1, d)
    query, key, value = (p(x).view(shape).transpose(1, 2) for p in projections)
    return _rotate(query, cos, sin), _rotate(key, cos, sin), value


def _updates(fused: Any, projections: tuple[torch.nn.Module, ...]) -> list | None:
    """Per projection, the LoRA layer whose unmerged update is added to its part of
    ``fused``'s output (None: nothing to add); None when ``fused`` does not compute what
    calling the projections would (another layer in place, or hooks)."""
    updates = []
    for layer, projection in zip(fused.layers, projections, strict=True):
        if _intercepted(projection):
            return None
        if projection is layer:
            updates.append(None)
        elif type(projection) is _LoRALinear and projection.base_layer is layer:
            if _intercepted(layer):
                return None
            updates.append(None if projection.folded else projection)  # folded: in `fused`
        else:
            return None
    return updates


def _signed(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` with its first half negated, for :func:`_rotate`."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``apply_rotary_pos_emb`` for one of its tensors, bitwise:
    ``x * cos + rotate_half(x) * sin``, where ``rotate_half(x) = [-x2, x1]``. The halves
    swapped (a roll) times the signed sine is the same product: negating a factor
    negates the rounded product exactly."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin
