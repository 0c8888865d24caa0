"""Bridge questions: two hops, where one search with the question cannot find the answer.

A bridge question names a first entity and asks about a second one that only a fact of
the first entity's article names: "In what year was the town where Oriane Thask was
born founded?" needs the person's article (born in Brevonne) and then the town's
(founded in 1214). The question never names the second entity. Its gold documents are
both articles, first hop first.

:data:`RELATIONS` are the nine families. :func:`bridge_items` turns the generator's
facts (:class:`Link`) into questions; :func:`bridge_demonstration` is the scripted
expert of RAG-v0 for them: search the first entity, read the linking fact, search the
second entity, read the answer; for about a third of the tasks it first makes a vaguer
search that misses both articles, then searches again by name.

Splits: a bridge question goes to the split of its two articles, each article's split
being :func:`doc_split` (a stable hash of its id at :data:`BRIDGE_TEST_FRACTION`, 0.5:
not the single-hop questions' test fraction), set explicitly in ``QAItem.split``; a fact
whose two articles fall in different splits gives no question, and neither does a fact
whose second article also names the first entity (a person who founded the organisation
they joined): one search could find both articles. So a test bridge question's
documents are never gold documents of a train bridge question; a run that mixes bridge
and single-hop questions drops the single-hop train questions about bridge test articles
(:func:`without_bridge_leaks`). A run on the single-hop questions alone (RAG-v0's
default) keeps them: a model trained there has seen articles that bridge test
questions need, and ``agentenv eval`` says so when it evaluates such a checkpoint on
bridge questions (:mod:`agentenv.run.leaks`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from agentenv.env.splits import stable_fraction
from envs.rag.baselines import parse_passages, search_action
from envs.rag.qa import QAItem, split_of_item

BRIDGE_TEST_FRACTION = 0.5
"""The share of articles on the bridge questions' test side (about a quarter of the
facts then have both articles there)."""

REQUERY_FRACTION = 1 / 3
"""About this share of the bridge demonstrations starts with a search that misses."""

_NAME = r"[A-Z][\w'-]*(?: [A-Z][\w'-]*)*"


@dataclass(frozen=True)
class Relation:
    """A family of bridge questions.

    Attributes:
        name: The fact of the first article that names the second ("birthplace").
        subject_kind: The first entity's kind ("person", "organisation", "artifact").
        attribute: The second entity's attribute that is asked for.
        question: The question, with ``{subject}`` for the first entity as the text
            writes it ("Oriane Thask", "the Vellmark Institute").
        link: Regex whose group 1 is the second entity's name in the first article.
        fact: Regex whose group 1 is the answer in the second article.
        blind: A search for the second hop without the first entity (it misses the
            first article: a re-query demonstration may start with it).
    """

    name: str
    subject_kind: str
    attribute: str
    question: str
    link: str
    fact: str
    blind: str


RELATIONS: tuple[Relation, ...] = (
    Relation("birthplace", "person", "founded",
             "In what year was the town where {subject} was born founded?",
             rf"\bborn in ({_NAME})", r"\bfounded in (\d{3,4})\b",
             "year the town was founded"),
    Relation("settled", "person", "founded",
             "In what year was the town where {subject} settled founded?",
             rf"\bsettled in ({_NAME})", r"\bfounded in (\d{3,4})\b",
             "year the town was founded"),
    Relation("joined", "person", "founded",
             "In what year was the organisation that {subject} joined founded?",
             rf"\bjoined (?:the )?({_NAME})", r"\bfounded in (\d{3,4})\b",
             "year the organisation was founded"),
    Relation("founder", "organisation", "birthplace",
             "In which town was the founder of {subject} born?",
             rf"\bfounded in \d+ by ({_NAME})", rf"\bborn in ({_NAME})",
             "town where the founder was born"),
    Relation("headquarters", "organisation", "founded",
             "In what year was the town where {subject} has its headquarters founded?",
             rf"\bheadquarters are in ({_NAME})", r"\bfounded in (\d{3,4})\b",
             "year the town was founded"),
    Relation("keeper", "artifact", "headquarters",
             "Where does the organisation that keeps {subject} have its headquarters?",
             rf"\bkept by (?:the )?({_NAME})", rf"\bheadquarters are in ({_NAME})",
             "headquarters of the organisation that keeps the object"),
    Relation("maker", "artifact", "born",
             "In what year was the maker of {subject} born?",
             rf"\bmade in \d+ by ({_NAME})", r"\((\d{3,4})-\d{3,4}\)",
             "birth year of the maker"),
    Relation("correspondent", "person", "born",
             "In what year was the correspondent of {subject} born?",
             rf"\bcorrespondence with ({_NAME})", r"\((\d{3,4})-\d{3,4}\)",
             "birth year of the correspondent"),
    Relation("road", "town", "founded",
             "In what year was the town that the old road to {subject} starts from founded?",
             rf"\bold road from ({_NAME})", r"\bfounded in (\d{3,4})\b",
             "year the town at the end of the old road was founded"),
)  # fmt: skip
"""Every bridge question family."""

_BY_NAME = {r.name: r for r in RELATIONS}


@dataclass(frozen=True)
class Link:
    """A fact of one article that names another, with the other's attributes.

    Attributes:
        relation: A :class:`Relation` name.
        subject_id: The first article's document id.
        subject: The first entity as the text writes it ("the Vellmark Institute").
        target_id: The second article's document id.
        target_aliases: Every name of the second entity (none may be in the question).
        target_attributes: The second entity's attributes by name ("founded": "1214").
    """

    relation: str
    subject_id: str
    subject: str
    target_id: str
    target_aliases: tuple[str, ...]
    target_attributes: Mapping[str, str]


def doc_split(doc_id: str) -> str:
    """The split of the bridge questions about article ``doc_id``."""
    return split_of_item(QAItem("", "", ("",), (doc_id,)), BRIDGE_TEST_FRACTION)


def without_bridge_leaks(items: Sequence[QAItem]) -> list[QAItem]:
    """``items`` less, when they mix bridge and other questions, the train questions of
    another type whose gold article is a bridge test article (training on them would
    teach a held-out bridge answer's article); the rest in order. Items of one kind
    pass unchanged."""
    kinds = {it.metadata.get("qtype") == "bridge" for it in items}
    if len(kinds) < 2:
        return list(items)
    return [
        it
        for it in items
        if it.metadata.get("qtype") == "bridge"
        or split_of_item(it) == "test"
        or all(doc_split(doc) == "train" for doc in it.gold_doc_ids)
    ]


def bridge_items(links: Sequence[Link], texts: Mapping[str, str]) -> list[QAItem]:
    """One bridge question per link whose two articles are in the same split and whose
    second article does not name the first entity (one search could find both).

    Ids are ``"<first doc id>-b<j>"`` (``j`` counts the first entity's links, kept or
    not), ``answers`` the second entity's attribute, ``gold_doc_ids`` both articles
    (first hop first), ``split`` both articles' split; ``metadata`` holds ``qtype``
    ``"bridge"``, ``kind`` (the first entity's), ``relation`` and ``bridge_aliases``
    (the second entity's names, for checks; never shown to the agent).

    Args:
        links: The facts, in the order their questions should come.
        texts: Every article's text by document id.

    Raises:
        KeyError: a link names a relation not in :data:`RELATIONS` or an unknown article.
    """
    items, seen = [], {}
    for link in links:
        relation = _BY_NAME[link.relation]
        j = seen[link.subject_id] = seen.get(link.subject_id, -1) + 1
        split = doc_split(link.subject_id)
        if doc_split(link.target_id) != split or _names(texts[link.target_id], link.subject):
            continue
        items.append(
            QAItem(
                f"{link.subject_id}-b{j}",
                relation.question.format(subject=link.subject),
                (link.target_attributes[relation.attribute],),
                (link.subject_id, link.target_id),
                split,
                {
                    "qtype": "bridge",
                    "kind": relation.subject_kind,
                    "relation": relation.name,
                    "bridge_aliases": link.target_aliases,
                },
            )
        )
    return items


def _names(text: str, entity: str) -> bool:
    """Whether ``text`` names ``entity`` (as written, with or without "the")."""
    return entity.removeprefix("the ").lower() in text.lower()


def match_question(question: str) -> tuple[Relation, str] | None:
    """The relation and first entity (as written) of a bridge question, or ``None``."""
    for relation in RELATIONS:
        pattern = re.escape(relation.question).replace(r"\{subject\}", "(.+)")
        match = re.fullmatch(pattern, question.strip())
        if match:
            return relation, match.group(1)
    return None


def wants_requery(task_id: str) -> bool:
    """Whether the demonstration of ``task_id`` starts with a missing search (stable)."""
    return stable_fraction(f"requery:{task_id}") < REQUERY_FRACTION


def vague_queries(relation: Relation, subject: str) -> list[str]:
    """Searches that leave out what identifies ``subject``, most natural first: the
    question with the entity cut to its shared part (a first name, "the Institute"),
    then :attr:`Relation.blind`."""
    words = subject.split()
    generic = {"person": words[0], "town": "the town"}.get(
        relation.subject_kind, f"the {words[-1]}"
    )
    return [relation.question.format(subject=generic), relation.blind]


def _passage(tool_output: str, name: str) -> str | None:
    """The text of the passage titled ``name`` in a ``search`` result, or ``None``."""
    title = name.removeprefix("the ").lower()
    return next((text for t, _, text in parse_passages(tool_output) if t.lower() == title), None)


def bridge_demonstration(
    question: str, task_id: str, search: Callable[[str], str], *, max_searches: int
) -> list[str] | None:
    """The expert's actions for a bridge question, from what ``search`` returns only.

    Searches the first entity by name, reads the second entity's name from its passage
    (:attr:`Relation.link`), searches that name, reads the answer (:attr:`Relation.fact`)
    and answers. When :func:`wants_requery` picks ``task_id`` (and ``max_searches >= 3``)
    it starts with the first of :func:`vague_queries` that misses both articles, checked
    by running it; if none misses, it makes no extra search. A fact it cannot read gives
    ``<answer>unknown</answer>`` (the replay then drops the demonstration).

    Args:
        question: The task's question.
        task_id: The task's id (picks the re-query tasks).
        search: ``query -> tool output``, exactly what the env's ``search`` returns.
        max_searches: The env's search limit.

    Returns:
        The actions, or ``None`` if ``question`` is no bridge question or
        ``max_searches < 2``.
    """
    matched = match_question(question)
    if matched is None or max_searches < 2:
        return None
    relation, subject = matched
    query = subject.removeprefix("the ")
    first = _passage(search(query), subject)
    link = re.search(relation.link, first) if first else None
    if link is None:
        return [search_action(query), "<answer>unknown</answer>"]
    target = link.group(1)
    second = _passage(search(target), target)
    fact = re.search(relation.fact, second) if second else None
    actions = [search_action(query), search_action(target)]
    if max_searches >= 3 and wants_requery(task_id):
        miss = next(
            (q for q in vague_queries(relation, subject) if _misses(search(q), subject, target)),
            None,
        )
        actions = actions if miss is None else [search_action(miss), *actions]
    return [*actions, f"<answer>{fact.group(1) if fact else 'unknown'}</answer>"]


def _misses(tool_output: str, *names: str) -> bool:
    """Whether a ``search`` result has no passage titled by any of ``names``."""
    return not any(_passage(tool_output, name) for name in names)
