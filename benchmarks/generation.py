"""Generation speed of every backend variant, side by side with plain HF ``generate``.

One batch = ``--tasks`` Calculator-v0 prompts x ``--group-size`` copies (a GRPO batch's
first turn), up to ``--max-new-tokens`` tokens each at temperature 1.0, in one process,
one variant after another on the same prompts; each variant runs ``--repeats`` times after
one untimed warm-up and the mean is reported::

    HF_HUB_OFFLINE=1 python benchmarks/generation.py              # SmolLM2, 1 task x 8
    python benchmarks/generation.py --tasks 4 --variants hf_fp32,agentenv

Variants (``--variants`` picks some):

* ``hf_fp32``: ``model.generate``, float32, dynamic KV cache -- the baseline.
* ``hf_fp32_lora``: the same through an unmerged LoRA adapter (how training sampled before).
* ``hf_bf16_static``: ``generate`` on a bfloat16 copy with a static KV cache.
* ``agentenv_fp32``: :class:`agentenv.TransformersPolicy` in float32.
* ``agentenv_bf16_noshare``: bfloat16, every row prefills its whole prompt.
* ``agentenv``: the default (``dtype="auto"``, shared prefix), stop tokens only.
* ``agentenv_lora``: the default on a model as GRPO trains it: base weights in the auto
  dtype, a LoRA adapter (r 16, every linear layer, non-zero update) that the sampler keeps
  unmerged (merged into bf16 weights most of a small update would round away).
* ``agentenv_stop``: the default plus the env's stop strings (what rollouts use): fewer
  tokens for the same turns, so compare its seconds per batch, not its tok/s.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from typing import Any

VARIANTS = (
    "hf_fp32",
    "hf_fp32_lora",
    "hf_bf16_static",
    "agentenv_fp32",
    "agentenv_bf16_noshare",
    "agentenv",
    "agentenv_lora",
    "agentenv_stop",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--model", default="smollm2-135m-instruct", help="alias or local folder")
    p.add_argument("--tasks", type=int, default=1, help="different prompts per batch")
    p.add_argument("--group-size", type=int, default=8, help="copies of each prompt")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2, help="timed runs per variant")
    p.add_argument("--source", default="basic_arithmetic", help="Calculator task source")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    unknown = sorted(set(args.variants.split(",")) - set(VARIANTS))
    if unknown:
        p.error(f"unknown variant(s) {unknown}; choose from {', '.join(VARIANTS)}")
    for name in ("tasks", "group_size", "max_new_tokens", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def prompts(args: argparse.Namespace, tokenizer: Any) -> tuple[list[list[int]], list[str]]:
    """The batch's token prompts and the env's stop strings."""
    import agentenv
    from agentenv.rollout.episode import ChatFormat

    env = agentenv.make("Calculator-v0", split="train", source=args.source)
    fmt = ChatFormat(tokenizer)
    batch = []
    for task in range(args.tasks):
        obs, _ = env.reset(options={"task_id": task})
        batch += [fmt.prompt_ids(obs)] * args.group_size
    stops = list(env.unwrapped.stop_strings)
    env.close()
    return batch, stops


def hf_generate(model: Any, tokenizer: Any, batch: list[list[int]], args: Any, **kw: Any) -> int:
    """Plain ``generate`` on a left-padded batch; returns the tokens it generated."""
    import torch

    width = max(map(len, batch))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=args.max_new_tokens,
            do_sample=True,
            temperature=1.0,
            top_k=None,
            top_p=None,
            pad_token_id=pad,
            **kw,
        )
    new = out[:, width:]
    eos = tokenizer.eos_token_id
    return sum(
        int((row == eos).nonzero()[0, 0]) + 1 if (row == eos).any() else len(row) for row in new
    )


def main(argv: list[str] | None = None) -> int:
    import torch

    from agentenv import SamplingConfig, TransformersPolicy, resolve_dtype
    from agentenv.lm import models
    from algorithms import GRPOConfig, apply_lora

    args = parse_args(argv)
    model, tokenizer = models.load(args.model, dtype="float32")
    batch, stops = prompts(args, tokenizer)
    auto = resolve_dtype("auto", "cpu")
    sampling = SamplingConfig(args.max_new_tokens, temperature=1.0, stop_strings=[])
    with_stops = SamplingConfig(args.max_new_tokens, temperature=1.0, stop_strings=stops)

    def policy_run(policy: TransformersPolicy, s: SamplingConfig) -> Any:
        return lambda: sum(len(g.token_ids) for g in policy.generate(batch, s))

    runs: dict[str, Any] = {}
    chosen = args.variants.split(",")
    if "hf_fp32" in chosen:
        runs["hf_fp32"] = lambda: hf_generate(model, tokenizer, batch, args)
    if "hf_fp32_lora" in chosen:
        lora = apply_lora(copy.deepcopy(model), 16, 32, 0.0, ["q_proj", "v_proj"], args.seed)
        runs["hf_fp32_lora"] = lambda: hf_generate(lora, tokenizer, batch, args)
    if "hf_bf16_static" in chosen:
        bf16 = copy.deepcopy(model).to(torch.bfloat16)
        runs["hf_bf16_static"] = lambda: hf_generate(
            bf16, tokenizer, batch, args, cache_implementation="static"
        )
    if "agentenv_fp32" in chosen:
        policy = TransformersPolicy(model, tokenizer, dtype="float32")
        runs["agentenv_fp32"] = policy_run(policy, sampling)
    if "agentenv_bf16_noshare" in chosen:
        policy = TransformersPolicy(model, tokenizer, dtype="bfloat16", share_prefix=False)
        runs["agentenv_bf16_noshare"] = policy_run(policy, sampling)
    default = TransformersPolicy(model, tokenizer)
    if "agentenv" in chosen:
        runs["agentenv"] = policy_run(default, sampling)
    if "agentenv_lora" in chosen:
        base = copy.deepcopy(model).to(auto)
        trained = apply_lora(base, 16, 32, 0.0, GRPOConfig().lora_target_modules, args.seed)
        gen = torch.Generator().manual_seed(args.seed)  # the same adapter every run
        with torch.no_grad():  # an adapter that has been trained a little
            for name, p in trained.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 1e-3, generator=gen)
        runs["agentenv_lora"] = policy_run(TransformersPolicy(trained, tokenizer), sampling)
    if "agentenv_stop" in chosen:
        runs["agentenv_stop"] = policy_run(default, with_stops)

    results = {}
    for name, run in runs.items():
        torch.manual_seed(args.seed)
        run()  # warm-up
        seconds, tokens = [], []
        for r in range(args.repeats):
            torch.manual_seed(args.seed + 1 + r)
            start = time.perf_counter()
            tokens.append(run())
            seconds.append(time.perf_counter() - start)
        results[name] = (statistics.mean(seconds), statistics.mean(tokens))
        print(f"== {name}: {results[name][1] / results[name][0]:.1f} tok/s", file=sys.stderr)

    print(
        f"Generation benchmark: {args.model}, {args.tasks} task(s) x {args.group_size}, "
        f"<= {args.max_new_tokens} new tokens, temperature 1.0, prompt {len(batch[0])} tokens, "
        f"torch threads {torch.get_num_threads()}, auto dtype here: {auto}"
    )
    base = results.get("hf_fp32")
    print(f"{'variant':24}{'s/batch':>10}{'tokens':>10}{'tok/s':>10}{'vs hf_fp32':>12}")
    for name, (sec, tok) in results.items():
        speed = f"{(tok / sec) / (base[1] / base[0]):.2f}x" if base else "-"
        print(f"{name:24}{sec:>10.2f}{tok:>10.0f}{tok / sec:>10.1f}{speed:>12}")
    if base and "agentenv_stop" in results:
        sec = results["agentenv_stop"][0]
        print(f"\nbatch wall time, hf_fp32 / agentenv_stop: {base[0] / sec:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
