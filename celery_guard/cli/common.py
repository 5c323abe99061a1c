"""What every ``guard`` command shares: the group, errors, ``--json``, tables and times.

Every command prints a table for people by default and JSON with ``--json`` (valid JSON on
stdout and nothing else). A bad argument, an unknown id or a store that does not answer ends
the command with a non-zero exit and a one-line reason on stderr; passwords are never printed.
Times are shown in ISO 8601, UTC, by the database's clock.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, TypeVar
from urllib.parse import urlsplit

import click
import redis
from celery.bin.base import CeleryCommand
from kombu.exceptions import KombuError
from sqlalchemy.exc import SQLAlchemyError

from celery_guard import serialization
from celery_guard.errors import GuardError
from celery_guard.install import GuardRuntime, install
from celery_guard.lease.backends import RedisLeases
from celery_guard.reaper import LEADER_NAME
from celery_guard.store.base import KeyRecord
from celery_guard.store.schema import KeyState

F = TypeVar("F", bound=Callable[..., Any])

#: Key states in the order ``status`` shows them.
STATES = tuple(state.value for state in KeyState)
#: Bounds: the CLI never reads an unbounded number of rows, leases or queue messages.
PAGE = 1000
MAX_KEYS = 10_000
MAX_LEASES = 100_000
MAX_LETTERS = 100_000
MAX_QUEUE_MESSAGES = 100_000
MAX_PRUNE_BATCHES = 1000
#: Width a table cell is cut to (``--json`` always has the full values).
CELL = 48

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$", re.IGNORECASE)
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}

_DELETE_IF_SAME = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


# -- plumbing ---------------------------------------------------------------------------------


class GuardCommand(CeleryCommand):  # type: ignore[misc]  # celery is untyped
    """A Celery command whose expected failures end in one line on stderr and exit 1."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (
            GuardError,
            redis.RedisError,
            KombuError,
            SQLAlchemyError,
            OSError,
        ) as exc:
            raise click.ClickException(_one_line(exc, ctx)) from None


def _one_line(exc: BaseException, ctx: click.Context) -> str:
    text = str(exc).strip()
    line = text.splitlines()[0] if text else type(exc).__name__
    app = getattr(ctx.obj, "app", None)
    for secret in _secrets(app):
        line = line.replace(secret, "***")
    return line


def _secrets(app: Any) -> set[str]:
    """Passwords of the URLs the app is configured with (to scrub them from messages)."""
    if app is None:
        return set()
    found: set[str] = set()
    for name in (
        "guard_store_url",
        "guard_lease_url",
        "broker_url",
        "broker_read_url",
        "broker_write_url",
        "result_backend",
    ):
        value = app.conf.get(name)
        for url in value if isinstance(value, (list, tuple)) else str(value or "").split(";"):
            try:
                password = urlsplit(str(url)).password
            except ValueError:
                continue
            if password and len(password) >= 3:
                found.add(password)
    return found


def _runtime(ctx: click.Context) -> GuardRuntime:
    """celery_guard's runtime for the ``-A`` app (installed here if the app did not)."""
    return install(ctx.obj.app)


def json_option(function: F) -> F:
    """``--json``: machine-readable output on stdout."""
    decorated: F = click.option(
        "--json", "as_json", is_flag=True, help="Print JSON instead of a table."
    )(function)
    return decorated


def _emit_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, default=str))


def _iso(timestamp: float | None) -> str | None:
    """Epoch seconds as ISO 8601 in UTC (``...Z``)."""
    if timestamp is None:
        return None
    moment = datetime.fromtimestamp(timestamp, tz=timezone.utc)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _secs(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _human_secs(value: float | None) -> str:
    if value is None:
        return "-"
    sign = "-" if value < 0 else ""
    value = abs(value)
    if value < 120:
        return f"{sign}{value:.1f}s"
    if value < 7200:
        return f"{sign}{value / 60:.1f}m"
    if value < 172800:
        return f"{sign}{value / 3600:.1f}h"
    return f"{sign}{value / 86400:.1f}d"


def _cut(value: Any, width: int = CELL) -> str:
    text = "-" if value is None else str(value)
    text = text.replace("\n", " ")
    return text if len(text) <= width else text[: width - 3] + "..."


def _table(headers: list[str], rows: Iterable[list[Any]], indent: str = "") -> str:
    """Aligned columns; cells but the last are cut to CELL characters."""
    cells = [
        [_cut(cell) for cell in row[:-1]] + [_cut(row[-1], 10_000)]
        for row in (list(r) for r in rows)
    ]
    widths = [len(header) for header in headers]
    for row in cells:
        for index, cell in enumerate(row):
            widths[index] = max(widths[index], len(cell))
    lines = [
        indent + "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True))
        for line in [headers, *cells]
    ]
    return "\n".join(line.rstrip() for line in lines)


def _fields(pairs: list[tuple[str, Any]]) -> str:
    width = max(len(name) for name, _ in pairs)
    indent = "\n" + " " * (width + 2)  # multi-line values stay in their column
    return "\n".join(
        f"{name.ljust(width)}  {'-' if value is None else str(value).replace(chr(10), indent)}"
        for name, value in pairs
    )


def _parse_json(text: str | None) -> Any:
    if text is None:
        return None
    try:
        return serialization.loads(text)
    except ValueError:
        return text


@dataclass(frozen=True)
class When:
    """A point in time given as an ISO datetime or as a duration before now (``2h``)."""

    absolute: float | None = None
    ago: float | None = None
    text: str = ""

    def resolve(self, now: float) -> float:
        """Epoch seconds; a duration counts back from ``now`` (the database's clock)."""
        if self.absolute is not None:
            return self.absolute
        return now - (self.ago or 0.0)


class WhenType(click.ParamType):  # type: ignore[type-arg]  # generic in click >= 8.2
    """``2024-05-01T12:00:00Z`` (naive means UTC) or ``30s``, ``10m``, ``2h``, ``3d``, ``1w``."""

    name = "WHEN"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> When:
        if isinstance(value, When):
            return value
        text = str(value).strip()
        match = _DURATION.match(text)
        if match:
            return When(ago=float(match.group(1)) * _UNITS[match.group(2).lower()], text=text)
        iso = text[:-1] + "+00:00" if text[-1:] in ("Z", "z") else text
        try:
            moment = datetime.fromisoformat(iso)
        except ValueError:
            self.fail(
                f"{text!r} is neither an ISO datetime nor a duration like 10m, 2h, 3d",
                param,
                ctx,
            )
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=timezone.utc)
        return When(absolute=moment.timestamp(), text=text)


WHEN = WhenType()


# -- the group ----------------------------------------------------------------------------------


@click.group(name="guard")
def guard() -> None:
    """celery_guard: inspect and maintain the idempotency store, leases and dead letters."""


@guard.command(cls=CeleryCommand, name="migrate")
@click.pass_context
def migrate(ctx: Any) -> None:
    """Create celery_guard's tables when missing and upgrade existing ones (idempotent)."""
    app = ctx.obj.app
    runtime = install(app)
    try:
        changed = runtime.migrate()
    except GuardError as exc:
        raise click.ClickException(str(exc)) from None
    for statement in changed:
        click.echo(f"upgraded: {statement}")
    click.echo(f"celery_guard tables are ready in {runtime.config.safe_store_url()}")


# -- shared by status and reconcile -------------------------------------------------------


def _redis_lease_remaining(leases: RedisLeases, key: str) -> float | None:
    """Seconds left on the key's Redis lease; None without one; inf when it never expires."""
    answer: Any = leases.client.pttl(leases.lease_key(key))
    millis = int(answer)
    if millis == -2:
        return None
    return math.inf if millis == -1 else millis / 1000


def _lease_remaining(runtime: GuardRuntime, record: KeyRecord, now: float) -> float | None:
    if record.state != KeyState.RUNNING.value:
        return None
    if isinstance(runtime.leases, RedisLeases):
        return _redis_lease_remaining(runtime.leases, record.key)
    return None if record.lease_expires_at is None else record.lease_expires_at - now


def _running_pages(runtime: GuardRuntime, *, expired_only: bool) -> Iterator[list[KeyRecord]]:
    """RUNNING rows in pages, at most MAX_KEYS in all."""
    after: str | None = None
    seen = 0
    while seen < MAX_KEYS:
        page = runtime.store.keys.running_keys(
            expired_only=expired_only, after=after, limit=min(PAGE, MAX_KEYS - seen)
        )
        if not page:
            return
        yield page
        seen += len(page)
        if len(page) < PAGE:
            return
        after = page[-1].key


def _reaper_info(runtime: GuardRuntime, now: float) -> dict[str, Any] | None:
    leader = runtime.store.recovery.leader(LEADER_NAME)
    if leader is None:
        return None
    holder, term, expires_at = leader
    return {
        "holder": holder,
        "term": term,
        "until": _iso(expires_at),
        "live": expires_at > now,
    }


def _reaper_line(reaper: dict[str, Any] | None) -> str:
    if reaper is None:
        return "never elected (no worker has run the reaper on this store)"
    if reaper["live"]:
        return f"{reaper['holder']} until {reaper['until']} (term {reaper['term']})"
    return (
        f"none live: {reaper['holder']}'s lease ended {reaper['until']} "
        "(start a worker to run the reaper)"
    )
