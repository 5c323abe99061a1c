"""What the claim and the completion cost PostgreSQL, statement by statement, beside the floor's.

Run from the repository root::

    .venv/bin/python bench/claim_cost.py --output docs/benchmarks.md

Throughput on a small shared machine scatters by tens of percent from run to run; the CPU a
PostgreSQL backend spends on one statement does not. This measures that, in one process against
a private PostgreSQL from the test rig (``--settings durable``, the default: fsync and
synchronous_commit on, as production runs it; ``fast``: the rig's), one "task" being the two
statements of a delivery on celery_guard's hot connection, claim then the autocommitted
COMPLETED marker:

- ``floor``: bench/floor.py's two statements on a kept psycopg connection, prepared;
- ``new``: celery_guard's ``Keys.claim`` and ``Keys.complete`` on a key without a row, as a
  first delivery claims it (the insert-only ``claim_new`` of celery_guard/store/queries/keys.sql);
- ``new_upsert``: the same with the full upsert only (``claim``), as every claim ran before
  ``claim_new`` existed;
- ``retry``: a key RELEASED by an earlier execution claimed again with the hint of a first
  delivery (``claim_new`` finds the row, then the upsert takes it over), and ``retry_upsert``
  the same through the upsert alone, as a retry's claim runs: the price an existing key pays
  when it is taken for a new one.

Per way, the median over the repeats (interleaved) of the PostgreSQL backends' CPU per claim
and per completion (``/proc``, all server processes), this process's CPU and the wall time
per task.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # so that ``tests.rig`` and ``bench`` import when run as a script
    sys.path.insert(0, str(ROOT))

from bench import floor  # noqa: E402
from bench.cpu import process_seconds  # noqa: E402
from bench.overhead import publish_section, settings_phrase  # noqa: E402
from celery_guard import GuardConfig  # noqa: E402
from celery_guard.store import ClaimOutcome, ClaimRequest, SqlStore  # noqa: E402
from celery_guard.store import keys as keys_module  # noqa: E402
from tests.rig import procs  # noqa: E402
from tests.rig.servers import PostgresServer  # noqa: E402

WAYS = ("floor", "new", "new_upsert", "retry", "retry_upsert")
HEADING = "## Claim cost on the server (bench/claim_cost.py)"
#: Columns, in µs per task: what each run measures.
COLUMNS = (
    "server: claim",
    "server: completion",
    "client CPU",
    "wall",
    "WAL bytes: claim",
    "WAL bytes: completion",
)
#: As GuardedTask stores a no-op task's message with its claim (messages.from_request): the
#: row, and so the claim's and the completion's WAL, are as large as a worker's.
MESSAGE = (
    '{"args":[10099970],"exchange":null,"headers":{"guard_idempotency_key":"noop:10099970",'
    '"guard_key_source":"option"},"id":"398bf0ce-3499-417b-8f16-b27ed1a74fa7","kwargs":{},'
    '"priority":null,"routing_key":null,"task":"bench.guarded_noop"}'
)


def server_seconds(postgres: PostgresServer) -> float:
    """CPU seconds of the server and its backends now."""
    return sum(process_seconds(pid) for pid in [postgres.pid, *procs.descendants(postgres.pid)])


def request(key: str) -> ClaimRequest:
    return ClaimRequest(
        key=key,
        task_name="bench.noop",
        fingerprint="f" * 40,
        check_fingerprint=True,
        owner="bench@host/1",
        message=MESSAGE,
        lease_ttl=30.0,
    )


@contextmanager
def upsert_only() -> Iterator[None]:
    """Claims take the full upsert at once, as before ``claim_new`` (a bench-only switch)."""
    original = keys_module._claim_new_statement
    keys_module._claim_new_statement = lambda *_: None  # type: ignore[assignment]
    try:
        yield
    finally:
        keys_module._claim_new_statement = original


class Way:
    """One way to run ``tasks`` claims and completions: ``prepare`` (untimed), then the two
    timed phases, each over all keys."""

    def __init__(
        self,
        prepare: Callable[[list[str]], None],
        claim: Callable[[str], int],
        complete: Callable[[str, int], None],
    ) -> None:
        self.prepare, self.claim, self.complete = prepare, claim, complete


def guard_way(store: SqlStore, *, retry: bool) -> Way:
    keys = store.keys

    def claim(key: str) -> int:
        result = keys.claim(request(key))
        assert result.outcome is ClaimOutcome.CLAIMED, result.outcome
        return result.record.fencing_token

    def prepare(names: list[str]) -> None:
        if retry:  # each key claimed once and released, as after a failed attempt
            for key in names:
                keys.release(key, claim(key), "transient")

    return Way(prepare, claim, lambda key, token: keys.complete(key, token, "null", 3600.0))


def floor_way(dsn: str) -> Way:
    connection = psycopg.connect(dsn, autocommit=True)
    claim_sql = floor.claim_sql("off")

    def claim(key: str) -> int:
        row = connection.execute(
            claim_sql, {"key": key, "lease": floor.LEASE_SECONDS}, prepare=True
        ).fetchone()
        assert row is not None
        return int(row[0])

    def complete(key: str, token: int) -> None:
        connection.execute(floor.COMPLETE, {"key": key, "token": token}, prepare=True)

    return Way(lambda names: None, claim, complete)


def wal_position(admin: psycopg.Connection[Any]) -> int:
    """The server's WAL insert position, in bytes."""
    row = admin.execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')").fetchone()
    assert row is not None
    return int(row[0])


def run(
    way: Way, postgres: PostgresServer, admin: psycopg.Connection[Any], tasks: int, upsert: bool
) -> dict[str, float]:
    """µs (and WAL bytes) per task of each column for one run of ``tasks`` fresh keys."""
    prefix = uuid.uuid4().hex[:8]
    warm = [f"warm-{prefix}-{n}" for n in range(20)]
    names = [f"{prefix}-{n}" for n in range(tasks)]
    switch = upsert_only() if upsert else _nothing()
    with switch:
        way.prepare(warm + names)
        for key in warm:  # connections opened, statements prepared
            way.complete(key, way.claim(key))
        # Each position read is one small statement of its own, outside the timed CPU.
        wal0 = wal_position(admin)
        server0, client0, wall0 = server_seconds(postgres), time.process_time(), time.perf_counter()
        tokens = [way.claim(key) for key in names]
        server1 = server_seconds(postgres)
        wal1 = wal_position(admin)
        server1b = server_seconds(postgres)
        for key, token in zip(names, tokens, strict=True):
            way.complete(key, token)
        server2, client1, wall1 = server_seconds(postgres), time.process_time(), time.perf_counter()
        wal2 = wal_position(admin)
    per_task = 1e6 / tasks
    return {
        "server: claim": (server1 - server0) * per_task,
        "server: completion": (server2 - server1b) * per_task,
        "client CPU": (client1 - client0) * per_task,
        "wall": (wall1 - wall0) * per_task,
        "WAL bytes: claim": (wal1 - wal0) / tasks,
        "WAL bytes: completion": (wal2 - wal1) / tasks,
    }


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=3000, help="tasks per run (3000)")
    parser.add_argument("--repeats", type=int, default=5, help="runs per way; median (5)")
    parser.add_argument("--settings", choices=("durable", "fast"), default="durable")
    parser.add_argument("--output", type=Path, default=None, help="markdown file to write to")
    args = parser.parse_args()
    command = shlex.join([os.path.relpath(sys.executable, ROOT), *sys.argv])
    load, started = os.getloadavg(), time.monotonic()
    measured: dict[str, list[dict[str, float]]] = {way: [] for way in WAYS}
    with PostgresServer(durable=args.settings == "durable") as postgres:
        store = SqlStore(GuardConfig(store_url=postgres.url))
        store.ensure_schema()
        admin = psycopg.connect(postgres.dsn_for(), autocommit=True)
        admin.execute(
            f"CREATE TABLE {floor.FLOOR_KEYS} (key varchar(200) PRIMARY KEY, "
            "state varchar(16) NOT NULL, token integer NOT NULL, "
            "lease_expires_at double precision)"
        )
        ways = {
            "floor": floor_way(postgres.dsn_for()),
            "new": guard_way(store, retry=False),
            "new_upsert": guard_way(store, retry=False),
            "retry": guard_way(store, retry=True),
            "retry_upsert": guard_way(store, retry=True),
        }
        try:
            for _ in range(args.repeats):  # interleaved, so drift hits every way alike
                for name in WAYS:
                    result = run(
                        ways[name], postgres, admin, args.tasks, upsert=name.endswith("_upsert")
                    )
                    measured[name].append(result)
                    print(
                        f"{name:12s} " + "  ".join(f"{c} {result[c]:6.0f}" for c in COLUMNS),
                        flush=True,
                    )
        finally:
            store.dispose()
            admin.close()
    section = render(args, command, measured, load, time.monotonic() - started)
    publish_section(args.output, section, HEADING)


def render(
    args: argparse.Namespace,
    command: str,
    measured: dict[str, list[dict[str, float]]],
    load: tuple[float, float, float],
    wall: float,
) -> str:
    setting = settings_phrase(args.settings)
    lines = [
        HEADING,
        "",
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} with `{command}` "
        f"({wall:.0f} s; load average {load[0]:.2f} at start on {os.cpu_count()} CPUs).",
        "",
        f"PostgreSQL with {setting}. {args.tasks} keys per run, claimed one after another, then "
        f"completed; median of {args.repeats} interleaved runs, per task (µs but for the WAL). "
        "*server*: CPU of every PostgreSQL process (`/proc`) during the claims and during the "
        "completions; *client CPU*: this process (psycopg and celery_guard's store layer, "
        "no Celery); *wall*: both phases; "
        "*WAL bytes*: the server's WAL written per claim and per completion "
        "(`pg_current_wal_lsn()`), the stored message as long as a worker's no-op task's. "
        "Ways: *floor*: bench/floor.py's two statements; *new*: celery_guard's `Keys.claim` and "
        "`Keys.complete` on keys without a row (the insert-only `claim_new`); *new_upsert*: "
        "the same through the full upsert alone (every claim before `claim_new`); *retry*: "
        "RELEASED keys claimed again with a first delivery's hint (`claim_new` finds the row, "
        "then the upsert takes it over); *retry_upsert*: the same through the upsert alone, "
        "as a retry's claim runs.",
        "",
        "| Way | " + " | ".join(COLUMNS) + " |",
        "|---|" + "---:|" * len(COLUMNS),
    ]
    for name in WAYS:
        medians = [statistics.median(run[c] for run in measured[name]) for c in COLUMNS]
        lines.append(f"| {name} | " + " | ".join(f"{v:.0f}" for v in medians) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
