"""The documentation's links resolve, and the README stays short.

For README.md, benchmarks/README.md and every docs/**/*.md page: each markdown link
``[text](target)`` (images too) whose target is not an http(s) or mailto address names an
existing file or folder, relative to the page, and an ``#anchor`` (alone or after a page)
is a heading of the target page under GitHub's slug rules. Links inside fenced code
blocks and inline code are not links. No heavy imports: this runs in milliseconds.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
MAX_README_LINES = 300

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.DOTALL)
# [text](target) or [text](<target> "title"); the text may hold one level of brackets
LINK = re.compile(
    r"\[(?:[^\[\]]|\[[^\[\]]*\])*\]"  # [text]
    r"\(\s*(<[^>]*>|[^\s()]*(?:\([^\s()]*\)[^\s()]*)*)"  # (target
    r"(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^)]*\)))?\s*\)"  # "title")
)
EXTERNAL = ("http://", "https://", "mailto:")


def prose_lines(text: str) -> list[str]:
    """The page's lines outside fenced code blocks (fence lines dropped too)."""
    lines, fence = [], None
    for line in text.splitlines():
        match = FENCE.match(line)
        if fence is None and match:
            fence = match.group(1)
        elif fence is not None:
            if match and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence):
                if not line.strip().lstrip(fence[0]):  # a closing fence has no info string
                    fence = None
        else:
            lines.append(line)
    return lines


def slugify(heading: str) -> str:
    """GitHub's anchor for a heading's text (github-slugger on the rendered text)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link renders as its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML tags render as nothing
    text = text.replace("`", "").replace("*", "")  # code and emphasis markers
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)  # keep letters, digits, _, -, spaces
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading anchor of a page; a repeated slug gets -1, -2, ... like GitHub's."""
    occurrences: dict[str, int] = {}
    found = set()
    for line in prose_lines(text):
        match = HEADING.match(line)
        if not match:
            continue
        original = result = slugify(match.group(2))
        while result in occurrences:
            occurrences[original] += 1
            result = f"{original}-{occurrences[original]}"
        occurrences[result] = 0
        found.add(result)
    return found


def links(text: str) -> list[str]:
    """The targets of the page's markdown links, outside code."""
    targets = []
    for paragraph in re.split(r"\n[ \t]*\n", "\n".join(prose_lines(text))):
        prose = INLINE_CODE.sub("code", paragraph)  # a code span never crosses a paragraph
        targets += [m.group(1).strip("<>") for m in LINK.finditer(prose)]
    return targets


def broken_links(page: Path) -> list[str]:
    """``"target: why"`` for each link of ``page`` that does not resolve."""
    broken = []
    for target in links(page.read_text(encoding="utf-8")):
        if target.startswith(EXTERNAL):
            continue
        path_part, _, anchor = target.partition("#")
        path_part = unquote(path_part)
        if not path_part:
            dest = page
        elif path_part.startswith("/"):  # GitHub resolves /x from the repository root
            dest = ROOT / path_part.lstrip("/")
        else:
            dest = (page.parent / path_part).resolve()
        if not dest.exists():
            broken.append(f"{target}: no file {dest}")
            continue
        if not anchor:
            continue
        if dest.suffix != ".md":
            broken.append(f"{target}: an anchor into a file that is not a markdown page")
        elif unquote(anchor) not in anchors(dest.read_text(encoding="utf-8")):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.name}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path):
    broken = broken_links(page)
    assert not broken, f"{page.relative_to(ROOT)}: broken links:\n" + "\n".join(broken)


def test_readme_is_short():
    lines = len(README.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_README_LINES, (
        f"README.md has {lines} lines, expected at most {MAX_README_LINES}: "
        "move details to a page under docs/ and link it"
    )


def test_pages_exist():
    assert README.exists() and len(PAGES) > 1, "expected README.md and pages under docs/"


@pytest.mark.parametrize(
    ("heading", "slug"),
    [
        ("2. Dependencies point one way", "2-dependencies-point-one-way"),
        ("Calculator, gsm_symbolic", "calculator-gsm_symbolic"),
        ("Reproduce: base -> SFT -> GRPO, offline", "reproduce-base---sft---grpo-offline"),
        ("Generation (`agentenv/lm/sampler.py`)", "generation-agentenvlmsamplerpy"),
        ("The sandbox, and what it does *not* protect", "the-sandbox-and-what-it-does-not-protect"),
        ("[agentenv train](cli.md) flags", "agentenv-train-flags"),
    ],
)
def test_slugify_follows_github(heading: str, slug: str):
    assert slugify(heading) == slug


def test_anchors_number_repeats_and_skip_code():
    page = "# Setup\n## Setup\n```bash\n# not a heading\n```\n## Setup\n### Setup-1\n"
    assert anchors(page) == {"setup", "setup-1", "setup-2", "setup-1-1"}


def test_links_skip_code_and_read_titles():
    page = (
        'See [a](a.md#x) and ![img](images/p.png "title").\n'
        "```\n[not](code.md)\n```\n"
        "Inline `[not](either.md)`; [b](<b c.md>) [web](https://x.org/y)\n"
        "\nA stray ` here\n\n[c](c.md) and `[d](d.md)`\n"
    )
    assert links(page) == ["a.md#x", "images/p.png", "b c.md", "https://x.org/y", "c.md"]
