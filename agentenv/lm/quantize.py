"""QLoRA's base: the frozen model loaded in 4 bits through bitsandbytes.

``quantize="nf4"`` (``agentenv train|sft|eval --quantize nf4``) loads every linear layer of
the decoder as bitsandbytes' ``Linear4bit`` (NormalFloat4, one absmax per 64 weights; the
embeddings and the LM head stay in the compute dtype), and LoRA trains on top, its
adapters in float32. bitsandbytes >= 0.48 runs this on CPUs too (its CPU library; on
x86 without AVX512 the matmul is a dequantize then ``F.linear``): about 7x less memory for
the quantized weights, and a forward 1.25x slower than float32 on the 2-core AVX2
machine (``python benchmarks/qlora.py``).

On a CPU with avx512_bf16 (AMX included), bitsandbytes' ``Linear4bit`` would repack its
weights in place at the first forward in eval mode without gradients and from then on
compute in bfloat16 through a kernel without a backward (``gemv_4bit``): a QLoRA run's
first rollout would leave the learner without the base's gradient to the activations
(the LoRA layers below the last would train on a partial gradient, silently) and every
forward 4-bit in bf16 whatever the compute dtype. :func:`keep_differentiable` turns that
repacking off (bitsandbytes' own switch, ``support_avx512bf16_for_cpu``), so the 4-bit
product stays a de-quantize then a matmul in the compute dtype on every CPU, as on AVX2.

The bundled fast sampler packs plain weight matrices, so a 4-bit model decodes with the
reference path (:mod:`agentenv.lm.reference`: the model's own forward), which
:func:`agentenv.lm.engines.make_policy` picks with one log line. A checkpoint records the
base's quantization (``trainer_state.json``); ``agentenv export`` then merges the adapter
into the de-quantized 4-bit base, the weights the adapter was trained against.

This module imports torch and bitsandbytes only inside its functions: the configs call
:func:`check_quantize` before any model loads.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from agentenv.errors import InvalidOptionError

QUANTIZATIONS = ("nf4",)
INSTALL = 'bash install.sh --qlora (or pip install "bitsandbytes>=0.48")'


def check_quantize(quantize: str | None, use_lora: bool = True) -> None:
    """Raise unless ``quantize`` is None or one of :data:`QUANTIZATIONS` that can run here
    (bitsandbytes importable) on a LoRA run. Torch-free.

    Raises:
        InvalidOptionError: naming the bad value, or what to install or set.
    """
    if quantize is None:
        return
    if quantize not in QUANTIZATIONS:
        raise InvalidOptionError(
            f"quantize must be one of {QUANTIZATIONS} or None, got {quantize!r}"
        )
    if not use_lora:
        raise InvalidOptionError(
            f"quantize={quantize!r} freezes the base in 4 bits, which only adapters can train "
            "on (QLoRA); set use_lora true, or leave quantize unset to fine-tune every weight"
        )
    if importlib.util.find_spec("bitsandbytes") is None:
        raise InvalidOptionError(
            f"quantize={quantize!r} loads the base through bitsandbytes, which is not "
            f"installed: {INSTALL}"
        )


def quantization_config(quantize: str, dtype: Any) -> Any:
    """transformers' ``BitsAndBytesConfig`` for ``quantize``, computing in ``dtype``."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type=quantize, bnb_4bit_compute_dtype=dtype
    )


def keep_differentiable(model: Any) -> int:
    """Keep every bitsandbytes ``Linear4bit`` of ``model`` on its differentiable path in
    the compute dtype (no CPU repacking into the bf16 inference kernel; see the module
    docstring). Returns how many layers it set."""
    import bitsandbytes as bnb

    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    for layer in layers:
        layer.support_avx512bf16_for_cpu = False
    return len(layers)


def quantization_of(model: Any) -> str | None:
    """The 4-bit type (``"nf4"``) ``model``'s base was loaded with, or None. Reads through
    peft and DDP wrappers to the transformers model's config."""
    for module in model.modules():
        config = getattr(module, "config", None)
        qc = getattr(config, "quantization_config", None)
        if qc is not None:
            qc = qc if isinstance(qc, dict) else qc.to_dict()
            return qc.get("bnb_4bit_quant_type") if qc.get("load_in_4bit") else None
    return None
