"""Atomic, resumable checkpoints of a :class:`~algorithms.trainer.Trainer` (GRPO, SFT).

A checkpoint is a folder::

    adapter/               LoRA: the PEFT adapter and the tokenizer;
                           ``AutoPeftModelForCausalLM.from_pretrained(path / "adapter")``
                           loads it with its base (``base_model_name_or_path``)
    model/                 full fine-tuning: the model and tokenizer in Hugging Face format
    optimizer.pt           AdamW state
    scheduler.pt           LR scheduler state
    rng_state.pt           python, numpy, torch (and CUDA) RNG states of the main process
    critic.pt              GRPO with credit="gae": the value head and its optimizer state
    trainer_state.json     {"step": ..., "config": {...GRPOConfig...}, "quantize": "nf4" | null}
    run.json               the run the trainer's ``run_record`` describes, if it has one: the
                           env it trained on and its rollout settings (``agentenv train`` and
                           ``sft`` set it; ``agentenv eval --adapter`` reads it back)
    checkpoint_complete.json   written last: {"step": ...}

Everything is written into ``<path>.tmp-<pid>`` next to the target, fsynced, marked complete
and then renamed into place with :func:`os.replace`, so a killed run leaves either the old
checkpoint or a ``.tmp-`` folder that :func:`latest_checkpoint` never returns.

Parameters sharded by FSDP2 (``fully_shard``, accelerate's ``fsdp_version: 2``) are
gathered whole before the main process writes (collectives: every process saves
together), so the files are the same as an unsharded run's: the trained adapter (or the
whole model) in Hugging Face format, and ``optimizer.pt`` as a full optimizer state keyed
by parameter name (``torch.distributed.checkpoint.state_dict``'s format) instead of
``optimizer.state_dict()``'s positions. Loading puts each process's shard back in place.
Such a checkpoint resumes with or without FSDP2; one saved without sharding resumes
without it (its optimizer state is keyed by position), or seeds a new run's weights.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from peft import set_peft_model_state_dict
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from agentenv.errors import CheckpointError, InvalidOptionError
from agentenv.lm.quantize import quantization_of
from agentenv.lm.weights import is_sharded


class Checkpointable(Protocol):
    """What a checkpoint saves and restores (a :class:`~algorithms.trainer.Trainer` is one):
    the model, its optimizer and LR schedule, the step, the config (its ``use_lora`` and
    LoRA fields must match on load) and any extra state (GRPO's critic)."""

    accelerator: Any  # accelerate's Accelerator: the main process writes
    optimizer: torch.optim.Optimizer
    scheduler: Any  # an LR scheduler (state_dict / load_state_dict)
    tokenizer: Any  # saved beside the weights, so they load on their own
    config: Any  # a dataclass with use_lora and the _MUST_MATCH fields
    step: int

    @property
    def unwrapped_model(self) -> torch.nn.Module: ...

    def extra_state(self) -> dict[str, Any]: ...

    def load_extra_state(self, state: dict[str, Any]) -> None: ...


MARKER = "checkpoint_complete.json"
RUN_FILE = "run.json"  # the trainer's run_record (agentenv.run.recorded)
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
        publish(tmp, path, marker)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # no-op once renamed


def publish(tmp: Path, path: Path, marker: dict[str, Any]) -> None:
    """Make the written folder ``tmp`` the checkpoint ``path``: fsync its files, write the
    completion marker, rename. A checkpoint already at ``path`` (the same step saved again)
    is moved aside first and removed after, so ``path`` always holds a complete one."""
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


_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)  # whole tensors, on the CPU


def _full_state_dict(model: torch.nn.Module, adapters_only: bool) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every sharded tensor gathered whole, on the CPU. A
    collective: every process calls it. LoRA: the adapters' entries, gathered by every
    process (they are small); full fine-tuning: the whole model, to the main process only
    (the others get an empty dict)."""
    if adapters_only:
        state = {}
        for name, value in model.state_dict().items():
            if ".lora_" in name:
                full = getattr(value, "full_tensor", None)
                state[name] = (full() if full is not None else value).detach().cpu()
    else:
        state = get_model_state_dict(model, options=_FULL)
    shared: dict[int, torch.Tensor] = {}  # tied parameters: one tensor under all their
    for name, param in model.named_parameters(remove_duplicate=False):  # names, so
        if name in state:  # save_pretrained writes it once, as for an unsharded model
            state[name] = shared.setdefault(id(param), state[name])
    return state


def save_checkpoint(trainer: Checkpointable, path: str | Path) -> Path:
    """Write ``trainer``'s full state to the folder ``path`` atomically; return ``path``.

    Only the main process writes; every process waits until the folder is in place (and,
    under FSDP2, first takes part in gathering the sharded weights and optimizer state).
    """
    path = Path(path)
    acc = trainer.accelerator
    acc.wait_for_everyone()
    model = trainer.unwrapped_model
    weights_state = optimizer_state = None  # None: read from the unsharded model and optimizer
    if is_sharded(model):
        weights_state = _full_state_dict(model, adapters_only=trainer.config.use_lora)
        optimizer_state = get_optimizer_state_dict(model, trainer.optimizer, options=_FULL)
    error: OSError | None = None
    if acc.is_main_process:

        def write(tmp: Path) -> None:
            weights = tmp / ("adapter" if trainer.config.use_lora else "model")
            if trainer.config.use_lora:  # the trained adapter only (not GRPO's reference)
                model.save_pretrained(
                    weights, selected_adapters=[model.active_adapter], state_dict=weights_state
                )
            else:
                model.save_pretrained(weights, state_dict=weights_state)
            trainer.tokenizer.save_pretrained(weights)  # alongside: loadable on its own
            optimizer = optimizer_state or trainer.optimizer.state_dict()
            torch.save(optimizer, tmp / "optimizer.pt")
            torch.save(trainer.scheduler.state_dict(), tmp / "scheduler.pt")
            torch.save(_rng_state(), tmp / "rng_state.pt")
            for name, value in trainer.extra_state().items():  # e.g. GRPO's critic
                torch.save(value, tmp / f"{name}.pt")
            state = {
                "step": trainer.step,
                "config": dataclasses.asdict(trainer.config),
                "quantize": quantization_of(model),  # QLoRA's 4-bit base, for export
            }
            (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2))
            run = getattr(trainer, "run_record", None)  # set by agentenv train / sft
            if run is not None:
                (tmp / RUN_FILE).write_text(json.dumps(run, indent=2))

        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            _write_atomically(path, write, {"step": trainer.step})
        except OSError as exc:  # e.g. ENOSPC part-way: nothing of it is left behind
            error = exc
    # every process learns whether the write failed (a barrier, as wait_for_everyone)
    failed = acc.reduce(torch.tensor([float(error is not None)], device=acc.device), "sum")
    if failed.item():
        previous = latest_checkpoint(path.parent)
        cause = repr(error) if error is not None else "an error on the main process"
        kept = f"the previous one ({previous}) is intact" if previous else "no earlier one exists"
        raise CheckpointError(
            f"could not write the checkpoint {path} ({cause}); none of it was kept and {kept}. "
            "Free disk space (or fix the folder's permissions), then continue with --resume"
        ) from error
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


def _load_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> tuple[list, list]:
    """``model.load_state_dict(weights, strict=False)``; for FSDP2-sharded parameters each
    process keeps its shard of the whole tensors. Returns ``(missing, unexpected)``."""
    if not is_sharded(model):
        return model.load_state_dict(weights, strict=False)
    names = set(model.state_dict())
    unexpected = [name for name in weights if name not in names]
    known = {name: tensor for name, tensor in weights.items() if name in names}
    options = StateDictOptions(full_state_dict=True, strict=False)
    set_model_state_dict(model, known, options=options)
    return [name for name in names if name not in weights], unexpected


def load_model_weights(model: torch.nn.Module, folder: Path) -> None:
    """Copy HF safetensors weights into ``model``; only tied parameters may be absent."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise InvalidOptionError(f"no *.safetensors weights in {folder}; the checkpoint is broken")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update(load_file(str(file)))
    missing, unexpected = _load_weights(model, weights)
    params = model.state_dict(keep_vars=True)
    loaded = {id(params[name]) for name in weights if name in params}
    untied = [name for name in missing if id(params[name]) not in loaded]
    if untied or unexpected:
        raise InvalidOptionError(
            f"checkpoint weights in {folder} do not fit the model: missing {untied[:5]}, "
            f"unexpected {list(unexpected)[:5]}; pass the same base model as when saving"
        )


def load_checkpoint(trainer: Checkpointable, path: str | Path) -> None:
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
        if is_sharded(model):
            unexpected = _load_weights(model, _with_adapter_name(model, weights))[1]
        else:
            unexpected = set_peft_model_state_dict(model, weights).unexpected_keys
        if unexpected:
            raise InvalidOptionError(f"adapter in {path} has unexpected keys {unexpected[:5]}")
    else:
        load_model_weights(model, path / "model")
    optimizer = torch.load(path / "optimizer.pt", weights_only=True)
    if all(isinstance(key, str) for key in optimizer["state"]):  # keyed by name (FSDP2 runs)
        set_optimizer_state_dict(
            model, trainer.optimizer, optimizer, options=StateDictOptions(full_state_dict=True)
        )
    elif is_sharded(model):
        raise InvalidOptionError(
            f"the optimizer state in {path} is keyed by position (saved without FSDP2), which "
            "cannot be sharded; resume it without FSDP, or start a new run with --init-from"
        )
    else:
        trainer.optimizer.load_state_dict(optimizer)
    trainer.scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    extra = {}
    for name in trainer.extra_state():
        if not (path / f"{name}.pt").is_file():
            raise InvalidOptionError(
                f"checkpoint {path} has no {name}.pt, which this trainer resumes (it was "
                "saved with other settings, e.g. another --credit); resume with the saved "
                "settings, or start a new run from its weights with --init-from"
            )
        extra[name] = torch.load(path / f"{name}.pt", weights_only=True)
    if extra:
        trainer.load_extra_state(extra)
    _set_rng_state(torch.load(path / "rng_state.pt", weights_only=True))
    trainer.step = int(state["step"])


def _with_adapter_name(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> dict:
    """A saved adapter's weights keyed like ``model``'s state dict: peft saves
    ``...lora_A.weight`` for the model's ``...lora_A.<adapter>.weight``."""
    marker = f".{model.active_adapter}."
    keyed, used = {}, set()
    for name in model.state_dict():
        if ".lora_" in name and marker in name:
            head, _, tail = name.rpartition(marker)
            saved = f"{head}.{tail}"
            if saved in weights:
                keyed[name] = weights[saved]
                used.add(saved)
    return {**keyed, **{name: w for name, w in weights.items() if name not in used}}
