"""The documentation agrees with the code.

- docs/configuration.md's settings table and ``GuardConfig`` agree both ways, and no page names a
  ``guard_*`` key that is neither a setting nor one of celery_guard's message headers.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from celery_guard import GuardConfig
from celery_guard.config import CONFIG_PREFIX
from celery_guard.keys import HEADER_KEY, HEADER_KEY_SOURCE
from celery_guard.sampling import PUBLISHED_AT_HEADER

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
CONFIGURATION = ROOT / "docs" / "configuration.md"


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
