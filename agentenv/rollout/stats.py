"""What a batch of episodes did with their tools: calls per episode, how often a policy
made a second call and, for a search env, whether it searched again after a miss and found
the second hop, for the training loop's metrics and ``agentenv eval``.

Calls are counted from the env's ``info["num_tool_calls"]`` at the episode's end (every
:class:`~agentenv.env.core.ToolEnv` reports it); an env that does not report it counts 0.
Retrieval is read from ``info["search_gold_hits"]`` (per search, the gold articles it
returned) and ``info["gold_retrieved"]`` (per gold article in hop order, found or not),
which RAG-v0 reports; lookups from ``info["prices_found"]`` (per item asked, its price
returned yet), which Calculator-v0's ``prices`` source reports. Episodes without them
are left out of those rates.
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


def retrieval_stats(episodes: Sequence[Any]) -> dict[str, float]:
    """``requery_after_miss_rate``: of the episodes whose first search returned no gold
    article, the share that searched again; ``second_hop_recall``: of the episodes with
    two or more gold articles (bridge questions), the share that retrieved the second;
    ``prices_found_rate``: of the episodes that looked prices up, the share whose lookups
    returned every asked item's price. Each only where some episode reports what it
    needs ({} otherwise)."""
    out = {}
    missed = [
        e.info["search_gold_hits"]
        for e in episodes
        if e.info.get("search_gold_hits") and e.info["search_gold_hits"][0] == 0
    ]
    if missed:
        out["requery_after_miss_rate"] = sum(len(hits) >= 2 for hits in missed) / len(missed)
    hops = [
        e.info["gold_retrieved"] for e in episodes if len(e.info.get("gold_retrieved", ())) >= 2
    ]
    if hops:
        out["second_hop_recall"] = sum(bool(found[1]) for found in hops) / len(hops)
    found = [e.info["prices_found"] for e in episodes if e.info.get("prices_found")]
    if found:
        out["prices_found_rate"] = sum(all(f) for f in found) / len(found)
    return out
