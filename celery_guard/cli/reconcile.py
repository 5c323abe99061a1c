"""``guard reconcile``: the pass after an incident (docs/operations.md), report and ``--apply``."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from typing import Any
from urllib.parse import urlsplit

import click
import redis
from kombu.compression import decompress
from kombu.exceptions import KombuError

from celery_guard import redis_queues
from celery_guard.cli.common import (
    _DELETE_IF_SAME,
    MAX_KEYS,
    MAX_LEASES,
    MAX_LETTERS,
    MAX_QUEUE_MESSAGES,
    PAGE,
    GuardCommand,
    _emit_json,
    _human_secs,
    _iso,
    _reaper_info,
    _reaper_line,
    _running_pages,
    _runtime,
    _table,
    guard,
    json_option,
)
from celery_guard.errors import GuardError
from celery_guard.install import GuardRuntime
from celery_guard.lease.backends import RedisLeases
from celery_guard.store.base import DeadLetter, KeyRecord
from celery_guard.store.schema import KeyState

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
        for key, token, live in store.recovery.dead_owner_keys(limit=PAGE)
        if key not in seen and (live or not leases.in_store)
    ]
    rows = store.keys.get_many([key for key, _ in dead])
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
        ended = runtime.store.recovery.expire_lease(item["key"], item["fencing_token"]) or dropped
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
        rows = runtime.store.keys.get_many(list(keyed.values()))
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
    rows = runtime.store.keys.get_many([item["key"] for item in section.items])
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


def _redis_queue(runtime: GuardRuntime, queue_name: str) -> tuple[redis.Redis, list[str]]:
    """A client of the Redis broker and the lists kombu keeps ``queue_name`` in (per priority)."""
    app = runtime.app
    timeout = runtime.config.store_timeout
    client = redis.Redis.from_url(
        _broker_url(app), socket_timeout=timeout, socket_connect_timeout=timeout
    )
    lists = redis_queues.configured_lists(queue_name, app.conf.broker_transport_options or {})
    return client, lists


def _scan_queue(client: redis.Redis, lists: list[str]) -> Iterator[tuple[str, bytes]]:
    """(list, raw message) for up to MAX_QUEUE_MESSAGES messages (nothing is consumed)."""
    return redis_queues.scan(client, lists, limit=MAX_QUEUE_MESSAGES, page=PAGE)


def _read_queue(runtime: GuardRuntime, queue_name: str) -> QueueRead:
    """Every dead letter in the broker's queue, read with LRANGE (nothing is consumed)."""
    client, lists = _redis_queue(runtime, queue_name)
    read = QueueRead()
    try:
        for _, raw in _scan_queue(client, lists):
            read.messages += 1
            letter = _decode_envelope(raw)
            if letter is None:
                read.unreadable += 1
            else:
                read.letters.setdefault(letter["id"], letter)
    finally:
        client.close()
    read.truncated = read.messages >= MAX_QUEUE_MESSAGES
    return read


def remove_queue_letters(runtime: GuardRuntime, queue_name: str, ids: set[int]) -> int | None:
    """Delete the queue copies of the dead letters ``ids`` (Redis broker); how many went.

    ``None`` when the broker is not Redis: other brokers cannot delete a message from the
    middle of a queue without consuming the rest.
    """
    if urlsplit(_broker_url(runtime.app)).scheme not in ("redis", "rediss"):
        return None
    if not ids:
        return 0
    client, lists = _redis_queue(runtime, queue_name)
    try:
        # Read first, then remove by value: LREM never shifts what is still to be read.
        doomed = [
            (name, raw)
            for name, raw in _scan_queue(client, lists)
            if (letter := _decode_envelope(raw)) is not None and letter["id"] in ids
        ]
        removed = 0
        for name, raw in doomed:
            answer: Any = client.lrem(name, 1, raw)  # type: ignore[arg-type]  # bytes work
            removed += int(answer)
        return removed
    finally:
        client.close()


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
    index = runtime.store.dead_letters.dead_letter_index(limit=MAX_LETTERS)
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
                letter = runtime.store.dead_letters.get_dead_letter(item["id"])
                if letter is None:
                    item["result"] = "gone: purged meanwhile"
                    continue
                runtime.dead_letters.publish(letter)
                item["result"] = "published"
            else:
                stored = runtime.store.dead_letters.insert_dead_letter(
                    _letter_from_queue(item["letter"])
                )
                item["result"] = (
                    "inserted" if stored is not None else "kept out: its id is taken meanwhile"
                )
        except (ValueError, GuardError, KombuError, redis.RedisError, OSError) as exc:
            item["result"] = f"failed: {str(exc).strip().splitlines()[0] if str(exc) else exc!r}"


@guard.command(cls=GuardCommand, name="reconcile")
@click.option("--apply", "apply_fixes", is_flag=True, help="Fix what the report finds.")
@click.option(
    "--skip-queue",
    is_flag=True,
    help="Do not compare the dead-letter queue with the table (when another system consumes "
    "the queue, a missing message is not a lost letter).",
)
@json_option
@click.pass_context
def reconcile(ctx: click.Context, apply_fixes: bool, skip_queue: bool, as_json: bool) -> None:
    """Cross-check keys, leases and dead letters after an incident; --apply fixes them.

    Reports (1) RUNNING keys without a live lease (--apply ends a lease that still looks live,
    so the reaper takes the key over), (2) Redis leases without a RUNNING key (--apply deletes
    them), (3) dead letters in the table but not in the broker's queue (--apply publishes them)
    and in the queue but not in the table (--apply records them). The queue is read without
    consuming it, on a Redis broker only; it is assumed to mirror the table, so if something
    consumes it, pass --skip-queue.
    """
    runtime = _runtime(ctx)
    now = runtime.store.now()
    keys_section = _keys_without_lease(runtime, now)
    leases_section = _orphan_leases(runtime)
    queue_section = (
        Section(checked=False, reason="skipped (--skip-queue)")
        if skip_queue
        else _queue_comparison(runtime)
    )
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
