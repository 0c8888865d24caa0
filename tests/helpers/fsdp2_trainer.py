"""GRPO checkpoints under accelerate's FSDP2. Run as ``torchrun --nproc_per_node 2
fsdp2_trainer.py OUT fsdp2 KIND...``, or as one unsharded process: ``python
fsdp2_trainer.py OUT plain KIND...`` (each kind in turn, in one launch).

accelerate runs FSDP only on GPUs; on CPU processes its state says MULTI_CPU. Here the
state is switched to FSDP with an FSDP2 plugin before anything is prepared, so
accelerate's own FSDP2 code runs on gloo: ``prepare`` shards the model with
``fully_shard`` (one unit per decoder layer) and points the optimizer at the sharded
parameters, ``no_sync`` and ``clip_grad_norm_`` take the FSDP2 paths.

Every process builds the same tiny model (argv's kind: ``lora``, ``full`` fine-tuning, or
``lora_kl``: LoRA with a KL term to the adapter-disabled base) and the same 4 groups; each
learns on its share for 2 steps and saves a checkpoint; a second trainer, built with another
LoRA init, loads it and learns a third step, then samples greedily through
``TransformersPolicy``. The main process writes the saved weights, the weights after the
third step (gathered), each step's metrics and the sampled tokens and log-probs to OUT,
by kind; a kind's checkpoint is ``OUT`` with the suffix ``.KIND.ckpt``.
"""

import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from safetensors.torch import load_file
from toy_episodes import SAMPLING, TOY_REWARDS, make_groups

from agentenv.lm import weights
from agentenv.lm.backend import SamplingConfig
from agentenv.lm.models import load_tokenizer, tiny_model
from agentenv.lm.sampler import TransformersPolicy
from algorithms.config import GRPOConfig
from algorithms.grpo import GRPO

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9]]


def accelerator(mode: str) -> Accelerator:
    acc = Accelerator(cpu=True)
    if mode == "fsdp2":
        acc.state.distributed_type = DistributedType.FSDP
        acc.state.fsdp_plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2,
            auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
            cpu_ram_efficient_loading=False,
        )
    return acc


def config(kind: str) -> GRPOConfig:
    """lora, full (fine-tuning) or lora_kl (beta > 0: the adapter-disabled reference)."""
    beta = 0.1 if kind == "lora_kl" else 0.0
    return GRPOConfig(use_lora=kind != "full", beta=beta, learning_rate=1e-2, micro_batch_tokens=40)


def trainer(acc: Accelerator, tokenizer, kind: str, seed: int) -> GRPO:
    torch.manual_seed(0)  # the same base weights in every process and every trainer
    model = tiny_model(tokenizer)
    return GRPO(model, tokenizer, config(kind), accelerator=acc, seed=seed, sampling=SAMPLING)


def whole(algo: GRPO) -> dict[str, torch.Tensor]:
    """The trained weights, gathered whole (a collective)."""
    params = algo.unwrapped_model.named_parameters()
    return {name: weights.whole(p).clone() for name, p in params if p.requires_grad}


def main(out: str, mode: str, *kinds: str) -> None:
    tokenizer = load_tokenizer()
    results = {}
    for kind in kinds:  # an accelerator each: one for both left the second model unsharded
        acc = accelerator(mode)
        results[kind] = learn(acc, tokenizer, mode, kind, checkpoint(out, kind))
    if acc.is_main_process:
        torch.save(results, out)
    acc.wait_for_everyone()


def checkpoint(out: str, kind: str) -> Path:
    """Where the run writing ``out`` saves its checkpoint of ``kind``."""
    return Path(out).with_suffix(f".{kind}.ckpt")


def learn(acc: Accelerator, tokenizer, mode: str, kind: str, folder: Path) -> dict | None:
    """One kind's three steps, checkpoint and samples; what the main process saves."""
    use_lora = kind != "full"
    rank, world = acc.process_index, acc.num_processes
    mine = make_groups(TOY_REWARDS)[rank::world]
    algo = trainer(acc, tokenizer, kind, seed=0)
    assert (mode == "fsdp2") == (type(algo._params[0]).__name__ == "DTensor")
    metrics = [algo.learn(mine), algo.learn(mine)]
    algo.save(folder)
    resumed = trainer(acc, tokenizer, kind, seed=1)  # another LoRA init: load must win
    resumed.load(folder)
    # the sampler of the sharded model gathers the whole policy (a collective), built
    # before the third step: generate() must notice the optimizer step and gather again
    policy = TransformersPolicy(resumed.unwrapped_model, tokenizer, dtype="float32")
    greedy = SamplingConfig(max_new_tokens=8, temperature=0.0, stop_strings=[])
    policy.generate(PROMPTS, greedy)
    metrics.append(resumed.learn(mine))
    after = whole(resumed)
    sampled = [(g.token_ids, g.sampler_logprobs) for g in policy.generate(PROMPTS, greedy)]
    if not acc.is_main_process:
        return None
    name = "adapter/adapter_model.safetensors" if use_lora else "model/model.safetensors"
    optimizer = torch.load(folder / "optimizer.pt", weights_only=True)["state"]
    return {
        "saved": load_file(str(folder / name)),
        "after": after,
        "metrics": metrics,
        "sampled": sampled,
        "world": world,
        "keys": sorted({type(key).__name__ for key in optimizer}),
        "steps": sorted({float(s["step"]) for s in optimizer.values()}),
    }


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *(sys.argv[3:] or ["lora"]))
