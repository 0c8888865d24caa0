"""What both sides of ``grpo_step.py`` share so that they do the same work.

The env and its task ids per step, the ``--reward-noise`` hash, agentenv's LoRA defaults
(TRL gets the same) and the compute dtype that ``--dtype`` resolves to on this machine.
"""

from __future__ import annotations

import argparse
import hashlib
from typing import Any

ENV_ID = "Calculator-v0"
TOOL_SLACK = 64  # completion tokens per tool round allowed for the tool result (TRL's budget)


def task_ids(args: argparse.Namespace, step: int) -> list[int]:
    """The train-split task ids of one step: the same in both systems."""
    return list(range(step * args.batch_size, (step + 1) * args.batch_size))


def all_task_ids(args: argparse.Namespace) -> list[int]:
    """The task ids of every step, in order."""
    return [i for s in range(args.steps) for i in task_ids(args, s)]


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
    from algorithms import GRPOConfig

    c = GRPOConfig()
    return {
        "r": c.lora_r,
        "alpha": c.lora_alpha,
        "dropout": c.lora_dropout,
        "targets": list(c.lora_target_modules),
    }


def compute_dtype(args: argparse.Namespace) -> str:
    """``--dtype`` resolved on this machine: the same compute dtype for both systems."""
    import agentenv

    return str(agentenv.resolve_dtype(args.dtype, args.device)).removeprefix("torch.")
