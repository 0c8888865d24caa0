"""Supervised fine-tuning on episodes: masked NLL over the policy's tokens only.

The warm start of the data -> SFT -> GRPO -> eval pipeline. It consumes the same
tokenized episodes as :mod:`algorithms.grpo` (e.g. expert demonstrations replayed
through an env by ``agentenv.rollout.demos``), so the loss sees exactly the tokens and masks
RL will see: prompt, tool results and template scaffolding are masked out.

    loss = -sum_t mask_t * log p(x_t | x_<t) / sum_t mask_t      (over the whole batch)
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from typing import Any

import torch
from accelerate import Accelerator

from agentenv.errors import InvalidOptionError
from agentenv.lm.precision import autocast
from agentenv.rollout.episode import collate
from algorithms.batching import EpisodeLike, pack_micro_batches
from algorithms.config import SFTConfig
from algorithms.logprobs import token_logprobs
from algorithms.losses import masked_nll
from algorithms.trainer import Trainer


class SFT(Trainer):
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
        config = config or SFTConfig()
        super().__init__(
            model,
            tokenizer,
            config,
            accelerator,
            total_steps=config.total_steps,
            seed=seed,  # the run's: LoRA init and episode shuffling
            dtype=dtype,
        )
        self.config: SFTConfig

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
