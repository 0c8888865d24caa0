"""The RAG environment: answer questions about a corpus using a ``search`` tool."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, SupportsFloat

from agentenv.env.core import Task, ToolEnv
from agentenv.env.parsers import ActionParser
from agentenv.env.spaces import Message
from agentenv.env.tools import Tool, tool
from agentenv.errors import InvalidOptionError, TaskSourceError
from envs.rag.bridge import bridge_demonstration, without_bridge_leaks
from envs.rag.corpus import Document, chunk_documents, load_corpus
from envs.rag.data import bundled
from envs.rag.errors import BadKError, EmptyQueryError, QueryTooLongError, SearchLimitError
from envs.rag.index_cache import build_retriever
from envs.rag.qa import QAItem, check_gold_ids, load_qa_jsonl, select_types, split_items
from envs.rag.retrieval import Hit, Retriever, unique_docs
from envs.rag.scoring import RewardWeights, score_answer

COMPACT_PROMPT = (
    "Answer the question from a document collection; its facts are not in your memory. "
    "Search it like this:\n"
    '<tool_call>{"name": "search", "arguments": {"query": "founder of the Vellmark Institute"}}'
    "</tool_call>\n"
    "Then reply with a short answer (a name, a year or a few words): <answer>...</answer>."
)
"""The system prompt of ``prompt_style="compact"``."""

_SEARCH_DOC = """Search the document collection and return the best-matching passages.

Each passage comes numbered with its document id and title.

Args:
    query: Key words or a question, e.g. "founder of the Vellmark Institute".
    k: How many passages to return, 1 to {max_k}.
"""


class RAGEnv(ToolEnv):
    """Answer questions about a corpus with a ``search`` tool (id ``agentenv/RAG-v0``).

    The default data is a generated fictional encyclopedia (360 articles, 990 questions;
    see :mod:`envs.rag.data`) whose facts no model can know, so answering needs
    retrieval. ``corpus=`` / ``qa=`` swap in your own documents and questions.
    ``question_types=["bridge"]`` selects its 392 two-hop questions instead (opt-in; see
    :mod:`envs.rag.bridge`).

    Tool: ``search(query, k=default_k)`` returns up to ``k`` numbered passages
    (``[n] title (doc id, chunk)`` then the text, each cut to ``passage_chars`` and to
    an equal share of ``max_output_chars``) from the retriever: ``"hybrid"`` (BM25 +
    MiniLM/Chroma, fused; default), ``"bm25"`` or ``"dense"``. At most ``max_searches``
    searches per episode. An empty query, a query over ``max_query_chars``, ``k``
    outside ``[1, max_k]`` or a search past the limit comes back as an ``Error: ...``
    observation, counted in ``info["tool_errors"]`` under ``empty_query``,
    ``query_too_long``, ``k_out_of_range`` or ``search_limit``. ``max_turns`` actions
    without an ``<answer>`` end the episode ``truncated``, with reward 0.

    Reward of a final answer (weights configurable, see :mod:`envs.rag.scoring`)::

        answer_weight    * max(EM, token F1)     best over all gold aliases   (1.0)
      + retrieval_weight * RR(gold document)     among every document the
                                                  episode retrieved, in order (0.2)
      + format_weight    * well_formed           non-empty and <= max_answer_words
                                                  words, or exactly right      (0.05)

    A right answer is always well formed, so with the same searches a wrong answer
    scores strictly less than a right one, and ``format_weight < answer_weight`` is
    enforced. Each term is in ``info`` (``reward_answer``, ``reward_retrieval``,
    ``reward_format``) with ``correct`` (EM), ``answer_em``, ``answer_f1``,
    ``retrieval_rr``, ``retrieval_recall``, ``format_ok``, ``num_searches``, ``retrieved_doc_ids``,
    ``gold_doc_ids``, ``gold`` and ``qtype``.

    Isolation: the retriever (index, embedding model) is shared, read-only, by every
    instance over the same corpus and settings; counters and retrieved documents are
    per instance.

    Args:
        split: ``"train"`` or ``"test"``; questions are split by gold document.
        corpus: ``None`` (bundled), a folder of .txt/.md files, a .jsonl file, or a
            list of :class:`~envs.rag.corpus.Document`.
        qa: Questions: ``None`` (bundled; requires the bundled corpus), a JSONL file
            (see :mod:`envs.rag.qa`) or a list of :class:`~envs.rag.qa.QAItem`.
        num_tasks: Keep only the first ``num_tasks`` questions of the split.
        question_types: Keep only questions of these types (``metadata["qtype"]``; one
            type or a list); the bundled data has ``"id"``, ``"name"``,
            ``"paraphrase"``, ``"mixed"`` and ``"bridge"``. ``None``: every question
            but the ``"bridge"`` ones, which are opt-in.
        retriever: ``"hybrid"``, ``"bm25"`` or ``"dense"``.
        fusion: ``"rrf"`` (reciprocal rank fusion, k=60) or ``"weighted"``.
        fusion_weights: ``{"bm25": w, "dense": w}`` (default 1.0 each).
        rrf_k: RRF constant.
        fetch_k: Candidates per retriever before fusion.
        bm25_backend: ``"fast"`` (inverted index) or ``"rank_bm25"`` (BM25Okapi).
        chunk_size: Words per chunk.
        chunk_overlap: Words shared by consecutive chunks.
        embedding_model: Sentence-transformers model (default bundled all-MiniLM-L6-v2).
        chroma: ``"persistent"`` (a Chroma folder in the index cache; the default),
            ``"memory"`` (in-process) or ``"http://host:port"`` (a Chroma server: use it
            when many worker processes share one index).
        cache_dir: Root of the index cache (default ``agentenv_home()/rag_index``).
        default_k: Passages per search when ``k`` is not given.
        max_k: Largest ``k`` allowed.
        max_searches: Searches per episode.
        max_query_chars: Longest query accepted.
        passage_chars: Longest passage text shown.
        answer_weight: Weight of answer correctness.
        retrieval_weight: Weight of the retrieval score.
        format_weight: Weight of a well-formed answer (< ``answer_weight``).
        max_answer_words: Longest well-formed answer.
        judge: An :class:`agentenv.run.judge.LLMJudge` grading the final answer against the
            first gold answer; its grade (0..1) times ``judge_weight`` is added to the
            reward and reported as the ``judge`` reward component (``judge_error`` says
            why a grade fell back). ``None``: EM / F1 only.
        judge_weight: Weight of the judge's grade.
        max_turns: Actions per episode before ``truncated``.
        parser: Action parser (default Hermes ``<tool_call>`` / ``<answer>``).
        tool_timeout_s: Wall-clock limit per search.
        max_output_chars: Longest tool output shown.
        prompt_style: ``"full"`` (instructions plus the tool's JSON schema) or
            ``"compact"`` (:data:`COMPACT_PROMPT`: one example search, ~80 tokens instead
            of ~255; for small models and CPU training).
        render_mode: ``None`` or ``"ansi"``.
    """

    def __init__(
        self,
        *,
        split: str = "train",
        corpus: str | Path | Sequence[Document] | None = None,
        qa: str | Path | Sequence[QAItem] | None = None,
        num_tasks: int | None = None,
        question_types: str | Sequence[str] | None = None,
        retriever: str = "hybrid",
        fusion: str = "rrf",
        fusion_weights: Mapping[str, float] | None = None,
        rrf_k: float = 60.0,
        fetch_k: int = 50,
        bm25_backend: str = "fast",
        chunk_size: int = 128,
        chunk_overlap: int = 32,
        embedding_model: str | None = None,
        chroma: str = "persistent",
        cache_dir: str | Path | None = None,
        default_k: int = 3,
        max_k: int = 10,
        max_searches: int = 4,
        max_query_chars: int = 1000,
        passage_chars: int = 500,
        answer_weight: float = 1.0,
        retrieval_weight: float = 0.2,
        format_weight: float = 0.05,
        max_answer_words: int = 10,
        judge: Any = None,
        judge_weight: float = 1.0,
        max_turns: int = 6,
        parser: ActionParser | None = None,
        tool_timeout_s: float = 10.0,
        max_output_chars: int = 3000,
        prompt_style: str = "full",
        render_mode: str | None = None,
    ):
        _check_limits(default_k, max_k, max_searches, max_query_chars, passage_chars)
        self.default_k, self.max_k, self.max_searches = default_k, max_k, max_searches
        self.max_query_chars, self.passage_chars = max_query_chars, passage_chars
        self.weights = RewardWeights(
            answer_weight, retrieval_weight, format_weight, max_answer_words
        )
        if judge is not None and not hasattr(judge, "score_batch"):
            raise InvalidOptionError(
                f"judge must be an agentenv.run.judge.LLMJudge (or have score_batch), got "
                f"{type(judge).__name__}"
            )
        if judge_weight < 0:
            raise InvalidOptionError(f"judge_weight must be >= 0, got {judge_weight}")
        self.judge, self.judge_weight = judge, float(judge_weight)
        super().__init__(
            [self._make_search_tool()],
            split=split,
            parser=parser,
            max_turns=max_turns,
            tool_timeout_s=tool_timeout_s,
            max_output_chars=max_output_chars,
            prompt_style=prompt_style,
            render_mode=render_mode,
        )
        if num_tasks is not None and num_tasks < 1:
            raise InvalidOptionError(f"num_tasks must be >= 1, got {num_tasks}")
        documents, items = _load_data(corpus, qa)
        items = without_bridge_leaks(select_types(items, question_types))
        self._items = split_items(items, split)[:num_tasks]
        if not self._items:
            raise TaskSourceError(
                f"the {split!r} split has no questions ({len(items)} in all, of the chosen "
                "types); add questions, or give them explicit 'split' fields in the QA file"
            )
        self.chunks = chunk_documents(documents, chunk_size=chunk_size, chunk_overlap=chunk_overlap)
        self.retriever: Retriever = build_retriever(
            self.chunks,
            retriever=retriever,
            chunking=(chunk_size, chunk_overlap),
            bm25_backend=bm25_backend,
            fusion=fusion,
            weights=fusion_weights,
            rrf_k=rrf_k,
            fetch_k=fetch_k,
            model=embedding_model,
            chroma=chroma,
            cache_dir=cache_dir,
        )
        self._lock = threading.Lock()
        # bumped after every step and at reset/close: a search that outlives its step (the
        # tool timed out) must not add what it found to the episode after the fact
        self._epoch = 0
        self._num_searches = 0
        self._queries: list[str] = []
        self._retrieved: list[Hit] = []
        self._search_docs: list[list[str]] = []  # each search's documents, in order

    # ---- the search tool ------------------------------------------------------------
    def demonstration(self, task: Task) -> list[str] | None:
        """Search with the question, then answer with the span the rule-based reader takes
        from the top passage (:class:`envs.rag.baselines.SearchThenAnswer`).

        A ``"bridge"`` question is searched in two hops instead, the first entity then the
        second one its passage names, some tasks after a first search that misses
        (:func:`envs.rag.bridge.bridge_demonstration`).

        The gold answer is never looked at: the demonstration only knows what retrieval
        returns. Its answer can be wrong; the replay (``agentenv.rollout.demos``) keeps a
        demonstration only when the env scores it correct.
        """
        from envs.rag.baselines import extract_answer, parse_top_passage, search_action

        question = task.prompt.strip()
        if task.metadata.get("qtype") == "bridge":
            searches = min(self.max_searches, self.max_turns - 1)
            actions = bridge_demonstration(
                question, task.id, self._demo_search, max_searches=searches
            )
            if actions is not None:
                return actions
        hits = self.retriever.search(question, self.default_k)  # what the tool call returns
        top = parse_top_passage(self.format_hits(question, hits))
        answer = extract_answer(question, *top) if top else "unknown"
        return [search_action(question), f"<answer>{answer}</answer>"]

    def _demo_search(self, query: str) -> str:
        """What the ``search`` tool returns for ``query`` with the default ``k``."""
        return self.format_hits(query, self.retriever.search(query.strip(), self.default_k))

    def _make_search_tool(self) -> Tool:
        def search(query: str, k: int = 3) -> str:
            return self._search(query, k)

        search.__doc__ = _SEARCH_DOC.format(max_k=self.max_k)
        search.__defaults__ = (self.default_k,)
        return tool(search, name="search")

    def _search(self, query: str, k: int) -> str:
        if not query.strip():
            raise EmptyQueryError(
                'query is empty; pass the words to look for, e.g. {"query": "Vellmark Institute"}'
            )
        if len(query) > self.max_query_chars:
            raise QueryTooLongError(
                f"query is {len(query)} characters long; the limit is {self.max_query_chars}. "
                "Search with a few key words instead"
            )
        if not 1 <= k <= self.max_k:
            raise BadKError(f"k must be between 1 and {self.max_k}, got {k}")
        with self._lock:
            if self._num_searches >= self.max_searches:
                raise SearchLimitError(
                    f"search limit reached ({self.max_searches} per episode); give the final "
                    "answer in <answer>...</answer>"
                )
            self._num_searches += 1
            epoch = self._epoch
        hits = self.retriever.search(query.strip(), k)
        with self._lock:
            if epoch == self._epoch:
                self._queries.append(query)
                self._retrieved.extend(hits)
                self._search_docs.append(unique_docs(hits))
        return self.format_hits(query, hits)

    def format_hits(self, query: str, hits: Sequence[Hit]) -> str:
        """The ``search`` tool's output: numbered passages with ids and titles."""
        if not hits:
            return f"No passages found for {query.strip()[:80]!r}. Try other key words."
        # Share the tool's output budget between the passages (headers take ~80 chars).
        budget = (self.executor.max_output_chars - 80 * len(hits)) // len(hits)
        limit = max(20, min(self.passage_chars, budget))
        blocks = []
        for n, hit in enumerate(hits, start=1):
            text = hit.chunk.text
            if len(text) > limit:
                text = text[:limit].rstrip() + " [...]"
            title = f"{hit.chunk.title} " if hit.chunk.title else ""
            blocks.append(f"[{n}] {title}(doc {hit.doc_id}, chunk {hit.chunk.index})\n{text}")
        return "\n\n".join(blocks)

    # ---- ToolEnv hooks --------------------------------------------------------------
    @property
    def num_tasks(self) -> int:
        return len(self._items)

    def get_task(self, index: int) -> Task:
        item = self._items[index]
        meta = {"gold_doc_ids": item.gold_doc_ids, "qtype": item.metadata.get("qtype")}
        return Task(id=item.id, prompt=item.question, answer=item.answers, metadata=meta)

    def instructions(self) -> str:
        return (
            "You answer questions about a document collection you have never seen; its "
            "facts are not in your memory. Use the search tool to find passages (at most "
            f"{self.max_searches} searches), then give a short answer (a name, a year or a "
            f"phrase of at most {self.weights.max_answer_words} words) in <answer></answer> tags."
        )

    def compact_prompt(self) -> str:
        return COMPACT_PROMPT

    def on_reset(self, task: Task) -> None:
        with self._lock:
            self._epoch += 1
            self._num_searches = 0
            self._queries = []
            self._retrieved = []
            self._search_docs = []

    def score(self, answer: str, task: Task) -> tuple[float, dict[str, Any]]:
        retrieved = unique_docs(self._retrieved)
        gold_docs = task.metadata["gold_doc_ids"]
        reward, info = score_answer(answer, task.answer, retrieved, gold_docs, self.weights)
        if self.judge is not None:  # a free-form grade on top of EM / F1
            (verdict,) = self.judge.score_batch([(task.prompt, answer, task.answer[0])])
            reward += self.judge_weight * verdict.reward
            info["reward_judge"] = self.judge_weight * verdict.reward
            info["reward_components"]["judge"] = verdict.reward
            info["judge_error"] = verdict.error
        info.update(
            retrieved_doc_ids=retrieved,
            gold_doc_ids=list(gold_docs),
            gold=list(task.answer),
            qtype=task.metadata["qtype"],
        )
        return reward, info

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        obs, info = super().reset(seed=seed, options=options)
        info["num_searches"] = 0
        return obs, info

    def step(self, action: str) -> tuple[list[Message], SupportsFloat, bool, bool, dict[str, Any]]:
        found_before = set(unique_docs(self._retrieved))
        obs, reward, terminated, truncated, info = super().step(action)
        with self._lock:
            self._epoch += 1  # searches still running (timed out) record nothing now
        info["num_searches"] = self._num_searches
        info.update(self._retrieval_progress(found_before))
        return obs, reward, terminated, truncated, info

    def _retrieval_progress(self, found_before: set[str]) -> dict[str, Any]:
        """What this episode's searches found of the task's gold articles:
        ``search_gold_hits`` (per search so far, how many gold articles it returned),
        ``gold_retrieved`` (per gold article, in hop order: found by any search yet) and
        ``turn_reward``, the share of gold articles first found by this step's searches (a
        per-turn reward for ``credit="turn"``; not part of the episode's reward)."""
        assert self.task is not None
        gold = list(self.task.metadata["gold_doc_ids"])
        found = set(unique_docs(self._retrieved))
        new = [d for d in gold if d in found and d not in found_before]
        return {
            "search_gold_hits": [sum(d in docs for d in gold) for docs in self._search_docs],
            "gold_retrieved": [d in found for d in gold],
            "turn_reward": len(new) / len(gold) if gold else 0.0,
        }

    def close(self) -> None:
        """Drop this episode's state; the shared retriever stays for other instances."""
        with self._lock:
            self._epoch += 1
            self._queries, self._retrieved, self._search_docs = [], [], []
        super().close()


def _check_limits(default_k: int, max_k: int, searches: int, query_chars: int, chars: int) -> None:
    if max_k < 1 or not 1 <= default_k <= max_k:
        raise InvalidOptionError(f"need 1 <= default_k <= max_k, got {default_k} and {max_k}")
    if searches < 1 or query_chars < 1 or chars < 20:
        raise InvalidOptionError(
            f"need max_searches >= 1, max_query_chars >= 1 and passage_chars >= 20, got "
            f"{searches}, {query_chars}, {chars}"
        )


def _load_data(
    corpus: str | Path | Sequence[Document] | None, qa: str | Path | Sequence[QAItem] | None
) -> tuple[list[Document], list[QAItem]]:
    if corpus is None:
        docs, items = bundled(bridge=True)  # bridge questions last; select_types drops them
        documents = list(docs)
        items = list(items) if qa is None else _load_qa(qa)
    else:
        documents = load_corpus(corpus)
        if qa is None:
            raise InvalidOptionError(
                "a custom corpus needs questions: pass qa= a JSONL file with question, "
                "answers and gold_doc_ids per line, or a list of envs.rag.QAItem"
            )
        items = _load_qa(qa)
    check_gold_ids(items, documents)
    return documents, items


def _load_qa(qa: str | Path | Sequence[QAItem]) -> list[QAItem]:
    if isinstance(qa, str | Path):
        return load_qa_jsonl(qa)
    items = list(qa)
    bad = [type(i).__name__ for i in items if not isinstance(i, QAItem)]
    if bad:
        raise InvalidOptionError(f"qa must hold envs.rag.QAItem objects, got {bad[0]}")
    return items
