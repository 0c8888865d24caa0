"""float32 against bfloat16 on this machine: which compute dtype trains and samples faster.

    HF_HUB_OFFLINE=1 python benchmarks/cpu_dtype.py
    python benchmarks/cpu_dtype.py --repeats 5 --max-new-tokens 96

``--dtype auto`` (:func:`agentenv.lm.precision.cpu_prefers_bf16`) picks bfloat16 on a CPU
only where it should be the faster of the two; this script measures that on the machine it
runs on, both dtypes in one process, one after the other:

* **plain matmul**: the model's largest linear shape at 2,048 rows (a learn phase's
  micro-batch), fastest of 50 calls, GFLOP/s;
* **learn**: ``GRPO.learn`` on learn_phase.py's default batch (4 x 8 RAG-v0-shaped
  episodes of random tokens), the default LoRA on a base loaded in that dtype, median of
  ``--repeats`` after a warm-up;
* **sample**: :class:`agentenv.TransformersPolicy` drawing ``--rows`` continuations of a
  Calculator-v0 prompt, up to ``--max-new-tokens`` each, median tokens per second of
  ``--repeats`` after a warm-up (the two dtypes may draw other tokens: compare tok/s).

The last column is bfloat16's time over float32's (below 1: bfloat16 is faster). The
end-to-end check is ``agentenv quickstart --dtype float32`` against ``--dtype bfloat16``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from _common import torch_threads
from learn_phase import make_batch, parse_turns, plain_matmul_gflops


def timed(run: Any, repeats: int) -> tuple[float, Any]:
    """Median seconds of ``repeats`` calls after one untimed call, and the last result."""
    run()
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = run()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def measure(args: argparse.Namespace, dtype: str) -> dict[str, float]:
    import torch

    import agentenv
    from agentenv.lm import models
    from agentenv.lm.precision import training_dtype
    from agentenv.rollout.episode import ChatFormat
    from algorithms import GRPO, GRPOConfig

    compute = getattr(torch, dtype)
    torch.manual_seed(args.seed)
    model, tokenizer = models.load(args.model, dtype=training_dtype(compute, use_lora=True))
    c = model.config
    gflops = plain_matmul_gflops(2048, c.hidden_size, c.intermediate_size, compute, "cpu")
    sampling = agentenv.SamplingConfig(args.max_new_tokens, temperature=1.0, stop_strings=[])
    algo = GRPO(model, tokenizer, GRPOConfig(), sampling=sampling, seed=args.seed, dtype=compute)
    shape = argparse.Namespace(
        groups=4, group_size=8, prompt=106, turns=parse_turns("20:277,33:0"), shared_turns=0
    )
    batch = make_batch(shape, c.vocab_size, random.Random(args.seed))
    learn_s, _ = timed(lambda: algo.learn(batch), args.repeats)

    env = agentenv.make("Calculator-v0", split="train")
    obs, _ = env.reset(options={"task_id": 0})
    prompt = ChatFormat(tokenizer).prompt_ids(obs)
    env.close()
    policy = agentenv.TransformersPolicy(model, tokenizer, dtype=dtype)

    def sample() -> float:
        start = time.perf_counter()
        tokens = sum(len(g.token_ids) for g in policy.generate([prompt] * args.rows, sampling))
        return tokens / (time.perf_counter() - start)

    rates = [sample() for _ in range(args.repeats + 1)][1:]  # the first one warms up
    return {"matmul": gflops, "learn": learn_s, "sample": statistics.median(rates)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="alias or local folder")
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each (after one)")
    p.add_argument("--rows", type=int, default=8, help="continuations sampled at once")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("repeats", "rows", "max_new_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")

    import torch

    from agentenv.lm import precision

    fp32, bf16 = measure(args, "float32"), measure(args, "bfloat16")
    features = precision.cpu_features()
    print(
        f"# {torch.cpu.get_capabilities().get('cpu_name', '?')} ({precision.cpu_vendor() or '?'}), "
        f"{torch_threads()} threads, torch {torch.__version__}; native bf16: "
        f"{precision.cpu_supports_bf16()}, AMX-BF16: {'amx_bf16' in features}"
    )
    print(f"{'':<34} {'float32':>9} {'bfloat16':>9} {'bf16/fp32 time':>15}")
    rows = [
        ("plain matmul, GFLOP/s", "matmul", "{:>9.0f}", lambda a, b: a / b),
        ("learn (4 x 8 RAG episodes), s", "learn", "{:>9.2f}", lambda a, b: b / a),
        (f"sample ({args.rows} rows), tok/s", "sample", "{:>9.1f}", lambda a, b: a / b),
    ]
    for label, key, fmt, ratio in rows:
        a, b = fp32[key], bf16[key]
        print(f"{label:<34} {fmt.format(a)} {fmt.format(b)} {ratio(a, b):>15.2f}")
    auto = "bfloat16" if precision.cpu_prefers_bf16() else "float32"
    faster = "bfloat16" if bf16["learn"] < fp32["learn"] else "float32"
    print(f"--dtype auto here: {auto}; the faster learn phase here: {faster}")


if __name__ == "__main__":
    main()
