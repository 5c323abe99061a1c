"""``guard status``, ``guard key show`` and ``guard prune``: the keys table, read and pruned."""

from __future__ import annotations

import json
from typing import Any

import click

from celery_guard.cli.common import (
    MAX_PRUNE_BATCHES,
    PAGE,
    STATES,
    GuardCommand,
    _cut,
    _emit_json,
    _fields,
    _human_secs,
    _iso,
    _lease_remaining,
    _parse_json,
    _reaper_info,
    _reaper_line,
    _running_pages,
    _runtime,
    _secs,
    guard,
    json_option,
)
from celery_guard.lease.backends import RedisLeases
from celery_guard.store.base import KeyRecord
from celery_guard.store.schema import KeyState

# -- status -----------------------------------------------------------------------------------


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


@key_group.command(cls=GuardCommand, name="revive")
@click.argument("key")
@json_option
@click.pass_context
def key_revive(ctx: click.Context, key: str, as_json: bool) -> None:
    """Make a DEAD key claimable again, with fresh attempts, without publishing anything.

    For a key whose dead letter was purged; `dlq replay` does this and re-publishes the task.
    """
    runtime = _runtime(ctx)
    if not runtime.store.revive_key(key):
        raise click.ClickException(f"key {key!r} is not DEAD (or does not exist); nothing done")
    if as_json:
        _emit_json({"key": key, "state": "RELEASED"})
    else:
        click.echo(f"key {key} revived: RELEASED, attempts reset; its next delivery runs it")


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
