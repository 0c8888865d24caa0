"""One process of the 2-process DDP check in test_ddp.py (run by torchrun, or alone).

Every process builds the same tiny model and the same 4 groups, learns one GRPO step on
its share (``groups[rank::world]``) and rank 0 saves the summed gradient and the loss.
"""

import random
import sys

import torch

from agentenv.models import load_tokenizer, tiny_model
from algorithms.grpo import GRPO, GRPOConfig

REWARDS = [[0, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]]  # two zero-variance groups


def groups() -> list[list[dict]]:
    rng = random.Random(0)
    out = []
    for group in REWARDS:
        eps = []
        for reward in group:
            p, a1, env, a2 = rng.randint(3, 6), rng.randint(2, 6), rng.randint(2, 4), 3
            mask = [0] * p + [1] * a1 + [0] * env + [1] * a2
            ids = [rng.randint(100, 5000) for _ in mask]
            eps.append((ids, mask, float(reward)))
        out.append(eps)
    return out


class Ep:
    def __init__(self, ids, mask, reward):
        self.input_ids, self.action_mask, self.reward = ids, mask, reward
        self.sampler_logprobs = [-1.0 if m else 0.0 for m in mask]


def main(out_path: str, loss_type: str) -> None:
    tokenizer = load_tokenizer()
    cfg = GRPOConfig(loss_type=loss_type, use_lora=False, learning_rate=1e-3, micro_batch_tokens=40)
    algo = GRPO(tiny_model(tokenizer), tokenizer, cfg)
    rank, world = algo.accelerator.process_index, algo.accelerator.num_processes
    mine = [[Ep(*e) for e in g] for g in groups()[rank::world]]
    metrics = algo.learn(mine)
    if rank == 0:
        grads = {n: p.grad.clone() for n, p in algo.unwrapped_model.named_parameters()}
        torch.save({"grads": grads, "metrics": metrics, "world": world}, out_path)
    algo.accelerator.wait_for_everyone()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
