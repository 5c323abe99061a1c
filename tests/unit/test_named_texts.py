"""The hand-written SQL and Lua files: every text the code looks up is there, described, and
installed with the package."""

from __future__ import annotations

import fnmatch
import importlib.resources
from pathlib import Path

import pytest
import tomllib

from celery_guard.lease import backends
from celery_guard.store import dead_letters, keys, queries, recovery

ROOT = Path(__file__).resolve().parents[2]

#: (package, file, the names its code looks up)
FILES = [
    (
        "celery_guard.store.queries",
        "keys.sql",
        {
            "claim",
            "claim_new",
            "new_row",
            "first_token",
            "next_token",
            "external_first_token",
            "external_next_token",
            "lapsed",
            "same_payload",
            "claim_commit",
        },
    ),
    ("celery_guard.store.queries", "dead_letters.sql", {"advance_id_sequence"}),
    ("celery_guard.store.queries", "recovery.sql", {"dead_owners"}),
    ("celery_guard.lease", "scripts.lua", {"acquire", "renew", "release"}),
]


@pytest.mark.parametrize(("package", "resource", "expected"), FILES)
def test_every_named_text_is_present_and_described(
    package: str, resource: str, expected: set[str]
) -> None:
    loaded = queries.load(package, resource)
    assert set(loaded) == expected  # none missing, none left unused
    for name, named in loaded.items():
        assert named.name == name
        assert len(named.description) > 10, name
        assert "-- name:" not in named.text, name
        assert named.text == named.text.strip(), name


def test_the_modules_hold_the_texts_they_run() -> None:
    assert set(keys.SQL) == FILES[0][2]
    assert set(dead_letters.SQL) == FILES[1][2]
    assert set(recovery.SQL) == FILES[2][2]
    assert set(backends.SCRIPTS) == FILES[3][2]
    # The description and notes are for the reader: never sent to the database.
    assert not recovery.SQL["dead_owners"].startswith("--")
    assert recovery.SQL["dead_owners"].startswith("SELECT k.key")


@pytest.mark.parametrize("dialect", ["postgresql", "sqlite"])
@pytest.mark.parametrize("check_fingerprint", [False, True])
@pytest.mark.parametrize("external", [False, True])
@pytest.mark.parametrize("synchronous_commit", ["off", None])
def test_every_claim_variant_is_filled_in_and_short(
    dialect: str, check_fingerprint: bool, external: bool, synchronous_commit: str | None
) -> None:
    sql = keys._claim_statement(dialect, check_fingerprint, external, synchronous_commit).text
    assert "{" not in sql and "}" not in sql  # every placeholder filled
    assert "celery_guard.token_floor" in sql
    assert (":p_external_token" in sql) is external
    # Only PostgreSQL has a commit level to set, and only when one is configured.
    with_level = dialect == "postgresql" and synchronous_commit is not None
    assert ("set_config('synchronous_commit', 'off', true)" in sql) is with_level
    # psycopg parses a query over 4 KB on every execution (keys._claim_statement).
    assert len(sql.encode()) < 4096


def test_the_files_are_installed_as_package_data() -> None:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]
    for package, resource, _ in FILES:
        assert importlib.resources.files(package).joinpath(resource).is_file()
        assert any(fnmatch.fnmatch(resource, glob) for glob in declared.get(package, [])), (
            f"{package}/{resource} is not in [tool.setuptools.package-data]"
        )


def test_a_text_without_a_description_is_refused() -> None:
    with pytest.raises(ValueError, match=r"q\.sql: 'bare' has no '-- description'"):
        queries.parse("-- name: bare\nSELECT 1\n", "q.sql")


def test_a_name_used_twice_is_refused() -> None:
    source = "-- name: a\n-- first\nSELECT 1\n\n-- name: a\n-- second\nSELECT 2\n"
    with pytest.raises(ValueError, match=r"q\.sql: 'a' is named twice"):
        queries.parse(source, "q.sql")


def test_a_name_without_text_is_refused() -> None:
    with pytest.raises(ValueError, match=r"q\.sql: 'empty' has no text"):
        queries.parse("-- name: empty\n-- does nothing\n\n-- name: b\n-- b\nSELECT 1\n", "q.sql")


def test_notes_stay_out_and_comments_inside_a_text_stay_in() -> None:
    source = (
        "-- file header, not a text\n\n"
        "-- name: q\n"
        "-- What q does.\n"
        "-- A note for the reader.\n"
        "SELECT 1\n"
        "  -- why this line\n"
        "  FROM t\n\n\n"
    )
    (named,) = queries.parse(source, "q.sql").values()
    assert named.description == "What q does."
    assert named.text == "SELECT 1\n  -- why this line\n  FROM t"
