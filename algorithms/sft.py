"""Supervised fine-tuning on episodes: masked NLL over the policy's tokens only.

The warm start of the data -> SFT -> GRPO -> eval pipeline. It consumes the same
tokenized episodes as :mod:`algorithms.grpo` (e.g. expert demonstrations replayed
through an env by ``agentenv.demos``), so the loss sees exactly the tokens and masks
RL will see: prompt, tool results and template scaffolding are masked out.

    loss = -sum_t mask_t * log p(x_t | x_<t) / sum_t mask_t      (over the whole batch)
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from transformers import get_scheduler

from agentenv.config import option
from agentenv.episode import collate
from agentenv.errors import InvalidOptionError
from algorithms.grpo import (
    LORA_TARGETS,
    EpisodeLike,
    default_accelerator,
    pack_micro_batches,
)
from algorithms.logprobs import token_logprobs
from algorithms.lora import apply_lora
from algorithms.precision import autocast, compute_dtype


@dataclass
class SFTConfig:
    """Hyper-parameters of :class:`SFT`."""

    learning_rate: float = option(2e-4, "Peak AdamW LR (LoRA adapters want a large LR).")
    epochs: int = option(2, "Passes over the episodes in :meth:`SFT.fit`.")
    batch_size: int = option(16, "Episodes per optimizer step.")
    micro_batch_tokens: int = option(
        1024,
        "Sequences x padded length per forward/backward. 1024 is fastest and leanest on a "
        "CPU (larger batches only add memory); on a GPU raise it (e.g. 16384) for speed.",
    )
    max_grad_norm: float = option(1.0, "Global gradient-norm clip.")
    weight_decay: float = option(0.0, "AdamW weight decay.")
    warmup_steps: int = option(0, "Linear LR warmup, in optimizer steps.")
    lr_scheduler: str = option("constant", "constant | linear | cosine (needs total_steps).")
    total_steps: int | None = option(None, "Optimizer steps, for linear/cosine decay.")
    use_lora: bool = option(True, "Train LoRA adapters (peft); False: full fine-tuning.")
    lora_r: int = option(16, "LoRA rank.")
    lora_alpha: int = option(32, "LoRA scaling numerator (scale = alpha / r).")
    lora_dropout: float = option(0.0, "Dropout on the LoRA input.")
    lora_target_modules: list[str] = option(LORA_TARGETS, "Module names that get adapters.")
    lora_layers: int | None = option(
        None, "Adapt only the last N layers (None: all); backward then stops there (CPU speed)."
    )

    def __post_init__(self) -> None:
        checks = [
            ("learning_rate", self.learning_rate > 0),
            ("epochs", self.epochs >= 1),
            ("batch_size", self.batch_size >= 1),
            ("micro_batch_tokens", self.micro_batch_tokens >= 1),
            ("max_grad_norm", self.max_grad_norm > 0),
            ("lora_r", self.lora_r >= 1),
        ]
        for name, ok in checks:
            if not ok:
                raise InvalidOptionError(f"{name} has an invalid value {getattr(self, name)!r}")
        if self.lr_scheduler not in ("constant", "linear", "cosine"):
            raise InvalidOptionError(
                f"lr_scheduler must be constant, linear or cosine, got {self.lr_scheduler!r}"
            )
        if self.lr_scheduler != "constant" and self.total_steps is None:
            raise InvalidOptionError(f"lr_scheduler={self.lr_scheduler!r} needs total_steps")


def masked_nll(logp: torch.Tensor, action_mask: torch.Tensor, num_tokens: float) -> torch.Tensor:
    """``-sum(logp * mask) / num_tokens``; ``logp`` and ``action_mask`` are ``(N, T)``."""
    return -(logp * action_mask).sum() / num_tokens


class SFT:
    """Masked-NLL fine-tuning: ``SFT(model, tokenizer, config).fit(episodes)``.

    Has the attributes :func:`algorithms.checkpoint.save_checkpoint` needs, so SFT
    checkpoints load with ``PeftModel.from_pretrained(base, ckpt / "adapter")`` and
    ``agentenv train --init-from ckpt``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        config: SFTConfig | None = None,
        accelerator: Accelerator | None = None,
        *,
        seed: int = 0,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.config = cfg = config or SFTConfig()
        self.seed = seed  # the run's: LoRA init and episode shuffling
        self.tokenizer = tokenizer
        self.accelerator = accelerator or default_accelerator(model)
        self.dtype = compute_dtype(model, dtype)  # autocast to it in every forward
        self.step = 0
        if cfg.use_lora:
            model = apply_lora(
                model,
                cfg.lora_r,
                cfg.lora_alpha,
                cfg.lora_dropout,
                cfg.lora_target_modules,
                seed,
                cfg.lora_layers,
            )
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
        name = "constant_with_warmup" if cfg.lr_scheduler == "constant" else cfg.lr_scheduler
        self.scheduler = get_scheduler(
            name, optimizer, num_warmup_steps=cfg.warmup_steps, num_training_steps=cfg.total_steps
        )
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        self._params = params

    @property
    def unwrapped_model(self) -> torch.nn.Module:
        return self.accelerator.unwrap_model(self.model)

    def learn(self, episodes: Sequence[EpisodeLike]) -> dict[str, float]:
        """One optimizer step on ``episodes`` (accumulated over micro-batches)."""
        start = time.perf_counter()
        device = self.accelerator.device
        num_tokens = float(sum(sum(e.action_mask) for e in episodes))
        if num_tokens == 0:
            raise InvalidOptionError("the episodes contain no policy tokens to learn from")
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total_loss = 0.0
        pad = self.tokenizer.pad_token_id
        for idx in pack_micro_batches(
            [len(e.input_ids) for e in episodes], self.config.micro_batch_tokens
        ):
            batch = collate([episodes[i] for i in idx], [0.0] * len(idx), pad)
            ids, attn = batch["input_ids"].to(device), batch["attention_mask"].to(device)
            mask = batch["action_mask"].to(device)  # (N, T)
            with autocast(self.accelerator.device, self.dtype):
                logp = token_logprobs(self.model, ids, attn, action_mask=mask)  # (N, T)
            loss = masked_nll(logp, mask, num_tokens)
            self.accelerator.backward(loss)
            total_loss += loss.item()
        grad_norm = self.accelerator.clip_grad_norm_(self._params, self.config.max_grad_norm)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        elapsed = time.perf_counter() - start
        processed = sum(len(e.input_ids) for e in episodes)
        return {
            "sft/loss": total_loss,
            "sft/grad_norm": float(grad_norm),
            "learning_rate": lr,
            "sft/policy_tokens": num_tokens,
            "tokens_per_second": processed / elapsed,
            "step": float(self.step),
        }

    def fit(self, episodes: Sequence[EpisodeLike], *, progress: bool = True) -> list[dict]:
        """``config.epochs`` shuffled passes of ``batch_size``-episode steps."""
        from tqdm.auto import tqdm

        order = list(range(len(episodes)))
        rng = random.Random(self.seed)
        bs = self.config.batch_size
        steps = self.config.epochs * -(-len(order) // bs)
        history = []
        with tqdm(total=steps, desc="sft", disable=not progress) as bar:
            for _ in range(self.config.epochs):
                rng.shuffle(order)
                for i in range(0, len(order), bs):
                    history.append(self.learn([episodes[j] for j in order[i : i + bs]]))
                    bar.update(1)
                    bar.set_postfix(loss=f"{history[-1]['sft/loss']:.3f}")
        return history

    def save(self, path: str | Path) -> Path:
        """Write the checkpoint atomically (same layout as GRPO's)."""
        from algorithms.checkpoint import save_checkpoint

        return save_checkpoint(self, path)
