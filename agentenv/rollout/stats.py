"""What a batch of episodes did with their tools: calls per episode and how often a
policy made a second call, for the training loop's metrics and ``agentenv eval``.

Calls are counted from the env's ``info["num_tool_calls"]`` at the episode's end (every
:class:`~agentenv.env.core.ToolEnv` reports it); an env that does not report it counts 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

HISTOGRAM_TOP = 3  # calls counted 0, 1, 2 and "3+"


def tool_call_stats(episodes: Sequence[Any]) -> dict[str, float]:
    """``tool_calls_mean``, ``second_call_rate`` (share of episodes with >= 2 calls) and
    the histogram ``tool_calls/0`` ... ``tool_calls/3+`` (shares of episodes), over
    ``episodes`` (anything with an ``info`` dict). Empty input gives zeros."""
    calls = [int(e.info.get("num_tool_calls", 0)) for e in episodes]
    n = max(len(calls), 1)
    out = {
        "tool_calls_mean": sum(calls) / n,
        "second_call_rate": sum(c >= 2 for c in calls) / n,
    }
    for k in range(HISTOGRAM_TOP):
        out[f"tool_calls/{k}"] = sum(c == k for c in calls) / n
    out[f"tool_calls/{HISTOGRAM_TOP}+"] = sum(c >= HISTOGRAM_TOP for c in calls) / n
    return out
