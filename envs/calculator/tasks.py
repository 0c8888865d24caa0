"""Task sources for the Calculator env: reasoning-gym generators (offline) and GSM8K.

Every source yields :class:`agentenv.Task` objects whose ``answer`` is the gold
number as a string. Splits are made by hashing the normalised question text, so
``train`` and ``test`` are disjoint by construction and stable across runs and
machines; duplicates within a split are dropped.

Sources:

* ``"gsm_symbolic"`` (default) and ``"basic_arithmetic"``: generated offline by the
  ``reasoning-gym`` package; ``config`` is passed to its dataset config.
* ``"word_problems"``: two-step arithmetic word problems from
  :mod:`envs.calculator.word_problems` (offline; each task carries its expression).
* ``"prices"``: shopping problems whose prices only the env's ``price`` tool knows
  (:mod:`envs.calculator.prices`; two lookups, then the calculator); each task carries
  its shop's ``prices`` and the ``quantities`` asked.
* ``"gsm8k"``: ``path=None`` loads the hub dataset ``openai/gsm8k`` (needs the hub;
  its own train/test splits are used); ``path="file.jsonl"`` or ``.parquet`` loads a
  local file with ``question`` and ``answer`` columns (GSM8K's ``... #### 72``
  answer format is parsed).
"""

from __future__ import annotations

import functools
import importlib
import json
import re
from pathlib import Path
from typing import Any

from agentenv.env.core import Task
from agentenv.env.splits import hashed_split
from agentenv.errors import InvalidOptionError, TaskSourceError

GENERATED_SOURCES = ("gsm_symbolic", "basic_arithmetic", "word_problems", "prices")
SOURCES = (*GENERATED_SOURCES, "gsm8k")
TEST_FRACTION = 0.2
DEFAULT_NUM_TASKS = {"train": 2000, "test": 500}
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def split_of(question: str, test_fraction: float = TEST_FRACTION) -> str:
    """``"test"`` or ``"train"``, decided by a stable hash of the normalised question."""
    norm = " ".join(question.lower().split())
    return hashed_split(norm, test_fraction)


def parse_gsm8k_answer(answer: str) -> str:
    """``"... #### 1,234"`` -> ``"1234"``; a bare number is returned cleaned.

    Raises:
        ValueError: if no number can be found.
    """
    text = str(answer)
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    text = text.strip().replace(",", "").replace("$", "")
    match = _NUMBER.fullmatch(text) or _NUMBER.search(text)
    if not match:
        raise ValueError(f"no number in answer {answer!r}")
    return match.group(0)


def load_tasks(
    source: str = "gsm_symbolic",
    split: str = "train",
    *,
    num_tasks: int | None = None,
    path: str | None = None,
    config: dict[str, Any] | None = None,
    seed: int = 0,
) -> tuple[Task, ...]:
    """Load (and cache) the tasks of one split of one source.

    Args:
        source: One of :data:`SOURCES`.
        split: ``"train"`` or ``"test"``.
        num_tasks: How many tasks to keep (default 2000 train / 500 test for the
            generators; all rows for GSM8K).
        path: Local GSM8K-style JSONL/Parquet file (``source="gsm8k"`` only).
        config: Extra reasoning-gym dataset config (e.g. ``{"max_terms": 4}``).
        seed: Generator seed; the split assignment does not depend on it.

    Raises:
        InvalidOptionError: unknown source/split or a bad combination.
        TaskSourceError: the data could not be loaded or has a malformed row.
    """
    if source not in SOURCES:
        raise InvalidOptionError(f"source must be one of {SOURCES}, got {source!r}")
    if split not in ("train", "test"):
        raise InvalidOptionError(f"split must be 'train' or 'test', got {split!r}")
    if num_tasks is not None and num_tasks < 1:
        raise InvalidOptionError(f"num_tasks must be >= 1, got {num_tasks}")
    if path is not None and source != "gsm8k":
        raise InvalidOptionError(f"path= is only used with source='gsm8k', got source={source!r}")
    cfg = json.dumps(config or {}, sort_keys=True)
    return _load_cached(source, split, num_tasks, path, cfg, seed)


@functools.lru_cache(maxsize=32)
def _load_cached(
    source: str, split: str, num_tasks: int | None, path: str | None, cfg: str, seed: int
) -> tuple[Task, ...]:
    if source in GENERATED_SOURCES:
        n = num_tasks or DEFAULT_NUM_TASKS[split]
        return _generated(source, split, n, json.loads(cfg), seed)
    rows = _gsm8k_rows(path, split)
    tasks = _dedupe(
        Task(id=f"gsm8k-{i}", prompt=q, answer=a)
        for i, (q, a) in enumerate(rows)
        if path is None or split_of(q) == split
    )
    if not tasks:
        raise TaskSourceError(f"no {split!r} tasks in {path or 'openai/gsm8k'}")
    return tuple(tasks[:num_tasks] if num_tasks else tasks)


def _generated(
    source: str, split: str, n: int, config: dict[str, Any], seed: int
) -> tuple[Task, ...]:
    frac = TEST_FRACTION if split == "test" else 1 - TEST_FRACTION
    size = int(n / frac * 1.3) + 16
    for _ in range(4):  # grow the pool if duplicates left us short
        try:
            dataset = _create(source, size, seed, config)
        except (TypeError, ValueError, AssertionError) as exc:
            raise TaskSourceError(
                f"reasoning-gym rejected config {config} for {source!r}: {exc}"
            ) from exc
        tasks = _dedupe(
            Task(
                id=f"{source}-{i}",
                prompt=item["question"],
                answer=parse_gsm8k_answer(item["answer"]),
                metadata={
                    "source": source,
                    "expression": item["metadata"].get("expression"),
                    **item.get("task_metadata", {}),
                },
            )
            for i, item in enumerate(dataset)
            if split_of(item["question"]) == split
        )
        if len(tasks) >= n:
            return tuple(tasks[:n])
        size *= 2
    raise TaskSourceError(
        f"{source!r} produced only {len(tasks)} distinct {split} tasks, fewer than "
        f"num_tasks={n}; lower num_tasks or widen the generator config"
    )


def _create(source: str, size: int, seed: int, config: dict[str, Any]) -> list[dict[str, Any]]:
    """Items ``{"question", "answer", "metadata": {"expression"?}, "task_metadata"?}`` of a
    generated source (``task_metadata``: more keys of the task's metadata)."""
    if source in ("prices", "word_problems"):  # the bundled generators
        if config:
            raise TypeError(f"{source} takes no config, got {config}")
        module = importlib.import_module(f"envs.calculator.{source}")
        items = []
        for p in module.generate(size, seed):
            item = {
                "question": p.question,
                "answer": str(p.answer),
                "metadata": {"expression": p.expression},
            }
            if source == "prices":
                item["task_metadata"] = {"prices": p.prices, "quantities": p.quantities}
            items.append(item)
        return items
    import reasoning_gym

    return list(reasoning_gym.create_dataset(source, size=size, seed=seed, **config))


def _dedupe(tasks: Any) -> list[Task]:
    seen: set[str] = set()
    out = []
    for t in tasks:
        if t.prompt not in seen:
            seen.add(t.prompt)
            out.append(t)
    return out


def _gsm8k_rows(path: str | None, split: str) -> list[tuple[str, str]]:
    import datasets

    try:
        if path is None:  # needs the hub; never the default path
            ds = datasets.load_dataset("openai/gsm8k", "main", split=split)
        else:
            file = Path(path)
            if not file.is_file():
                raise TaskSourceError(f"GSM8K file not found: {path}")
            kind = "parquet" if file.suffix == ".parquet" else "json"
            ds = datasets.load_dataset(kind, data_files=str(file), split="train")
    except TaskSourceError:
        raise
    except Exception as exc:
        where = path or "the hub dataset 'openai/gsm8k' (offline? pass path= to a local file)"
        raise TaskSourceError(f"could not load GSM8K from {where}: {exc}") from exc
    missing = {"question", "answer"} - set(ds.column_names)
    if missing:
        raise TaskSourceError(
            f"{path or 'openai/gsm8k'} lacks column(s) {sorted(missing)}; "
            f"found {ds.column_names}. Rows need 'question' and 'answer'."
        )
    rows = []
    for i, row in enumerate(ds):
        try:
            rows.append((str(row["question"]), parse_gsm8k_answer(row["answer"])))
        except ValueError as exc:
            raise TaskSourceError(f"{path or 'openai/gsm8k'} row {i}: {exc}") from exc
    return rows
