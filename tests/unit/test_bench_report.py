"""The benchmark report's plumbing, without running a benchmark (``make bench`` does that)."""

from __future__ import annotations

import importlib
from pathlib import Path

from bench import peers, run_all


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
