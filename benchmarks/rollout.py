"""Collection throughput: the rollout engine vs lock-step, and the sampler's fixed work.

    python benchmarks/rollout.py                       # all scenarios, 8 / 32 / 64 episodes
    python benchmarks/rollout.py --scenarios calc --sizes 8 64
    python benchmarks/rollout.py --device cuda          # the model on a GPU (default: cpu)
    python benchmarks/rollout.py --device cuda --passes 4 --fresh-episodes --rag-retriever bm25
    .venv-vllm/bin/python benchmarks/rollout.py --engines agentenv vllm   # and vLLM in-process
    python benchmarks/rollout.py --scenarios rag --sizes 32 --fast-paths-off reuse_cache

For each scenario and number of episodes (G = 8 per task, sampled at temperature 1.0 from
seeds, the default SmolLM2-135M-Instruct in the compute dtype ``auto`` resolves to):

* **lockstep** (``RolloutConfig.batching``'s default): every turn is one ``generate`` call
  for the whole batch, then every env steps, then the next turn starts.
* **continuous**: every episode advances on its own; its next turn joins the running
  batch as soon as its env has answered.
* **fixed work**: the sampler alone, the same number of rows of one prompt, 128 new
  tokens each, no stop: the tok/s a batch of that many rows reaches when no row ends early.

Generation in the loop also reads what fixed work never does: each episode's prompt and
its env's replies (prefill). The bundled sampler counts that part (``prefill s``, ``read``
tokens); ``decode tok/s`` is the policy tokens over the rest of generation, the part
fixed work measures.

``--engines`` picks the generation engines measured one after the other in the same run:
``agentenv`` (the bundled sampler), ``reference`` (the plain decoding path,
agentenv/lm/reference.py) and ``vllm`` (vLLM in this process, ``--engine vllm``:
run the script with a Python that has vLLM, e.g. ``.venv-vllm/`` from ``install.sh
--vllm``). vLLM's fixed work is its own ``LLM.generate`` with ``ignore_eos``.
``--fast-paths-off NAME ...`` then measures the bundled sampler again once per named fast
path (``agentenv.lm.backend.FAST_PATHS``) with that one path off: its gain, in the same
run.

Scenarios: ``calc`` (Calculator-v0 word problems, 2 turns, 64 tokens a turn), ``rag``
(RAG-v0, compact prompt, up to 3 turns, 48 tokens a turn: examples/rag_grpo.yaml),
``sleep`` (``calc`` with every env step taking 0.5 s longer, a slow tool). Both systems
collect the same episodes (same seeds); the script checks that their policy tokens match
in count. One run each; nothing else should run meanwhile.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from _common import peak_memory, torch_threads

SCENARIOS = {
    "calc": {
        "env": ("Calculator-v0", {"source": "word_problems", "prompt_style": "compact"}),
        "max_turns": 2,
        "max_new_tokens": 64,
        "sleep_s": 0.0,
    },
    "rag": {
        "env": ("RAG-v0", {"prompt_style": "compact"}),
        "max_turns": 3,
        "max_new_tokens": 48,
        "sleep_s": 0.0,
    },
    "sleep": {
        "env": ("Calculator-v0", {"source": "word_problems", "prompt_style": "compact"}),
        "max_turns": 2,
        "max_new_tokens": 64,
        "sleep_s": 0.5,
    },
}


def make_factory(env_id: str, kwargs: dict[str, Any], sleep_s: float) -> Any:
    import gymnasium as gym

    import agentenv

    class SlowTool(gym.Wrapper):
        def step(self, action: str) -> Any:
            time.sleep(sleep_s)
            return self.env.step(action)

    def factory() -> Any:
        env = agentenv.make(env_id, split="train", **kwargs)
        return SlowTool(env) if sleep_s else env

    return factory


def collect_once(
    policy: Any,
    fmt: Any,
    scenario: dict,
    episodes: int,
    group: int,
    seed: int,
    engine: str,
    first_task: int = 0,
) -> dict:
    import agentenv

    factory = make_factory(*scenario["env"], scenario["sleep_s"])
    config = agentenv.RolloutConfig(
        group_size=group,
        max_turns=scenario["max_turns"],
        max_episode_tokens=2048,
        sampling=agentenv.SamplingConfig(scenario["max_new_tokens"], temperature=1.0),
        show_progress=False,
        env_workers=max(8, episodes),
        batching=engine,
    )
    tasks = list(range(first_task, first_task + episodes // group))
    t0 = time.perf_counter()
    groups, m = agentenv.collect(
        factory,
        tasks,
        policy,
        fmt,
        config,
        options=[{"task_id": i} for i in tasks],
        sample_seed=seed,
    )
    m["wall_s"] = time.perf_counter() - t0
    m["turns"] = sum(e.num_turns for g in groups for e in g) / episodes
    return m


QUESTION = (
    "A carpenter works 6 days a week and is paid 195 a day. How much does he earn in 4 weeks?"
)


def prompt_ids(tokenizer: Any, filler_words: int = 0) -> list[int]:
    """A system line and :data:`QUESTION`, after the first ``filler_words`` words of this
    file's docstring in a seeded random order (repeated as needed): a long context that
    prompt lookup finds little to copy from."""
    import random

    from agentenv import ChatFormat

    words = __doc__.split()
    random.Random(0).shuffle(words)
    filler = " ".join((words * (1 + filler_words // len(words)))[:filler_words])
    messages = [
        {"role": "system", "content": "You solve math problems. Use the calculator tool."},
        {"role": "user", "content": f"{filler}\n\n{QUESTION}" if filler else QUESTION},
    ]
    return ChatFormat(tokenizer).prompt_ids(messages)


def fixed_prompt(tokenizer: Any, tokens: int | None = None) -> list[int]:
    """The fixed-work prompt: :func:`prompt_ids` without filler, or with the fewest filler
    words that make it at least ``tokens`` long (a word is at least one token)."""
    low, high = 0, tokens or 0
    while low < high:
        mid = (low + high) // 2
        low, high = (mid + 1, high) if len(prompt_ids(tokenizer, mid)) < tokens else (low, mid)
    return prompt_ids(tokenizer, low)


def fixed_work(
    policy: Any, rows: int, prompt_tokens: int | None = None
) -> tuple[float, float | None]:
    """tok/s of ``rows`` copies of one chat prompt (:func:`fixed_prompt`), 128 new tokens
    each, no stop, and the rows decoded per sequence run (rows share one until they draw
    different tokens; None for vLLM and the reference path, which run every row)."""
    import agentenv

    ids = fixed_prompt(policy.tokenizer, prompt_tokens)
    sampling = agentenv.SamplingConfig(max_new_tokens=128, temperature=1.0, stop_strings=[])
    if hasattr(policy, "llm"):  # vLLM: its own generate, told to ignore EOS
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = [
            SamplingParams(max_tokens=128, temperature=1.0, ignore_eos=True, logprobs=0, seed=i)
            for i in range(rows)
        ]
        t0 = time.perf_counter()
        prompts = [TokensPrompt(prompt_token_ids=ids)] * rows
        outs = policy.llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        return sum(len(o.outputs[0].token_ids) for o in outs) / seconds, None
    stop_ids = policy.stop_token_ids
    policy.stop_token_ids = [-1]  # no row ends early
    counts = hasattr(policy, "decoded_rows")  # the reference path shares no rows
    decoded = (policy.decoded_rows, policy.decoded_slots) if counts else (0, 0)
    try:
        t0 = time.perf_counter()
        gens = policy.generate([ids] * rows, sampling, seeds=list(range(rows)))
        seconds = time.perf_counter() - t0
    finally:
        policy.stop_token_ids = stop_ids
        if counts:
            policy.clear_cache()
    tps = sum(len(g.token_ids) for g in gens) / seconds
    if not counts:
        return tps, None
    return tps, (policy.decoded_rows - decoded[0]) / (policy.decoded_slots - decoded[1])


def per_slot(shared: float | None) -> str:
    """Fixed work's rows decoded per sequence run, for its line (none for vLLM and the
    reference path)."""
    return "" if shared is None else f" ({shared:.2f} rows per sequence run)"


def decode_columns(m: dict, fixed: float) -> str:
    """Prefill seconds and tokens read, and the tok/s of the rest of generation (decoding:
    what fixed work measures) and its share of fixed work; dashes for an engine that does
    not count its prefills (vLLM)."""
    if "rollout/prefill_s" not in m:
        return f"{'-':>9} {'-':>6} {'-':>12} {'-':>8}"
    decode = m["rollout/tokens"] / (m["rollout/generate_s"] - m["rollout/prefill_s"])
    return (
        f"{m['rollout/prefill_s']:>9.1f} {m['rollout/prefill_tokens']:>6.0f} "
        f"{decode:>12.1f} {decode / fixed:>8.0%}"
    )


def make_policy(
    engine: str, model: Any, tokenizer: Any, name: str, dtype: Any, off: tuple[str, ...] = ()
) -> Any:
    from agentenv.lm.backend import EngineConfig
    from agentenv.lm.engines import check_engine, make_policy

    config = EngineConfig(engine=engine, fast_paths_off=list(off))
    check_engine(config)
    return make_policy(config, model, tokenizer, model_name=name, dtype=dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    parser.add_argument("--sizes", nargs="+", type=int, default=[8, 32, 64])
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="cpu", help="where the model runs: cpu, cuda, cuda:1")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--engines", nargs="+", default=["agentenv"], choices=["agentenv", "reference", "vllm"]
    )
    parser.add_argument(
        "--rag-retriever",
        default="hybrid",
        choices=["hybrid", "bm25"],
        help="RAG-v0's retriever; bm25 needs neither Chroma nor the MiniLM embeddings (a machine "
        "without them); its passages differ from hybrid's, so compare like with like",
    )
    parser.add_argument(
        "--passes",
        type=int,
        default=1,
        help="collect every scenario and size this many times, each pass printed: on a GPU the "
        "first time at a shape pays for it (cuDNN plans), so the second pass is the steady state",
    )
    parser.add_argument(
        "--fresh-episodes",
        action="store_true",
        help="with --passes: each pass collects other tasks with another seed (pass k: tasks "
        "after pass k-1's, seed + k), and the two systems take turns going first, as the steps "
        "of a training run meet partly new shapes",
    )
    parser.add_argument(
        "--fixed-prompt-tokens",
        nargs="+",
        type=int,
        default=[],
        help="also measure fixed work after prompts grown to these many tokens (e.g. 450: a RAG "
        "episode's context), each row then decoding over a longer KV cache; the shares printed "
        "stay against the plain prompt's",
    )
    parser.add_argument(
        "--fast-paths-off",
        nargs="+",
        default=[],
        metavar="NAME",
        help="then the bundled sampler again with each of these fast paths off, one at a time "
        "(agentenv.lm.backend.FAST_PATHS)",
    )
    args = parser.parse_args()
    from agentenv.lm.backend import FAST_PATHS

    unknown = sorted(set(args.fast_paths_off) - set(FAST_PATHS))
    if unknown:
        parser.error(f"--fast-paths-off: unknown {unknown}; the names are {list(FAST_PATHS)}")
    if args.passes < 1:
        parser.error(f"--passes must be >= 1, got {args.passes}")
    if any(tokens < 1 for tokens in args.fixed_prompt_tokens):
        parser.error(f"--fixed-prompt-tokens must be >= 1, got {args.fixed_prompt_tokens}")
    if args.fresh_episodes and args.passes < 2:
        parser.error(
            f"--fresh-episodes needs --passes 2 or more, got {args.passes} (one pass is the "
            "plain run)"
        )
    if args.rag_retriever != "hybrid":
        SCENARIOS["rag"]["env"][1]["retriever"] = args.rag_retriever

    import torch

    import agentenv
    from agentenv.lm import models

    dtype = agentenv.resolve_dtype(args.dtype, args.device)
    model, tokenizer = models.load(args.model, dtype=dtype, device=args.device)
    fmt = agentenv.ChatFormat(tokenizer)
    print(
        f"# {args.model}, {args.device}, {dtype}, torch threads {torch_threads()}, "
        f"torch {torch.__version__}"
    )
    runs = [(engine, ()) for engine in args.engines]
    runs += [("agentenv", (name,)) for name in args.fast_paths_off]
    for engine, off in runs:
        policy = make_policy(engine, model, tokenizer, args.model, dtype, off)
        print(f"## engine {engine}" + (f", {off[0]} off" if off else ""))
        run_engine(policy, fmt, args)
        del policy
    peak = peak_memory(args.device)
    gpu = peak.get("peak_gpu_mb")
    print(
        f"peak RSS {peak['peak_rss_mb']:.0f} MiB" + ("" if gpu is None else f", GPU {gpu:.0f} MiB")
    )


def run_engine(policy: Any, fmt: Any, args: argparse.Namespace) -> None:
    """Fixed work, then every scenario and size in both batchings, for one engine."""
    fixed_work(policy, min(args.sizes))  # warm-up: first calls are slow (vLLM's more so)
    fixed = {}
    for n in sorted(set(args.sizes)):
        fixed[n], shared = fixed_work(policy, n)
        print(f"fixed work, {n} rows x 128 tokens: {fixed[n]:.1f} tok/s{per_slot(shared)}")
        for tokens in args.fixed_prompt_tokens:
            tps, shared = fixed_work(policy, n, tokens)
            print(f"  the same after a {tokens}-token prompt: {tps:.1f} tok/s{per_slot(shared)}")
    header = (
        f"{'scenario':<8} {'episodes':>8} {'system':<10} {'wall s':>7} {'gen s':>6} "
        f"{'tokens':>6} {'tok/s':>6} {'vs fixed':>8} {'prefill s':>9} {'read':>6} "
        f"{'decode tok/s':>12} {'vs fixed':>8} {'rows':>5} {'/slot':>5} {'env s':>6} "
        f"{'env wait s':>10}"
    )
    for k in range(args.passes):
        if args.passes > 1:
            print(f"### pass {k + 1} of {args.passes}")
        print(header)
        collect_table(policy, fmt, args, fixed, k if args.fresh_episodes else 0)


def collect_table(
    policy: Any, fmt: Any, args: argparse.Namespace, fixed: dict, fresh: int = 0
) -> None:
    """Every scenario and size in both systems, a row each: lockstep first, except on the
    odd passes of ``--fresh-episodes`` (``fresh``: the pass's number, 0 otherwise)."""
    systems = ("continuous", "lockstep") if fresh % 2 else ("lockstep", "continuous")
    for name in args.scenarios:
        scenario = SCENARIOS[name]
        for n in args.sizes:
            results = {}
            for system in systems:
                m = collect_once(
                    policy,
                    fmt,
                    scenario,
                    n,
                    args.group_size,
                    args.seed + fresh,
                    system,
                    first_task=fresh * (n // args.group_size),
                )
                results[system] = m
                print(
                    f"{name:<8} {n:>8} {system:<10} {m['wall_s']:>7.1f} "
                    f"{m['rollout/generate_s']:>6.1f} {m['rollout/tokens']:>6.0f} "
                    f"{m['rollout/tokens_per_s']:>6.1f} "
                    f"{m['rollout/tokens_per_s'] / fixed[n]:>8.0%} {decode_columns(m, fixed[n])} "
                    f"{m['rollout/rows_mean']:>5.1f} {m.get('rollout/rows_per_slot', 1.0):>5.2f} "
                    f"{m['rollout/env_s']:>6.1f} "
                    f"{m['rollout/env_wait_s']:>10.1f}",
                    flush=True,
                )
            a, b = results["lockstep"], results["continuous"]
            print(
                f"{'':<8} {'':>8} continuous / lockstep: wall {a['wall_s'] / b['wall_s']:.2f}x "
                f"faster, tok/s {b['rollout/tokens_per_s'] / a['rollout/tokens_per_s']:.2f}x"
                + ("" if a["rollout/tokens"] == b["rollout/tokens"] else "  (token counts differ)")
            )


if __name__ == "__main__":
    main()
