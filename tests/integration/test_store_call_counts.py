"""What the circuit breaker counts, on real servers: each store and Redis lease call is reported
with its latency, and real timeouts (lock wait, statement) are told apart from refusals."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg
import pytest

from celery_guard import GuardConfig, StoreError, StoreUnavailable
from celery_guard.circuit import Circuit
from celery_guard.circuit.timeouts import is_timeout, timed_out
from celery_guard.lease.backends import RedisLeases
from celery_guard.store import ClaimRequest, SqlStore
from tests.rig.ports import free_port
from tests.rig.servers import PostgresServer, RedisServer

Seen = list[tuple[float, StoreError | None]]


@pytest.fixture
def pg_store(pg_url: str) -> Iterator[tuple[SqlStore, Seen]]:
    store = SqlStore(GuardConfig(store_url=pg_url, store_timeout=0.3))
    store.ensure_schema()
    seen: Seen = []
    store.observer = lambda seconds, error: seen.append((seconds, error))
    try:
        yield store, seen
    finally:
        store.dispose()


def claim_request(key: str) -> ClaimRequest:
    return ClaimRequest(
        key=key,
        task_name="t",
        fingerprint=None,
        check_fingerprint=False,
        owner="test/1",
        message=None,
        lease_ttl=10.0,
    )


def test_a_lock_wait_past_the_store_timeout_is_reported_as_a_timeout(
    pg_store: tuple[SqlStore, Seen], pg_url: str
) -> None:
    store, seen = pg_store
    store.keys.claim(claim_request("before"))
    assert len(seen) == 1 and seen[0][1] is None
    with psycopg.connect(pg_url.replace("+psycopg", "")) as locker:
        locker.execute("LOCK TABLE celery_guard_keys IN ACCESS EXCLUSIVE MODE")
        with pytest.raises(StoreUnavailable):
            store.keys.claim(claim_request("blocked"))
        seconds, error = seen[-1]
        assert error is not None and is_timeout(error)
        assert 0.25 < seconds < 2
        store.now()  # another table: answers
        assert seen[-1][1] is None
    store.keys.claim(claim_request("after"))
    assert seen[-1][1] is None


def test_a_refused_connection_is_a_failure_not_a_timeout() -> None:
    store = SqlStore(
        GuardConfig(store_url=f"postgresql://u@127.0.0.1:{free_port()}/db", store_timeout=2.0)
    )
    seen: Seen = []
    store.observer = lambda seconds, error: seen.append((seconds, error))
    with pytest.raises(StoreUnavailable):
        store.now()
    ((seconds, error),) = seen
    assert error is not None
    assert not timed_out(error, seconds, store_timeout=2.0)


def test_redis_lease_calls_are_counted_too(redis_server: RedisServer, sqlite_url: str) -> None:
    circuit = Circuit(GuardConfig(store_timeout=1.0))
    circuit.on_worker_init()
    circuit.record_in_this_process()
    assert circuit.block is not None
    store = SqlStore(GuardConfig(store_url=sqlite_url))
    leases = RedisLeases(redis_server.url_for(9), timeout=1.0, prefix=uuid.uuid4().hex)
    dead = RedisLeases(f"redis://127.0.0.1:{free_port()}/0", timeout=1.0)
    circuit.watch(store, leases)
    circuit.watch(store, dead)
    try:
        held = leases.acquire("k", ttl=30)
        assert held.acquired
        assert leases.renew_leases([("k", held.handle or 0)], ttl=30) == {"k"}
        assert leases.held(["k"]) == {"k"}
        assert leases.release("k", held.handle)
        assert circuit.block.totals().calls == 4
        assert circuit.block.totals().failures == 0
        with pytest.raises(StoreUnavailable):
            dead.acquire("k", ttl=30)
        totals = circuit.block.totals()
        assert (totals.calls, totals.failures) == (5, 1)
    finally:
        leases.close()
        dead.close()
        store.dispose()


def test_an_observer_that_raises_does_not_change_the_call(
    postgres: PostgresServer, pg_store: tuple[SqlStore, Seen]
) -> None:
    store, _ = pg_store

    def broken(seconds: float, error: StoreError | None) -> None:
        raise RuntimeError("metrics are down")

    store.observer = broken
    assert store.now() > 0
