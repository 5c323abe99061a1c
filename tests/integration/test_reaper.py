"""The reaper's store primitives and one pass against a real Redis broker."""

from __future__ import annotations

import json
import time
import uuid

import pytest
from celery import Celery
from sqlalchemy import text

from celery_guard import Fenced
from celery_guard.lease.backends import RedisLeases, SqlLeases
from celery_guard.outbox import UnclaimedRepublisher
from celery_guard.reaper import Reaper
from celery_guard.store import ClaimRequest, SqlStore
from tests.integration.claims import claim
from tests.rig.procs import wait_until
from tests.rig.servers import RedisServer


def test_one_leader_at_a_time_and_a_resigned_lease_is_free(store: SqlStore) -> None:
    assert store.recovery.acquire_leadership("reaper", "a", ttl=30)
    assert store.recovery.acquire_leadership("reaper", "a", ttl=30), "the holder keeps it"
    assert not store.recovery.acquire_leadership("reaper", "b", ttl=30)
    store.recovery.resign_leadership("reaper", "a")
    assert store.recovery.acquire_leadership("reaper", "b", ttl=30)
    assert not store.recovery.acquire_leadership("reaper", "a", ttl=30)


def test_an_expired_leadership_passes_to_the_next_candidate(store: SqlStore) -> None:
    assert store.recovery.acquire_leadership("reaper", "a", ttl=0.1)
    wait_until(lambda: store.recovery.acquire_leadership("reaper", "b", ttl=30), 10, "leadership")


def test_orphans_are_expired_running_keys_marked_once_per_period(store: SqlStore) -> None:
    live = claim(store, "live")
    orphan = claim(store, "orphan", ttl=0.1)
    done = claim(store, "done", ttl=0.1)
    store.keys.complete("done", done, "1", retention=60)
    wait_until(
        lambda: [r.key for r in store.recovery.orphans(republish_after=60, limit=10)] == ["orphan"],
        timeout=10,
        what="the orphan's lease to expire",
    )
    assert store.recovery.mark_republished("orphan", orphan, republish_after=60)
    assert not store.recovery.mark_republished("orphan", orphan, republish_after=60), (
        "once per period"
    )
    assert store.recovery.orphans(republish_after=60, limit=10) == []
    assert not store.recovery.mark_republished("live", live, republish_after=60), "a live lease"


def test_pruning_deletes_completed_keys_past_their_retention_only(store: SqlStore) -> None:
    for key, retention in (("gone", 0.0), ("kept", 600.0), ("forever", None)):
        token = claim(store, key)
        store.keys.complete(key, token, "1", retention=retention)
    claim(store, "running")
    assert store.recovery.prune_completed(limit=100) == 1
    assert store.keys.get("gone") is None
    assert all(store.keys.get(key) is not None for key in ("kept", "forever", "running"))


def test_a_pruned_keys_next_row_starts_above_every_token_the_old_row_issued(
    store: SqlStore,
) -> None:
    """Regression (found by tests/property): pruning deleted a row's tokens with it, so the
    key's next claim started again at token 1 and a zombie of the old row owned the new one."""
    zombie = claim(store, "k")  # token 1; its worker freezes
    assert store.recovery.expire_lease("k", zombie)
    takeover = store.keys.claim(
        ClaimRequest(
            key="k",
            task_name="shop.record",
            fingerprint="fp",
            check_fingerprint=True,
            owner="w2/2",
            message=None,
            lease_ttl=30,
        )
    )
    assert takeover.record.fencing_token == 2
    store.keys.complete("k", 2, "1", retention=0.0)  # guard_result_ttl = 0: only while in flight
    assert store.recovery.prune_completed(limit=100) == 1
    fresh = claim(store, "k")  # a new call with the same key
    assert store.keys.renew_leases([("k", zombie)], 30) == set(), "the zombie must stay fenced"
    with pytest.raises(Fenced):
        store.keys.complete("k", zombie, '"zombie"', retention=None)
    assert fresh == 3, "the new row's tokens start above the pruned row's"
    store.keys.complete("k", fresh, '"fresh"', retention=None)
    assert store.recovery.token_floor() == 2
    assert claim(store, "other") == 3, "a new key starts above the floor too"


def test_a_pass_republishes_an_orphans_stored_message_to_its_queue(
    store: SqlStore, redis_server: RedisServer
) -> None:
    broker = redis_server.url_for(10)
    queue = f"reaped-{uuid.uuid4().hex[:8]}"
    message = json.dumps(
        {
            "task": "shop.record",
            "id": "task-1",
            "args": ["tag"],
            "kwargs": {"value": 1},
            "headers": {"guard_idempotency_key": "orphan", "guard_key_source": "call"},
            "exchange": "",
            "routing_key": queue,
            "priority": None,
        }
    )
    claim(store, "orphan", ttl=0.1, message=message)
    app = Celery("reaper-test", broker=broker, set_as_current=False)
    reaper = Reaper(
        app, store.recovery, SqlLeases(store.keys), interval=1, lease_ttl=0.1, holder="me"
    )
    try:
        wait_until(lambda: reaper.run_once().recovered == ["orphan"], 10, "the orphan's recovery")
        assert reaper.run_once().recovered == [], "not re-published again within the period"
        with app.connection_for_read() as connection:
            received = connection.SimpleQueue(queue, no_ack=True).get(timeout=5)
            assert received.headers["id"] == "task-1"
            assert received.headers["task"] == "shop.record"
            assert received.headers["guard_idempotency_key"] == "orphan"
            assert received.decode()[0] == ["tag"]
    finally:
        app.close()


def test_with_redis_leases_a_held_lease_keeps_its_key_out_of_the_reaper(
    store: SqlStore, redis_server: RedisServer
) -> None:
    leases = RedisLeases(redis_server.url_for(9), timeout=2, prefix=uuid.uuid4().hex)
    app = Celery("reaper-test", broker=redis_server.url_for(10), set_as_current=False)
    try:
        held = leases.acquire("alive", ttl=30)
        claim(store, "alive", ttl=0.1, message='{"task": "t"}')
        reaper = Reaper(app, store.recovery, leases, interval=1, lease_ttl=0.1, holder="me")
        wait_until(
            lambda: store.recovery.orphans(60, 10) != [], 10, "the row's claim-time lease to end"
        )
        assert reaper.run_once().recovered == []
        assert held.handle is not None
        leases.release("alive", held.handle)
        assert reaper.run_once().recovered == ["alive"]
    finally:
        leases.close()
        app.close()


def tracked_message(queue: str, key: str, task_id: str) -> str:
    return json.dumps(
        {
            "task": "shop.record",
            "id": task_id,
            "args": ["tag"],
            "kwargs": {},
            "headers": {"guard_idempotency_key": key, "guard_key_source": "option"},
            "exchange": "",
            "routing_key": queue,
            "priority": None,
        }
    )


def test_a_pass_republishes_a_tracked_publish_no_worker_claimed_once_its_queue_moved_past(
    store: SqlStore, redis_server: RedisServer
) -> None:
    """The reaper side of publish tracking, on SQLite and PostgreSQL, with a Redis broker."""
    app = Celery("reaper-test", broker=redis_server.url_for(10), set_as_current=False)
    queue = f"tracked-{uuid.uuid4().hex[:8]}"
    outbox = UnclaimedRepublisher(app, store.publishes, after=0.2)
    reaper = Reaper(
        app, store.recovery, SqlLeases(store.keys), interval=1, lease_ttl=5, outbox=outbox
    )
    try:
        # Still waiting in its queue (its own header is the oldest there): left alone.
        app.send_task(
            "shop.record",
            args=["tag"],
            task_id="t-1",
            queue=queue,
            headers={"guard_published_at": time.time()},  # install()'s hook may stamp it again
        )
        with redis_server.client(10) as client:
            stamp = json.loads(client.lindex(queue, -1))["headers"]["guard_published_at"]
        assert store.publishes.track_publish(
            key="k-1",
            task_name="shop.record",
            task_id="t-1",
            message=tracked_message(queue, "k-1", "t-1"),
            publisher_stamp=stamp,
            countdown=0.0,
            expires_in=None,
        )
        wait_until(
            lambda: (report := reaper.run_once().outbox) is not None and report.postponed == 1,
            10,
            "the reaper to find the message still queued",
        )
        # Lost (taken off the queue unseen): re-published, same id, key header and queue.
        with redis_server.client(10) as client:
            assert client.rpop(queue) is not None
        wait_until(
            lambda: (
                (report := reaper.run_once().outbox) is not None and report.republished == ["k-1"]
            ),
            10,
            "the lost message's re-publish",
        )
        with app.connection_for_read() as connection:
            received = connection.SimpleQueue(queue, no_ack=True).get(timeout=5)
            assert received.headers["id"] == "t-1"
            assert received.headers["guard_idempotency_key"] == "k-1"
            assert received.decode()[0] == ["tag"]
        (record,) = store.publishes.due_publishes(after=-60, limit=10)
        assert record.republishes == 1 and record.republished_at is not None
        claim(store, "k-1")  # a worker claims it: the record is forgotten
        forgotten = reaper.run_once().outbox
        assert forgotten is not None and forgotten.forgotten == 1
        assert store.publishes.unclaimed_publishes() == (0, None)
    finally:
        reaper.stop()
        app.close()


def test_a_pass_goes_on_when_publish_tracking_fails(
    store: SqlStore, caplog: pytest.LogCaptureFixture
) -> None:
    """A published table your migrations have not created yet: logged, the rest still runs."""
    app = Celery("reaper-test", broker="memory://", set_as_current=False)
    outbox = UnclaimedRepublisher(app, store.publishes, after=60)
    reaper = Reaper(
        app, store.recovery, SqlLeases(store.keys), interval=1, lease_ttl=0.1, outbox=outbox
    )
    claim(store, "orphan", ttl=0.1)  # no stored message: reported unrecoverable
    with store.engine.begin() as connection:
        connection.execute(text("DROP TABLE celery_guard_published"))
    wait_until(lambda: store.recovery.orphans(60, 10) != [], 10, "the orphan's lease to end")
    report = reaper.run_once()
    assert report.leader and report.unrecoverable == ["orphan"]
    assert "publish tracking failed this pass" in caplog.text
    app.close()
