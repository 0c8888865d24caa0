"""Seconds per GRPO step (collect + learn) and peak memory: agentenv vs TRL's GRPOTrainer.

Both systems train the same model on the same Calculator-v0 tasks with the same
``calculator`` tool, group size, sampling, per-turn and turn limits, optimiser and loss
(see ``matched_settings``), in the same run, each in its own subprocess so peak RSS is
measured separately::

    HF_HUB_OFFLINE=1 python benchmarks/grpo_step.py                 # SmolLM2, 3 steps
    python benchmarks/grpo_step.py --model /tmp/tiny --steps 1 --group-size 2 --max-new-tokens 16

TRL is a benchmark-only dependency: ``pip install -e ".[bench]"``.

Prompts: with ``--prompt-style full`` (default) agentenv's system prompt is the env's
instructions plus its tool schema and call format; TRL's is the same instructions, and its
chat template appends its own tool schema and call format (about 50 tokens more here).

Turn rule (``--turn-rule trl``, the default, makes both do the same work): TRL ends an
episode at the first turn without a tool call and runs at most
``max_tool_calling_iterations = max_turns - 1`` tool rounds; agentenv natively answers a
turn with neither a tool call nor an answer with a format reminder and goes on, so by
default a wrapper ends its episodes there too. ``--turn-rule agentenv`` keeps agentenv's
native behaviour (more turns and tokens per step for a model that does not call tools).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ENV_ID = "Calculator-v0"
TOOL_SLACK = 64  # completion tokens per tool round allowed for the tool result (TRL's budget)
_RESULT_KEYS = (
    "setup_s",
    "setup_rss_mb",
    "peak_rss_mb",
    "peak_gpu_mb",
    "prompt_tokens",
    "template",
)
INSTALL_HINT = 'TRL is not installed; install the benchmark extra: pip install -e ".[bench]"'


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--model", default="smollm2-135m-instruct", help="alias or local folder")
    p.add_argument("--steps", type=int, default=3, help="steps per system (>=3: 1st untimed)")
    p.add_argument("--batch-size", type=int, default=1, help="tasks per step (B)")
    p.add_argument("--group-size", type=int, default=8, help="episodes per task (G)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per policy turn")
    p.add_argument("--max-turns", type=int, default=2, help="policy turns per episode")
    p.add_argument("--source", default="basic_arithmetic", help="Calculator task source")
    p.add_argument(
        "--prompt-style",
        default="full",
        choices=["full", "compact"],
        help="full: about the same system prompt in both (instructions + tool schema); "
        "compact: agentenv's short prompt, which TRL's template extends by its tool section",
    )
    p.add_argument("--turn-rule", default="trl", choices=["trl", "agentenv"])
    p.add_argument("--only", choices=["agentenv", "trl"], help="run one system")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="compute dtype of both systems (auto: bfloat16 where the hardware has it); TRL "
        "gets bf16=/fp16= mixed precision, agentenv its default (bf16 sampling copy, LoRA "
        "base in the dtype)",
    )
    p.add_argument("--learning-rate", type=float, default=None, help="5e-5 LoRA / 1e-5 full")
    p.add_argument("--full-finetune", action="store_true", help="no LoRA in either system")
    p.add_argument(
        "--reward-noise",
        type=float,
        default=0.0,
        help="reward += this x a hash of the completion's tokens in [0, 1), so no group has "
        "zero reward variance and agentenv cannot skip the learn pass (with beta=0 it drops "
        "zero-variance groups; TRL does not)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--worker", choices=["agentenv", "trl"], help=argparse.SUPPRESS)
    p.add_argument("--result-file", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "max_new_tokens", "max_turns"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.group_size < 2:
        p.error(f"--group-size must be >= 2 (GRPO needs a group), got {args.group_size}")
    if args.learning_rate is None:
        args.learning_rate = 1e-5 if args.full_finetune else 5e-5
    return args


def task_ids(args: argparse.Namespace, step: int) -> list[int]:
    """The train-split task ids of one step: the same in both systems."""
    return list(range(step * args.batch_size, (step + 1) * args.batch_size))


def token_hash(ids: list[int]) -> float:
    """A stable pseudo-random number in [0, 1) for a token sequence (the --reward-noise term)."""
    digest = hashlib.blake2b(str(list(ids)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def make_env(args: argparse.Namespace) -> Any:
    import agentenv

    return agentenv.make(
        ENV_ID,
        split="train",
        source=args.source,
        prompt_style=args.prompt_style,
        max_turns=args.max_turns,
    )


def lora_settings() -> dict[str, Any]:
    """agentenv's GRPO LoRA defaults; TRL gets the same via ``peft_config``."""
    from algorithms.grpo import GRPOConfig

    c = GRPOConfig()
    return {
        "r": c.lora_r,
        "alpha": c.lora_alpha,
        "dropout": c.lora_dropout,
        "targets": list(c.lora_target_modules),
    }


def peak_rss_mb() -> float | None:
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes / KiB


def _memory(device: str) -> dict[str, float | None]:
    out: dict[str, float | None] = {"peak_rss_mb": peak_rss_mb()}
    if device.startswith("cuda"):
        import torch

        out["peak_gpu_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return out


# ---- agentenv ---------------------------------------------------------------------------


def _stop_without_tool_call(env: Any) -> Any:
    """Wrap ``env`` so a turn with neither tool call nor answer ends the episode (TRL's rule)."""
    import gymnasium as gym

    class StopWithoutToolCall(gym.Wrapper):
        def step(self, action: str) -> tuple[Any, ...]:
            obs, reward, terminated, truncated, info = self.env.step(action)
            if not (terminated or truncated) and obs and all(m["role"] == "user" for m in obs):
                truncated = True  # the env's format reminder: TRL would stop here
            return obs, reward, terminated, truncated, info

    return StopWithoutToolCall(env)


def run_agentenv(args: argparse.Namespace) -> dict[str, Any]:
    """Setup, then ``steps`` x (collect + learn), timed per phase."""
    import torch

    from agentenv.lm import models
    from agentenv.lm.generation import SamplingConfig, TransformersPolicy, resolve_dtype
    from agentenv.rollout.collect import RolloutConfig, collect
    from agentenv.rollout.episode import ChatFormat
    from agentenv.run.train import training_dtype
    from algorithms.grpo import GRPO, GRPOConfig

    t0 = time.perf_counter()
    torch.manual_seed(args.seed)
    compute = resolve_dtype(args.dtype, args.device)
    model, tokenizer = models.load(
        args.model,
        dtype=training_dtype(compute, use_lora=not args.full_finetune),
        device=args.device,
    )
    config = GRPOConfig(
        learning_rate=args.learning_rate,
        beta=0.0,
        loss_type="dapo",
        num_iterations=1,
        use_lora=not args.full_finetune,
    )
    rollout = RolloutConfig(
        args.group_size,
        args.max_turns,
        4096,  # budget never binds: limits are per turn
        SamplingConfig(args.max_new_tokens, temperature=1.0),
        show_progress=False,
    )
    algo = GRPO(model, tokenizer, config, sampling=rollout.sampling, seed=args.seed, dtype=compute)
    fmt = ChatFormat(tokenizer)
    policy = TransformersPolicy(algo.unwrapped_model, tokenizer, dtype=compute)

    def env_factory() -> Any:
        env = make_env(args)
        return _stop_without_tool_call(env) if args.turn_rule == "trl" else env

    probe = make_env(args)
    ids = [i for s in range(args.steps) for i in task_ids(args, s)]
    prompt_tokens = [len(fmt.prompt_ids(probe.reset(options={"task_id": i})[0])) for i in ids]
    probe.close()
    result: dict[str, Any] = {"setup_s": time.perf_counter() - t0, "steps": []}
    result["setup_rss_mb"] = peak_rss_mb()
    result["prompt_tokens"] = statistics.mean(prompt_tokens)
    for step in range(args.steps):
        tasks = task_ids(args, step)
        start = time.perf_counter()
        groups, m = collect(
            env_factory, tasks, policy, fmt, rollout, options=[{"task_id": i} for i in tasks]
        )
        episodes = [ep for group in groups for ep in group]
        for ep in episodes:
            policy_ids = [t for t, a in zip(ep.input_ids, ep.action_mask, strict=True) if a]
            ep.reward += args.reward_noise * token_hash(policy_ids)
        models.release_memory()  # as `agentenv train` does after each phase
        t_learn = time.perf_counter()
        metrics = algo.learn(groups)
        models.release_memory()
        end = time.perf_counter()
        result["steps"].append(
            {
                "total_s": end - start,
                "generate_s": m["rollout/generate_s"],
                "env_s": m["rollout/env_s"],
                "learn_s": end - t_learn,
                "tokens": m["rollout/tokens"],
                "turns": statistics.mean(ep.num_turns for ep in episodes),
                "reward": metrics["rewards/mean"],
                "frac_reward_zero_std": metrics["frac_reward_zero_std"],
            }
        )
    return {**result, **_memory(args.device)}


# ---- TRL --------------------------------------------------------------------------------


def _timed_trainer_class() -> type:
    """GRPOTrainer that adds up time spent generating, in the tool loop and in rewards."""
    from trl import GRPOTrainer

    class TimedGRPOTrainer(GRPOTrainer):
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            self.clock: dict[str, float] = defaultdict(float)

        def _generate_single_turn(self, prompt_ids: list, *a: Any, **kw: Any) -> Any:
            start = time.perf_counter()
            ids, logprobs = super()._generate_single_turn(prompt_ids, *a, **kw)
            self.clock["generate_s"] += time.perf_counter() - start
            self.clock["tokens"] += sum(len(x) for x in ids)
            self.clock["sequences"] += len(ids)
            return ids, logprobs

        def _tool_call_loop(self, *a: Any, **kw: Any) -> Any:
            start, gen = time.perf_counter(), self.clock["generate_s"]
            out = super()._tool_call_loop(*a, **kw)  # its generation is counted above
            gen_inside = self.clock["generate_s"] - gen
            self.clock["env_s"] += time.perf_counter() - start - gen_inside
            return out

        def _calculate_rewards(self, *a: Any, **kw: Any) -> Any:
            start = time.perf_counter()
            out = super()._calculate_rewards(*a, **kw)
            self.clock["env_s"] += time.perf_counter() - start
            return out

        def _generate_and_score_completions(self, *a: Any, **kw: Any) -> Any:
            start = time.perf_counter()
            out = super()._generate_and_score_completions(*a, **kw)
            self.clock["collect_s"] += time.perf_counter() - start
            return out

    return TimedGRPOTrainer


def _step_timer(episodes_per_step: int) -> Any:
    """A TrainerCallback that records each optimizer step's time and phase split."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.trainer: Any = None  # set once the trainer exists
            self.steps: list[dict[str, float]] = []

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self._start, self._clock = time.perf_counter(), dict(self.trainer.clock)

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            total = time.perf_counter() - self._start
            d = {k: v - self._clock.get(k, 0.0) for k, v in self.trainer.clock.items()}
            self.steps.append(
                {
                    "total_s": total,
                    "generate_s": d.get("generate_s", 0.0),
                    "env_s": d.get("env_s", 0.0),
                    "learn_s": total - d.get("collect_s", 0.0),
                    "tokens": d.get("tokens", 0.0),
                    "turns": d.get("sequences", 0.0) / episodes_per_step,
                }
            )

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            if self.steps and logs and "reward" in logs:
                self.steps[-1]["reward"] = logs["reward"]
                self.steps[-1]["frac_reward_zero_std"] = logs.get("frac_reward_zero_std", 0.0)

    return StepTimer()


def _tool_tokenizer(tokenizer: Any) -> tuple[Any, str]:
    """The tokenizer with a tool-capable template (agentenv.integrations.trl), and its name."""
    from agentenv.integrations.trl import tool_chat_template

    own = tokenizer.chat_template
    tokenizer = tool_chat_template(tokenizer)
    return (
        tokenizer,
        "the model's own" if tokenizer.chat_template == own else "trl/chat_templates/qwen2_5.jinja",
    )


def _trl_prompt(env: Any, task_id: int, prompt_style: str) -> list[dict[str, str]]:
    """The env's opening messages; with ``full``, TRL's template lists the tool itself."""
    system, user = env.reset(options={"task_id": task_id})[0]
    if prompt_style == "full":  # keep the instructions, drop agentenv's own tool section
        system = {"role": "system", "content": env.unwrapped.instructions()}
    return [system, user]


def _reward_fn(env: Any, reward_noise: float) -> Any:
    """TRL reward: the Calculator env's own parser and ``score`` on the first answer given."""
    inner = env.unwrapped

    def calculator_reward(
        completions: list, completion_ids: list, task_id: list, **kw: Any
    ) -> list[float]:
        rewards = []
        for messages, ids, tid in zip(completions, completion_ids, task_id, strict=True):
            answers = [
                inner.parser.parse(m.get("content") or "").answer
                for m in messages
                if m["role"] == "assistant"
            ]
            answer = next((a for a in answers if a is not None), None)
            score = inner.score(answer, inner.get_task(tid))[0] if answer is not None else 0.0
            rewards.append(score + reward_noise * token_hash(ids))
        return rewards

    return calculator_reward


def _compute_dtype(args: argparse.Namespace) -> str:
    """``--dtype`` resolved on this machine: the same compute dtype for both systems."""
    from agentenv.lm.generation import resolve_dtype

    return str(resolve_dtype(args.dtype, args.device)).removeprefix("torch.")


def _trl_config(args: argparse.Namespace, output_dir: str) -> Any:
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=output_dir,
        max_steps=args.steps,
        seed=args.seed,
        per_device_train_batch_size=args.batch_size * args.group_size,
        gradient_accumulation_steps=1,
        num_generations=args.group_size,
        generation_kwargs={"max_new_tokens": args.max_new_tokens},  # per turn, like agentenv
        max_completion_length=args.max_turns * (args.max_new_tokens + TOOL_SLACK),
        max_tool_calling_iterations=args.max_turns - 1,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch",
        beta=0.0,
        loss_type="dapo",
        epsilon=0.2,
        num_iterations=1,
        scale_rewards="group",
        use_cpu=args.device == "cpu",
        bf16=_compute_dtype(args) == "bfloat16",  # TRL's mixed precision: fp32 weights
        fp16=_compute_dtype(args) == "float16",
        gradient_checkpointing=False,
        shuffle_dataset=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


def run_trl(args: argparse.Namespace) -> dict[str, Any]:
    """Setup, then ``trainer.train()`` for ``steps`` optimizer steps, timed by a callback."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig

    from agentenv.lm import models
    from envs.calculator import calculator

    t0 = time.perf_counter()
    torch.manual_seed(args.seed)
    model, tokenizer = models.load(args.model, device=args.device)
    tokenizer, template = _tool_tokenizer(tokenizer)
    env = make_env(args)
    ids = [i for s in range(args.steps) for i in task_ids(args, s)]
    rows = [{"prompt": _trl_prompt(env, i, args.prompt_style), "task_id": i} for i in ids]
    prompt_tokens = [
        len(
            tokenizer.apply_chat_template(
                r["prompt"], tools=[calculator.fn], add_generation_prompt=True, return_dict=True
            )["input_ids"]
        )
        for r in rows
    ]
    lora = lora_settings()
    peft_config = (
        None
        if args.full_finetune
        else LoraConfig(
            task_type="CAUSAL_LM",
            r=lora["r"],
            lora_alpha=lora["alpha"],
            lora_dropout=lora["dropout"],
            target_modules=lora["targets"],
        )
    )
    timer = _step_timer(args.batch_size * args.group_size)
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = _timed_trainer_class()(
            model=model,
            reward_funcs=_reward_fn(env, args.reward_noise),
            args=_trl_config(args, output_dir),
            train_dataset=Dataset.from_list(rows),
            processing_class=tokenizer,
            peft_config=peft_config,
            tools=[calculator.fn],
            callbacks=[timer],
        )
        timer.trainer = trainer
        result: dict[str, Any] = {"setup_s": time.perf_counter() - t0, "template": template}
        result["setup_rss_mb"] = peak_rss_mb()
        result["prompt_tokens"] = statistics.mean(prompt_tokens)
        trainer.train()
    env.close()
    return {**result, "steps": timer.steps, **_memory(args.device)}


# ---- orchestration and report -----------------------------------------------------------


def run_worker(system: str, argv: list[str]) -> dict[str, Any] | None:
    """Run one system in a fresh interpreter (its own peak RSS); None if it failed."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "result.json"
        env = {**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1", "TOKENIZERS_PARALLELISM": "false"}
        env.setdefault("HF_HUB_OFFLINE", "1")
        cmd = [sys.executable, __file__, *argv, "--worker", system, "--result-file", str(path)]
        print(f"== {system}: running ...", file=sys.stderr, flush=True)
        code = subprocess.run(cmd, env=env, stdout=sys.stderr).returncode  # stdout: the table
        if code != 0 or not path.exists():
            print(f"== {system}: failed (exit {code}); its output is above", file=sys.stderr)
            return None
        return json.loads(path.read_text())


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Means over timed steps (the first, warm-up step is dropped when there are >= 3)."""
    steps = result["steps"]
    timed = steps[1:] if len(steps) >= 3 else steps
    s = {k: statistics.mean(st.get(k, float("nan")) for st in timed) for k in timed[0]}
    s["min_s"] = min(st["total_s"] for st in timed)
    s["other_s"] = s["total_s"] - s["generate_s"] - s["env_s"] - s["learn_s"]
    s["tokens_per_s"] = s["tokens"] / s["generate_s"] if s["generate_s"] else float("nan")
    s["timed"], s["all"] = len(timed), len(steps)
    for key in _RESULT_KEYS:
        if result.get(key) is not None:
            s[key] = result[key]
    return s


def matched_settings(args: argparse.Namespace) -> list[str]:
    lora = "full fine-tuning (no LoRA)"
    if not args.full_finetune:
        lo = lora_settings()
        targets = ",".join(lo["targets"])
        lora = f"LoRA r={lo['r']} alpha={lo['alpha']} dropout={lo['dropout']} on {targets}"
    return [
        f"model {args.model}, {args.device}, compute dtype {_compute_dtype(args)} (--dtype "
        f"{args.dtype}), torch threads {_threads()}",
        f"{ENV_ID} source={args.source} prompt_style={args.prompt_style}; same task ids; "
        f"same calculator tool and scoring",
        f"B={args.batch_size} tasks x G={args.group_size} per step; temperature 1.0, no top-k/p",
        f"<= {args.max_new_tokens} new tokens per turn, <= {args.max_turns} turns "
        f"(TRL max_tool_calling_iterations={args.max_turns - 1}, max_completion_length="
        f"{args.max_turns * (args.max_new_tokens + TOOL_SLACK)}); turn rule: {args.turn_rule}",
        f"{lora}; AdamW lr={args.learning_rate:g} constant, wd 0, clip 1.0",
        "loss dapo, beta 0 (no reference), epsilon 0.2, num_iterations 1, advantages "
        "(r-mean)/std per group, gradient checkpointing off"
        + (f"; reward += {args.reward_noise:g} x token hash" if args.reward_noise else ""),
    ]


def _threads() -> int:
    import torch

    return torch.get_num_threads()


ROWS = [  # (label, key, format)
    ("s/step mean", "total_s", "{:.2f}"),
    ("s/step min", "min_s", "{:.2f}"),
    ("  generation s", "generate_s", "{:.2f}"),
    ("  env: tools + reward s", "env_s", "{:.3f}"),
    ("  learn s", "learn_s", "{:.2f}"),
    ("  other s (tokenize, glue)", "other_s", "{:.2f}"),
    ("tokens generated/step", "tokens", "{:.0f}"),
    ("generation tokens/s", "tokens_per_s", "{:.1f}"),
    ("turns/episode", "turns", "{:.2f}"),
    ("prompt tokens", "prompt_tokens", "{:.0f}"),
    ("reward mean", "reward", "{:.3g}"),
    ("frac groups zero reward std", "frac_reward_zero_std", "{:.2f}"),
    ("peak RSS MB", "peak_rss_mb", "{:.0f}"),
    ("  RSS MB after setup", "setup_rss_mb", "{:.0f}"),
    ("peak GPU MB", "peak_gpu_mb", "{:.0f}"),
    ("setup s (load, init)", "setup_s", "{:.1f}"),
]


def report(args: argparse.Namespace, summaries: dict[str, dict[str, Any]]) -> str:
    names = list(summaries)
    lines = ["GRPO step benchmark: one step = collect B x G episodes + one optimizer step"]
    lines += [f"  {line}" for line in matched_settings(args)]
    if "trl" in summaries:
        lines.append(
            f"  chat template: agentenv the model's own, TRL {summaries['trl']['template']} "
            "(which adds its own tool section to the system prompt)"
        )
    lines.append("")
    lines.append(f"{'':30}" + "".join(f"{n:>12}" for n in names))
    for label, key, fmt in ROWS:
        if any(key in s for s in summaries.values()):
            cells = [fmt.format(s[key]) if key in s else "-" for s in summaries.values()]
            lines.append(f"{label:30}" + "".join(f"{c:>12}" for c in cells))
    timed = ", ".join(f"{n} {s['timed']}/{s['all']}" for n, s in summaries.items())
    lines.append(f"{'steps timed':30}{timed}  (first step dropped as warm-up when >= 3)")
    if len(summaries) == 2:
        a, t = summaries["agentenv"], summaries["trl"]
        lines.append(
            f"\nTRL / agentenv seconds per step: {t['total_s'] / a['total_s']:.2f}x (mean), "
            f"{t['min_s'] / a['min_s']:.2f}x (min)"
        )
    zero_std = summaries.get("agentenv", {}).get("frac_reward_zero_std", 0.0)
    if zero_std > 0 and not args.reward_noise:
        lines.append(
            f"note: {zero_std:.0%} of agentenv's groups had equal rewards; with beta=0 GRPO.learn "
            "drops them before the forward/backward, TRL runs them with zero advantages. "
            "--reward-noise 1e-3 makes both learn on every episode."
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.worker:
        result = run_agentenv(args) if args.worker == "agentenv" else run_trl(args)
        Path(args.result_file).write_text(json.dumps(result))
        return 0
    systems = [args.only] if args.only else ["agentenv", "trl"]
    if "trl" in systems and importlib.util.find_spec("trl") is None:
        print(INSTALL_HINT, file=sys.stderr)
        if args.only == "trl":
            return 1
        systems.remove("trl")
    summaries = {}
    for system in systems:
        result = run_worker(system, argv)
        if result is not None:
            summaries[system] = summarize(result)
    if not summaries:
        return 1
    print(report(args, summaries))
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": vars(args), **summaries}, indent=2))
    return 0 if len(summaries) == len(systems) else 1


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
