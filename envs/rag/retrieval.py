"""The retriever interface, hits, and hybrid fusion.

Every retriever has ``search(query, k) -> list[Hit]`` (best first) and a ``name``:
:class:`~envs.rag.bm25.BM25Retriever` (sparse), :class:`~envs.rag.dense.DenseRetriever`
(MiniLM embeddings in ChromaDB) and :class:`HybridRetriever`, which asks each of its
retrievers for ``fetch_k`` candidates and fuses the lists:

* ``"rrf"`` (default) -- reciprocal rank fusion:
  ``score(c) = sum_i w_i / (rrf_k + rank_i(c))`` with ranks from 1 and ``rrf_k = 60``;
  a chunk missing from a list gets nothing from it.
* ``"weighted"`` -- each list's scores min-max normalised to [0, 1] (a list whose scores
  are all equal maps to 1), then ``score(c) = sum_i w_i * norm_i(c)``.

Ties are broken by first appearance (retriever order, then rank), so fusion is
deterministic.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from envs.rag.corpus import Chunk
from envs.rag.errors import RetrieverConfigError

FUSIONS: tuple[str, ...] = ("rrf", "weighted")


@dataclass(frozen=True)
class Hit:
    """One retrieved chunk and its score (higher is better; scale depends on the retriever)."""

    chunk: Chunk
    score: float

    @property
    def doc_id(self) -> str:
        """The id of the document the chunk comes from."""
        return self.chunk.doc_id


@runtime_checkable
class Retriever(Protocol):
    """What the env's ``search`` tool needs from a retriever (read-only, thread-safe)."""

    name: str

    def search(self, query: str, k: int = 5) -> list[Hit]:
        """The ``k`` best chunks for ``query``, best first (fewer if fewer match)."""
        ...


def unique_docs(hits: Iterable[Hit]) -> list[str]:
    """Document ids of ``hits`` in order, each once (chunks collapsed to documents)."""
    return list(dict.fromkeys(h.doc_id for h in hits))


def top_k_indices(scores: np.ndarray, k: int) -> list[int]:
    """Indices of the ``k`` largest positive ``scores``, best first, ties by index."""
    positive = np.flatnonzero(scores > 0)
    if positive.size == 0:
        return []
    if positive.size > k:
        # Keep every index tied with the k-th value, then order exactly.
        kth = np.partition(scores[positive], positive.size - k)[positive.size - k]
        positive = positive[scores[positive] >= kth]
    order = np.lexsort((positive, -scores[positive]))
    return [int(i) for i in positive[order[:k]]]


def rrf_fuse(
    ranked: Sequence[Sequence[Hit]], weights: Sequence[float], k: int, rrf_k: float = 60.0
) -> list[Hit]:
    """Reciprocal rank fusion of several best-first hit lists (see module doc)."""
    scores: dict[str, float] = {}
    chunks: dict[str, Chunk] = {}
    for hits, weight in zip(ranked, weights, strict=True):
        for rank, hit in enumerate(hits, start=1):
            chunks.setdefault(hit.chunk.id, hit.chunk)
            scores[hit.chunk.id] = scores.get(hit.chunk.id, 0.0) + weight / (rrf_k + rank)
    return _best(scores, chunks, k)


def weighted_fuse(ranked: Sequence[Sequence[Hit]], weights: Sequence[float], k: int) -> list[Hit]:
    """Weighted sum of min-max normalised scores (see module doc)."""
    scores: dict[str, float] = {}
    chunks: dict[str, Chunk] = {}
    for hits, weight in zip(ranked, weights, strict=True):
        if not hits:
            continue
        values = [h.score for h in hits]
        lo, hi = min(values), max(values)
        for hit in hits:
            norm = (hit.score - lo) / (hi - lo) if hi > lo else 1.0
            chunks.setdefault(hit.chunk.id, hit.chunk)
            scores[hit.chunk.id] = scores.get(hit.chunk.id, 0.0) + weight * norm
    return _best(scores, chunks, k)


def _best(scores: dict[str, float], chunks: dict[str, Chunk], k: int) -> list[Hit]:
    order = list(scores)  # insertion order = first appearance
    position = {cid: i for i, cid in enumerate(order)}
    best = sorted(order, key=lambda cid: (-scores[cid], position[cid]))[:k]
    return [Hit(chunks[cid], scores[cid]) for cid in best]


def check_fusion_options(
    names: Sequence[str],
    weights: Mapping[str, float] | None,
    fusion: str,
    rrf_k: float,
    fetch_k: int,
) -> dict[str, float]:
    """Validate fusion options for retrievers ``names``; return the full weight map.

    Raises:
        RetrieverConfigError: on an unknown fusion, an unknown weight name, a negative
            or all-zero weight, ``fetch_k < 1`` or ``rrf_k <= 0``.
    """
    if not names:
        raise RetrieverConfigError("HybridRetriever needs at least one retriever")
    if fusion not in FUSIONS:
        raise RetrieverConfigError(f"fusion must be one of {FUSIONS}, got {fusion!r}")
    weights = dict(weights or {})
    unknown = sorted(set(weights) - set(names))
    if unknown:
        raise RetrieverConfigError(
            f"weights name unknown retriever(s) {unknown}; known: {sorted(names)}"
        )
    full = {name: float(weights.get(name, 1.0)) for name in names}
    if any(w < 0 for w in full.values()) or not any(full.values()):
        raise RetrieverConfigError(f"fusion weights must be >= 0 and not all 0, got {full}")
    if fetch_k < 1 or rrf_k <= 0:
        raise RetrieverConfigError(f"need fetch_k >= 1 and rrf_k > 0, got {fetch_k}, {rrf_k}")
    return full


class HybridRetriever:
    """Fuses several retrievers (by default BM25 + dense) into one ranking.

    Reusable on its own::

        chunks = chunk_documents(load_directory("my_docs"))
        hybrid = HybridRetriever({"bm25": BM25Retriever(chunks), "dense": DenseRetriever(chunks)})
        hits = hybrid.search("how do I reset the router", k=5)

    Args:
        retrievers: ``{name: retriever}``; order matters only for tie-breaking.
        weights: ``{name: weight}`` (default 1.0 each); weights must be >= 0, not all 0.
        fusion: ``"rrf"`` (default) or ``"weighted"``.
        rrf_k: The RRF constant (default 60).
        fetch_k: Candidates asked from each retriever (at least the requested ``k``).

    Raises:
        RetrieverConfigError: on an unknown fusion, an unknown weight name, a negative
            or all-zero weight, or ``fetch_k < 1``.
    """

    name = "hybrid"

    def __init__(
        self,
        retrievers: Mapping[str, Retriever],
        *,
        weights: Mapping[str, float] | None = None,
        fusion: str = "rrf",
        rrf_k: float = 60.0,
        fetch_k: int = 50,
    ):
        self.weights = check_fusion_options(list(retrievers), weights, fusion, rrf_k, fetch_k)
        self.retrievers = dict(retrievers)
        self.fusion = fusion
        self.rrf_k = float(rrf_k)
        self.fetch_k = int(fetch_k)

    def search_all(self, query: str, k: int = 5) -> dict[str, list[Hit]]:
        """Each retriever's own ``fetch_k`` list plus the fused top ``k`` under ``"hybrid"``."""
        if k < 1:
            raise RetrieverConfigError(f"k must be >= 1, got {k}")
        depth = max(self.fetch_k, k)
        lists = {name: r.search(query, depth) for name, r in self.retrievers.items()}
        used = [name for name in lists if self.weights[name] > 0]
        ranked = [lists[n] for n in used]
        weights = [self.weights[n] for n in used]
        if self.fusion == "rrf":
            fused = rrf_fuse(ranked, weights, k, self.rrf_k)
        else:
            fused = weighted_fuse(ranked, weights, k)
        return {**lists, "hybrid": fused}

    def search(self, query: str, k: int = 5) -> list[Hit]:
        """The fused top ``k`` chunks for ``query``, best first."""
        return self.search_all(query, k)["hybrid"]
