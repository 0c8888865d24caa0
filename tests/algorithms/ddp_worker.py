"""One process of the 2-process DDP check in test_ddp.py (run by torchrun, or alone).

Every process builds the same tiny model and the same 4 groups, learns one GRPO step on
its share (``groups[rank::world]``) and rank 0 saves the summed gradient and the loss.
"""

import sys

import torch
from toy_episodes import SAMPLING, TOY_REWARDS, make_groups

from agentenv.lm.models import load_tokenizer, tiny_model
from algorithms.config import GRPOConfig
from algorithms.grpo import GRPO


def main(out_path: str, loss_type: str) -> None:
    tokenizer = load_tokenizer()
    cfg = GRPOConfig(loss_type=loss_type, use_lora=False, learning_rate=1e-3, micro_batch_tokens=40)
    algo = GRPO(tiny_model(tokenizer), tokenizer, cfg, sampling=SAMPLING)
    rank, world = algo.accelerator.process_index, algo.accelerator.num_processes
    mine = make_groups(TOY_REWARDS)[rank::world]
    metrics = algo.learn(mine)
    if rank == 0:
        grads = {n: p.grad.clone() for n, p in algo.unwrapped_model.named_parameters()}
        torch.save({"grads": grads, "metrics": metrics, "world": world}, out_path)
    algo.accelerator.wait_for_everyone()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
