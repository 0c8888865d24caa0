"""Stable hashes for deciding a task's split, or which demonstrations re-query.

The bundled task sets decide "is this item on the test side?" and "does this demonstration
start with a miss?" from a hash of a key (a question, a gold document, a task id), so the
answer is the same on every machine, in every process and under any ``PYTHONHASHSEED``.
"""

from __future__ import annotations

import hashlib

__all__ = ["hashed_split", "stable_fraction", "stable_hash"]


def stable_hash(key: str) -> int:
    """A 64-bit integer from ``key`` (BLAKE2b, 8 bytes, big-endian): the same everywhere."""
    return int.from_bytes(hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest(), "big")


def stable_fraction(key: str) -> float:
    """``key``'s :func:`stable_hash` mapped into ``[0, 1)``: ``stable_fraction(k) < p`` picks
    about a share ``p`` of keys, the same keys every time."""
    return stable_hash(key) / 2**64


def hashed_split(key: str, test_fraction: float) -> str:
    """``"test"`` for about a share ``test_fraction`` of keys (in steps of 1/10,000), else
    ``"train"``: the Calculator's and Workspace's rule (RAG's questions use
    :func:`stable_fraction`, which picks other keys)."""
    return "test" if stable_hash(key) % 10_000 < test_fraction * 10_000 else "train"
