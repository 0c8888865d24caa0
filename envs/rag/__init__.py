"""RAG env: question answering over a corpus with hybrid retrieval (``agentenv/RAG-v0``).

The retrieval stack is reusable on its own::

    from envs.rag import BM25Retriever, DenseRetriever, HybridRetriever, chunk_documents
    from envs.rag import load_directory

    chunks = chunk_documents(load_directory("my_docs"), chunk_size=128, chunk_overlap=32)
    retriever = HybridRetriever({"bm25": BM25Retriever(chunks), "dense": DenseRetriever(chunks)})
    for hit in retriever.search("how do I reset the router", k=5):
        print(hit.score, hit.doc_id, hit.chunk.text[:80])

Retrieval quality (recall@k, MRR): ``python -m envs.rag.evaluate`` or
:func:`envs.rag.evaluate.evaluate_retrieval`. Scripted baseline policies:
:mod:`envs.rag.baselines`.
"""

from envs.rag.bm25 import BM25Retriever, FastBM25, tokenize
from envs.rag.corpus import (
    Chunk,
    Document,
    chunk_documents,
    load_corpus,
    load_directory,
    load_hf_documents,
    load_jsonl_documents,
)
from envs.rag.data import bundled, generate
from envs.rag.dense import DenseRetriever, Embedder, get_embedder, make_chroma_client
from envs.rag.env import RAGEnv
from envs.rag.errors import (
    BadKError,
    ChromaConnectionError,
    CorpusError,
    EmptyQueryError,
    QAFileError,
    QueryTooLongError,
    RetrieverConfigError,
    SearchError,
    SearchLimitError,
)
from envs.rag.index_cache import build_retriever, clear_retriever_cache, default_cache_dir
from envs.rag.qa import QAItem, load_medquad, load_qa_jsonl, split_items
from envs.rag.retrieval import (
    Hit,
    HybridRetriever,
    Retriever,
    rrf_fuse,
    unique_docs,
    weighted_fuse,
)
from envs.rag.scoring import RewardWeights, exact_match, normalize_answer, score_answer, token_f1

__all__ = [
    "BM25Retriever",
    "BadKError",
    "ChromaConnectionError",
    "Chunk",
    "CorpusError",
    "DenseRetriever",
    "Document",
    "Embedder",
    "EmptyQueryError",
    "FastBM25",
    "Hit",
    "HybridRetriever",
    "QAFileError",
    "QAItem",
    "QueryTooLongError",
    "RAGEnv",
    "Retriever",
    "RetrieverConfigError",
    "RewardWeights",
    "SearchError",
    "SearchLimitError",
    "build_retriever",
    "bundled",
    "chunk_documents",
    "clear_retriever_cache",
    "default_cache_dir",
    "exact_match",
    "generate",
    "get_embedder",
    "load_corpus",
    "load_directory",
    "load_hf_documents",
    "load_jsonl_documents",
    "load_medquad",
    "load_qa_jsonl",
    "make_chroma_client",
    "normalize_answer",
    "rrf_fuse",
    "score_answer",
    "split_items",
    "token_f1",
    "tokenize",
    "unique_docs",
    "weighted_fuse",
]
