"""The audit the demo prints: one table comparing both legs, then each leg in detail."""

from __future__ import annotations

from example_project.demo.cluster import LegReport

# -- printing the audit --------------------------------------------------------------------------


def _n(count: float, noun: str, plural: str | None = None) -> str:
    """``1 key``, ``3 keys``."""
    return f"{count:.0f} " + (noun if round(count) == 1 else plural or noun + "s")


def _money(cents: int) -> str:
    return f"${cents / 100:,.2f}"


def _once(tally: dict[str, int], total: int) -> str:
    return f"{tally['once']}/{total}"


def _parked_text(report: LegReport) -> str:
    if report.guard is not None:
        parked = report.guard.get("parked", [])
        done = sum(1 for item in parked if item["state"] in ("COMPLETED", "DEAD"))
        return f"{len(parked)}, {done} done" if parked else "0"
    extra = report.plain or {}
    return f"{extra.get('parked_in_unacked', 0)}, not run"


def _column(report: LegReport) -> list[tuple[str, str]]:
    """One leg's column of the audit table: (row label, value)."""
    clean = report.orders - len(report.poison["orders"])
    if report.guard is not None:
        dead = len(report.guard.get("poison_dead_lettered", []))
        poison = f"{dead} dead-lettered"
        others = str(len(report.guard.get("other_dead_letters", [])))
    else:
        poison = "still crashing"
        others = "none exist"
    return [
        ("orders charged exactly once (payments table)", _once(report.charged, report.orders)),
        ("orders charged twice or more (payments table)", str(report.charged["twice_or_more"])),
        ("orders charged exactly once (provider's ledger)", _once(report.ledger, report.orders)),
        ("orders charged twice or more (provider's ledger)", str(report.ledger["twice_or_more"])),
        ("money taken twice", _money(report.money_charged_twice_cents)),
        ("charged by the provider, missing from payments", str(report.charged_not_recorded)),
        ("orders whose stock was reserved exactly once", _once(report.reserved, report.orders)),
        ("units reserved / units ordered", f"{report.units_reserved}/{report.units_ordered}"),
        ("invoices issued exactly once (poison pills aside)", _once(report.invoiced, clean)),
        ("invoices issued twice or more", str(report.invoiced["twice_or_more"])),
        (f"poison pills ({len(report.poison['orders'])} planted)", poison),
        ("pool processes killed by poison pills", str(report.poison["processes_killed"])),
        ("dead letters besides the poison pills", others),
        ("tasks not done at the end", str(len(report.not_done))),
        ("messages parked with the SIGKILLed worker", _parked_text(report)),
        ("HTTP 503s from the provider (each retried)", str(report.provider["unavailable"])),
        (f"task bodies that wrote a row (for {report.tasks} tasks)", str(report.executions)),
    ]


def print_audit(guarded: LegReport, plain: LegReport | None) -> bool:
    """Print the audit; return True when GuardedTask held every promise."""
    reports = [guarded] + ([plain] if plain is not None else [])
    columns = [_column(report) for report in reports]
    width = max(len(label) for label, _ in columns[0]) + 4
    print()
    print("=" * (width + 22 * len(reports)))
    print("AUDIT".ljust(width) + "".join(f"{report.label:>22}" for report in reports))
    print(" " * width + "".join(f"{f'{r.orders} orders':>22}" for r in reports))
    print("-" * (width + 22 * len(reports)))
    for index, (label, _) in enumerate(columns[0]):
        print(f"  {label}".ljust(width) + "".join(f"{c[index][1]:>22}" for c in columns))
    print("=" * (width + 22 * len(reports)))

    g, guard = guarded, guarded.guard or {}
    metrics = guard.get("metrics", {})
    extra_copies = g.messages - g.tasks
    print()
    print(f"GuardedTask: {g.workers}, {g.messages} messages for {g.tasks} tasks, {g.seconds:.0f}s")
    print(
        f"  duplicates prevented     {guard.get('duplicates_prevented', 0)} of the "
        f"{extra_copies} extra copies found their key COMPLETED: the stored result was "
        "returned, nothing ran"
    )
    print(
        f"  deferred while in flight {metrics.get('in_flight_deferred', 0):.0f} times a copy "
        "arrived while another worker held the key's lease: re-published for a moment later"
    )
    retries = _n(metrics.get("retries", 0), "retry", "retries")
    print(
        f"  retries                  {retries} with full-jitter "
        f"delays after the provider's HTTP 503s ({g.provider['unavailable']} sent, counting any "
        "to a worker killed or frozen by then)"
    )
    print(
        f"  takeovers                {_n(metrics.get('takeover_claims', 0), 'claim')} took over "
        "a key whose owner's lease had run out, poison pills' attempts included (metrics)"
    )
    print("  each task a fault interrupted, from the fault to its key's COMPLETED (the store):")
    for item in guard.get("recoveries", []):
        seconds = f"{item['seconds']:5.1f}s" if item["seconds"] is not None else "  never"
        print(
            f"    {item['key']:<12} {item['fault']} {item['worker']:<10} {seconds}  "
            f"completed by {item['completed_by'].split('@')[0]} with fencing token "
            f"{item['fencing_token']} (attempt {item['attempts']}, claimed as "
            f"{item['claim_reason']})"
        )
    if not guard.get("recoveries"):
        print("    none: the faults hit no running task this time")
    if metrics.get("orphan_recovery_seconds_count"):
        mean = metrics["orphan_recovery_seconds_sum"] / metrics["orphan_recovery_seconds_count"]
        print(
            f"  reaper (metrics)         re-published "
            f"{_n(metrics['orphans_recovered'], 'orphaned key')} no other copy had claimed, "
            f"{mean:.1f}s after the lease ran out on average"
        )
    print(
        f"  stale owners             {_n(metrics.get('fenced', 0), 'execution')} of the resumed "
        f"worker fenced (commit refused); the provider refused "
        f"{_n(g.provider['refused_stale'], 'stale fencing token')} and answered "
        f"{_n(g.provider['replayed'], 'repeated charge')} with the first charge"
    )
    for letter in guard.get("dead_letters", []):
        print(
            f"  dead letter              {letter['key']} ({letter['class']}): "
            f"{letter['reason'].split(':')[0]}, after {letter['attempts']} attempts"
        )

    if plain is not None:
        p, extra = plain, plain.plain or {}
        print()
        print(
            f"plain Celery: {p.workers}, acks_late, reject_on_worker_lost, Redis visibility "
            f"timeout 3600 s, {p.seconds:.0f}s"
        )
        print(
            f"  every copy ran           {p.executions} task bodies wrote rows for {p.tasks} "
            f"tasks: {p.repeat_executions} charges, reservations and invoices too many"
        )
        print(
            f"  stuck                    {_n(extra.get('parked_in_unacked', 0), 'message')} of "
            "the SIGKILLed worker, parked in Redis's unacked set until the 3600 s visibility "
            "timeout; then they run again"
        )
        if p.not_done:
            print(f"  not done                 {', '.join(p.not_done[:8])}")
        if p.charged_not_recorded:
            print(
                f"  lost writes              {_n(p.charged_not_recorded, 'order')} charged by "
                "the provider without a payment row: the worker died between the two"
            )
        print(
            f"  poison pills             requeued after every crash, never dead-lettered: "
            f"{p.poison['processes_killed']} pool processes killed so far"
        )
        print(
            "  (a shorter visibility timeout brings a dead worker's messages back sooner, and runs"
            " slow or frozen tasks twice; a provider-side Idempotency-Key the task made up would"
            " spare the provider's ledger, not the shop's own tables)"
        )

    ok = guarded_ok(g)
    print()
    if ok:
        print(
            f"RESULT: OK. GuardedTask charged each of the {g.orders} orders exactly once "
            "(payments table and provider's ledger), reserved and invoiced each once, and "
            "dead-lettered only the planted poison pills."
        )
    else:
        print("RESULT: FAILED. GuardedTask did not hold its guarantee; see above.")
    return ok


def guarded_ok(g: LegReport) -> bool:
    guard = g.guard or {}
    clean = g.orders - len(g.poison["orders"])
    return (
        g.charged["once"] == g.orders
        and g.ledger["once"] == g.orders
        and g.reserved["once"] == g.orders
        and g.units_reserved == g.units_ordered
        and g.invoiced["once"] == clean
        and g.poison["invoiced"] == 0
        and len(guard.get("poison_dead_lettered", [])) == len(g.poison["orders"])
        and not guard.get("other_dead_letters")
        and not g.not_done
    )
