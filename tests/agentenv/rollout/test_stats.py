"""Tool calls per episode, by hand."""

from types import SimpleNamespace

import pytest

from agentenv.rollout.stats import tool_call_stats


def test_tool_call_stats_by_hand():
    calls = [0, 1, 2, 2, 5, None]  # None: an env that does not report calls (counts 0)
    episodes = [SimpleNamespace(info={} if c is None else {"num_tool_calls": c}) for c in calls]
    stats = tool_call_stats(episodes)
    assert stats == pytest.approx(
        {
            "tool_calls_mean": 10 / 6,
            "second_call_rate": 3 / 6,
            "tool_calls/0": 2 / 6,
            "tool_calls/1": 1 / 6,
            "tool_calls/2": 2 / 6,
            "tool_calls/3+": 1 / 6,
        }
    )
    assert tool_call_stats([])["tool_calls_mean"] == 0.0
