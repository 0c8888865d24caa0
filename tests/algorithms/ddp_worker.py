"""One process of the 2-process DDP checks in test_ddp.py (run by torchrun, or alone).

Every process builds the same tiny model and the same toy episodes and learns one step on
its share; rank 0 saves the summed gradient and the metrics of each job, by job. The jobs
run one after another in one launch (a launch costs more than the jobs):

- ``grpo:LOSS_TYPE``: GRPO on the 4 groups of ``TOY_REWARDS``, share ``groups[rank::world]``.
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


def main(out_path: str, *jobs: str) -> None:
    """Run each job (``grpo:LOSS_TYPE`` or ``sft``); rank 0 saves ``{job: result}``."""
    tokenizer = load_tokenizer()
    results = {job: learn(tokenizer, *job.split(":")) for job in jobs}
    if results[jobs[0]] is not None:  # rank 0
        torch.save(results, out_path)


def learn(tokenizer, mode: str, loss_type: str = "dapo") -> dict | None:
    """One job's step; its gradients, metrics and world size on rank 0, else None."""
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
    algo.accelerator.wait_for_everyone()
    if rank != 0:
        return None
    grads = {n: p.grad.clone() for n, p in algo.unwrapped_model.named_parameters()}
    return {"grads": grads, "metrics": metrics, "world": world}


if __name__ == "__main__":
    main(*sys.argv[1:])
