"""The ``agentenv`` command line.

agentenv list                              registered environments
agentenv demo [ENV_ID]                     play one episode with a model, print it
agentenv sft ENV_ID                        supervised warm start on demonstrations
agentenv train ENV_ID                      GRPO training run
agentenv eval ENV_ID --model M             accuracy, pass@k, tool use on a split
agentenv plot RUN_DIR                      redraw a run's plots
agentenv show RUN_DIR [--step N]           HTML view of sampled episodes, token by token
agentenv quickstart                        SFT -> GRPO -> eval on the default, in minutes
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from agentenv.errors import AgentEnvError, InvalidOptionError

QUICKSTART_ENV = {"source": "word_problems", "prompt_style": "compact"}


def _json_arg(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc.msg}): {text!r}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _cmd_list(args: argparse.Namespace) -> int:
    from agentenv.registration import registry

    for env_id, spec in registry().items():
        entry = spec.entry_point if isinstance(spec.entry_point, str) else spec.entry_point.__name__
        print(f"{env_id:32s} {entry}" + (f"  {spec.kwargs}" if spec.kwargs else ""))
    return 0


def _load_policy(args: argparse.Namespace):  # noqa: ANN202
    from agentenv import models
    from agentenv.generation import resolve_dtype
    from agentenv.train import load_from_checkpoint

    device = args.device or models.default_device()
    model, tokenizer = models.load(
        args.model, dtype=resolve_dtype(args.dtype, device), device=device
    )
    if getattr(args, "adapter", None):
        # A LoRA adapter stays unmerged: folded into bf16 weights most of a small update
        # rounds away (the sampler computes it separately, see agentenv.generation).
        model = load_from_checkpoint(model, args.adapter).requires_grad_(False)
        model.eval()
    return model, tokenizer


def _cmd_demo(args: argparse.Namespace) -> int:
    from agentenv.play import ChatModelPolicy, play_episode
    from agentenv.registration import make

    env = make(args.env_id, split="test", **args.env_kwargs)
    print(f"Loading {args.model} ...", flush=True)
    start = time.perf_counter()
    model, tokenizer = _load_policy(args)
    print(f"Loaded in {time.perf_counter() - start:.1f} s. Playing one {args.env_id} episode.\n")
    policy = ChatModelPolicy(
        model, tokenizer, max_new_tokens=args.max_new_tokens, temperature=args.temperature
    )
    result = play_episode(env, policy, seed=args.seed)
    for m in result.messages:
        print(f"--- {m['role']} ---\n{m['content']}\n")
    env.close()
    status = "terminated" if result.terminated else "truncated"
    print(f"=== reward {result.reward:g} ({status}); info: {result.info}")
    return 0


def _cmd_sft(args: argparse.Namespace) -> int:
    from agentenv.warmstart import SFTRunConfig, sft

    sft(
        SFTRunConfig(
            env_id=args.env_id,
            env_kwargs=args.env_kwargs,
            model=args.model,
            num_demos=args.num_demos,
            output_dir=args.output_dir,
            device=args.device,
            dtype=args.dtype,
            seed=args.seed,
            sft={"epochs": args.epochs, **args.sft},
        )
    )
    return 0


def _train_config(args: argparse.Namespace):  # noqa: ANN202
    from agentenv.train import TrainConfig

    flags = {
        "env_id": args.env_id,
        "model": args.model,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "group_size": args.group_size,
        "max_turns": args.max_turns,
        "output_dir": args.output_dir,
        "device": args.device,
        "dtype": args.dtype,
        "seed": args.seed,
        "init_from": args.init_from,
        "eval_tasks": args.eval_tasks,
        "env_kwargs": args.env_kwargs or None,
        "grpo": args.grpo or None,
        "wandb_project": args.wandb,
    }
    flags = {k: v for k, v in flags.items() if v is not None}
    if args.config:
        return TrainConfig.from_file(args.config, **flags)
    if args.resume and args.output_dir:
        from pathlib import Path

        saved = json.loads((Path(args.output_dir) / "config.json").read_text())
        return TrainConfig(**{**saved, **flags})
    return TrainConfig(**flags)


def _cmd_train(args: argparse.Namespace) -> int:
    from agentenv.train import train

    if args.resume and not args.output_dir:
        raise InvalidOptionError("--resume needs --output-dir RUN_DIR (the run to continue)")
    train(config=_train_config(args), resume=args.resume)
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from agentenv.evaluate import EvalConfig, EvalReport, evaluate, format_table

    if args.compare:
        print(format_table([EvalReport.load(p) for p in args.compare]))
        return 0
    if not args.env_id:
        raise InvalidOptionError("eval needs ENV_ID (or --compare A.json B.json)")
    from agentenv.episode import ChatFormat
    from agentenv.generation import TransformersPolicy
    from agentenv.registration import make

    num_tasks = None if args.num_tasks == "all" else int(args.num_tasks)
    config = EvalConfig(
        split=args.split,
        num_tasks=num_tasks,
        samples=args.samples,
        temperature=args.temperature,
        max_turns=args.max_turns,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
    )
    model, tokenizer = _load_policy(args)
    label = args.label or (f"{args.model}+{args.adapter}" if args.adapter else args.model)
    report = evaluate(
        lambda: make(args.env_id, split=args.split, **args.env_kwargs),
        TransformersPolicy(model, tokenizer, dtype=args.dtype),
        ChatFormat(tokenizer),
        config,
        label=label,
    )
    print(format_table([report]))
    if args.output:
        report.save(args.output)
        print(f"written: {args.output}")
    return 0


def _cmd_plot(args: argparse.Namespace) -> int:
    from agentenv.plots import plot_run

    for path in plot_run(args.run_dir):
        print(path)
    return 0


def _cmd_show(args: argparse.Namespace) -> int:
    from agentenv.viewer import render_html

    try:
        print(render_html(args.run_dir, args.step))
    except FileNotFoundError as exc:
        raise InvalidOptionError(str(exc)) from exc
    return 0


def _cmd_quickstart(args: argparse.Namespace) -> int:
    """SFT warm start, then GRPO from it, then the before/after eval and plots."""
    from agentenv.train import TrainConfig, train
    from agentenv.warmstart import SFTRunConfig, sft

    out = args.output_dir or f"runs/quickstart-{time.strftime('%Y%m%d-%H%M%S')}"
    ckpt = sft(
        SFTRunConfig(
            env_kwargs=QUICKSTART_ENV,
            num_demos=args.demos,
            output_dir=f"{out}/sft",
            device=args.device,
            dtype=args.dtype,
            sft={"epochs": 1, "batch_size": 8},
        )
    )
    run_dir = train(
        config=TrainConfig(
            env_kwargs=QUICKSTART_ENV,
            init_from=str(ckpt),
            steps=args.steps,
            batch_size=4,
            group_size=8,
            max_turns=2,
            max_new_tokens=48,
            max_episode_tokens=384,
            temperature=0.7,  # at 1.0 a small warm-started model rarely answers right
            eval_tasks=args.eval_tasks,
            output_dir=f"{out}/grpo",
            device=args.device,
            dtype=args.dtype,
            save_every=args.steps,
            grpo={"learning_rate": 2e-4},
        )
    )
    _print_learning_signal(run_dir)
    return 0


def _print_learning_signal(run_dir: str | Path) -> None:
    """Print the train reward per step and whether the held-out gain is significant."""
    from agentenv.evaluate import EvalReport, compare

    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").open()]
    steps = [r for r in rows if "frac_reward_zero_std" in r]
    if steps:
        rewards = " ".join(f"{r['rewards/mean']:.2f}" for r in steps)
        useful = sum(1 - r["frac_reward_zero_std"] for r in steps) / len(steps)
        print(
            f"GRPO train reward per step: {rewards}; groups with a learning signal "
            f"(reward variance > 0): {useful:.0%}."
        )
    before, after = (Path(run_dir) / "eval" / f"{k}.json" for k in ("before", "after"))
    if before.exists() and after.exists():
        d = compare(EvalReport.load(before), EvalReport.load(after))
        gain, se = d["accuracy_diff"], d["accuracy_diff_stderr"]
        verdict = "more" if gain > 2 * se else "NOT more"
        print(
            f"Held-out accuracy gain of GRPO over its SFT warm start: {gain:+.3f} ± {se:.3f} "
            f"(paired stderr): {verdict} than 2 standard errors. README 'Reproduce' has the "
            "longer recipe (200 test tasks)."
        )


def _env_args(p: argparse.ArgumentParser, positional: bool = True) -> None:
    if positional:
        p.add_argument("env_id", nargs="?" if not positional else None)
    p.add_argument(
        "--env-kwargs",
        type=_json_arg,
        default={},
        help='env constructor arguments as JSON, e.g. \'{"source": "word_problems"}\'',
    )
    p.add_argument("--model", default="smollm2-135m-instruct", help="alias, HF id or local path")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    _dtype_arg(p)
    p.add_argument("--seed", type=int, default=0)


def _dtype_arg(p: argparse.ArgumentParser, default: str | None = "auto") -> None:
    p.add_argument(
        "--dtype",
        default=default,
        choices=["auto", "float32", "bfloat16", "float16"],
        help="compute dtype; auto: bfloat16 on GPUs and on CPUs with native bf16, else float32",
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``agentenv`` command."""
    parser = argparse.ArgumentParser(
        prog="agentenv", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="list registered environments").set_defaults(fn=_cmd_list)

    p = sub.add_parser("demo", help="play one episode with a model and print the transcript")
    p.add_argument("env_id", nargs="?", default="Calculator-v0")
    _env_args(p, positional=False)
    p.add_argument("--adapter", default=None, help="checkpoint folder to apply")
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.set_defaults(fn=_cmd_demo)

    p = sub.add_parser("sft", help="supervised warm start on the env's demonstrations")
    _env_args(p)
    p.add_argument("--num-demos", type=int, default=256)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--sft", type=_json_arg, default={}, help="SFTConfig overrides as JSON")
    p.add_argument("--output-dir", default=None)
    p.set_defaults(fn=_cmd_sft)

    p = sub.add_parser("train", help="train with GRPO")
    p.add_argument("env_id", nargs="?", default=None, help="default: --config's, or Calculator-v0")
    _env_args(p, positional=False)
    p.set_defaults(model=None, seed=None, dtype=None)
    for flag, kind in (
        ("--steps", int),
        ("--batch-size", int),
        ("--group-size", int),
        ("--max-turns", int),
        ("--eval-tasks", int),
    ):
        p.add_argument(flag, type=kind, default=None)
    p.add_argument("--config", default=None, help="YAML or JSON file of TrainConfig fields")
    p.add_argument("--output-dir", default=None)
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    p.add_argument("--init-from", default=None, help="checkpoint to start from (e.g. SFT)")
    p.add_argument("--grpo", type=_json_arg, default={}, help="GRPOConfig overrides as JSON")
    p.add_argument("--wandb", default=None, metavar="PROJECT", help="log to W&B")
    p.set_defaults(fn=_cmd_train)

    p = sub.add_parser("eval", help="evaluate a model on a split")
    p.add_argument("env_id", nargs="?")
    _env_args(p, positional=False)
    p.add_argument("--adapter", default=None, help="checkpoint folder (adapter/ or model/)")
    p.add_argument("--split", default="test", choices=["train", "test"])
    p.add_argument("--num-tasks", default="200", help="N or 'all'")
    p.add_argument("--samples", type=int, default=1, help="K samples per task (pass@k)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--label", default=None)
    p.add_argument("--output", default=None, help="write the report as JSON")
    p.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"), default=None)
    p.set_defaults(fn=_cmd_eval)

    p = sub.add_parser("plot", help="redraw RUN_DIR/plots/*.png")
    p.add_argument("run_dir")
    p.set_defaults(fn=_cmd_plot)

    p = sub.add_parser("show", help="write an HTML page of sampled episodes")
    p.add_argument("run_dir")
    p.add_argument("--step", type=int, default=None)
    p.set_defaults(fn=_cmd_show)

    p = sub.add_parser("quickstart", help="SFT -> GRPO -> eval on the default, in minutes")
    p.add_argument("--demos", type=int, default=96)
    p.add_argument("--steps", type=int, default=12, help="GRPO steps of 4 tasks x 8 samples")
    p.add_argument("--eval-tasks", type=int, default=50, help="held-out tasks, before and after")
    p.add_argument("--output-dir", default=None)
    p.add_argument("--device", default=None)
    _dtype_arg(p)
    p.set_defaults(fn=_cmd_quickstart)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``agentenv`` console script."""
    import agentenv  # noqa: F401 - registers the bundled environments

    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except AgentEnvError as exc:
        print(f"agentenv: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
