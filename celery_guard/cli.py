"""``celery -A proj guard ...``: the operator's commands, a Celery sub-command (click).

Every command prints a table for people by default and JSON with ``--json`` (valid JSON on
stdout and nothing else). A bad argument, an unknown id or a store that does not answer ends
the command with a non-zero exit and a one-line reason on stderr; passwords are never printed.
Times are shown in ISO 8601, UTC, by the database's clock.
"""

from __future__ import annotations

import base64
import json
import math
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, fields
from datetime import datetime, timezone
from typing import Any, TypeVar
from urllib.parse import urlsplit

import click
import redis
from celery.bin.base import CeleryCommand
from kombu.compression import decompress
from kombu.exceptions import KombuError
from sqlalchemy.exc import SQLAlchemyError

from celery_guard import serialization
from celery_guard.errors import GuardError
from celery_guard.install import GuardRuntime, install
from celery_guard.lease.backends import RedisLeases
from celery_guard.reaper import LEADER_NAME
from celery_guard.store.base import DeadLetter, KeyRecord
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
#: kombu's Redis transport keeps priority ``p`` of queue ``q`` in the list ``q + SEP + p``.
KOMBU_PRIORITY_SEP = "\x06\x16"
KOMBU_PRIORITY_STEPS = (0, 3, 6, 9)
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
    return "\n".join(
        f"{name.ljust(width)}  {'-' if value is None else value}" for name, value in pairs
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
    """Create celery_guard's tables in the store when they are missing."""
    app = ctx.obj.app
    runtime = install(app)
    try:
        runtime.migrate()
    except GuardError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"celery_guard tables are ready in {runtime.config.safe_store_url()}")


# -- status -----------------------------------------------------------------------------------


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
        page = runtime.store.running_keys(
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
    leader = runtime.store.leader(LEADER_NAME)
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


@guard.command(cls=GuardCommand, name="status")
@json_option
@click.pass_context
def status(ctx: click.Context, as_json: bool) -> None:
    """Keys per state, the oldest RUNNING key, expired leases, the reaper and dead letters."""
    runtime = _runtime(ctx)
    store = runtime.store
    now = store.now()
    counts = store.count_keys_by_state()
    states = {state: counts.get(state, 0) for state in STATES}
    states.update({state: n for state, n in counts.items() if state not in states})
    redis_leases = isinstance(runtime.leases, RedisLeases)
    if redis_leases:
        without_lease = 0
        for page in _running_pages(runtime, expired_only=False):
            held = runtime.leases.held([record.key for record in page])
            without_lease += sum(1 for record in page if record.key not in held)
    else:
        without_lease = store.count_expired_leases()
    oldest = store.oldest_running()
    oldest_info: dict[str, Any] | None = None
    if oldest is not None:
        remaining = _lease_remaining(runtime, oldest, now)
        oldest_info = {
            "key": oldest.key,
            "task": oldest.task_name,
            "owner": oldest.owner,
            "fencing_token": oldest.fencing_token,
            "claimed_at": _iso(oldest.updated_at),
            "age_seconds": _secs(now - oldest.updated_at),
            "lease_remaining_seconds": _secs(remaining),
        }
    total, pending = store.count_dead_letters()
    report: dict[str, Any] = {
        "store": runtime.config.safe_store_url(),
        "lease_backend": "redis" if redis_leases else "sql",
        "now": _iso(now),
        "keys": states,
        "oldest_running": oldest_info,
        "running_without_live_lease": without_lease,
        "reaper": _reaper_info(runtime, now),
        "dead_letters": {"total": total, "not_replayed": pending},
    }
    if as_json:
        _emit_json(report)
        return
    if oldest_info is None:
        oldest_line = "none"
    else:
        remaining = oldest_info["lease_remaining_seconds"]
        lease = (
            "no lease"
            if remaining is None
            else f"lease {_human_secs(remaining)}" + (" (expired)" if remaining <= 0 else " left")
        )
        oldest_line = (
            f"{oldest_info['key']} ({oldest_info['task']}) owner {oldest_info['owner']}, "
            f"age {_human_secs(oldest_info['age_seconds'])}, {lease}"
        )
    lease_kind = "no Redis lease" if redis_leases else "lease expired"
    click.echo(
        _fields(
            [
                ("store", report["store"]),
                ("leases", "Redis" if redis_leases else "store rows"),
                ("now", report["now"]),
                ("keys", "  ".join(f"{state} {n}" for state, n in states.items())),
                ("oldest RUNNING", oldest_line),
                ("RUNNING, no live lease", f"{without_lease} ({lease_kind})"),
                ("reaper", _reaper_line(report["reaper"])),
                ("dead letters", f"{total} total, {pending} not replayed"),
            ]
        )
    )


# -- key show -----------------------------------------------------------------------------------


@guard.group(name="key")
def key_group() -> None:
    """Inspect idempotency keys."""


def _message_summary(message: Any) -> str | None:
    if message is None:
        return None
    if not isinstance(message, dict):
        return _cut(message, 200)
    args = json.dumps(message.get("args"), default=str)
    kwargs = json.dumps(message.get("kwargs"), default=str)
    route = message.get("routing_key") or "-"
    if message.get("exchange"):
        route = f"{message['exchange']}/{route}"
    return (
        f"{message.get('task')}[{message.get('id')}] args={_cut(args, 120)} "
        f"kwargs={_cut(kwargs, 120)} route={route}"
    )


def _retention(record: KeyRecord, now: float) -> tuple[float | None, str]:
    """(retention seconds, a sentence) for a key's stored result."""
    if record.state != KeyState.COMPLETED.value:
        return None, "-"
    if record.expires_at is None:
        return None, "kept until pruned by hand (no retention)"
    retention = record.expires_at - (record.completed_at or record.expires_at)
    if record.expires_at <= now:
        return retention, f"expired at {_iso(record.expires_at)} (pruned at the next pass)"
    return retention, f"{_human_secs(retention)}, until {_iso(record.expires_at)}"


@key_group.command(cls=GuardCommand, name="show")
@click.argument("key")
@json_option
@click.pass_context
def key_show(ctx: click.Context, key: str, as_json: bool) -> None:
    """Show one idempotency key's row: state, owner, lease, token, times and stored message."""
    runtime = _runtime(ctx)
    record = runtime.store.get(key)
    if record is None:
        raise click.ClickException(f"no idempotency key {key!r} in the store")
    now = runtime.store.now()
    remaining = _lease_remaining(runtime, record, now)
    retention, retention_text = _retention(record, now)
    message = _parse_json(record.message)
    data = {
        "key": record.key,
        "state": record.state,
        "task": record.task_name,
        "attempts": record.attempts,
        "fencing_token": record.fencing_token,
        "owner": record.owner,
        "owner_lock": record.owner_lock,
        "lease_expires_at": _iso(record.lease_expires_at),
        "lease_remaining_seconds": _secs(remaining),
        "claim_reason": record.claim_reason,
        "last_error": record.last_error,
        "duplicates": record.duplicates,
        "fingerprint": record.fingerprint,
        "created_at": _iso(record.created_at),
        "updated_at": _iso(record.updated_at),
        "completed_at": _iso(record.completed_at),
        "expires_at": _iso(record.expires_at),
        "retention_seconds": _secs(retention),
        "republished_at": _iso(record.republished_at),
        "result": _parse_json(record.result),
        "message": message,
    }
    if as_json:
        _emit_json(data)
        return
    if remaining is None:
        lease = "-"
    elif remaining <= 0:
        lease = f"expired {_human_secs(-remaining)} ago"
    else:
        lease = f"{_human_secs(remaining)} left"
    click.echo(
        _fields(
            [
                ("key", record.key),
                ("state", record.state),
                ("task", record.task_name),
                ("attempts", record.attempts),
                ("fencing token", record.fencing_token),
                ("owner", record.owner),
                ("lease", lease),
                ("claim reason", record.claim_reason),
                ("last error", record.last_error),
                ("duplicates", record.duplicates),
                ("created", _iso(record.created_at)),
                ("updated", _iso(record.updated_at)),
                ("completed", _iso(record.completed_at)),
                ("retention", retention_text),
                ("re-published", _iso(record.republished_at)),
                ("result", _cut(record.result, 200) if record.result is not None else None),
                ("message", _message_summary(message)),
            ]
        )
    )


# -- dead letters -------------------------------------------------------------------------------


@guard.group(name="dlq")
def dlq() -> None:
    """List, show, replay and purge dead letters."""


def _letter_row(letter: DeadLetter, *, full: bool) -> dict[str, Any]:
    data: dict[str, Any] = {
        "id": letter.id,
        "created_at": _iso(letter.created_at),
        "task": letter.task_name,
        "key": letter.key,
        "task_id": letter.task_id,
        "error_class": letter.error_class,
        "error_type": letter.error_type,
        "error": letter.error,
        "reason": letter.reason,
        "attempts": letter.attempts,
        "replayed": letter.replayed_at is not None,
        "replayed_at": _iso(letter.replayed_at),
    }
    if full:
        data["traceback"] = letter.traceback
        data["message"] = _parse_json(letter.message)
    return data


@dlq.command(cls=GuardCommand, name="list")
@click.option("--task", "task_name", metavar="NAME", help="Only this task's dead letters.")
@click.option(
    "--since", type=WHEN, help="Created at or after WHEN: an ISO datetime or 10m, 2h, 3d."
)
@click.option(
    "--limit",
    type=click.IntRange(1, 10_000),
    default=50,
    show_default=True,
    help="At most this many, newest first.",
)
@json_option
@click.pass_context
def dlq_list(
    ctx: click.Context, task_name: str | None, since: When | None, limit: int, as_json: bool
) -> None:
    """List dead letters, newest first."""
    runtime = _runtime(ctx)
    since_at = since.resolve(runtime.store.now()) if since is not None else None
    letters = runtime.store.list_dead_letters(task_name=task_name, since=since_at, limit=limit)
    if as_json:
        _emit_json([_letter_row(letter, full=False) for letter in letters])
        return
    if not letters:
        click.echo("no dead letters")
        return
    click.echo(
        _table(
            ["ID", "CREATED", "TASK", "KEY", "CLASS", "TYPE", "ATTEMPTS", "REPLAYED"],
            (
                [
                    letter.id,
                    _iso(letter.created_at),
                    letter.task_name,
                    letter.key,
                    letter.error_class,
                    letter.error_type,
                    letter.attempts,
                    _iso(letter.replayed_at) if letter.replayed_at is not None else "no",
                ]
                for letter in letters
            ),
        )
    )


@dlq.command(cls=GuardCommand, name="show")
@click.argument("letter_id", metavar="ID", type=int)
@json_option
@click.pass_context
def dlq_show(ctx: click.Context, letter_id: int, as_json: bool) -> None:
    """Show one dead letter in full: error, reason, traceback and the stored message."""
    runtime = _runtime(ctx)
    letter = runtime.store.get_dead_letter(letter_id)
    if letter is None:
        raise click.ClickException(f"unknown dead letter id {letter_id}")
    data = _letter_row(letter, full=True)
    if as_json:
        _emit_json(data)
        return
    click.echo(
        _fields(
            [
                ("id", letter.id),
                ("created", data["created_at"]),
                ("task", letter.task_name),
                ("task id", letter.task_id),
                ("key", letter.key),
                ("class", letter.error_class),
                ("type", letter.error_type),
                ("error", letter.error),
                ("reason", letter.reason),
                ("attempts", letter.attempts),
                ("replayed", data["replayed_at"] or "no"),
            ]
        )
    )
    click.echo("\ntraceback:")
    click.echo((letter.traceback or "-").rstrip())
    click.echo("\nmessage:")
    message = data["message"]
    click.echo(json.dumps(message, indent=2, default=str) if message is not None else "-")


@dlq.command(cls=GuardCommand, name="replay")
@click.argument("letter_id", metavar="[ID]", type=int, required=False)
@click.option("--task", "task_name", metavar="NAME", help="With --all: the task to replay.")
@click.option(
    "--all", "replay_all", is_flag=True, help="Replay every not-yet-replayed letter of --task."
)
@json_option
@click.pass_context
def dlq_replay(
    ctx: click.Context,
    letter_id: int | None,
    task_name: str | None,
    replay_all: bool,
    as_json: bool,
) -> None:
    """Revive dead letters and publish their messages again (replaying twice runs once).

    Give one ID, or --task NAME --all. Fix the cause first: a replayed task that fails the
    same way is dead-lettered again.
    """
    if letter_id is not None and replay_all:
        raise click.UsageError("give either a dead letter ID or --all, not both", ctx)
    if letter_id is None and not replay_all:
        raise click.UsageError("give a dead letter ID, or --task NAME --all", ctx)
    if replay_all and not task_name:
        raise click.UsageError("--all needs --task NAME", ctx)
    if letter_id is not None and task_name:
        raise click.UsageError("--task only selects letters for --all", ctx)
    runtime = _runtime(ctx)
    if letter_id is not None:
        _replay_one(runtime, letter_id, as_json)
    else:
        assert task_name is not None
        _replay_all(runtime, task_name, as_json)


def _replay_one(runtime: GuardRuntime, letter_id: int, as_json: bool) -> None:
    try:
        outcome, letter = runtime.dead_letters.replay(letter_id)
    except (KombuError, redis.RedisError, OSError) as exc:
        # replay() revives the letter (marks it replayed) before it publishes.
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise click.ClickException(
            f"dead letter {letter_id} was marked replayed but its message was not published "
            f"({reason}); its key is RELEASED and a later replay answers 'already replayed'"
        ) from None
    if outcome == "unknown" or letter is None:
        raise click.ClickException(f"unknown dead letter id {letter_id}")
    if as_json:
        _emit_json(
            {
                "id": letter_id,
                "outcome": outcome,
                "task": letter.task_name,
                "key": letter.key,
                "replayed_at": _iso(letter.replayed_at),
            }
        )
    elif outcome == "replayed":
        click.echo(
            f"replayed dead letter {letter_id}: {letter.task_name} key {letter.key} published again"
        )
    else:
        click.echo(
            f"dead letter {letter_id} already replayed at {_iso(letter.replayed_at)}; nothing sent"
        )


def _replay_all(runtime: GuardRuntime, task_name: str, as_json: bool) -> None:
    # Take the ids first: a replay that fails again adds new letters, never replayed here.
    ids: list[int] = []
    while len(ids) < MAX_LETTERS:
        page = runtime.store.pending_dead_letter_ids(
            task_name, after_id=ids[-1] if ids else 0, limit=PAGE
        )
        ids.extend(page)
        if len(page) < PAGE:
            break
    done: dict[str, list[Any]] = {"replayed": [], "already": [], "unknown": [], "failed": []}
    for letter_id in ids:
        try:
            outcome, _ = runtime.dead_letters.replay(letter_id)
        except (GuardError, KombuError, redis.RedisError, OSError) as exc:
            done["failed"].append({"id": letter_id, "error": str(exc).strip().splitlines()[0]})
            continue
        done[outcome].append(letter_id)
    if as_json:
        _emit_json({"task": task_name, **done})
    else:
        click.echo(
            f"{task_name}: replayed {len(done['replayed'])}, already replayed "
            f"{len(done['already']) + len(done['unknown'])}, failed {len(done['failed'])}"
        )
        for failure in done["failed"]:
            click.echo(f"  dead letter {failure['id']} not replayed: {failure['error']}")
    if done["failed"]:
        raise click.ClickException(
            f"{len(done['failed'])} dead letter(s) of {task_name} could not be replayed"
        )


@dlq.command(cls=GuardCommand, name="purge")
@click.option("--before", type=WHEN, help="Only letters created before WHEN (ISO, or 7d ago).")
@click.option("--yes", is_flag=True, help="Confirm deleting every dead letter (no --before).")
@json_option
@click.pass_context
def dlq_purge(ctx: click.Context, before: When | None, yes: bool, as_json: bool) -> None:
    """Delete dead letters from the store's table (the broker's queue is not touched).

    Never asks: deleting all of them needs --yes.
    """
    if before is None and not yes:
        raise click.ClickException(
            "refusing to delete every dead letter without --yes "
            "(or give --before WHEN to delete older ones)"
        )
    runtime = _runtime(ctx)
    cutoff = before.resolve(runtime.store.now()) if before is not None else None
    deleted = runtime.store.purge_dead_letters(before=cutoff)
    if as_json:
        _emit_json({"deleted": deleted, "before": _iso(cutoff)})
    elif cutoff is None:
        click.echo(f"deleted {deleted} dead letter(s)")
    else:
        click.echo(f"deleted {deleted} dead letter(s) created before {_iso(cutoff)}")


# -- prune ----------------------------------------------------------------------------------------


@guard.command(cls=GuardCommand, name="prune")
@json_option
@click.pass_context
def prune(ctx: click.Context, as_json: bool) -> None:
    """Delete COMPLETED keys whose retention has ended (the reaper also does it every pass)."""
    runtime = _runtime(ctx)
    pruned = 0
    complete = False
    for _ in range(MAX_PRUNE_BATCHES):
        batch = runtime.store.prune_completed(limit=PAGE)
        pruned += batch
        if batch < PAGE:
            complete = True
            break
    if as_json:
        _emit_json({"pruned": pruned, "complete": complete})
        return
    click.echo(f"pruned {pruned} COMPLETED key(s) past their retention")
    if not complete:
        click.echo(f"stopped after {MAX_PRUNE_BATCHES} batches of {PAGE}; run it again")


# -- reconcile ------------------------------------------------------------------------------------


@dataclass
class Section:
    """One part of the reconcile report."""

    checked: bool = True
    reason: str | None = None
    truncated: bool = False
    items: list[dict[str, Any]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "checked": self.checked,
            "reason": self.reason,
            "count": len(self.items),
            "truncated": self.truncated,
            **self.extra,
            "items": self.items,
        }


def _orphan_action(record: KeyRecord, needs_apply: bool) -> str:
    if needs_apply:
        return "end its lease (--apply) so the reaper takes it over"
    if record.message is None:
        return "no stored message (arguments not JSON): waits for the broker to redeliver it"
    if record.republished_at is not None:
        return (
            f"re-published by the reaper at {_iso(record.republished_at)}; "
            "waits for a worker to claim it"
        )
    return "orphan: the reaper re-publishes its message at its next pass"


def _key_item(record: KeyRecord, now: float, why: str, needs_apply: bool) -> dict[str, Any]:
    """One RUNNING key without a live lease; ``needs_apply``: a lease still looks live."""
    return {
        "key": record.key,
        "task": record.task_name,
        "owner": record.owner,
        "fencing_token": record.fencing_token,
        "claimed_at": _iso(record.updated_at),
        "row_lease_expires_at": _iso(record.lease_expires_at),
        "row_lease_live": record.lease_expires_at is not None and record.lease_expires_at > now,
        "needs_apply": needs_apply,
        "why": why,
        "action": _orphan_action(record, needs_apply),
    }


def _keys_without_lease(runtime: GuardRuntime, now: float) -> Section:
    """(1) RUNNING keys with no live lease."""
    section = Section()
    store = runtime.store
    seen: set[str] = set()
    leases = runtime.leases
    if isinstance(leases, RedisLeases):
        for page in _running_pages(runtime, expired_only=False):
            held = leases.held([record.key for record in page])
            for record in page:
                if record.key in held:
                    continue
                live_row = record.lease_expires_at is not None and record.lease_expires_at > now
                section.items.append(_key_item(record, now, "no Redis lease", live_row))
                seen.add(record.key)
            section.truncated = section.truncated or len(seen) >= MAX_KEYS
    else:
        for page in _running_pages(runtime, expired_only=True):
            for record in page:
                section.items.append(_key_item(record, now, "lease expired", False))
                seen.add(record.key)
        section.truncated = len(seen) >= MAX_KEYS
    # PostgreSQL liveness locks: an owner process that died leaves a lease that looks live
    # (in its row, or in Redis until the Redis lease runs out).
    dead = [
        (key, token)
        for key, token, live in store.dead_owner_keys(limit=PAGE)
        if key not in seen and (live or not leases.in_store)
    ]
    rows = store.get_many([key for key, _ in dead])
    for key, token in dead:
        row = rows.get(key)
        if row is not None and row.fencing_token == token:
            section.items.append(_key_item(row, now, "owner process is dead", True))
    return section


def _apply_keys(runtime: GuardRuntime, section: Section) -> None:
    for item in section.items:
        if not item["needs_apply"]:
            item["result"] = "left to the reaper"
            continue
        dropped = False
        if item["why"] == "owner process is dead" and not runtime.leases.in_store:
            # As the reaper does: drop the dead owner's Redis lease too (token-checked).
            dropped = runtime.leases.release(item["key"], item["fencing_token"])
        ended = runtime.store.expire_lease(item["key"], item["fencing_token"]) or dropped
        item["result"] = (
            "lease ended: the reaper re-publishes its message at its next pass"
            if ended
            else "unchanged: the key was claimed, finished or its lease ran out meanwhile"
        )


def _lease_name_to_key(leases: RedisLeases, name: str) -> str | None:
    head, tail = f"{leases.prefix}:{{", "}:lease"
    if name.startswith(head) and name.endswith(tail) and len(name) > len(head) + len(tail):
        return name[len(head) : -len(tail)]
    return None


def _orphan_leases(runtime: GuardRuntime) -> Section:
    """(2) Redis leases whose key has no RUNNING row."""
    leases = runtime.leases
    if not isinstance(leases, RedisLeases):
        return Section(checked=False, reason="no Redis leases: leases live in the store's rows")
    section = Section()
    client = leases.client
    names: list[str] = []
    pattern = f"{leases.prefix}:{{*}}:lease"
    for scanned, raw in enumerate(client.scan_iter(match=pattern, count=PAGE), start=1):
        name = raw.decode() if isinstance(raw, bytes) else str(raw)
        if _lease_name_to_key(leases, name) is not None:
            names.append(name)
        if scanned >= MAX_LEASES:
            section.truncated = True
            break
    section.extra["leases_scanned"] = len(names)
    for start in range(0, len(names), PAGE):
        batch = names[start : start + PAGE]
        pipeline = client.pipeline(transaction=False)
        for name in batch:
            pipeline.get(name)
            pipeline.pttl(name)
        answers = pipeline.execute()
        keyed = {name: _lease_name_to_key(leases, name) or "" for name in batch}
        rows = runtime.store.get_many(list(keyed.values()))
        for index, name in enumerate(batch):
            value, pttl = answers[2 * index], int(answers[2 * index + 1])
            if value is None:  # expired since the scan
                continue
            record = rows.get(keyed[name])
            if record is not None and record.state == KeyState.RUNNING.value:
                continue
            section.items.append(
                {
                    "key": keyed[name],
                    "lease": name,
                    "lease_token": value.decode() if isinstance(value, bytes) else str(value),
                    "lease_remaining_seconds": None if pttl < 0 else pttl / 1000,
                    "row_state": None if record is None else record.state,
                    "row_fencing_token": None if record is None else record.fencing_token,
                    "action": "delete the lease (--apply)"
                    + ("; it never expires by itself" if pttl == -1 else ""),
                }
            )
    return section


def _apply_leases(runtime: GuardRuntime, section: Section) -> None:
    leases = runtime.leases
    if not section.items or not isinstance(leases, RedisLeases):
        return
    # A second look at the rows: a claim that took its lease just before the scan has written
    # its RUNNING row by now and keeps its lease.
    rows = runtime.store.get_many([item["key"] for item in section.items])
    for item in section.items:
        record = rows.get(item["key"])
        if record is not None and record.state == KeyState.RUNNING.value:
            item["result"] = "kept: the key is RUNNING now"
            continue
        answer: Any = leases.client.eval(_DELETE_IF_SAME, 1, item["lease"], item["lease_token"])
        item["result"] = (
            "deleted" if int(answer) == 1 else "kept: the lease changed or expired meanwhile"
        )


@dataclass
class QueueRead:
    """What reading the dead-letter queue found."""

    letters: dict[int, dict[str, Any]] = field(default_factory=dict)
    messages: int = 0
    unreadable: int = 0
    truncated: bool = False


def _broker_url(app: Any) -> str:
    url = app.conf.broker_read_url or app.conf.broker_url or "amqp://"
    if isinstance(url, (list, tuple)):
        url = url[0]
    return str(url).split(";")[0].strip()


def _decode_envelope(raw: bytes) -> dict[str, Any] | None:
    """The dead letter in one kombu Redis envelope, or None when it is not one."""
    try:
        envelope = json.loads(raw)
        body: Any = envelope["body"]
        properties = envelope.get("properties") or {}
        headers = envelope.get("headers") or {}
        if properties.get("body_encoding") == "base64":
            body = base64.b64decode(body)
        if headers.get("compression"):
            body = decompress(  # type: ignore[no-untyped-call]
                body if isinstance(body, bytes) else body.encode(), headers["compression"]
            )
        if isinstance(body, bytes):
            body = body.decode(envelope.get("content-encoding") or "utf-8")
        letter = json.loads(body) if isinstance(body, str) else body
        if not isinstance(letter, dict):
            return None
        letter_id = headers.get("guard_dead_letter_id", letter.get("id"))
        if letter_id is None:
            return None
        letter["id"] = int(letter_id)
        return letter
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
        return None


def _read_queue(runtime: GuardRuntime, queue_name: str) -> QueueRead:
    """Every dead letter in the broker's queue, read with LRANGE (nothing is consumed)."""
    app = runtime.app
    url = _broker_url(app)
    transport_options = app.conf.broker_transport_options or {}
    prefix = str(transport_options.get("global_keyprefix") or "")
    steps = transport_options.get("priority_steps") or KOMBU_PRIORITY_STEPS
    timeout = runtime.config.store_timeout
    client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
    read = QueueRead()
    try:
        lists = [prefix + queue_name] + [
            f"{prefix}{queue_name}{KOMBU_PRIORITY_SEP}{step}" for step in steps if step
        ]
        for name in lists:
            start = 0
            while True:
                if read.messages >= MAX_QUEUE_MESSAGES:
                    read.truncated = True
                    return read
                answer: Any = client.lrange(name, start, start + PAGE - 1)
                chunk: list[bytes] = list(answer)
                for raw in chunk:
                    read.messages += 1
                    letter = _decode_envelope(raw)
                    if letter is None:
                        read.unreadable += 1
                    else:
                        read.letters.setdefault(letter["id"], letter)
                if len(chunk) < PAGE:
                    break
                start += PAGE
    finally:
        client.close()
    return read


def _queue_comparison(runtime: GuardRuntime) -> Section:
    """(3) Dead letters in the queue but not in the table, and the other way round."""
    queue_name = runtime.dead_letters.queue.name
    url = _broker_url(runtime.app)
    scheme = urlsplit(url).scheme
    if scheme not in ("redis", "rediss"):
        return Section(
            checked=False,
            reason=f"queue comparison needs a Redis broker; this one is {scheme or '?'}://",
            extra={"queue": queue_name},
        )
    read = _read_queue(runtime, queue_name)
    index = runtime.store.dead_letter_index(limit=MAX_LETTERS)
    in_table = {letter_id: (key, task, created) for letter_id, key, task, created in index}
    # With more letters than we read, an older queue letter may be in the table unread.
    floor = min(in_table) if len(index) >= MAX_LETTERS else 0
    section = Section(
        truncated=read.truncated or len(index) >= MAX_LETTERS,
        extra={
            "queue": queue_name,
            "queue_messages": read.messages,
            "unreadable_messages": read.unreadable,
            "table_letters": len(index),
        },
    )
    for letter_id in sorted(set(in_table) - set(read.letters)):
        key, task, created = in_table[letter_id]
        section.items.append(
            {
                "where": "table_only",
                "id": letter_id,
                "key": key,
                "task": task,
                "created_at": _iso(created),
                "action": "publish it to the queue (--apply)",
            }
        )
    for letter_id in sorted(set(read.letters) - set(in_table)):
        if letter_id < floor:
            continue
        letter = read.letters[letter_id]
        section.items.append(
            {
                "where": "queue_only",
                "id": letter_id,
                "key": letter.get("key"),
                "task": letter.get("task_name"),
                "created_at": _iso(letter.get("created_at")),
                "action": "insert it into the table (--apply)",
                "letter": letter,
            }
        )
    return section


def _letter_from_queue(body: dict[str, Any]) -> DeadLetter:
    values: dict[str, Any] = {f.name: body.get(f.name) for f in fields(DeadLetter)}
    missing = [
        name
        for name in ("key", "task_name", "error_class", "error_type", "error", "reason")
        if not isinstance(values[name], str)
    ]
    if missing or not isinstance(values["attempts"], int):
        raise ValueError(f"queue message lacks {', '.join(missing) or 'attempts'}")
    return DeadLetter(**values)


def _apply_queue(runtime: GuardRuntime, section: Section) -> None:
    for item in section.items:
        try:
            if item["where"] == "table_only":
                letter = runtime.store.get_dead_letter(item["id"])
                if letter is None:
                    item["result"] = "gone: purged meanwhile"
                    continue
                runtime.dead_letters.publish(letter)
                item["result"] = "published"
            else:
                stored = runtime.store.insert_dead_letter(_letter_from_queue(item["letter"]))
                item["result"] = (
                    "inserted" if stored is not None else "kept out: its id is taken meanwhile"
                )
        except (ValueError, GuardError, KombuError, redis.RedisError, OSError) as exc:
            item["result"] = f"failed: {str(exc).strip().splitlines()[0] if str(exc) else exc!r}"


@guard.command(cls=GuardCommand, name="reconcile")
@click.option("--apply", "apply_fixes", is_flag=True, help="Fix what the report finds.")
@json_option
@click.pass_context
def reconcile(ctx: click.Context, apply_fixes: bool, as_json: bool) -> None:
    """Cross-check keys, leases and dead letters after an incident; --apply fixes them.

    Reports (1) RUNNING keys without a live lease (--apply ends a lease that still looks live,
    so the reaper takes the key over), (2) Redis leases without a RUNNING key (--apply deletes
    them), (3) dead letters in the table but not in the broker's queue (--apply publishes them)
    and in the queue but not in the table (--apply records them). The queue is read without
    consuming it, on a Redis broker only.
    """
    runtime = _runtime(ctx)
    now = runtime.store.now()
    keys_section = _keys_without_lease(runtime, now)
    leases_section = _orphan_leases(runtime)
    queue_section = _queue_comparison(runtime)
    reaper = _reaper_info(runtime, now)
    if apply_fixes:
        _apply_keys(runtime, keys_section)
        _apply_leases(runtime, leases_section)
        _apply_queue(runtime, queue_section)
    if as_json:
        queue_data = queue_section.as_dict()
        queue_data["table_only"] = [i for i in queue_section.items if i["where"] == "table_only"]
        queue_data["queue_only"] = [i for i in queue_section.items if i["where"] == "queue_only"]
        del queue_data["items"]
        _emit_json(
            {
                "applied": apply_fixes,
                "running_without_live_lease": keys_section.as_dict(),
                "leases_without_running_key": leases_section.as_dict(),
                "dead_letter_queue": queue_data,
                "reaper": reaper,
            }
        )
        return
    _print_reconcile(keys_section, leases_section, queue_section, reaper, apply_fixes)


def _what(item: dict[str, Any], apply_fixes: bool) -> str:
    return str(item.get("result", "-")) if apply_fixes else str(item["action"])


def _print_reconcile(
    keys_section: Section,
    leases_section: Section,
    queue_section: Section,
    reaper: dict[str, Any] | None,
    apply_fixes: bool,
) -> None:
    done = "DONE" if apply_fixes else "ACTION"
    more = " (more not read)"
    click.echo(
        f"RUNNING keys without a live lease: {len(keys_section.items)}"
        + (more if keys_section.truncated else "")
    )
    if keys_section.items:
        click.echo(
            _table(
                ["KEY", "TASK", "OWNER", "TOKEN", "WHY", done],
                (
                    [
                        i["key"],
                        i["task"],
                        i["owner"],
                        i["fencing_token"],
                        i["why"],
                        _what(i, apply_fixes),
                    ]
                    for i in keys_section.items
                ),
                indent="  ",
            )
        )
    if not leases_section.checked:
        click.echo(f"Leases without a RUNNING key: not checked ({leases_section.reason})")
    else:
        click.echo(
            f"Leases without a RUNNING key: {len(leases_section.items)} of "
            f"{leases_section.extra['leases_scanned']} Redis leases"
            + (more if leases_section.truncated else "")
        )
        if leases_section.items:
            click.echo(
                _table(
                    ["KEY", "TOKEN", "REMAINING", "ROW", done],
                    (
                        [
                            i["key"],
                            i["lease_token"],
                            _human_secs(i["lease_remaining_seconds"]),
                            i["row_state"] or "no row",
                            _what(i, apply_fixes),
                        ]
                        for i in leases_section.items
                    ),
                    indent="  ",
                )
            )
    queue_name = queue_section.extra["queue"]
    if not queue_section.checked:
        click.echo(
            f"Dead letters, table vs queue {queue_name}: not compared ({queue_section.reason})"
        )
    else:
        extra = queue_section.extra
        click.echo(
            f"Dead letters, table vs queue {queue_name}: {extra['table_letters']} in the table, "
            f"{extra['queue_messages']} queued message(s)"
            + (
                f", {extra['unreadable_messages']} unreadable"
                if extra["unreadable_messages"]
                else ""
            )
            + (more if queue_section.truncated else "")
        )
        for where, title in (
            ("table_only", "in the table, not in the queue"),
            ("queue_only", "in the queue, not in the table"),
        ):
            items = [i for i in queue_section.items if i["where"] == where]
            click.echo(f"  {title}: {len(items)}")
            if items:
                click.echo(
                    _table(
                        ["ID", "CREATED", "TASK", "KEY", done],
                        (
                            [i["id"], i["created_at"], i["task"], i["key"], _what(i, apply_fixes)]
                            for i in items
                        ),
                        indent="    ",
                    )
                )
    click.echo(f"Reaper: {_reaper_line(reaper)}")
