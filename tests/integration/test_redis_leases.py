"""Redis leases on a real Redis: SET NX PX, token-checked renew and release, INCR fencing."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from celery_guard import StoreUnavailable
from celery_guard.lease.backends import RedisLeases
from celery_guard.lease.heartbeat import Heartbeat, Lease
from celery_guard.store import ClaimOutcome, ClaimRequest, SqlStore
from tests.rig.ports import free_port
from tests.rig.procs import wait_until
from tests.rig.servers import RedisServer


@pytest.fixture
def leases(redis_server: RedisServer) -> Iterator[RedisLeases]:
    backend = RedisLeases(redis_server.url_for(9), timeout=2.0, prefix=uuid.uuid4().hex)
    try:
        yield backend
    finally:
        backend.close()


def test_one_holder_at_a_time_and_tokens_only_rise(leases: RedisLeases) -> None:
    first = leases.acquire("k", ttl=30)
    assert first.acquired and first.handle == 1
    second = leases.acquire("k", ttl=30)
    assert not second.acquired
    assert second.handle == 1, "reports the holder's token"
    assert 29 < second.remaining <= 30
    leases.release("k", first.handle)
    third = leases.acquire("k", ttl=30)
    assert third.acquired and third.handle == 2


def test_renew_and_release_check_the_token(leases: RedisLeases) -> None:
    held = leases.acquire("k", ttl=1)
    assert leases.renew_leases([("k", 99)], ttl=30) == set()
    leases.release("k", 99)
    assert leases.held(["k", "other"]) == {"k"}
    assert held.handle is not None
    assert leases.renew_leases([("k", held.handle)], ttl=30) == {"k"}
    assert not leases.acquire("k", ttl=30).acquired


def test_an_unrenewed_lease_expires_and_the_next_holder_gets_a_newer_token(
    leases: RedisLeases,
) -> None:
    old = leases.acquire("k", ttl=0.2)
    wait_until(lambda: leases.held(["k"]) == set(), timeout=10, what="the lease to expire")
    new = leases.acquire("k", ttl=30)
    assert new.acquired and new.handle is not None and old.handle is not None
    assert new.handle > old.handle
    assert old.handle is not None
    assert leases.renew_leases([("k", old.handle)], ttl=30) == set(), "the old holder is out"


def test_an_unreachable_redis_is_a_store_outage_without_the_password() -> None:
    leases = RedisLeases(f"redis://:s3cret@127.0.0.1:{free_port()}/0", timeout=0.5)
    with pytest.raises(StoreUnavailable) as caught:
        leases.acquire("k", ttl=5)
    assert "s3cret" not in str(caught.value)
    leases.close()


def claim(store: SqlStore, token: int, owner: str = "w1/1") -> ClaimOutcome:
    return store.keys.claim(
        ClaimRequest(
            key="k",
            task_name="t",
            fingerprint="fp",
            check_fingerprint=True,
            owner=owner,
            message=None,
            lease_ttl=30.0,
            external_token=token,
        )
    ).outcome


def test_the_holder_of_the_external_lease_takes_a_running_row_over(store: SqlStore) -> None:
    assert claim(store, 1) is ClaimOutcome.CLAIMED
    # The row's own lease is still live; holding the Redis lease is what entitles a takeover.
    assert claim(store, 2, owner="w2/2") is ClaimOutcome.CLAIMED
    record = store.keys.get("k")
    assert record is not None
    assert (record.fencing_token, record.claim_reason, record.owner) == (2, "TAKEOVER", "w2/2")


def test_a_counter_that_went_backwards_still_yields_a_newer_token(store: SqlStore) -> None:
    """Redis restarted without persistence: INCR starts over, the row's token keeps rising."""
    assert claim(store, 5) is ClaimOutcome.CLAIMED
    assert claim(store, 1, owner="w2/2") is ClaimOutcome.CLAIMED
    record = store.keys.get("k")
    assert record is not None and record.fencing_token == 6


def test_renewals_publish_live_status_that_ends_with_the_lease(leases: RedisLeases) -> None:
    acquisition = leases.acquire("order:7", ttl=30)
    lease = Lease(
        "order:7", 5, handle=acquisition.handle, ttl=30, hard_deadline=None, progress_timeout=None
    )
    lease.description = {"task": "shop.charge", "owner": "w1@host/123"}
    heartbeat = Heartbeat(leases, interval=10)
    heartbeat.hold(lease)
    assert leases.live_statuses() == [], "nothing is published before the first renewal"
    lease.progress({"done": 3, "of": 10})
    heartbeat.beat()
    (status,) = leases.live_statuses()
    assert status["task"] == "shop.charge" and status["owner"] == "w1@host/123"
    assert status["key"] == "order:7" and status["fencing_token"] == 5
    assert status["progress"] == {"done": 3, "of": 10}
    assert status["started_at"] <= status["progress_at"] <= status["renewed_at"]
    # Another holder's release never touches it; the holder's own release removes it.
    assert not leases.release("order:7", (acquisition.handle or 0) + 1)
    assert len(leases.live_statuses()) == 1
    heartbeat.drop(lease)
    assert leases.release("order:7", acquisition.handle)
    assert leases.live_statuses() == []
