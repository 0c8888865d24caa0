"""Word pools and small helpers shared by the task families."""

from __future__ import annotations

import json
import random
import re
from typing import Any

WORDS = (
    "amber", "anchor", "apple", "arrow", "aspen", "atlas", "autumn", "badge", "basil", "beacon",
    "birch", "blossom", "bridge", "bronze", "cactus", "candle", "canyon", "cedar", "cherry",
    "cinder", "clover", "cobalt", "comet", "copper", "coral", "crystal", "daisy", "delta",
    "dune", "ember", "falcon", "fern", "fjord", "forest", "garnet", "glacier", "granite",
    "harbor", "hazel", "horizon", "indigo", "island", "ivory", "jasper", "juniper", "lagoon",
    "lantern", "lemon", "lilac", "linen", "lotus", "maple", "marble", "meadow", "mint",
    "monsoon", "mosaic", "nectar", "nova", "oasis", "olive", "onyx", "orbit", "orchid",
    "pebble", "pepper", "pine", "planet", "plum", "prairie", "quartz", "quill", "raven",
    "reef", "ridge", "river", "saffron", "sage", "sapphire", "shadow", "sierra", "silver",
    "spruce", "summit", "thistle", "thunder", "tulip", "tundra", "velvet", "violet", "walnut",
    "willow", "zephyr",
)  # fmt: skip
NAMES = (
    "Ada", "Alan", "Alice", "Amara", "Arjun", "Bea", "Boris", "Carla", "Chen", "Dana",
    "Diego", "Elena", "Emeka", "Farah", "Felix", "Grace", "Hana", "Hugo", "Ines", "Ivan",
    "Jonas", "Julia", "Kai", "Kenji", "Lara", "Leo", "Lina", "Malik", "Maya", "Mei", "Nadia",
    "Nina", "Omar", "Oscar", "Priya", "Quinn", "Rafael", "Rosa", "Sam", "Sara", "Tariq",
    "Tess", "Uma", "Victor", "Wen", "Yara", "Yusuf", "Zoe",
)  # fmt: skip


def call(name: str, **arguments: Any) -> dict[str, Any]:
    """A scripted tool call."""
    return {"name": name, "arguments": arguments}


def parse_number(text: str | None) -> float | None:
    """The single number in an answer file (commas and whitespace ignored), or ``None``."""
    if text is None:
        return None
    cleaned = text.strip().replace(",", "")
    if not re.fullmatch(r"-?\d+(\.\d+)?", cleaned):
        return None
    return float(cleaned)


def parse_json(text: str | None) -> Any:
    """``json.loads(text)``, or ``None`` when missing or invalid."""
    if text is None:
        return None
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def phrase(rng: random.Random, n_words: tuple[int, int] = (2, 4)) -> str:
    """A short random phrase, sometimes with a number."""
    words = [rng.choice(WORDS) for _ in range(rng.randint(*n_words))]
    if rng.random() < 0.4:
        words.insert(rng.randrange(len(words) + 1), str(rng.randint(1, 999)))
    if rng.random() < 0.5:
        words[0] = words[0].capitalize()
    return " ".join(words)


def last_json_line(output: str) -> Any:
    """The JSON value on the last non-empty line of ``output``, or ``None``."""
    lines = [line for line in output.strip().splitlines() if line.strip()]
    return parse_json(lines[-1]) if lines else None
