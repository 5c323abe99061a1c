"""Hand-written SQL (and the lease scripts' Lua) kept in files of named texts, loaded once.

A file holds any number of texts, each introduced by a ``-- name: NAME`` line and a one-line
``-- description`` right below it; further ``--`` lines right after the description are notes
for the reader and are not part of the text. Everything up to the next ``-- name:`` line is
the text, without its surrounding blank lines. Lines before the first ``-- name:`` describe the
file. The layout is procrastinate's ``sql/queries.sql`` (and aiosql's): the code that runs a
text only looks it up by name. Most statements are SQLAlchemy Core expressions in the table
modules; only what Core cannot say (the claim's one-round-trip upsert, PostgreSQL's
``pg_locks`` and sequence functions) is written by hand, here.
"""

from __future__ import annotations

import importlib.resources
import re
from dataclasses import dataclass

_NAME = re.compile(r"^--\s*name:\s*(?P<name>\S+)\s*$")
_COMMENT = re.compile(r"^--\s?(?P<text>.*)$")


@dataclass(frozen=True)
class NamedText:
    """One named text of a file: a query, a fragment of one, or a Lua script."""

    name: str
    #: What it does, in one line (the comment right below its name).
    description: str
    text: str


def parse(source: str, origin: str) -> dict[str, NamedText]:
    """The named texts of ``source`` by name; ``origin`` names the file in errors.

    A text without a description, an empty text or a name used twice is a ``ValueError``: the
    files ship with the package, so the error is a packaging bug found at import.
    """
    found: dict[str, NamedText] = {}
    name: str | None = None
    lines: list[str] = []

    def finish() -> None:
        if name is None:
            return
        leading = 0
        while leading < len(lines) and _COMMENT.match(lines[leading].strip()):
            leading += 1
        description = _COMMENT.match(lines[0].strip()) if lines else None
        if description is None or not description.group("text").strip():
            raise ValueError(f"{origin}: {name!r} has no '-- description' line below its name")
        text = "\n".join(lines[leading:]).strip()
        if not text:
            raise ValueError(f"{origin}: {name!r} has no text")
        found[name] = NamedText(name, description.group("text").strip(), text)

    for line in source.splitlines():
        match = _NAME.match(line.strip())
        if match is None:
            if name is not None:
                lines.append(line.rstrip())
            continue
        finish()
        name, lines = match.group("name"), []
        if name in found:
            raise ValueError(f"{origin}: {name!r} is named twice")
    finish()
    return found


def load(package: str, resource: str) -> dict[str, NamedText]:
    """The named texts of ``resource``, a file shipped in ``package`` (package data)."""
    source = importlib.resources.files(package).joinpath(resource).read_text(encoding="utf-8")
    return parse(source, f"{package}/{resource}")


def texts(package: str, resource: str) -> dict[str, str]:
    """Name -> text of ``resource``'s named texts (what the modules that run them need)."""
    return {name: named.text for name, named in load(package, resource).items()}
