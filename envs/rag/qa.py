"""Question/answer sets: the JSONL format, train/test splitting and a MedQuAD-style loader.

A QA file has one JSON object per line::

    {"question": "Who founded the Vellmark Institute?",
     "answers": ["Oriane Thask", "Thask"],          # every accepted alias ("answer": str ok)
     "gold_doc_ids": ["org-0007"],                   # documents that hold the answer
     "id": "q-17",                                   # optional
     "split": "test"}                                # optional: "train" or "test"

Without ``split`` fields, :func:`split_items` assigns each question by a stable hash of
its gold document ids (of the question if it has none), so the documents a test
question is about are never the gold documents of a train question.
"""

from __future__ import annotations

import difflib
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentenv.env.splits import stable_fraction
from agentenv.errors import InvalidOptionError
from envs.rag.corpus import Document, load_hf_dataset, read_jsonl
from envs.rag.errors import CorpusError, QAFileError

TEST_FRACTION = 0.2


@dataclass(frozen=True)
class QAItem:
    """One question with its gold answers and gold documents.

    Attributes:
        id: Stable id.
        question: The question shown to the agent.
        answers: Every accepted answer (aliases); scored by exact match and token F1.
        gold_doc_ids: Documents holding the answer (may be empty: no retrieval reward).
        split: ``"train"``, ``"test"`` or ``None`` (assigned by hash).
        metadata: Anything else (e.g. ``qtype`` of the bundled questions).
    """

    id: str
    question: str
    answers: tuple[str, ...]
    gold_doc_ids: tuple[str, ...] = ()
    split: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict, compare=False)


def split_of_item(item: QAItem, test_fraction: float = TEST_FRACTION) -> str:
    """The split of ``item``: its own ``split`` or a stable hash of its gold docs/question."""
    if item.split is not None:
        return item.split
    key = "|".join(sorted(item.gold_doc_ids)) or " ".join(item.question.lower().split())
    return "test" if stable_fraction(key) < test_fraction else "train"


def split_items(
    items: Sequence[QAItem], split: str, test_fraction: float = TEST_FRACTION
) -> list[QAItem]:
    """The items of ``split`` (``"train"`` or ``"test"``), in their original order."""
    return [it for it in items if split_of_item(it, test_fraction) == split]


def select_types(items: Sequence[QAItem], types: str | Sequence[str] | None) -> list[QAItem]:
    """The items whose ``metadata["qtype"]`` is in ``types``, in order; ``None``: all but
    ``"bridge"`` questions.

    Raises:
        InvalidOptionError: naming a type no item has (with the valid ones), or for none.
    """
    if types is None:
        return [it for it in items if it.metadata.get("qtype") != "bridge"]
    wanted = [types] if isinstance(types, str) else list(types)
    valid = sorted({str(it.metadata["qtype"]) for it in items if it.metadata.get("qtype")})
    if not wanted:
        raise InvalidOptionError(f"question_types is empty; pass one or more of {valid}")
    for qtype in wanted:
        if qtype not in valid:
            close = difflib.get_close_matches(str(qtype), valid, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise InvalidOptionError(
                f"question_types has {qtype!r}, which no question of this QA set has{hint}; "
                f"valid types: {valid or 'none (the questions have no qtype)'}"
            )
    return [it for it in items if it.metadata.get("qtype") in wanted]


def _as_str_list(value: Any, what: str, where: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str | int) for v in value):
        raise QAFileError(f"{where}: {what} must be a string or a list of strings, got {value!r}")
    return tuple(str(v) for v in value)


def load_qa_jsonl(path: str | Path) -> list[QAItem]:
    """Questions from a JSONL file (format in the module docstring).

    Raises:
        QAFileError: naming the line for bad JSON, a missing question/answers field,
            an empty answer list or a bad ``split`` value.
    """
    items = []
    for lineno, row in read_jsonl(path, error=QAFileError):
        where = f"{path}, line {lineno}"
        question = row.get("question")
        if not isinstance(question, str) or not question.strip():
            raise QAFileError(f"{where}: 'question' must be a non-empty string, got {question!r}")
        raw_answers = row.get("answers", row.get("answer"))
        if raw_answers is None:
            raise QAFileError(f"{where}: needs 'answers' (list of strings) or 'answer' (string)")
        answers = _as_str_list(raw_answers, "'answers'", where)
        if not any(a.strip() for a in answers):
            raise QAFileError(f"{where}: 'answers' is empty; give at least one accepted answer")
        gold = _as_str_list(row.get("gold_doc_ids", row.get("gold_doc_id", [])), "gold ids", where)
        split = row.get("split")
        if split not in (None, "train", "test"):
            raise QAFileError(f"{where}: 'split' must be 'train' or 'test', got {split!r}")
        extra = {k: v for k, v in row.items() if k not in _QA_FIELDS}
        items.append(
            QAItem(str(row.get("id", f"q-{lineno}")), question, answers, gold, split, extra)
        )
    if not items:
        raise QAFileError(f"{path} has no questions; add one JSON object per line")
    return items


_QA_FIELDS = {"id", "question", "answers", "answer", "gold_doc_ids", "gold_doc_id", "split"}


def check_gold_ids(items: Sequence[QAItem], documents: Sequence[Document]) -> None:
    """Raise :class:`QAFileError` if a question names a document the corpus lacks."""
    known = {d.id for d in documents}
    for item in items:
        unknown = [g for g in item.gold_doc_ids if g not in known]
        if unknown:
            sample = sorted(known)[:3]
            raise QAFileError(
                f"question {item.id!r} names gold document(s) {unknown} that are not in the "
                f"corpus (corpus ids look like {sample}); fix the ids or the corpus"
            )


def load_medquad(
    name_or_path: str | Path,
    *,
    split: str = "train",
    question_column: str = "Question",
    answer_column: str = "Answer",
    type_column: str | None = "qtype",
    limit: int | None = None,
) -> tuple[list[Document], list[QAItem]]:
    """A MedQuAD-style dataset as a corpus plus questions.

    Each distinct answer text becomes a document (id ``"medquad-<hash>"``); each row a
    question whose gold document is its answer's and whose accepted answer is the answer
    text (long answers are scored by token F1 rather than exact match). Works with a hub id
    such as ``"keivalya/MedQuad-MedicalQnADataset"`` (needs the hub; never a default) or a
    local ``.jsonl``/``.csv``/``.parquet`` file with the same columns.

    Args:
        name_or_path: Hub dataset id or local file/folder.
        split: Dataset split to read.
        question_column: Column with the question.
        answer_column: Column with the answer text.
        type_column: Optional column with the question type (kept as metadata and title).
        limit: Keep only the first ``limit`` rows.

    Raises:
        CorpusError: if loading fails or a column is missing.
    """
    ds = load_hf_dataset(name_or_path, split=split)
    missing = [c for c in (question_column, answer_column) if c not in ds.column_names]
    if missing:
        raise CorpusError(
            f"dataset {str(name_or_path)!r} has no column(s) {missing}; its columns are "
            f"{ds.column_names}. Pass question_column=/answer_column= accordingly."
        )
    has_type = type_column is not None and type_column in ds.column_names
    docs: dict[str, Document] = {}
    items: list[QAItem] = []
    for i, row in enumerate(ds):
        if limit is not None and i >= limit:
            break
        question, answer = str(row[question_column] or ""), str(row[answer_column] or "")
        if not question.strip() or not answer.strip():
            continue
        qtype = str(row[type_column]) if has_type else ""
        doc_id = "medquad-" + hashlib.blake2b(answer.encode(), digest_size=6).hexdigest()
        docs.setdefault(doc_id, Document(doc_id, qtype, answer, {"source": str(name_or_path)}))
        items.append(
            QAItem(f"medquad-q{i}", question, (answer,), (doc_id,), None, {"qtype": qtype})
        )
    if not items:
        raise CorpusError(f"dataset {str(name_or_path)!r} gave no question/answer rows")
    return list(docs.values()), items
