"""Retrieval quality on a QA set: recall@k and MRR of BM25, dense and fused retrieval.

    python -m envs.rag.evaluate                      # bundled set, all questions
    python -m envs.rag.evaluate --split test --fusion weighted --weights bm25=1,dense=1

A question counts as found at ``k`` when one of its gold documents is among the
first ``k`` distinct documents retrieved (chunks are collapsed to their documents);
MRR is the mean of ``1 / rank`` of the first gold document within the first
``max(ks)`` documents (0 beyond). Questions without gold documents are skipped.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Mapping, Sequence

from envs.rag.qa import QAItem
from envs.rag.retrieval import HybridRetriever, Retriever, unique_docs
from envs.rag.scoring import first_gold_rr

DEFAULT_KS: tuple[int, ...] = (1, 3, 5, 10)


def _ranked_lists(
    retriever: Retriever, items: Sequence[QAItem], depth: int
) -> dict[str, list[list[str]]]:
    """Per retriever name, the ranked document ids of every question."""
    out: dict[str, list[list[str]]] = {}
    parts = retriever.retrievers if isinstance(retriever, HybridRetriever) else {"": retriever}
    for part in parts.values():
        if hasattr(part, "embed_queries"):  # batch-embed once instead of once per search
            part.embed_queries([it.question for it in items])
    for item in items:
        if isinstance(retriever, HybridRetriever):
            lists = retriever.search_all(item.question, k=depth * 4)
        else:
            lists = {retriever.name: retriever.search(item.question, k=depth * 4)}
        for name, hits in lists.items():
            out.setdefault(name, []).append(unique_docs(hits)[:depth])
    return out


def evaluate_retrieval(
    retriever: Retriever, items: Sequence[QAItem], ks: Sequence[int] = DEFAULT_KS
) -> dict[str, dict[str, float]]:
    """Recall@k and MRR per retriever; a hybrid also reports each of its parts.

    Args:
        retriever: Any retriever; a :class:`HybridRetriever` is scored as ``"hybrid"``
            and each of its retrievers under its own name, from one search per question.
        items: Questions with gold document ids.
        ks: Cut-offs for recall.

    Returns:
        ``{retriever_name: {"recall@1": ..., ..., "mrr": ..., "n": ...}}``.
    """
    items = [it for it in items if it.gold_doc_ids]
    depth = max(ks)
    results: dict[str, dict[str, float]] = {}
    for name, ranked in _ranked_lists(retriever, items, depth).items():
        row: dict[str, float] = {}
        for k in ks:
            found = [
                bool(set(docs[:k]) & set(it.gold_doc_ids))
                for docs, it in zip(ranked, items, strict=True)
            ]
            row[f"recall@{k}"] = sum(found) / max(len(items), 1)
        rrs = [first_gold_rr(docs, it.gold_doc_ids) for docs, it in zip(ranked, items, strict=True)]
        row["mrr"] = sum(rrs) / max(len(items), 1)
        row["n"] = float(len(items))
        results[name] = row
    return results


def evaluate_by_type(
    retriever: Retriever, items: Sequence[QAItem], ks: Sequence[int] = DEFAULT_KS
) -> dict[str, dict[str, dict[str, float]]]:
    """:func:`evaluate_retrieval` for all items (``"all"``) and per ``metadata["qtype"]``."""
    groups: dict[str, list[QAItem]] = {"all": list(items)}
    for it in items:
        groups.setdefault(str(it.metadata.get("qtype", "other")), []).append(it)
    return {group: evaluate_retrieval(retriever, its, ks) for group, its in groups.items()}


def format_table(results: Mapping[str, Mapping[str, Mapping[str, float]]]) -> str:
    """A Markdown table: one row per (question group, retriever)."""
    first = next(iter(results.values()))
    metrics = [m for m in next(iter(first.values())) if m != "n"]
    lines = [
        "| questions | n | retriever | " + " | ".join(metrics) + " |",
        "|---|---|---|" + "---|" * len(metrics),
    ]
    for group, per_retriever in results.items():
        for name, row in per_retriever.items():
            cells = " | ".join(f"{row[m]:.3f}" for m in metrics)
            lines.append(f"| {group} | {int(row['n'])} | {name} | {cells} |")
    return "\n".join(lines)


def _weights(text: str) -> dict[str, float]:
    pairs = [p.split("=", 1) for p in text.split(",") if p]
    return {k.strip(): float(v) for k, v in pairs}


def main(argv: Sequence[str] | None = None) -> None:
    """Command-line entry point (see the module docstring)."""
    from envs.rag.corpus import chunk_documents
    from envs.rag.data import bundled
    from envs.rag.index_cache import build_retriever
    from envs.rag.qa import split_items

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--split", choices=["all", "train", "test"], default="all")
    parser.add_argument("--ks", type=int, nargs="+", default=list(DEFAULT_KS))
    parser.add_argument("--fusion", choices=["rrf", "weighted"], default="rrf")
    parser.add_argument("--weights", type=_weights, default={}, help="e.g. bm25=1,dense=1")
    parser.add_argument("--chunk-size", type=int, default=128)
    parser.add_argument("--chunk-overlap", type=int, default=32)
    parser.add_argument("--chroma", default="memory", help="memory, persistent or a server URL")
    parser.add_argument("--limit", type=int, default=None, help="evaluate the first N questions")
    args = parser.parse_args(argv)

    docs, qa = bundled()
    items = list(qa) if args.split == "all" else split_items(qa, args.split)
    items = items[: args.limit] if args.limit else items
    chunks = chunk_documents(docs, chunk_size=args.chunk_size, chunk_overlap=args.chunk_overlap)
    start = time.perf_counter()
    hybrid = build_retriever(
        chunks,
        retriever="hybrid",
        chunking=(args.chunk_size, args.chunk_overlap),
        fusion=args.fusion,
        weights=args.weights,
        chroma=args.chroma,
    )
    built = time.perf_counter() - start
    start = time.perf_counter()
    results = evaluate_by_type(hybrid, items, args.ks)
    print(
        f"bundled corpus: {len(docs)} documents, {len(chunks)} chunks; {len(items)} questions "
        f"({args.split}); fusion={args.fusion} weights={hybrid.weights}; index {built:.1f} s, "
        f"evaluation {time.perf_counter() - start:.1f} s\n"
    )
    print(format_table(results))


if __name__ == "__main__":
    main()
