"""Run under ``torchrun --nproc_per_node 2``: the sampler of an FSDP2-sharded LoRA model.

Every process builds the same tiny LoRA model, keeps an unsharded copy, shards the other
with torch's ``fully_shard`` (gloo, CPU) and samples from both greedily: the logits of
the sampling copies, the tokens and their log-probs must agree, before and after a weight update.
Prints ``ok RANK`` on success.
"""

import copy

import torch
import torch.distributed as dist
from draws import assert_same_draws  # (this script's folder, tests/helpers)
from peft import LoraConfig, get_peft_model
from torch.distributed.fsdp import fully_shard

from agentenv.lm.backend import SamplingConfig
from agentenv.lm.models import load_tokenizer, tiny_model
from agentenv.lm.sampler import TransformersPolicy


def lora_b(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p for n, p in model.named_parameters() if "lora_B" in n]


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tokenizer = load_tokenizer()
    torch.manual_seed(0)  # the same LoRA init in every process, as loading a checkpoint gives
    model = get_peft_model(tiny_model(tokenizer), LoraConfig(r=4, target_modules=["q_proj"]))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a nonzero update, the same in every process
        for p in lora_b(model):
            p.copy_(torch.randn(p.shape, generator=generator))
    reference = copy.deepcopy(model)
    for layer in model.base_model.model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    assert type(lora_b(model)[0]).__name__ == "DTensor"

    sharded = TransformersPolicy(model, tokenizer, dtype="float32")
    plain = TransformersPolicy(reference, tokenizer, dtype="float32")
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    sampling = SamplingConfig(max_new_tokens=12, temperature=0.0)
    seeds = [rank, rank + 10]  # each process its own rows, as in a multi-process run

    def check() -> torch.Tensor:
        sharded.refresh()
        plain.refresh()
        ids = torch.tensor([prompts[0]])
        logits = sharded.model(input_ids=ids).logits
        diff = (logits - plain.model(input_ids=ids).logits).abs().max()
        assert diff < 1e-5, diff
        got = sharded.generate(prompts, sampling, seeds=seeds)
        want = plain.generate(prompts, sampling, seeds=seeds)
        assert_same_draws(
            got, want, model=reference, prompts=prompts, sampling=sampling, atol=1e-4
        )  # (greedy: tokens part only at a near tie of the top two logits)
        return logits

    before = check()
    with torch.no_grad():  # an "optimizer step" on both: the sampler must pick it up
        for p, q in zip(lora_b(model), lora_b(reference), strict=True):
            p.mul_(-3.0)
            q.mul_(-3.0)
    after = check()
    assert (before - after).abs().max() > 0.1, "the sampling copy did not follow the update"
    dist.destroy_process_group()
    print(f"ok {rank}", flush=True)


if __name__ == "__main__":
    main()
