"""Drafted tokens (prompt lookup) on and off, collecting the same tasks in turn.

    python benchmarks/drafting.py --init-from runs/rag_sft/checkpoint  # RAG recipe's SFT policy
    python benchmarks/drafting.py --env Calculator-v0 --env-kwargs '{"source": "word_problems"}'

Collects ``--tasks`` tasks x ``--group-size`` episodes (the RAG recipe's rollout settings
by default: compact prompt, 3 turns of up to 48 tokens, temperature 0.7, lock-step
collection; ``--batching continuous`` for the rollout engine), with the
sampler's drafts off (``draft_tokens=0``) and on (``--draft-tokens``), alternating, for
``--rounds`` rounds of two task sets, in one process. It prints each collection's
prefill and decoding seconds and the tokens a row took per decode step, then the
totals: decoding with drafts against without. In float32 both collect the same
episodes; in bfloat16 the verifying forward rounds differently, so episodes may differ
(the table says so where the token counts differ). Drafts pay where the policy copies
its context: after SFT on RAG-v0, not much for the base model at temperature 1.0.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from _common import peak_memory, torch_threads


def collect_once(policy: Any, fmt: Any, args: argparse.Namespace, tasks: list[int]) -> dict:
    import agentenv

    config = agentenv.RolloutConfig(
        group_size=args.group_size,
        max_turns=args.max_turns,
        max_episode_tokens=1024,
        sampling=agentenv.SamplingConfig(args.max_new_tokens, temperature=args.temperature),
        show_progress=False,
        batching=args.batching,
    )
    kwargs = json.loads(args.env_kwargs)
    t0 = time.perf_counter()
    groups, m = agentenv.collect(
        lambda: agentenv.make(args.env, split="train", **kwargs),
        tasks,
        policy,
        fmt,
        config,
        options=[{"task_id": i} for i in tasks],
        sample_seed=args.seed,
    )
    m["wall_s"] = time.perf_counter() - t0
    return m


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument(
        "--init-from", default=None, help="a checkpoint folder (adapter/ or model/)"
    )
    parser.add_argument("--env", default="RAG-v0")
    parser.add_argument("--env-kwargs", default='{"prompt_style": "compact"}')
    parser.add_argument("--tasks", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--draft-tokens", type=int, default=4)
    parser.add_argument("--batching", default="lockstep", choices=["lockstep", "continuous"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--seed", type=int, default=5)
    args = parser.parse_args()
    if args.draft_tokens < 1 or args.rounds < 1:
        parser.error(
            f"--draft-tokens and --rounds must be >= 1, got {args.draft_tokens}, {args.rounds}"
        )

    import torch

    import agentenv
    from agentenv.lm import models
    from agentenv.lm.sampler import TransformersPolicy

    model, tokenizer = models.load(args.model, dtype=torch.float32, device="cpu")
    if args.init_from:
        from agentenv.run.export import load_from_checkpoint

        model = load_from_checkpoint(model, args.init_from)
    policy = TransformersPolicy(model, tokenizer, dtype=args.dtype)
    fmt = agentenv.ChatFormat(tokenizer)
    print(
        f"# {args.model}{' + ' + args.init_from if args.init_from else ''}, {args.env}, "
        f"{policy.dtype}, torch threads {torch_threads()}, torch {torch.__version__}"
    )
    print(
        f"{'drafts':>6} {'tasks':>6} {'wall s':>7} {'prefill s':>9} {'decode s':>8} "
        f"{'tokens':>6} {'decode tok/s':>12} {'tok/step':>8}"
    )
    totals: dict[int, list[float]] = {0: [0.0, 0.0], args.draft_tokens: [0.0, 0.0]}
    counts: dict[int, list[float]] = {0: [], args.draft_tokens: []}
    for _ in range(args.rounds):
        for first in (0, 10 * args.tasks):
            tasks = list(range(first, first + args.tasks))
            for k in (0, args.draft_tokens):
                policy.draft_tokens = k
                m = collect_once(policy, fmt, args, tasks)
                decode = m["rollout/generate_s"] - m["rollout/prefill_s"]
                totals[k][0] += decode
                totals[k][1] += m["rollout/tokens"]
                counts[k].append(m["rollout/tokens"])
                print(
                    f"{k:>6} {tasks[0]:>6} {m['wall_s']:>7.1f} {m['rollout/prefill_s']:>9.1f} "
                    f"{decode:>8.1f} {m['rollout/tokens']:>6.0f} "
                    f"{m['rollout/tokens'] / decode:>12.1f} {m['rollout/tokens_per_step']:>8.2f}",
                    flush=True,
                )
    off, on = totals[0], totals[args.draft_tokens]
    print(
        f"decoding: {off[0]:.1f} s without drafts, {on[0]:.1f} s with up to {args.draft_tokens} "
        f"({off[1] / off[0]:.1f} vs {on[1] / on[0]:.1f} tok/s: {off[0] / on[0]:.2f}x)"
        + ("" if counts[0] == counts[args.draft_tokens] else "  (token counts differ)")
    )
    print(f"peak RSS {peak_memory('cpu')['peak_rss_mb']:.0f} MiB")


if __name__ == "__main__":
    main()
