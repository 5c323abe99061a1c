"""``celery -A app guard ...`` as an operator runs it: a real subprocess of the ``celery`` CLI.

The shop's store, Redis broker and worker processes are the session's; tests that need a store
of their own (prune, Redis leases) create a fresh PostgreSQL database.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import redis
from sqlalchemy import create_engine, inspect, text

import celery_guard
from celery_guard import GuardConfig
from celery_guard.cli.reconcile import _decode_envelope
from celery_guard.deadletters import DeadLetterSink
from celery_guard.store import ClaimOutcome, ClaimRequest, SqlStore
from celery_guard.store.base import DeadLetter
from tests.acceptance.conftest import (
    ROOT,
    SHOP_APP,
    effect_count,
    key_record,
    open_gates,
    wait_for_key_state,
)
from tests.acceptance.test_failure_policy import drain_dead_letter_queue
from tests.rig.procs import side_by_side, wait_until
from tests.rig.servers import PostgresServer, RedisServer
from tests.rig.workers import WorkerProcess


def run_guard(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", SHOP_APP, "guard", *args],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_migrate_creates_the_tables_and_can_run_again(
    postgres: PostgresServer, redis_server: RedisServer
) -> None:
    url = postgres.create_database("cli_migrate")
    env = {"CG_STORE_URL": url, "CG_BROKER_URL": redis_server.url_for(7)}
    for _ in range(2):
        completed = run_guard("migrate", env=env)
        assert completed.returncode == 0, completed.stderr
        assert "celery_guard tables are ready" in completed.stdout
    engine = create_engine(url)
    try:
        assert "celery_guard_keys" in inspect(engine).get_table_names()
    finally:
        engine.dispose()


def test_migrate_upgrades_a_first_schema_database_once(
    postgres: PostgresServer, redis_server: RedisServer
) -> None:
    url = postgres.create_database("cli_migrate_upgrade")
    env = {"CG_STORE_URL": url, "CG_BROKER_URL": redis_server.url_for(7)}
    assert run_guard("migrate", env=env).returncode == 0
    engine = create_engine(url)
    try:
        with engine.begin() as connection:  # back to the first schema's two full indexes
            connection.execute(text("DROP INDEX ix_celery_guard_keys_running"))
            connection.execute(text("DROP INDEX ix_celery_guard_keys_prunable"))
            connection.execute(
                text(
                    "CREATE INDEX ix_celery_guard_keys_expires_at ON celery_guard_keys (expires_at)"
                )
            )
        first = run_guard("migrate", env=env)
        assert first.returncode == 0, first.stderr
        assert "upgraded: CREATE INDEX CONCURRENTLY" in first.stdout
        assert "upgraded: DROP INDEX CONCURRENTLY" in first.stdout
        again = run_guard("migrate", env=env)
        assert again.returncode == 0, again.stderr
        assert "upgraded" not in again.stdout
        names = {index["name"] for index in inspect(engine).get_indexes("celery_guard_keys")}
        assert names == {"ix_celery_guard_keys_running", "ix_celery_guard_keys_prunable"}
    finally:
        engine.dispose()


def test_migrate_against_an_unreachable_store_exits_non_zero_with_one_line(
    redis_server: RedisServer,
) -> None:
    env = {
        "CG_STORE_URL": "postgresql://shop:s3cret@127.0.0.1:9/shop",
        "CG_STORE_TIMEOUT": "1",
        "CG_BROKER_URL": redis_server.url_for(7),
    }
    completed = run_guard("migrate", env=env)
    assert completed.returncode != 0
    assert "unavailable" in completed.stderr
    assert "s3cret" not in completed.stderr + completed.stdout


# -- the operator commands against the shop's store, real workers and real brokers -------------

RESULT_TIMEOUT = 60


def run_guard_each(
    *commands: Sequence[str], env: dict[str, str] | None = None
) -> list[subprocess.CompletedProcess[str]]:
    """:func:`run_guard` for commands that change nothing and do not depend on each other, side
    by side (:func:`tests.rig.procs.side_by_side`); results in order."""
    return side_by_side(functools.partial(run_guard, *args, env=env or {}) for args in commands)


def succeeded(completed: subprocess.CompletedProcess[str]) -> str:
    """The stdout of a guard command that must have succeeded."""
    assert completed.returncode == 0, f"{' '.join(completed.args[5:])}: {completed.stderr}"
    return completed.stdout


def failed(completed: subprocess.CompletedProcess[str], code: int = 1) -> str:
    """The reason a guard command that must have failed with ``code`` gave on stderr."""
    assert completed.returncode == code, (completed.returncode, completed.stdout, completed.stderr)
    assert completed.stdout == ""
    errors = [line for line in completed.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, completed.stderr
    if code == 1:
        assert completed.stderr.strip() == errors[0], "one line, nothing else"
    return errors[0]


def guard_ok(*args: str, env: dict[str, str] | None = None) -> str:
    """Run a guard command that must succeed; its stdout."""
    return succeeded(run_guard(*args, env=env or {}))


def guard_json(*args: str, env: dict[str, str] | None = None) -> Any:
    """Run a guard command with --json; its stdout parsed (it must be nothing but JSON)."""
    return json.loads(guard_ok(*args, "--json", env=env))


def guard_fails(*args: str, env: dict[str, str] | None = None, code: int = 1) -> str:
    """Run a guard command that must fail with ``code``; the reason it gave on stderr."""
    return failed(run_guard(*args, env=env or {}), code)


def iso(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, tz=timezone.utc).isoformat()


def claim(store: SqlStore, key: str, lease_ttl: float, message: str | None = None) -> int:
    """Claim a key directly, as a worker would; its fencing token."""
    result = store.keys.claim(
        ClaimRequest(
            key=key,
            task_name="shop.record",
            fingerprint=None,
            check_fingerprint=False,
            owner="cli-test/1",
            message=message,
            lease_ttl=lease_ttl,
        )
    )
    assert result.outcome is ClaimOutcome.CLAIMED
    return result.record.fencing_token


def letters_for(task: str, keys: set[str]) -> list[dict[str, Any]]:
    rows = guard_json("dlq", "list", "--task", task, "--since", "1h", "--limit", "500")
    return [row for row in rows if row["key"] in keys]


@pytest.mark.workers
def test_status_and_key_show_on_keys_workers_hold_and_completed(
    shop: ModuleType, shop_env: dict[str, str], shop_workers: list[WorkerProcess], tag: str
) -> None:
    assert shop.record.delay(tag, 7).get(timeout=RESULT_TIMEOUT) == {"tag": tag, "value": 7}
    # The body is held at its gate until the CLI has shown it running: each guard command is a
    # subprocess that imports Celery, and on a busy machine a chain of them outlasts any fixed
    # body length.
    running = shop.gated.delay(tag)
    key = f"gated:{tag}"
    try:
        held = wait_for_key_state(shop, key, "RUNNING")
        check_status_and_key_show(shop, shop_workers, tag, key)
    finally:
        open_gates(shop_env["CG_MARKER_DIR"], tag, 1)  # a fresh key's first owner holds token 1
    assert held.fencing_token == 1
    assert running.get(timeout=RESULT_TIMEOUT)["tag"] == tag
    assert key_record(shop, key) is not None and effect_count(shop, tag) == 2  # record, gated


def check_status_and_key_show(
    shop: ModuleType, shop_workers: list[WorkerProcess], tag: str, key: str
) -> None:
    """What ``guard status`` and ``guard key show`` say while ``key``'s body is held."""
    store = celery_guard.get_runtime(shop.app).store
    wait_until(
        lambda: store.recovery.leader("reaper") is not None, 30, "a worker's reaper to be elected"
    )

    answers = run_guard_each(
        ("status", "--json"),
        ("status",),
        ("key", "show", key, "--json"),
        ("key", "show", f"record:{tag}", "--json"),
        ("key", "show", f"record:{tag}"),
    )
    status = json.loads(succeeded(answers[0]))
    assert set(status["keys"]) >= {"RUNNING", "COMPLETED", "RELEASED", "DEAD"}
    assert status["keys"]["RUNNING"] >= 1 and status["keys"]["COMPLETED"] >= 1
    oldest = status["oldest_running"]
    assert oldest is not None and oldest["age_seconds"] >= 0
    assert status["reaper"]["live"] and status["reaper"]["holder"]
    assert status["lease_backend"] == "sql" and "@" in status["store"]
    assert status["dead_letters"]["total"] >= status["dead_letters"]["not_replayed"] >= 0
    human = succeeded(answers[1])
    assert "RUNNING" in human and "oldest RUNNING" in human and "dead letters" in human

    held = json.loads(succeeded(answers[2]))
    assert (held["state"], held["task"], held["claim_reason"]) == ("RUNNING", "shop.gated", "NEW")
    assert 0 < held["lease_remaining_seconds"] <= 10 and held["owner"]
    done = json.loads(succeeded(answers[3]))
    assert (done["state"], done["task"], done["attempts"], done["fencing_token"]) == (
        "COMPLETED",
        "shop.record",
        1,
        1,
    )
    assert done["result"] == {"tag": tag, "value": 7}
    assert done["message"]["args"] == [tag, 7] and done["message"]["task"] == "shop.record"
    assert done["completed_at"].endswith("Z") and done["retention_seconds"] == 7 * 24 * 3600
    assert done["lease_remaining_seconds"] is None
    human = succeeded(answers[4])
    assert "COMPLETED" in human and f"shop.record[{done['message']['id']}]" in human

    # Workers beat into the store every reaper interval: wait for the one running the body.
    wait_until(
        lambda: "PROCESSING (1 running)" in guard_ok("status"),
        60,
        "a worker heartbeat to show the running body",
    )
    by_pid = {worker["pid"]: worker for worker in guard_json("status")["workers"]}
    for worker in shop_workers:
        assert by_pid[worker.pid]["alive"]
        assert by_pid[worker.pid]["state"] in {"READY", "PROCESSING"}

    assert "no idempotency key" in guard_fails("key", "show", f"record:{tag}-unknown")


@pytest.mark.workers
def test_dlq_list_and_show_with_filters(
    shop: ModuleType, shop_workers: list[WorkerProcess], tag: str
) -> None:
    tags = [f"{tag}-{n}" for n in range(3)]
    results = [shop.reject_order.delay(t) for t in tags]
    for result in results:
        with pytest.raises(ValueError, match="has no lines"):
            result.get(timeout=RESULT_TIMEOUT)
    keys = {f"reject:{t}" for t in tags}

    mine = letters_for("shop.reject_order", keys)
    assert {row["key"] for row in mine} == keys
    for row in mine:
        assert (row["task"], row["error_class"], row["error_type"], row["attempts"]) == (
            "shop.reject_order",
            "permanent",
            "ValueError",
            1,
        )
        assert row["replayed"] is False and row["created_at"].endswith("Z")
    letter = mine[0]
    answers = run_guard_each(
        ("dlq", "list", "--task", "shop.reject_order", "--limit", "2", "--json"),
        ("dlq", "list", "--since", iso(time.time() + 3600), "--json"),
        ("dlq", "list", "--task", "shop.reject_order", "--since", "1h"),
        ("dlq", "show", str(letter["id"]), "--json"),
        ("dlq", "show", str(letter["id"])),
        ("dlq", "show", "987654321"),
        ("dlq", "list", "--since", "yesterday"),
        ("dlq", "list", "--limit", "0"),
    )
    newest = json.loads(succeeded(answers[0]))
    assert len(newest) == 2 and newest[0]["id"] > newest[1]["id"]
    assert all(row["task"] == "shop.reject_order" for row in newest)
    assert json.loads(succeeded(answers[1])) == []
    human = succeeded(answers[2])
    assert human.splitlines()[0].split() == [
        "ID",
        "CREATED",
        "TASK",
        "KEY",
        "CLASS",
        "TYPE",
        "ATTEMPTS",
        "REPLAYED",
    ]
    assert all(key in human for key in keys)

    shown = json.loads(succeeded(answers[3]))
    assert shown["key"] == letter["key"] and "raise ValueError" in shown["traceback"]
    assert shown["message"]["args"] == [letter["key"].removeprefix("reject:")]
    assert "has no lines" in shown["error"]
    human = succeeded(answers[4])
    assert "raise ValueError" in human and '"task": "shop.reject_order"' in human
    assert "unknown dead letter id" in failed(answers[5])
    assert "--since" in failed(answers[6], code=2)
    assert "--limit" in failed(answers[7], code=2)


@pytest.mark.workers
def test_replay_after_the_bug_is_fixed_runs_the_task_once(
    shop: ModuleType, shop_env: dict[str, str], shop_workers: list[WorkerProcess], tag: str
) -> None:
    marker = Path(shop_env["CG_MARKER_DIR"]) / tag
    marker.touch()
    with pytest.raises(ValueError, match="bug present"):
        shop.fixable.delay(tag).get(timeout=RESULT_TIMEOUT)
    key = f"fixable:{tag}"
    (letter,) = letters_for("shop.fixable", {key})
    assert (key_record(shop, key) or pytest.fail("no row")).state == "DEAD"

    marker.unlink()  # the bug is fixed
    assert f"replayed dead letter {letter['id']}" in guard_ok("dlq", "replay", str(letter["id"]))
    wait_for_key_state(shop, key, "COMPLETED")
    assert effect_count(shop, tag) == 1

    again = guard_ok("dlq", "replay", str(letter["id"]))
    assert "already replayed" in again
    assert guard_json("dlq", "replay", str(letter["id"]))["outcome"] == "already"
    record = key_record(shop, key)
    assert record is not None and record.state == "COMPLETED" and effect_count(shop, tag) == 1
    (replayed,) = letters_for("shop.fixable", {key})
    assert replayed["replayed"] is True


@pytest.mark.workers
def test_replay_all_of_a_task(
    shop: ModuleType, shop_env: dict[str, str], shop_workers: list[WorkerProcess], tag: str
) -> None:
    tags = [f"{tag}-a", f"{tag}-b"]
    markers = [Path(shop_env["CG_MARKER_DIR"]) / t for t in tags]
    for marker in markers:
        marker.touch()
    results = [shop.fixable.delay(t) for t in tags]
    for result in results:
        with pytest.raises(ValueError, match="bug present"):
            result.get(timeout=RESULT_TIMEOUT)
    keys = {f"fixable:{t}" for t in tags}
    ids = {row["id"] for row in letters_for("shop.fixable", keys)}
    assert len(ids) == 2
    for marker in markers:
        marker.unlink()

    replayed = guard_json("dlq", "replay", "--task", "shop.fixable", "--all")
    assert ids <= set(replayed["replayed"]) and replayed["failed"] == []
    for key in keys:
        wait_for_key_state(shop, key, "COMPLETED")
    assert [effect_count(shop, t) for t in tags] == [1, 1]
    again = guard_ok("dlq", "replay", "--task", "shop.fixable", "--all")
    assert again.startswith("shop.fixable: replayed 0,")
    assert [effect_count(shop, t) for t in tags] == [1, 1]


@pytest.mark.workers
def queued_letter_ids(shop: ModuleType) -> set[int]:
    """Ids of the dead letters in the shop's dead-letter queue, read without consuming."""
    client = redis.Redis.from_url(shop.app.conf.broker_url)
    try:
        raws = client.lrange("celery_guard.dead_letters", 0, -1)
    finally:
        client.close()
    return {letter["id"] for raw in raws if (letter := _decode_envelope(raw)) is not None}


def test_purge_and_argument_errors(
    shop: ModuleType, shop_workers: list[WorkerProcess], tag: str
) -> None:
    assert "--yes" in guard_fails("dlq", "purge")
    store = celery_guard.get_runtime(shop.app).store
    with pytest.raises(ValueError):
        shop.reject_order.delay(f"{tag}-old").get(timeout=RESULT_TIMEOUT)
    cutoff = store.now()
    with pytest.raises(ValueError):
        shop.reject_order.delay(f"{tag}-new").get(timeout=RESULT_TIMEOUT)
    keys = {f"reject:{tag}-old", f"reject:{tag}-new"}
    letters = letters_for("shop.reject_order", keys)
    assert len(letters) == 2
    (old_letter,) = [r for r in letters if "old" in r["key"]]
    (new_letter,) = [r for r in letters if "new" in r["key"]]
    assert {old_letter["id"], new_letter["id"]} <= queued_letter_ids(shop)

    purged = guard_json("dlq", "purge", "--before", iso(cutoff))
    assert purged["deleted"] >= 1 and old_letter["id"] in purged["ids"]
    assert purged["queue_copies_removed"] == purged["deleted"]
    assert [row["key"] for row in letters_for("shop.reject_order", keys)] == [f"reject:{tag}-new"]
    # The queue copy went too, so `guard reconcile --apply` cannot bring the letter back.
    in_queue = queued_letter_ids(shop)
    assert old_letter["id"] not in in_queue and new_letter["id"] in in_queue
    assert guard_ok("dlq", "purge", "--before", "30d").startswith("deleted 0 dead letter(s)")

    unknown, both, neither, no_task, bad_before = run_guard_each(
        ("dlq", "replay", "987654321"),
        ("dlq", "replay", "1", "--all"),
        ("dlq", "replay"),
        ("dlq", "replay", "--all"),
        ("dlq", "purge", "--before", "soon"),
    )
    assert "unknown dead letter id" in failed(unknown)
    assert "not both" in failed(both, code=2)
    assert "give a dead letter ID" in failed(neither, code=2)
    assert "--task" in failed(no_task, code=2)
    assert "--before" in failed(bad_before, code=2)


def test_prune_deletes_completed_keys_past_their_retention(
    postgres: PostgresServer, shop_env: dict[str, str], tag: str
) -> None:
    url = postgres.create_database(f"cli_prune_{tag}")
    store = SqlStore(GuardConfig(store_url=url))
    try:
        store.ensure_schema()
        for name, retention in (("gone-1", 0.0), ("gone-2", 0.0), ("kept", 3600.0), ("ever", None)):
            store.keys.complete(name, claim(store, name, lease_ttl=60), '"ok"', retention)
        assert guard_json("prune", env={"CG_STORE_URL": url}) == {"pruned": 2, "complete": True}
        assert [store.keys.get(name) is None for name in ("gone-1", "gone-2", "kept", "ever")] == [
            True,
            True,
            False,
            False,
        ]
        assert "pruned 0 COMPLETED key(s)" in guard_ok("prune", env={"CG_STORE_URL": url})
    finally:
        store.dispose()


@pytest.mark.workers
def test_reconcile_finds_an_expired_lease_and_republishes_a_letter_missing_from_the_queue(
    shop: ModuleType, shop_workers: list[WorkerProcess], tag: str
) -> None:
    store = celery_guard.get_runtime(shop.app).store
    # A RUNNING key whose owner vanished. Without a stored message the reaper cannot re-publish
    # it, so it stays an orphan whatever the reaper's timing.
    orphan = f"cli-orphan:{tag}"
    token = claim(store, orphan, lease_ttl=0.1)
    try:
        with pytest.raises(ValueError):
            shop.reject_order.delay(tag).get(timeout=RESULT_TIMEOUT)
        (letter,) = letters_for("shop.reject_order", {f"reject:{tag}"})
        drain_dead_letter_queue(shop, "celery_guard.dead_letters")  # the publish was "lost"

        report = guard_json("reconcile")
        (item,) = [i for i in report["running_without_live_lease"]["items"] if i["key"] == orphan]
        assert (item["why"], item["row_lease_live"], item["fencing_token"]) == (
            "lease expired",
            False,
            token,
        )
        assert "no stored message" in item["action"]
        queue = report["dead_letter_queue"]
        assert queue["checked"] and letter["id"] in {i["id"] for i in queue["table_only"]}
        assert report["leases_without_running_key"]["checked"] is False
        assert report["reaper"]["live"]
        human = guard_ok("reconcile")
        assert orphan in human and "in the table, not in the queue" in human

        applied = guard_json("reconcile", "--apply")
        assert applied["applied"] is True
        (fix,) = [i for i in applied["dead_letter_queue"]["table_only"] if i["id"] == letter["id"]]
        assert fix["result"] == "published"

        after = guard_json("reconcile")["dead_letter_queue"]
        assert letter["id"] not in {i["id"] for i in after["table_only"] + after["queue_only"]}
        queued = drain_dead_letter_queue(shop, "celery_guard.dead_letters")
        assert letter["id"] in {body["id"] for body in queued}

        # A queue that another system consumes is no evidence of lost letters: skip it.
        skipped = guard_json("reconcile", "--skip-queue", "--apply")["dead_letter_queue"]
        assert skipped["checked"] is False and "skip" in skipped["reason"]
        assert skipped["table_only"] == [] and skipped["queue_only"] == []
        assert drain_dead_letter_queue(shop, "celery_guard.dead_letters") == []
    finally:
        store.keys.release(orphan, token, None)


def test_reconcile_with_redis_leases_ends_stale_leases_and_records_queue_only_letters(
    postgres: PostgresServer, redis_server: RedisServer, shop: ModuleType, tag: str
) -> None:
    url = postgres.create_database(f"cli_reconcile_{tag}")
    lease_url = redis_server.url_for(5)
    queue = f"cli-dead-letters-{tag}"
    env = {"CG_STORE_URL": url, "CG_LEASE_URL": lease_url, "CG_DEAD_LETTER_QUEUE": queue}
    leases = redis.Redis.from_url(lease_url)
    store = SqlStore(GuardConfig(store_url=url))
    try:
        store.ensure_schema()
        # (1) a RUNNING row whose Redis lease is gone while the row's lease still looks live,
        # beside a healthy key that holds its lease.
        message = {"task": "shop.record", "id": "t-1", "args": ["x"], "routing_key": "celery"}
        stale_token = claim(store, "cli:no-lease", lease_ttl=60, message=json.dumps(message))
        healthy_token = claim(store, "cli:healthy", lease_ttl=60)
        leases.set("celery_guard:{cli:healthy}:lease", healthy_token, px=60_000)
        # (2) a lease whose key has no row.
        leases.set("celery_guard:{cli:ghost}:lease", 7, px=60_000)
        # (3) a dead letter in the queue only (its table row was lost).
        sink = DeadLetterSink(shop.app, store.dead_letters, queue)
        sink.publish(
            DeadLetter(
                id=4242,
                created_at=time.time(),
                key="cli:lost",
                task_name="shop.reject_order",
                task_id="t-lost",
                message=None,
                error_class="permanent",
                error_type="ValueError",
                error="lost",
                traceback=None,
                reason="a permanent error",
                attempts=1,
            )
        )

        status = guard_json("status", env=env)
        assert status["lease_backend"] == "redis" and status["keys"]["RUNNING"] == 2
        assert status["running_without_live_lease"] == 1 and status["reaper"] is None
        assert status["oldest_running"]["key"] == "cli:no-lease"
        assert status["oldest_running"]["lease_remaining_seconds"] is None
        # What a renewal publishes beside the lease (celery_guard.lease.heartbeat.status_json).
        live = {
            "key": "cli:healthy",
            "task": "shop.slow",
            "owner": "w9@h/42",
            "fencing_token": 1,
            "started_at": time.time() - 30,
            "progress_at": time.time() - 5,
            "renewed_at": time.time(),
            "progress": {"step": 2},
        }
        leases.set("celery_guard:{cli:healthy}:status", json.dumps(live), px=60_000)
        (entry,) = guard_json("status", env=env)["live"]
        assert (entry["key"], entry["owner"], entry["progress"]) == (
            "cli:healthy",
            "w9@h/42",
            {"step": 2},
        )
        assert 29 <= entry["started_seconds_ago"] <= 60
        assert "cli:healthy (shop.slow) on w9@h/42" in guard_ok("status", env=env)
        healthy = guard_json("key", "show", "cli:healthy", env=env)
        assert 0 < healthy["lease_remaining_seconds"] <= 60

        report = guard_json("reconcile", env=env)
        (item,) = report["running_without_live_lease"]["items"]
        assert (item["key"], item["why"], item["row_lease_live"], item["needs_apply"]) == (
            "cli:no-lease",
            "no Redis lease",
            True,
            True,
        )
        (lease,) = report["leases_without_running_key"]["items"]
        assert (lease["key"], lease["lease_token"], lease["row_state"]) == ("cli:ghost", "7", None)
        queued = report["dead_letter_queue"]
        assert [i["id"] for i in queued["queue_only"]] == [4242] and queued["table_only"] == []
        human = guard_ok("reconcile", env=env)
        assert "cli:ghost" in human and "in the queue, not in the table: 1" in human

        applied = guard_json("reconcile", "--apply", env=env)
        assert applied["running_without_live_lease"]["items"][0]["result"].startswith("lease ended")
        assert applied["leases_without_running_key"]["items"][0]["result"] == "deleted"
        assert applied["dead_letter_queue"]["queue_only"][0]["result"] == "inserted"
        assert not leases.exists("celery_guard:{cli:ghost}:lease")
        recorded = store.dead_letters.get_dead_letter(4242)
        assert recorded is not None and (recorded.key, recorded.error) == ("cli:lost", "lost")
        record = store.keys.get("cli:no-lease")
        assert record is not None and record.fencing_token == stale_token
        assert (record.lease_expires_at or 0) <= store.now()

        after = guard_json("reconcile", env=env)
        (item,) = after["running_without_live_lease"]["items"]
        assert not item["row_lease_live"] and not item["needs_apply"]
        assert item["action"].startswith("orphan: the reaper re-publishes")
        assert after["leases_without_running_key"]["items"] == []
        assert after["dead_letter_queue"]["queue_only"] == []
        assert after["dead_letter_queue"]["table_only"] == []
        # The id sequence moved past the recorded letter: the next one cannot collide.
        later = store.dead_letters.dead_letter(
            healthy_token,
            DeadLetter(
                key="cli:healthy",
                task_name="shop.record",
                task_id=None,
                message=None,
                error_class="permanent",
                error_type="ValueError",
                error="x",
                traceback=None,
                reason="r",
                attempts=1,
            ),
        )
        assert later.id is not None and later.id > 4242

        other = guard_json("reconcile", env={**env, "CG_BROKER_URL": "memory://"})
        assert other["dead_letter_queue"]["checked"] is False
        assert "needs a Redis broker" in other["dead_letter_queue"]["reason"]
    finally:
        store.dispose()
        leases.delete("celery_guard:{cli:healthy}:lease", "celery_guard:{cli:ghost}:lease")
        leases.close()
        broker = redis.Redis.from_url(shop.app.conf.broker_url)
        broker.delete(queue)
        broker.close()


def test_commands_against_an_unreachable_store_fail_in_one_line_without_the_password(
    redis_server: RedisServer,
) -> None:
    env = {
        "CG_STORE_URL": "postgresql://u:s3cret@127.0.0.1:9/x",
        "CG_STORE_TIMEOUT": "1",
        "CG_BROKER_URL": redis_server.url_for(7),
    }
    for args in (["status", "--json"], ["dlq", "list"], ["reconcile"]):
        completed = run_guard(*args, env=env)
        assert completed.returncode == 1, completed
        assert completed.stdout == ""
        assert len(completed.stderr.strip().splitlines()) == 1, completed.stderr
        assert "unavailable" in completed.stderr
        assert "s3cret" not in completed.stderr


def test_key_revive_makes_a_dead_key_claimable_and_refuses_anything_else(
    shop: ModuleType, shop_workers: list[WorkerProcess], tag: str
) -> None:
    with pytest.raises(ValueError):
        shop.reject_order.delay(tag).get(timeout=60)
    key = f"reject:{tag}"
    assert "revived" in guard_ok("key", "revive", key)
    record = celery_guard.get_runtime(shop.app).store.keys.get(key)
    assert record is not None and (record.state, record.attempts) == ("RELEASED", 0)
    assert "not DEAD" in guard_fails("key", "revive", key)
    assert "not DEAD" in guard_fails("key", "revive", f"no-such-key-{tag}")
