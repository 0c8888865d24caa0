"""Compute dtype of the learn phase: bfloat16 / float16 autocast over float32 trainables.

The compute dtype is the dtype of the model's weights unless given: a LoRA run whose base
was loaded in bfloat16 computes in bfloat16 (its float32 adapters too); a float32 model
computes in float32 unless told otherwise (float32 weights trained under bf16 autocast).
Autocast is plain ``torch.autocast``, not accelerate's ``mixed_precision`` (fixed once per
process), so two trainers in one process may use different dtypes.
"""

from __future__ import annotations

import contextlib

import torch

from agentenv.errors import InvalidOptionError


def compute_dtype(model: torch.nn.Module, dtype: torch.dtype | None = None) -> torch.dtype:
    """``dtype``, or the dtype of the model's (frozen or not) input embeddings."""
    if dtype is not None:
        return dtype
    get = getattr(model, "get_input_embeddings", None)
    embeddings = get() if get else None
    if embeddings is not None and embeddings.weight.is_floating_point():
        return embeddings.weight.dtype
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def autocast(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """``torch.autocast`` to ``dtype`` on ``device``'s type; a no-op for float32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    if dtype == torch.float16 and device.type == "cpu":
        raise InvalidOptionError("float16 compute needs a GPU; use bfloat16 or float32 on a CPU")
    return torch.autocast(device_type=device.type, dtype=dtype)
