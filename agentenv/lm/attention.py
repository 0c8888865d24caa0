"""Attention on a CPU for bfloat16, shared by the sampler and the learner; in-place KV
caches for the sampler (a CPU in bfloat16 and float32, a GPU in any dtype).

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
import inspect
import math
from typing import Any

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicLayer

CPU_BF16_ATTENTION = "agentenv_cpu_bf16"  # registered with transformers on first use
CACHE_ATTENTION = "agentenv_sdpa_buffers"  # SDPA over in-place caches (sampling)
# grouped_attention's most scores in one call: without gradients (a chunk of rows;
# 32 MB in bfloat16), and with them (the batch's, kept for backward: 8 MB a layer)
SCORES = 2**24
GRAD_SCORES = 2**22


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
    mask, several queries attend causally (the last query sees every key).

    Large problems go to the fused kernel. With gradients (the learner) that is decided
    for the whole batch, whose scores backward keeps (``GRAD_SCORES``). Without (the
    sampler) it is decided per row: a batch of more than ``SCORES`` scores runs in
    chunks of rows, so a row's values never depend on which rows share its batch (the
    fused kernel rounds otherwise in bfloat16), and only a row of more than ``SCORES``
    scores goes to the fused kernel. (The RAG recipe's continued prefills, 17-19 rows of
    ~350 new tokens over ~500, went to it whole before; in row chunks a layer took 51-54
    ms against 59-66 ms alone, and the recipe's collections were as fast either way:
    1.33 vs 1.30 ms a token read, one process alternating, 2-core bf16 CPU.)

    Shapes: query ``(b, h, q, d)``, key/value ``(b, kv, L, d)``, boolean mask
    ``(b or 1, 1, q, L)`` (True = attend); returns ``(b, q, h, d)``.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    b, h, q, d = query.shape
    kv, length = key.shape[1], key.shape[2]
    grad = torch.is_grad_enabled()
    scores = (b if grad else 1) * h * q * length  # what one call would hold
    if h % kv or scores > (GRAD_SCORES if grad else SCORES) or dropout > 0 or q > length:
        if attention_mask is not None and attention_mask.shape[-1] < length:  # spare slots
            key, value = (
                key[:, :, : attention_mask.shape[-1]],
                value[:, :, : attention_mask.shape[-1]],
            )
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs
        )
    if attention_mask is None and q > 1:
        attention_mask = torch.ones((q, length), dtype=torch.bool, device=query.device)
        attention_mask = attention_mask.tril(length - q)[None, None]  # (1, 1, q, L)
    else:
        attention_mask = _over_spare_slots(attention_mask, length)
    rows = b if grad else max(1, SCORES // scores)  # rows a chunk holds
    if rows >= b:
        return _grouped(query, key, value, attention_mask, scaling), None
    one_mask = attention_mask is None or attention_mask.shape[0] == 1  # every row's
    chunks = [  # each row computed as it would be alone or in any other batch
        _grouped(
            query[i : i + rows],
            key[i : i + rows],
            value[i : i + rows],
            attention_mask if one_mask else attention_mask[i : i + rows],
            scaling,
        )
        for i in range(0, b, rows)
    ]
    return torch.cat(chunks), None


def _grouped(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
) -> torch.Tensor:
    """:func:`grouped_attention`'s two matmuls, the mask already over every key."""
    b, h, q, d = query.shape
    kv, length = key.shape[1], key.shape[2]
    g = h // kv  # query heads per KV head; head i reads KV head i // g
    scale = scaling if scaling is not None else d**-0.5
    if math.frexp(scale)[0] == 0.5:  # a power of two (d = 64: 1/8) scales exactly: the
        query, scale = query * scale, 1.0  # queries then, not the L times more scores
    scores = torch.matmul(query.reshape(b, kv, g * q, d), key.transpose(-1, -2))
    if scale != 1.0:
        scores = scores * scale  # (b, kv, g*q, L)
    if attention_mask is not None:
        # the dtype's lowest value, not -inf: a fully masked row (a left-padding query)
        # then gets finite, ignored outputs instead of NaNs that would reach the cache;
        # in place (the matmul's or the scaling's own output; neither backward needs it)
        scores.view(b, kv, g, q, length).masked_fill_(
            ~attention_mask[:, :, None].bool(), torch.finfo(scores.dtype).min
        )
    probs = torch.softmax(scores, dim=-1)  # float32 inside, the output in the input's dtype
    out = torch.matmul(probs, value)  # (b, kv, g*q, d)
    return out.view(b, h, q, d).transpose(1, 2).contiguous()


def sdpa_over_buffers(
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
    """transformers' SDPA attention over :class:`AppendCacheLayer` buffers (a
    transformers attention function): the mask is extended over the buffers' spare
    slots, which it masks out. What the sampler decodes with in float32 on a CPU, where
    the fused kernel is fast and appending in place saves copying the whole cache every
    step (``DynamicLayer`` concatenates), and on a GPU (:func:`sampler_attention`). Shapes
    as :func:`grouped_attention`'s.

    A decode step (one query per row) runs each KV head's query group as that head's
    queries, as transformers >= 5.24 does: before it (vLLM's CPU wheel pins < 5.20),
    transformers copied every KV head once per query head, the whole cache every step
    (64 rows: 84 -> 197-235 tok/s in float32 on a 2-core CPU). Several queries per row
    (a prefill, a step verifying drafted tokens) on a CPU go to the kernel with
    ``enable_gqa``, which reads each KV head for its query heads where transformers
    copies the whole cache once per query head first (with a mask it does on every
    device): bitwise the same outputs (tested), and on a 2-core Intel Xeon with AMX
    2x faster in float32 for 4 rows of 107 tokens over 600 (10.3 -> 4.9 ms a layer), 10x
    for 8 rows verifying 4 drafted tokens over 400 (7.5 -> 0.7 ms). On a GPU the
    kernels that take a mask with ``enable_gqa`` are not the fast ones (transformers'
    ``use_gqa_in_sdpa``): there it stays transformers' call."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    attention_mask = _over_spare_slots(attention_mask, key.shape[2])
    b, h, q, d = query.shape
    kv = key.shape[1]
    gqa = h > kv and h % kv == 0 and not dropout  # query heads share each KV head
    if gqa and q == 1:
        out = F.scaled_dot_product_attention(
            query.reshape(b, kv, h // kv, d),  # (b, kv, g, d): a group per KV head
            key,
            value,
            attn_mask=attention_mask,  # (b, 1, 1, L): the same for every head
            scale=scaling,
        )
        return out.reshape(b, h, 1, d).transpose(1, 2).contiguous(), None
    if gqa and attention_mask is not None and query.device.type == "cpu":
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True
        )  # (b, h, q, d): query head i reads KV head i // (h // kv)
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs
    )


def _over_spare_slots(mask: torch.Tensor | None, length: int) -> torch.Tensor | None:
    """``mask`` (``(..., L')``) extended to ``length`` keys, masking the rest: keys from an
    :class:`AppendCacheLayer` carry spare slots (zeros) after the mask's end."""
    if mask is None or mask.shape[-1] >= length:
        return mask
    return F.pad(mask, (0, length - mask.shape[-1]))


def cached_forward(model: torch.nn.Module, cache: Any, **inputs: Any) -> tuple[torch.Tensor, Any]:
    """``model(**inputs, use_cache=True)`` continuing the KV ``cache`` (None: the model
    starts its own); returns the logits and the cache (None where the model keeps none,
    e.g. under gradient checkpointing).

    transformers 5 renamed the forward's ``past_key_values`` (argument and output) to
    ``cache`` and removes the old name in 5.40; the model's own signature says which one
    it takes. ``model`` may be wrapped (peft, DDP): the first transformers model inside
    it decides.
    """
    inner = next(m for m in model.modules() if isinstance(m, PreTrainedModel))
    name = _cache_argument(type(inner))
    out = model(**inputs, **{name: cache}, use_cache=True)
    return out.logits, out.get(name)


@functools.cache
def _cache_argument(cls: type) -> str:
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


@functools.cache
def register() -> str:
    """Register :func:`grouped_attention` with transformers; return its name."""
    return _register(CPU_BF16_ATTENTION, grouped_attention)


@functools.cache
def register_cache_attention() -> str:
    """Register :func:`sdpa_over_buffers` with transformers; return its name."""
    return _register(CACHE_ATTENTION, sdpa_over_buffers)


def _register(name: str, function: Any) -> str:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(name, function)

    def always_a_mask(*args: Any, **kwargs: Any) -> Any:
        # keys may carry spare slots past the valid ones (AppendCacheLayer): never skip
        return sdpa_mask(*args, **{**kwargs, "allow_is_causal_skip": False})

    AttentionMaskInterface.register(name, always_a_mask)
    return name


def wants_grouped(model: torch.nn.Module, dtype: torch.dtype) -> bool:
    """Whether ``model`` computing in ``dtype`` should use :func:`grouped_attention`: a
    model on the CPU that uses SDPA attention, computing in bfloat16."""
    return dtype == torch.bfloat16 and _sdpa(model) and _device_type(model) == "cpu"


def _sdpa(model: torch.nn.Module) -> bool:
    """True for a model that uses SDPA attention."""
    config = getattr(model, "config", None)
    return config is not None and getattr(config, "_attn_implementation", None) == "sdpa"


def _device_type(model: torch.nn.Module) -> str:
    return next(model.parameters()).device.type


def sampler_attention(model: torch.nn.Module, dtype: torch.dtype) -> str | None:
    """The attention the sampler decodes ``model`` with (registered with transformers),
    None for the model's own (a model that does not use SDPA). Both choices decode over
    in-place KV caches (:func:`append_cache`): :func:`grouped_attention` on a CPU in
    bfloat16, :func:`sdpa_over_buffers` otherwise (a CPU in float32, a GPU in any dtype).

    On a GPU the in-place cache also keeps the attention's shapes still: its buffers grow
    ``AppendCacheLayer.SPARE`` slots at a time, where a concatenated cache hands SDPA a new
    key length every decode step, and a GPU pays one-time costs for every new shape (an
    H200 ran the first batch at a shape 2.5-3.3x slower than the same batch again)."""
    if not _sdpa(model):
        return None
    if dtype == torch.bfloat16 and _device_type(model) == "cpu":
        return register()
    return register_cache_attention()


def use_cpu_bf16_attention(model: torch.nn.Module, dtype: torch.dtype) -> bool:
    """Switch ``model`` (computing in ``dtype``) to :func:`grouped_attention` where that
    pays (:func:`wants_grouped`); return whether it did. The same values as SDPA up to
    float rounding; a peft model's layers follow its base model's config."""
    if not wants_grouped(model, dtype):
        return False
    model.config._attn_implementation = register()
    return True


def append_cache(model: torch.nn.Module) -> Any | None:
    """An empty KV cache whose layers append in place (:class:`AppendCacheLayer`), for a
    model that uses :func:`grouped_attention` or :func:`sdpa_over_buffers` and full
    attention in every layer; None otherwise (the model then makes its own
    ``DynamicCache``)."""
    from transformers import DynamicCache

    config = getattr(model, "config", None)
    attention = getattr(config, "_attn_implementation", None)
    if attention not in (CPU_BF16_ATTENTION, CACHE_ATTENTION):
        return None
    cache = DynamicCache(config=config)
    if not cache.layers or any(type(layer) is not DynamicLayer for layer in cache.layers):
        return None  # sliding windows, linear attention, ...: keep transformers' own
    cache.layers = [AppendCacheLayer() for _ in cache.layers]
    return cache


class AppendCacheLayer(DynamicLayer):
    """A full-attention KV cache layer that appends decode steps in place.

    ``DynamicLayer`` concatenates: every decode step copies the whole cache of every
    layer (memory-bound on a CPU: a sixth of a SmolLM2 decode step at 400 cached
    tokens). This layer keeps ``SPARE`` free slots after the valid ones and writes
    new tokens into them. ``update`` returns the whole buffers ``(b, kv, capacity, d)``
    (contiguous: a matmul over a slice of them is 3x slower), with zeros in the spare
    slots, which :func:`grouped_attention` masks out; ``keys`` / ``values`` and
    ``get_seq_length`` see the valid slots only. A first update (a prefill) gets no
    spare slots, so a mask-less causal prefill never sees them.
    """

    SPARE = 64

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.length, self._k, self._v = 0, None, None
        self._spare_rows: tuple[torch.Tensor, torch.Tensor] | None = None  # batch_append's

    @property
    def keys(self) -> torch.Tensor | None:  # type: ignore[override]
        return None if self._k is None else self._k[:, :, : self.length]

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:  # DynamicLayer's own methods
        self._k = None if value is None or value.dim() != 4 else value.contiguous()
        self._spare_rows = None
        self.length = 0 if self._k is None else self._k.shape[-2]

    @property
    def values(self) -> torch.Tensor | None:  # type: ignore[override]
        return None if self._v is None else self._v[:, :, : self.length]

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        self._v = None if value is None or value.dim() != 4 else value.contiguous()

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, add = self.length, key_states.shape[-2]
        if self._k is None or n + add > self._k.shape[-2]:
            capacity = n + add + (self.SPARE if n else 0)
            k = key_states.new_zeros((*key_states.shape[:2], capacity, key_states.shape[-1]))
            v = value_states.new_zeros((*value_states.shape[:2], capacity, value_states.shape[-1]))
            if n:
                k[:, :, :n], v[:, :, :n] = self._k[:, :, :n], self._v[:, :, :n]
            self._k, self._v, self._spare_rows = k, v, None
        self._k[:, :, n : n + add] = key_states
        self._v[:, :, n : n + add] = value_states
        self.length = n + add
        return self._k, self._v

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized and self._k is not None else 0

    def adopt(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        """Take ``keys`` / ``values`` (``(b, kv, capacity, d)``, valid up to ``length``, zeros
        after) as this layer's buffers, without copying them."""
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
        self._k, self._v, self.length, self._spare_rows = keys, values, length, None

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self._k is not None:
            self._k = self._k.repeat_interleave(repeats, dim=0)
            self._v = self._v.repeat_interleave(repeats, dim=0)
            self._spare_rows = None

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self._k is not None:
            self._k, self._v = self._k[indices], self._v[indices]
            self._spare_rows = None

    def batch_append(self, indices: torch.Tensor, capacity: int) -> None:
        """Append copies of rows ``indices`` after the last row. The buffers keep room for
        ``capacity`` rows in all (their leading dimension: a view of the first rows stays
        contiguous), so later appends copy only the appended rows."""
        if self._k is None:
            return
        b, add = self._k.shape[0], len(indices)
        spare = self._spare_rows
        if spare is None or len(spare[0]) < b + add:
            rows = max(capacity, b + add)
            spare = (
                self._k.new_empty((rows, *self._k.shape[1:])),
                self._v.new_empty((rows, *self._v.shape[1:])),
            )
            spare[0][:b], spare[1][:b] = self._k, self._v
        spare[0][b : b + add], spare[1][b : b + add] = spare[0][indices], spare[1][indices]
        self._k, self._v, self._spare_rows = spare[0][: b + add], spare[1][: b + add], spare
