"""Documents, chunking and corpus loaders.

A corpus is a list of :class:`Document` (id, title, text). :func:`chunk_documents`
cuts each document into overlapping word windows (:class:`Chunk`, which keeps the
document id, title and chunk number); the retrievers index chunks.

Loaders (all return ``list[Document]`` and raise :class:`~envs.rag.errors.CorpusError`
with the file and line at fault):

* :func:`load_directory` -- every ``.txt`` / ``.md`` file under a folder (recursive);
  the id is the relative path, the title a leading ``# heading`` (taken out of the
  text) or else the file name.
* :func:`load_jsonl_documents` -- one JSON object per line with ``id``, ``title``, ``text``.
* :func:`load_hf_documents` -- a ``datasets`` dataset (hub name or local file/folder)
  with chosen text/title/id columns.
* :func:`load_corpus` -- dispatches on a path or passes a list of documents through.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from envs.rag.errors import CorpusError, RetrieverConfigError

TEXT_SUFFIXES: tuple[str, ...] = (".txt", ".md")


@dataclass(frozen=True)
class Document:
    """One source document.

    Attributes:
        id: Unique id within the corpus (gold ids in QA files refer to it).
        title: Short title shown with every passage ("" if none).
        text: The full text.
        metadata: Anything else (type of entity, source file, ...).
    """

    id: str
    title: str
    text: str
    metadata: dict[str, Any] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class Chunk:
    """A window of a document's words: what the retrievers index and return.

    Attributes:
        id: ``"<doc_id>#<index>"``.
        doc_id: The document it comes from.
        title: The document's title.
        text: The words of this window.
        index: Position of the window in the document (0-based).
    """

    id: str
    doc_id: str
    title: str
    text: str
    index: int = 0

    @property
    def search_text(self) -> str:
        """What is indexed: the title (context for later windows) then the text."""
        return f"{self.title}. {self.text}" if self.title else self.text


def chunk_documents(
    documents: Sequence[Document], *, chunk_size: int = 128, chunk_overlap: int = 32
) -> list[Chunk]:
    """Cut documents into windows of ``chunk_size`` words overlapping by ``chunk_overlap``.

    Words are whitespace-separated tokens; a document shorter than ``chunk_size``
    is one chunk. Documents with no words are skipped.

    Args:
        documents: The corpus.
        chunk_size: Words per chunk (>= 1).
        chunk_overlap: Words shared by consecutive chunks (0 <= overlap < chunk_size).

    Raises:
        RetrieverConfigError: on a bad size/overlap.
        CorpusError: if no document has any text.
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise RetrieverConfigError(f"chunk_size must be an int >= 1 (words), got {chunk_size!r}")
    if not isinstance(chunk_overlap, int) or not 0 <= chunk_overlap < chunk_size:
        raise RetrieverConfigError(
            f"chunk_overlap must be an int in [0, chunk_size={chunk_size}), got {chunk_overlap!r}"
        )
    stride = chunk_size - chunk_overlap
    chunks: list[Chunk] = []
    for doc in documents:
        words = doc.text.split()
        starts = [0] if words else []
        while starts and starts[-1] + chunk_size < len(words):
            starts.append(starts[-1] + stride)
        for i, start in enumerate(starts):
            text = " ".join(words[start : start + chunk_size])
            chunks.append(Chunk(f"{doc.id}#{i}", doc.id, doc.title, text, i))
    if not chunks:
        raise CorpusError(
            f"the corpus has no text to index ({len(documents)} documents, all empty); "
            "give at least one document with some words"
        )
    return chunks


def content_hash(chunks: Sequence[Chunk], *parts: object) -> str:
    """A sha256 hex digest of the chunks (ids, titles, texts) and any extra ``parts``.

    Used to name cached indexes: equal corpora, chunking and models give equal hashes.
    """
    h = hashlib.sha256()
    for part in parts:
        h.update(repr(part).encode("utf-8") + b"\x00")
    for c in chunks:
        for value in (c.id, c.title, c.text):
            h.update(value.encode("utf-8", errors="surrogatepass") + b"\x00")
    return h.hexdigest()


def validate_documents(documents: Iterable[Document], where: str) -> list[Document]:
    """Check types and unique ids; return the documents as a list.

    Raises:
        CorpusError: on an empty corpus, a non-Document item or a duplicate id.
    """
    docs = list(documents)
    if not docs:
        raise CorpusError(f"{where} has no documents; give at least one document with text")
    seen: dict[str, int] = {}
    for i, doc in enumerate(docs):
        if not isinstance(doc, Document):
            raise CorpusError(
                f"{where}: item {i} is a {type(doc).__name__}, expected envs.rag.Document"
            )
        if doc.id in seen:
            raise CorpusError(
                f"{where}: document id {doc.id!r} is used twice (items {seen[doc.id]} and {i}); "
                "ids must be unique"
            )
        seen[doc.id] = i
    return docs


def _title_and_body(text: str, fallback: str) -> tuple[str, str]:
    """A leading Markdown heading becomes the title (and leaves the body)."""
    stripped = text.lstrip()
    first, _, rest = stripped.partition("\n")
    if first.startswith("#") and first.lstrip("#").strip() and rest.strip():
        return first.lstrip("#").strip(), rest.strip()
    return fallback, text


def load_directory(path: str | Path, *, suffixes: Sequence[str] = TEXT_SUFFIXES) -> list[Document]:
    """Every text file under ``path`` (recursive, sorted) as a document.

    Args:
        path: A folder.
        suffixes: File endings to read (default ``.txt`` and ``.md``).

    Raises:
        CorpusError: if the folder is missing, holds no such files, or a file is not UTF-8.
    """
    root = Path(path)
    if not root.is_dir():
        raise CorpusError(f"corpus folder not found: {str(root)!r}; pass an existing folder")
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in suffixes)
    docs = []
    for file in files:
        try:
            text = file.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise CorpusError(
                f"{file} is not UTF-8 text ({exc.reason} at byte {exc.start}); "
                "convert it to UTF-8 or remove it from the folder"
            ) from exc
        if text.strip():
            rel = file.relative_to(root).as_posix()
            title, body = _title_and_body(text, file.stem)
            docs.append(Document(rel, title, body, {"path": str(file)}))
    if not docs:
        raise CorpusError(
            f"corpus folder {str(root)!r} has no non-empty {'/'.join(suffixes)} files; "
            "add documents or point at another folder"
        )
    return docs


def read_jsonl(path: str | Path, error: type[Exception] = CorpusError) -> list[tuple[int, dict]]:
    """``(line_number, object)`` for every non-blank line of a JSONL file.

    Raises:
        error: naming the file and line for a missing file, bad JSON or a non-object line.
    """
    file = Path(path)
    if not file.is_file():
        raise error(f"file not found: {str(file)!r}")
    rows = []
    with file.open(encoding="utf-8", errors="replace") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise error(
                    f"{file}, line {lineno}: not valid JSON ({exc.msg} at column {exc.colno}); "
                    "each line must be one JSON object, e.g. "
                    '{"id": "doc-1", "title": "...", "text": "..."}'
                ) from None
            if not isinstance(obj, dict):
                raise error(
                    f"{file}, line {lineno}: expected a JSON object, got {type(obj).__name__}"
                )
            rows.append((lineno, obj))
    return rows


def load_jsonl_documents(
    path: str | Path, *, text_field: str = "text", title_field: str = "title", id_field: str = "id"
) -> list[Document]:
    """Documents from a JSONL file, one object per line.

    A missing id becomes ``"line-<n>"``; a missing title becomes ``""``.

    Raises:
        CorpusError: naming the line for bad JSON or a missing/non-string text field.
    """
    docs = []
    for lineno, row in read_jsonl(path):
        text = row.get(text_field)
        if not isinstance(text, str):
            raise CorpusError(
                f"{path}, line {lineno}: field {text_field!r} must be a string, got "
                f"{type(text).__name__}; keys on this line: {sorted(row)}"
            )
        doc_id = str(row.get(id_field, f"line-{lineno}"))
        extra = {k: v for k, v in row.items() if k not in (text_field, title_field, id_field)}
        docs.append(Document(doc_id, str(row.get(title_field) or ""), text, extra))
    return validate_documents(docs, str(path))


def load_hf_dataset(
    name_or_path: str | Path, *, split: str = "train", config: str | None = None
) -> Any:
    """Load a ``datasets`` dataset from a local file/folder or, failing that, the hub.

    Local files are read by suffix (``.jsonl``/``.json``, ``.csv``, ``.parquet``);
    a folder written by ``Dataset.save_to_disk`` is loaded from disk. Anything else is
    treated as a hub id (needs network or a filled hub cache).

    Raises:
        CorpusError: when loading fails, with the underlying reason.
    """
    import datasets

    path = Path(name_or_path)
    kinds = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
    try:
        if path.is_file():
            if path.suffix.lower() not in kinds:
                raise CorpusError(
                    f"cannot read {str(path)!r}: expected a .jsonl/.json/.csv/.parquet file"
                )
            return datasets.load_dataset(
                kinds[path.suffix.lower()], data_files=str(path), split="train"
            )
        if path.is_dir() and (path / "dataset_info.json").exists():
            loaded = datasets.load_from_disk(str(path))
            return loaded[split] if isinstance(loaded, datasets.DatasetDict) else loaded
        return datasets.load_dataset(str(name_or_path), config, split=split)
    except CorpusError:
        raise
    except Exception as exc:
        raise CorpusError(
            f"could not load dataset {str(name_or_path)!r} (split {split!r}): {exc}. "
            "Offline? Pass a local .jsonl/.csv/.parquet file or a save_to_disk folder."
        ) from exc


def load_hf_documents(
    name_or_path: str | Path,
    *,
    split: str = "train",
    text_column: str = "text",
    title_column: str | None = None,
    id_column: str | None = None,
    config: str | None = None,
) -> list[Document]:
    """Documents from a ``datasets`` dataset with chosen columns.

    Args:
        name_or_path: Hub id or local file/folder (see :func:`load_hf_dataset`).
        split: Dataset split to read.
        text_column: Column with the document text.
        title_column: Column with the title (optional).
        id_column: Column with a unique id (optional; row number otherwise).
        config: Hub dataset configuration name.

    Raises:
        CorpusError: on a missing column or a loading failure.
    """
    ds = load_hf_dataset(name_or_path, split=split, config=config)
    wanted = [c for c in (text_column, title_column, id_column) if c]
    missing = [c for c in wanted if c not in ds.column_names]
    if missing:
        raise CorpusError(
            f"dataset {str(name_or_path)!r} has no column(s) {missing}; its columns are "
            f"{ds.column_names}. Pass text_column=/title_column=/id_column= accordingly."
        )
    docs = []
    for i, row in enumerate(ds):
        doc_id = str(row[id_column]) if id_column else f"row-{i}"
        title = str(row[title_column] or "") if title_column else ""
        docs.append(Document(doc_id, title, str(row[text_column] or "")))
    return validate_documents(docs, f"dataset {str(name_or_path)!r}")


def load_corpus(source: str | Path | Sequence[Document]) -> list[Document]:
    """A corpus from a folder, a ``.jsonl`` file or a list of documents.

    Raises:
        CorpusError: if the path is neither, or loading fails.
    """
    if isinstance(source, str | Path):
        path = Path(source)
        if path.is_dir():
            return load_directory(path)
        if path.suffix.lower() in (".jsonl", ".json"):
            return load_jsonl_documents(path)
        raise CorpusError(
            f"corpus {str(source)!r} is neither a folder of .txt/.md files nor a .jsonl file; "
            "for a datasets dataset use envs.rag.load_hf_documents(...)"
        )
    return validate_documents(source, "the corpus")
