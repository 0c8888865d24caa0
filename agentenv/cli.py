"""The ``agentenv`` command line.

agentenv list [--import MODULE]            registered environments (bundled and your own)
agentenv demo [ENV_ID]                     play one episode with a model, print it
agentenv sft ENV_ID                        supervised warm start on demonstrations
agentenv train ENV_ID                      GRPO training run
agentenv eval ENV_ID --model M             accuracy, pass@k, tool use on a split
agentenv plot RUN_DIR                      redraw a run's plots
agentenv show RUN_DIR [--step N]           HTML view of sampled episodes, token by token
agentenv export CHECKPOINT OUT             a plain HF model folder (LoRA merged in float32)
agentenv serve ENV_ID --port N             an env as an OpenEnv server (a session per client)
agentenv quickstart                        SFT -> GRPO -> eval on the default, in minutes
"""

from __future__ import annotations

import argparse
import difflib
import ipaddress
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agentenv import config as config_lib
from agentenv.errors import AgentEnvError, InvalidOptionError
from agentenv.lm.models import DEFAULT_MODEL
from agentenv.lm.precision import DTYPES

QUICKSTART_ENV = {"source": "word_problems", "prompt_style": "compact"}


def _cmd_list(args: argparse.Namespace) -> int:
    from agentenv.env.registration import registry

    for env_id, spec in registry().items():
        entry = spec.entry_point if isinstance(spec.entry_point, str) else spec.entry_point.__name__
        print(f"{env_id:32s} {entry}" + (f"  {spec.kwargs}" if spec.kwargs else ""))
    return 0


def _load_policy(args: argparse.Namespace):  # noqa: ANN202
    from agentenv.lm import models
    from agentenv.lm.precision import resolve_dtype
    from agentenv.run.export import base_model_for, checkpoint_quantize, load_from_checkpoint

    device = args.device or models.default_device()
    adapter = getattr(args, "adapter", None)
    trained_on = checkpoint_quantize(adapter) if adapter else None
    if trained_on and trained_on != getattr(args, "quantize", None):
        print(
            f"note: {adapter} was trained on a {trained_on} base; this evaluates it on the "
            f"unquantized one (pass --quantize {trained_on} for the base it was trained on)",
            file=sys.stderr,
        )
    model, tokenizer = models.load(  # an adapter's own base unless --model names another
        base_model_for(adapter, args.model),
        dtype=resolve_dtype(args.dtype, device),
        device=device,
        quantize=getattr(args, "quantize", None),
    )
    if adapter:
        # A LoRA adapter stays unmerged: folded into bf16 weights most of a small update
        # rounds away (the sampler computes it separately, see agentenv.lm.weights).
        model = load_from_checkpoint(model, adapter).requires_grad_(False)
        model.eval()
    return model, tokenizer


def _cmd_demo(args: argparse.Namespace) -> int:
    from agentenv.env.play import ChatModelPolicy, play_episode
    from agentenv.env.registration import make

    _demo_settings(args)
    env = make(args.env_id, split="test", **args.env_kwargs)  # before the model loads
    print(f"Loading {args.model} ...", flush=True)
    start = time.perf_counter()
    model, tokenizer = _load_policy(args)
    print(f"Loaded in {time.perf_counter() - start:.1f} s. Playing one {args.env_id} episode.\n")
    policy = ChatModelPolicy(
        model, tokenizer, max_new_tokens=args.max_new_tokens, temperature=args.temperature
    )
    result = play_episode(env, policy, seed=args.seed, max_steps=args.max_turns or 100)
    for m in result.messages:
        print(f"--- {m['role']} ---\n{m['content']}\n")
    env.close()
    status = "terminated" if result.terminated else "truncated"
    print(f"=== reward {result.reward:g} ({status}); info: {result.info}")
    return 0


DEMO_DEFAULTS = {"env_id": "Calculator-v0", "env_kwargs": {}, "max_new_tokens": 192}


def _demo_settings(args: argparse.Namespace) -> None:
    """Fill in ``demo``'s settings not given: from what ``--adapter``'s run trained with
    (saying so in one line), else the defaults. A bad ``--adapter`` fails here."""
    from agentenv.run.recorded import (
        check_checkpoint,
        one_env_record,
        recorded_note,
        recorded_run,
        take_recorded,
    )

    check_checkpoint(args.adapter, "--adapter")
    found = recorded_run(args.adapter) if args.adapter else None
    if found is not None:
        record, chosen = one_env_record(found[0], args.env_id)
        if chosen:  # a mixture: one of its envs (ENV_ID may have named it)
            args.env_id = None
            print(chosen, file=sys.stderr)
        found = (record, found[1])
        names = ("env_id", "env_kwargs", "max_turns", "max_new_tokens")
        given = {k: getattr(args, k) for k in names if getattr(args, k) is not None}
        given["max_episode_tokens"] = None  # demo has no episode budget
        taken = take_recorded(found[0], given)
        for key, value in taken.items():
            setattr(args, key, value)
        if taken:
            env_id = args.env_id or found[0]["env_id"]
            print(recorded_note(args.adapter, taken, found[1], env_id), file=sys.stderr)
    for key, value in DEMO_DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, value)


def _overrides(args: argparse.Namespace) -> dict:
    """The settings given on the command line: flags, and the positional ENV_ID."""
    overrides = config_lib.flag_overrides(args, args.config_flags)
    if args.env_arg:
        overrides["env_id"] = args.env_arg
    return overrides


def _cmd_sft(args: argparse.Namespace) -> int:
    from agentenv.run.config import SFTRunConfig, resolve
    from agentenv.run.sft import sft

    overrides = _overrides(args)
    sft(resolve(SFTRunConfig, args.config, overrides))
    _end_if_multi_process()
    return 0


def _train_config(args: argparse.Namespace):  # noqa: ANN202
    """Defaults, then ``--config FILE`` (or a resumed run's config.json), then flags."""
    from agentenv.run.config import TrainConfig

    overrides = _overrides(args)
    file = args.config
    if args.resume and not file:
        if not overrides.get("output_dir"):
            raise InvalidOptionError("--resume needs --output-dir RUN_DIR (the run to continue)")
        file = Path(overrides["output_dir"]) / "config.json"
        if not file.is_file():
            raise InvalidOptionError(f"--resume needs an existing run: {file} does not exist")
    return TrainConfig.resolve(file, overrides)


def _cmd_train(args: argparse.Namespace) -> int:
    from agentenv.run.train import train

    train(config=_train_config(args), resume=args.resume)
    _end_if_multi_process()
    return 0


def _end_if_multi_process() -> None:
    """In a process of a finished multi-process run (``agentenv train`` or ``sft`` under
    ``accelerate launch`` or ``torchrun``), end with status 0 at once, skipping the
    interpreter's teardown: gloo's worker threads may still hold the last collective's
    tensors then, and freeing them while the interpreter shuts down aborts the process
    ("terminate called without an active exception", a rank exiting -6 after a run that
    succeeded). Destroying the process group first is no cure: it deadlocked a rank, gloo's
    thread waiting for the GIL its destructor held. Nothing is lost: the run directory is
    written (atomically) and the loggers closed before the command returns."""
    from agentenv.run.train import processes

    if processes()[0] == 1:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _cmd_seeds(args: argparse.Namespace) -> int:
    from agentenv.run.evaluate import EvalReport
    from agentenv.run.seeds import Arm, format_arms, run_seeds

    baseline = EvalReport.load(args.baseline) if args.baseline else None
    if args.report:
        arms = [Arm.load(folder, part=args.part) for folder in args.report]
        print(format_arms(arms, baseline))
        return 0
    train_args = list(args.train_args)
    if train_args[:1] == ["--"]:
        train_args = train_args[1:]
    if not train_args:
        raise InvalidOptionError(
            "agentenv seeds needs the train command's arguments after --, e.g. `agentenv "
            "seeds --seeds 0 1 -- --config recipe.yaml --output-dir runs/arm`; or --report "
            "ARM_DIR to report arms already run"
        )
    parsed = build_parser().parse_args(["train", *train_args])  # bad flags fail here
    config = _train_config(parsed)  # bad values too, before any run starts
    if not config.output_dir:
        raise InvalidOptionError(
            "agentenv seeds writes each seed to OUT/seed_N: give the arm's folder as "
            "--output-dir OUT (after --) or output_dir in --config"
        )
    kept, skip = [], False
    for arg in train_args:  # each seed gets its own --seed and --output-dir
        if skip:
            skip = False
        elif arg in ("--seed", "--output-dir", "--resume"):
            skip = arg != "--resume"
        elif not arg.startswith(("--seed=", "--output-dir=")):
            kept.append(arg)
    imports = [x for module in args.imports or [] for x in ("--import", module)]
    arm = run_seeds(
        [*imports, *kept], args.seeds, Path(config.output_dir), args.eval_tasks, args.jobs,
        eval_args=imports, part=args.part,
    )  # fmt: skip
    print(format_arms([arm], baseline))
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from agentenv.run.config import EvalRunConfig, resolve
    from agentenv.run.evaluate import EvalReport, evaluate_mixture, format_table

    if args.part is not None and not args.compare:
        raise InvalidOptionError(
            f"--part {args.part} goes with --compare A.json B.json (it picks each report's "
            "part); to evaluate one env of several, give that env alone (ENV_ID or --envs)"
        )
    if args.compare:
        reports = [EvalReport.load(p) for p in args.compare]
        if args.part is not None:  # a report over several envs: its part; one env's: whole
            reports = [r.part(args.part) if r.by_env else r for r in reports]
        print(format_table(reports))
        return 0
    overrides = _overrides(args)
    base, note = _checkpoint_settings(args.config, overrides)
    run = resolve(EvalRunConfig, args.config, overrides, base=base)
    if note:
        print(note, file=sys.stderr)
    from agentenv.lm.engines import check_engine, make_policy
    from agentenv.rollout.episode import ChatFormat

    mixture = run.mixture()  # one env, or several (--envs)
    for spec in mixture.specs:
        spec.make(run.eval.split).close()  # before the model loads
    if run.adapter:
        from agentenv.run.leaks import seen_warning

        for spec in mixture.specs:
            warning = seen_warning(run.adapter, spec.env_id, spec.env_kwargs, run.eval.split)
            if warning:
                print(warning, file=sys.stderr)
    check_engine(run.generation)
    judge = run.make_judge()
    model, tokenizer = _load_policy(run)
    label = run.label or (f"{run.model}+{run.adapter}" if run.adapter else run.model)
    policy = make_policy(run.generation, model, tokenizer, model_name=run.model, dtype=run.dtype)
    try:
        report = evaluate_mixture(
            mixture,
            run.eval.split,
            policy,
            ChatFormat(tokenizer),
            run.eval,
            label=label,
            show_progress=True,
            judge=judge,
            about={
                "env_id": run.env_id,
                "env_kwargs": run.env_kwargs,
                "model": run.model,
                "adapter": run.adapter,
            },
        )
    finally:  # a vLLM engine shuts down; a server engine unloads the adapter it loaded
        if hasattr(policy, "close"):
            policy.close()
    print(format_table([report]))
    if run.output:
        report.save(run.output)
        print(f"written: {run.output}")
    return 0


def _checkpoint_settings(file: str | None, overrides: dict) -> tuple[dict, str | None]:
    """``eval --adapter CKPT``: the env and rollout settings CKPT's run trained with that
    neither ``file`` nor the flags give, as a config layer under both, and the line that
    says so (None: nothing taken). A bad ``--adapter`` fails here, before any model loads."""
    from agentenv.run.recorded import (
        ROLLOUT_SETTINGS,
        check_checkpoint,
        recorded_note,
        recorded_run,
        take_recorded,
    )

    given = config_lib.merge(config_lib.load_file(file) if file else {}, overrides)
    adapter = given.get("adapter")
    check_checkpoint(adapter, "--adapter")
    found = recorded_run(adapter) if adapter else None
    if found is None:
        return {}, None
    record, source = found
    flat = {k: given[k] for k in ("env_id", "env_kwargs", "envs", "quantize") if k in given}
    section = given.get("eval") if isinstance(given.get("eval"), dict) else {}
    flat.update({k: section[k] for k in ROLLOUT_SETTINGS if k in section})
    taken = take_recorded(record, flat)
    if not taken:
        return {}, None
    base = {k: taken[k] for k in ("env_id", "env_kwargs", "envs", "quantize") if k in taken}
    rollout = {k: taken[k] for k in ROLLOUT_SETTINGS if k in taken}
    if rollout:
        base["eval"] = rollout
    return base, recorded_note(adapter, taken, source, given.get("env_id", record["env_id"]))


def _cmd_export(args: argparse.Namespace) -> int:
    from agentenv.run.export import export_checkpoint

    out = export_checkpoint(args.checkpoint, args.out, model=args.model, dtype=args.dtype)
    print(f"exported {args.checkpoint} -> {out} (AutoModelForCausalLM.from_pretrained loads it)")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from agentenv.integrations.openenv import app
    except ImportError as exc:
        raise InvalidOptionError(
            f"agentenv serve needs OpenEnv: {exc}; `pip install 'agentenv[openenv]'`"
        ) from exc
    from agentenv.integrations.openenv.server import TOKEN_ENV_VAR

    token = _serve_token(args, TOKEN_ENV_VAR)
    local = _is_loopback(args.host)
    if not local and token is None:
        raise InvalidOptionError(
            f"--host {args.host} lets other machines reach the env: pass --token-file PATH "
            f"(or set {TOKEN_ENV_VAR}; clients send the same), or serve on 127.0.0.1"
        )
    application = app(
        args.env_id,
        max_sessions=args.max_sessions,
        step_timeout_s=args.step_timeout_s or None,
        token=token,
        require_bwrap=not local and not args.allow_unsandboxed_code,
        **args.env_kwargs,
    )
    guard = "; requests need the token" if token else ""
    print(f"serving {args.env_id} on http://{args.host}:{args.port} (OpenEnv{guard}; Ctrl-C stops)")
    uvicorn.run(application, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def _serve_token(args: argparse.Namespace, env_var: str) -> str | None:
    """The secret ``serve`` requires: ``--token-file``'s first line, else ``--token`` (with a
    warning: ``ps`` and the shell history show it), else ``$env_var``, else None."""
    if args.token_file:
        try:
            lines = Path(args.token_file).read_text().splitlines()
        except OSError as exc:
            raise InvalidOptionError(
                f"--token-file {args.token_file}: cannot read it ({exc.strerror})"
            ) from exc
        if not lines or not lines[0].strip():
            raise InvalidOptionError(f"--token-file {args.token_file} is empty; write the secret")
        return lines[0].strip()
    if args.token:
        print(
            "warning: --token puts the secret where `ps` and the shell's history show it; "
            f"pass --token-file PATH or set {env_var} instead",
            file=sys.stderr,
        )
        return args.token
    return os.environ.get(env_var) or None


def _is_loopback(host: str) -> bool:
    """Whether ``host`` only reaches this machine (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: it may resolve to anything
        return False


def _cmd_plot(args: argparse.Namespace) -> int:
    from agentenv.run.plots import plot_run

    for path in plot_run(args.run_dir):
        print(path)
    return 0


def _cmd_show(args: argparse.Namespace) -> int:
    from agentenv.run.viewer import render_html

    try:
        print(render_html(args.run_dir, args.step))
    except FileNotFoundError as exc:
        raise InvalidOptionError(str(exc)) from exc
    return 0


def _cmd_quickstart(args: argparse.Namespace) -> int:
    """SFT warm start, then GRPO from it, then the before/after eval and plots."""
    from agentenv.run.config import SFTRunConfig, TrainConfig
    from agentenv.run.sft import sft
    from agentenv.run.train import train

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
            rollout={
                "max_turns": 2,
                "max_episode_tokens": 384,
                # at 1.0 a small warm-started model rarely answers right
                "sampling": {"max_new_tokens": 48, "temperature": 0.7},
            },
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
    from agentenv.run.evaluate import EvalReport, compare

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
            f"(paired stderr): {verdict} than 2 standard errors. docs/reproduce.md has the "
            "longer recipe (200 test tasks)."
        )


class _Parser(argparse.ArgumentParser):
    """An argument parser (and its sub-parsers) that takes no abbreviation of a flag
    (``--temp`` is not ``--temperature``) and answers a misspelt flag with the closest one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_args(self, args: Any = None, namespace: Any = None) -> argparse.Namespace:  # type: ignore[override]
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            parser = self._command(parsed)
            parser.error(f"unrecognized arguments: {' '.join(extras)}{parser.suggest(extras)}")
        return parsed

    def _command(self, parsed: argparse.Namespace) -> _Parser:
        """The parser of the sub-command ``parsed`` ran (this one if none)."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                return action.choices.get(getattr(parsed, action.dest, None), self)
        return self

    def suggest(self, extras: Sequence[str]) -> str:
        """``"; did you mean --X?"`` for the first unknown flag close to one of this parser's
        (the spelling its help shows), else ``""``."""
        shown = [
            option
            for action in self._actions
            if action.help != argparse.SUPPRESS
            for option in action.option_strings
        ]
        for extra in extras:
            flag = extra.split("=")[0]
            if not flag.startswith("--"):
                continue
            longer = [option for option in shown if option.startswith(flag)]  # a prefix
            initials = [o for o in shown if "-" in o[2:] and _initials(o) == flag[2:]]  # --lr
            close = initials or longer or difflib.get_close_matches(flag, shown, n=1, cutoff=0.6)
            if close:
                return f"; did you mean {' or '.join(close[:3])}?"
        return ""


def _initials(option: str) -> str:
    """``"--learning-rate"`` -> ``"lr"``: what ``--lr`` abbreviates."""
    return "".join(word[:1] for word in option[2:].split("-"))


def _env_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--env-kwargs",
        type=config_lib.parse_json_object,
        default=None,
        metavar="JSON",
        help='env constructor arguments as JSON, e.g. \'{"source": "word_problems"}\'',
    )
    p.add_argument("--model", default=DEFAULT_MODEL, help="alias, HF id or local path")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    _dtype_arg(p)
    p.add_argument("--seed", type=int, default=0)


def _dtype_arg(p: argparse.ArgumentParser, default: str | None = "auto") -> None:
    p.add_argument(
        "--dtype",
        default=default,
        choices=DTYPES,
        help="compute dtype; auto: bfloat16 on GPUs and CPUs where it is faster (native bf16; "
        "on Intel, AMX), else float32",
    )


def _command(sub: Any, name: str, **kwargs: Any) -> argparse.ArgumentParser:
    """A subcommand; every one takes ``--import MODULE`` (run before the command)."""
    p = sub.add_parser(name, **kwargs)
    p.add_argument(
        "--import",
        dest="imports",
        action="append",
        metavar="MODULE",
        help="import MODULE (a module name or a .py path) first, so its register() calls run; "
        "an env id 'MODULE:Name-v0' does the same",
    )
    return p


def _settings_command(
    sub: Any,
    name: str,
    defaults: Any,
    fn: Any,
    *,
    help: str,
    description: str,  # noqa: A002
) -> argparse.ArgumentParser:
    """A command whose settings are one config tree: ``ENV_ID``, ``--config FILE`` and a
    flag per field of ``defaults`` (see :mod:`agentenv.config`)."""
    p = _command(
        sub,
        name,
        help=help,
        usage="%(prog)s [-h] [ENV_ID] [--config FILE] [--import MODULE] [--FLAG VALUE ...]",
        description=f"{description} Settings: defaults, then --config FILE, then flags; the "
        "effective config is saved with the results.",
    )
    p.add_argument(
        "env_arg",
        nargs="?",
        metavar="ENV_ID",
        help="the env id (or --env-id); default: --config's, or Calculator-v0; "
        "MODULE:Name-v0 imports MODULE first",
    )
    p.add_argument(
        "--config", default=None, metavar="FILE", help="YAML or JSON, nested like config.json"
    )
    p.set_defaults(fn=fn, config_flags=config_lib.add_flags(p, defaults))
    return p


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``agentenv`` command."""
    parser = _Parser(
        prog="agentenv", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )

    sub = parser.add_subparsers(dest="command", required=True)
    _command(sub, "list", help="list registered environments").set_defaults(fn=_cmd_list)

    p = _command(sub, "demo", help="play one episode with a model and print the transcript")
    p.add_argument(
        "env_id",
        nargs="?",
        default=None,
        help="default: the env --adapter's run trained on, else Calculator-v0",
    )
    _env_args(p)
    p.add_argument(
        "--adapter",
        default=None,
        metavar="CKPT",
        help="checkpoint folder to apply; the env, env kwargs, turns and tokens per turn its "
        "run trained with are used unless given",
    )
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: 192")
    p.add_argument("--max-turns", type=int, default=None, help="default: the env's limit")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.set_defaults(fn=_cmd_demo)

    from agentenv.run.config import SFTRunConfig

    _settings_command(
        sub,
        "sft",
        SFTRunConfig(),
        _cmd_sft,
        help="supervised warm start on the env's demonstrations",
        description="Supervised warm start.",
    )

    from agentenv.run.config import TrainConfig

    p = _settings_command(
        sub,
        "train",
        TrainConfig(),
        _cmd_train,
        help="train with GRPO",
        description="Train with GRPO.",
    )
    p.add_argument("--resume", action="store_true", help="continue RUN_DIR (--output-dir)")

    from agentenv.run.config import EvalRunConfig

    p = _settings_command(
        sub,
        "eval",
        EvalRunConfig(),
        _cmd_eval,
        help="evaluate a model on a split",
        description="Evaluate a model (and adapter) on an env's split: accuracy, pass@k, tool use.",
    )
    p.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"), default=None)
    p.add_argument(
        "--part",
        default=None,
        metavar="NAME",
        help="with --compare: env NAME's part of a report over several envs (--envs), "
        "e.g. a mixture's env against that env's run alone; a one-env report is taken whole",
    )

    p = _command(
        sub,
        "seeds",
        help="run a training recipe once per seed, evaluate each, report them as a set",
        usage="%(prog)s [-h] [--seeds N ...] [--eval-tasks N] [--jobs N] [--baseline EVAL] "
        "[--part NAME] -- TRAIN_ARGS ...\n       %(prog)s --report ARM_DIR ... [--baseline EVAL] "
        "[--part NAME]",
        description="Run `agentenv train TRAIN_ARGS --seed N --output-dir OUT/seed_N` for "
        "each seed (OUT: the --output-dir of TRAIN_ARGS), evaluate each run's last "
        "checkpoint on the test split (its env and limits from the checkpoint) into "
        "OUT/seed_N/eval.json, and report every seed's accuracy, their mean, sd and min, "
        "and each seed's paired difference from --baseline. Seeds already evaluated are "
        "skipped; a seed's run that stopped resumes.",
    )
    p.add_argument(
        "--seeds", type=int, nargs="+", default=[0, 1, 2], metavar="N", help="default: 0 1 2"
    )
    p.add_argument(
        "--eval-tasks", type=int, default=None, metavar="N", help="test tasks (default: eval's)"
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        metavar="N",
        help="seeds run at once, each its own process sharing the CPU cores (and, where "
        "CUDA_VISIBLE_DEVICES lists several GPUs, one each); 1: one after another",
    )
    p.add_argument(
        "--baseline",
        default=None,
        metavar="EVAL.json",
        help="an `agentenv eval --output` report on the same tasks (e.g. the SFT start's)",
    )
    p.add_argument(
        "--report", nargs="+", default=None, metavar="ARM_DIR", help="report these arms only"
    )
    p.add_argument(
        "--part",
        default=None,
        metavar="NAME",
        help="of runs on several envs (--envs), report env NAME's part of each seed's "
        "evaluation (e.g. against a --baseline of that env alone)",
    )
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then train's arguments")
    p.set_defaults(fn=_cmd_seeds)

    p = _command(sub, "export", help="write a checkpoint as a plain Hugging Face model folder")
    p.add_argument("checkpoint", help="checkpoint folder (adapter/ or model/ inside)")
    p.add_argument("out", help="new folder for the merged model, tokenizer and chat template")
    p.add_argument(
        "--model", default=DEFAULT_MODEL, help="base model (default: the one the adapter records)"
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="weights dtype; bfloat16 rounds away most of a small LoRA update",
    )
    p.set_defaults(fn=_cmd_export)

    p = _command(sub, "serve", help="serve an env as an OpenEnv server")
    p.add_argument("env_id", help="a registered env id (agentenv list)")
    p.add_argument(
        "--env-kwargs",
        type=config_lib.parse_json_object,
        default={},
        metavar="JSON",
        help='env constructor arguments as JSON; "split" is the default split of reset',
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="0.0.0.0 to accept other machines (then a token is required)",
    )
    secret = p.add_mutually_exclusive_group()
    secret.add_argument(
        "--token-file",
        default=None,
        metavar="PATH",
        help="a file whose first line is the shared secret every request must carry "
        "(Authorization: Bearer TOKEN); default: $AGENTENV_SERVE_TOKEN (agentenv's clients "
        "send that variable's value)",
    )
    secret.add_argument(
        "--token",
        default=None,
        help="the secret itself; `ps` shows it to every user of the machine: prefer "
        "--token-file or $AGENTENV_SERVE_TOKEN",
    )
    p.add_argument(
        "--allow-unsandboxed-code",
        action="store_true",
        help="off loopback, serve an env that runs code without bubblewrap (rlimit: the "
        "network open, world-readable files visible to the model's code)",
    )
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-sessions", type=int, default=64, help="most concurrent sessions (envs)")
    p.add_argument(
        "--step-timeout-s",
        type=float,
        default=60.0,
        help="a longer step ends its episode as 'timeout' (0: no limit)",
    )
    p.add_argument("--log-level", default="warning", help="uvicorn's log level")
    p.set_defaults(fn=_cmd_serve)

    p = _command(sub, "plot", help="redraw RUN_DIR/plots/*.png")
    p.add_argument("run_dir")
    p.set_defaults(fn=_cmd_plot)

    p = _command(sub, "show", help="write an HTML page of sampled episodes")
    p.add_argument("run_dir")
    p.add_argument("--step", type=int, default=None)
    p.set_defaults(fn=_cmd_show)

    p = _command(sub, "quickstart", help="SFT -> GRPO -> eval on the default, in minutes")
    p.add_argument("--demos", type=int, default=96)
    p.add_argument("--steps", type=int, default=16, help="GRPO steps of 4 tasks x 8 samples")
    p.add_argument("--eval-tasks", type=int, default=50, help="held-out tasks, before and after")
    p.add_argument("--output-dir", default=None)
    p.add_argument("--device", default=None)
    _dtype_arg(p)
    p.set_defaults(fn=_cmd_quickstart)
    return parser


def reference() -> str:
    """The command-line reference (``docs/cli.md``): every command's ``--help``, in order.

    Regenerate the file with ``python -m agentenv.cli reference > docs/cli.md``; a test
    fails when it is out of date.
    """
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    parts = [
        "# agentenv command-line reference\n",
        "Generated by `python -m agentenv.cli reference > docs/cli.md` from the parsers "
        "(every settings flag comes from a config dataclass field and its help).\n",
    ]
    for name, command in sub.choices.items():
        command.formatter_class = lambda prog: argparse.HelpFormatter(prog, width=100)
        parts.append(f"## agentenv {name}\n\n```text\n{command.format_help().rstrip()}\n```\n")
    return "\n".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``agentenv`` console script."""
    import agentenv  # noqa: F401 - registers the bundled environments

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv == ["reference"]:
        print(reference(), end="")
        return 0
    args = build_parser().parse_args(argv)
    try:
        from agentenv.env.registration import import_module

        for module in getattr(args, "imports", None) or []:
            import_module(module)
        return args.fn(args)
    except AgentEnvError as exc:
        print(f"agentenv: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
