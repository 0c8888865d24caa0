"""``agentenv export``: a checkpoint as a plain Hugging Face model folder, ready for vLLM,
TGI, ``pipeline`` or the Hub.

    checkpoint (adapter/ or model/) -> base model + LoRA merged, in float32
    -> OUT/ (config, safetensors weights, tokenizer with its chat template, README)

The merge is done in float32 by default: folded into bfloat16 weights, most of a small
LoRA update rounds away (72% of an SFT adapter's update, by norm, on SmolLM2), so a bf16
export would serve another policy than the one trained.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch

from agentenv.errors import InvalidOptionError
from agentenv.lm.models import DEFAULT_MODEL


def resolve_checkpoint(checkpoint: str | Path, *, say: bool = False) -> Path:
    """``checkpoint`` itself, or for a population's checkpoint (``agentenv train
    --population N``) the folder of its fittest member (with ``say``: one line on stderr
    naming it)."""
    from algorithms.population import best_member, is_population_checkpoint

    checkpoint = Path(checkpoint)
    if not is_population_checkpoint(checkpoint):
        return checkpoint
    folder, index = best_member(checkpoint)
    if say:
        print(
            f"{checkpoint} holds a population: using its fittest member, {folder.name} "
            f"(another member: pass {checkpoint}/member_<i>)",
            file=sys.stderr,
        )
    return folder


def checkpoint_base(checkpoint: str | Path) -> str | None:
    """The base model a checkpoint's LoRA adapter was trained on (``base_model_name_or_path``
    of ``adapter/adapter_config.json``), or None (no adapter, or none recorded)."""
    config = resolve_checkpoint(checkpoint) / "adapter" / "adapter_config.json"
    try:
        return json.loads(config.read_text()).get("base_model_name_or_path") or None
    except (OSError, ValueError):
        return None


def checkpoint_quantize(checkpoint: str | Path) -> str | None:
    """The 4-bit type of the base a checkpoint was trained on (QLoRA), or None."""
    state = resolve_checkpoint(checkpoint) / "trainer_state.json"
    try:
        return json.loads(state.read_text()).get("quantize")
    except (OSError, ValueError):
        return None


def base_model_for(checkpoint: str | Path | None, model: str) -> str:
    """The base model to load for ``checkpoint``: ``model`` if the user chose one (anything
    but the default alias), else the base the adapter records, if it is still there."""
    base = checkpoint_base(checkpoint) if checkpoint else None
    if model != DEFAULT_MODEL or base is None:
        return model
    looks_local = base.startswith((os.sep, ".")) or os.path.isdir(base)
    return base if not looks_local or os.path.isdir(base) else model


def export_checkpoint(
    checkpoint: str | Path, out: str | Path, *, model: str = DEFAULT_MODEL, dtype: str = "float32"
) -> Path:
    """Write ``checkpoint``'s policy to ``out`` as a standalone model; return ``out``.

    Args:
        checkpoint: A folder written by ``agentenv sft`` / ``train`` (``adapter/`` or
            ``model/`` inside; a population's: its fittest member).
        out: The folder to create (must not exist). Written to ``out.tmp-<pid>`` first and
            renamed, so a killed export leaves no half-written model.
        model: The base model; the default alias means "the base the adapter records".
        dtype: ``float32`` (default, exact) or ``bfloat16`` (half the size; rounds away
            most of a small LoRA update).

    Raises:
        InvalidOptionError: ``checkpoint`` is not a checkpoint, ``out`` exists, or ``dtype``
            is not float32 / bfloat16. Checked before any model loads.
    """
    from agentenv.run.recorded import check_checkpoint, checkpoint_env

    check_checkpoint(checkpoint, "CHECKPOINT")
    checkpoint, out = resolve_checkpoint(checkpoint, say=True), Path(out)
    if not ((checkpoint / "adapter").is_dir() or (checkpoint / "model").is_dir()):
        raise InvalidOptionError(
            f"{checkpoint} has neither adapter/ nor model/; pass a checkpoint folder written by "
            "`agentenv sft` or `agentenv train` (e.g. RUN/checkpoints/step_000010)"
        )
    if out.exists():
        raise InvalidOptionError(f"{out} already exists; pass a new folder to export into")
    if dtype not in ("float32", "bfloat16"):
        raise InvalidOptionError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")

    import torch

    from agentenv.lm import models
    from agentenv.run.export import load_from_checkpoint

    base = base_model_for(checkpoint, model)
    quantized = checkpoint_quantize(checkpoint)
    trained_on, env = None, checkpoint_env(checkpoint)
    if env is not None:  # said on stderr and in the export's README
        kwargs = env["env_kwargs"]
        trained_on = env["env_id"] + (f" {json.dumps(kwargs)}" if kwargs else "")
        print(f"note: {checkpoint} trained on {trained_on}", file=sys.stderr)
    policy, tokenizer = models.load(base, dtype="float32", device="cpu", quantize=quantized)
    if quantized:  # the adapter learned against the 4-bit weights: merge into those
        print(
            f"{checkpoint} was trained on a {quantized} base: merging into that base "
            "de-quantized to float32",
            file=sys.stderr,
        )
        policy = policy.dequantize()
    policy = load_from_checkpoint(policy, checkpoint)
    if hasattr(policy, "merge_and_unload"):
        policy = policy.merge_and_unload()  # in float32: the update is kept
    policy = policy.to(getattr(torch, dtype)).eval()
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        policy.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)  # with the chat template the episodes were built with
        (tmp / "README.md").write_text(
            f"# Exported by agentenv\n\nBase model: `{base}`\nCheckpoint: `{checkpoint}`\n"
            f"Weights: LoRA merged in float32"
            + (f" into the {quantized} base, de-quantized" if quantized else "")
            + f", saved as {dtype}.\n"
            + (f"Trained on: `{trained_on}` (agentenv env id and kwargs).\n" if trained_on else "")
            + "\n"
            "```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n"
            f'model = AutoModelForCausalLM.from_pretrained("{out}")\n'
            f'tokenizer = AutoTokenizer.from_pretrained("{out}")\n```\n'
        )
        out.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_from_checkpoint(model: torch.nn.Module, folder: str | Path) -> torch.nn.Module:
    """Apply a checkpoint's weights to a freshly loaded base model.

    A LoRA checkpoint (``folder/adapter``) returns a trainable ``PeftModel``; a full
    checkpoint (``folder/model``) is loaded into ``model`` in place; a population's, its
    fittest member (:func:`resolve_checkpoint`).
    """
    folder = resolve_checkpoint(folder, say=True)
    if (folder / "adapter").is_dir():
        from algorithms.lora import load_adapter

        return load_adapter(model, folder / "adapter")
    if (folder / "model").is_dir():
        from algorithms.checkpoint import load_model_weights

        load_model_weights(model, folder / "model")
        return model
    raise InvalidOptionError(
        f"init_from={str(folder)!r} has neither adapter/ nor model/; pass a checkpoint folder "
        "written by `agentenv sft` or `agentenv train` (e.g. RUN/checkpoints/step_000010)"
    )
