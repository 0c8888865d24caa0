"""BM25 (Okapi) retrieval with two interchangeable backends.

Tokenizer (:func:`tokenize`, used for chunks and queries alike): lowercase the text,
take maximal runs of Unicode letters/digits (``\\w+`` without ``_``), drop a short list
of English stop words (:data:`STOPWORDS`); no stemming. ``"KX-4471, the Lantern's"``
-> ``["kx", "4471", "lantern", "s"]``.

Backends (same scores, same ranking):

* ``"rank_bm25"`` -- :class:`rank_bm25.BM25Okapi`. Pure Python: every query walks a
  dict per chunk, so a query costs O(#chunks x #query terms) (about a second at 100k).
* ``"fast"`` (default) -- :class:`FastBM25`: the same formula precomputed into an
  inverted index (per term: chunk indices and BM25 weights, flat numpy arrays), so a
  query only touches the postings of its terms. Scores equal ``BM25Okapi.get_scores``
  bit for bit (same float64 operations in the same order; tested).

BM25Okapi's formula (k1=1.5, b=0.75, epsilon=0.25)::

    idf(t) = ln(N - n_t + 0.5) - ln(n_t + 0.5), negative idf -> epsilon * mean idf
    score(q, d) = sum over query tokens t (repeats count) of
                  idf(t) * tf(t, d) * (k1 + 1) / (tf(t, d) + k1 * (1 - b + b * |d| / avgdl))
"""

from __future__ import annotations

import math
import re
from array import array
from collections import Counter
from collections.abc import Sequence

import numpy as np

from envs.rag.corpus import Chunk
from envs.rag.errors import CorpusError, RetrieverConfigError
from envs.rag.retrieval import Hit, top_k_indices

BACKENDS: tuple[str, ...] = ("fast", "rank_bm25")
_WORD = re.compile(r"[^\W_]+")
STOPWORDS: frozenset[str] = frozenset(
    "a an and are as at be but by for from had has have he her his i in into is it its "
    "of on or she that the their them they this to was were what when where which who "
    "whom why with how did does do you your our we".split()
)


def tokenize(text: str) -> list[str]:
    """Lowercased letter/digit runs of ``text`` minus :data:`STOPWORDS` (see module doc)."""
    return [w for w in _WORD.findall(text.lower()) if w not in STOPWORDS]


class FastBM25:
    """BM25Okapi scores from a precomputed inverted index (CSR arrays: per term, the
    documents holding it and their BM25 weights).

    Args:
        corpus: Tokenized documents.
        k1: Term-frequency saturation.
        b: Length normalisation.
        epsilon: Floor for negative idf, as a fraction of the mean idf.
    """

    def __init__(
        self,
        corpus: Sequence[Sequence[str]],
        k1: float = 1.5,
        b: float = 0.75,
        epsilon: float = 0.25,
    ):
        self.k1, self.b, self.epsilon = k1, b, epsilon
        self.corpus_size = len(corpus)
        doc_len = np.array([len(d) for d in corpus], dtype=np.float64)
        self.avgdl = float(sum(len(d) for d in corpus)) / self.corpus_size
        # Postings as flat arrays (CSR by term): term ids in first-seen order, like
        # BM25Okapi's dicts, so the idf mean (and epsilon) is summed in the same order.
        self._vocab: dict[str, int] = {}
        term_ids, doc_ids, tfs = array("q"), array("i"), array("i")  # compact while growing
        for i, doc in enumerate(corpus):
            counts = Counter(doc)
            term_ids.extend(self._vocab.setdefault(t, len(self._vocab)) for t in counts)
            doc_ids.extend([i] * len(counts))
            tfs.extend(counts.values())
        terms = np.frombuffer(term_ids, dtype=np.int64)
        order = np.argsort(terms, kind="stable")  # by term, documents ascending within
        df = np.bincount(terms, minlength=len(self._vocab))
        self._indptr = np.concatenate([[0], np.cumsum(df)])
        self._docs = np.frombuffer(doc_ids, dtype=np.int32)[order]
        self.idf = self._idf({t: int(df[i]) for t, i in self._vocab.items()})
        idf = np.array(list(self.idf.values()), dtype=np.float64)[terms[order]]
        q_freq = np.frombuffer(tfs, dtype=np.int32)[order].astype(np.float64)
        # The exact expression (and operation order) of BM25Okapi.get_scores.
        norm = q_freq + self.k1 * (1 - self.b + self.b * doc_len[self._docs] / self.avgdl)
        self._weights = idf * (q_freq * (self.k1 + 1) / norm)

    def _idf(self, nd: dict[str, int]) -> dict[str, float]:
        idf: dict[str, float] = {}
        idf_sum = 0.0
        negative = []
        for word, freq in nd.items():
            value = math.log(self.corpus_size - freq + 0.5) - math.log(freq + 0.5)
            idf[word] = value
            idf_sum += value
            if value < 0:
                negative.append(word)
        eps = self.epsilon * (idf_sum / len(idf)) if idf else 0.0
        for word in negative:
            idf[word] = eps
        return idf

    def get_scores(self, query: Sequence[str]) -> np.ndarray:
        """Scores of every document for the tokenized ``query`` (shape ``(N,)``)."""
        scores = np.zeros(self.corpus_size)
        for term in query:
            tid = self._vocab.get(term)
            if tid is not None:
                start, end = self._indptr[tid], self._indptr[tid + 1]
                scores[self._docs[start:end]] += self._weights[start:end]
        return scores


class BM25Retriever:
    """Sparse retriever over chunks: BM25 with the :func:`tokenize` tokenizer.

    Only chunks with a positive score are returned (a query with no known word finds
    nothing). Ties are broken by corpus order, so results are deterministic.

    Args:
        chunks: What to index.
        backend: ``"fast"`` (inverted index, default) or ``"rank_bm25"`` (BM25Okapi).
        k1: BM25 ``k1``.
        b: BM25 ``b``.
        epsilon: BM25Okapi's idf floor.

    Raises:
        CorpusError: if there are no chunks.
        RetrieverConfigError: on an unknown backend.
    """

    name = "bm25"

    def __init__(
        self,
        chunks: Sequence[Chunk],
        *,
        backend: str = "fast",
        k1: float = 1.5,
        b: float = 0.75,
        epsilon: float = 0.25,
    ):
        if backend not in BACKENDS:
            raise RetrieverConfigError(f"bm25 backend must be one of {BACKENDS}, got {backend!r}")
        if not chunks:
            raise CorpusError("cannot build a BM25 index over an empty corpus; add documents")
        self.chunks = list(chunks)
        self.backend = backend
        tokenized = [tokenize(c.search_text) for c in self.chunks]
        if not any(tokenized):
            raise CorpusError(
                "every chunk is empty after tokenization (only punctuation or stop words); "
                "the corpus needs some words"
            )
        if backend == "fast":
            self._bm25: FastBM25 | object = FastBM25(tokenized, k1=k1, b=b, epsilon=epsilon)
        else:
            from rank_bm25 import BM25Okapi

            self._bm25 = BM25Okapi(tokenized, k1=k1, b=b, epsilon=epsilon)

    def scores(self, query: str) -> np.ndarray:
        """BM25 score of every chunk for ``query`` (shape ``(num_chunks,)``)."""
        return np.asarray(self._bm25.get_scores(tokenize(query)), dtype=np.float64)

    def search(self, query: str, k: int = 5) -> list[Hit]:
        """The ``k`` best chunks with a positive score, best first."""
        if k < 1:
            raise RetrieverConfigError(f"k must be >= 1, got {k}")
        scores = self.scores(query)
        return [Hit(self.chunks[i], float(scores[i])) for i in top_k_indices(scores, k)]
