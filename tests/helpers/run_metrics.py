"""Two runs' logged metrics compared without their timings (a resumed run against an
uninterrupted one: every other value must be equal)."""

from __future__ import annotations

from pathlib import Path

from agentenv.run.tracking import read_metrics

# Wall-clock metrics and the rates computed from them, by key prefix.
TIMINGS = (
    "time/",
    "rollout/generate_s",
    "rollout/env_",
    "rollout/total_s",
    "rollout/prefill_s",
    "rollout/tokens_per",
    "tokens_per",
)


def untimed_metrics(run: Path) -> list[dict]:
    """Every row of ``run``'s metrics without the keys of :data:`TIMINGS`."""
    return [{k: v for k, v in r.items() if not k.startswith(TIMINGS)} for r in read_metrics(run)]
