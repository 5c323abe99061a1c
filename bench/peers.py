"""Peers: celery-once and celery-singleton beside plain Celery and GuardedTask, cost and faults.

Run from the repository root (``--help`` lists the options)::

    .venv/bin/python bench/peers.py --tasks 2000 --output docs/benchmarks.md

Needs the ``bench`` extra (``pip install -e '.[bench]'``: celery_once, celery-singleton). One
private Redis (broker in db 0, markers and counters in db 1, both peers' locks in db 2) and one
private PostgreSQL are started with the test rig.

1. **Overhead.** bench/overhead.py's machinery, unchanged (``overhead.run_once``): for each
   variant and repeat, N messages are published to a fresh queue (through each task's own
   ``apply_async``, so the peers take their locks), then ONE prefork worker drains them; time runs
   from the first ``task_prerun`` to the last ``task_postrun``. The same no-op and one-row-insert
   tasks as plain Celery, GuardedTask, celery-once ``QueueOnce`` and celery-singleton
   ``Singleton`` (bench/peers_app.py), interleaved in one run.
2. **Faults.** The same "order" task four ways (bench/peers_faults_app.py), two real workers
   (prefork, concurrency 1, prefetch multiplier 1) per variant and fault, effects counted as rows
   in a PostgreSQL table: (a) the order sent twice at once; (b) sent again after the first
   completed; (c) the whole worker SIGKILLed after the body wrote its row, before it ended, left
   to the broker's redelivery; (c') the whole worker SIGKILLed before the write, the client
   sending the order again a few seconds later; (d) the worker SIGSTOPped past its lease and the
   visibility timeout, then resumed. Every send goes through the task's own ``apply_async``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.metadata
import json
import os
import shlex
import signal
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # so that ``tests.rig`` and ``bench`` import when run as a script
    sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402
import redis  # noqa: E402
import sqlalchemy  # noqa: E402

import celery_guard  # noqa: E402
from bench import overhead, recovery  # noqa: E402
from bench.overhead import machine_info, write_section  # noqa: E402
from bench.recovery import (  # noqa: E402
    LogFindings,
    distinct,
    dsn_of,
    reaper_leader,
    worker_name,
    worker_of,
    workers_running,
)
from celery_guard import GuardConfig, get_runtime  # noqa: E402
from tests.rig import procs  # noqa: E402
from tests.rig.servers import PostgresServer, RedisServer  # noqa: E402
from tests.rig.workers import WorkerProcess  # noqa: E402

HEADING = "## Peers (bench/peers.py)"
BROKER_DB, MARKER_DB, LOCK_DB = 0, 1, 2
DEFAULTS = GuardConfig()
POLL = 0.05

PEER_PACKAGES = {"celery-once": "celery_once", "celery-singleton": "celery_singleton"}
LABELS = {
    "plain": "plain Celery",
    "once": "celery-once",
    "singleton": "celery-singleton",
    "guarded": "GuardedTask",
}
OVERHEAD_PAIRS = [
    ("noop", ["plain_noop", "guarded_noop", "once_noop", "singleton_noop"]),
    ("insert", ["plain_insert", "guarded_insert", "once_insert", "singleton_insert"]),
]
OVERHEAD_VARIANTS = [name for _, names in OVERHEAD_PAIRS for name in names]
FAULT_VARIANTS = ("plain", "once", "singleton", "guarded")
FAULTS = {
    "a": "the same order sent twice at once (concurrent duplicate)",
    "b": "the same order sent again after the first completed (sequential duplicate)",
    "c": "the whole worker SIGKILLed after the body wrote its row, before it ended; the broker "
    "redelivers",
    "c2": "the whole worker SIGKILLed mid-task before the write; the client sends the order again",
    "d": "the worker frozen (SIGSTOP) past its lease and the visibility timeout, then resumed",
}


def peer_versions() -> dict[str, str]:
    """Each peer's installed version, or the exact error its import gives."""
    found = {}
    for package, module in PEER_PACKAGES.items():
        try:
            importlib.import_module(module)
            found[package] = importlib.metadata.version(package)
        except Exception as exc:  # recorded verbatim in the report
            found[package] = f"NOT usable: {type(exc).__name__}: {exc}"
    return found


# -- part 1: overhead, with bench/overhead.py's machinery ---------------------------------------


def clear_locks(redis_server: RedisServer) -> None:
    with redis_server.client(LOCK_DB) as locks:
        locks.flushdb()


def locks_left(redis_server: RedisServer, patterns: dict[str, str]) -> dict[str, int]:
    with redis_server.client(LOCK_DB) as locks:
        return {peer: len(list(locks.scan_iter(pattern))) for peer, pattern in patterns.items()}


def measure_overhead(
    args: argparse.Namespace,
    postgres: PostgresServer,
    redis_server: RedisServer,
) -> dict[str, list[float]]:
    env = {
        "BENCH_BROKER_URL": redis_server.url_for(BROKER_DB),
        "BENCH_REDIS_URL": redis_server.url_for(MARKER_DB),
        "BENCH_STORE_URL": postgres.url,
        "BENCH_PREFETCH": str(args.prefetch),
        "BENCH_LOCK_URL": redis_server.url_for(LOCK_DB),
    }
    os.environ.update(env)  # read by bench.overhead_app / bench.peers_app when imported
    bench = importlib.import_module("bench.peers_app")
    bench.metadata.create_all(sqlalchemy.create_engine(postgres.url, poolclass=sqlalchemy.NullPool))
    get_runtime(bench.app).migrate()
    get_runtime(bench.app).store.dispose()

    runs: dict[str, list[float]] = {name: [] for name in OVERHEAD_VARIANTS}
    for repeat in range(args.repeats):  # interleaved, so drift hits every variant alike
        for name in OVERHEAD_VARIANTS:
            clear_locks(redis_server)
            seconds = overhead.run_once(bench, name, repeat, args, env, postgres, redis_server)
            left = locks_left(redis_server, bench.LOCK_PATTERNS)
            if any(left.values()):
                raise RuntimeError(f"{name}: locks left after the run: {left}")
            runs[name].append(seconds)
            print(
                f"overhead run {repeat + 1}/{args.repeats} {name:17s} "
                f"{args.tasks / seconds:8.1f}/s",
                flush=True,
            )
    return runs


# -- part 2: faults -----------------------------------------------------------------------------


@dataclass
class FaultRun:
    fault: str
    variant: str
    tag: str
    #: What each send through the task's ``apply_async`` answered.
    sends: list[str] = field(default_factory=list)
    #: Bodies that started, deliveries that ended (``task_postrun``), rows written (the effect).
    starts: int = 0
    ended: int = 0
    effects: int = 0
    #: Seconds from the fault (kill, freeze; the last send for (a) and (b)) to moments after it.
    restart: float | None = None
    first_effect: float | None = None
    last_effect: float | None = None
    lock_ttl_at_fault: float | None = None  # seconds; -1: no expiry; None: no lock
    lock_released: float | None = None
    #: Rows the killed or frozen execution itself committed.
    victim_rows: int | None = None
    victim_led_reaper: bool | None = None
    key_state: str = ""
    settled: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def prevented(self) -> bool:
        return self.effects == 1


class FaultRig:
    """The servers, the faults app imported in this process (the client), and its workers' env."""

    def __init__(self, args: argparse.Namespace, postgres: PostgresServer, redis: RedisServer):
        self.args = args
        self.postgres = postgres
        self.redis = redis
        self.base_env = {
            "BENCH_BROKER_URL": redis.url_for(BROKER_DB),
            "BENCH_MARKER_URL": redis.url_for(MARKER_DB),
            "BENCH_LOCK_URL": redis.url_for(LOCK_DB),
            "BENCH_STORE_URL": postgres.url,
            "BENCH_ONCE_TIMEOUT": str(args.once_timeout),
            "BENCH_VISIBILITY_TIMEOUT": repr(float(args.visibility_timeout)),
        }
        # The client installs the guard too (offline), so GuardedTask.apply_async sets the key.
        os.environ.update({**self.base_env, "BENCH_INSTALL_GUARD": "1"})
        self.app: ModuleType = importlib.import_module("bench.peers_faults_app")
        # bench.recovery (imported above) imported bench.recovery_app, whose app this is, before
        # the servers had ports: point this process's app at them. It only publishes here.
        self.app.app.conf.broker_url = self.base_env["BENCH_BROKER_URL"]
        self.app.app.conf.guard_store_url = postgres.url
        engine = sqlalchemy.create_engine(postgres.url, poolclass=sqlalchemy.NullPool)
        celery_guard.metadata.create_all(engine)
        self.app.metadata.create_all(engine)
        engine.dispose()

    def env(self, variant: str) -> dict[str, str]:
        # The plain and peer workers run without celery_guard installed (no reaper, no hooks).
        return {**self.base_env, "BENCH_INSTALL_GUARD": "1" if variant == "guarded" else "0"}

    def lock_key(self, variant: str, tag: str) -> str | None:
        task, args = self.app.TASKS[variant], (tag, self.args.task_seconds)
        if variant == "once":
            return str(task.get_key(args, {}))
        if variant == "singleton":
            return str(task.generate_lock(task.name, list(args), {}))
        return None

    def send(self, variant: str, tag: str, queue: str) -> str:
        """One send through the task's own ``apply_async``; what it answered."""
        task_id = str(uuid.uuid4())
        try:
            result = self.app.TASKS[variant].apply_async(
                (tag, self.args.task_seconds), queue=queue, task_id=task_id
            )
        except Exception as exc:
            if type(exc).__name__ == "AlreadyQueued":  # celery-once
                return f"refused (AlreadyQueued: lock expires in {exc.countdown:.0f} s)"
            raise
        if getattr(result, "id", task_id) != task_id:  # celery-singleton: the holder's result
            return "refused (returned the running task's id)"
        return "accepted"

    def reset_redis(self) -> None:
        for db in (BROKER_DB, MARKER_DB, LOCK_DB):
            with self.redis.client(db) as client:
                client.flushdb()


class Watch:
    """Samples what a fault run left: markers, rows, the lock, and whether the broker is idle."""

    def __init__(
        self,
        rig: FaultRig,
        run: FaultRun,
        queue: str,
        db: psycopg.Connection[Any],
        markers: redis.Redis,
        broker: redis.Redis,
        locks: redis.Redis,
    ) -> None:
        self.rig, self.run, self.queue = rig, run, queue
        self.db, self.markers, self.broker, self.locks = db, markers, broker, locks
        self.lock_key = rig.lock_key(run.variant, run.tag)
        self.fault_at: float | None = None
        self.rows_at_fault = 0
        self.lock_seen = False
        self.quiet_since: float | None = None

    def entries(self, key: str) -> list[dict[str, Any]]:
        return [json.loads(raw) for raw in self.markers.lrange(key, 0, -1)]

    def starts(self) -> list[dict[str, Any]]:
        return self.entries(f"bench:started:{self.run.tag}")

    def wrote(self) -> list[dict[str, Any]]:
        return self.entries(self.rig.app.wrote_key(self.run.tag))

    def ended(self) -> list[dict[str, Any]]:
        return self.entries(self.rig.app.ended_key(self.run.tag))

    def rows(self) -> int:
        row = self.db.execute(
            "SELECT count(*) FROM bench_effects WHERE tag = %s", (self.run.tag,)
        ).fetchone()
        return int(row[0]) if row else 0

    def fault(self) -> None:
        """Call right after the kill, the freeze, or the last send: times count from here."""
        self.fault_at = time.time()
        self.rows_at_fault = self.rows()
        if self.lock_key is not None:
            ttl = self.locks.pttl(self.lock_key)  # -2: no such key; -1: no expiry
            self.run.lock_ttl_at_fault = None if ttl == -2 else (-1 if ttl == -1 else ttl / 1000)
            self.lock_seen = ttl != -2

    def since(self, moment: float) -> float:
        assert self.fault_at is not None
        return moment - self.fault_at

    def sample(self) -> None:
        run, now, rows = self.run, time.time(), self.rows()
        if self.fault_at is not None:
            if rows > self.rows_at_fault and run.first_effect is None:
                run.first_effect = self.since(now)
            if rows > max(run.effects, self.rows_at_fault):
                run.last_effect = self.since(now)
            later = [s for s in self.starts() if s["at"] > self.fault_at]
            if later and run.restart is None:
                run.restart = self.since(float(later[0]["at"]))
            if (
                self.lock_key is not None
                and self.lock_seen
                and run.lock_released is None
                and not self.locks.exists(self.lock_key)
            ):
                run.lock_released = self.since(now)
        run.effects = rows

    def idle(self) -> bool:
        """Nothing waits in the queue and nothing is delivered but unacknowledged."""
        waiting = sum(self.broker.llen(k) for k in self.broker.scan_iter(f"{self.queue}*"))
        return waiting == 0 and self.broker.hlen("unacked") == 0

    def watch(self, seconds: float, until: Callable[[], bool] | None = None) -> bool:
        """Sample for up to ``seconds``; True as soon as ``until()`` holds."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.sample()
            if until is not None and until():
                return True
            time.sleep(POLL)
        self.sample()
        return until is not None and until()

    def settle(self, cap: float, quiet: float = 1.5) -> bool:
        """Sample until the broker has been idle for ``quiet`` s (at most ``cap`` s)."""
        self.quiet_since = None

        def settled() -> bool:
            if not self.idle():
                self.quiet_since = None
                return False
            self.quiet_since = self.quiet_since or time.monotonic()
            return time.monotonic() - self.quiet_since >= quiet

        self.run.settled = self.watch(cap, settled)
        if not self.run.settled:
            self.run.notes.append(f"broker not idle {cap:.0f} s after the fault")
        return self.run.settled


def run_fault(rig: FaultRig, fault: str, variant: str, findings: LogFindings) -> FaultRun:
    args = rig.args
    tag = f"{fault}-{variant}-{uuid.uuid4().hex[:8]}"
    queue = f"peers.{fault}.{variant}.{uuid.uuid4().hex[:6]}"
    run = FaultRun(fault, variant, tag)
    where = f"peers-{fault}-{variant}"
    options = {"concurrency": 1, "queues": queue, "app": "bench.peers_faults_app"}
    try:
        with (
            workers_running(2, rig.env(variant), findings, where, **options) as workers,
            psycopg.connect(dsn_of(rig.postgres.url), autocommit=True) as db,
            rig.redis.client(MARKER_DB) as markers,
            rig.redis.client(BROKER_DB) as broker,
            rig.redis.client(LOCK_DB) as locks,
        ):
            watch = Watch(rig, run, queue, db, markers, broker, locks)
            if fault == "a":
                run.sends.append(rig.send(variant, tag, queue))
                run.sends.append(rig.send(variant, tag, queue))
                watch.fault()
                watch.settle(args.cap)
            elif fault == "b":
                run.sends.append(rig.send(variant, tag, queue))
                if not watch.watch(args.cap, lambda: bool(watch.ended()) and watch.idle()):
                    run.notes.append(f"the first send had not ended within {args.cap:.0f} s")
                run.sends.append(rig.send(variant, tag, queue))
                watch.fault()
                watch.settle(args.cap)
            else:
                run_crash(rig, fault, variant, run, watch, workers, queue)
            run.starts = len(watch.starts())
            run.ended = len(watch.ended())
            if variant == "guarded":
                row = db.execute(
                    "SELECT state, claim_reason, fencing_token, attempts FROM celery_guard_keys "
                    "WHERE key = %s",
                    (f"order:{tag}",),
                ).fetchone()
                if row is not None:
                    run.key_state = f"{row[0]} {row[1]} token {row[2]}, attempts {row[3]}"
    finally:
        rig.reset_redis()
    return run


def run_crash(
    rig: FaultRig,
    fault: str,
    variant: str,
    run: FaultRun,
    watch: Watch,
    workers: list[WorkerProcess],
    queue: str,
) -> None:
    """(c), (c') and (d): one send, then the worker running it is killed or frozen."""
    args = rig.args
    run.sends.append(rig.send(variant, run.tag, queue))
    # (c): after the body passed its write; (c') and (d): as soon as the body started.
    marks = watch.wrote if fault == "c" else watch.starts
    found: list[tuple[WorkerProcess, int]] = []

    def running() -> bool:
        entries = marks()
        if not entries:
            return False
        pid = int(entries[0]["pid"])
        victim = worker_of(workers, pid)
        if victim is not None:
            found.append((victim, pid))
        return victim is not None

    procs.wait_until(running, 30, f"{run.tag} to run in a pool child", POLL)
    victim, victim_pid = found[-1]
    if variant == "guarded":
        leader = reaper_leader(watch.db)
        run.victim_led_reaper = leader is not None and leader.startswith(worker_name(victim) + "@")

    if fault in ("c", "c2"):
        procs.signal_group(victim.pid, signal.SIGKILL)  # main process and child at once
        watch.fault()
        victim.kill()  # waits (bounded) until no process of its tree is left
        if fault == "c2":
            watch.watch(max(0.0, args.resend_after - watch.since(time.time())))
            run.sends.append(rig.send(variant, run.tag, queue))
        watch.settle(args.cap)
    else:  # "d"
        victim.freeze()
        watch.fault()
        watch.watch(args.freeze)
        victim.thaw()
        # The frozen delivery ends, then the broker must be idle again.
        frozen_ended = watch.watch(
            args.cap, lambda: any(int(e["pid"]) == victim_pid for e in watch.ended())
        )
        if not frozen_ended:
            run.notes.append(f"the resumed execution did not end within {args.cap:.0f} s")
        watch.settle(args.cap)
    row = watch.db.execute(
        "SELECT count(*) FROM bench_effects WHERE tag = %s AND pid = %s", (run.tag, victim_pid)
    ).fetchone()
    run.victim_rows = int(row[0]) if row else None


# -- report -------------------------------------------------------------------------------------


def name(fault: str) -> str:
    return "(c')" if fault == "c2" else f"({fault})"


def fmt(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def cell(run: FaultRun) -> str:
    """One cell of the summary table: prevented or not, and the counts behind it."""
    accepted = sum(1 for s in run.sends if s == "accepted")
    refused = [s for s in run.sends if s != "accepted"]
    verdict = "**yes**" if run.prevented else "**no**"
    parts = [f"**{run.effects} row{'s' if run.effects != 1 else ''}**"]
    parts.append(f"{accepted} of {len(run.sends)} sends accepted")
    if refused:
        parts.append("; ".join(sorted(set(refused))))
    parts.append(f"{run.starts} bod{'y' if run.starts == 1 else 'ies'} started")
    parts.append(f"{run.ended} deliver{'y' if run.ended == 1 else 'ies'} ended")
    if run.fault in ("c", "c2", "d"):
        parts.append(f"killed/frozen run's own rows {run.victim_rows}")
    if not run.settled:
        parts.append("NOT settled")
    return f"{verdict}: " + ", ".join(parts)


def render(
    args: argparse.Namespace,
    runs: dict[str, list[float]] | None,
    faults: list[FaultRun],
    findings: LogFindings,
    versions: dict[str, str],
    info: dict[str, str],
    command: str,
    wall: float,
) -> str:
    today = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    out = [
        HEADING,
        "",
        f"Measured {today} with `{command}` (total wall time {wall:.0f} s). Peers: "
        + ", ".join(f"{package} {version}" for package, version in versions.items())
        + ".",
        "",
        "How the peers work, read from their source: both take a Redis lock in the caller's "
        "`apply_async` (celery-once: redis-py `Lock`, `SET NX PX`, timeout `once={'timeout'}`, "
        "default 3600 s, and `AlreadyQueued` for a duplicate; celery-singleton: `SET NX` with no "
        "expiry unless `singleton_lock_expiry` is set, and the running task's `AsyncResult` for "
        "a duplicate) and delete it when the task ends (celery-once in `after_return`, "
        "celery-singleton in `on_success`/`on_failure`). The worker checks no lock: a message "
        "the broker delivers again runs whatever the lock says. Locks live in the same private "
        "Redis as the broker (another database).",
        "",
    ]
    if runs is not None:
        rate = {name: args.tasks / statistics.median(seconds) for name, seconds in runs.items()}
        out += [
            "### Overhead",
            "",
            f"bench/overhead.py's method and tasks (see above): one prefork worker (concurrency "
            f"{args.concurrency}, prefetch multiplier {args.prefetch}, acks_late and "
            f"reject_on_worker_lost) drains {args.tasks} messages published beforehand, each "
            "sent through its task's own `apply_async` (so the peers lock them at publish, "
            "outside the timed window); time from the first `task_prerun` to the last "
            f"`task_postrun`. Median of {args.repeats} interleaved runs. After each peer run "
            "the lock database was checked: no lock was left.",
            "",
            "| Variant | Tasks | Seconds | Tasks/s | / plain | / GuardedTask "
            "| All runs (tasks/s) |",
            "|---|---:|---:|---:|---:|---:|---|",
        ]
        for _, names in OVERHEAD_PAIRS:
            plain, guarded = rate[names[0]], rate[names[1]]
            for name in names:
                seconds = statistics.median(runs[name])
                every = ", ".join(f"{args.tasks / s:.0f}" for s in runs[name])
                out.append(
                    f"| {name} | {args.tasks} | {seconds:.2f} | {rate[name]:.0f} | "
                    f"{rate[name] / plain:.2f} | {rate[name] / guarded:.2f} | {every} |"
                )
        out += [
            "",
            "In the worker the peers only compute the task's lock key and `DEL` it in Redis "
            "when the task ends (the lock they took at publish, whose cost is not in this "
            "window); GuardedTask claims and completes the key in PostgreSQL. Neither peer "
            "looks at a message the broker delivers twice (below).",
            "",
        ]
    if faults:
        out += fault_section(args, faults, findings)
    out += ["### Machine and versions", ""]
    out += [f"- {key}: {value}" for key, value in info.items()]
    out += [f"- {package}: {version}" for package, version in versions.items()]
    return "\n".join(out) + "\n"


def fault_section(
    args: argparse.Namespace, faults: list[FaultRun], findings: LogFindings
) -> list[str]:
    by = {(run.fault, run.variant): run for run in faults}
    variants = [v for v in FAULT_VARIANTS if any(run.variant == v for run in faults)]
    out = [
        "### What each prevents under the same faults",
        "",
        "The same order task four ways (bench/peers_faults_app.py): plain Celery with "
        "`acks_late` and `reject_on_worker_lost`, celery-once `QueueOnce` (`once={'keys': "
        f"['tag'], 'timeout': {args.once_timeout}}}`), celery-singleton `Singleton` "
        "(`unique_on=['tag']`, no lock expiry, its default) and GuardedTask "
        "(`idempotency_key='order:{tag}'`, celery_guard's defaults: lease TTL "
        f"{DEFAULTS.lease_ttl:g} s, reaper every {DEFAULTS.reaper_interval:g} s). The body works "
        f"{args.task_seconds / 2:g} s, writes one row (the effect; GuardedTask in "
        f"`self.guard.transaction()`), works {args.task_seconds / 2:g} s more. Per variant and "
        "fault: two fresh real workers (prefork, concurrency 1, prefetch multiplier 1; "
        "celery_guard installed only in the GuardedTask workers) on a private Redis broker, "
        "every send through the task's own `apply_async`, effects counted as rows in "
        "PostgreSQL after the broker has been idle (nothing queued, nothing unacknowledged) "
        f"for 1.5 s. The Redis transport's visibility timeout is **{args.visibility_timeout:g} "
        "s** here, swept every second, so the broker's redelivery of a killed or frozen "
        "worker's message happens within the run; kombu's default is 3600 s, swept about every "
        "100 s, so where a time below says ≈ that timeout, read an hour in a default setup.",
        "",
        "Double effect prevented? (1 row for the order: yes; more: no.) *Sends accepted*: "
        "what the task's `apply_async` answered; *bodies started*: executions of the body "
        "(worker stamp); *deliveries ended*: `task_postrun` in a pool process, body run or not "
        "(each deferral of GuardedTask's in-flight duplicate counts; a killed run never ends); "
        "*killed/frozen run's own rows*: rows committed by the execution that was killed or "
        "frozen.",
        "",
        "| Fault | " + " | ".join(LABELS[v] for v in variants) + " |",
        "|---|" + "---|" * len(variants),
    ]
    for fault, label in FAULTS.items():
        cells = [cell(by[(fault, v)]) if (fault, v) in by else "not run" for v in variants]
        if any((fault, v) in by for v in variants):
            out.append(f"| {name(fault)} {label} | " + " | ".join(cells) + " |")
    out += [
        "",
        "Times after the fault (the kill, the freeze), in seconds. *restart*: a body of the "
        "order starts again (worker stamp); *first row* / *last row*: a row for the order "
        "becomes visible after the fault (polled every 50 ms); *lock*: the peer's lock "
        "(its TTL at the fault; when it was gone).",
        "",
        "| Fault | Variant | Restart | First row | Last row | Rows | Lock at fault | "
        "Lock gone | Notes |",
        "|---|---|---:|---:|---:|---:|---|---:|---|",
    ]
    for fault in ("c", "c2", "d"):
        for variant in variants:
            run = by.get((fault, variant))
            if run is None:
                continue
            notes = list(run.notes)
            if run.sends[1:]:
                notes.append("re-send: " + run.sends[1])
            if run.victim_led_reaper is not None:
                notes.append(f"victim led the reaper: {'yes' if run.victim_led_reaper else 'no'}")
            if run.key_state:
                notes.append(f"key {run.key_state}")
            if run.lock_ttl_at_fault is None:
                lock = "—" if variant in ("plain", "guarded") else "none"
            elif run.lock_ttl_at_fault < 0:
                lock = "held, no expiry"
            else:
                lock = f"held, {run.lock_ttl_at_fault:.0f} s left"
            out.append(
                f"| {name(fault)} | {LABELS[variant]} | {fmt(run.restart)} | "
                f"{fmt(run.first_effect)} | {fmt(run.last_effect)} | {run.effects} | {lock} | "
                f"{fmt(run.lock_released)} | {'; '.join(notes)} |"
            )
    out += ["", *fault_reading(by), ""]
    levels = [line for _, line in findings.errors if "Traceback" in line]
    out.append(
        f"Worker logs: {len(levels)} Traceback and "
        f"{len(findings.errors) - len(levels)} ERROR/CRITICAL lines"
        + (":" if findings.errors else ".")
    )
    out += [
        f"- `{line}` ({count}x, first in {where})"
        for where, line, count in distinct(findings.errors)[:12]
    ]
    out.append("")
    return out


#: Rows per order each variant is expected to leave, from how it works (read from the source).
EXPECTED = {
    "a": {"plain": 2, "once": 1, "singleton": 1, "guarded": 1},
    "b": {"plain": 2, "once": 2, "singleton": 2, "guarded": 1},
    "c": {"plain": 2, "once": 2, "singleton": 2, "guarded": 1},
    "c2": {"plain": 2, "once": 1, "singleton": 1, "guarded": 1},
    "d": {"plain": 2, "once": 2, "singleton": 2, "guarded": 1},
}
#: Why, per fault: shown only when every variant's count is the expected one.
READING = {
    "a": "Both peers refuse the second send in the caller (`AlreadyQueued`; the running task's "
    "result). GuardedTask publishes both; the second delivery finds the key in flight, is "
    "deferred, and then finds it COMPLETED and returns the stored result. Plain Celery runs both.",
    "b": "The peers deleted their lock when the first run ended, so the second send runs again: "
    "they prevent *concurrent* duplicates only. GuardedTask keeps the COMPLETED key for "
    "`guard_result_ttl` (7 days by default) and returns the stored result.",
    "c": "The killed run had committed its row. The broker redelivers its message once the "
    "visibility timeout has passed since the delivery, and the worker runs it without looking "
    "at any lock, so the peers write twice, as plain Celery does: the lock the killed worker "
    "left did not hold the redelivery back (it still had most of its timeout left; the "
    "redelivered run deleted it when it ended). GuardedTask's row was in the "
    "guard transaction, uncommitted, and died with the process; the reaper saw the owner dead "
    "(its liveness lock gone) and re-published the key, and the broker's later redelivery "
    "found it COMPLETED.",
    "c2": "Plain Celery accepts the client's re-send and runs the order on the surviving worker; "
    "the broker's redelivery then runs it a second time. The peers' lock, left behind by the "
    "killed worker, refuses the re-send (celery-once until its timeout, celery-singleton, "
    "without expiry, until some run of the order ends): one row, but only once the broker "
    "redelivers, after the visibility timeout (an hour by default). GuardedTask restarts the "
    "order through the reaper within seconds and deduplicates the re-send.",
    "d": "Frozen longer than the visibility timeout, the worker loses its message to the other "
    "worker, which runs it (and, for the peers, deletes the lock); the frozen run then resumes "
    "and commits its row too. GuardedTask: the lease ran out, the reaper handed the key to the "
    "other worker, and the resumed run's commit was refused (fenced by its token).",
}


def fault_reading(by: dict[tuple[str, str], FaultRun]) -> list[str]:
    """One bullet per fault: the mechanism when the counts are the expected ones, else a flag."""
    out = []
    for fault, expected in EXPECTED.items():
        measured = {v: by[fault, v].effects for v in FAULT_VARIANTS if (fault, v) in by}
        if not measured:
            continue
        if all(expected[v] == rows for v, rows in measured.items()):
            out.append(f"- {name(fault)} {READING[fault]}")
        else:
            shown = ", ".join(f"{LABELS[v]} {rows}" for v, rows in measured.items())
            wanted = ", ".join(f"{LABELS[v]} {expected[v]}" for v in measured)
            out.append(
                f"- {name(fault)} **Not what was expected**: rows {shown}; expected {wanted}. "
                "Read the worker logs (`--keep-logs`) before trusting this row."
            )
    return out


# -- main ---------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--part", choices=("all", "overhead", "faults"), default="all")
    group = parser.add_argument_group("overhead (bench/overhead.py's options)")
    group.add_argument("--tasks", type=int, default=2000, help="messages per run (2000)")
    group.add_argument("--concurrency", type=int, default=2, help="prefork pool size (2)")
    group.add_argument("--repeats", type=int, default=3, help="runs per variant; median (3)")
    group.add_argument("--prefetch", type=int, default=4, help="worker_prefetch_multiplier (4)")
    group.add_argument("--timeout", type=float, default=300, help="seconds allowed per run")
    group = parser.add_argument_group("faults")
    group.add_argument("--faults", default=",".join(FAULTS), help="which faults (a,b,c,c2,d)")
    group.add_argument("--task-seconds", type=float, default=3, help="the order's work (3 s)")
    group.add_argument(
        "--visibility-timeout", type=float, default=15, help="Redis transport's (15 s)"
    )
    group.add_argument("--once-timeout", type=int, default=60, help="celery-once lock (60 s)")
    group.add_argument("--freeze", type=float, default=25, help="SIGSTOP length (25 s)")
    group.add_argument("--resend-after", type=float, default=3, help="(c') re-send (3 s)")
    group.add_argument("--cap", type=float, default=90, help="seconds any wait may take (90)")
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "benchmarks.md")
    parser.add_argument("--no-write", action="store_true", help="print, do not write --output")
    parser.add_argument("--keep-logs", type=Path, help="copy every worker's log to this directory")
    args = parser.parse_args()
    recovery.KEEP_LOGS = args.keep_logs  # read by recovery.workers_running
    chosen = [fault for fault in FAULTS if fault in args.faults.split(",")]
    if args.freeze <= max(args.visibility_timeout, DEFAULTS.lease_ttl) + args.task_seconds:
        parser.error("--freeze must outlast the visibility timeout (and the lease) plus the task")
    command = shlex.join([os.path.relpath(sys.executable, ROOT), *sys.argv])

    versions = peer_versions()
    broken = {package: v for package, v in versions.items() if v.startswith("NOT")}
    if broken:
        sys.exit(f"peers not usable ({broken}); install them: pip install -e '.[bench]'")

    started, load_at_start = time.monotonic(), os.getloadavg()
    redis_server, postgres = RedisServer(), PostgresServer()
    findings = LogFindings()
    runs: dict[str, list[float]] | None = None
    faults: list[FaultRun] = []
    try:
        redis_server.start()
        postgres.start()
        if args.part in ("all", "overhead"):
            runs = measure_overhead(args, postgres, redis_server)
        if args.part in ("all", "faults"):
            rig = FaultRig(args, postgres, redis_server)
            for fault in chosen:  # each fault for every variant in turn
                for variant in FAULT_VARIANTS:
                    run = run_fault(rig, fault, variant, findings)
                    faults.append(run)
                    print(
                        f"fault ({fault}) {variant:9s} rows {run.effects} starts {run.starts} "
                        f"restart {fmt(run.restart)} first {fmt(run.first_effect)} last "
                        f"{fmt(run.last_effect)} lock gone {fmt(run.lock_released)} "
                        f"sends {run.sends} {run.key_state} {'; '.join(run.notes)}",
                        flush=True,
                    )
        info = machine_info(postgres, redis_server, load_at_start)
    finally:
        try:
            postgres.stop()  # by PID; a server that never started is a no-op
        finally:
            redis_server.stop()
    wall = time.monotonic() - started

    section = render(args, runs, faults, findings, versions, info, command, wall)
    print("\n" + section)
    if args.no_write:
        print(f"not written (--no-write); total wall time {wall:.0f} s")
    else:
        write_section(args.output, section, HEADING)
        print(f"written to {args.output}; total wall time {wall:.0f} s")


if __name__ == "__main__":
    main()
