"""Recovery after a whole-worker SIGKILL, and heartbeat write load: plain Celery vs GuardedTask.

Run from the repository root (``--help`` lists the options)::

    .venv/bin/python bench/recovery.py --runs 3 --output docs/benchmarks.md

Private servers are started with the test rig: PostgreSQL (the store, with pg_stat_statements
preloaded), one Redis for the broker and the start markers, and a second Redis that holds only
the leases of the Redis-lease variants (so its command counters are the leases' alone).

1. **Recovery.** Per variant and run: a fresh database and queue, two real prefork workers
   (concurrency 1, prefetch multiplier 1) of ``bench/recovery_app.py``. One task works for
   ``--task-seconds`` then writes one row. Once it runs, the whole worker running it (main
   process and pool child, one process group) is SIGKILLed; the benchmark then measures, from
   the kill, when the body started again (stamped by the worker) and when the row became
   visible (polled every 20 ms), giving up after ``--cap`` seconds. A guarded variant is run
   twice per run: the task is put (with Celery's ``cancel_consumer``/``add_consumer``) on the
   worker that does not lead the reaper, then on the leader, because only the leader acts.
2. **Heartbeat load.** ``--load-tasks`` guarded tasks that sleep ``--load-seconds`` run at once
   in ``--load-workers`` workers (threads pool); over a ``--window`` second window in the steady
   state, PostgreSQL's counters (pg_stat_statements, pg_stat_user_tables, pg_stat_database) and
   the lease Redis's ``INFO commandstats`` are sampled, SQL leases against Redis leases.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import math
import os
import re
import shlex
import signal
import socket
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # so that ``tests.rig`` and ``bench`` import when run as a script
    sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402
import sqlalchemy  # noqa: E402
from celery import Celery  # noqa: E402

import celery_guard  # noqa: E402
from bench import recovery_app  # noqa: E402  (importing it reads no server: install is offline)
from bench.overhead import code_revision, machine_info, write_section  # noqa: E402
from celery_guard import GuardConfig  # noqa: E402
from tests.rig import procs  # noqa: E402
from tests.rig.servers import PostgresServer, RedisServer  # noqa: E402
from tests.rig.workers import WorkerProcess  # noqa: E402

HEADING = "## Recovery (bench/recovery.py)"
APP = "bench.recovery_app"
BROKER_DB, MARKER_DB = 0, 1
DEFAULTS = GuardConfig()
#: kombu's Redis transport default, which the app leaves alone.
VISIBILITY_TIMEOUT = 3600.0
POLL = 0.02
#: After ``cancel_consumer``, a BRPOP the worker already sent (kombu waits up to 1 s) may still
#: hand it a message; this long is waited before publishing.
BRPOP_SETTLE = 1.5
#: Which worker is killed: the one running the task, chosen as the reaper's leader or not.
CASES = {
    "": "the one running the task",
    "other": "the worker not leading the reaper",
    "leader": "the reaper's leader",
}
#: ``--keep-logs``: where each worker's log is copied before its directory is removed.
KEEP_LOGS: Path | None = None


@dataclass(frozen=True)
class KillVariant:
    name: str
    label: str
    guarded: bool
    lease: str = "sql"  # where a guarded task's lease lives: "sql" (the row) or "redis"
    lease_ttl: float | None = None  # None: celery_guard's default
    liveness_locks: bool | None = None  # None: celery_guard's default

    @property
    def task(self) -> str:
        return "recovery.guarded_long" if self.guarded else "recovery.plain_long"

    @property
    def ttl(self) -> float:
        return self.lease_ttl if self.lease_ttl is not None else DEFAULTS.lease_ttl


KILL_VARIANTS = (
    KillVariant(
        "vanilla",
        "plain Celery task, `acks_late=True`, `task_reject_on_worker_lost=True`, Redis broker "
        f"with the default visibility timeout ({VISIBILITY_TIMEOUT:.0f} s)",
        guarded=False,
        lease="",
    ),
    KillVariant(
        "guarded_sql",
        f"GuardedTask, SQL leases, defaults (`guard_lease_ttl` {DEFAULTS.lease_ttl:g} s, "
        f"`guard_reaper_interval` {DEFAULTS.reaper_interval:g} s, `guard_liveness_locks` "
        f"{getattr(DEFAULTS, 'liveness_locks', 'n/a')})",
        guarded=True,
    ),
    KillVariant(
        "guarded_redis",
        "GuardedTask, Redis leases (`guard_lease_url`), defaults otherwise",
        guarded=True,
        lease="redis",
    ),
    KillVariant(
        "guarded_sql_nolive",
        "GuardedTask, SQL leases, `guard_liveness_locks = False` (the lease-TTL path), defaults "
        "otherwise",
        guarded=True,
        liveness_locks=False,
    ),
    KillVariant(
        "guarded_sql_ttl2",
        "GuardedTask, SQL leases, `guard_lease_ttl` 2 s (reaper interval default)",
        guarded=True,
        lease_ttl=2.0,
    ),
)


# -- the servers --------------------------------------------------------------------------------


class Rig:
    """The private servers, a Celery client to publish with, and fresh databases on demand."""

    def __init__(self) -> None:
        self.postgres = PostgresServer()
        self.broker = RedisServer()  # db 0: broker; db 1: start markers
        self.leases = RedisServer()  # db 0: leases of the Redis-lease variants, nothing else
        self.client: Celery | None = None

    def start(self) -> None:
        self.postgres.start()
        with psycopg.connect(self.postgres.dsn_for("postgres"), autocommit=True) as connection:
            # Counts every statement the moment it ends, unlike the cumulative statistics that
            # backends flush at most once a second.
            connection.execute("ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'")
        self.postgres.restart()
        self.broker.start()
        self.leases.start()
        self.client = Celery(
            "recovery-client", broker=self.broker.url_for(BROKER_DB), set_as_current=False
        )

    def stop(self) -> None:
        try:
            if self.client is not None:
                self.client.close()
        finally:
            try:
                self.postgres.stop()  # each by PID; one never started is a no-op
            finally:
                try:
                    self.broker.stop()
                finally:
                    self.leases.stop()

    def fresh_database(self, prefix: str) -> str:
        """A new database with celery_guard's tables, bench_effects and pg_stat_statements."""
        name = f"{prefix}_{uuid.uuid4().hex[:6]}"
        url = self.postgres.create_database(name)
        engine = sqlalchemy.create_engine(url, poolclass=sqlalchemy.NullPool)
        celery_guard.metadata.create_all(engine)
        recovery_app.metadata.create_all(engine)
        engine.dispose()
        with psycopg.connect(self.postgres.dsn_for(name), autocommit=True) as connection:
            connection.execute("CREATE EXTENSION pg_stat_statements")
        return url

    def worker_env(
        self,
        store_url: str,
        guarded: bool,
        lease: str,
        lease_ttl: float | None = None,
        liveness_locks: bool | None = None,
    ) -> dict[str, str]:
        return {
            "BENCH_BROKER_URL": self.broker.url_for(BROKER_DB),
            "BENCH_MARKER_URL": self.broker.url_for(MARKER_DB),
            "BENCH_STORE_URL": store_url,
            "BENCH_INSTALL_GUARD": "1" if guarded else "0",
            "BENCH_LEASE_URL": self.leases.url_for(0) if lease == "redis" else "",
            "BENCH_LEASE_TTL": "" if lease_ttl is None else repr(lease_ttl),
            "BENCH_LIVENESS_LOCKS": "" if liveness_locks is None else str(int(liveness_locks)),
        }

    def reset_redis(self) -> None:
        """Drop what a run left in Redis (e.g. a killed worker's unacknowledged message)."""
        for server, db in ((self.broker, BROKER_DB), (self.broker, MARKER_DB), (self.leases, 0)):
            with server.client(db) as client:
                client.flushdb()

    def send(self, name: str, args: tuple[Any, ...], queue: str, **options: Any) -> None:
        assert self.client is not None
        self.client.send_task(name, args=args, queue=queue, **options)


def dsn_of(url: str) -> str:
    """psycopg's connection string for a SQLAlchemy ``postgresql+psycopg://`` URL."""
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


# -- worker processes and their logs ------------------------------------------------------------


@dataclass
class LogFindings:
    """Lines of interest in the workers' logs, with where they came from."""

    errors: list[tuple[str, str]] = field(default_factory=list)  # Traceback / ERROR / CRITICAL
    warnings: list[tuple[str, str]] = field(default_factory=list)
    #: ``worker state X -> FENCED`` transitions, and those a process never left (until it ended).
    fenced: list[tuple[str, str]] = field(default_factory=list)
    left_fenced: list[tuple[str, str]] = field(default_factory=list)

    def scan(self, where: str, text: str) -> None:
        still_fenced: dict[str, str] = {}
        for line in text.splitlines():
            if "Traceback" in line or re.search(r"\b(ERROR|CRITICAL)\b", line):
                self.errors.append((where, line))
            elif re.search(r"\bWARNING\b", line):
                self.warnings.append((where, line))
            state = re.search(r"celery_guard worker state (\w+) -> (\w+)", line)
            if state:
                match = _LOG_LINE.match(line)
                process = match.group(3) if match else "?"
                if state.group(2) == "FENCED":
                    self.fenced.append((where, line))
                    still_fenced[process] = line
                elif state.group(1) == "FENCED" and state.group(2) in ("READY", "PROCESSING"):
                    still_fenced.pop(process, None)
        self.left_fenced += [(where, line) for line in still_fenced.values()]


_LOG_LINE = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}): (\w+)/([^\]]*)\] (.*)$")


def log_time(line: str) -> float | None:
    """Epoch seconds of a Celery log line (``[YYYY-mm-dd HH:MM:SS,mmm: LEVEL/Process] ...``)."""
    match = _LOG_LINE.match(line)
    if not match:
        return None
    stamp = datetime.datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f")
    return stamp.timestamp()  # the worker logs local time; so does this conversion


@contextmanager
def workers_running(
    count: int,
    env: dict[str, str],
    findings: LogFindings,
    where: str,
    app: str = APP,
    **options: Any,
) -> Iterator[list[WorkerProcess]]:
    """Start ``count`` workers, wait until all are ready; stop each by PID and scan its log."""
    workers = [
        WorkerProcess(
            app, env=env, cwd=ROOT, hostname=f"{where}-w{i}-{uuid.uuid4().hex[:4]}@%h", **options
        )
        for i in range(1, count + 1)
    ]
    try:
        for worker in workers:
            worker.start(wait_ready=False)
        for worker in workers:
            worker.wait_ready(timeout=60)  # kills the worker and raises with its log tail
        yield workers
    finally:
        for worker in workers:
            try:
                worker.stop(timeout=20)  # warm shutdown by PID, SIGKILL of the group after 20 s
            finally:
                findings.scan(f"{where} {worker_name(worker)}", worker.log_text())
                if KEEP_LOGS is not None:
                    KEEP_LOGS.mkdir(parents=True, exist_ok=True)
                    (KEEP_LOGS / f"{where}-{worker_name(worker)}.log").write_text(worker.log_text())
                worker.cleanup()  # already stopped; removes its log directory


def worker_name(worker: WorkerProcess) -> str:
    return worker.hostname.split("@", 1)[0]


def nodename(worker: WorkerProcess) -> str:
    return worker.hostname.replace("%h", socket.gethostname())


def set_consuming(rig: Rig, worker: WorkerProcess, queue: str, consuming: bool) -> None:
    """Celery remote control: ``add_consumer`` / ``cancel_consumer``, waiting for the reply."""
    assert rig.client is not None
    control, node = rig.client.control, nodename(worker)
    call = control.add_consumer if consuming else control.cancel_consumer
    replies = call(queue, destination=[node], reply=True, timeout=10)
    if not any("ok" in (reply.get(node) or {}) for reply in replies or []):
        raise RuntimeError(f"{node}: no ok to {call.__name__}({queue!r}) within 10 s: {replies!r}")


def worker_of(workers: list[WorkerProcess], pid: int) -> WorkerProcess | None:
    for worker in workers:
        if worker.is_alive() and pid in worker.child_pids():
            return worker
    return None


def wait_for(predicate: Callable[[], object], timeout: float, what: str) -> None:
    procs.wait_until(predicate, timeout, what, POLL)


# -- part 1: recovery after a whole-worker SIGKILL ----------------------------------------------


@dataclass
class KillRun:
    variant: str
    run: int
    #: "leader" / "other": the task was put on the reaper's leader / the other worker; "": vanilla.
    case: str = ""
    victim: str = ""
    victim_led_reaper: bool | None = None
    first_started_at: float = math.nan
    killed_at: float = math.nan
    #: When the killed execution's lease ran out (row or Redis), epoch seconds.
    lease_expires_at: float | None = None
    #: When the reaper logged the owner dead (liveness lock gone), and the re-publish.
    dead_owner_at: float | None = None
    republished_at: float | None = None
    restarted_at: float | None = None
    done_at: float | None = None
    second_started_at: float | None = None
    second_finished_at: float | None = None
    state: str = ""
    notes: list[str] = field(default_factory=list)

    def since_kill(self, moment: float | None) -> float | None:
        return None if moment is None else moment - self.killed_at

    @property
    def kill_to_restart(self) -> float | None:
        return self.since_kill(self.restarted_at)

    @property
    def kill_to_done(self) -> float | None:
        return self.since_kill(self.done_at)

    @property
    def own_run(self) -> float | None:
        """The successful execution's own time, body start to row visible."""
        if self.restarted_at is None or self.done_at is None:
            return None
        return self.done_at - self.restarted_at


def run_kill(
    rig: Rig,
    variant: KillVariant,
    run: int,
    args: argparse.Namespace,
    findings: LogFindings,
    kill_leader: bool | None = None,
) -> KillRun:
    store_url = rig.fresh_database(f"kill_{variant.name}_{run}")
    queue = f"recovery.{variant.name}.{run}.{uuid.uuid4().hex[:6]}"
    env = rig.worker_env(
        store_url, variant.guarded, variant.lease, variant.lease_ttl, variant.liveness_locks
    )
    tag = uuid.uuid4().hex[:12]
    key = f"long:{tag}"
    case = "" if kill_leader is None else ("leader" if kill_leader else "other")
    result = KillRun(variant.name, run, case)
    where = f"{variant.name}-{case or 'any'}-r{run}"
    options = {"concurrency": 1, "queues": queue}
    try:
        with (
            workers_running(2, env, findings, where, **options) as workers,
            psycopg.connect(dsn_of(store_url), autocommit=True) as db,
            rig.broker.client(MARKER_DB) as markers,
            rig.broker.client(BROKER_DB) as broker,
            rig.leases.client(0) as leases,
        ):

            def starts() -> list[dict[str, float]]:
                raw = markers.lrange(recovery_app.started_key(tag), 0, -1)
                return [json.loads(entry) for entry in raw]

            target = bystander = None
            if variant.guarded:
                # As in a cluster that has been up for a while: one worker already leads.
                wait_for(lambda: reaper_leader(db), 30, "a worker to lead the reaper")
                holder = reaper_leader(db) or ""
                leading = [w for w in workers if holder.startswith(worker_name(w) + "@")]
                if len(leading) != 1:
                    raise RuntimeError(f"the reaper's leader {holder!r} is none of the workers")
                others = [w for w in workers if w is not leading[0]]
                target, bystander = (
                    (leading[0], others[0]) if kill_leader else (others[0], leading[0])
                )
                # The task must run on ``target``: the other worker stops consuming meanwhile.
                set_consuming(rig, bystander, queue, False)
                time.sleep(BRPOP_SETTLE)
                # Publish right after a pass of the leader (it moves its election lease on).
                expires = leader_expiry(db)
                wait_for(lambda: leader_expiry(db) != expires, 30, "the next reaper pass")
            rig.send(variant.task, (tag, args.task_seconds), queue)

            victims: list[WorkerProcess] = []

            def running() -> bool:
                started = starts()
                if not started:
                    return False
                pid = int(started[0]["pid"])
                if variant.guarded:  # the store must say so too: RUNNING, owned by that child
                    row = key_row(db, key)
                    if row is None or row["state"] != "RUNNING" or not row["owner"]:
                        return False
                    pid = int(str(row["owner"]).rsplit("/", 1)[1])
                victim = worker_of(workers, pid)
                if victim is None:
                    return False
                victims.append(victim)
                result.first_started_at = float(started[0]["at"])
                return True

            wait_for(running, 30, f"{variant.task}({tag!r}) to run in a pool child")
            victim = victims[-1]
            result.victim = worker_name(victim)
            if target is not None and bystander is not None:
                if victim is not target:
                    raise RuntimeError(f"{tag} ran on {result.victim}, which was not consuming")
                set_consuming(rig, bystander, queue, True)  # the survivor consumes when it dies
            if variant.guarded:
                leader = reaper_leader(db)
                result.victim_led_reaper = leader is not None and leader.startswith(
                    result.victim + "@"
                )

            result.killed_at = time.time()
            procs.signal_group(victim.pid, signal.SIGKILL)  # main process and child at once
            victim.kill()  # waits (bounded) until no process of its tree is left
            if variant.lease == "sql":
                row = key_row(db, key)
                result.lease_expires_at = row["lease_expires_at"] if row else None
            elif variant.lease == "redis":
                pttl = leases.pttl(f"celery_guard:{{{key}}}:lease")
                result.lease_expires_at = time.time() + pttl / 1000 if pttl > 0 else None

            deadline = result.killed_at + args.cap
            while time.time() < deadline:
                started = starts()
                if len(started) >= 2 and result.restarted_at is None:
                    result.restarted_at = float(started[1]["at"])
                effect = db.execute(
                    "SELECT started_at, finished_at FROM bench_effects WHERE tag = %s", (tag,)
                ).fetchone()
                if effect is not None:
                    result.done_at = time.time()
                    result.second_started_at, result.second_finished_at = effect
                    break
                time.sleep(POLL)
            started = starts()
            if len(started) >= 2 and result.restarted_at is None:
                result.restarted_at = float(started[1]["at"])
            if len(started) > 2:
                result.notes.append(f"{len(started)} executions started")

            if result.done_at is not None:
                count = db.execute(
                    "SELECT count(*) FROM bench_effects WHERE tag = %s", (tag,)
                ).fetchone()
                if count and count[0] != 1:
                    result.notes.append(f"{count[0]} effect rows")
            if variant.guarded:
                row = key_row(db, key)
                if row is not None:
                    result.state = (
                        f"{row['state']} {row['claim_reason']} token {row['fencing_token']}"
                    )
            else:
                due = broker.zrange("unacked_index", 0, -1, withscores=True)
                if due:
                    restore_at = min(score for _, score in due) + VISIBILITY_TIMEOUT
                    result.state = (
                        f"message unacknowledged in kombu's `unacked`; restored "
                        f"{restore_at - result.killed_at:.0f} s after the kill"
                    )
                else:
                    result.state = "no unacknowledged message left in the broker"
            logs = {worker_name(worker): worker.log_text() for worker in workers}
    finally:
        rig.reset_redis()
    if variant.guarded:
        for text in logs.values():
            for line in text.splitlines():
                if f"re-published key={key} " in line:
                    result.republished_at = log_time(line)
                elif f"owner of key={key} " in line and "dead" in line:
                    result.dead_owner_at = log_time(line)
    return result


def key_row(db: psycopg.Connection[Any], key: str) -> dict[str, Any] | None:
    cursor = db.execute(
        "SELECT state, owner, fencing_token, claim_reason, lease_expires_at "
        "FROM celery_guard_keys WHERE key = %s",
        (key,),
    )
    row = cursor.fetchone()
    if row is None:
        return None
    return dict(zip([column.name for column in cursor.description or ()], row, strict=True))


def leader_expiry(db: psycopg.Connection[Any]) -> float | None:
    row = db.execute("SELECT expires_at FROM celery_guard_leaders WHERE name = 'reaper'").fetchone()
    return float(row[0]) if row else None


def reaper_leader(db: psycopg.Connection[Any]) -> str | None:
    """The reaper's current leader (a worker's hostname), if its election lease is live."""
    row = db.execute(
        "SELECT holder FROM celery_guard_leaders WHERE name = 'reaper' "
        "AND expires_at > EXTRACT(EPOCH FROM clock_timestamp())"
    ).fetchone()
    return str(row[0]) if row else None


# -- part 2: heartbeat write load ---------------------------------------------------------------


@dataclass(frozen=True)
class LoadConfig:
    pool: str
    workers: int
    tasks: int

    @property
    def concurrency(self) -> int:
        return self.tasks // self.workers

    def describe(self) -> str:
        return (
            f"{self.workers} workers, `--pool {self.pool} --concurrency {self.concurrency}` "
            f"({self.tasks} tasks)"
        )


@dataclass
class Snapshot:
    at: float
    #: pg_stat_statements, summed by kind: kind -> (calls, rows).
    statements: dict[str, tuple[int, int]]
    #: pg_stat_database and pg_stat_user_tables counters.
    counters: dict[str, int]
    #: The lease Redis: ``INFO commandstats`` calls by command, and total_commands_processed.
    redis_calls: dict[str, int]
    redis_total: int


@dataclass
class LoadRun:
    lease: str
    config: LoadConfig
    window: float = 0.0
    claim_spread: float = 0.0
    window_after_claim: float = 0.0
    #: pg_stat_statements per kind: (statements/s, rows/s).
    statements: dict[str, tuple[float, float]] = field(default_factory=dict)
    #: pg_stat_database / pg_stat_user_tables counters, per second.
    counters: dict[str, float] = field(default_factory=dict)
    #: The lease Redis: calls/s by command (INFO commandstats), and total_commands_processed/s.
    redis: dict[str, float] = field(default_factory=dict)
    redis_total: float = 0.0
    notes: list[str] = field(default_factory=list)


def classify(query: str) -> str:
    """What a statement is, from pg_stat_statements' normalised text."""
    sql = " ".join(query.split())
    head = sql[:80].upper()
    if "PG_STAT" in sql.upper():
        return "benchmark's own counter reads"
    if "pg_try_advisory_lock" in sql:
        return "liveness: pg_try_advisory_lock"
    if "pg_locks" in sql:
        return "reaper: dead-owner scan SELECT (pg_locks)"
    if head.startswith("UPDATE CELERY_GUARD_KEYS SET LEASE_EXPIRES_AT"):
        if " IN (" in sql:  # every lease a process holds, one statement
            return "heartbeat: lease renewal UPDATE"
        return "reaper: end a dead owner's lease UPDATE"
    if head.startswith("UPDATE CELERY_GUARD_KEYS") and "completed_at" in sql:
        return "completion UPDATE"
    if head.startswith("UPDATE CELERY_GUARD_KEYS") and "republished_at" in sql:
        return "reaper: mark re-published UPDATE"
    if head.startswith("INSERT INTO CELERY_GUARD_KEYS"):
        return "claim INSERT ... ON CONFLICT"
    if head.startswith("INSERT INTO CELERY_GUARD_LEADERS"):
        return "reaper: leader election upsert"
    if head.startswith("SELECT") and "FROM celery_guard_keys" in sql and "republished_at" in sql:
        return "reaper: orphan scan SELECT"
    if head.startswith("SELECT CAST(EXTRACT(") and "celery_guard" not in sql:
        return "reaper: database clock SELECT"
    if head.startswith("DELETE FROM CELERY_GUARD_KEYS"):
        return "reaper: prune DELETE"
    return f"other: {sql[:60]}"


def snapshot(db: psycopg.Connection[Any], leases: Any) -> Snapshot:
    at = time.monotonic()
    db.execute("SELECT pg_stat_clear_snapshot()")
    statements: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for query, calls, rows in db.execute(
        "SELECT query, calls, rows FROM pg_stat_statements "
        "WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())"
    ):
        kind = classify(query)
        statements[kind][0] += calls
        statements[kind][1] += rows
    row = db.execute(
        "SELECT d.xact_commit, d.tup_updated, k.n_tup_upd, k.n_tup_hot_upd, l.n_tup_upd "
        "FROM pg_stat_database d, pg_stat_user_tables k, pg_stat_user_tables l "
        "WHERE d.datname = current_database() AND k.relname = 'celery_guard_keys' "
        "AND l.relname = 'celery_guard_leaders'"
    ).fetchone()
    assert row is not None, "pg_stat_user_tables has no celery_guard tables"
    names = (
        "pg_stat_database.xact_commit",
        "pg_stat_database.tup_updated",
        "celery_guard_keys n_tup_upd",
        "celery_guard_keys n_tup_hot_upd",
        "celery_guard_leaders n_tup_upd",
    )
    commandstats = leases.info("commandstats")
    total = int(leases.info("stats")["total_commands_processed"])
    return Snapshot(
        at=at,
        statements={kind: (calls, rows) for kind, (calls, rows) in statements.items()},
        counters=dict(zip(names, (int(value) for value in row), strict=True)),
        redis_calls={
            name.removeprefix("cmdstat_"): int(stats["calls"])
            for name, stats in commandstats.items()
        },
        redis_total=total,
    )


def run_load(
    rig: Rig, lease: str, config: LoadConfig, args: argparse.Namespace, findings: LogFindings
) -> LoadRun:
    store_url = rig.fresh_database(f"load_{lease}")
    queue = f"recovery.load.{lease}.{uuid.uuid4().hex[:6]}"
    env = rig.worker_env(store_url, True, lease, None)
    result = LoadRun(lease, config, window=args.window)
    where = f"load-{lease}-{config.pool}"
    options = {"concurrency": config.concurrency, "pool": config.pool, "queues": queue}
    ttl = DEFAULTS.lease_ttl
    try:
        with (
            workers_running(config.workers, env, findings, where, **options),
            psycopg.connect(dsn_of(store_url), autocommit=True) as db,
            rig.leases.client(0) as leases,
        ):
            assert rig.client is not None
            with rig.client.producer_or_acquire() as producer:
                for n in range(config.tasks):
                    rig.send(
                        "recovery.guarded_sleep", (n, args.load_seconds), queue, producer=producer
                    )

            def count(state: str) -> int:
                row = db.execute(
                    "SELECT count(*) FROM celery_guard_keys WHERE state = %s", (state,)
                ).fetchone()
                return int(row[0]) if row else 0

            try:
                wait_for(lambda: count("RUNNING") >= config.tasks, 120, "every task to run")
            except TimeoutError as exc:
                raise RuntimeError(
                    f"{exc}: {count('RUNNING')} of {config.tasks} RUNNING, "
                    f"{count('COMPLETED')} COMPLETED, {count('RELEASED')} RELEASED"
                ) from None
            first, last = db.execute(
                "SELECT min(created_at), max(created_at) FROM celery_guard_keys"
            ).fetchone() or (0.0, 0.0)
            result.claim_spread = last - first
            # Steady state for both lease kinds: with Redis leases the reaper starts reading
            # the running keys' rows once their claim-time lease (never renewed) has passed.
            start = last + ttl + 0.5
            end = start + args.window
            if end > first + args.load_seconds - 1.0:
                raise RuntimeError(
                    f"the window would end {end - first:.1f} s after the first claim, but the "
                    f"first task ends after {args.load_seconds:g} s: raise --load-seconds"
                )
            result.window_after_claim = start - last
            time.sleep(max(0.0, start - time.time()))
            before = snapshot(db, leases)
            time.sleep(max(0.0, end - time.time()))
            after = snapshot(db, leases)
            still = count("RUNNING")
            if still != config.tasks:
                result.notes.append(f"only {still} of {config.tasks} still RUNNING at the end")
            try:
                wait_for(
                    lambda: count("COMPLETED") >= config.tasks,
                    args.load_seconds + 120,
                    "every task to complete",
                )
            except TimeoutError as exc:
                raise RuntimeError(
                    f"{exc}: {count('COMPLETED')} of {config.tasks} COMPLETED, "
                    f"{count('RUNNING')} RUNNING, {count('RELEASED')} RELEASED"
                ) from None
            first_claims = db.execute(
                "SELECT count(*) FROM celery_guard_keys WHERE state = 'COMPLETED' "
                "AND fencing_token = 1 AND attempts = 1"
            ).fetchone()
            if not first_claims or first_claims[0] != config.tasks:
                result.notes.append(
                    f"{first_claims[0] if first_claims else 0} of {config.tasks} keys completed "
                    "by their first claim (token 1)"
                )
            else:
                result.notes.append("every key completed by its first claim (token 1)")
    finally:
        rig.reset_redis()
    seconds = after.at - before.at
    result.window = seconds
    for kind in sorted(set(before.statements) | set(after.statements)):
        calls0, rows0 = before.statements.get(kind, (0, 0))
        calls1, rows1 = after.statements.get(kind, (0, 0))
        result.statements[kind] = ((calls1 - calls0) / seconds, (rows1 - rows0) / seconds)
    for name in after.counters:
        result.counters[name] = (after.counters[name] - before.counters[name]) / seconds
    for command in sorted(set(before.redis_calls) | set(after.redis_calls)):
        delta = after.redis_calls.get(command, 0) - before.redis_calls.get(command, 0)
        if delta and command != "info":  # INFO: the benchmark's own snapshots
            result.redis[command] = delta / seconds
    # Less the two INFO calls of the first snapshot, which come after its reading.
    result.redis_total = (after.redis_total - before.redis_total - 2) / seconds
    return result


def measure_load(
    rig: Rig, args: argparse.Namespace, findings: LogFindings
) -> tuple[LoadConfig, dict[str, LoadRun], list[str]]:
    """Both lease kinds on threads workers; on failure, both again on prefork with fewer tasks."""
    configs = [LoadConfig(args.load_pool, args.load_workers, args.load_tasks)]
    if args.load_pool == "threads":
        configs.append(
            LoadConfig("prefork", args.load_workers, args.load_workers * args.fallback_concurrency)
        )
    problems: list[str] = []
    for config in configs:
        try:
            runs = {}
            for lease in ("sql", "redis"):
                print(f"heartbeat load: {lease} leases, {config.describe()}", flush=True)
                runs[lease] = run_load(rig, lease, config, args, findings)
            return config, runs, problems
        except Exception as exc:  # reported, then the fallback configuration is tried
            problems.append(f"{config.describe()}: {type(exc).__name__}: {exc}")
            print(f"heartbeat load failed with {config.describe()}: {exc}", flush=True)
    raise RuntimeError("heartbeat load failed:\n" + "\n".join(problems))


# -- report -------------------------------------------------------------------------------------


def fmt(value: float | None, digits: int = 1) -> str:
    return "" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def median_or_none(values: list[float | None]) -> float | None:
    """The median when every run has a value, else None (a run that did not recover)."""
    if not values or any(value is None for value in values):
        return None
    return statistics.median([value for value in values if value is not None])


def render(
    args: argparse.Namespace,
    kills: dict[str, list[KillRun]],
    load: tuple[LoadConfig, dict[str, LoadRun], list[str]],
    findings: LogFindings,
    server_errors: list[str],
    info: dict[str, str],
    command: str,
    wall: float,
) -> str:
    today = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    cap = f"{args.cap:g}"
    out = [
        HEADING,
        "",
        f"Measured {today} with `{command}` (total wall time {wall:.0f} s).",
        "",
        "### Time to recover after a whole-worker SIGKILL",
        "",
        "Per variant and run: a fresh PostgreSQL database and queue, and two real `celery worker` "
        "processes (prefork, concurrency 1, prefetch multiplier 1) on a private Redis broker whose "
        f"visibility timeout is kombu's default ({VISIBILITY_TIMEOUT:.0f} s). One task works for "
        f"{args.task_seconds:g} s, then writes one row (guarded: in `self.guard.transaction()`, "
        "committed with the COMPLETED marker). As soon as the task runs (guarded: its key is "
        "RUNNING and owned by a pool child; every variant: the body's start marker), the worker "
        "running it is SIGKILLed as a whole (main process and child, one process group), so its "
        "lease has nearly its full TTL left, the slowest case. Whether the killed worker leads the "
        "reaper (one worker at a time acts) matters, so every guarded run kills twice, in fresh "
        "workers each time: once the worker that does not lead, once the leader. The benchmark "
        "waits until a leader is elected, has the other worker stop consuming the queue (Celery "
        f"remote control `cancel_consumer`, then {BRPOP_SETTLE:g} s for its pending BRPOP) when "
        "the task must run on the leader (and the leader when it must not), publishes the task "
        "right after a reaper pass (the leader's election lease moves on), and has the idle worker "
        "consume again (`add_consumer`, acknowledged) once the task runs, before the kill. The "
        "kill thus falls just after a reaper pass, the slowest phase of its interval. "
        "*restart*: the second execution's body starts (stamped by the worker); *done*: the row "
        f"is visible (polled every {POLL * 1000:.0f} ms); *own run*: restart to done, the task's "
        f"own {args.task_seconds:g} s plus its commit. Nothing is subtracted. Median of "
        f"{args.runs} interleaved runs; every wait for recovery is capped at {cap} s.",
        "",
        "| Variant | Worker killed | Kill → restart (s) | Kill → done (s) | Own run (s) | "
        "Vanilla / this (kill → done) | Kill → done, every run (s) |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    groups = [
        (variant, case, [run for run in kills.get(variant.name, []) if run.case == case])
        for variant in KILL_VARIANTS
        for case in CASES
    ]
    groups = [(variant, case, runs) for variant, case, runs in groups if runs]
    vanilla = median_or_none([run.kill_to_done for run in kills.get("vanilla", [])])
    never = f"not recovered within {cap} s"
    for variant, case, runs in groups:
        restart = median_or_none([run.kill_to_restart for run in runs])
        done = median_or_none([run.kill_to_done for run in runs])
        own = median_or_none([run.own_run for run in runs])
        if variant.name == "vanilla":
            ratio = "baseline"
        elif done is None:
            ratio = ""
        elif vanilla is not None:
            ratio = f"{vanilla / done:.1f}x"
        elif "vanilla" in kills:
            ratio = f"> {cap} s cap, i.e. at least {args.cap / done:.1f}x"
        else:
            ratio = ""
        every = ", ".join(fmt(run.kill_to_done) or "—" for run in runs)
        out.append(
            f"| {variant.name} | {CASES[case]} | {fmt(restart) or never} | "
            f"{fmt(done) or never} | {fmt(own, 2)} | {ratio} | {every} |"
        )
    out += [""]
    out += [
        f"- **{variant.name}**: {variant.label}."
        for variant in KILL_VARIANTS
        if variant.name in kills
    ]
    if "vanilla" in kills:
        recovered = [run for run in kills["vanilla"] if run.done_at is not None]
        out += [
            "",
            f"Vanilla: recovered within {cap} s in {len(recovered)} of {len(kills['vanilla'])} "
            f"runs; it waits for the visibility timeout ({VISIBILITY_TIMEOUT:.0f} s by default). "
            "What the broker held after the wait: "
            f"{'; '.join(sorted({run.state for run in kills['vanilla']}))}.",
        ]
    guarded_runs = [run for _, case, runs in groups if case for run in runs]
    if guarded_runs:
        out += [
            "",
            "Where the time goes, every guarded run, in seconds from the kill. *Leader killed*: "
            "the killed worker held the reaper's election lease when it was killed. *Lease "
            "ends*: when the killed execution's lease would have run out (row or Redis, read right "
            "after the kill). *Dead owner*: the reaper's log line `owner of key=... is dead "
            "(liveness lock gone)`; *re-published*: its `re-published key=...` line (worker log "
            "times, millisecond resolution).",
            "",
            "| Variant | Run | Leader killed | Lease ends | Dead owner | Re-published | Restart | "
            "Done | Key afterwards |",
            "|---|---:|---|---:|---:|---:|---:|---:|---|",
        ]
        for run in guarded_runs:
            notes = f" ({'; '.join(run.notes)})" if run.notes else ""
            leader = {True: "yes", False: "no", None: "?"}[run.victim_led_reaper]
            out.append(
                f"| {run.variant} | {run.run} | {leader} | "
                f"{fmt(run.since_kill(run.lease_expires_at))} | "
                f"{fmt(run.since_kill(run.dead_owner_at)) or '—'} | "
                f"{fmt(run.since_kill(run.republished_at))} | "
                f"{fmt(run.kill_to_restart)} | {fmt(run.kill_to_done)} | {run.state}{notes} |"
            )

        def restart_median(variant: KillVariant, case: str) -> float | None:
            picked = [
                run.kill_to_restart for run in kills.get(variant.name, []) if run.case == case
            ]
            return median_or_none(picked) if picked else None

        late = [
            variant
            for variant in KILL_VARIANTS
            if (slow := restart_median(variant, "leader")) is not None
            and (fast := restart_median(variant, "other")) is not None
            and slow > fast + DEFAULTS.reaper_interval
        ]
        if late:
            out += [
                "",
                "When the killed worker led the reaper, nothing happens until its election lease "
                "runs out: only the leader acts, and a survivor takes the leadership over only "
                "then, whatever the liveness lock or the task's lease already showed.",
            ]
    if "guarded_sql" in kills:
        cells, met = [], True
        for case in ("other", "leader"):
            runs = [run for run in kills["guarded_sql"] if run.case == case]
            if not runs:
                continue
            restart = median_or_none([run.kill_to_restart for run in runs])
            done = median_or_none([run.kill_to_done for run in runs])
            met = met and restart is not None and restart < 15
            cells.append(
                f"killing {CASES[case]}: kill → restart {fmt(restart) or never}"
                f"{' s' if restart is not None else ''}, kill → done {fmt(done) or never}"
                f"{' s' if done is not None else ''}"
            )
        out += [
            "",
            "The project's target: GuardedTask with the default TTL restarts the work within "
            f"15 s of the kill ({'met' if met else 'NOT met'}): " + "; ".join(cells) + ".",
        ]

    config, load_runs, problems = load
    ttl = DEFAULTS.lease_ttl
    out += [
        "",
        f"### Heartbeat writes while {config.tasks} long tasks run",
        "",
        f"{config.tasks} guarded tasks that only sleep {args.load_seconds:g} s run at once in "
        f"{config.describe()}, with the default `guard_lease_ttl` {ttl:g} s, so every process "
        f"renews its leases every {DEFAULTS.renew_interval:.2f} s. The window of "
        f"{args.window:g} s starts {ttl + 0.5:g} s after the last claim (past the claim-time "
        "lease, so the Redis variant's reaper is in its steady state too) and ends before the "
        "first task does. *pg_stat_statements* counts each statement when it ends (exact); "
        "*pg_stat_user_tables* and *pg_stat_database* are PostgreSQL 15's cumulative statistics, "
        "which a backend flushes at most once a second (a backend that flushed less than 1 s ago "
        "keeps its counts pending until its next transaction or 10 s idle), so over a "
        f"{args.window:g} s window they can be off by one heartbeat round. Redis: the lease "
        "server's `INFO commandstats` (a server that holds only the leases).",
        "",
    ]
    if problems:
        out += [
            "The threads pool did not work with the guard, so this falls back to prefork:",
            "",
            *[f"- {problem}" for problem in problems],
            "",
        ]
    leases = [lease for lease in ("sql", "redis") if lease in load_runs]
    labels = {"sql": "SQL leases", "redis": "Redis leases"}
    out += [
        "| Per second over the window | " + " | ".join(labels[lease] for lease in leases) + " |",
        "|---|" + "---:|" * len(leases),
    ]

    def row(label: str, value: Callable[[LoadRun], str]) -> None:
        out.append(f"| {label} | " + " | ".join(value(load_runs[lease]) for lease in leases) + " |")

    beat = "heartbeat: lease renewal UPDATE"
    own_reads = "benchmark's own counter reads"
    row(
        f"**{beat}s** (pg_stat_statements calls)",
        lambda run: f"**{run.statements.get(beat, (0.0, 0.0))[0]:.2f}**",
    )
    row(
        "**rows those UPDATEs changed** (pg_stat_statements rows)",
        lambda run: f"**{run.statements.get(beat, (0.0, 0.0))[1]:.1f}**",
    )
    row(
        "celery_guard_keys rows updated, `n_tup_upd` (pg_stat_user_tables; of which HOT)",
        lambda run: (
            f"{run.counters['celery_guard_keys n_tup_upd']:.1f} "
            f"({run.counters['celery_guard_keys n_tup_hot_upd']:.1f})"
        ),
    )
    row(
        "all statements in the database, the benchmark's reads excluded (pg_stat_statements)",
        lambda run: f"{sum(c for k, (c, _) in run.statements.items() if k != own_reads):.2f}",
    )
    row(
        "transactions committed, `xact_commit` (pg_stat_database; counts the benchmark's too)",
        lambda run: f"{run.counters['pg_stat_database.xact_commit']:.2f}",
    )
    kinds = sorted(
        {kind for run in load_runs.values() for kind, (calls, _) in run.statements.items() if calls}
        - {beat, own_reads}
    )
    for kind in kinds:

        def statements(run: LoadRun, kind: str = kind) -> str:
            return "{:.2f} ({:.1f})".format(*run.statements.get(kind, (0, 0)))

        row(f"&nbsp;&nbsp;{kind}: statements (rows)", statements)
    row(
        "**lease Redis: commands** (`total_commands_processed`, counts those run by Lua scripts)",
        lambda run: f"**{run.redis_total:.1f}**",
    )
    for command in sorted({name for run in load_runs.values() for name in run.redis}):

        def calls(run: LoadRun, command: str = command) -> str:
            return f"{run.redis.get(command, 0.0):.1f}"

        # A "|" inside a code span still splits a Markdown table cell.
        shown = command.replace("|", "\\|")
        row(f"&nbsp;&nbsp;lease Redis: `{shown}` (INFO commandstats)", calls)
    processes = config.workers
    out += [
        "",
        f"Expected: SQL leases batch every lease of a process into one UPDATE per round, so "
        f"≈ {processes} / {DEFAULTS.renew_interval:.2f} = "
        f"{processes / DEFAULTS.renew_interval:.1f} statements/s and ≈ {config.tasks} / "
        f"{DEFAULTS.renew_interval:.2f} = {config.tasks / DEFAULTS.renew_interval:.0f} rows/s; "
        "Redis leases write nothing to PostgreSQL while the tasks run.",
    ]
    for lease in leases:
        load_run = load_runs[lease]
        detail = (
            f"{labels[lease]}: claims spread over {load_run.claim_spread:.1f} s, window "
            f"{load_run.window:.1f} s"
        )
        if load_run.notes:
            detail += "; " + "; ".join(load_run.notes)
        out.append(f"{detail}.")

    out += ["", "### Worker and server logs", ""]
    levels = collections.Counter(
        "Traceback" if "Traceback" in line else "ERROR" for _, line in findings.errors
    )
    out.append(
        f"Every worker's log was searched for `Traceback` and `ERROR`: {levels['Traceback']} "
        f"Traceback and {levels['ERROR']} ERROR/CRITICAL lines" + (":" if findings.errors else ".")
    )
    out += [
        f"- `{line}` ({count}x, first in {where})"
        for where, line, count in distinct(findings.errors)
    ]
    if findings.fenced:
        out += [
            "",
            f"`worker state ... -> FENCED` transitions: {len(findings.fenced)}; processes that "
            f"never left FENCED before they stopped: {len(findings.left_fenced)}"
            + (":" if findings.left_fenced else "."),
        ]
        out += [
            f"- `{line}` ({count}x, first in {where})"
            for where, line, count in distinct(findings.left_fenced)[:12]
        ]
        if findings.left_fenced:
            out += [
                "",
                "Each such line comes with a `lease lost ... taken over` WARNING at the moment "
                "tasks complete: a heartbeat round that overlaps a completion renews the finished "
                "key too, whose row is already COMPLETED (SQL leases) or whose Redis lease is "
                "already released, so the key is missing from the answer and `Heartbeat.beat` "
                "fences the finished execution; when that lands after the execution ended, the "
                "process stays FENCED with nothing running.",
            ]
    warn = distinct(findings.warnings)
    if warn:
        out += ["", f"WARNING lines ({len(findings.warnings)}), distinct after masking numbers:"]
        out += [f"- `{line}` ({count}x, first in {where})" for where, line, count in warn[:12]]
    out += [
        "",
        f"PostgreSQL's log: {len(server_errors)} ERROR lines" + (":" if server_errors else "."),
    ]
    out += [
        f"- `{line}` ({count}x)"
        for _, line, count in distinct([("", line) for line in server_errors])[:12]
    ]
    out += ["", "### Machine and versions", ""]
    out += [f"- {key}: {value}" for key, value in info.items()]
    return "\n".join(out) + "\n"


def distinct(lines: list[tuple[str, str]]) -> list[tuple[str, str, int]]:
    """Lines grouped after masking times, numbers and ids: (first source, example, count)."""
    groups: dict[str, list[Any]] = {}
    for where, line in lines:
        body = _LOG_LINE.sub(r"\2/\3] \4", line.strip())
        body = re.sub(r"^\S+ \S+ UTC \[\d+\] ", "", body)  # PostgreSQL's own prefix
        masked = re.sub(r"\b[0-9a-f]{6,}\b|\d+(\.\d+)?", "N", body)
        if masked not in groups:
            groups[masked] = [where, body.replace("`", "'")[:300], 0]
        groups[masked][2] += 1
    return [(where, line, count) for where, line, count in groups.values()]


def postgres_errors(path: Path) -> list[str]:
    """ERROR lines of the PostgreSQL log, each with the statement it names (if logged)."""
    lines = path.read_text(errors="replace").splitlines()
    found = []
    for index, line in enumerate(lines):
        if "ERROR:" not in line:
            continue
        for follower in lines[index + 1 : index + 4]:
            if "STATEMENT:" in follower:
                statement = " ".join(follower.split("STATEMENT:", 1)[1].split())
                line = f"{line} [STATEMENT: {statement[:80]}]"
                break
        found.append(line)
    return found


# -- main ---------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="runs per recovery variant (3)")
    parser.add_argument("--cap", type=float, default=120, help="seconds to wait for recovery")
    parser.add_argument("--task-seconds", type=float, default=5, help="the long task's work (5)")
    names = [variant.name for variant in KILL_VARIANTS]
    parser.add_argument(
        "--variants", default=",".join(names), help=f"recovery variants ({','.join(names)})"
    )
    parser.add_argument("--load-tasks", type=int, default=200, help="concurrent tasks (200)")
    parser.add_argument("--load-workers", type=int, default=4, help="worker processes (4)")
    parser.add_argument("--load-pool", choices=("threads", "prefork"), default="threads")
    parser.add_argument(
        "--fallback-concurrency",
        type=int,
        default=10,
        help="prefork pool per worker if threads fail",
    )
    parser.add_argument("--load-seconds", type=float, default=30, help="each task's sleep (30)")
    parser.add_argument("--window", type=float, default=10, help="sampling window (10 s)")
    parser.add_argument("--part", choices=("all", "recovery", "load"), default="all")
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "benchmarks.md")
    parser.add_argument("--no-write", action="store_true", help="print, do not write --output")
    parser.add_argument("--keep-logs", type=Path, help="copy every worker's log to this directory")
    args = parser.parse_args()
    global KEEP_LOGS
    KEEP_LOGS = args.keep_logs
    chosen = [variant for variant in KILL_VARIANTS if variant.name in args.variants.split(",")]
    if args.load_tasks % args.load_workers:
        parser.error("--load-tasks must be a multiple of --load-workers")
    command = shlex.join([os.path.relpath(sys.executable, ROOT), *sys.argv])

    started, load_at_start = time.monotonic(), os.getloadavg()
    revision_at_start = code_revision()
    findings = LogFindings()
    kills: dict[str, list[KillRun]] = {}
    load: tuple[LoadConfig, dict[str, LoadRun], list[str]] = (
        LoadConfig(args.load_pool, args.load_workers, args.load_tasks),
        {},
        [],
    )
    rig = Rig()
    try:
        rig.start()
        if args.part in ("all", "recovery"):
            for run in range(1, args.runs + 1):  # interleaved, so drift hits every variant
                for variant in chosen:
                    for kill_leader in (False, True) if variant.guarded else (None,):
                        result = run_kill(rig, variant, run, args, findings, kill_leader)
                        kills.setdefault(variant.name, []).append(result)
                        print(
                            f"run {run}/{args.runs} {variant.name:18s} {result.case or '-':6s} "
                            f"kill→restart {fmt(result.kill_to_restart) or '—':>5s} s  "
                            f"kill→done {fmt(result.kill_to_done) or '—':>5s} s  {result.state}",
                            flush=True,
                        )
        if args.part in ("all", "load"):
            load = measure_load(rig, args, findings)
        server_errors = postgres_errors(rig.postgres.log_path)
        info = machine_info(rig.postgres, rig.broker, load_at_start)
        if info["celery_guard"] != revision_at_start:  # the tree changed while this ran
            info["celery_guard"] = (
                f"{revision_at_start} at the start, {info['celery_guard']} at the end"
            )
    finally:
        rig.stop()
    wall = time.monotonic() - started

    section = render(args, kills, load, findings, server_errors, info, command, wall)
    print("\n" + section)
    if args.no_write:
        print(f"not written (--no-write); total wall time {wall:.0f} s")
    else:
        write_section(args.output, section, HEADING)
        print(f"written to {args.output}; total wall time {wall:.0f} s")


if __name__ == "__main__":
    main()
