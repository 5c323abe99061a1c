"""The documentation points at things that exist and agrees with the code.

- Every relative link in README.md and docs/ resolves to a file of this repository, and an
  ``#anchor`` to a heading of that file (GitHub's slugs).
- docs/configuration.md's settings table and ``GuardConfig`` agree both ways, and no page names a
  ``guard_*`` key that is neither a setting nor one of celery_guard's message headers.
- No comment, docstring or test cites a document that is not in this repository.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from celery_guard import GuardConfig
from celery_guard.config import CONFIG_PREFIX
from celery_guard.keys import HEADER_KEY, HEADER_KEY_SOURCE
from celery_guard.messages import PUBLISHED_AT_HEADER

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
CONFIGURATION = ROOT / "docs" / "configuration.md"

_FENCE = re.compile(r"^```.*?^```", re.M | re.S)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6} +(.+?) *#*$", re.M)


def _prose(text: str) -> str:
    """The text outside code blocks and code spans, where a link is a link."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation but ``-`` and ``_`` dropped,
    spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text stays
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file, repeated headings numbered as GitHub does."""
    seen: dict[str, int] = {}
    found = set()
    for heading in _HEADING.findall(_FENCE.sub("", path.read_text())):
        slug = github_slug(heading)
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def test_github_slugs_are_computed_as_github_does() -> None:
    assert github_slug("Publish tracking (opt-in): messages lost before any claim") == (
        "publish-tracking-opt-in-messages-lost-before-any-claim"
    )
    assert github_slug("Soak (bench/soak.py)") == "soak-benchsoakpy"
    assert github_slug("Publish tracking (bench/publish_tracking.py)") == (
        "publish-tracking-benchpublish_trackingpy"
    )
    assert github_slug("The `celery guard` commands") == "the-celery-guard-commands"
    assert github_slug("What it guarantees, and what it does not") == (
        "what-it-guarantees-and-what-it-does-not"
    )


@pytest.mark.parametrize("page", DOCS, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in _LINK.findall(_prose(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
            continue
        path_part, _, anchor = target.partition("#")
        resolved = (page.parent / path_part).resolve() if path_part else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif not resolved.is_relative_to(ROOT):
            broken.append(f"{target}: outside the repository")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading #{anchor} in {resolved.relative_to(ROOT)}")
    assert broken == [], f"{page.relative_to(ROOT)} has broken links"


def test_the_configuration_table_and_guard_config_agree_both_ways() -> None:
    """Every ``GuardConfig`` field has a row in docs/configuration.md, and every row a field."""
    settings = {CONFIG_PREFIX + field.name for field in dataclasses.fields(GuardConfig)}
    rows = re.findall(r"^\| `(guard_\w+)` \|", CONFIGURATION.read_text(), re.MULTILINE)
    assert len(rows) == len(set(rows)), "docs/configuration.md has a setting's row twice"
    assert set(rows) - settings == set(), "docs/configuration.md's table names unknown settings"
    assert settings - set(rows) == set(), "settings missing from docs/configuration.md's table"


@pytest.mark.parametrize("page", DOCS, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_guard_key_a_page_names_exists(page: Path) -> None:
    """A ``guard_*`` word is a setting or a header; anything else is a typo or a stale name."""
    known = {CONFIG_PREFIX + field.name for field in dataclasses.fields(GuardConfig)}
    known |= {HEADER_KEY, HEADER_KEY_SOURCE, PUBLISHED_AT_HEADER}
    # Quoted misspellings in the errors a page shows are meant not to exist.
    text = re.sub(r"unknown celery_guard (?:setting|option) '[^']*'", "", page.read_text())
    # ``guard_circuit_*`` names a family of settings, not one.
    named = {name for name in re.findall(r"\bguard_\w+", text) if not name.endswith("_")}
    assert named - known == set(), f"{page.relative_to(ROOT)} names guard_* keys that do not exist"


# Pointers to documents that are not in this repository: the old design notes by name, their
# source material by number, and bare issue numbers with no tracker. Built from pieces so this
# file does not match itself.
_NOWHERE = re.compile(
    "|".join(
        (
            r"(?<!docs/)\bdesign" + r"\.md",  # docs/design.md is this repository's
            r"\bseeds? +0\d\d\b",
            r"(?<![\w/-])issue +#\d+",  # owner/repo#N or a URL names the tracker
        )
    ),
    re.IGNORECASE,
)
_SOURCES = ("celery_guard", "tests", "bench", "example_project", "scripts")


def test_no_comment_or_test_points_to_a_document_outside_the_repository() -> None:
    found = []
    for top in _SOURCES:
        for path in sorted((ROOT / top).rglob("*")):
            if path.suffix not in {".py", ".yml", ".yaml", ".sh", ".lua", ".sql", ".json"}:
                continue
            for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if _NOWHERE.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert found == [], "cite a file of this repository or a public source instead"
