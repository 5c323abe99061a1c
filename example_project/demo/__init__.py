"""``make demo``: the example shop under chaos, guarded by celery_guard, then on plain Celery.

What it does, start to end (about two minutes, every process started here stopped by PID):

1. Starts a private Redis on a free loopback port, the pretend payment provider
   (``payment_provider.py``, 15% of its answers HTTP 503), and uses an embedded SQLite store
   (``--postgres``: a private PostgreSQL instead).
2. **GuardedTask leg**: four ``celery worker`` processes (prefork) run ``example_project.shop``.
   The checkout places a few hundred orders at a steady rate and enqueues, per order,
   ``charge_payment``, ``reserve_stock`` and ``send_invoice``, each two or three times. Meanwhile:
   one worker is SIGKILLed mid-run, another is frozen (SIGSTOP) past its lease and resumed
   (SIGCONT), a few orders carry a VAT number that crashes the invoice renderer's process every
   time (poison pills), and the provider fails transiently.
3. **Plain Celery leg**: the same scenario (same orders, same timing, same faults) on
   ``example_project.plain_shop``: the same task bodies without GuardedTask.
4. Prints an audit from the shop's tables, the provider's ledger, the store and the workers'
   metrics, and writes a timeline picture (``demo-output/timeline.png``).

Options: ``--orders N``, ``--seed S``, ``--postgres``, ``--no-plain``, ``--json FILE`` (the audit as
JSON), ``--output DIR``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import signal
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from types import FrameType
from typing import Any

from example_project.demo.audit import print_audit
from example_project.demo.cluster import GuardedLeg, Leg, LegReport, PlainLeg
from example_project.demo.scenario import DemoOptions, make_scenario
from tests.rig.servers import PostgresServer, RedisServer

__all__ = ["DemoOptions", "main", "run_demo"]

# -- the whole run -------------------------------------------------------------------------------


@contextlib.contextmanager
def _interruptible() -> Iterator[None]:
    """Ctrl-C and SIGTERM (e.g. a CI timeout) unwind the run, so every process gets stopped.

    SIGINT is set explicitly: a shell starting the demo in the background ignores it otherwise.
    """

    def raise_interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, raise_interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_demo(options: DemoOptions) -> dict[str, Any]:
    """Run both legs; return the audit as a dict (also written to ``options.json_path``)."""
    started = time.monotonic()
    out = options.output
    for stale in ("guarded.sqlite3", "plain.sqlite3", "timeline.png", "audit.json"):
        for path in out.glob(stale + "*"):
            path.unlink()
    shutil.rmtree(out / "logs", ignore_errors=True)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    scenario = make_scenario(options)
    pids: list[int] = []
    servers: list[Any] = []
    legs: list[Leg] = []
    reports: dict[str, LegReport] = {}
    try:
        redis_server = RedisServer()
        redis_server.start()
        servers.append(redis_server)
        pids.append(redis_server.pid)
        postgres = None
        if options.postgres:
            postgres = PostgresServer()
            postgres.start()
            servers.append(postgres)
            pids.append(postgres.pid)
        store = f"PostgreSQL (private, pid {postgres.pid})" if postgres else "SQLite (embedded)"
        print(
            f"celery_guard demo: {options.orders} orders; each order's three tasks "
            "(charge_payment, reserve_stock, send_invoice) published 2-3 times"
        )
        print(
            f"  redis pid {redis_server.pid} on 127.0.0.1:{redis_server.port}; store {store}; "
            f"payment provider answers {options.failure_rate:.0%} of charges with HTTP 503"
        )
        print(
            f"  faults: SIGKILL a worker at {scenario.kill_at:.0f}s, SIGSTOP another at "
            f"{scenario.freeze_at:.0f}s for {scenario.thaw_at - scenario.freeze_at:.0f}s (lease "
            f"TTL {options.lease_ttl:g}s, reaper every {options.reaper_interval:g}s), "
            f"{len(scenario.poison_ids)} poison pills (guard_max_attempts {options.max_attempts})"
        )
        leg_classes: list[tuple[type[Leg], int]] = [(GuardedLeg, 0)]
        if options.plain:
            leg_classes.append((PlainLeg, 1))
        for number, (leg_class, db) in enumerate(leg_classes, start=1):
            leg = leg_class(options, scenario, redis_server, postgres, db)
            legs.append(leg)
            print()
            title = {
                "guarded": "GuardedTask (example_project/shop.py)",
                "plain": "plain Celery, the same scenario (example_project/plain_shop.py)",
            }[leg.slug]
            print(f"[{number}/{len(leg_classes)}] {title}")
            leg.start()
            pids.append(leg.provider.pid)
            for worker in leg.workers:
                pids.append(worker.pid)
                pids.extend(worker.child_pids())
            print(
                f"  {len(leg.workers)} workers ({', '.join(str(w.pid) for w in leg.workers)}) "
                f"x {options.concurrency} processes; provider pid {leg.provider.pid}"
            )
            leg.run()
            for worker in leg.live_workers():
                pids.extend(worker.child_pids())
            leg.stop_workers()
            reports[leg.slug] = leg.report()
            leg.close()
    except KeyboardInterrupt:
        print("\ninterrupted: stopping every process the demo started", flush=True)
        raise
    finally:
        for leg in legs:
            with contextlib.suppress(Exception):
                leg.close()
        for server in reversed(servers):
            server.stop()
    guarded, plain = reports["guarded"], reports.get("plain")
    ok = print_audit(guarded, plain)
    png = None
    if options.png:
        png = _draw(options, guarded, plain)
    wall = time.monotonic() - started
    print(f"wall time {wall:.0f}s; logs, databases and the audit as JSON in {out}")
    summary = {
        "ok": ok,
        "wall_seconds": wall,
        "png": str(png) if png else None,
        "pids": sorted(set(pids)),
        "guarded": asdict(guarded),
        "plain": asdict(plain) if plain else None,
    }
    json_path = options.json_path or out / "audit.json"
    json_path.write_text(json.dumps(summary, indent=2, default=str))
    return summary


def _draw(options: DemoOptions, guarded: LegReport, plain: LegReport | None) -> Path | None:
    try:
        from example_project.demo.timeline import draw
    except ImportError as exc:
        print(f"no timeline picture: {exc} (pip install -e '.[demo]' installs matplotlib)")
        return None
    path = options.output / "timeline.png"
    draw(path, guarded, plain)
    print(f"timeline: {path}")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--orders", type=int, default=DemoOptions.orders)
    parser.add_argument("--seed", type=int, default=DemoOptions.seed)
    parser.add_argument("--postgres", action="store_true", help="a private PostgreSQL store")
    parser.add_argument("--no-plain", action="store_true", help="skip the plain-Celery leg")
    parser.add_argument("--no-png", action="store_true", help="skip the timeline picture")
    parser.add_argument("--poison", type=int, default=None, help="poison pills to plant")
    parser.add_argument("--output", type=Path, default=DemoOptions.output)
    parser.add_argument("--json", type=Path, default=None, help="write the audit here as JSON")
    args = parser.parse_args(argv)
    if args.orders < 1:
        parser.error("--orders must be at least 1")
    options = DemoOptions(
        orders=args.orders,
        seed=args.seed,
        postgres=args.postgres,
        plain=not args.no_plain,
        poison=args.poison,
        output=args.output.resolve(),
        json_path=args.json,
        png=not args.no_png,
    )
    with _interruptible():
        try:
            summary = run_demo(options)
        except KeyboardInterrupt:
            return 130
    return 0 if summary["ok"] else 1
