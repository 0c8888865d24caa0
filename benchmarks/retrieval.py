"""Retrieval speed and memory: BM25 (rank-bm25 vs the fast backend), dense, and fused.

    HF_HUB_OFFLINE=1 python benchmarks/retrieval.py                  # 1k, 10k, 100k chunks
    HF_HUB_OFFLINE=1 python benchmarks/retrieval.py --sizes 1000 --queries 50

For every corpus size and retriever it prints the index build time, the query latency
(p50 / p95 over ``--queries`` questions, top 10) and the growth of the process's
resident memory while the index was built (psutil RSS; the first index of a run also
pays for imports, and freed memory is not always returned to the OS, so read it as an
estimate). For BM25 the index is built a second time under tracemalloc to report what
it keeps and the build's peak (Python and numpy memory; Chroma's is native, so dense
has the RSS figure only). The corpus is the bundled fictional encyclopedia generated with as many
seeds as needed (one ~40-word chunk per article); queries are its questions.

Retrievers: ``bm25/rank_bm25`` (BM25Okapi, pure Python: every query scores every
chunk; its queries stop after ``--slow-budget-s`` seconds), ``bm25/fast`` (inverted
index, same scores), ``dense`` (all-MiniLM-L6-v2 + in-memory Chroma HNSW, cosine) and
``hybrid`` (fast BM25 + dense, RRF over 50 candidates each).

Dense vectors: sizes up to ``--real-embed-max`` (default 10,000) are embedded for real.
Larger sizes get random unit vectors instead (HNSW build and search cost do not depend
on what the vectors mean) and their embedding time is *estimated* from the throughput
measured on a sample (marked ``est.``). Dense and hybrid query latency always includes
embedding the query with the real model.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time
import tracemalloc
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import psutil
from _common import torch_threads

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from envs.rag import (  # noqa: E402
    BM25Retriever,
    Chunk,
    DenseRetriever,
    Document,
    HybridRetriever,
    chunk_documents,
    generate,
    get_embedder,
    make_chroma_client,
)


def rss_mb() -> float:
    """Resident memory of this process, MiB."""
    return psutil.Process().memory_info().rss / 2**20


def make_corpus(n: int) -> tuple[list[Chunk], list[str]]:
    """``n`` chunks of generated articles (seeds 0, 1, ...) and their questions."""
    chunks: list[Chunk] = []
    questions: list[str] = []
    seed = 0
    while len(chunks) < n:
        docs, qa = generate(num_per_type=96, seed=seed)
        docs = [Document(f"s{seed}/{d.id}", d.title, d.text) for d in docs]
        chunks.extend(chunk_documents(docs))
        questions.extend(q.question for q in qa)
        seed += 1
    return chunks[:n], questions


def timed(build: Callable[[], Any]) -> tuple[Any, float, float]:
    """``(result, seconds, RSS growth MiB)`` of ``build()``."""
    gc.collect()
    before, start = rss_mb(), time.perf_counter()
    result = build()
    return result, time.perf_counter() - start, rss_mb() - before


def latencies(search: Callable[[str], Any], queries: Sequence[str], budget_s: float) -> list[float]:
    """Seconds per query, stopping early once ``budget_s`` is spent (at least 3 queries)."""
    out: list[float] = []
    spent = 0.0
    for q in queries:
        start = time.perf_counter()
        search(q)
        out.append(time.perf_counter() - start)
        spent += out[-1]
        if spent > budget_s and len(out) >= 3:
            break
    return out


def pct(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile of ``values`` in milliseconds."""
    return float(np.percentile(np.asarray(values) * 1000, q))


def embedding_throughput(chunks: Sequence[Chunk], sample: int = 512) -> float:
    """Chunks per second that all-MiniLM-L6-v2 embeds on this machine (batch 64)."""
    embedder = get_embedder()
    texts = [c.search_text for c in chunks[:sample]]
    embedder.encode(texts[:16])  # warm-up
    start = time.perf_counter()
    embedder.encode(texts)
    return len(texts) / (time.perf_counter() - start)


def bench_bm25(
    n: int, chunks: list[Chunk], queries: list[str], backend: str, budget_s: float
) -> tuple[BM25Retriever, dict[str, Any]]:
    """Build and time one BM25 backend."""
    bm25, secs, mem = timed(lambda: BM25Retriever(chunks, backend=backend))
    lat = latencies(lambda q: bm25.search(q, 10), queries, budget_s)
    row = _row(n, f"bm25/{backend}", secs, mem, lat)
    bm25 = None  # rebuild under tracemalloc: what the index keeps, and the build's peak
    gc.collect()
    tracemalloc.start()
    kept = BM25Retriever(chunks, backend=backend)
    row["kept_mb"], row["peak_mb"] = (v / 2**20 for v in tracemalloc.get_traced_memory())
    tracemalloc.stop()
    return kept, row


def bench_dense(
    n: int, chunks: list[Chunk], queries: list[str], args: argparse.Namespace,
    throughput: float, client: Any,
) -> tuple[DenseRetriever, dict[str, Any]]:  # fmt: skip
    """Embed (or fake) the vectors, build the Chroma index and time dense queries."""
    embedder = get_embedder()
    real = n <= args.real_embed_max
    if real:
        vectors, embed_s, _ = timed(lambda: embedder.encode([c.search_text for c in chunks]))
    else:
        rng = np.random.default_rng(0)
        vectors = rng.standard_normal((n, embedder.dim), dtype=np.float32)
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
        embed_s = n / throughput
    dense, secs, mem = timed(
        lambda: DenseRetriever(
            chunks, vectors, embedder=embedder, client=client, collection_name=f"bench-{n}"
        )
    )
    dense.memo_size = 0  # time the query embedding every time
    lat = latencies(lambda q: dense.search(q, 10), queries, 120)
    return dense, _row(n, "dense", secs, mem, lat, embed_s=embed_s, real=real)


def bench_size(
    n: int, args: argparse.Namespace, throughput: float, client: Any
) -> list[dict[str, Any]]:
    """Build every retriever over ``n`` chunks and time their queries."""
    chunks, questions = make_corpus(n)
    queries = random.Random(n).sample(questions, min(args.queries, len(questions)))
    _, slow_row = bench_bm25(n, chunks, queries, "rank_bm25", args.slow_budget_s)
    gc.collect()
    fast, fast_row = bench_bm25(n, chunks, queries, "fast", 60)
    dense, dense_row = bench_dense(n, chunks, queries, args, throughput, client)
    hybrid = HybridRetriever({"bm25": fast, "dense": dense}, fusion="rrf", fetch_k=50)
    lat = latencies(lambda q: hybrid.search(q, 10), queries, 120)
    hybrid_row = _row(n, "hybrid (rrf)", 0.0, 0.0, lat, note="reuses the two indexes")
    client.delete_collection(f"bench-{n}")
    return [slow_row, fast_row, dense_row, hybrid_row]


def _row(n, name, secs, mem, lat, embed_s=None, real=True, note="") -> dict[str, Any]:
    return {
        "chunks": n,
        "retriever": name,
        "build_s": secs,
        "embed_s": embed_s,
        "embed_real": real,
        "rss_mb": mem,
        "kept_mb": None,
        "peak_mb": None,
        "p50_ms": pct(lat, 50),
        "p95_ms": pct(lat, 95),
        "queries": len(lat),
        "note": note,
    }


def format_rows(rows: Sequence[dict[str, Any]]) -> str:
    """A Markdown table of the measurements."""
    lines = [
        "| chunks | retriever | index build s | + embedding s | RSS +MiB | kept / peak MiB "
        "| p50 ms | p95 ms | queries |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r["embed_s"] is None:
            embed = "-"
        else:
            embed = f"{r['embed_s']:.1f}" + ("" if r["embed_real"] else " est.")
        build = "-" if r["note"] else f"{r['build_s']:.2f}"
        traced = "-" if r["kept_mb"] is None else f"{r['kept_mb']:.0f} / {r['peak_mb']:.0f}"
        lines.append(
            f"| {r['chunks']:,} | {r['retriever']} | {build} | {embed} | {r['rss_mb']:.0f} | "
            f"{traced} | "
            f"{r['p50_ms']:.1f} | {r['p95_ms']:.1f} | {r['queries']} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    """Run the benchmark (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000, 10_000, 100_000])
    parser.add_argument("--queries", type=int, default=200, help="questions timed per retriever")
    parser.add_argument("--real-embed-max", type=int, default=10_000)
    parser.add_argument("--slow-budget-s", type=float, default=30.0, help="rank_bm25 query budget")
    args = parser.parse_args(argv)

    print(
        f"machine: {os.cpu_count()} CPUs, torch threads = {torch_threads()}, load average "
        f"{os.getloadavg()[0]:.1f} (other processes competing for the CPUs inflate latencies)"
    )
    start = time.perf_counter()
    get_embedder()
    print(f"embedding model loaded in {time.perf_counter() - start:.1f} s")
    sample, _ = make_corpus(512)
    throughput = embedding_throughput(sample)
    print(f"all-MiniLM-L6-v2 embedding throughput: {throughput:.0f} chunks/s (batch 64, CPU)")
    client = make_chroma_client("memory")
    rows: list[dict[str, Any]] = []
    for n in args.sizes:
        t = time.perf_counter()
        rows.extend(bench_size(n, args, throughput, client))
        print(f"... {n:,} chunks done in {time.perf_counter() - t:.0f} s", flush=True)
        gc.collect()
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}\n")
    print(format_rows(rows))
    print(
        "\nindex build s: tokenising + indexing (BM25) or inserting vectors into Chroma's HNSW "
        "(dense); '+ embedding s' is the time to embed the chunks, 'est.' = estimated from "
        "the measured throughput because random unit vectors were indexed at that size. "
        "kept / peak MiB: memory the BM25 index keeps / peak while building it (tracemalloc)."
    )


if __name__ == "__main__":
    main()
