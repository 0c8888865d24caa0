"""Atomic, resumable checkpoints of a :class:`~algorithms.trainer.Trainer` (GRPO, SFT).

A checkpoint is a folder::

    adapter/               LoRA: the PEFT adapter and the tokenizer;
                           ``AutoPeftModelForCausalLM.from_pretrained(path / "adapter")``
                           loads it with its base (``base_model_name_or_path``)
    model/                 full fine-tuning: the model and tokenizer in Hugging Face format
    optimizer.pt           AdamW state
    scheduler.pt           LR scheduler state
    rng_state.pt           python, numpy, torch (and CUDA) RNG states of the main process
    trainer_state.json     {"step": ..., "config": {...GRPOConfig...}}
    checkpoint_complete.json   written last: {"step": ...}

Everything is written into ``<path>.tmp-<pid>`` next to the target, fsynced, marked complete
and then renamed into place with :func:`os.replace`, so a killed run leaves either the old
checkpoint or a ``.tmp-`` folder that :func:`latest_checkpoint` never returns.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from peft import set_peft_model_state_dict
from safetensors.torch import load_file

from agentenv.errors import InvalidOptionError

if TYPE_CHECKING:
    from algorithms.trainer import Trainer

MARKER = "checkpoint_complete.json"
_MUST_MATCH = ("use_lora", "lora_r", "lora_alpha", "lora_target_modules", "lora_layers")


def _fsync(path: Path) -> None:
    """Flush a file or a folder's entries to disk (folders: best effort, POSIX only)."""
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if path.is_dir() else 0)
    try:
        fd = os.open(path, flags)
    except OSError:  # e.g. folders on Windows
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomically(path: Path, write: Callable[[Path], None], marker: dict[str, Any]) -> None:
    """Run ``write(tmp)``, fsync everything, write the marker, then rename ``tmp`` to ``path``."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write(tmp)
        for root, _, files in os.walk(tmp):
            for name in files:
                _fsync(Path(root) / name)
            _fsync(Path(root))
        (tmp / MARKER).write_text(json.dumps(marker))
        _fsync(tmp / MARKER)
        _fsync(tmp)
        if path.exists():  # re-saving the same step: move the old one aside first
            old = path.with_name(f"{path.name}.old-{os.getpid()}")
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
        _fsync(path.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # no-op once renamed


def _rng_state() -> dict[str, Any]:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(trainer: Trainer, path: str | Path) -> Path:
    """Write ``trainer``'s full state to the folder ``path`` atomically; return ``path``.

    Only the main process writes; every process waits until the folder is in place.
    """
    path = Path(path)
    acc = trainer.accelerator
    acc.wait_for_everyone()
    if acc.is_main_process:

        def write(tmp: Path) -> None:
            model = trainer.unwrapped_model
            weights = tmp / ("adapter" if trainer.config.use_lora else "model")
            if trainer.config.use_lora:  # the trained adapter only (not GRPO's reference)
                model.save_pretrained(weights, selected_adapters=[model.active_adapter])
            else:
                model.save_pretrained(weights)
            trainer.tokenizer.save_pretrained(weights)  # alongside: loadable on its own
            torch.save(trainer.optimizer.state_dict(), tmp / "optimizer.pt")
            torch.save(trainer.scheduler.state_dict(), tmp / "scheduler.pt")
            torch.save(_rng_state(), tmp / "rng_state.pt")
            state = {"step": trainer.step, "config": dataclasses.asdict(trainer.config)}
            (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2))

        path.parent.mkdir(parents=True, exist_ok=True)
        _write_atomically(path, write, {"step": trainer.step})
    acc.wait_for_everyone()
    return path


def checkpoint_step(path: Path) -> int | None:
    """The step recorded in a complete checkpoint's marker, or None if it is not complete."""
    try:
        return int(json.loads((path / MARKER).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The complete checkpoint folder directly under ``run_dir`` with the highest step.

    Folders without the marker (a run killed while saving) and ``.tmp-``/``.old-`` folders
    are ignored. Returns None when there is none.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return None
    found = []
    for child in run_dir.iterdir():
        if not child.is_dir() or ".tmp-" in child.name or ".old-" in child.name:
            continue
        step = checkpoint_step(child)
        if step is not None:
            found.append((step, child.name, child))
    return max(found)[2] if found else None


def load_model_weights(model: torch.nn.Module, folder: Path) -> None:
    """Copy HF safetensors weights into ``model``; only tied parameters may be absent."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise InvalidOptionError(f"no *.safetensors weights in {folder}; the checkpoint is broken")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update(load_file(str(file)))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    params = model.state_dict(keep_vars=True)
    loaded = {id(params[name]) for name in weights if name in params}
    untied = [name for name in missing if id(params[name]) not in loaded]
    if untied or unexpected:
        raise InvalidOptionError(
            f"checkpoint weights in {folder} do not fit the model: missing {untied[:5]}, "
            f"unexpected {list(unexpected)[:5]}; pass the same base model as when saving"
        )


def load_checkpoint(trainer: Trainer, path: str | Path) -> None:
    """Restore weights, optimizer, scheduler, RNG states and step into ``trainer``.

    The trainer must be built like the saved one (same base model, LoRA settings).

    Raises:
        InvalidOptionError: ``path`` is not a complete checkpoint, or its LoRA settings
            differ from ``trainer.config``.
    """
    path = Path(path)
    if checkpoint_step(path) is None:
        raise InvalidOptionError(
            f"{path} is not a complete checkpoint (no {MARKER}); pass the folder that "
            "latest_checkpoint(run_dir) returns"
        )
    state = json.loads((path / "trainer_state.json").read_text())
    current = dataclasses.asdict(trainer.config)
    for key in _MUST_MATCH:
        if state["config"].get(key) != current[key]:
            raise InvalidOptionError(
                f"checkpoint {path} was saved with {key}={state['config'].get(key)!r}, this "
                f"trainer has {key}={current[key]!r}; build the trainer with the saved setting"
            )
    model = trainer.unwrapped_model
    if trainer.config.use_lora:
        weights = load_file(str(path / "adapter" / "adapter_model.safetensors"))
        result = set_peft_model_state_dict(model, weights)
        if result.unexpected_keys:
            raise InvalidOptionError(
                f"adapter in {path} has unexpected keys {result.unexpected_keys[:5]}"
            )
    else:
        load_model_weights(model, path / "model")
    trainer.optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
    trainer.scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    _set_rng_state(torch.load(path / "rng_state.pt", weights_only=True))
    trainer.step = int(state["step"])
