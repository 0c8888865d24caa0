"""Seconds per GRPO step (collect + learn) and peak memory: agentenv vs TRL's GRPOTrainer.

Both systems train the same model on the same Calculator-v0 tasks with the same
``calculator`` tool, group size, sampling, per-turn and turn limits, optimiser and loss
(see ``matched_settings``), in the same run, each in its own subprocess so peak RSS is
measured separately::

    HF_HUB_OFFLINE=1 python benchmarks/grpo_step.py                 # SmolLM2, 3 steps
    python benchmarks/grpo_step.py --engines agentenv vllm          # and agentenv on vLLM
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

Engines (``--engines``): ``agentenv`` samples with the bundled sampler, ``reference`` with the
plain decoding path (agentenv only), ``vllm`` with vLLM
in the trainer's process (``--engine vllm``); that worker runs under ``--vllm-python``
(default: this Python if it imports vllm, else ``.venv-vllm/bin/python`` from
``install.sh --vllm``, whose vLLM CPU wheel pins an older transformers than the main venv).
With ``vllm``, TRL runs too with ``use_vllm=True, vllm_mode="colocate"`` (its own vLLM
in the trainer's process), under the same Python.

Files: this one holds the arguments, the orchestration (each system runs in a fresh
interpreter that re-runs this script with ``--worker agentenv|trl``) and the report;
``grpo_step_agentenv.py`` and ``grpo_step_trl.py`` hold the two systems' runners,
``_grpo_step_settings.py`` what they share (env, task ids, reward noise, LoRA, dtype) and
``_common.py`` the peak-memory and thread-count measurements.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _common import torch_threads
from _grpo_step_settings import ENV_ID, TOOL_SLACK, compute_dtype, lora_settings

_RESULT_KEYS = (
    "setup_s",
    "setup_rss_mb",
    "peak_rss_mb",
    "peak_gpu_mb",
    "prompt_tokens",
    "template",
)
INSTALL_HINT = 'TRL is not installed; install the benchmark extra: pip install -e ".[bench]"'


# ---- arguments --------------------------------------------------------------------------


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
    p.add_argument(
        "--engines",
        nargs="+",
        default=["agentenv"],
        choices=["agentenv", "reference", "vllm"],
        help="generation engines: agentenv and TRL run once per engine (vllm: TRL's colocate); "
        "reference: agentenv's plain decoding path only (TRL's own generate is its default)",
    )
    p.add_argument("--engine", default="agentenv", help=argparse.SUPPRESS)  # a worker's
    p.add_argument("--vllm-python", help="the Python the vllm engine runs under")
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


# ---- orchestration and report -----------------------------------------------------------


def vllm_python(args: argparse.Namespace) -> str:
    """The Python the vllm engine's worker runs under (see the module docstring)."""
    if args.vllm_python:
        return args.vllm_python
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    return str(Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python")


def run_worker(
    system: str, argv: list[str], python: str = sys.executable, engine: str = "agentenv"
) -> dict[str, Any] | None:
    """Run one system in a fresh interpreter (its own peak RSS); None if it failed."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "result.json"
        env = {**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1", "TOKENIZERS_PARALLELISM": "false"}
        env.setdefault("HF_HUB_OFFLINE", "1")
        cmd = [python, __file__, *argv, "--worker", system, "--result-file", str(path)]
        cmd += ["--engine", engine]
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
        f"model {args.model}, {args.device}, compute dtype {compute_dtype(args)} (--dtype "
        f"{args.dtype}), torch threads {torch_threads()}",
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
    lines.append(f"{'':30}" + "".join(f"{n:>15}" for n in names))
    for label, key, fmt in ROWS:
        if any(key in s for s in summaries.values()):
            cells = [fmt.format(s[key]) if key in s else "-" for s in summaries.values()]
            lines.append(f"{label:30}" + "".join(f"{c:>15}" for c in cells))
    timed = ", ".join(f"{n} {s['timed']}/{s['all']}" for n, s in summaries.items())
    lines.append(f"{'steps timed':30}{timed}  (first step dropped as warm-up when >= 3)")
    lines.append("")
    for peer in (n for n in names if n.startswith("trl")):
        t = summaries[peer]
        for name in (n for n in names if n.startswith("agentenv")):
            a = summaries[name]
            lines.append(
                f"{peer} / {name} seconds per step: {t['total_s'] / a['total_s']:.2f}x "
                f"(mean), {t['min_s'] / a['min_s']:.2f}x (min)"
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
        if args.worker == "agentenv":
            from grpo_step_agentenv import run_agentenv as run
        else:
            from grpo_step_trl import run_trl as run
        result = run(args)
        Path(args.result_file).write_text(json.dumps(result))
        return 0
    ours = [] if args.only == "trl" else [f"agentenv-{e}" for e in args.engines]
    trl_engines = [e for e in args.engines if e != "reference"]  # TRL has no plain sampler
    theirs = [] if args.only == "agentenv" else [f"trl-{e}" for e in trl_engines]
    systems = [s.removesuffix("-agentenv") for s in [*ours, *theirs]]
    if "trl" in systems and importlib.util.find_spec("trl") is None:
        print(INSTALL_HINT, file=sys.stderr)
        if args.only == "trl":
            return 1
        systems = [s for s in systems if not s.startswith("trl")]
    summaries = {}
    for system in systems:
        if system.endswith("-vllm"):
            worker = system.removesuffix("-vllm")
            result = run_worker(worker, argv, vllm_python(args), engine="vllm")
        elif system.endswith("-reference"):
            result = run_worker(system.removesuffix("-reference"), argv, engine="reference")
        else:
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
