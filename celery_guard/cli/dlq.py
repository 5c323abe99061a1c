"""``guard dlq ...``: list, show, replay and purge dead letters."""

from __future__ import annotations

import json
from typing import Any

import click
import redis
from kombu.exceptions import KombuError

from celery_guard.cli.common import (
    MAX_LETTERS,
    PAGE,
    WHEN,
    GuardCommand,
    When,
    _emit_json,
    _fields,
    _iso,
    _parse_json,
    _runtime,
    _table,
    guard,
    json_option,
)
from celery_guard.cli.reconcile import remove_queue_letters
from celery_guard.errors import GuardError
from celery_guard.install import GuardRuntime
from celery_guard.store.base import DeadLetter

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
    letters = runtime.store.dead_letters.list_dead_letters(
        task_name=task_name, since=since_at, limit=limit
    )
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
    letter = runtime.store.dead_letters.get_dead_letter(letter_id)
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
        page = runtime.store.dead_letters.pending_dead_letter_ids(
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
    """Delete dead letters from the store's table and their copies in the broker's queue.

    Queue copies are removed on a Redis broker (so `guard reconcile --apply` does not bring
    them back); other brokers keep them, and the output says so.

    Never asks: deleting all of them needs --yes. The keys of unreplayed letters stay DEAD;
    `guard key revive KEY` makes one claimable again.
    """
    if before is None and not yes:
        raise click.ClickException(
            "refusing to delete every dead letter without --yes "
            "(or give --before WHEN to delete older ones)"
        )
    runtime = _runtime(ctx)
    cutoff = before.resolve(runtime.store.now()) if before is not None else None
    ids = runtime.store.dead_letters.purge_dead_letters(before=cutoff)
    queue_name = runtime.dead_letters.queue.name
    try:
        from_queue = remove_queue_letters(runtime, queue_name, set(ids))
    except (redis.RedisError, OSError) as exc:
        raise click.ClickException(
            f"deleted {len(ids)} dead letter(s) from the table, but their copies in queue "
            f"{queue_name!r} could not be removed ({type(exc).__name__}); `guard reconcile` "
            "would bring them back: run the purge again when the broker answers"
        ) from None
    if as_json:
        _emit_json(
            {
                "deleted": len(ids),
                "ids": ids,
                "before": _iso(cutoff),
                "queue": queue_name,
                "queue_copies_removed": from_queue,
            }
        )
        return
    when = "" if cutoff is None else f" created before {_iso(cutoff)}"
    queue_note = (
        f"{from_queue} queue copies removed from {queue_name}"
        if from_queue is not None
        else f"queue copies in {queue_name} left (only a Redis broker allows removing them)"
    )
    click.echo(f"deleted {len(ids)} dead letter(s){when}; {queue_note}")
