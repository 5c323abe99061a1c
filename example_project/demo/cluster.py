"""The demo's moving parts: the payment provider process, the workers, and one leg's run.

A *leg* is one cluster (four ``celery worker`` processes, a payment provider, a database) running
the scenario: the checkout publishes on time, faults strike on time, the leg waits until the
cluster settles, then reads what happened from the shop's tables, the provider's ledger, the
broker and (guarded leg) the store and the workers' metrics.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import random
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.request
import uuid
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from types import ModuleType
from typing import Any

from sqlalchemy import Engine, create_engine, func, insert, select

from example_project import domain
from example_project.demo.scenario import ROOT, DemoOptions, Scenario, Send

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# The demo reuses the test rig: private servers and worker processes, each stopped by PID.
from tests.rig import procs
from tests.rig.ports import free_port
from tests.rig.servers import PostgresServer, RedisServer
from tests.rig.workers import WorkerProcess

# -- processes -----------------------------------------------------------------------------------


class ProviderProcess:
    """``python -m example_project.payment_provider`` on a free loopback port, stopped by PID."""

    def __init__(self, failure_rate: float, seed: int, log_path: Path) -> None:
        self.port = free_port()
        self.failure_rate = failure_rate
        self.seed = seed
        self.log_path = log_path
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self._proc is not None
        return self._proc.pid

    def start(self) -> None:
        argv = [sys.executable, "-m", "example_project.payment_provider", "--port", str(self.port)]
        argv += ["--failure-rate", str(self.failure_rate), "--seed", str(self.seed)]
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                argv,
                cwd=ROOT,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        procs.register(self)

        def healthy() -> bool:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise RuntimeError(f"payment provider exited: {procs.log_tail(self.log_path)}")
            with contextlib.suppress(OSError):
                return bool(self.get("/health").get("ok"))
            return False

        procs.wait_until(healthy, 20, "the payment provider to answer", 0.05)

    def get(self, path: str) -> dict[str, Any]:
        with urllib.request.urlopen(self.url + path, timeout=5) as response:
            return dict(json.loads(response.read()))

    def stop(self) -> None:
        if self._proc is not None:
            procs.terminate_tree(self._proc, signal.SIGTERM, 5)
            self._proc = None
        procs.unregister(self)

    def emergency_kill(self) -> None:
        procs.kill_tree_now(self._proc)


def sqlite_write_lock_free(path: Path, wait: float = 0.3) -> bool:
    """True if a writer can take SQLite's write lock within ``wait`` seconds."""
    connection = sqlite3.connect(path, timeout=wait, isolation_level=None)
    try:
        connection.execute("BEGIN IMMEDIATE")
        connection.execute("ROLLBACK")
        return True
    except sqlite3.OperationalError:
        return False
    finally:
        connection.close()


_KILLED_CHILD = re.compile(
    r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d+): ERROR/MainProcess\] Process .* exited with "
    r"'signal 9 \(SIGKILL\)'",
    re.MULTILINE,
)


def killed_children(log_text: str) -> list[float]:
    """Epoch times at which a worker's log says one of its pool processes died of SIGKILL."""
    times = []
    for stamp, millis in _KILLED_CHILD.findall(log_text):
        moment = datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S").timestamp()
        times.append(moment + int(millis) / 1000)
    return times


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A worker's Prometheus metrics: {(sample name, labels): value}; empty if unreachable."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=3) as response:
            text = response.read().decode()
    except OSError:
        return {}
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


# -- progress ------------------------------------------------------------------------------------


class Progress:
    """A one-line progress bar on a terminal; four plain lines in a log file."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.tty = sys.stdout.isatty()
        self._quarter = 0
        self._line = ""

    def update(self, done: int, elapsed: float) -> None:
        width = 40
        filled = int(width * min(done, self.total) / max(1, self.total))
        bar = "#" * filled + "-" * (width - filled)
        self._line = f"  [{bar}] {done}/{self.total} tasks done  {elapsed:5.1f}s"
        if self.tty:
            print("\r" + self._line, end="", flush=True)
        elif done * 4 >= (self._quarter + 1) * self.total:
            self._quarter = done * 4 // max(1, self.total)
            print(self._line, flush=True)

    def say(self, text: str) -> None:
        if self.tty:
            print("\r" + " " * len(self._line) + "\r" + text, flush=True)
            print(self._line, end="", flush=True)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.tty and self._line:
            print(flush=True)
        elif self._quarter < 4 and self._line:
            print(self._line, flush=True)  # the last state, short of 100%


# -- one leg: a cluster of workers running the scenario ------------------------------------------


@dataclass
class Fault:
    at: float  # seconds since the leg started
    kind: str  # SIGKILL, SIGSTOP, SIGCONT
    worker: str
    pid: int
    #: Work the fault interrupted: idempotency keys (guarded) or orders in flight (plain).
    interrupted: list[str] = field(default_factory=list)


@dataclass
class LegReport:
    label: str
    orders: int
    messages: int
    tasks: int
    seconds: float
    workers: str
    faults: list[Fault]
    charged: dict[str, int]  # once / twice_or_more / never, from the payments table
    ledger: dict[str, int]  # the same from the provider's ledger
    money_charged_twice_cents: int
    charged_not_recorded: int
    reserved: dict[str, int]
    units_reserved: int
    units_ordered: int
    invoiced: dict[str, int]  # orders without a poison pill
    poison: dict[str, Any]
    provider: dict[str, int]  # unavailable (503s), replayed, refused_stale
    not_done: list[str]
    executions: int
    #: Bodies that wrote a row again for a task that already had one (a second charge...).
    repeat_executions: int
    guard: dict[str, Any] | None = None
    plain: dict[str, Any] | None = None
    timeline: dict[str, Any] = field(default_factory=dict)


def _tally(counts: Counter[int], order_ids: list[int]) -> dict[str, int]:
    return {
        "once": sum(1 for o in order_ids if counts[o] == 1),
        "twice_or_more": sum(1 for o in order_ids if counts[o] > 1),
        "never": sum(1 for o in order_ids if counts[o] == 0),
    }


class Leg:
    """What both legs share: servers, workers, the checkout, faults and the domain audit."""

    label = ""
    slug = ""
    app_module = ""

    def __init__(
        self,
        options: DemoOptions,
        scenario: Scenario,
        redis_server: RedisServer,
        postgres: PostgresServer | None,
        broker_db: int,
    ) -> None:
        self.options = options
        self.scenario = scenario
        self.redis = redis_server
        self.postgres = postgres
        self.broker_url = redis_server.url_for(broker_db)
        self.broker_db = broker_db
        self.out = options.output
        self.sqlite_path: Path | None = None
        if postgres is not None:
            self.db_url = postgres.create_database(f"shop_{self.slug}_{uuid.uuid4().hex[:6]}")
        else:
            self.sqlite_path = self.out / f"{self.slug}.sqlite3"
            self.db_url = f"sqlite:///{self.sqlite_path}"
        self.provider = ProviderProcess(
            options.failure_rate, options.seed, self.out / "logs" / f"{self.slug}-provider.log"
        )
        self.workers: list[WorkerProcess] = []
        self.killed: WorkerProcess | None = None
        self.faults: list[Fault] = []
        self.started_at = 0.0
        self.ended_at = 0.0
        self._reader: Engine | None = None
        self.app: ModuleType | None = None

    # -- setup ---------------------------------------------------------------------------------

    def worker_env(self, index: int) -> dict[str, str]:
        raise NotImplementedError

    def import_app(self) -> ModuleType:
        raise NotImplementedError

    def start(self) -> None:
        self.provider.start()
        self.app = self.import_app()
        engine = self.writer_engine()
        try:
            domain.metadata.create_all(engine)
            with engine.begin() as connection:
                connection.execute(
                    insert(domain.stock),
                    [{"sku": sku, "on_hand": 100_000, "reserved": 0} for sku in domain.SKUS],
                )
                connection.execute(
                    insert(domain.orders),
                    [
                        {**asdict(order), "created_at": time.time()}
                        for order in self.scenario.orders.values()
                    ],
                )
        finally:
            engine.dispose()
        self.workers = [
            WorkerProcess(
                self.app_module,
                env=self.worker_env(index),
                cwd=ROOT,
                concurrency=self.options.concurrency,
                hostname=f"{self.slug}-{index}@demo",
            )
            for index in range(1, self.options.workers + 1)
        ]
        for worker in self.workers:
            worker.start(wait_ready=False)
        for worker in self.workers:
            worker.wait_ready(timeout=90)

    def writer_engine(self) -> Engine:
        if self.sqlite_path is not None:
            return domain.sqlite_engine(self.db_url)
        return create_engine(self.db_url)

    @property
    def reader(self) -> Engine:
        """Reads for progress and the audit (on SQLite: without taking the write lock)."""
        if self._reader is None:
            self._reader = create_engine(self.db_url)
        return self._reader

    def live_workers(self) -> list[WorkerProcess]:
        return [w for w in self.workers if w is not self.killed and w.is_alive()]

    # -- the run -----------------------------------------------------------------------------

    def send(self, send: Send) -> None:
        raise NotImplementedError

    def done_count(self) -> int:
        raise NotImplementedError

    def activity(self) -> object:
        """A snapshot that keeps changing while the cluster still does something."""
        raise NotImplementedError

    def settled(self, done: int, quiet_for: float) -> bool:
        raise NotImplementedError

    def busiest(self, exclude: list[WorkerProcess]) -> tuple[WorkerProcess, list[str]]:
        raise NotImplementedError

    def interrupted_by(self, worker: WorkerProcess) -> list[str]:
        raise NotImplementedError

    def before_kill(self, worker: WorkerProcess) -> None:
        """Last look at a worker about to die (its metrics die with it)."""

    def parked_messages(self) -> list[dict[str, Any]]:
        """Headers of messages delivered but never acknowledged (Redis's ``unacked`` hash).

        Called once every live worker has stopped (a warm shutdown hands its unacknowledged
        messages back to the queue), so what is left belongs to the SIGKILLed worker: Redis
        gives them to another consumer only after the visibility timeout.
        """
        with self.redis.client(self.broker_db) as client:
            entries = client.hvals("unacked")
        found = []
        for entry in entries:
            with contextlib.suppress(ValueError, KeyError, TypeError, IndexError):
                found.append(dict(json.loads(entry)[0]["headers"]))
        return found

    def report(self) -> LegReport:
        raise NotImplementedError

    def order_task(self, send: Send) -> tuple[Any, tuple[Any, ...]]:
        assert self.app is not None
        order = self.scenario.orders[send.order_id]
        if send.task == "charge":
            return self.app.charge_payment, (order.id, order.amount_cents)
        if send.task == "reserve":
            return self.app.reserve_stock, (order.id, order.sku, order.quantity)
        return self.app.send_invoice, (order.id, order.customer_email, order.vat_number)

    def run(self) -> None:
        """Send the scenario's messages on time, inject its faults, wait until it settles."""
        scenario = self.scenario
        progress = Progress(3 * len(scenario.orders))
        pending = list(reversed(scenario.sends))
        faults = [(scenario.kill_at, "kill"), (scenario.freeze_at, "freeze")]
        faults.append((scenario.thaw_at, "thaw"))
        frozen: WorkerProcess | None = None
        deadline = scenario.thaw_at + scenario.send_window + 60
        self.started_at = time.time()
        last_poll = 0.0
        last_activity: object = None
        quiet_since = self.started_at
        try:
            while True:
                now = time.time()
                elapsed = now - self.started_at
                while pending and pending[-1].at <= elapsed:
                    self.send(pending.pop())
                if faults and faults[0][0] <= elapsed:
                    _, kind = faults.pop(0)
                    if kind == "kill":
                        self.kill(progress)
                    elif kind == "freeze":
                        frozen = self.freeze(progress)
                    elif frozen is not None:
                        frozen.thaw()
                        self.note(progress, "SIGCONT", frozen, [])
                        frozen = None
                if now - last_poll >= 0.25:
                    last_poll = now
                    done = self.done_count()
                    progress.update(done, elapsed)
                    activity = self.activity()
                    if activity != last_activity:
                        last_activity, quiet_since = activity, now
                    if not pending and not faults and self.settled(done, now - quiet_since):
                        break
                    if elapsed > deadline:
                        progress.say(f"  stopped waiting after {elapsed:.0f}s")
                        break
                time.sleep(0.005)
        finally:
            if frozen is not None:
                frozen.thaw()
            self.ended_at = time.time()
            progress.close()

    def note(self, progress: Progress, kind: str, worker: WorkerProcess, what: list[str]) -> None:
        at = time.time() - self.started_at
        self.faults.append(Fault(at, kind, worker.hostname, worker.pid, what))
        shown = ", ".join(what[:4]) + (f" and {len(what) - 4} more" if len(what) > 4 else "")
        detail = {
            "SIGKILL": f"killed with its pool; interrupted {shown or 'nothing'}",
            "SIGSTOP": f"frozen with its pool; interrupted {shown or 'nothing'}",
            "SIGCONT": "resumed",
        }[kind]
        progress.say(f"  {at:5.1f}s  {kind} {worker.hostname} (pid {worker.pid}): {detail}")

    def kill(self, progress: Progress) -> None:
        victim, _ = self.busiest(exclude=[])
        self.before_kill(victim)
        victim.kill()
        self.killed = victim
        self.note(progress, "SIGKILL", victim, self.interrupted_by(victim))

    def freeze(self, progress: Progress) -> WorkerProcess | None:
        live = self.live_workers()
        if not live:
            return None
        target, _ = self.busiest(exclude=[self.killed] if self.killed else [])
        for _ in range(40):
            target.freeze()
            # SQLite has one write lock for the whole file: a process frozen while holding it
            # would stall every worker, which is SQLite's limit, not what this fault is about.
            # Freeze again a moment later in that case.
            if self.sqlite_path is None or sqlite_write_lock_free(self.sqlite_path):
                break
            target.thaw()
            time.sleep(random.uniform(0.02, 0.1))
        self.note(progress, "SIGSTOP", target, self.interrupted_by(target))
        return target

    def stop_workers(self) -> None:
        logs = self.out / "logs"
        for worker in self.workers:
            with contextlib.suppress(Exception):
                worker.thaw()
            worker.request_warm_shutdown()
        for worker in self.workers:
            worker.stop(timeout=20)
            shutil.copyfile(worker.log_path, logs / f"{worker.hostname.split('@')[0]}.log")

    def close(self) -> None:
        for worker in self.workers:
            worker.stop(timeout=5)
        self.provider.stop()
        if self._reader is not None:
            self._reader.dispose()

    # -- the audit -----------------------------------------------------------------------------

    def _counts(self, table: Any) -> Counter[int]:
        with self.reader.connect() as connection:
            rows = connection.execute(
                select(table.c.order_id, func.count()).group_by(table.c.order_id)
            ).all()
        return Counter({int(order_id): int(count) for order_id, count in rows})

    def _rows(self, table: Any, *columns: str) -> list[Any]:
        with self.reader.connect() as connection:
            return list(connection.execute(select(*(table.c[name] for name in columns))).all())

    def domain_report(self, extra_timeline: dict[str, Any]) -> LegReport:
        scenario = self.scenario
        all_ids = sorted(scenario.orders)
        clean_ids = [o for o in all_ids if o not in scenario.poison_ids]
        paid = self._counts(domain.payments)
        reserved = self._counts(domain.reservations)
        invoiced = self._counts(domain.invoices)
        ledger_data = self.provider.get("/ledger")
        ledger = Counter(int(charge["order_id"]) for charge in ledger_data["charges"])
        amounts = {o.id: o.amount_cents for o in scenario.orders.values()}
        events = Counter(event[1] for event in ledger_data["events"])
        with self.reader.connect() as connection:
            units = connection.execute(select(func.sum(domain.stock.c.reserved))).scalar_one()
        not_done = [
            f"{task}:{order_id}"
            for order_id in all_ids
            for task, counts in (("charge", paid), ("reserve", reserved), ("invoice", invoiced))
            if counts[order_id] == 0 and not (task == "invoice" and order_id in scenario.poison_ids)
        ]
        t0 = self.started_at
        timeline = {
            "unavailable": [e[0] - t0 for e in ledger_data["events"] if e[1] == "unavailable"],
            "refused_stale": [e[0] - t0 for e in ledger_data["events"] if e[1] == "refused_stale"],
            "faults": [asdict(fault) for fault in self.faults],
            "seconds": self.ended_at - t0,
            **extra_timeline,
        }
        return LegReport(
            label=self.label,
            orders=len(all_ids),
            messages=len(scenario.sends),
            tasks=3 * len(all_ids),
            seconds=self.ended_at - self.started_at,
            workers=f"{self.options.workers} workers x {self.options.concurrency} processes",
            faults=self.faults,
            charged=_tally(paid, all_ids),
            ledger=_tally(ledger, all_ids),
            money_charged_twice_cents=sum(
                (count - 1) * amounts[o] for o, count in ledger.items() if count > 1
            ),
            charged_not_recorded=sum(1 for o in all_ids if ledger[o] > paid[o]),
            reserved=_tally(reserved, all_ids),
            units_reserved=int(units or 0),
            units_ordered=sum(o.quantity for o in scenario.orders.values()),
            invoiced=_tally(invoiced, clean_ids),
            poison={
                "orders": list(scenario.poison_ids),
                "invoiced": sum(invoiced[o] for o in scenario.poison_ids),
                "processes_killed": sum(
                    len(killed_children(worker.log_text())) for worker in self.workers
                ),
            },
            provider={
                "unavailable": events["unavailable"],
                "replayed": events["replayed"],
                "refused_stale": events["refused_stale"],
                "charges": len(ledger_data["charges"]),
            },
            not_done=not_done,
            executions=sum(paid.values()) + sum(reserved.values()) + sum(invoiced.values()),
            repeat_executions=sum(paid.values())
            + sum(reserved.values())
            + sum(invoiced.values())
            - len(paid)
            - len(reserved)
            - len(invoiced),
            timeline=timeline,
        )

    def executions_timeline(self) -> dict[str, Any]:
        """Every body execution that wrote its row, per task, relative to the leg's start."""
        t0 = self.started_at
        runs: dict[str, list[float]] = {}
        repeats: list[float] = []
        for task, table in (
            ("charge", domain.payments),
            ("reserve", domain.reservations),
            ("invoice", domain.invoices),
        ):
            seen: set[int] = set()
            runs[task] = []
            for order_id, created_at in sorted(
                self._rows(table, "order_id", "created_at"), key=lambda row: row[1]
            ):
                (repeats if order_id in seen else runs[task]).append(created_at - t0)
                seen.add(order_id)
        crashes = [t - t0 for w in self.workers for t in killed_children(w.log_text())]
        return {"completions": runs, "repeats": repeats, "poison_crashes": crashes}


class GuardedLeg(Leg):
    label = "GuardedTask"
    slug = "guarded"
    app_module = "example_project.shop"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.metrics_ports: dict[str, int] = {}
        self.metrics: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
        self.runtime: Any = None

    def worker_env(self, index: int) -> dict[str, str]:
        port = free_port()
        self.metrics_ports[f"{self.slug}-{index}@demo"] = port
        return {**self.app_env(), "SHOP_METRICS_PORT": str(port)}

    def app_env(self) -> dict[str, str]:
        options = self.options
        return {
            "SHOP_BROKER_URL": self.broker_url,
            "SHOP_STORE_URL": self.db_url,
            "SHOP_PAYMENT_PROVIDER_URL": self.provider.url,
            # Short times, so that the faults heal within the demo's two minutes.
            "SHOP_LEASE_TTL": str(options.lease_ttl),
            "SHOP_REAPER_INTERVAL": str(options.reaper_interval),
            "SHOP_MAX_ATTEMPTS": str(options.max_attempts),
            "SHOP_BACKOFF_BASE": "0.2",
            "SHOP_BACKOFF_MAX": "2",
        }

    def import_app(self) -> ModuleType:
        # The shop reads its settings at import: point it at this run's servers first.
        os.environ.update(self.app_env())
        os.environ.pop("SHOP_METRICS_PORT", None)
        module = importlib.import_module(self.app_module)
        import celery_guard

        self.runtime = celery_guard.get_runtime(module.app)
        self.runtime.migrate()
        return module

    def send(self, send: Send) -> None:
        task, args = self.order_task(send)
        task.apply_async(args)

    def _states(self) -> tuple[dict[str, int], int]:
        from celery_guard.store.schema import keys

        with self.reader.connect() as connection:
            states = dict(
                connection.execute(select(keys.c.state, func.count()).group_by(keys.c.state)).all()
            )
            duplicates = connection.execute(select(func.sum(keys.c.duplicates))).scalar_one()
        return states, int(duplicates or 0)

    def done_count(self) -> int:
        states, _ = self._states()
        return int(states.get("COMPLETED", 0)) + int(states.get("DEAD", 0))

    def activity(self) -> object:
        states, duplicates = self._states()
        return sorted(states.items()), duplicates

    def settled(self, done: int, quiet_for: float) -> bool:
        # Every key completed or dead-lettered, and late copies answered (prevented duplicates).
        return done >= 3 * len(self.scenario.orders) and quiet_for >= 2.0

    def _running(self) -> list[tuple[str, str]]:
        from celery_guard.store.schema import keys

        with self.reader.connect() as connection:
            rows = connection.execute(
                select(keys.c.key, keys.c.owner).where(keys.c.state == "RUNNING")
            ).all()
        return [(key, owner or "") for key, owner in rows]

    def busiest(self, exclude: list[WorkerProcess]) -> tuple[WorkerProcess, list[str]]:
        candidates = [w for w in self.live_workers() if w not in exclude]
        best: tuple[WorkerProcess, list[str]] = (candidates[0], [])
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            running = self._running()
            for worker in candidates:
                keys = [k for k, owner in running if owner.startswith(worker.hostname + "/")]
                if len(keys) > len(best[1]):
                    best = (worker, keys)
            if best[1]:
                break
            time.sleep(0.02)
        return best

    def interrupted_by(self, worker: WorkerProcess) -> list[str]:
        return sorted(k for k, owner in self._running() if owner.startswith(worker.hostname + "/"))

    def before_kill(self, worker: WorkerProcess) -> None:
        self.metrics[worker.hostname] = scrape(self.metrics_ports[worker.hostname])

    def stop_workers(self) -> None:
        for worker in self.live_workers():
            self.metrics[worker.hostname] = scrape(self.metrics_ports[worker.hostname])
        super().stop_workers()

    def metric(self, name: str, **labels: str) -> float:
        """A metric summed over every worker (the killed one: its last values before the kill)."""
        total = 0.0
        for samples in self.metrics.values():
            for (sample, sample_labels), value in samples.items():
                found = dict(sample_labels)
                if sample == name and all(found.get(k) == v for k, v in labels.items()):
                    total += value
        return total

    def report(self) -> LegReport:
        from celery_guard.store.schema import dead_letters, keys

        t0 = self.started_at
        with self.reader.connect() as connection:
            key_rows = connection.execute(
                select(
                    keys.c.key,
                    keys.c.task_name,
                    keys.c.state,
                    keys.c.attempts,
                    keys.c.fencing_token,
                    keys.c.claim_reason,
                    keys.c.owner,
                    keys.c.completed_at,
                    keys.c.duplicates,
                )
            ).all()
            letters = connection.execute(
                select(
                    dead_letters.c.key,
                    dead_letters.c.error_class,
                    dead_letters.c.reason,
                    dead_letters.c.attempts,
                    dead_letters.c.created_at,
                )
            ).all()
        by_key = {row.key: row for row in key_rows}
        poison_keys = {f"invoice:{o}" for o in self.scenario.poison_ids}
        recoveries = []
        for fault in self.faults:
            if fault.kind not in ("SIGKILL", "SIGSTOP"):
                continue
            fault_time = t0 + fault.at
            for key in fault.interrupted:
                row = by_key.get(key)
                if row is None or key in poison_keys:
                    continue
                recoveries.append(
                    {
                        "key": key,
                        "fault": fault.kind,
                        "state": row.state,
                        "claim_reason": row.claim_reason,
                        "fencing_token": row.fencing_token,
                        "worker": fault.worker.split("@")[0],
                        "attempts": row.attempts,
                        "completed_by": (row.owner or "").split("/")[0],
                        "seconds": (row.completed_at - fault_time) if row.completed_at else None,
                        "completed_at": (row.completed_at - t0) if row.completed_at else None,
                    }
                )
        takeovers = [
            row for row in key_rows if row.claim_reason == "TAKEOVER" and row.state == "COMPLETED"
        ]
        completions: dict[str, list[float]] = defaultdict(list)
        for row in key_rows:
            if row.state == "COMPLETED" and row.completed_at is not None:
                completions[row.key.split(":")[0]].append(row.completed_at - t0)
        crashes = [t - t0 for w in self.workers for t in killed_children(w.log_text())]
        report = self.domain_report(
            {
                "completions": dict(completions),
                "repeats": [],
                "recovered": [r["completed_at"] for r in recoveries if r["completed_at"]],
                "dead_letters": [letter.created_at - t0 for letter in letters],
                "poison_crashes": crashes,
            }
        )
        parked = [
            {
                "key": headers.get("guard_idempotency_key"),
                "state": getattr(by_key.get(headers.get("guard_idempotency_key")), "state", None),
            }
            for headers in self.parked_messages()
        ]
        report.guard = {
            "parked": parked,
            "duplicates_prevented": sum(row.duplicates for row in key_rows),
            "keys": dict(Counter(row.state for row in key_rows)),
            "takeovers": len(takeovers),
            "recoveries": recoveries,
            "dead_letters": [
                {
                    "key": letter.key,
                    "class": letter.error_class,
                    "attempts": letter.attempts,
                    "reason": letter.reason,
                }
                for letter in letters
            ],
            "poison_dead_lettered": sorted(
                k for k in poison_keys if by_key.get(k) is not None and by_key[k].state == "DEAD"
            ),
            "other_dead_letters": sorted({letter.key for letter in letters} - poison_keys),
            "metrics": {
                "retries": self.metric("celery_guard_retries_total"),
                "in_flight_deferred": self.metric(
                    "celery_guard_tasks_total", outcome="in_flight_deferred"
                ),
                "duplicate_prevented": self.metric(
                    "celery_guard_tasks_total", outcome="duplicate_prevented"
                ),
                "fenced": self.metric("celery_guard_tasks_total", outcome="fenced"),
                "takeover_claims": self.metric(
                    "celery_guard_lease_acquisitions_total", reason="takeover"
                ),
                "orphans_recovered": self.metric("celery_guard_orphans_recovered_total"),
                "orphan_recovery_seconds_sum": self.metric(
                    "celery_guard_orphan_recovery_seconds_sum"
                ),
                "orphan_recovery_seconds_count": self.metric(
                    "celery_guard_orphan_recovery_seconds_count"
                ),
            },
        }
        return report


class PlainLeg(Leg):
    label = "plain Celery"
    slug = "plain"
    app_module = "example_project.plain_shop"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: Every message's task id, to find the ones that never ran.
        self.sent_task_ids: dict[str, Send] = {}

    def app_env(self) -> dict[str, str]:
        return {
            "PLAIN_SHOP_BROKER_URL": self.broker_url,
            "PLAIN_SHOP_DB_URL": self.db_url,
            "PLAIN_SHOP_PROVIDER_URL": self.provider.url,
        }

    def worker_env(self, index: int) -> dict[str, str]:
        return self.app_env()

    def import_app(self) -> ModuleType:
        os.environ.update(self.app_env())
        return importlib.import_module(self.app_module)

    def send(self, send: Send) -> None:
        task, args = self.order_task(send)
        task_id = uuid.uuid4().hex
        self.sent_task_ids[task_id] = send
        task.apply_async(args, task_id=task_id)

    def done_count(self) -> int:
        return sum(
            len(self._counts(table))
            for table in (domain.payments, domain.reservations, domain.invoices)
        )

    def activity(self) -> object:
        with self.reader.connect() as connection:
            return sum(
                int(connection.execute(select(func.count()).select_from(table)).scalar_one())
                for table in (domain.payments, domain.reservations, domain.invoices)
            )

    def settled(self, done: int, quiet_for: float) -> bool:
        # Nothing marks a plain task "done for good": wait until no body has written for a while.
        return quiet_for >= 3.0

    def busiest(self, exclude: list[WorkerProcess]) -> tuple[WorkerProcess, list[str]]:
        candidates = [w for w in self.live_workers() if w not in exclude]
        best: tuple[WorkerProcess, list[str]] = (candidates[0], [])
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            found = self.interrupted_by_all(candidates)
            for worker, orders in found.items():
                if len(orders) > len(best[1]):
                    best = (worker, orders)
            if best[1]:
                break
            time.sleep(0.02)
        return best

    def interrupted_by_all(self, workers: list[WorkerProcess]) -> dict[WorkerProcess, list[str]]:
        in_flight = self.provider.get("/inflight")["requests"]
        return {
            worker: sorted(f"charge:{o}" for client, o in in_flight if client == worker.hostname)
            for worker in workers
        }

    def interrupted_by(self, worker: WorkerProcess) -> list[str]:
        return self.interrupted_by_all([worker])[worker]

    def report(self) -> LegReport:
        report = self.domain_report(self.executions_timeline())
        ran: set[str] = set()
        for table in (domain.payments, domain.reservations, domain.invoices):
            ran.update(str(task_id) for (task_id,) in self._rows(table, "task_id"))
        poison = set(self.scenario.poison_ids)
        never_ran = [
            task_id
            for task_id, send in self.sent_task_ids.items()
            if task_id not in ran and not (send.task == "invoice" and send.order_id in poison)
        ]
        parked = {headers["id"] for headers in self.parked_messages()}
        report.plain = {
            "messages_never_finished": len(never_ran),
            "parked_in_unacked": len(set(never_ran) & parked),
        }
        return report
