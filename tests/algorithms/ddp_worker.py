"""One process of the 2-process DDP checks in test_ddp.py (run by torchrun, or alone).

Every process builds the same tiny model and the same toy episodes and learns one step on
its share; rank 0 saves the summed gradient and the metrics.

- ``grpo LOSS_TYPE``: GRPO on the 4 groups of ``TOY_REWARDS``, share ``groups[rank::world]``.
- ``sft``: SFT on 9 episodes split unevenly (rank 0: 7, rank 1: 2), so the processes have
  different numbers of micro-batches and policy tokens.
"""

import sys

import torch
from toy_episodes import SAMPLING, TOY_REWARDS, make_groups

from agentenv.lm.models import load_tokenizer, tiny_model
from algorithms.config import GRPOConfig, SFTConfig
from algorithms.grpo import GRPO
from algorithms.sft import SFT

SFT_SPLIT = 7  # rank 0 learns on the first 7 episodes, rank 1 on the last 2


def main(out_path: str, mode: str, loss_type: str = "dapo") -> None:
    tokenizer = load_tokenizer()
    if mode == "grpo":
        cfg = GRPOConfig(
            loss_type=loss_type, use_lora=False, learning_rate=1e-3, micro_batch_tokens=40
        )
        algo = GRPO(tiny_model(tokenizer), tokenizer, cfg, sampling=SAMPLING)
    else:
        cfg = SFTConfig(use_lora=False, learning_rate=1e-3, micro_batch_tokens=40)
        algo = SFT(tiny_model(tokenizer), tokenizer, cfg)
    rank, world = algo.accelerator.process_index, algo.accelerator.num_processes
    if mode == "grpo":
        metrics = algo.learn(make_groups(TOY_REWARDS)[rank::world])
    else:
        episodes = [ep for group in make_groups([[0, 0, 0]] * 3, seed=4) for ep in group]
        share = [episodes[:SFT_SPLIT], episodes[SFT_SPLIT:]][rank] if world == 2 else episodes
        metrics = algo.learn(share)
    if rank == 0:
        grads = {n: p.grad.clone() for n, p in algo.unwrapped_model.named_parameters()}
        torch.save({"grads": grads, "metrics": metrics, "world": world}, out_path)
    algo.accelerator.wait_for_everyone()


if __name__ == "__main__":
    main(*sys.argv[1:])
