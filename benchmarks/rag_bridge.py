"""How often one search with a RAG-v0 bridge question finds its first and its second hop.

    HF_HUB_OFFLINE=1 python benchmarks/rag_bridge.py               # bundled data, hybrid, k=3
    HF_HUB_OFFLINE=1 python benchmarks/rag_bridge.py --demos       # also replay demonstrations

For every bridge question (``question_types=["bridge"]``, see ``envs/rag/bridge.py``) of
each split it searches with the question's own text alone, through the env's retriever
with the env's default ``k``, and counts the questions whose first-hop article (the one
the question names) and whose second-hop article (the one holding the answer) are among
the documents returned. A low second-hop rate means one search cannot answer: the first
hop has to be read. Printed per split and relation family. ``--demos`` also replays every
demonstration through the env and reports how many end correct and how many start with a
search that misses (the re-query ones).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from envs.rag import RAGEnv  # noqa: E402
from envs.rag.bridge import RELATIONS, match_question  # noqa: E402
from envs.rag.retrieval import HybridRetriever, unique_docs  # noqa: E402


def one_search_rates(env: RAGEnv) -> dict[str, Counter]:
    """Per relation (and ``"all"``): questions ``n``, ``first`` and ``second`` hop found."""
    rows: dict[str, Counter] = defaultdict(Counter)
    parts = env.retriever.retrievers if isinstance(env.retriever, HybridRetriever) else {}
    for part in [env.retriever, *parts.values()]:
        if hasattr(part, "embed_queries"):  # batch-embed once instead of once per search
            part.embed_queries([env.get_task(i).prompt for i in range(env.num_tasks)])
    for i in range(env.num_tasks):
        task = env.get_task(i)
        found = unique_docs(env.retriever.search(task.prompt, env.default_k))
        first, second = task.metadata["gold_doc_ids"]
        matched = match_question(task.prompt)
        for key in ("all", matched[0].name if matched else "other"):
            rows[key].update(n=1, first=first in found, second=second in found)
    return rows


def replay_demonstrations(env: RAGEnv) -> Counter:
    """``n``, ``correct`` and ``requery`` (one search more than two) over every task."""
    out: Counter = Counter()
    for i in range(env.num_tasks):
        env.reset(options={"task_id": i})
        actions = env.demonstration(env.task)
        info: dict = {}
        for action in actions:
            *_, info = env.step(action)
        out.update(n=1, correct=bool(info.get("correct")), requery=len(actions) == 4)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--retriever", default="hybrid", choices=["hybrid", "bm25", "dense"])
    parser.add_argument("--chroma", default="memory", help="memory, persistent or a server URL")
    parser.add_argument("--demos", action="store_true", help="replay every demonstration too")
    args = parser.parse_args()

    start = time.perf_counter()
    print("| split | relation | n | first hop in top k | second hop in top k |")
    print("|---|---|---|---|---|")
    demos = {}
    for split in ("train", "test"):
        env = RAGEnv(
            split=split, question_types="bridge", retriever=args.retriever, chroma=args.chroma
        )
        rows = one_search_rates(env)
        for relation in ["all", *(r.name for r in RELATIONS if r.name in rows)]:
            row, n = rows[relation], rows[relation]["n"]
            print(
                f"| {split} | {relation} | {n} | {row['first'] / n:.3f} ({row['first']}) "
                f"| {row['second'] / n:.3f} ({row['second']}) |"
            )
        if args.demos:
            demos[split] = replay_demonstrations(env)
    k = env.default_k
    print(f"\nretriever {args.retriever}, k={k}, {time.perf_counter() - start:.0f} s")
    for split, row in demos.items():
        print(
            f"demonstrations ({split}): {row['correct']} of {row['n']} correct, "
            f"{row['requery']} re-query"
        )


if __name__ == "__main__":
    main()
