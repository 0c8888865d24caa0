"""How episodes are collected (torch-free: the command line builds flags from it)."""

from __future__ import annotations

from dataclasses import dataclass

from agentenv.config import option
from agentenv.errors import InvalidOptionError
from agentenv.lm.backend import SamplingConfig

BATCHING = ("lockstep", "continuous")


@dataclass
class RolloutConfig:
    """How episodes are collected."""

    group_size: int = option(8, "Episodes per task (G); all reset with the task's seed.")
    max_turns: int = option(5, "Policy turns per episode (the env's own limit may be lower).")
    max_episode_tokens: int = option(2048, "Token budget per episode (prompt + all turns).")
    sampling: SamplingConfig = option(SamplingConfig(), "Per-turn sampling settings (section).")
    env_workers: int = option(8, "Threads stepping environments concurrently.")
    batching: str = option(
        "lockstep",
        "lockstep: every turn of the batch is one generate call, then every env steps. "
        "continuous: each episode advances on its own; its next turn joins the running "
        "batch as soon as its env answers (no turn waits for the slowest row; which is "
        "faster depends on the env and the device: docs/benchmarks.md).",
    )
    max_concurrency: int = option(
        64, "continuous batching: most episodes decoding at once; the others wait."
    )
    episode_timeout_s: float | None = option(
        None,
        "Wall-clock limit of an episode from the start of the collection; past it the "
        "episode ends (stop_reason 'timeout') at its next turn or inside a slow env step. "
        "None: no limit.",
    )
    show_progress: bool = option(True, "Show a progress bar over the batch.")

    def __post_init__(self) -> None:
        names = ("group_size", "max_turns", "max_episode_tokens", "env_workers", "max_concurrency")
        for name in names:
            if getattr(self, name) < 1:
                raise InvalidOptionError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.batching not in BATCHING:
            raise InvalidOptionError(f"batching must be one of {BATCHING}, got {self.batching!r}")
        if self.episode_timeout_s is not None and self.episode_timeout_s <= 0:
            raise InvalidOptionError(
                f"episode_timeout_s must be > 0 or None (no limit), got {self.episode_timeout_s}"
            )
