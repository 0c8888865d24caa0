"""Where GRPO's learn phase goes: ``GRPO.learn`` on one fixed batch, split by kind of work.

    python benchmarks/learn_phase.py                               # RAG-v0 recipe's shapes
    python benchmarks/learn_phase.py --micro-batch-tokens 768 3072 # two budgets, one run
    python benchmarks/learn_phase.py --turns 20:0 --prompt 108     # a short one-turn episode
    python benchmarks/learn_phase.py --shared-turns 1 --paths tree prompt  # a group's trees

The batch has a real run's shapes and synthetic contents: ``--groups`` groups of
``--group-size`` episodes, each group sharing a ``--prompt``-token prompt, each episode
the ``--turns`` ``POLICY:ENV`` pairs (policy tokens, then the environment's reply). The
defaults are examples/rag_grpo.yaml's mean episode (docs/reproduce.md#rag-v0: 106 prompt
tokens, a search, 277 tokens of passages, an answer; 53 policy tokens in all, split 20 +
33 here). Random token ids and rewards (no group has equal rewards, so none is dropped),
the default SmolLM2-135M-Instruct with GRPO's default LoRA, in the compute dtype
``--dtype`` gives. With ``--shared-turns K`` the episodes of a group also share their first
K turns (RAG-v0's groups often share their first search call and its passages), which
the learn phase can run once as a prefix tree (:mod:`algorithms.prefix_tree`).

``--paths`` picks how micro-batches run, each timed on the same batch: ``tree`` (GRPO's
own choice: a prefix tree where it holds at most ``TREE_BELOW`` of the tokens, else the
rows after their common prefix) and ``prompt`` (always the rows after their common
prefix: the path before prefix trees).

For each micro-batch budget: the learn phase's time (median of ``--repeats`` after a
warm-up) and peak RSS, then one learn under torch's profiler (CPU only), its operators'
own time split into

* **linear layers**: the model's frozen projections (forward and input gradients; a
  group's shared prompt runs once per micro-batch: random contents share nothing more),
* **LoRA**: the adapters' rank-r matmuls (any matmul with a dimension equal to r),
* **LM head**: on the policy tokens only,
* **attention matmuls** (scores and outputs; or the fused kernel, whose GFLOP are not
  counted, where a large micro-batch sends attention to it) and **attention scores'
  elementwise work** (scaling, masking, softmax and their gradients: operators on tensors
  of 4 or more dimensions whose last is not the head size),
* **other**: norms, rotary embeddings, activations, residual adds, casts, the optimizer
  and autograd's bookkeeping.

The peer is the machine: a plain matmul of the model's largest linear shape at a
micro-batch's row count, timed alone in the same run (its fastest of 50 calls). Each
kind of matmul's GFLOP/s is set against it, and "matmuls at the plain rate" is the time
the learn phase would take if every matmul ran at that rate and nothing else took any.
The profiler's overhead makes the profiled learn slower than the timed ones; the shares
are what to read. Profiling a large budget takes far more memory than the learn itself
(3072 tokens on SmolLM2: 13.9 GB against 4.7 GB); the peak RSS printed is the process's
so far, before that budget's profile.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from types import SimpleNamespace
from typing import Any

from _common import peak_memory, torch_threads

PARTS = (
    "linear layers",
    "LoRA",
    "LM head",
    "attention matmuls",
    "attention scores' elementwise",
    "other",
)
MATMULS = {"aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm"}
FUSED_ATTENTION = ("scaled_dot_product", "flash_attention", "efficient_attention")


def parse_turns(text: str) -> list[tuple[int, int]]:
    """``"20:277,33:0"`` -> ``[(20, 277), (33, 0)]`` (policy tokens, env tokens per turn)."""
    try:
        turns = [tuple(int(n) for n in part.split(":")) for part in text.split(",")]
    except ValueError:
        turns = []
    if not turns or any(len(t) != 2 or t[0] < 1 or t[1] < 0 for t in turns):
        raise argparse.ArgumentTypeError(
            f"expected POLICY:ENV token counts per turn, e.g. 20:277,33:0, got {text!r}"
        )
    return turns  # type: ignore[return-value]


def make_batch(args: argparse.Namespace, vocab: int, rng: random.Random) -> list[list[Any]]:
    """``groups`` x ``group_size`` episodes of the requested shape, random ids and rewards."""

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1000, vocab) for _ in range(n)]

    groups = []
    for _ in range(args.groups):
        prompt = tokens(args.prompt)
        shared = [(tokens(p), tokens(e)) for p, e in args.turns[: args.shared_turns]]
        group = []
        for _ in range(args.group_size):
            ids, mask = list(prompt), [0] * len(prompt)
            for k, (policy, env) in enumerate(args.turns):
                turn = shared[k] if k < len(shared) else (tokens(policy), tokens(env))
                ids += turn[0] + turn[1]
                mask += [1] * policy + [0] * env
            logprobs = [-1.0 if m else 0.0 for m in mask]
            group.append(
                SimpleNamespace(
                    input_ids=ids, action_mask=mask, sampler_logprobs=logprobs, reward=rng.random()
                )
            )
        groups.append(group)
    return groups


def part_of(name: str, shapes: list[list[int]], model: SimpleNamespace) -> str:
    """Which of :data:`PARTS` an operator's own time belongs to."""
    dims = [d for shape in shapes if shape for d in shape]
    if any(kernel in name for kernel in FUSED_ATTENTION):
        return "attention matmuls"
    if name in MATMULS:
        if model.vocab in dims:
            return "LM head"
        if model.rank in dims:
            return "LoRA"
        return "attention matmuls" if "bmm" in name else "linear layers"
    first = shapes[0] if shapes else []
    if len(first) >= 4 and first[-1] != model.head_dim:
        return "attention scores' elementwise"
    return "other"


def matmul_flops(name: str, shapes: list[list[int]]) -> float:
    """Floating-point operations of one matmul call from its input shapes."""
    a, b = (shapes[1], shapes[2]) if name in ("aten::addmm", "aten::baddbmm") else shapes[:2]
    batch = a[0] if len(a) == 3 else 1
    return 2.0 * batch * a[-2] * a[-1] * b[-1]


def plain_matmul_gflops(rows: int, hidden: int, inner: int, dtype: Any, device: str) -> float:
    """GFLOP/s of ``(rows, hidden) @ (hidden, inner)`` alone: its fastest of 50 calls after
    10 warm-up ones (what the kernel gives when nothing else intervenes)."""
    import torch

    a = torch.randn(rows, hidden, dtype=dtype, device=device)
    b = torch.randn(hidden, inner, dtype=dtype, device=device)
    times = []
    for i in range(60):
        start = time.perf_counter()
        a @ b
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        if i >= 10:
            times.append(time.perf_counter() - start)
    return 2.0 * rows * hidden * inner / min(times) / 1e9


def profile_learn(algo: Any, batch: list[list[Any]], model: SimpleNamespace) -> dict[str, Any]:
    """One profiled learn: own time (s) and matmul GFLOP per part."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        algo.learn(batch)
    seconds = dict.fromkeys(PARTS, 0.0)
    flops = dict.fromkeys(PARTS, 0.0)
    for event in prof.key_averages(group_by_input_shape=True):
        shapes = [list(s) for s in event.input_shapes]
        part = part_of(event.key, shapes, model)
        seconds[part] += event.self_cpu_time_total / 1e6
        if event.key in MATMULS:
            flops[part] += matmul_flops(event.key, shapes) * event.count
    return {"seconds": seconds, "flops": flops}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=4, help="B: tasks in the batch")
    parser.add_argument("--group-size", type=int, default=8, help="G: episodes per task")
    parser.add_argument("--prompt", type=int, default=106, help="prompt tokens (shared)")
    parser.add_argument(
        "--turns",
        type=parse_turns,
        default=parse_turns("20:277,33:0"),
        help="POLICY:ENV tokens per turn, comma-separated",
    )
    parser.add_argument(
        "--micro-batch-tokens",
        type=int,
        nargs="+",
        default=[None],
        help="budgets to compare (default: GRPO's default for the device)",
    )
    parser.add_argument(
        "--shared-turns", type=int, default=0, help="turns every episode of a group shares"
    )
    parser.add_argument(
        "--paths",
        nargs="+",
        default=["tree"],
        choices=["tree", "prompt"],
        help="tree: GRPO's choice (a prefix tree where it pays); prompt: rows after their "
        "common prefix only",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed learns per budget")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="cpu", help="where the model trains: cpu, cuda")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for name, value, least in [
        ("--groups", args.groups, 1),
        ("--group-size", args.group_size, 2),  # GRPO compares episodes within a group
        ("--prompt", args.prompt, 1),
        ("--shared-turns", args.shared_turns, 0),
        ("--repeats", args.repeats, 1),
        *[("--micro-batch-tokens", b, 1) for b in args.micro_batch_tokens if b is not None],
    ]:
        if value < least:
            parser.error(f"{name} must be >= {least}, got {value}")
    if args.shared_turns > len(args.turns):
        parser.error(
            f"--shared-turns must be <= the {len(args.turns)} turns, got {args.shared_turns}"
        )

    import torch

    import agentenv
    from agentenv.lm import models
    from agentenv.lm.precision import training_dtype
    from algorithms import GRPO, GRPOConfig, logprobs
    from algorithms.batching import pack_prefix_trees

    torch.manual_seed(args.seed)
    compute = agentenv.resolve_dtype(args.dtype, args.device)
    model, tokenizer = models.load(
        args.model, dtype=training_dtype(compute, use_lora=True), device=args.device
    )
    config = GRPOConfig()
    algo = GRPO(
        model,
        tokenizer,
        config,
        sampling=agentenv.SamplingConfig(48, temperature=0.7),
        seed=args.seed,
        dtype=compute,
    )
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    shape = SimpleNamespace(vocab=c.vocab_size, rank=config.lora_r, head_dim=head_dim)
    batch = make_batch(args, c.vocab_size, random.Random(args.seed))
    episode = len(batch[0][0].input_ids)
    policy = sum(p for p, _ in args.turns)
    print(
        f"# {args.model}, {args.device}, {compute}, torch threads {torch_threads()}, "
        f"torch {torch.__version__}"
    )
    print(
        f"# {args.groups} x {args.group_size} episodes of {episode} tokens ({args.prompt} "
        f"prompt, {policy} policy, {episode - args.prompt - policy} environment)"
    )
    default, tree_below = algo.micro_batch_tokens, logprobs.TREE_BELOW
    for budget, path in ((b, p) for b in args.micro_batch_tokens for p in args.paths):
        algo.micro_batch_tokens = budget or default
        logprobs.TREE_BELOW = tree_below if path == "tree" else 0.0  # 0: never a tree
        algo.learn(batch)  # warm-up
        if args.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            algo.learn(batch)
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        packs = pack_prefix_trees(  # as GRPO packs them: a group's prompt counted once
            [list(zip(ep.input_ids, ep.action_mask, strict=True)) for g in batch for ep in g],
            algo.micro_batch_tokens,
        )
        rows = min(len(packs[0]) * (episode - args.prompt), 4096)  # after the shared prompt
        plain = plain_matmul_gflops(rows, c.hidden_size, c.intermediate_size, compute, args.device)
        memory = peak_memory(args.device)
        gpu = memory.get("peak_gpu_mb")
        print(
            f"\n## micro_batch_tokens {algo.micro_batch_tokens} ({len(packs)} micro-batches of "
            f"up to {len(packs[0])} episodes), path {path}: learn "
            f"{statistics.median(times):.2f} s (median of {args.repeats}; "
            f"{', '.join(f'{t:.2f}' for t in times)}), peak RSS {memory['peak_rss_mb'] or 0:.0f} "
            "MiB (of the process so far)" + (f", peak GPU {gpu:.0f} MiB" if gpu else "")
        )
        print(
            f"plain ({rows}, {c.hidden_size}) @ ({c.hidden_size}, {c.intermediate_size}) "
            f"matmul alone: {plain:.0f} GFLOP/s"
        )
        if not args.device.startswith("cpu"):
            continue
        prof = profile_learn(algo, batch, shape)
        total = sum(prof["seconds"].values())
        print(f"profiled learn: {total:.2f} s of operators' own time")
        print(f"{'part':<31} {'s':>6} {'share':>6} {'GFLOP':>7} {'GFLOP/s':>8} {'of plain':>8}")
        for part in PARTS:
            sec, f = prof["seconds"][part], prof["flops"][part] / 1e9
            rate = f"{f / sec:>8.0f} {f / sec / plain:>8.0%}" if f and sec else f"{'':>8} {'':>8}"
            print(f"{part:<31} {sec:>6.2f} {sec / total:>6.0%} {f:>7.0f} {rate}")
        all_flops = sum(prof["flops"].values()) / 1e9
        print(
            f"matmuls at the plain rate: {all_flops / plain:.2f} s for {all_flops:.0f} GFLOP "
            f"({all_flops / plain / total:.0%} of the profiled time)"
        )
    logprobs.TREE_BELOW = tree_below


if __name__ == "__main__":
    main()
