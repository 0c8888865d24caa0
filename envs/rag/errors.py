"""Errors of the RAG env, each under agentenv's single hierarchy.

Loading and index problems are raised to the caller (:class:`CorpusError`,
:class:`QAFileError`, :class:`ChromaConnectionError`). Problems with a ``search``
call inside an episode are :class:`~agentenv.errors.ToolError` subclasses: the
executor turns them into an ``Error: ...`` observation and counts them in
``info["tool_errors"]`` under their ``kind``.
"""

from __future__ import annotations

from agentenv.errors import AgentEnvError, InvalidOptionError, TaskSourceError, ToolError


class CorpusError(TaskSourceError):
    """A corpus could not be loaded: missing path, empty corpus, broken line or column."""


class QAFileError(TaskSourceError):
    """A question/answer file could not be loaded or names unknown documents."""


class ChromaConnectionError(AgentEnvError):
    """The Chroma server given with ``chroma="http://host:port"`` cannot be reached."""


class RetrieverConfigError(InvalidOptionError):
    """A retriever or fusion option has a bad value (unknown backend, bad weight, k < 1)."""


class SearchError(ToolError):
    """Base of the errors a ``search`` tool call can produce inside an episode."""

    kind = "search"


class EmptyQueryError(SearchError):
    """The query is empty or only whitespace."""

    kind = "empty_query"


class QueryTooLongError(SearchError):
    """The query is longer than the env's ``max_query_chars``."""

    kind = "query_too_long"


class BadKError(SearchError):
    """``k`` is outside ``[1, max_k]``."""

    kind = "k_out_of_range"


class SearchLimitError(SearchError):
    """The episode already used its ``max_searches`` searches."""

    kind = "search_limit"
