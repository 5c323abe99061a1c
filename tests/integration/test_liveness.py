"""Dead or slow: a process's advisory lock vanishes with it, and the reaper acts at once."""

from __future__ import annotations

import multiprocessing
import os
import signal
from typing import Any

from celery import Celery

from celery_guard import GuardConfig
from celery_guard.lease.backends import SqlLeases
from celery_guard.lease.liveness import ProcessLiveness, owner_lock_id
from celery_guard.reaper import Reaper
from celery_guard.store import ClaimOutcome, ClaimRequest, SqlStore
from tests.rig.procs import pid_alive, wait_until
from tests.rig.servers import PostgresServer, RedisServer


def claim_and_hang(url: str, key: str, ready: Any) -> None:
    store = SqlStore(GuardConfig(store_url=url))
    owner = f"child/{os.getpid()}"
    lock = ProcessLiveness(store.db, recheck_after=30).lock_id(owner)
    outcome = store.keys.claim(
        ClaimRequest(
            key=key,
            task_name="t",
            fingerprint="fp",
            check_fingerprint=True,
            owner=owner,
            owner_lock=lock,
            message='{"task": "t", "args": [], "kwargs": {}, "routing_key": "q", "exchange": ""}',
            lease_ttl=300.0,
        )
    ).outcome
    ready.put((outcome.value, lock))
    signal.pause()  # until the test kills it


def test_a_killed_owner_is_found_dead_at_once_and_its_key_recovered(
    pg_url: str, redis_server: RedisServer
) -> None:
    store = SqlStore(GuardConfig(store_url=pg_url))
    store.ensure_schema()
    context = multiprocessing.get_context("spawn")
    ready = context.Queue()
    child = context.Process(target=claim_and_hang, args=(pg_url, "k", ready), daemon=True)
    child.start()
    app = Celery("liveness", broker=redis_server.url_for(12), set_as_current=False)
    try:
        outcome, lock = ready.get(timeout=60)
        assert outcome == ClaimOutcome.CLAIMED.value
        assert lock == owner_lock_id(f"child/{child.pid}")
        assert store.recovery.dead_owner_keys(limit=10) == [], "a living owner is not dead"
        reaper = Reaper(
            app, store.recovery, SqlLeases(store.keys), interval=1, lease_ttl=300, holder="r"
        )
        assert reaper.run_once().recovered == [], "its 300 s lease is still running"
        assert child.pid is not None
        os.kill(child.pid, signal.SIGKILL)
        wait_until(lambda: not pid_alive(child.pid or 0), 10, "the owner to die")
        report: list[Any] = []
        wait_until(
            lambda: report.append(reaper.run_once()) or report[-1].recovered == ["k"],
            timeout=10,
            what="the dead owner's key to be recovered without waiting for its lease",
        )
        assert any("k" in r.dead_owners for r in report)
    finally:
        child.kill()
        child.join(timeout=10)
        ready.close()
        ready.join_thread()
        app.close()
        store.dispose()


def test_liveness_is_a_no_op_on_sqlite(sqlite_url: str) -> None:
    store = SqlStore(GuardConfig(store_url=sqlite_url))
    assert ProcessLiveness(store.db, recheck_after=10).lock_id("w/1") is None
    assert store.recovery.dead_owner_keys(limit=10) == []
    store.dispose()


def test_a_postgresql_restart_kills_every_lock_but_no_owner(tmp_path: Any) -> None:
    """Every session's advisory lock dies with a restart: that is no proof the owners died.

    A key claimed before the restart is left to its lease, and the lock the process cached is
    taken again on its next claim rather than recorded while no session holds it.
    """
    with PostgresServer() as server:
        url = server.create_database("restart")
        store = SqlStore(GuardConfig(store_url=url, store_timeout=2.0))
        store.ensure_schema()
        liveness = ProcessLiveness(store.db, recheck_after=300)  # the cache alone would not notice
        try:
            lock = liveness.lock_id("w/1")
            assert lock is not None
            store.keys.claim(claim_request("before", lock))
            server.restart()
            store.dispose()
            # The claim's lock died with the server, not with its owner: not dead.
            assert store.recovery.dead_owner_keys(limit=10) == []
            # The process's next claim holds its lock again (on a new session) or records none.
            again = liveness.lock_id("w/1")
            again = again if again is not None else liveness.lock_id("w/1")
            assert again == lock
            store.keys.claim(claim_request("after", again))
            assert store.recovery.dead_owner_keys(limit=10) == [], "its lock is held again"
        finally:
            liveness._drop()
            store.dispose()


def claim_request(key: str, lock: int | None) -> ClaimRequest:
    return ClaimRequest(
        key=key,
        task_name="t",
        fingerprint="fp",
        check_fingerprint=True,
        owner="w/1",
        owner_lock=lock,
        message=None,
        lease_ttl=300.0,
    )
