"""Soak: many guarded tasks over several workers while processes die, freeze and lose their links.

Run from the repository root (not in CI; it loads the machine for several minutes)::

    .venv/bin/python bench/soak.py --tasks 20000 --seconds 300 --output docs/benchmarks.md

Private servers come from the test rig: PostgreSQL (the store), Redis (results, and the broker
of the ``redis`` run) and RabbitMQ (the broker of the ``rabbitmq`` run); ``--brokers`` picks the
runs. Per run, ``--workers`` real prefork workers of ``tests/apps/shop.py`` each reach
PostgreSQL and the broker through fault proxies of their own (``tests/rig/faultproxy.py``).
For ``--seconds`` the script publishes ``--tasks`` tasks at a steady rate (most
``shop.record``, some ``shop.long_write`` working a second; a share sent twice), plus
``--pills`` poison pills that kill their own process, while a chaos loop picks a fault every
few seconds:

- ``kill_worker``: SIGKILL a whole worker (main process and pool); a new one takes its place;
- ``kill_child``: SIGKILL one pool process;
- ``freeze``: SIGSTOP a whole worker past the lease TTL, then SIGCONT;
- ``store_*``: the worker's PostgreSQL link blackholed, cut, slowed or flapping for a while;
- ``broker_*``: the worker's broker link blackholed or cut for a while.

Then every fault is healed and the run drains. Printed (and written to ``--output``): tasks lost
(keys never COMPLETED; must be 0; those with no key row at all never reached a worker's claim,
so the broker transport lost them), double effects (tags with more than one effect row; must be
0), dead letters (must be the planted pills only), and the recovery-time distribution: from a
fault to the moment each key its victim was running was taken over by another owner (or
completed).

The Redis run turns publish tracking on (``guard_track_publishes``, in the producer and the
workers, ``guard_unclaimed_republish_after`` = ``--unclaimed-after``), which closes the window
in which kombu's Redis transport loses a message to a whole-worker SIGKILL; it reports how many
messages the reaper re-published from tracking. ``--no-tracking`` runs it without, as before.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import os
import random
import shlex
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # so that ``tests.rig`` and ``bench`` import when run as a script
    sys.path.insert(0, str(ROOT))

from celery import Celery  # noqa: E402
from sqlalchemy import create_engine, text  # noqa: E402

import celery_guard  # noqa: E402
from bench.overhead import machine_info, write_section  # noqa: E402
from celery_guard import GuardConfig  # noqa: E402
from celery_guard.store import metadata as guard_metadata  # noqa: E402
from celery_guard.store.sql import SqlStore  # noqa: E402
from tests.apps import shop_tables  # noqa: E402
from tests.apps.shop_producer import producer_app  # noqa: E402
from tests.rig import procs  # noqa: E402
from tests.rig.faultproxy import FaultProxy  # noqa: E402
from tests.rig.servers import PostgresServer, RabbitMQServer, RedisServer  # noqa: E402
from tests.rig.workers import WorkerProcess  # noqa: E402

HEADING = "## Soak (bench/soak.py)"
APP = "tests.apps.shop"
QUEUE = "soak"
LEASE_TTL = 3.0
FAULTS = {  # name: weight
    "kill_worker": 2,
    "kill_child": 2,
    "freeze": 2,
    "store_blackhole": 1,
    "store_cut": 1,
    "store_latency": 1,
    "store_flap": 1,
    "broker_blackhole": 1,
    "broker_cut": 1,
}


def log(message: str) -> None:
    print(f"[{datetime.datetime.now():%H:%M:%S}] {message}", flush=True)


@dataclass
class Slot:
    """One worker's place: its proxies stay, the worker in it may be replaced."""

    index: int
    store_proxy: FaultProxy
    broker_proxy: FaultProxy
    env: dict[str, str]
    concurrency: int
    worker: WorkerProcess | None = None
    frozen: bool = False
    retired: list[WorkerProcess] = field(default_factory=list)

    def start(self) -> None:
        self.worker = WorkerProcess(
            APP,
            env=self.env,
            cwd=ROOT,
            concurrency=self.concurrency,
            queues=QUEUE,
            hostname=f"soak{self.index}-{uuid.uuid4().hex[:6]}@%h",
        )
        self.worker.start(wait_ready=True, timeout=120)

    def pids(self) -> set[int]:
        if self.worker is None or not self.worker.is_alive():
            return set()
        return {self.worker.pid, *self.worker.child_pids()}


class Soak:
    def __init__(
        self,
        args: argparse.Namespace,
        postgres: PostgresServer,
        redis: RedisServer,
        broker: str,
        broker_port: int,
    ):
        self.args = args
        self.rng = random.Random(args.seed)
        self.postgres = postgres
        self.redis = redis
        self.broker = broker
        self.broker_port = broker_port
        self.store_url = postgres.create_database(f"soak_{uuid.uuid4().hex[:8]}")
        engine = create_engine(self.store_url)
        guard_metadata.create_all(engine)
        shop_tables.metadata.create_all(engine)
        engine.dispose()
        self.store = SqlStore(GuardConfig(store_url=self.store_url))
        #: Publish tracking on the Redis run: its producer records every publish too.
        self.tracking = broker == "redis" and not args.no_tracking
        if self.tracking:
            self.client = producer_app(
                self.broker_url(broker_port),
                self.store_url,
                result_backend=redis.url_for(1),
                guard_track_publishes=True,
                guard_unclaimed_republish_after=args.unclaimed_after,
            )
        else:
            self.client = Celery(
                "soak-client", broker=self.broker_url(broker_port), backend=redis.url_for(1)
            )
        self.slots: list[Slot] = []
        self.faults: collections.Counter[str] = collections.Counter()
        self.recovery: dict[str, list[float]] = collections.defaultdict(list)
        self.unrecovered: collections.Counter[str] = collections.Counter()
        self.watchers: list[threading.Thread] = []
        self.timers: list[threading.Timer] = []
        self.lock = threading.Lock()
        self.sent_tags: list[str] = []
        self.published_at: dict[str, float] = {}
        self.fault_log: list[tuple[float, str]] = []
        self.pill_keys: list[str] = []
        self.messages = 0

    # -- setup ----------------------------------------------------------------------------------

    def broker_url(self, port: int) -> str:
        if self.broker == "rabbitmq":
            return f"amqp://guest:guest@127.0.0.1:{port}//"
        return f"redis://127.0.0.1:{port}/0"

    def start_workers(self) -> None:
        for index in range(self.args.workers):
            store_proxy = FaultProxy(self.postgres.port).start()
            broker_proxy = FaultProxy(self.broker_port).start()
            env = {
                "CG_STORE_URL": self.store_url.replace(
                    f"127.0.0.1:{self.postgres.port}/", f"127.0.0.1:{store_proxy.port}/"
                ),
                "CG_BROKER_URL": self.broker_url(broker_proxy.port),
                "CG_RESULT_URL": self.redis.url_for(1),
                "CG_LEASE_TTL": str(LEASE_TTL),
                "CG_REAPER_INTERVAL": "1",
                "CG_STORE_TIMEOUT": "1.5",
                "CG_MAX_ATTEMPTS": str(self.args.max_attempts),
                # A whole worker SIGKILLed with a message fetched but not yet claimed: only the
                # broker knows it; kombu hands it out again after this (the default is an hour).
                "CG_VISIBILITY_TIMEOUT": str(self.args.visibility_timeout),
                "CG_TRACK_PUBLISHES": "1" if self.tracking else "0",
                "CG_UNCLAIMED_REPUBLISH_AFTER": str(self.args.unclaimed_after),
            }
            self.slots.append(
                Slot(index, store_proxy, broker_proxy, env, concurrency=self.args.concurrency)
            )
        threads = [threading.Thread(target=slot.start) for slot in self.slots]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if not all(slot.worker and slot.worker.is_alive() for slot in self.slots):
            raise RuntimeError("a worker did not start")

    # -- load -----------------------------------------------------------------------------------

    def publish(self, stop: threading.Event) -> None:
        """``--tasks`` tasks spread evenly over ``--seconds``; the pills among the first half."""
        args = self.args
        started = time.monotonic()
        pill_at = sorted(self.rng.sample(range(args.tasks // 2), args.pills))
        prefix = uuid.uuid4().hex[:8]
        with self.client.producer_or_acquire() as producer:
            for n in range(args.tasks):
                if stop.is_set():
                    break
                due = started + args.seconds * n / args.tasks
                delay = due - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                tag = f"{prefix}-{n}"
                long_one = self.rng.random() < args.long_share
                name, task_args = (
                    ("shop.long_write", (tag, 1.0)) if long_one else ("shop.record", (tag,))
                )
                copies = 2 if self.rng.random() < args.duplicate_share else 1
                for _ in range(copies):
                    self.client.send_task(name, args=task_args, queue=QUEUE, producer=producer)
                    self.messages += 1
                self.sent_tags.append(tag)
                self.published_at[tag] = time.monotonic()
                if pill_at and n == pill_at[0]:
                    pill_at.pop(0)
                    pill = f"{prefix}-pill-{n}"
                    self.client.send_task("shop.poison", args=(pill,), queue=QUEUE)
                    self.pill_keys.append(f"poison:{pill}")
                    self.messages += 1
        log(f"published {len(self.sent_tags)} tasks ({self.messages} messages)")

    # -- chaos ----------------------------------------------------------------------------------

    def chaos(self, stop: threading.Event) -> None:
        names, weights = zip(*FAULTS.items(), strict=True)
        while not stop.wait(self.rng.uniform(self.args.fault_every / 2, self.args.fault_every)):
            live = [s for s in self.slots if s.worker and s.worker.is_alive() and not s.frozen]
            if not live:
                continue
            slot = self.rng.choice(live)
            fault = self.rng.choices(names, weights)[0]
            try:
                self.inject(fault, slot)
            except Exception as exc:  # a fault that could not be injected is logged, not fatal
                log(f"fault {fault} on slot {slot.index} failed: {exc!r}")

    def inject(self, fault: str, slot: Slot) -> None:
        assert slot.worker is not None
        self.faults[fault] += 1
        self.fault_log.append((time.monotonic(), fault))
        victims = self.running_on(slot.pids())
        log(f"{fault} on slot {slot.index} ({len(victims)} keys running there)")
        if fault == "kill_worker":
            slot.worker.kill()
            self.watch(fault, victims)
            slot.retired.append(slot.worker)
            # Its replacement starts on healthy links (a fault still running ends here).
            slot.store_proxy.heal()
            slot.broker_proxy.heal()
            slot.start()
        elif fault == "kill_child":
            children = slot.worker.child_pids()
            if children:
                child = self.rng.choice(children)
                victims = self.running_on({child})
                os.kill(child, signal.SIGKILL)
                self.watch(fault, victims)
        elif fault == "freeze":
            slot.frozen = True
            slot.worker.freeze()
            self.watch(fault, victims)
            self.later(self.rng.uniform(LEASE_TTL + 1, 2 * LEASE_TTL + 2), self.thaw, slot)
        else:
            link, kind = fault.split("_", 1)
            proxy = slot.store_proxy if link == "store" else slot.broker_proxy
            if kind == "blackhole":
                proxy.blackhole()
            elif kind == "cut":
                proxy.cut()
            elif kind == "latency":
                proxy.latency(upstream=0.2, downstream=0.2)
            else:
                proxy.flap(period=2.0, down="cut")
            if link == "store" and kind in ("blackhole", "cut", "flap"):
                self.watch(fault, victims)
            self.later(self.rng.uniform(3, 8), proxy.heal)

    def thaw(self, slot: Slot) -> None:
        if slot.worker is not None:
            slot.worker.thaw()
        slot.frozen = False

    def later(self, seconds: float, action: Any, *args: Any) -> None:
        timer = threading.Timer(seconds, action, args)
        timer.daemon = True
        self.timers.append(timer)
        timer.start()

    def running_on(self, pids: set[int]) -> dict[str, int]:
        """The RUNNING keys owned by these processes: key -> fencing token."""
        if not pids:
            return {}
        with self.store.engine.connect() as connection:
            rows = connection.execute(
                text(
                    "SELECT key, owner, fencing_token FROM celery_guard_keys "
                    "WHERE state = 'RUNNING'"
                )
            ).all()
        found = {}
        for key, owner, token in rows:
            try:
                pid = int(str(owner).rsplit("/", 1)[1])
            except (IndexError, ValueError):
                continue
            if pid in pids:
                found[key] = int(token)
        return found

    def watch(self, fault: str, victims: dict[str, int]) -> None:
        """Time, for each key the fault hit, until another owner took it over or it completed."""
        if not victims:
            return
        started = time.monotonic()

        def run() -> None:
            left = dict(victims)
            deadline = started + self.args.recovery_cap
            while left and time.monotonic() < deadline:
                records = self.store.keys.get_many(list(left))
                for key, token in list(left.items()):
                    record = records.get(key)
                    if record is None:
                        continue
                    if record.fencing_token > token or record.state in ("COMPLETED", "DEAD"):
                        with self.lock:
                            self.recovery[fault].append(time.monotonic() - started)
                        del left[key]
                time.sleep(0.1)
            with self.lock:
                self.unrecovered[fault] += len(left)

        thread = threading.Thread(target=run, daemon=True)
        self.watchers.append(thread)
        thread.start()

    # -- the end --------------------------------------------------------------------------------

    def heal_all(self) -> None:
        for timer in self.timers:
            timer.cancel()
        for slot in self.slots:
            slot.store_proxy.heal()
            slot.broker_proxy.heal()
            if slot.frozen:
                self.thaw(slot)

    def states(self) -> dict[str, int]:
        with self.store.engine.connect() as connection:
            rows = connection.execute(
                text("SELECT state, count(*) FROM celery_guard_keys GROUP BY state")
            ).all()
        return {state: int(count) for state, count in rows}

    def drain(self) -> float:
        """Wait until every key is final, or nothing has changed for ``--stall`` seconds."""
        expected = len(self.sent_tags) + len(self.pill_keys)
        started = time.monotonic()
        deadline = started + self.args.drain_cap
        last_report, last_change, last_states = 0.0, started, {}
        while time.monotonic() < deadline:
            states = self.states()
            finished = states.get("COMPLETED", 0) + states.get("DEAD", 0)
            if finished >= expected and not states.get("RUNNING") and not states.get("RELEASED"):
                break
            if states != last_states:
                last_states, last_change = states, time.monotonic()
            elif time.monotonic() - last_change > self.args.stall:
                log(f"nothing changed for {self.args.stall:g} s: {states} of {expected}")
                break
            if time.monotonic() - last_report > 15:
                log(f"draining: {states} of {expected}")
                last_report = time.monotonic()
            time.sleep(1)
        return time.monotonic() - started

    def verdict(self) -> dict[str, Any]:
        with self.store.engine.connect() as connection:
            effects = dict(
                connection.execute(text("SELECT tag, count(*) FROM effects GROUP BY tag")).all()
            )
            keys = connection.execute(
                text(
                    "SELECT key, state, attempts, fencing_token, claim_reason, duplicates "
                    "FROM celery_guard_keys"
                )
            ).all()
            dead = [
                row[0]
                for row in connection.execute(
                    text("SELECT key FROM celery_guard_dead_letters")
                ).all()
            ]
        by_key = {row[0]: row for row in keys}
        task_keys = {
            tag: next((k for k in (f"record:{tag}", f"long:{tag}") if k in by_key), f"record:{tag}")
            for tag in self.sent_tags
        }
        lost = [
            tag
            for tag, key in task_keys.items()
            if key not in by_key or by_key[key][1] != "COMPLETED" or effects.get(tag, 0) == 0
        ]
        # No row at all: no worker ever claimed it, so the message was lost before reaching
        # celery_guard (in the broker transport); the others were claimed and then not finished.
        never_claimed = [tag for tag in lost if task_keys[tag] not in by_key]
        doubled = [tag for tag in self.sent_tags if effects.get(tag, 0) > 1]
        logs = [
            worker.log_text()
            for slot in self.slots
            for worker in [*slot.retired, *([slot.worker] if slot.worker else [])]
        ]
        fenced = sum(text.count("completion refused (fenced)") for text in logs)
        return {
            "tasks": len(self.sent_tags),
            "messages": self.messages,
            "lost": lost,
            "never_claimed": never_claimed,
            "doubled": doubled,
            "dead_letters": sorted(dead),
            "unexpected_dead": sorted(set(dead) - set(self.pill_keys)),
            "pills_not_dead": sorted(set(self.pill_keys) - set(dead)),
            "duplicates_prevented": sum(int(row[5]) for row in keys),
            "takeovers": sum(1 for row in keys if row[4] == "TAKEOVER"),
            "max_attempts_seen": max(
                (int(row[2]) for row in keys if row[0] not in self.pill_keys), default=0
            ),
            "fenced_commits": fenced,
            # Publish tracking: messages no worker claimed, published again by the reaper.
            "unclaimed_republished": sum(
                text.count("re-published unclaimed publish") for text in logs
            ),
            "unclaimed_abandoned": sum(text.count("gave up on unclaimed publish") for text in logs),
        }

    def stop(self) -> None:
        self.heal_all()
        for slot in self.slots:
            for worker in [*slot.retired, *([slot.worker] if slot.worker else [])]:
                worker.kill()
            slot.store_proxy.stop()
            slot.broker_proxy.stop()
        self.store.dispose()
        if self.tracking:
            celery_guard.get_runtime(self.client).store.dispose()
        self.client.close()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


BROKER_NOTES = {
    "redis": "Redis broker (kombu's Redis transport, visibility timeout {vt:g} s{tracking})",
    "rabbitmq": "RabbitMQ broker (AMQP, Debian's rabbitmq-server{tracking})",
}


def render_run(args: argparse.Namespace, soak: Soak, result: dict[str, Any], drained: float) -> str:
    ok = not result["lost"] and not result["doubled"] and not result["unexpected_dead"]
    tracking = (
        f", publish tracking on: guard_unclaimed_republish_after {args.unclaimed_after:g} s"
        if soak.tracking
        else ""
    )
    broker = BROKER_NOTES[soak.broker].format(vt=args.visibility_timeout, tracking=tracking)
    out = [
        f"### {broker}",
        "",
        f"{result['tasks']} tasks ({result['messages']} messages) published over "
        f"{args.seconds:g} s; after the chaos, everything healed and the run drained in "
        f"{drained:.0f} s.",
        "",
        *([never_claimed_note(soak, result), ""] if result["never_claimed"] else []),
        "| Outcome | Value | Must be |",
        "|---|---:|---|",
        f"| tasks lost (key never COMPLETED, or no effect) | {len(result['lost'])} | 0 |",
        f"| of which never claimed (no key row: lost before reaching celery_guard) "
        f"| {len(result['never_claimed'])} | |",
        f"| double effects (tags with 2+ effect rows) | {len(result['doubled'])} | 0 |",
        f"| dead letters | {len(result['dead_letters'])} | {args.pills} (the planted pills) |",
        f"| dead letters that are not pills | {len(result['unexpected_dead'])} | 0 |",
        f"| pills not dead-lettered | {len(result['pills_not_dead'])} | 0 |",
        f"| duplicate deliveries answered from the store | {result['duplicates_prevented']} | |",
        f"| keys completed by an owner that took them over | {result['takeovers']} | |",
        f"| late commits refused (fenced) | {result['fenced_commits']} | |",
        f"| most attempts on one key (pills aside) | {result['max_attempts_seen']} | |",
        *(
            [
                "| messages re-published from publish tracking (never claimed) "
                f"| {result['unclaimed_republished']} | |",
                "| tracked publishes given up (re-published 3 times, never claimed) "
                f"| {result['unclaimed_abandoned']} | 0 |",
            ]
            if soak.tracking
            else []
        ),
        "",
        f"Verdict: **{'PASS' if ok else 'FAIL'}**.",
        "",
        "| Fault | Injected | Keys hit | Recovery p50 s | p90 s | max s | Not recovered in "
        f"{args.recovery_cap:g} s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for fault in FAULTS:
        times = soak.recovery.get(fault, [])
        hit = len(times) + soak.unrecovered.get(fault, 0)
        cells = (
            [f"{percentile(times, q):.1f}" for q in (0.5, 0.9)] + [f"{max(times):.1f}"]
            if times
            else ["", "", ""]
        )
        out.append(
            f"| {fault} | {soak.faults.get(fault, 0)} | {hit} | {' | '.join(cells)} | "
            f"{soak.unrecovered.get(fault, 0)} |"
        )
    return "\n".join(out) + "\n"


def never_claimed_note(soak: Soak, result: dict[str, Any]) -> str:
    """Why tasks with no key row were lost: the fault nearest to each one's publication."""
    nearest = []
    for tag in result["never_claimed"]:
        at = soak.published_at[tag]
        gap, fault = min(((abs(t - at), f) for t, f in soak.fault_log), default=(0.0, "none"))
        nearest.append(f"{fault} {gap:.1f} s away")
    note = (
        "No worker ever claimed the lost tasks (no key row). The fault nearest to each one's "
        f"publication: {', '.join(nearest)}."
    )
    if soak.broker == "redis" and soak.tracking:
        note += (
            " Publish tracking was on: the reaper should have re-published them from their "
            "records; check the workers' logs for 're-published unclaimed publish'."
        )
    elif soak.broker == "redis":
        note += (
            " kombu's Redis transport takes a message off the queue with BRPOP and only then "
            "records it as unacknowledged, in the worker; a worker SIGKILLed in between (or a "
            "BRPOP reply lost with its connection) takes the message with it. celery_guard "
            "never saw it, so its reaper cannot re-publish it, and the visibility timeout "
            "cannot restore what was never recorded. RabbitMQ tracks unacknowledged messages "
            "in the broker and requeues them when the connection drops."
        )
    return note


def render(
    args: argparse.Namespace, runs: list[str], wall: float, info: dict[str, str], command: str
) -> str:
    today = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    out = [
        HEADING,
        "",
        f"Measured {today} with `{command}` (total wall time {wall:.0f} s). Not run in CI.",
        "",
        f"Per broker: {args.workers} real prefork workers of `tests/apps/shop.py` (concurrency "
        f"{args.concurrency}, lease TTL {LEASE_TTL:g} s, reaper every 1 s, store timeout 1.5 s, "
        f"`guard_max_attempts` {args.max_attempts}), each reaching PostgreSQL and its broker "
        f"through a fault proxy of its own (`tests/rig/faultproxy.py`). {args.tasks} tasks are "
        f"published evenly over {args.seconds:g} s ({args.duplicate_share:.0%} of them sent "
        f"twice, {args.long_share:.0%} working 1 s, the rest `shop.record`), with "
        f"{args.pills} poison pills among them, while a fault is injected every "
        f"{args.fault_every / 2:g}-{args.fault_every:g} s (seed {args.seed}): a whole worker "
        "SIGKILLed (and replaced), a pool process SIGKILLed, a worker SIGSTOPped for 1-2 TTLs, "
        "or one worker's PostgreSQL or broker link blackholed, cut, slowed (0.2 s each way) or "
        "flapping (2 s period) for 3-8 s. Recovery: from the fault to the moment each key its "
        "victim was running was claimed by another owner (a new fencing token) or completed, "
        "polled every 0.1 s."
        + (
            ""
            if args.no_tracking
            else " The Redis run has publish tracking on (`guard_track_publishes`, in the "
            "producer and the workers): every publish is recorded in the store first, and the "
            "reaper re-publishes any that no worker claimed "
            f"{args.unclaimed_after:g} s after it was due, once the queue has moved past it."
        ),
        "",
        *runs,
        "### Machine and versions",
        "",
        *[f"- {name}: {value}" for name, value in info.items()],
    ]
    return "\n".join(out) + "\n"


def run_one(
    args: argparse.Namespace, broker: str, postgres: PostgresServer, redis: RedisServer
) -> tuple[str, dict[str, Any]]:
    rabbit = RabbitMQServer() if broker == "rabbitmq" else None
    soak: Soak | None = None
    try:
        if rabbit is not None:
            rabbit.start()
        soak = Soak(args, postgres, redis, broker, rabbit.port if rabbit else redis.port)
        soak.start_workers()
        log(f"{broker}: {args.workers} workers up; {args.tasks} tasks over {args.seconds:g} s")
        stop = threading.Event()
        chaos = threading.Thread(target=soak.chaos, args=(stop,), daemon=True)
        chaos.start()
        try:
            soak.publish(stop)
        finally:
            stop.set()
            chaos.join(180)
        soak.heal_all()
        log(f"chaos over ({dict(soak.faults)}); everything healed; draining")
        drained_in = soak.drain()
        for watcher in soak.watchers:
            watcher.join(args.recovery_cap)
        result = soak.verdict()
        for name in ("lost", "never_claimed", "doubled", "unexpected_dead", "pills_not_dead"):
            if result[name]:
                log(f"{broker} {name}: {len(result[name])}: {result[name][:10]}")
        return render_run(args, soak, result, drained_in), result
    finally:
        if soak is not None:
            soak.stop()
        if rabbit is not None:
            rabbit.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--brokers", default="redis,rabbitmq", help="one run each (both)")
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--seconds", type=float, default=300.0, help="publishing time (300)")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--pills", type=int, default=5)
    parser.add_argument("--long-share", type=float, default=0.05)
    parser.add_argument("--duplicate-share", type=float, default=0.1)
    parser.add_argument("--fault-every", type=float, default=8.0, help="seconds, at most")
    parser.add_argument("--max-attempts", type=int, default=8)
    parser.add_argument("--visibility-timeout", type=float, default=60.0)
    parser.add_argument(
        "--unclaimed-after",
        type=float,
        default=15.0,
        help="guard_unclaimed_republish_after of the Redis run's publish tracking (15 s)",
    )
    parser.add_argument(
        "--no-tracking", action="store_true", help="the Redis run without publish tracking"
    )
    parser.add_argument("--recovery-cap", type=float, default=120.0)
    parser.add_argument("--drain-cap", type=float, default=900.0)
    parser.add_argument("--stall", type=float, default=150.0, help="drain gives up (150 s)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "benchmarks.md")
    parser.add_argument("--no-write", action="store_true", help="print, do not write --output")
    args = parser.parse_args()
    brokers = [name for name in args.brokers.split(",") if name]
    if not brokers or set(brokers) - set(BROKER_NOTES):
        parser.error(f"--brokers: a comma-separated list of {', '.join(BROKER_NOTES)}")
    command = shlex.join([os.path.relpath(sys.executable, ROOT), *sys.argv])
    started, load_at_start = time.monotonic(), os.getloadavg()
    postgres, redis = PostgresServer(), RedisServer()
    try:
        postgres.start()
        redis.start()
        runs, failed = [], False
        for broker in brokers:
            text_of_run, result = run_one(args, broker, postgres, redis)
            runs.append(text_of_run)
            failed = failed or bool(
                result["lost"] or result["doubled"] or result["unexpected_dead"]
            )
        info = machine_info(postgres, redis, load_at_start)
        section = render(args, runs, time.monotonic() - started, info, command)
        print(section)
        if not args.no_write:
            write_section(args.output, section, HEADING)
            log(f"wrote {args.output}")
        sys.exit(1 if failed else 0)
    finally:
        redis.stop()
        postgres.stop()
        procs.kill_all()


if __name__ == "__main__":
    main()
