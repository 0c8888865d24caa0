"""Supervised fine-tuning on episodes: masked NLL over the policy's tokens only.

The warm start of the data -> SFT -> GRPO -> eval pipeline. It consumes the same
tokenized episodes as :mod:`algorithms.grpo` (e.g. expert demonstrations replayed
through an env by ``agentenv.rollout.demos``), so the loss sees exactly the tokens and masks
RL will see: prompt, tool results and template scaffolding are masked out.

    loss = -sum_t mask_t * log p(x_t | x_<t) / sum_t mask_t      (over the whole batch)
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Sequence
from typing import Any

import torch
from accelerate import Accelerator

from agentenv.errors import InvalidOptionError
from agentenv.lm.precision import autocast
from algorithms.batching import EpisodeLike, MicroBatch, pack_micro_batches, padding_micro_batch
from algorithms.config import SFT_MICRO_BATCH_TOKENS, SFTConfig
from algorithms.logprobs import token_logprobs
from algorithms.losses import masked_nll
from algorithms.trainer import Trainer


class SFT(Trainer):
    """Masked-NLL fine-tuning: ``SFT(model, tokenizer, config).fit(episodes)``.

    Has the attributes :func:`algorithms.checkpoint.save_checkpoint` needs, so SFT
    checkpoints load with ``PeftModel.from_pretrained(base, ckpt / "adapter")`` and
    ``agentenv train --init-from ckpt``.
    """

    micro_batch_defaults = SFT_MICRO_BATCH_TOKENS

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
        """One optimizer step on ``episodes`` (accumulated over micro-batches).

        Under several processes each passes its own share (shares may differ in size, or be
        empty): the loss is normalised by the policy tokens of all shares and every process
        makes the same number of backward calls, so the step equals one process's on the
        union of the shares.
        """
        start = time.perf_counter()
        acc, device = self.accelerator, self.accelerator.device
        local_tokens = sum(sum(e.action_mask) for e in episodes)
        packs = pack_micro_batches([len(e.input_ids) for e in episodes], self.micro_batch_tokens)
        (num_tokens,) = self._global([local_tokens], "sum")
        (num_batches,) = self._global([len(packs)], "max")
        if num_tokens == 0:
            raise InvalidOptionError("the episodes contain no policy tokens to learn from")
        batches = [
            MicroBatch.from_episodes(
                [episodes[i] for i in idx], [0.0] * len(idx), self.pad_token_id, device
            )
            for idx in packs
        ]
        batches += [padding_micro_batch(self.pad_token_id, device)] * (
            int(num_batches) - len(batches)
        )
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        local_loss = 0.0
        for j, mb in enumerate(batches):
            last = j == len(batches) - 1  # gradients all-reduce on the last backward only
            with contextlib.nullcontext() if last else acc.no_sync(self.model):
                with autocast(device, self.dtype):
                    logp = token_logprobs(
                        self.model, mb.input_ids, mb.attention_mask, action_mask=mb.action_mask
                    )  # (N, T)
                loss = masked_nll(logp, mb.action_mask, num_tokens)
                self._backward(loss)
            local_loss += loss.item()
        lr = self.scheduler.get_last_lr()[0]
        grad_norm = self._clip_and_step(self.config.max_grad_norm)
        self.scheduler.step()
        self.step += 1
        total_loss, processed = self._global(
            [local_loss, sum(len(e.input_ids) for e in episodes)], "sum"
        )
        return {
            "sft/loss": total_loss,
            "sft/grad_norm": float(grad_norm),
            "learning_rate": lr,
            "sft/policy_tokens": num_tokens,
            "tokens_per_second": processed / (time.perf_counter() - start),
            "step": float(self.step),
        }

    def fit(self, episodes: Sequence[EpisodeLike], *, progress: bool = True) -> list[dict]:
        """``config.epochs`` shuffled passes of ``batch_size``-episode steps.

        Every process passes the same ``episodes`` (the same seed shuffles them alike); under
        several processes each learns on its share of every step's batch.
        """
        from tqdm.auto import tqdm

        order = list(range(len(episodes)))
        rng = random.Random(self.seed)
        bs = self.config.batch_size
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        steps = self.config.epochs * -(-len(order) // bs)
        history = []
        with tqdm(total=steps, desc="sft", disable=not progress or rank != 0) as bar:
            for _ in range(self.config.epochs):
                rng.shuffle(order)
                for i in range(0, len(order), bs):
                    share = order[i : i + bs][rank::world]
                    history.append(self.learn([episodes[j] for j in share]))
                    bar.update(1)
                    bar.set_postfix(loss=f"{history[-1]['sft/loss']:.3f}")
        return history
