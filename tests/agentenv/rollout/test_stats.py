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


def test_retrieval_stats_by_hand():
    from agentenv.rollout.stats import retrieval_stats

    infos = [
        {"search_gold_hits": [0, 1], "gold_retrieved": [True, False]},  # missed, searched again
        {"search_gold_hits": [0], "gold_retrieved": [False, False]},  # missed, stopped
        {"search_gold_hits": [1, 1], "gold_retrieved": [True, True]},
        {"search_gold_hits": [1], "gold_retrieved": [True]},  # single-hop: no second hop
        {},  # an env that reports no retrieval
    ]
    stats = retrieval_stats([SimpleNamespace(info=i) for i in infos])
    assert stats == pytest.approx({"requery_after_miss_rate": 1 / 2, "second_hop_recall": 1 / 3})
    assert retrieval_stats([SimpleNamespace(info={})]) == {}


def test_prices_found_rate_by_hand():
    from agentenv.rollout.stats import retrieval_stats

    infos = [
        {"prices_found": [True, True]},
        {"prices_found": [True, False]},  # one lookup missed and was not repeated
        {"prices_found": [False, False]},
        {"search_gold_hits": [1], "gold_retrieved": [True]},  # a search env: not counted
    ]
    stats = retrieval_stats([SimpleNamespace(info=i) for i in infos])
    assert stats == pytest.approx({"prices_found_rate": 1 / 3})
