"""QLoRA's base: the model in 4 bits (bitsandbytes NF4) against the same model unquantized.

    python benchmarks/qlora.py                      # SmolLM2-135M-Instruct, float32 compute
    python benchmarks/qlora.py --model /tmp/tiny --tokens 16

Prints, for the base loaded as ``agentenv train --quantize nf4`` loads it and as a plain
run does (the peer), in one process:

* **memory**: the model's weights and buffers (``get_memory_footprint``), and the decoder's
  linear layers alone (what is quantized; the embeddings and the tied LM head are not);
* **distance**: the logits of a chat prompt, max and mean absolute difference, and how
  often the two models' most likely next token agrees over the prompt's positions;
* **speed**: the median seconds of a forward over ``--tokens`` tokens (``--repeats``).

Needs bitsandbytes (``pip install -e ".[qlora]"``). On a busy CPU bitsandbytes' 4-bit
forward slows far more than a float32 one: run it on an idle machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

PROMPT = "What is 17 times 23? Use the calculator, then answer briefly."


def linear_bytes(model: torch.nn.Module) -> int:
    """Bytes of the decoder's linear layers (weights, and bitsandbytes' absmax/code)."""
    total = 0
    for name, module in model.named_modules():
        if ".layers." not in name or not hasattr(module, "weight"):
            continue
        weight = module.weight
        if weight is None or weight.dim() < 1:
            continue
        total += weight.numel() * weight.element_size()
        state = getattr(weight, "quant_state", None)
        if state is not None:
            total += state.absmax.numel() * state.absmax.element_size()
            total += state.code.numel() * state.code.element_size()
    return total


def forward_seconds(model: torch.nn.Module, ids: torch.Tensor, repeats: int) -> float:
    times = []
    with torch.no_grad():
        model(ids)  # warm-up
        for _ in range(repeats):
            t0 = time.perf_counter()
            model(ids)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="float32", help="compute dtype of both")
    p.add_argument("--tokens", type=int, default=64, help="tokens per timed forward")
    p.add_argument("--repeats", type=int, default=8)
    args = p.parse_args()

    from agentenv.lm import models

    plain, tokenizer = models.load(args.model, dtype=args.dtype, device="cpu")
    quant, _ = models.load(args.model, dtype=args.dtype, device="cpu", quantize="nf4")
    chat = [{"role": "user", "content": PROMPT}]
    prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt")
    prompt = prompt if isinstance(prompt, torch.Tensor) else prompt["input_ids"]
    with torch.no_grad():
        a, b = plain(prompt).logits.float(), quant(prompt).logits.float()
    diff = (a - b).abs()
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    ids = torch.randint(
        0, len(tokenizer), (1, args.tokens), generator=torch.Generator().manual_seed(0)
    )
    mib = 2**20
    print(f"# {args.model}, compute {args.dtype}, torch threads {torch.get_num_threads()}")
    print(f"{'':34}{'nf4 (QLoRA base)':>18}{args.dtype:>12}")
    print(
        f"{'model memory MiB':34}{quant.get_memory_footprint() / mib:>18.1f}"
        f"{plain.get_memory_footprint() / mib:>12.1f}"
    )
    print(
        f"{'decoder linear layers MiB':34}{linear_bytes(quant) / mib:>18.1f}"
        f"{linear_bytes(plain) / mib:>12.1f}"
    )
    print(
        f"{f'forward, {args.tokens} tokens, s (median)':34}"
        f"{forward_seconds(quant, ids, args.repeats):>18.3f}"
        f"{forward_seconds(plain, ids, args.repeats):>12.3f}"
    )
    print(
        f"logits over the {prompt.shape[1]}-token prompt: max |diff| {diff.max():.2f}, mean "
        f"{diff.mean():.3f} (mean |logit| {a.abs().mean():.2f}); top-1 agreement {agree:.1%}"
    )


if __name__ == "__main__":
    main()
