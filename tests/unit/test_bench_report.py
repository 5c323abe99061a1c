"""The benchmark report's plumbing, without running a benchmark (``make bench`` does that)."""

from __future__ import annotations

import argparse
import importlib
import marshal
import os
from pathlib import Path

import pytest

from bench import bytecodes, instructions, overhead, peers, pool_cost, run_all


def test_run_all_finds_every_benchmark_in_bench_and_skips_app_modules() -> None:
    names = run_all.benchmarks()
    assert names[:3] == ["overhead", "recovery", "peers"]
    assert not [name for name in names if name.endswith("_app") or name == "run_all"]
    # A benchmark is a script with a main(); helper modules (bench/cpu.py) are not run.
    assert [name for name in names if not callable(getattr(_module(name), "main", None))] == []


def _module(name: str) -> object:
    return importlib.import_module(f"bench.{name}")


def test_header_replaces_only_what_is_above_the_first_section(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nold header\n\n## Overhead (x)\n\nkept\n\n## Peers\n\nkept\n")
    outcomes = [run_all.Outcome("peers", "python bench/peers.py", 12.0, 1)]
    text = run_all.header(outcomes, "bench/run_all.py --only peers", False, {"CPU": "c"}, 12.0)
    run_all.write_header(doc, text)
    new = doc.read_text()
    assert "old header" not in new
    assert new.count("kept") == 2
    assert "**failed (exit 1)**" in new
    assert "only peers" in new


def test_a_count_that_differs_from_the_mechanism_is_flagged_not_explained() -> None:
    runs = {
        ("b", variant): peers.FaultRun("b", variant, "t", effects=rows, settled=True)
        for variant, rows in (("plain", 2), ("once", 2), ("singleton", 2), ("guarded", 1))
    }
    assert peers.fault_reading(runs) == [f"- (b) {peers.READING['b']}"]
    runs["b", "guarded"].effects = 2
    (line,) = peers.fault_reading(runs)
    assert "Not what was expected" in line
    assert "GuardedTask 2" in line


def test_scale_reports_percentiles_and_every_run_beside_its_load() -> None:
    from bench import scale

    assert scale.percentile([float(n) for n in range(1, 101)], 0.5) == 50.0
    assert scale.percentile([float(n) for n in range(1, 101)], 0.99) == 99.0
    args = argparse.Namespace(
        seconds=60.0,
        insert_rate=600.0,
        expired=0.02,
        concurrency=4,
        tasks=100,
        store_url=None,
        pgbouncer=False,
    )
    stats = {"updated": 0.0, "hot": 0.0, "autovacuums": 0.0}
    run = scale.KeysRun(
        rows=1000,
        indexes="partial",
        claims=[0.0003, 0.0004],
        completions=[0.001],
        seconds=1.0,
        load="1.00/1.00/1.00",
        sizes_before={"celery_guard_keys": 2**20},
        sizes_after={"celery_guard_keys": 2**21},
        stats_before=stats,
        stats_after=stats,
    )
    claimers = scale.ClaimersRun(
        workers=2, tasks=100, unique=90, seconds=5.0, effects=90, effect_span=1.0, load="2.00"
    )
    keys_lines = scale.render_keys(args, [run])
    claimer_lines = scale.render_claimers(args, [claimers])
    assert any(line.startswith("| 1,000 | partial | 0.300 / 0.400") for line in keys_lines)
    assert any("1.00/1.00/1.00" in line for line in keys_lines)
    assert any("celery_guard_keys: 1.0 → 2.0" in line for line in keys_lines)
    assert any(
        line.startswith("| 2 | 90 | 5 | 0 |") and "90 / 90" in line for line in claimer_lines
    )


def test_overhead_pairs_each_rounds_runs_and_says_both_verdicts() -> None:
    result = overhead.SettingResult()
    # Round 2 ran in a slow phase of the machine: both variants took twice as long.
    result.seconds["floor_noop"] = [10.0, 20.0, 10.0]
    result.seconds["guarded_noop"] = [11.0, 22.0, 12.5]
    assert [round(r, 3) for r in overhead.paired_ratios(result, "guarded_noop", "floor_noop")] == [
        0.909,
        0.909,
        0.8,
    ]
    args = argparse.Namespace(tasks=1000, variants=["floor", "guarded"])
    (line,) = overhead.render_targets(args, {"durable": result})
    # The medians (10 s and 12.5 s: runs of different rounds) make 0.80; the rounds' own
    # ratios have a median of 0.91.
    assert line == (
        "- durable, noop: GuardedTask (defaults) / floor 0.80 (NOT met), paired 0.91 (met); "
        "target at least 0.9"
    )


def test_a_run_without_the_partial_indexes_never_replaces_the_headline_section() -> None:
    headline = overhead.heading_for(overhead.DEFAULT_CONCURRENCY)
    bound = overhead.heading_for(overhead.DEFAULT_CONCURRENCY, without_indexes=True)
    assert headline == overhead.HEADING and bound != headline
    assert "--without-indexes" in bound
    # What it drops is exactly the keys table's partial indexes, never its primary key.
    from celery_guard.store.schema import keys

    partial = {
        index.name
        for index in keys.indexes
        if index.dialect_options["postgresql"]["where"] is not None
    }
    assert set(overhead.PARTIAL_KEY_INDEXES) == partial


def test_pool_cost_matches_a_builtin_across_workers_whatever_its_address(tmp_path: Path) -> None:
    # Two workers' dumps: a built-in's name carries an address that differs between them.
    for variant, address in (("floor", "0x7fed6425ea00"), ("guarded", "0x7f7cb545ea00")):
        directory = tmp_path / f"{variant}_noop"
        directory.mkdir()
        stats = {
            ("~", 0, f"<built-in method __new__ of type object at {address}>"): (8, 8, 0, 0, {}),
            ("/x/celery_guard/engine.py", 459, "observed"): (
                4,
                4 if variant == "guarded" else 0,
                0,
                0,
                {},
            ),
        }
        (directory / "1.pstats").write_bytes(marshal.dumps(stats))
    floor = pool_cost.calls_by_function(tmp_path / "floor_noop", tasks=2)
    guarded = pool_cost.calls_by_function(tmp_path / "guarded_noop", tasks=2)
    assert floor["<built-in method __new__ of type object>"] == 4.0
    assert guarded["<built-in method __new__ of type object>"] == 4.0
    assert guarded["engine.py:459(observed)"] - floor["engine.py:459(observed)"] == 2.0


def test_instructions_table_gives_ratios_to_plain_and_floor_and_the_excess() -> None:
    counts = {("noop", "plain"): 800_000.0, ("noop", "floor"): 1_000_000.0}
    counts["noop", "guarded"] = 1_250_000.0
    args = argparse.Namespace(low=20, high=120, settings="fast")
    text = instructions.render(
        counts, ("noop",), ("plain", "floor", "guarded"), args, "bench/instructions.py", 9.0
    )
    assert text.startswith(instructions.HEADING + "\n")
    assert "| noop | guarded | 1250.0 | 1.56 | 1.25 | +250.0 |" in text
    assert "| noop | floor | 1000.0 | 1.25 | 1.00 |  |" in text
    assert "100 tasks between" in text
    assert "instructions" not in run_all.benchmarks()  # by hand: valgrind, not make bench


def _loop(times: int) -> int:
    total = 0
    for step in range(times):
        total += step
    return total


def test_bytecodes_are_counted_per_function_and_grow_with_the_work() -> None:
    with bytecodes.counting() as short:
        _loop(5)
    with bytecodes.counting() as long:
        _loop(50)
    short_counts = bytecodes.per_task(short, tasks=1)
    long_counts = bytecodes.per_task(long, tasks=10)
    place = next(name for name in short_counts if name.endswith(" _loop"))
    assert place.startswith("tests/unit/test_bench_report.py:")
    # Deterministic: the same loop gives the same count every time, 45 more steps more.
    assert long_counts[place] * 10 > short_counts[place] * 5
    with bytecodes.counting() as again:
        _loop(5)
    assert bytecodes.per_task(again, tasks=1)[place] == short_counts[place]
    text = "\n".join(bytecodes.render("loop", long, tasks=10, top=3))
    assert text.startswith("== loop: ")
    assert "tests " in text  # this repository's package, by top-level directory
    assert "bytecodes" not in run_all.benchmarks()  # printed by hand, not make bench


def test_in_pool_process_runs_the_work_in_a_forked_pool_process_and_returns_its_answer() -> None:
    """bench/instructions.py and bench/bytecodes.py count a pool process's work: forked, with
    ``worker_process_init`` sent in it (not in the benchmark's own process), the answer back."""
    from celery import signals

    initialised: list[int] = []

    def on_init(**_: object) -> None:
        initialised.append(os.getpid())

    signals.worker_process_init.connect(on_init, weak=False)
    try:
        pid, seen = instructions.in_pool_process(lambda: (os.getpid(), list(initialised)))
        with pytest.raises(SystemExit, match="failed"):
            instructions.in_pool_process(lambda: 1 // 0)
    finally:
        signals.worker_process_init.disconnect(on_init)
    assert pid != os.getpid()
    assert seen == [pid]
    assert initialised == []  # sent in the child only
