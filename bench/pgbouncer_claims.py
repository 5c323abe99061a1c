"""What the unprepared claim costs per task: claim + completion, prepared or not, with PgBouncer.

Run from the repository root::

    .venv/bin/python bench/pgbouncer_claims.py --tasks 3000 --repeats 3

In one process, against private servers from the test rig (PostgreSQL with the rig's fast
settings, and PgBouncer 1.18 in ``pool_mode = transaction`` in front of it), each "task" is the
two statements celery_guard sends per delivery on its hot connection: the claim
(``INSERT ... ON CONFLICT ... RETURNING``) and the autocommitted COMPLETED marker, on a fresh
key. Three ways:

- ``prepared``: PostgreSQL directly, ``guard_store_pooling = "session"``: psycopg prepares both
  statements after 5 executions (its ``prepare_threshold``);
- ``unprepared``: PostgreSQL directly, ``guard_store_pooling = "transaction"``: the same
  statements parsed and planned on every execution, the cost of not preparing alone;
- ``pgbouncer``: through PgBouncer with ``"transaction"``: unprepared plus the pooler's hop.

Per way, the median over the repeats (interleaved) of: wall time per task, this process's CPU
per task, and the CPU of every PostgreSQL process (in all, in the claims, in the completions:
each run claims its keys, then completes them) and of PgBouncer per task, read from ``/proc``.
Only a rough figure on a loaded machine: say what else ran.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from celery_guard import GuardConfig  # noqa: E402
from celery_guard.store import ClaimOutcome, ClaimRequest, SqlStore  # noqa: E402
from tests.rig import procs  # noqa: E402
from tests.rig.servers import PgBouncerServer, PostgresServer  # noqa: E402

WAYS = ("prepared", "unprepared", "pgbouncer")
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: list[int]) -> float:
    """utime + stime of ``pids`` (those still alive), in seconds."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / TICKS


def run(store: SqlStore, tasks: int, server_pids: list[int]) -> tuple[float, ...]:
    """For ``tasks`` claims, then their completions: seconds, client CPU seconds and server CPU
    seconds in all, then the server CPU seconds of the claims and of the completions."""
    prefix = uuid.uuid4().hex[:8]
    for n in range(10):  # warm up: connections opened, statements prepared where they are
        token = claim(store, f"warm-{prefix}-{n}")
        store.keys.complete(f"warm-{prefix}-{n}", token, "null", retention=3600.0)
    server_before, cpu_before = cpu_seconds(server_pids), time.process_time()
    started = time.perf_counter()
    tokens = [claim(store, f"{prefix}-{n}") for n in range(tasks)]
    server_claimed = cpu_seconds(server_pids)
    for n, token in enumerate(tokens):
        store.keys.complete(f"{prefix}-{n}", token, "null", retention=3600.0)
    wall = time.perf_counter() - started
    server_after = cpu_seconds(server_pids)
    return (
        wall,
        time.process_time() - cpu_before,
        server_after - server_before,
        server_claimed - server_before,
        server_after - server_claimed,
    )


def claim(store: SqlStore, key: str) -> int:
    """Claim a fresh key; its fencing token."""
    result = store.keys.claim(
        ClaimRequest(
            key=key,
            task_name="bench.noop",
            fingerprint="fp",
            check_fingerprint=True,
            owner="bench/1",
            message=None,
            lease_ttl=30.0,
        )
    )
    assert result.outcome is ClaimOutcome.CLAIMED
    return result.record.fencing_token


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=3000, help="tasks per run (default 3000)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per way; median (3)")
    args = parser.parse_args()
    load = os.getloadavg()
    with PostgresServer() as postgres, PgBouncerServer(postgres) as pgbouncer:
        urls = {
            "prepared": (postgres.url, "session"),
            "unprepared": (postgres.url, "transaction"),
            "pgbouncer": (pgbouncer.serve(postgres.url), "transaction"),
        }
        stores = {
            way: SqlStore(GuardConfig(store_url=url, store_pooling=pooling))
            for way, (url, pooling) in urls.items()
        }
        stores["prepared"].ensure_schema()
        measured: dict[str, list[tuple[float, ...]]] = {way: [] for way in WAYS}
        try:
            for _ in range(args.repeats):
                for way in WAYS:
                    server = [postgres.pid, *procs.descendants(postgres.pid)]
                    bouncer_before = cpu_seconds([pgbouncer.pid])
                    values = run(stores[way], args.tasks, server)
                    bouncer = cpu_seconds([pgbouncer.pid]) - bouncer_before
                    measured[way].append(
                        tuple(1e3 * value / args.tasks for value in (*values, bouncer))
                    )
        finally:
            for store in stores.values():
                store.dispose()
    print(
        f"{args.tasks} tasks x {args.repeats} repeats, claim + completion per task; load "
        f"average at start {load[0]:.2f} on {os.cpu_count()} CPUs; ms per task, medians"
    )
    print(
        "| way | wall | client CPU | PostgreSQL CPU | of which claim | of which completion "
        "| PgBouncer CPU |"
    )
    print("|---|---|---|---|---|---|---|")
    for way in WAYS:
        columns = [statistics.median(run[i] for run in measured[way]) for i in range(6)]
        print(f"| {way} | " + " | ".join(f"{value:.3f}" for value in columns) + " |")


if __name__ == "__main__":
    main()
