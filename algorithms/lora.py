"""LoRA adapters via peft, shared by the algorithms."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model

from agentenv.errors import InvalidOptionError


@contextlib.contextmanager
def quiet_peft() -> Iterator[None]:
    """Silence the one warning peft 0.21 gives whenever it wraps a model: it reads
    ``is_gradient_checkpointing``, a property transformers 5.23 deprecated (a FutureWarning
    nothing on our side or a user's can act on)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*is_gradient_checkpointing", FutureWarning)
        yield


def load_adapter(model: torch.nn.Module, folder: str | Path) -> PeftModel:
    """``model`` with the LoRA adapter saved in ``folder``, trainable."""
    with quiet_peft():
        return PeftModel.from_pretrained(model, str(folder), is_trainable=True)


def apply_lora(
    model: torch.nn.Module,
    r: int,
    alpha: int,
    dropout: float,
    target_modules: Sequence[str],
    seed: int,
    last_layers: int | None = None,
) -> torch.nn.Module:
    """Wrap ``model`` with fresh LoRA adapters, or keep a PeftModel's own adapters trainable.

    A model that already is a :class:`peft.PeftModel` (e.g. loaded from an SFT
    checkpoint to continue with GRPO) is returned as is, only its active adapter
    unfrozen; any other adapter stays frozen. That matters for GRPO's KL reference (see
    :mod:`algorithms.grpo`, "Reference policy"): a fresh adapter (B = 0) uses the
    adapter-disabled base, a warm-started one a frozen copy of itself (the
    ``"reference"`` adapter), and ``reference="base"`` keeps the adapter-disabled base.
    The adapter initialisation is seeded with ``seed`` without touching the caller's RNG.

    ``last_layers=n`` adapts only the top ``n`` transformer layers. Backpropagation then
    stops at the lowest adapted layer, so the backward pass costs about ``n / L`` of a
    full one: the main lever for training on a CPU.

    The LoRA layers are told not to cast their input to the adapters' float32: under
    bf16 autocast their matmuls run in bf16 either way (the same values), and the cast
    made a float32 copy of every adapted layer's input that backward kept (0.13 GB per
    768-token micro-batch on SmolLM2).
    """
    if isinstance(model, PeftModel):  # its active adapter trains; any other stays frozen
        active = f".{model.active_adapter}."
        for name, param in model.named_parameters():
            param.requires_grad_("lora_" in name and active in name)
        return _keep_input_dtype(model)
    layers = None
    if last_layers is not None:
        total = model.config.num_hidden_layers
        if not 1 <= last_layers <= total:
            raise InvalidOptionError(
                f"lora_layers must be in [1, {total}] for this model, got {last_layers}"
            )
        layers = list(range(total - last_layers, total))
    config = LoraConfig(
        task_type="CAUSAL_LM",
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=list(target_modules),
        layers_to_transform=layers,
    )
    with torch.random.fork_rng(), quiet_peft():
        torch.manual_seed(seed)
        return _keep_input_dtype(get_peft_model(model, config))


def _keep_input_dtype(model: torch.nn.Module) -> torch.nn.Module:
    """Turn off peft's cast of each LoRA layer's input to the adapter dtype (see above)."""
    for module in model.modules():
        if hasattr(module, "cast_input_dtype_enabled"):
            module.cast_input_dtype_enabled = False
    return model
