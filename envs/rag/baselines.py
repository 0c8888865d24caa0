"""Scripted policies for the RAG env: baselines, demos and tests.

Both are plain callables ``messages -> action`` (see :func:`agentenv.play_episode`):

* :class:`SearchThenAnswer` -- searches with the question, then answers from the top
  passage with :func:`extract_answer`, a small rule-based reader.
* :class:`AnswerWithoutSearch` -- answers at once (a fixed guess): what a model gets
  from its own memory on a corpus it has never seen.

The gap between their mean rewards shows that the env rewards retrieval.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from agentenv.env.spaces import Message
from envs.rag.bm25 import tokenize

_SPAN = re.compile(r"[A-Z][\w'-]*(?:\s+[A-Z][\w'-]*)*")
_CANDIDATE = re.compile(_SPAN.pattern + r"|\b\d+(?:[.,:/-]\d+)*\b")
_YEAR = re.compile(r"(?<![-\w,.])[1-9]\d{2,3}\b(?![,.]\d)")
_HEADER = re.compile(r"^\[1\] (?P<title>.*?)\s*\(doc (?P<doc>[^,]+), chunk \d+\)$", re.M)
_ANY_HEADER = re.compile(r"^\[\d+\] (?P<title>.*?)\s*\(doc (?P<doc>[^,]+), chunk \d+\)$", re.M)
_ORG_WORDS = ("organisation", "organization", "society", "institution", "group")


def parse_top_passage(tool_output: str) -> tuple[str, str] | None:
    """``(title, text)`` of passage ``[1]`` in a ``search`` result, or ``None``."""
    match = _HEADER.search(tool_output)
    if match is None:
        return None
    rest = tool_output[match.end() :].lstrip("\n")
    return match.group("title"), rest.split("\n\n[2] ", 1)[0].strip()


def parse_passages(tool_output: str) -> list[tuple[str, str, str]]:
    """``(title, doc id, text)`` of every numbered passage in a ``search`` result, in order."""
    headers = list(_ANY_HEADER.finditer(tool_output))
    ends = [h.start() for h in headers[1:]] + [len(tool_output)] if headers else []
    return [
        (h.group("title"), h.group("doc"), tool_output[h.end() : end].strip())
        for h, end in zip(headers, ends, strict=True)
    ]


def _spans_after(text: str, pattern: str, exclude: str) -> list[str]:
    spans = []
    for m in re.finditer(pattern + r"(" + _SPAN.pattern + ")", text):
        span = m.group(1).strip()
        if span.lower() not in exclude:
            spans.append(span)
    return spans


def _best_sentence_spans(question: str, title: str, text: str) -> list[str]:
    """Candidate answers (capitalised phrases, numbers) from the sentences sharing most
    words with ``question``, best sentence first; none that the question contains."""
    q_words, q_lower = set(tokenize(question)), question.lower()
    sentences = re.split(r"(?<=[.!?])\s+", text)
    ranked = sorted(sentences, key=lambda s: -len(q_words & set(tokenize(s))))  # stable
    spans = []
    for sentence in ranked:
        for m in _CANDIDATE.finditer(sentence):
            span = re.sub(r"^(The|A|An)\s+", "", m.group(0))
            lone_first_word = m.start() == 0 and " " not in span and not span[0].isdigit()
            if lone_first_word and span.lower() not in title.lower():
                continue  # "Never unplug it ...": capitalised only because it starts a sentence
            if span.lower() not in q_lower and span not in ("The", "A", "An"):
                spans.append(span)
    return spans


def extract_answer(question: str, title: str, text: str) -> str:
    """A short answer to ``question`` read from one passage, by simple rules.

    If the question names the passage's subject (its title) or an identifier (a name
    with a digit, like a catalogue number), it asks for an attribute: "what year /
    when" takes the first year; "which town / where" the first name after "in"/"from";
    "which organisation" the first name after "by the"; "who" the first name after
    "by". Otherwise (and failing those) the answer is the first capitalised phrase or
    number, not in the question, of the sentence sharing most words with the question,
    then of the next best sentences; else the title.
    """
    q = question.lower()
    identifiers = [s for s in _SPAN.findall(question) if any(ch.isdigit() for ch in s)]
    about_subject = title.lower() in q or bool(identifiers)
    exclude = q + " " + title.lower()
    spans: list[str] = []
    if about_subject and re.search(r"\b(what|which) year\b|\bwhen\b", q):
        years = _YEAR.findall(text)
        return years[0] if years else title
    if about_subject and re.search(r"\bwhere\b|\bwhich (town|city|place)\b", q):
        spans = _spans_after(text, r"\b(?:in|from) (?:the )?", exclude)
    elif about_subject and re.search(r"^\s*which (" + "|".join(_ORG_WORDS) + r")\b", q):
        spans = _spans_after(text, r"\bby the ", exclude)
    elif about_subject and re.search(r"^\s*who\b", q):
        spans = _spans_after(text, r"\bby ", exclude)
    spans += _best_sentence_spans(question, title, text)
    return spans[0] if spans else title


def search_action(query: str) -> str:
    """A Hermes ``search`` tool call for ``query``."""
    return f"<tool_call>{json.dumps({'name': 'search', 'arguments': {'query': query}})}</tool_call>"


class SearchThenAnswer:
    """Search with the question, then answer from the top passage (rule-based reader)."""

    def __call__(self, messages: Sequence[Message]) -> str:
        question = next(m["content"] for m in messages if m["role"] == "user")
        tool_outputs = [m["content"] for m in messages if m["role"] == "tool"]
        if not tool_outputs:
            return search_action(question)
        top = parse_top_passage(tool_outputs[-1])
        answer = extract_answer(question, *top) if top else "unknown"
        return f"<answer>{answer}</answer>"


class AnswerWithoutSearch:
    """Answer at once, without searching, with a fixed guess.

    Args:
        guess: The answer given to every question.
    """

    def __init__(self, guess: str = "unknown"):
        self.guess = guess

    def __call__(self, messages: Sequence[Message]) -> str:
        return f"<answer>{self.guess}</answer>"
