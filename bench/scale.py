"""The keys table at scale: claim and completion latency with millions of rows, pruning's pace,
the table's size, and many claimers at once.

Run from the repository root (``make bench`` runs it too, ``--smoke`` with small sizes)::

    .venv/bin/python bench/scale.py --rows 1000000,10000000 --output docs/benchmarks.md

**Many keys.** For each ``--rows`` size a fresh durable PostgreSQL (fsync, synchronous_commit
and full_page_writes on, the rig's ``PostgresServer(durable=True)`` that bench/overhead.py runs
too) gets the schema from celery_guard's own ``migrate`` and is filled by one ``INSERT ...
SELECT generate_series``: mostly COMPLETED keys whose expiry is spread evenly over the
retention, 2% RELEASED, 1% DEAD, 1 in 10,000 RUNNING, and a backlog of already expired
COMPLETED keys. Keys are ``bench.scale:`` and an MD5 hex, as hashed keys scatter over the
primary key's B-tree. Then, for ``--seconds``, one client claims and completes keys through
``SqlStore.keys`` (90% new keys, 10% duplicates of COMPLETED ones), closed loop, while another
process prunes the way the reaper does (:meth:`Recovery.prune_pass` every reaper interval).
The retention is chosen so that, at the insert rate the client reaches, as many keys expire
per second as are inserted: the steady state of a store that has been up for a whole
retention. Reported: claim and completion latency percentiles, the insert rate, rows pruned per
second, the expired backlog before and after (pruning keeps up when it does not grow), the
reaper's scans' latency, HOT updates, and the table's and each index's size before and after.
``--indexes legacy`` runs the same with the indexes of the first schema, to compare.

**Many claimers.** ``--workers 2,4,8`` real ``celery worker`` processes (concurrency
``--concurrency``, Redis broker, durable PostgreSQL or ``--store-url``) drain a backlog of
``--tasks`` messages of which 10% repeat an earlier key (bench/scale_app.py). Reported:
deadlocks (``pg_stat_database.deadlocks`` before and after), lock waits sampled from
``pg_stat_activity`` every 50 ms, the reaper's leader changes (``celery_guard_leaders.term``),
and effect rows per key (one each, or the run fails).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import multiprocessing
import os
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # so that ``tests.rig`` and ``bench`` import when run as a script
    sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402

from bench.overhead import machine_info, write_section  # noqa: E402
from celery_guard import GuardConfig  # noqa: E402
from celery_guard.store import ClaimOutcome, ClaimRequest, SqlStore  # noqa: E402
from tests.rig import procs  # noqa: E402
from tests.rig.servers import PG_BIN, PgBouncerServer, PostgresServer, RedisServer  # noqa: E402
from tests.rig.workers import WorkerProcess  # noqa: E402

HEADING = "## Scale (bench/scale.py)"
#: The reaper's default pass interval (``guard_reaper_interval``) and its pruning batch.
REAPER_INTERVAL = 2.0
TASK = "bench.scale.task"
#: Share of the claims that repeat a key already COMPLETED (a duplicate delivery).
DUPLICATE_SHARE = 0.10

#: The first schema's indexes on celery_guard_keys, for ``--indexes legacy``.
LEGACY_INDEXES = (
    "CREATE INDEX ix_celery_guard_keys_state_lease ON celery_guard_keys (state, lease_expires_at)",
    "CREATE INDEX ix_celery_guard_keys_expires_at ON celery_guard_keys (expires_at)",
)

#: One statement fills the table. ``%(n)s`` rows; ``%(retention)s`` seconds; ``%(expired)s``:
#: the share already past its expiry. Row i's state is a function of i, so a size's rows are
#: the same on every run.
FILL = """
INSERT INTO celery_guard_keys (
    key, task_name, state, attempts, fencing_token, lease_expires_at, owner, owner_lock,
    claim_id, claim_reason, fingerprint, message, result, last_error, duplicates,
    created_at, updated_at, completed_at, expires_at, republished_at)
SELECT 'bench.scale:' || md5(i::text), 'bench.scale.task', s.state, 1, 1 + i %% 3,
       CASE WHEN s.state = 'RUNNING' THEN s.now + 3600 END,
       CASE WHEN s.state = 'RUNNING' THEN 'celery@bench/4242' END, NULL,
       md5(i::text || 'claim'), 'NEW', md5(i::text || 'a') || md5(i::text || 'b'),
       '{"task":"bench.scale.task","id":"' || md5(i::text || 'id') || '","args":[' || i
           || '],"kwargs":{},"options":{"queue":"celery","exchange":"","routing_key":"celery"},'
           || '"headers":{"guard_published_at":' || s.now || '}}',
       CASE WHEN s.state = 'COMPLETED' THEN '{"ok":true,"n":' || i || '}' END,
       CASE WHEN s.state IN ('RELEASED', 'DEAD') THEN 'RuntimeError: bench' END, 0,
       s.expires - %(retention)s, s.expires - %(retention)s + 1,
       CASE WHEN s.state = 'COMPLETED' THEN s.expires - %(retention)s + 1 END,
       CASE WHEN s.state = 'COMPLETED' THEN s.expires END, NULL
FROM generate_series(1, %(n)s) AS i,
LATERAL (
    SELECT CASE WHEN i %% 10000 = 0 THEN 'RUNNING' WHEN i %% 100 < 2 THEN 'RELEASED'
                WHEN i %% 100 = 2 THEN 'DEAD' ELSE 'COMPLETED' END AS state,
           extract(epoch FROM clock_timestamp())::double precision AS now,
           -- spread evenly over (now - expired * retention, now + (1 - expired) * retention)
           extract(epoch FROM clock_timestamp())::double precision
               + %(retention)s * ((i::double precision / %(n)s) - %(expired)s) AS expires
) AS s
"""

SIZES = """
SELECT c.relname, pg_relation_size(c.oid) AS bytes
FROM pg_class AS c
WHERE c.relname = 'celery_guard_keys'
   OR c.oid IN (SELECT indexrelid FROM pg_index
                WHERE indrelid = 'celery_guard_keys'::regclass)
UNION ALL
SELECT 'toast', COALESCE(pg_relation_size(reltoastrelid), 0) FROM pg_class
WHERE relname = 'celery_guard_keys'
ORDER BY 1
"""


def percentile(values: list[float], share: float) -> float:
    """The ``share`` quantile (0..1) of ``values``, nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(share * len(ordered)) - 1))]


def load() -> str:
    return "/".join(f"{value:.2f}" for value in os.getloadavg())


def dsn(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://")


def sizes(url: str) -> dict[str, int]:
    with psycopg.connect(dsn(url), autocommit=True) as connection:
        return {str(name): int(size) for name, size in connection.execute(SIZES).fetchall()}


def table_stats(url: str) -> dict[str, float]:
    with psycopg.connect(dsn(url), autocommit=True) as connection:
        row = connection.execute(
            "SELECT n_tup_ins, n_tup_upd, n_tup_hot_upd, n_tup_del, n_dead_tup, n_live_tup, "
            "autovacuum_count, autoanalyze_count FROM pg_stat_user_tables "
            "WHERE relname = 'celery_guard_keys'"
        ).fetchone()
    assert row is not None
    names = ("inserted", "updated", "hot", "deleted", "dead", "live", "autovacuums", "analyzes")
    return {name: float(value or 0) for name, value in zip(names, row, strict=True)}


def expired_backlog(url: str) -> int:
    with psycopg.connect(dsn(url), autocommit=True) as connection:
        row = connection.execute(
            "SELECT count(*) FROM celery_guard_keys WHERE state = 'COMPLETED' "
            "AND expires_at <= extract(epoch FROM clock_timestamp())"
        ).fetchone()
    assert row is not None
    return int(row[0])


def pg_test_fsync() -> str:
    """The disk's own fsync latency as pg_test_fsync measures it (fdatasync, one 8 kB write)."""
    binary = PG_BIN / "pg_test_fsync"
    if not binary.exists():
        return "pg_test_fsync not found"
    # In the temporary directory, where the rig's PostgreSQL data directories live.
    with tempfile.TemporaryDirectory(prefix="bench-fsync-") as scratch:
        done = subprocess.run(
            [str(binary), "-s", "2", "-f", str(Path(scratch) / "probe")],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    for line in done.stdout.splitlines():
        if "fdatasync" in line and "ops/sec" in line:
            parts = line.split()
            return f"{float(parts[-2]) / 1000:.2f} ms per fdatasync ({parts[-4]} ops/s)"
    return done.stdout.strip().splitlines()[-1] if done.stdout.strip() else "unknown"


# -- many keys -------------------------------------------------------------------------------


@dataclass
class KeysRun:
    rows: int
    indexes: str
    fill_seconds: float = 0.0
    fill_load: str = ""
    claims: list[float] = field(default_factory=list)
    steady_claims: list[float] = field(default_factory=list)
    new_claims: list[float] = field(default_factory=list)
    duplicate_claims: list[float] = field(default_factory=list)
    completions: list[float] = field(default_factory=list)
    seconds: float = 0.0
    load: str = ""
    pruned: int = 0
    prune_seconds: float = 0.0
    prune_passes: int = 0
    backlog_before: int = 0
    backlog_after: int = 0
    retention: float = 0.0
    drain_rate: float = 0.0
    sizes_before: dict[str, int] = field(default_factory=dict)
    sizes_after: dict[str, int] = field(default_factory=dict)
    stats_before: dict[str, float] = field(default_factory=dict)
    stats_after: dict[str, float] = field(default_factory=dict)
    scans: dict[str, float] = field(default_factory=dict)


def prune_loop(url: str, stop_at: float, report: Any) -> None:
    """The reaper's pruning, in its own process: one pass every reaper interval until
    ``stop_at`` (a ``time.time()``); adds rows, busy seconds and passes to ``report``."""
    store = SqlStore(GuardConfig(store_url=url, store_timeout=30.0))
    try:
        next_pass = time.time()
        while time.time() < stop_at:
            started = time.monotonic()
            pruned = store.recovery.prune_pass(REAPER_INTERVAL / 2)
            busy = time.monotonic() - started
            with report.get_lock():
                report[0] += pruned
                report[1] += busy
                report[2] += 1
                if busy >= REAPER_INTERVAL / 2:  # spent its budget on a backlog: full pace
                    report[3] = max(report[3], pruned / max(busy, 1e-9))
                elif not report[4]:  # the first pass that caught up: steady state from here
                    report[4] = time.time()
            next_pass += REAPER_INTERVAL
            time.sleep(max(0.0, min(next_pass, stop_at) - time.time()))
    finally:
        store.dispose()


def time_scans(store: SqlStore) -> dict[str, float]:
    """Milliseconds each of the reaper's scans of the keys table takes (best of three)."""
    scans = {
        "orphans": lambda: store.recovery.orphans(republish_after=60.0, limit=200),
        "dead owners": lambda: store.recovery.dead_owner_keys(limit=200),
        "expired leases (guard status)": store.keys.count_expired_leases,
        "oldest running (guard status)": store.keys.oldest_running,
    }
    out = {}
    for name, scan in scans.items():
        best = float("inf")
        for _ in range(3):
            started = time.perf_counter()
            scan()
            best = min(best, time.perf_counter() - started)
        out[name] = best * 1000
    return out


def claim_request(key: str) -> ClaimRequest:
    return ClaimRequest(
        key=key,
        task_name=TASK,
        fingerprint=None,
        check_fingerprint=False,
        owner="celery@bench/1",
        message='{"task":"bench.scale.task","id":"' + key[-32:] + '","args":[],"kwargs":{}}',
        lease_ttl=300.0,
    )


def run_keys(args: argparse.Namespace, rows: int, indexes: str) -> KeysRun:
    run = KeysRun(rows=rows, indexes=indexes)
    postgres = PostgresServer(durable=True, start_timeout=60)
    try:
        postgres.start()
        url = postgres.url
        store = SqlStore(GuardConfig(store_url=url, store_timeout=30.0))
        store.ensure_schema()
        with psycopg.connect(dsn(url), autocommit=True) as connection:
            if indexes == "legacy":
                for row in connection.execute(
                    "SELECT indexname FROM pg_indexes WHERE tablename = 'celery_guard_keys' "
                    "AND indexname <> 'celery_guard_keys_pkey'"
                ).fetchall():
                    connection.execute(f'DROP INDEX "{row[0]}"')
                connection.execute(
                    "ALTER TABLE celery_guard_keys RESET (fillfactor, "
                    "autovacuum_vacuum_scale_factor, autovacuum_vacuum_threshold,"
                    " autovacuum_vacuum_insert_scale_factor)"
                )
                for statement in LEGACY_INDEXES:
                    connection.execute(statement)
            # The retention that makes keys expire as fast as the client inserts them.
            run.retention = rows / args.insert_rate
            started = time.monotonic()
            connection.execute(
                FILL, {"n": rows, "retention": run.retention, "expired": args.expired}
            )
            connection.execute("VACUUM (ANALYZE) celery_guard_keys")
            run.fill_seconds = time.monotonic() - started
            run.fill_load = load()
        print(f"{rows} rows ({indexes}): filled in {run.fill_seconds:.0f} s", flush=True)
        run.sizes_before = sizes(url)
        run.scans = time_scans(store)
        run.backlog_before = expired_backlog(url)
        run.stats_before = table_stats(url)

        # COMPLETED keys (i % 100 = 50) from the half of the table that expires last.
        step = max(100, (rows // 2) // 5000 // 100 * 100)
        duplicates = [f"bench.scale:{_md5(i)}" for i in range(rows // 2 + 50, rows, step)]
        report = multiprocessing.get_context("spawn").Array("d", 5)
        stop_at = time.time() + args.seconds
        pruner = multiprocessing.get_context("spawn").Process(
            target=prune_loop, args=(url, stop_at, report), daemon=True
        )
        pruner.start()
        try:
            started = time.monotonic()
            n = 0
            stamps: list[float] = []
            while time.time() < stop_at:
                n += 1
                if n % 10 == 0:
                    key = duplicates[(n // 10) % len(duplicates)]
                else:
                    key = f"bench.scale.new:{os.getpid()}:{n}"
                stamps.append(time.time())
                t0 = time.perf_counter()
                result = store.keys.claim(claim_request(key))
                t1 = time.perf_counter()
                run.claims.append(t1 - t0)
                if result.outcome is ClaimOutcome.CLAIMED:
                    run.new_claims.append(t1 - t0)
                    store.keys.complete(
                        key, result.record.fencing_token, '{"ok":true}', run.retention
                    )
                    run.completions.append(time.perf_counter() - t1)
                else:
                    run.duplicate_claims.append(t1 - t0)
            run.seconds = time.monotonic() - started
            run.load = load()
        finally:
            pruner.join(timeout=args.seconds + 120)
            if pruner.is_alive():
                pruner.kill()
                pruner.join(10)
        run.pruned, run.prune_seconds, run.prune_passes = int(report[0]), report[1], int(report[2])
        run.drain_rate = report[3]
        # The claims made once pruning had caught up with the backlog.
        steady_from = report[4] or stop_at
        run.steady_claims = [
            latency for at, latency in zip(stamps, run.claims, strict=True) if at >= steady_from
        ]
        run.backlog_after = expired_backlog(url)
        run.stats_after = table_stats(url)
        run.sizes_after = sizes(url)
        store.dispose()
    finally:
        postgres.stop()
    claimed = len(run.claims) / max(run.seconds, 1e-9)
    print(
        f"{rows} rows ({indexes}): {claimed:.0f} claims/s, claim p50 "
        f"{percentile(run.claims, 0.5) * 1000:.3f} ms p99 {percentile(run.claims, 0.99) * 1000:.3f}"
        f" ms; completion p50 {percentile(run.completions, 0.5) * 1000:.3f} ms; pruned "
        f"{run.pruned} ({run.pruned / max(run.seconds, 1e-9):.0f}/s); backlog "
        f"{run.backlog_before} -> {run.backlog_after}; pruning busy {run.prune_seconds:.1f} s",
        flush=True,
    )
    return run


def _md5(i: int) -> str:
    import hashlib

    return hashlib.md5(str(i).encode()).hexdigest()  # the fill's key, not security


# -- report -------------------------------------------------------------------------------


def _ms(values: list[float], share: float) -> str:
    return f"{percentile(values, share) * 1000:.3f}" if values else "-"


def _mib(size: int) -> str:
    return f"{size / 2**20:,.1f}"


def render_keys(args: argparse.Namespace, runs: list[KeysRun]) -> list[str]:
    out = [
        "### Many keys: claim and completion latency while pruning runs",
        "",
        f"One client, closed loop, {args.seconds:.0f} s per size: claims through "
        "`SqlStore.keys.claim` (90% new keys, each then completed through "
        "`SqlStore.keys.complete`; 10% duplicates of COMPLETED keys), while another process "
        "prunes as the reaper does (`Recovery.prune_pass`, one pass every "
        f"{REAPER_INTERVAL:.0f} s, up to half of it). The retention is rows / "
        f"{args.insert_rate:.0f} s, so keys expire about as fast as the client inserts; "
        f"{args.expired:.0%} of the COMPLETED keys are already expired at the start (a backlog "
        "for pruning to catch up on). Latency is measured in the client around each call "
        "(round trip included); *once the backlog is pruned*: the claims made after the first "
        "pruning pass that ended before its time budget (it had caught up). The claim commits "
        "without waiting for its "
        'WAL flush (`guard_claim_synchronous_commit = "off"`), the completion waits for it.',
        "",
        "| Rows | Indexes | Claim p50 / p99 (ms) | Once the backlog is pruned "
        "| New-key claim p50 / p99 | Duplicate p50 / p99 "
        "| Completion p50 / p99 | Claims/s | Pruned/s (share of time pruning) "
        "| Pruning's pace through the backlog "
        "| Expired backlog start → end | Load (1/5/15) |",
        "|---:|---|---|---|---|---|---|---:|---:|---:|---|---|",
    ]
    for run in runs:
        rate = len(run.claims) / max(run.seconds, 1e-9)
        busy = run.prune_seconds / max(run.seconds, 1e-9)
        out.append(
            f"| {run.rows:,} | {run.indexes} | {_ms(run.claims, 0.5)} / {_ms(run.claims, 0.99)} "
            f"| {_ms(run.steady_claims, 0.5)} / {_ms(run.steady_claims, 0.99)} "
            f"| {_ms(run.new_claims, 0.5)} / {_ms(run.new_claims, 0.99)} "
            f"| {_ms(run.duplicate_claims, 0.5)} / {_ms(run.duplicate_claims, 0.99)} "
            f"| {_ms(run.completions, 0.5)} / {_ms(run.completions, 0.99)} | {rate:,.0f} "
            f"| {run.pruned / max(run.seconds, 1e-9):,.0f} ({busy:.0%}) "
            f"| {f'{run.drain_rate:,.0f} rows/s' if run.drain_rate else 'no pass used its budget'} "
            f"| {run.backlog_before:,} → {run.backlog_after:,} | {run.load} |"
        )
    out += [
        "",
        "Table and index sizes (MiB), after the fill (and `VACUUM ANALYZE`) → after the run; "
        "updates that were HOT (no new index entries) during the run; the reaper's scans "
        "(best of three, ms, before the run):",
        "",
        "| Rows | Indexes | Fill (s, load) | Relation sizes before → after | HOT updates "
        "| Autovacuums | Reaper scans (ms) |",
        "|---:|---|---|---|---|---:|---|",
    ]
    for run in runs:
        names = sorted(set(run.sizes_before) | set(run.sizes_after))
        relations = "; ".join(
            f"{name}: {_mib(run.sizes_before.get(name, 0))} → {_mib(run.sizes_after.get(name, 0))}"
            for name in names
        )
        updated = run.stats_after["updated"] - run.stats_before["updated"]
        hot = run.stats_after["hot"] - run.stats_before["hot"]
        vacuums = run.stats_after["autovacuums"] - run.stats_before["autovacuums"]
        scans = "; ".join(f"{name} {ms:.2f}" for name, ms in run.scans.items())
        out.append(
            f"| {run.rows:,} | {run.indexes} | {run.fill_seconds:.0f} ({run.fill_load}) "
            f"| {relations} | {hot:,.0f} of {updated:,.0f} | {vacuums:.0f} | {scans} |"
        )
    return out


def render(
    args: argparse.Namespace,
    runs: list[KeysRun],
    claimers: list[str],
    info: dict[str, str],
    command: str,
    wall: float,
    fsync: str,
) -> str:
    today = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    out = [
        HEADING,
        "",
        f"`{command}`, {today}, {wall / 60:.0f} min. The method is in bench/scale.py's "
        "docstring. PostgreSQL as production runs it: fsync, synchronous_commit and "
        "full_page_writes on (the rig's `PostgresServer(durable=True)`, shared_buffers 64 MB). "
        "The disk's own fsync latency (pg_test_fsync, in the temporary directory the servers' "
        f"data lives in): {fsync}.",
        "",
    ]
    if runs:
        out += [*render_keys(args, runs), ""]
    out += claimers
    out += ["", "### Machine and versions", ""]
    out += [f"- {key}: {value}" for key, value in info.items()]
    return "\n".join(out) + "\n"


def _list(value: str, kind: type) -> list[Any]:
    return [kind(part) for part in value.split(",") if part.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--rows", default="1000000,10000000", help="table sizes (1M and 10M)")
    parser.add_argument("--indexes", default="partial", help="partial and/or legacy (partial)")
    parser.add_argument("--seconds", type=float, default=60, help="measured seconds per size")
    parser.add_argument(
        "--insert-rate", type=float, default=600, help="the rate the retention is sized for"
    )
    parser.add_argument("--expired", type=float, default=0.02, help="share expired at start")
    parser.add_argument("--workers", default="2,4,8", help="worker counts for the claimers run")
    parser.add_argument("--concurrency", type=int, default=4, help="pool size per worker (4)")
    parser.add_argument("--tasks", type=int, default=4000, help="messages per claimers run")
    parser.add_argument(
        "--store-url",
        help="the claimers' store (default: a private durable "
        "PostgreSQL; a PgBouncer in front of one, say)",
    )
    parser.add_argument(
        "--pgbouncer",
        action="store_true",
        help="the claimers' store through a private PgBouncer in transaction pooling",
    )
    parser.add_argument(
        "--claimers-timeout", type=float, default=600, help="seconds allowed per claimers run"
    )
    parser.add_argument("--skip", default="", help="keys and/or claimers: parts not to run")
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "benchmarks.md")
    parser.add_argument("--no-write", action="store_true", help="print, do not write --output")
    args = parser.parse_args()
    command = shlex.join([os.path.relpath(sys.executable, ROOT), *sys.argv])
    started, load_at_start = time.monotonic(), os.getloadavg()
    fsync = pg_test_fsync()
    print(f"pg_test_fsync: {fsync}", flush=True)
    runs: list[KeysRun] = []
    if "keys" not in args.skip:
        for rows in _list(args.rows, int):
            for indexes in _list(args.indexes, str):
                runs.append(run_keys(args, rows, indexes))
    claimers: list[str] = []
    postgres, redis_server = PostgresServer(durable=True), RedisServer()
    try:
        postgres.start()
        redis_server.start()
        if "claimers" not in args.skip:
            claimers = run_claimers(args, postgres, redis_server)
        info = machine_info(postgres, redis_server, load_at_start)
    finally:
        redis_server.stop()
        postgres.stop()
    wall = time.monotonic() - started
    section = render(args, runs, claimers, info, command, wall, fsync)
    print("\n" + section)
    if not args.no_write:
        write_section(args.output, section, HEADING)
        print(f"written to {args.output}")


# -- many claimers ------------------------------------------------------------------------


@dataclass
class ClaimersRun:
    workers: int
    tasks: int
    unique: int
    seconds: float = 0.0
    deadlocks: int = 0
    lock_samples: int = 0
    samples: int = 0
    most_waiting: int = 0
    wait_events: collections.Counter[str] = field(default_factory=collections.Counter)
    leader_changes: int = 0
    effects: int = 0
    doubled: int = 0
    effect_span: float = 0.0
    load: str = ""


def _pg_url(url: str) -> str:
    return url if "+psycopg" in url else url.replace("postgresql://", "postgresql+psycopg://", 1)


def run_claimers(
    args: argparse.Namespace, postgres: PostgresServer, redis_server: RedisServer
) -> list[str]:
    """Each ``--workers`` count in turn, on a fresh effect table and keys table."""
    url = _pg_url(args.store_url or postgres.url)
    env = {"BENCH_BROKER_URL": redis_server.url_for(0), "BENCH_STORE_URL": url}
    bouncer: PgBouncerServer | None = None
    if args.pgbouncer:
        # The workers' store through PgBouncer in transaction pooling, their liveness session
        # straight to PostgreSQL (docs/pgbouncer.md); the bench's own reads go through it too.
        bouncer = PgBouncerServer(postgres, pool_size=20)
        bouncer.start()
        url = bouncer.serve(postgres.url, timeout="30s")
        env["BENCH_STORE_URL"] = url
        env["BENCH_GUARD_CONF"] = json.dumps(
            {"guard_store_pooling": "transaction", "guard_liveness_url": postgres.url}
        )
    os.environ.update(env)  # read by bench.scale_app when it is imported
    from bench import scale_app
    from celery_guard import get_runtime

    runtime = get_runtime(scale_app.app)
    runtime.migrate()
    scale_app.metadata.create_all(runtime.store.engine)
    runtime.store.dispose()
    runs = []
    try:
        for workers in _list(args.workers, int):
            runs.append(claimers_once(args, workers, url, env, redis_server, scale_app))
    finally:
        if bouncer is not None:
            bouncer.stop()
    return render_claimers(args, runs)


def claimers_once(
    args: argparse.Namespace,
    workers: int,
    url: str,
    env: dict[str, str],
    redis_server: RedisServer,
    scale_app: Any,
) -> ClaimersRun:

    unique = int(args.tasks * (1 - DUPLICATE_SHARE))
    run = ClaimersRun(workers=workers, tasks=args.tasks, unique=unique)
    queue = f"bench.scale.{workers}.{time.time_ns()}"
    with psycopg.connect(dsn(url), autocommit=True) as connection:
        connection.execute("TRUNCATE bench_scale_effects, celery_guard_keys")
        connection.execute(
            "DELETE FROM celery_guard_leaders WHERE name <> 'celery_guard.token_floor'"
        )
    # Every tenth message repeats an earlier key, spread through the backlog.
    numbers = list(range(unique))
    for position in range(args.tasks - unique):
        numbers.insert((position + 1) * 10 - 1, position * 7 % unique)
    with scale_app.app.producer_or_acquire() as producer:
        for n in numbers:
            scale_app.effect.apply_async((n,), queue=queue, producer=producer)
    deadlocks_before = _deadlocks(url)
    started_workers = [
        WorkerProcess(
            scale_app.__name__,
            env=env,
            cwd=ROOT,
            concurrency=args.concurrency,
            queues=queue,
            loglevel="WARNING",
        )
        for _ in range(workers)
    ]
    stop = threading.Event()
    sampler = threading.Thread(target=_sample_locks, args=(url, run, stop), daemon=True)
    try:
        for worker in started_workers:
            worker.start(wait_ready=False)
        sampler.start()
        started = time.monotonic()

        def drained() -> bool:
            for worker in started_workers:
                if not worker.is_alive():
                    raise RuntimeError(f"a worker exited with code {worker.returncode}")
            with psycopg.connect(dsn(url), autocommit=True) as connection:
                row = connection.execute(
                    "SELECT (SELECT count(*) FROM bench_scale_effects), "
                    "(SELECT COALESCE(sum(duplicates), 0) FROM celery_guard_keys)"
                ).fetchone()
            assert row is not None
            return bool(row[0] >= unique and row[1] >= args.tasks - unique)

        procs.wait_until(drained, args.claimers_timeout, f"{args.tasks} messages drained", 0.2)
        run.seconds = time.monotonic() - started
        run.load = load()
        # Read before the workers stop: each warm shutdown of the leader hands the lease on.
        with psycopg.connect(dsn(url), autocommit=True) as connection:
            leader = connection.execute(
                "SELECT term FROM celery_guard_leaders WHERE name = 'reaper'"
            ).fetchone()
        leader_changes = max(0, int(leader[0]) - 1) if leader else 0
    finally:
        stop.set()
        for worker in started_workers:
            worker.cleanup()  # warm shutdown by PID, SIGKILL after 20 s
        sampler.join(10)
    run.deadlocks = _deadlocks(url) - deadlocks_before
    run.leader_changes = leader_changes
    with psycopg.connect(dsn(url), autocommit=True) as connection:
        row = connection.execute(
            "SELECT count(*), count(*) - count(DISTINCT key), max(at) - min(at) "
            "FROM bench_scale_effects"
        ).fetchone()
    assert row is not None
    run.effects, run.doubled = int(row[0]), int(row[1])
    run.effect_span = float(row[2] or 0.0)
    print(
        f"{workers} workers x {args.concurrency}: {run.unique / run.effect_span:.0f} effects/s, "
        f"deadlocks {run.deadlocks}, lock-wait samples {run.lock_samples}/{run.samples}, "
        f"leader changes {run.leader_changes}, effects {run.effects} ({run.doubled} doubled)",
        flush=True,
    )
    if run.doubled or run.effects != unique:
        raise RuntimeError(f"{run.effects} effect rows for {unique} keys ({run.doubled} doubled)")
    return run


def _claimers_store(args: argparse.Namespace) -> str:
    if args.pgbouncer:
        return (
            "the durable PostgreSQL through PgBouncer 1.18 in transaction pooling (20 server "
            "sessions; `guard_store_pooling = 'transaction'`, the liveness session direct)"
        )
    return "`--store-url`" if args.store_url else "the durable PostgreSQL"


def _deadlocks(url: str) -> int:
    with psycopg.connect(dsn(url), autocommit=True) as connection:
        row = connection.execute(
            "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()
    return int(row[0]) if row else 0


def _sample_locks(url: str, run: ClaimersRun, stop: threading.Event) -> None:
    """Every 50 ms: how many of the database's sessions wait on a heavyweight lock, and on what."""
    with psycopg.connect(dsn(url), autocommit=True) as connection:
        while not stop.wait(0.05):
            rows = connection.execute(
                "SELECT wait_event_type, wait_event FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid() "
                "AND state = 'active' AND wait_event_type IN ('Lock', 'LWLock')"
            ).fetchall()
            run.samples += 1
            locks = [f"{kind}:{event}" for kind, event in rows]
            heavy = sum(1 for kind, _ in rows if kind == "Lock")
            if heavy:
                run.lock_samples += 1
            run.most_waiting = max(run.most_waiting, heavy)
            run.wait_events.update(locks)


def render_claimers(args: argparse.Namespace, runs: list[ClaimersRun]) -> list[str]:
    out = [
        "### Many claimers",
        "",
        f"Real `celery worker` processes (prefork, concurrency {args.concurrency}, prefetch 4), "
        f"a Redis broker, {_claimers_store(args)}; a "
        f"backlog of {args.tasks:,} messages published before the workers start, every tenth "
        "repeating an earlier key (bench/scale_app.py: its effect row commits with the key's "
        "COMPLETED marker). The rate is effects per second from the first effect committed "
        "to the last (worker start-up left out); the wall time runs from the workers' start to "
        "the last duplicate answered. Lock waits: `pg_stat_activity` sampled every "
        "50 ms (sessions in `wait_event_type = 'Lock'`); deadlocks: "
        "`pg_stat_database.deadlocks` before and after; leader changes: the reaper's "
        "`celery_guard_leaders.term` minus its first, read before the workers stop.",
        "",
        "| Workers | Effects/s | Wall (s) | Deadlocks | Samples with a lock wait "
        "| Most sessions waiting | Wait events seen (samples) | Reaper leader changes "
        "| Effect rows / keys | Load |",
        "|---:|---:|---:|---:|---:|---:|---|---:|---|---|",
    ]
    for run in runs:
        events = ", ".join(f"{name} {count}" for name, count in run.wait_events.most_common(4))
        out.append(
            f"| {run.workers} | {run.unique / max(run.effect_span, 1e-9):,.0f} "
            f"| {run.seconds:.0f} | {run.deadlocks} "
            f"| {run.lock_samples} of {run.samples} | {run.most_waiting} | {events or 'none'} "
            f"| {run.leader_changes} | {run.effects:,} / {run.unique:,} | {run.load} |"
        )
    return out


if __name__ == "__main__":
    main()
