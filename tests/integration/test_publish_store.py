"""Publish tracking's store primitives (``celery_guard_published``), on SQLite and PostgreSQL."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from celery_guard.store import SqlStore
from celery_guard.store.base import DeadLetter
from tests.integration.claims import claim
from tests.rig.procs import wait_until


def track(store: SqlStore, key: str, **overrides: Any) -> bool:
    values: dict[str, Any] = {
        "key": key,
        "task_name": "shop.record",
        "task_id": f"id-{key}",
        "message": '{"task": "shop.record"}',
        "publisher_stamp": 1000.0,
        "countdown": 0.0,
        "expires_in": None,
    }
    values.update(overrides)
    return store.publishes.track_publish(**values)


def unclaimed_keys(store: SqlStore, after: float) -> set[str]:
    return {
        r.key for r in store.publishes.due_publishes(after, 100) if not r.claimed and not r.expired
    }


def test_a_publish_is_recorded_once_per_key(store: SqlStore) -> None:
    assert track(store, "k")
    assert not track(store, "k", task_id="second-copy"), "one record per key"
    count, oldest = store.publishes.unclaimed_publishes()
    assert count == 1 and oldest is not None and 0 <= oldest < 60
    (record,) = store.publishes.due_publishes(after=-3600, limit=10)
    assert (record.key, record.task_id, record.republishes) == ("k", "id-k", 0)
    assert record.publisher_stamp == 1000.0 and record.republished_at is None
    assert record.due_at >= record.published_at and record.expires_at is None
    assert not store.publishes.forget_publish("k", "second-copy"), "only the recorded publish"
    assert store.publishes.forget_publish("k", "id-k")
    assert store.publishes.unclaimed_publishes() == (0, None)


def test_records_whose_key_has_a_row_in_any_state_are_forgotten_in_bounded_batches(
    store: SqlStore,
) -> None:
    for key in ("running", "completed", "released", "dead", "unclaimed"):
        assert track(store, key)
    claim(store, "running")
    store.keys.complete("completed", claim(store, "completed"), "1", retention=600)
    store.keys.release("released", claim(store, "released"), None)
    store.dead_letters.dead_letter(
        claim(store, "dead"),
        DeadLetter(
            key="dead",
            task_name="shop.record",
            task_id="id-dead",
            message=None,
            error_class="permanent",
            error_type="ValueError",
            error="bad",
            traceback=None,
            reason="test",
            attempts=1,
        ),
    )
    assert store.publishes.unclaimed_publishes()[0] == 1
    deleted, cursor, rounds = 0, "", 0
    while True:  # two records per call: the cursor walks the table in key order
        n, last = store.publishes.forget_claimed_publishes(cursor, limit=2)
        deleted, rounds = deleted + n, rounds + 1
        if last is None:
            break
        assert last > cursor
        cursor = last
    assert (deleted, rounds) == (4, 3)
    assert [r.key for r in store.publishes.due_publishes(after=-3600, limit=10)] == ["unclaimed"]
    assert store.publishes.forget_claimed_publishes("", limit=100) == (0, None)


def test_due_unclaimed_publishes_respect_the_eta_and_the_delay(store: SqlStore) -> None:
    assert track(store, "now")
    assert track(store, "later", countdown=3600.0)  # an ETA an hour away
    assert track(store, "claimed")
    claim(store, "claimed")
    assert unclaimed_keys(store, after=60) == set(), "not before due + delay"
    wait_until(lambda: unclaimed_keys(store, after=0.2) == {"now"}, 10, "the delay to pass")
    flags = {r.key: r.claimed for r in store.publishes.due_publishes(0.2, 100)}
    assert flags == {"now": False, "claimed": True}, "the ETA keeps 'later' out"
    (later,) = [r for r in store.publishes.due_publishes(-7200, 100) if r.key == "later"]
    assert 3590 < later.due_at - later.published_at <= 3600.5

    assert store.publishes.mark_publish_republished("now", "id-now", 2000.0, after=0.2)
    assert not store.publishes.mark_publish_republished("now", "id-now", 2000.0, after=60), (
        "once a period"
    )
    assert not store.publishes.mark_publish_republished("claimed", "id-claimed", 2000.0, after=0.2)
    assert unclaimed_keys(store, after=60) == set()
    (marked,) = [r for r in store.publishes.due_publishes(-7200, 100) if r.key == "now"]
    assert (marked.republishes, marked.publisher_stamp) == (1, 2000.0)
    assert marked.republished_at is not None
    assert abs(marked.waiting_since - marked.republished_at) < 0.01, "the delay restarts"
    store.publishes.unmark_publish_republished(
        replace(marked, republishes=0, publisher_stamp=1000.0)
    )
    (undone,) = [r for r in store.publishes.due_publishes(-7200, 100) if r.key == "now"]
    assert (undone.republishes, undone.publisher_stamp) == (0, 1000.0)

    assert store.publishes.forget_done_publishes(["now", "claimed"]) == 1, (
        "only the claimed one goes"
    )
    assert store.publishes.postpone_publishes(["now"]) == 1
    assert unclaimed_keys(store, after=30) == set(), "a postponed record waits a new delay"


def test_an_expired_message_is_forgotten_rather_than_re_published(store: SqlStore) -> None:
    assert track(store, "expiring", expires_in=0.1)
    assert track(store, "keeps", expires_in=3600.0)
    wait_until(
        lambda: (
            {r.key for r in store.publishes.due_publishes(0.2, 10) if r.expired} == {"expiring"}
        ),
        10,
        "the message to expire",
    )
    assert store.publishes.forget_claimed_publishes("", limit=10) == (1, None)
    assert [r.key for r in store.publishes.due_publishes(-3600, 10)] == ["keeps"]


def test_a_completed_key_is_not_pruned_while_its_publish_is_tracked(store: SqlStore) -> None:
    """Pruned first, the record would look unclaimed and a result_ttl=0 task would run again."""
    assert track(store, "k")
    store.keys.complete("k", claim(store, "k"), "1", retention=0.0)
    assert store.recovery.prune_completed(limit=10, keep_tracked=True) == 0
    assert store.keys.get("k") is not None
    assert store.publishes.forget_claimed_publishes("", limit=10) == (1, None)
    assert store.recovery.prune_completed(limit=10, keep_tracked=True) == 1
    assert store.keys.get("k") is None
