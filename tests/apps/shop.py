"""The Celery app the acceptance tests run in real worker processes.

Every task of the app is guarded (``task_cls``), as a user switching a whole app would do.
Configuration comes from the environment so the test process and its workers agree.
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

from celery import Celery
from sqlalchemy import insert

import celery_guard
from celery_guard import BY_ARGUMENTS
from celery_guard import signals as guard_signals
from tests.apps.shop_tables import effects, metadata, retry_log

__all__ = ["app", "effects", "metadata", "retry_log"]

app = Celery(
    "shop",
    broker=os.environ.get("CG_BROKER_URL", "redis://127.0.0.1:6379/1"),
    backend=os.environ.get("CG_RESULT_URL", os.environ.get("CG_BROKER_URL")),
    set_as_current=False,
    task_cls="celery_guard:GuardedTask",
)
app.conf.update(
    guard_store_url=os.environ.get("CG_STORE_URL", "sqlite:///shop.sqlite3"),
    guard_store_timeout=float(os.environ.get("CG_STORE_TIMEOUT", "2")),
    # Behind PgBouncer (tests/acceptance/test_pgbouncer.py): transaction pooling, and the
    # direct URL the liveness locks are held through, if any.
    guard_store_pooling=os.environ.get("CG_STORE_POOLING") or "session",
    guard_liveness_url=os.environ.get("CG_LIVENESS_URL") or None,
    guard_lease_ttl=float(os.environ.get("CG_LEASE_TTL", "10")),
    guard_reaper_interval=float(os.environ.get("CG_REAPER_INTERVAL", "2")),
    guard_drain_timeout=float(os.environ.get("CG_DRAIN_TIMEOUT", "30")),
    guard_lease_url=os.environ.get("CG_LEASE_URL") or None,
    guard_backoff_base=float(os.environ.get("CG_BACKOFF_BASE", "0.05")),
    guard_backoff_max=float(os.environ.get("CG_BACKOFF_MAX", "1")),
    guard_max_attempts=int(os.environ.get("CG_MAX_ATTEMPTS", "5")),
    guard_dead_letter_queue=os.environ.get("CG_DEAD_LETTER_QUEUE", "celery_guard.dead_letters"),
    # Several test workers share this host: no metrics endpoint unless a test asks for one.
    guard_metrics_port=int(os.environ["CG_METRICS_PORT"])
    if os.environ.get("CG_METRICS_PORT")
    else None,
    guard_metrics_address="127.0.0.1",
    guard_hard_deadline=float(os.environ["CG_HARD_DEADLINE"])
    if os.environ.get("CG_HARD_DEADLINE")
    else None,
    # Backpressure (celery_guard.circuit): tests shorten the windows.
    guard_circuit_enabled=os.environ.get("CG_CIRCUIT_ENABLED", "1") == "1",
    guard_circuit_min_calls=int(os.environ.get("CG_CIRCUIT_MIN_CALLS", "5")),
    guard_circuit_window=float(os.environ.get("CG_CIRCUIT_WINDOW", "10")),
    guard_circuit_probe_interval=float(os.environ.get("CG_CIRCUIT_PROBE_INTERVAL", "1")),
    guard_circuit_hold=float(os.environ.get("CG_CIRCUIT_HOLD", "5")),
    guard_adaptive_concurrency=os.environ.get("CG_ADAPTIVE_CONCURRENCY", "1") == "1",
    guard_create_tables=os.environ.get("CG_CREATE_TABLES", "1") != "0",
    guard_max_payload_bytes=int(os.environ["CG_MAX_PAYLOAD_BYTES"])
    if os.environ.get("CG_MAX_PAYLOAD_BYTES")
    else 16 * 1024 * 1024,
    guard_track_publishes=os.environ.get("CG_TRACK_PUBLISHES") == "1",
    guard_unclaimed_republish_after=float(os.environ.get("CG_UNCLAIMED_REPUBLISH_AFTER", "300")),
    broker_transport_options={
        "visibility_timeout": float(os.environ.get("CG_VISIBILITY_TIMEOUT", "3600")),
        # Sweep for unacknowledged messages every second, so a short visibility timeout set by
        # a test is honoured promptly (kombu's default sweeps about every 100 s).
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    },
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
    result_expires=600,
)
# Raw settings as JSON, for tests that give a worker a value of the wrong type.
app.conf.update(json.loads(os.environ.get("CG_EXTRA_CONF") or "{}"))
celery_guard.install(app)


@guard_signals.outcome.connect
def record_retry(sender: Any = None, **event: Any) -> None:
    """Keep every retry's delay, so tests can check each against its jitter bound."""
    if event.get("outcome") != guard_signals.RETRIED:
        return
    engine = celery_guard.get_runtime(app).store.engine
    with engine.begin() as connection:
        connection.execute(
            insert(retry_log).values(
                idempotency_key=event["key"], attempt=event["attempts"], delay=event["delay"]
            )
        )


def write_effect(task: Any, tag: str) -> None:
    with task.guard.transaction() as connection:
        connection.execute(
            insert(effects).values(
                tag=tag,
                idempotency_key=task.guard.key,
                fencing_token=task.guard.fencing_token,
                pid=os.getpid(),
            )
        )


@app.task(name="shop.record", bind=True, idempotency_key="record:{tag}")
def record(self: Any, tag: str, value: Any = None) -> dict[str, Any]:
    write_effect(self, tag)
    return {"tag": tag, "value": value}


@app.task(name="shop.record_by_id", bind=True)
def record_by_id(self: Any, tag: str) -> str:
    write_effect(self, tag)
    return tag


@app.task(name="shop.tick", bind=True)
def tick(self: Any) -> str:
    """A periodic-style task without arguments: every call must run."""
    write_effect(self, f"tick:{self.request.id}")
    return "tock"


@app.task(name="shop.by_args", bind=True, idempotency_key=BY_ARGUMENTS)
def by_args(self: Any, tag: str, n: int) -> int:
    write_effect(self, tag)
    return n


@app.task(name="shop.slow", bind=True, idempotency_key="slow:{tag}")
def slow(self: Any, tag: str, seconds: float) -> str:
    time.sleep(seconds)
    write_effect(self, tag)
    return tag


@app.task(
    name="shop.write_then_fail",
    bind=True,
    idempotency_key="wtf:{tag}",
    autoretry_for=(RuntimeError,),
    max_retries=3,
    default_retry_delay=0.1,
)
def write_then_fail(self: Any, tag: str, failures: int) -> int:
    """Writes, then raises on its first ``failures`` attempts (Celery's autoretry retries it)."""
    with self.guard.transaction() as connection:
        connection.execute(insert(effects).values(tag=tag, idempotency_key=self.guard.key))
        if self.request.retries < failures:
            raise RuntimeError(f"planned failure {self.request.retries + 1} of {failures}")
    return int(self.request.retries)


@app.task(name="shop.long_write", bind=True, idempotency_key="long:{tag}")
def long_write(self: Any, tag: str, seconds: float) -> dict[str, Any]:
    """Works for ``seconds``, then writes its effect: a task a worker can die in the middle of."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.05)
    write_effect(self, tag)
    return {"tag": tag, "pid": os.getpid(), "fencing_token": self.guard.fencing_token}


@app.task(name="shop.write_and_hold", bind=True, idempotency_key="hold:{tag}")
def write_and_hold(self: Any, tag: str, seconds: float) -> dict[str, Any]:
    """Writes its effect first, then keeps its transaction open for ``seconds``: its lease must
    be renewed while the body's transaction holds the pool process's connection."""
    with self.guard.transaction() as connection:
        connection.execute(
            insert(effects).values(
                tag=tag,
                idempotency_key=self.guard.key,
                fencing_token=self.guard.fencing_token,
                pid=os.getpid(),
            )
        )
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(0.05)
        self.guard.check()
    return {"tag": tag, "pid": os.getpid(), "fencing_token": self.guard.fencing_token}


@app.task(name="shop.gated", bind=True, idempotency_key="gated:{tag}")
def gated(self: Any, tag: str, limit: float = 120.0) -> dict[str, Any]:
    """Works until the test opens this execution's gate, then writes its effect.

    The gate is a file ``<CG_MARKER_DIR>/<tag>.<fencing token>``, so a test lets each owner of
    the key (the first, the one that took it over...) finish when it chooses. ``limit`` bounds
    the wait: past it the body writes anyway.
    """
    gate = os.path.join(
        os.environ.get("CG_MARKER_DIR", "/nonexistent"), f"{tag}.{self.guard.fencing_token}"
    )
    deadline = time.monotonic() + limit
    while not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.05)
    write_effect(self, tag)
    return {"tag": tag, "pid": os.getpid(), "fencing_token": self.guard.fencing_token}


@app.task(name="shop.hang_first_attempt", bind=True, idempotency_key="hang:{tag}")
def hang_first_attempt(self: Any, tag: str) -> int:
    """The first execution blocks forever on a socket read with no timeout (hard deadline's case)"""
    if self.guard.attempts == 1:
        reader, _writer = socket.socketpair()
        reader.recv(1)  # nothing is ever written: blocks until the process dies
    write_effect(self, tag)
    return int(self.guard.attempts)


@app.task(name="shop.flaky", bind=True, idempotency_key="flaky:{tag}")
def flaky(self: Any, tag: str, failures: int) -> int:
    """Raises a connection error (transient) on its first ``failures`` attempts."""
    with self.guard.transaction() as connection:
        connection.execute(insert(effects).values(tag=tag, idempotency_key=self.guard.key))
        if self.guard.attempts <= failures:
            raise ConnectionError(f"dependency unreachable (attempt {self.guard.attempts})")
    return int(self.guard.attempts)


@app.task(name="shop.reject_order", bind=True, idempotency_key="reject:{tag}")
def reject_order(self: Any, tag: str) -> None:
    """A validation error: permanent, dead-lettered at once."""
    write_effect(self, tag)
    raise ValueError(f"order {tag} has no lines")


@app.task(name="shop.buggy", bind=True, idempotency_key="buggy:{tag}")
def buggy(self: Any, tag: str) -> None:
    """A programming error (a name that does not exist): permanent, dead-lettered at once.

    Each execution appends a line to ``<CG_MARKER_DIR>/<tag>.runs`` (outside the store's
    transaction, which rolls back), so a test counts the executions.
    """
    with open(
        os.path.join(os.environ.get("CG_MARKER_DIR", "/nonexistent"), f"{tag}.runs"), "a"
    ) as runs:
        runs.write(f"{self.guard.attempts}\n")
    write_effect(self, tag)
    return undefined_helper(tag)  # type: ignore[name-defined]  # noqa: F821 - the bug


@app.task(name="shop.poison", bind=True, idempotency_key="poison:{tag}")
def poison(self: Any, tag: str) -> None:
    """Kills its own process every time, as a segfault or the OOM killer would."""
    os.kill(os.getpid(), 9)


@app.task(name="shop.fixable", bind=True, idempotency_key="fixable:{tag}")
def fixable(self: Any, tag: str) -> str:
    """Fails permanently while its bug marker exists; 'fixing the bug' removes the marker."""
    if os.path.exists(os.path.join(os.environ.get("CG_MARKER_DIR", "/nonexistent"), tag)):
        raise ValueError("bug present")
    write_effect(self, tag)
    return tag


@app.task(name="shop.add")
def add(x: int, y: int) -> int:
    return x + y


@app.task(name="shop.replace_with_add", bind=True)
def replace_with_add(self: Any, x: int) -> Any:
    raise self.replace(add.si(x, 100))


@app.task(name="shop.retry_once", bind=True)
def retry_once(self: Any, x: int) -> int:
    if self.request.retries == 0:
        raise self.retry(countdown=0.1)
    return x * 2


@app.task(name="shop.unserializable_result", bind=True, idempotency_key="unser:{tag}")
def unserializable_result(self: Any, tag: str) -> object:
    write_effect(self, tag)
    return object()


@app.task(name="shop.big_result", bind=True, idempotency_key="big:{tag}")
def big_result(self: Any, tag: str, size: int, padding: str = "") -> str:
    """Writes its effect and returns ``size`` characters; ``padding`` only makes the message big."""
    write_effect(self, tag)
    return "x" * size


def _orm_session(connection: Any, mode: str) -> Any:
    from sqlalchemy.orm import Session

    return Session(bind=connection, join_transaction_mode=mode)


@app.task(name="shop.transaction_habit", bind=True, idempotency_key="habit:{tag}", max_attempts=2)
def transaction_habit(self: Any, tag: str, habit: str) -> str:
    """Writes its effect, then does what a body might do with the guard's transaction.

    tests/acceptance/test_body_transaction.py publishes one key per habit, several times.
    """
    row = insert(effects).values(tag=tag, idempotency_key=self.guard.key, pid=os.getpid())
    if habit == "guard_session":
        with self.guard.session() as session:
            session.execute(row)
            session.commit()
        return habit
    with self.guard.transaction() as connection:
        connection.execute(row)
        if habit == "commit":
            connection.commit()
        elif habit == "close":
            connection.close()
        elif habit == "rollback_then_write":
            try:
                connection.rollback()
            except Exception:  # a body that swallows the refusal and goes on
                connection.execute(row)
        elif habit == "session_control_fully":
            session = _orm_session(connection, "control_fully")
            session.execute(row)
            session.commit()
        elif habit == "session_rollback":
            session = _orm_session(connection, "conditional_savepoint")  # the default
            session.execute(row)
            session.rollback()
        elif habit == "nested":
            with connection.begin_nested() as savepoint:
                connection.execute(row)
                savepoint.rollback()  # undoes the second row only
        elif habit == "invalidate":
            connection.invalidate()  # the completion then fails on a connection gone
        else:
            raise ValueError(f"unknown habit {habit!r}")
    return habit


if os.environ.get("CG_LATE_TASK"):
    # A task only newer workers know (a rolling deploy): older ones receive it as unknown.

    @app.task(name="shop.late", bind=True)
    def late(self: Any, tag: str) -> str:
        write_effect(self, tag)
        return tag
