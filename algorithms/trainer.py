"""What GRPO and SFT share: optimisation and LoRA settings, model preparation, AdamW, the
LR schedule, accelerate, and the checkpoint protocol.

``Trainer(model, tokenizer, config, ...)`` prepares a model for training once, the same
way for every algorithm:

    model -> (grouped attention on a CPU in bf16) -> (gradient checkpointing)
    -> LoRA adapters (peft) or full fine-tuning -> AdamW over the trainable parameters
    -> LR schedule -> accelerator.prepare

An algorithm subclasses it and adds its ``learn`` step. ``save`` / ``load`` write and
restore the whole state atomically (:mod:`algorithms.checkpoint`). Values the run owns
are arguments, not config fields: ``total_steps`` (the horizon of a decaying LR) and
``seed`` (LoRA initialisation).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from peft import PeftModel
from transformers import get_scheduler

from agentenv.errors import InvalidOptionError
from agentenv.lm.attention import use_cpu_bf16_attention
from agentenv.lm.precision import compute_dtype
from algorithms.checkpoint import load_checkpoint, save_checkpoint
from algorithms.config import TrainerConfig, check_schedule, micro_batch_tokens_for
from algorithms.lora import apply_lora


def default_accelerator(model: torch.nn.Module) -> Accelerator:
    """An :class:`~accelerate.Accelerator` on the model's device type.

    A model on the CPU gets ``Accelerator(cpu=True)``: under ``torchrun`` / ``accelerate
    launch`` several CPU processes then train as one (gloo DDP); a plain ``Accelerator()``
    would treat each as a lone process without a GPU, and would move a CPU model to a GPU
    if there is one. Mixed precision is not the accelerator's business here (see
    :mod:`agentenv.lm.precision`).

    accelerate keeps one device per process: once a trainer has run on one device type, a
    model on another is refused here (accelerate would raise for a CPU model after a GPU
    one, and would silently move a GPU model to the CPU after a CPU one).
    """
    from accelerate.state import AcceleratorState, is_initialized

    param = next(model.parameters(), None)
    if param is not None and is_initialized():
        running = AcceleratorState().device.type
        if running != param.device.type:
            raise InvalidOptionError(
                f"the model is on {param.device.type!r}, but accelerate already runs this "
                f"process on {running!r} (an earlier trainer); it keeps one device per "
                f"process: move the model to {running!r}, or train it in a new process"
            )
    return Accelerator(cpu=param is not None and param.device.type == "cpu")


class Trainer:
    """A model prepared for training (see the module docstring); subclasses add ``learn``.

    Attributes:
        model: The trained model as prepared by accelerate (a PeftModel under LoRA).
        optimizer, scheduler: AdamW over trainable parameters and its LR schedule.
        step: Number of completed optimizer steps (restored by :meth:`load`).
        dtype: Compute dtype of every forward (``dtype=`` or the model's weights' dtype;
            see :mod:`agentenv.lm.precision`).
        scaler: torch's ``GradScaler``, enabled in float16 only (dynamic loss scaling).
        micro_batch_tokens: The config's, or where None the default for the device
            (:func:`~algorithms.config.micro_batch_tokens_for`, from the subclass's
            ``micro_batch_defaults``).
    """

    micro_batch_defaults: dict[str, int]  # {"cpu": ..., "gpu": ...}, set by each subclass

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        config: TrainerConfig,
        accelerator: Accelerator | None = None,
        *,
        total_steps: int | None = None,
        seed: int = 0,
        dtype: torch.dtype | None = None,
    ) -> None:
        cfg = self.config = config
        check_schedule(cfg.lr_scheduler, cfg.warmup_steps, total_steps)
        if isinstance(model, PeftModel) and not cfg.use_lora:
            raise InvalidOptionError(
                "use_lora=False (full fine-tuning) got a PeftModel; pass use_lora=True to train "
                "its adapter, or model.merge_and_unload() to fine-tune the merged weights"
            )
        self.tokenizer = tokenizer
        pad = tokenizer.pad_token_id
        self.pad_token_id: int = pad if pad is not None else (tokenizer.eos_token_id or 0)
        self.accelerator = accelerator or default_accelerator(model)
        self.micro_batch_tokens: int = cfg.micro_batch_tokens or micro_batch_tokens_for(
            self.micro_batch_defaults, self.accelerator.device.type
        )
        self.dtype = compute_dtype(model, dtype)  # autocast to it in every forward
        use_cpu_bf16_attention(model, self.dtype)  # the sampler's kernel; 3x faster backward
        self.seed = seed
        self.step = 0
        # {name: object with state_dict() / load_state_dict()}: state of the loop that
        # drives the trainer (a run's task pool), saved and restored with its checkpoints
        self.attached: dict[str, Any] = {}
        if cfg.gradient_checkpointing:
            kwargs = {"use_reentrant": False}
            if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.23
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
            if cfg.use_lora:
                model.enable_input_require_grads()
        self._before_adapters(model)
        if cfg.use_lora:  # a PeftModel (e.g. from SFT) keeps its adapter, made trainable
            model = apply_lora(
                model,
                cfg.lora_r,
                cfg.lora_alpha,
                cfg.lora_dropout,
                cfg.lora_target_modules,
                seed,
                cfg.lora_layers,
            )
        self.total_steps = total_steps
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
        self.scheduler = self._schedule(optimizer)
        # the scheduler is not prepared: accelerate would step it once per process
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        # float16 gradients underflow to zero without loss scaling; a no-op in other dtypes
        self.scaler = torch.amp.GradScaler(
            self.accelerator.device.type, enabled=self.dtype == torch.float16
        )
        # the prepared model's own: FSDP2 replaces the parameters with sharded ones (and
        # points the optimizer at them), so the list above would clip stale tensors
        self._params = [p for p in self.model.parameters() if p.requires_grad]

    def _schedule(self, optimizer: torch.optim.Optimizer) -> Any:
        """The config's LR schedule over ``optimizer`` (a ``LambdaLR``)."""
        cfg = self.config
        name = cfg.lr_scheduler
        if name == "constant" and cfg.warmup_steps:
            name = "constant_with_warmup"
        return get_scheduler(
            name, optimizer, num_warmup_steps=cfg.warmup_steps, num_training_steps=self.total_steps
        )

    def new_optimizer(self, learning_rate: float) -> tuple[torch.optim.Optimizer, Any]:
        """Another AdamW (fresh state) over the same trainable parameters, at peak LR
        ``learning_rate``, with its own schedule: a population member's
        (:mod:`algorithms.population`). The trainer keeps using ``self.optimizer`` until
        the caller swaps it in."""
        optimizer = torch.optim.AdamW(
            self._params, lr=learning_rate, weight_decay=self.config.weight_decay
        )
        scheduler = self._schedule(optimizer)
        return self.accelerator.prepare_optimizer(optimizer), scheduler

    def _before_adapters(self, model: torch.nn.Module) -> None:
        """Hook: see the model as passed in, before any adapter (GRPO's reference copy)."""

    def extra_state(self) -> dict[str, Any]:
        """Hook: more state a checkpoint keeps, ``{name: torch-saveable value}`` (one
        ``<name>.pt`` file each; the float16 loss scale and the ``attached`` objects'
        states here, GRPO's critic in GRPO);
        :meth:`load_extra_state` restores it. Overrides extend ``super()``'s."""
        scaler = {"scaler": self.scaler.state_dict()} if self.scaler.is_enabled() else {}
        return {**scaler, **{name: obj.state_dict() for name, obj in self.attached.items()}}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        """Hook: restore what :meth:`extra_state` saved (the same names)."""
        if self.scaler.is_enabled():
            self.scaler.load_state_dict(state["scaler"])
        for name, obj in self.attached.items():
            obj.load_state_dict(state[name])

    def _global(self, values: list[float], reduction: str) -> list[float]:
        """``values`` reduced (``"sum"`` / ``"max"``) over every process, as float64."""
        tensor = torch.tensor([float(v) for v in values], dtype=torch.float64)
        tensor = tensor.to(self.accelerator.device)
        return self.accelerator.reduce(tensor, reduction=reduction).tolist()

    def _backward(self, loss: torch.Tensor) -> None:
        """Accumulate ``loss``'s gradients: scaled (float16), and summed over processes
        (DDP averages them)."""
        self.accelerator.backward(self.scaler.scale(loss * self.accelerator.num_processes))

    def _clip_and_step(self, max_grad_norm: float) -> float:
        """Unscale, clip to ``max_grad_norm``, step; return the gradient norm before clipping.

        In float16 a step whose gradients overflowed (norm inf or nan) is skipped and the
        loss scale halves (torch's ``GradScaler``); elsewhere this is clip and step.
        """
        self.scaler.unscale_(self.optimizer)
        norm = float(self.accelerator.clip_grad_norm_(self._params, max_grad_norm))
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return norm

    @property
    def unwrapped_model(self) -> torch.nn.Module:
        """The model without distributed wrappers (use it for generation and saving)."""
        return self.accelerator.unwrap_model(self.model)

    def save(self, path: str | Path) -> Path:
        """Write a complete checkpoint atomically (see :mod:`algorithms.checkpoint`)."""
        return save_checkpoint(self, path)

    def load(self, path: str | Path) -> None:
        """Restore weights, optimizer, scheduler, RNG and step from a checkpoint."""
        load_checkpoint(self, path)
