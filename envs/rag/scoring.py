"""Answer and retrieval scoring for the RAG env.

``reward = answer * max(EM, F1) + retrieval * R + format * well_formed`` where

* EM / F1 -- normalised exact match and token F1 (SQuAD-style normalisation:
  lowercase, punctuation and the articles a/an/the removed, whitespace collapsed),
  each the best over all gold aliases;
* R -- the reciprocal rank of the first gold document in the episode's retrieved
  documents (every search's hits in order, each document counted once; 0 if none);
  ``info["retrieval_recall"]`` reports the share of gold documents retrieved at any rank
  (a multi-hop question's later hops) beside it, outside the reward;
* well_formed -- the answer is non-empty and at most ``max_answer_words`` words, or is
  exactly right. Being right implies being well formed, so with equal retrieval a
  wrong answer always scores strictly less than a right one; and ``format`` must be
  below ``answer`` so the format term alone never outweighs a correct answer.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from agentenv.errors import InvalidOptionError

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation + "\u2013\u2014\u2018\u2019\u201c\u201d")


def normalize_answer(text: str) -> str:
    """Lowercase, drop punctuation and articles, collapse whitespace."""
    text = text.lower().translate(_PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, golds: Iterable[str]) -> float:
    """1.0 if the normalised prediction equals any normalised gold alias, else 0.0."""
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in golds))


def token_f1(prediction: str, golds: Iterable[str]) -> float:
    """Best token-level F1 between the normalised prediction and any gold alias."""
    pred = normalize_answer(prediction).split()
    best = 0.0
    for gold in golds:
        ref = normalize_answer(gold).split()
        common = sum((Counter(pred) & Counter(ref)).values())
        if common:
            precision, recall = common / len(pred), common / len(ref)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


def first_gold_rr(retrieved_doc_ids: Sequence[str], gold_doc_ids: Iterable[str]) -> float:
    """``1 / rank`` of the first gold document among ``retrieved_doc_ids``, or 0.0."""
    gold = set(gold_doc_ids)
    for rank, doc_id in enumerate(retrieved_doc_ids, start=1):
        if doc_id in gold:
            return 1.0 / rank
    return 0.0


def gold_recall(retrieved_doc_ids: Sequence[str], gold_doc_ids: Sequence[str]) -> float:
    """The share of ``gold_doc_ids`` among ``retrieved_doc_ids`` (at any rank), or 0.0."""
    gold = set(gold_doc_ids)
    return len(gold & set(retrieved_doc_ids)) / len(gold) if gold else 0.0


@dataclass(frozen=True)
class RewardWeights:
    """Weights of the reward terms (see the module docstring).

    Attributes:
        answer: Weight of ``max(EM, F1)``.
        retrieval: Weight of the retrieval score (the first gold document's reciprocal rank).
        format: Weight of a non-empty, short answer; must be < ``answer``.
        max_answer_words: Longest answer (in words) that counts as well formed.
    """

    answer: float = 1.0
    retrieval: float = 0.2
    format: float = 0.05
    max_answer_words: int = 10

    def __post_init__(self) -> None:
        for name in ("answer", "retrieval", "format"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or value < 0:
                raise InvalidOptionError(f"{name} weight must be a number >= 0, got {value!r}")
        if self.answer <= 0:
            raise InvalidOptionError(f"answer weight must be > 0, got {self.answer}")
        if self.format >= self.answer:
            raise InvalidOptionError(
                f"format weight ({self.format}) must be smaller than the answer weight "
                f"({self.answer}) so formatting alone never outweighs a correct answer"
            )
        if self.max_answer_words < 1:
            raise InvalidOptionError(f"max_answer_words must be >= 1, got {self.max_answer_words}")


def score_answer(
    answer: str,
    golds: Sequence[str],
    retrieved_doc_ids: Sequence[str],
    gold_doc_ids: Sequence[str],
    weights: RewardWeights,
) -> tuple[float, dict[str, Any]]:
    """The reward of a final ``answer`` and its components.

    Returns:
        ``(reward, info)`` with ``correct`` (EM), ``answer_em``, ``answer_f1``,
        ``retrieval_rr`` (the reward's), ``retrieval_recall`` (reported only),
        ``format_ok``, the weighted terms ``reward_answer``, ``reward_retrieval``,
        ``reward_format`` (which sum to ``reward``) and
        ``reward_components``, the unweighted ``answer`` / ``retrieval`` / ``format`` scores
        (for a trainer's ``reward_combination`` other than the weighted sum).
    """
    em = exact_match(answer, golds)
    f1 = token_f1(answer, golds)
    rr = first_gold_rr(retrieved_doc_ids, gold_doc_ids)
    recall = gold_recall(retrieved_doc_ids, gold_doc_ids)
    words = len(answer.split())
    format_ok = em == 1.0 or 1 <= words <= weights.max_answer_words
    terms = {
        "reward_answer": weights.answer * max(em, f1),
        "reward_retrieval": weights.retrieval * rr,
        "reward_format": weights.format * float(format_ok),
    }
    info: dict[str, Any] = {
        "correct": em == 1.0,
        "answer_em": em,
        "answer_f1": f1,
        "retrieval_rr": rr,
        "retrieval_recall": recall,
        "format_ok": format_ok,
        **terms,
        "reward_components": {
            "answer": max(em, f1),
            "retrieval": rr,
            "format": float(format_ok),
        },
    }
    return sum(terms.values()), info
