"""The ``agentenv`` command line.

agentenv list                      registered environments
agentenv demo [ENV_ID] [--model M] play one episode with a model and print it
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from agentenv.errors import AgentEnvError


def _cmd_list(args: argparse.Namespace) -> int:
    from agentenv.registration import registry

    for env_id, spec in registry().items():
        kwargs = f"  {spec.kwargs}" if spec.kwargs else ""
        entry = spec.entry_point if isinstance(spec.entry_point, str) else spec.entry_point.__name__
        print(f"{env_id:32s} {entry}{kwargs}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from agentenv import models
    from agentenv.play import ChatModelPolicy, play_episode
    from agentenv.registration import make

    env = make(args.env_id, split="test", render_mode="ansi")
    print(f"Loading {args.model} ...", flush=True)
    start = time.perf_counter()
    model, tokenizer = models.load(args.model, device=args.device)
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


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``agentenv`` command."""
    parser = argparse.ArgumentParser(
        prog="agentenv", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("list", help="list registered environments")
    p.set_defaults(fn=_cmd_list)
    p = sub.add_parser("demo", help="play one episode with a model and print the transcript")
    p.add_argument("env_id", nargs="?", default="Calculator-v0")
    p.add_argument("--model", default="smollm2-135m-instruct", help="alias, HF id or local path")
    p.add_argument("--seed", type=int, default=0, help="reset seed (picks the task)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cpu)")
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.set_defaults(fn=_cmd_demo)
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
