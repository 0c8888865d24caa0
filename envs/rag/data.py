"""The bundled data: a generated fictional encyclopedia and questions about it.

:func:`generate` builds, from a seed and nothing else (no download, same output on
every machine), ``4 * num_per_type`` short articles about invented people, towns,
organisations and artifacts (360 by default), with made-up names and catalogue
numbers no model can know, so answering requires retrieval. Every article is one
:class:`~envs.rag.corpus.Document`; every question a :class:`~envs.rag.qa.QAItem` with
its gold answers (aliases) and gold document.

Question types (``metadata["qtype"]``), mixed so that neither retriever wins alone:

* ``"id"`` -- asks by catalogue number ("... catalogue number KX-4471?"): a rare
  token only lexical match finds reliably.
* ``"name"`` -- asks by an invented name ("In what year was Oriane Thask born?").
* ``"paraphrase"`` -- describes a person's or organisation's specialty in other words
  than the article ("repairing antique sailing vessels" for "restoring old ships"):
  few content words in common, so semantic match is needed.
* ``"mixed"`` -- a rare river name (lexical; shared by several towns) plus a
  paraphrased industry (semantic): fusion can beat both retrievers here.
* ``"bridge"`` (only with ``generate(..., bridge=True)``) -- two hops: the answer is in
  a second article that only a fact of the first names ("In what year was the town
  where Oriane Thask was born founded?"); see :mod:`envs.rag.bridge`. They are built
  from the generated facts alone (no random draws) and appended after the single-hop
  questions, so the documents and every other question are the same with or without.

Questions are split by a stable hash of their gold document
(:func:`~envs.rag.qa.split_of_item`): a test question's article is never the gold
article of a train question, so a policy cannot memorise test facts in training.
Bridge questions keep that rule with an explicit split (see :mod:`envs.rag.bridge`).
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

from envs.rag.bridge import Link, bridge_items
from envs.rag.corpus import Document
from envs.rag.qa import QAItem

SINGLE_HOP_TYPES = ("id", "name", "paraphrase", "mixed")
"""The question types of :func:`generate` without ``bridge=True`` (RAG-v0's default)."""
QUESTION_TYPES = (*SINGLE_HOP_TYPES, "bridge")
"""Every question type of the bundled data."""

ACTIVITIES = [  # (as the article says it, as a paraphrased question says it)
    ("restoring", "repairing"),
    ("cataloguing", "classifying"),
    ("photographing", "taking pictures of"),
    ("studying", "researching"),
    ("collecting", "gathering"),
    ("sketching", "drawing"),
    ("preserving", "conserving"),
    ("measuring", "quantifying"),
    ("protecting", "safeguarding"),
    ("exhibiting", "displaying"),
    ("describing", "writing accounts of"),
    ("surveying", "inspecting"),
]
OBJECTS = [
    ("old ships", "antique sailing vessels"),
    ("mountain glaciers", "alpine ice fields"),
    ("desert beetles", "insects of arid lands"),
    ("medieval manuscripts", "handwritten books from the middle ages"),
    ("clock mechanisms", "the inner workings of timepieces"),
    ("wild orchids", "exotic blossoms"),
    ("coral reefs", "underwater limestone colonies"),
    ("volcanic caves", "lava tubes"),
    ("folk songs", "traditional ballads"),
    ("river fish", "freshwater species"),
    ("ancient coins", "historic money"),
    ("storm clouds", "thunderheads"),
    ("stone bridges", "masonry crossings"),
    ("bird nests", "avian dwellings"),
    ("glass beads", "tiny ornaments of blown silica"),
    ("forest mushrooms", "woodland fungi"),
]
INDUSTRIES = [
    ("glassblowing", "crafting vessels from molten sand"),
    ("salt harvesting", "gathering sea minerals in evaporation ponds"),
    ("wool weaving", "turning sheep fleece into textiles"),
    ("copper mining", "extracting reddish metal ore"),
    ("apple orchards", "growing fruit trees"),
    ("shipbuilding", "constructing boats"),
    ("cheese making", "producing dairy goods"),
    ("timber milling", "sawing logs into lumber"),
    ("pottery", "firing clay ceramics"),
    ("tea growing", "cultivating leaves for brewing"),
    ("silk spinning", "producing fine fabric from cocoons"),
    ("horse breeding", "raising steeds"),
    ("paper making", "manufacturing writing sheets from pulp"),
    ("bell casting", "forging large chimes"),
    ("oyster farming", "raising shellfish"),
    ("wine pressing", "turning grapes into vintages"),
]
PROFESSIONS = {  # article word -> paraphrase
    "cartographer": "mapmaker",
    "botanist": "plant scientist",
    "engineer": "machine designer",
    "historian": "chronicler of the past",
    "naturalist": "student of wildlife",
    "astronomer": "stargazer",
    "archivist": "keeper of records",
    "geologist": "rock expert",
    "linguist": "language scholar",
    "physician": "doctor",
    "architect": "building designer",
    "composer": "songwriter",
}
ORG_KINDS = {
    "Society": "association",
    "Guild": "craft union",
    "Institute": "research body",
    "League": "alliance",
    "Foundation": "endowment",
    "Academy": "learned college",
    "Circle": "club",
    "Collective": "cooperative",
    "Trust": "charity",
}
ITEMS = (
    "Lantern Chalice Astrolabe Codex Compass Mask Tapestry Clock Horn Drum Sextant Mirror".split()
)
MATERIALS = "bronze silver oak ivory jade iron porcelain brass ebony pewter".split()
CONDITIONS = [
    "in excellent condition",
    "slightly damaged by fire",
    "missing one of its original parts",
    "decorated with engraved stars",
    "shown to visitors only on feast days",
]
REGION_KINDS = "Valley Coast Highlands Plain Marches".split()
SEASONS = "spring summer autumn winter".split()

_ONSETS = "b br c d dr f g gr h k l m n p r s t th v z qu sh".split()
_VOWELS = "a e i o u ae ai ou y".split()
_CODAS = ["", "", "n", "r", "l", "s", "th", "x", "nd", "rm", "sk"]


class _Names:
    """Unique invented names (case-insensitively distinct across the whole corpus)."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.used: set[str] = set()

    def make(self, syllables: tuple[int, int] = (2, 3), unique: bool = True) -> str:
        for _ in range(1000):
            n = self.rng.randint(*syllables)
            word = "".join(
                self.rng.choice(_ONSETS) + self.rng.choice(_VOWELS) + self.rng.choice(_CODAS)
                for _ in range(n)
            )
            if 4 <= len(word) <= 12 and (not unique or word not in self.used):
                self.used.add(word)
                return word.capitalize()
        raise RuntimeError("name space exhausted; lower num_per_type")  # pragma: no cover

    def catalogue_id(self) -> str:
        while True:
            letters = "".join(self.rng.choice("ABCDEFGHJKLMNPRSTVWXZ") for _ in range(2))
            cid = f"{letters}-{self.rng.randint(1000, 9999)}"
            if cid not in self.used:
                self.used.add(cid)
                return cid


@dataclass
class _Entity:
    doc_id: str
    name: str  # as written in text ("the Vellmark Institute", "Oriane Thask", "Brevonne")
    short: str  # an alias ("Vellmark", "Thask")


def _aliases(entity: _Entity) -> tuple[str, ...]:
    plain = entity.name.removeprefix("the ")
    return tuple(dict.fromkeys([plain, entity.short]))


def generate(
    num_per_type: int = 90, seed: int = 0, *, bridge: bool = False
) -> tuple[list[Document], list[QAItem]]:
    """The fictional encyclopedia (``4 * num_per_type`` documents) and its questions.

    Args:
        num_per_type: People, towns, organisations and artifacts each (1 to 96: people
            and organisations together need distinct specialties, 12 x 16 = 192 of them).
        seed: Generator seed; the same seed always gives the same corpus and questions.
        bridge: Append the two-hop ``"bridge"`` questions
            (:func:`envs.rag.bridge.bridge_items`) after the single-hop ones, which stay
            exactly as without it.
    """
    max_per_type = len(ACTIVITIES) * len(OBJECTS) // 2
    if not 1 <= num_per_type <= max_per_type:
        raise ValueError(f"num_per_type must be in [1, {max_per_type}], got {num_per_type}")
    rng = random.Random(seed)
    names = _Names(rng)
    n = num_per_type
    rivers = [names.make((2, 2)) for _ in range(12)]
    regions = [f"{names.make()} {rng.choice(REGION_KINDS)}" for _ in range(8)]
    first_names = [names.make((2, 2)) for _ in range(40)]
    towns = [_Entity(f"town-{i:04d}", t, t) for i, t in enumerate(names.make() for _ in range(n))]
    people = []
    for i in range(n):
        first, last = rng.choice(first_names), names.make()
        people.append(_Entity(f"person-{i:04d}", f"{first} {last}", last))
    orgs = []
    for i in range(n):
        core = names.make()
        orgs.append(_Entity(f"org-{i:04d}", f"the {core} {rng.choice(list(ORG_KINDS))}", core))
    artifacts = []
    for i in range(n):
        core = names.make()
        artifacts.append(_Entity(f"artifact-{i:04d}", f"the {core} {rng.choice(ITEMS)}", core))
    # Specialties (activity, object) are unique across people and organisations, and so
    # are (profession, object) among people and (kind, object) among organisations.
    specialties = _specialties(rng, [rng.choice(list(PROFESSIONS)) for _ in range(n)],
                               [o.name.rsplit(" ", 1)[1] for o in orgs])  # fmt: skip
    river_industry = [(r, ind) for r in rivers for ind in INDUSTRIES]
    rng.shuffle(river_industry)

    docs: list[Document] = []
    qa: list[QAItem] = []
    # Facts that name another article, for the bridge questions: (relation, subject,
    # target); and the targets' attributes those questions ask for, by doc id.
    links: list[tuple[str, _Entity, _Entity]] = []
    attributes: dict[str, dict[str, str]] = {}

    def add(entity: _Entity, kind: str, text: str, questions: list[tuple[str, str, tuple]]) -> None:
        docs.append(Document(entity.doc_id, entity.name.removeprefix("the "), text, {"kind": kind}))
        for j, (qtype, question, answers) in enumerate(questions):
            qa.append(
                QAItem(f"{entity.doc_id}-q{j}", question, answers, (entity.doc_id,), None,
                       {"qtype": qtype, "kind": kind})
            )  # fmt: skip

    for i, person in enumerate(people):
        born = rng.randint(1700, 1900)
        profession, (act, act_q), (obj, obj_q) = specialties[i]
        home_town, later_town = rng.choice(towns), rng.choice(towns)
        joined, correspondent = rng.choice(orgs), rng.choice(people)
        home, later, org, friend = home_town.name, later_town.name, joined.name, correspondent.name
        links += [("birthplace", person, home_town), ("settled", person, later_town),
                  ("joined", person, joined), ("correspondent", person, correspondent)]  # fmt: skip
        attributes[person.doc_id] = {"born": str(born), "birthplace": home}
        pron = rng.choice(["she", "he"])
        text = (
            f"{person.name} ({born}-{born + rng.randint(35, 90)}) was a "
            f"{profession} born in {home}. {person.short} is remembered chiefly "
            f"for {act} {obj}. After long travels, {pron} settled in {later} and joined {org}. "
            f"{person.short} published {rng.randint(2, 14)} volumes and kept up a "
            f"correspondence with {friend}."
        )
        add(person, "person", text, [
            ("name", f"In what year was {person.name} born?", (str(born),)),
            ("name", f"In which town was {person.name} born?", (home,)),
            ("paraphrase", f"Which {PROFESSIONS[profession]} devoted a career to {act_q} "
             f"{obj_q}?", _aliases(person)),
        ])  # fmt: skip

    for i, town in enumerate(towns):
        founded = rng.randint(900, 1700)
        river, (industry, industry_q) = river_industry[i]
        attributes[town.doc_id] = {"founded": str(founded)}
        region, inhabitants = rng.choice(regions), rng.randint(8, 400) * 100
        road = rng.choice(towns)  # the draws in the order the text made them before
        links.append(("road", town, road))
        text = (
            f"{town.name} is a town in the {region}, on the banks of the {river} "
            f"River. It was founded in {founded} and today has about "
            f"{inhabitants:,} inhabitants. The local economy depends on "
            f"{industry}. Travellers reach it by the old road from {road.name}."
        )
        add(town, "town", text, [
            ("name", f"In what year was {town.name} founded?", (str(founded),)),
            ("mixed", f"Which town on the {river} River is known for {industry_q}?", (town.name,)),
        ])  # fmt: skip

    for i, org in enumerate(orgs):
        founded = rng.randint(1750, 1950)
        kind_title, (act, act_q), (obj, obj_q) = specialties[n + i]
        founder, hq_town = rng.choice(people), rng.choice(towns)
        kind, hq = kind_title.lower(), hq_town.name
        links += [("founder", org, founder), ("headquarters", org, hq_town)]
        attributes[org.doc_id] = {"founded": str(founded), "headquarters": hq}
        text = (
            f"{org.name[0].upper()}{org.name[1:]} is a {kind} founded in {founded} by "
            f"{founder.name}. Its headquarters are in {hq}. The {kind} is dedicated to {act} "
            f"{obj}, and its members meet every {rng.choice(SEASONS)} to share their work."
        )
        add(org, "organisation", text, [
            ("name", f"Who founded {org.name}?", _aliases(founder)),
            ("name", f"Where does {org.name} have its headquarters?", (hq,)),
            ("paraphrase", f"Which {ORG_KINDS[kind_title]} is committed to {act_q} {obj_q}?",
             _aliases(org)),
        ])  # fmt: skip

    for art in artifacts:
        made, cid = rng.randint(1500, 1900), names.catalogue_id()
        maker, holder = rng.choice(people), rng.choice(orgs)
        item = art.name.rsplit(" ", 1)[1].lower()
        links += [("keeper", art, holder), ("maker", art, maker)]
        text = (
            f"{art.name[0].upper()}{art.name[1:]} (catalogue number {cid}) is a "
            f"{rng.choice(MATERIALS)} {item} made in {made} by {maker.name}. It is now kept "
            f"by {holder.name}. The piece is {rng.choice(CONDITIONS)}."
        )
        add(art, "artifact", text, [
            ("id", f"Which organisation keeps the object with catalogue number {cid}?",
             _aliases(holder)),
            ("id", f"Who made the item catalogued as {cid}?", _aliases(maker)),
            ("name", f"In what year was {art.name} made?", (str(made),)),
        ])  # fmt: skip
    if bridge:
        texts = {d.id: d.text for d in docs}
        qa += bridge_items([_link(*link, attributes) for link in links], texts)
    return docs, qa


def _link(
    relation: str, subject: _Entity, target: _Entity, attributes: dict[str, dict[str, str]]
) -> Link:
    """A recorded fact as a :class:`~envs.rag.bridge.Link` with the target's attributes."""
    return Link(relation, subject.doc_id, subject.name, target.doc_id, _aliases(target),
                attributes[target.doc_id])  # fmt: skip


def _specialties(
    rng: random.Random, professions: list[str], kinds: list[str]
) -> list[tuple[str, tuple[str, str], tuple[str, str]]]:
    """``(role, activity, object)`` for each person then each organisation (see caller)."""
    combos = [(a, o) for a in ACTIVITIES for o in OBJECTS]
    rng.shuffle(combos)
    out = []
    used_roles: set[tuple[str, str]] = set()
    for role in [*professions, *kinds]:
        pick = next(
            (c for c in combos if (role, c[1][0]) not in used_roles),
            combos[0],  # fall back to a repeated (role, object) when none is left
        )
        combos.remove(pick)
        used_roles.add((role, pick[1][0]))
        out.append((role, *pick))
    return out


@functools.lru_cache(maxsize=4)
def bundled(
    num_per_type: int = 90, seed: int = 0, bridge: bool = False
) -> tuple[tuple[Document, ...], tuple[QAItem, ...]]:
    """:func:`generate` (``bridge`` as there), cached per process (as tuples)."""
    docs, qa = generate(num_per_type, seed, bridge=bridge)
    return tuple(docs), tuple(qa)
