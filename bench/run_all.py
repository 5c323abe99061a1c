"""Every benchmark in bench/, one after the other, and the header of docs/benchmarks.md.

``make bench`` runs this (``make bench BENCH_ARGS=--smoke`` for a quick check of the pipeline)::

    .venv/bin/python bench/run_all.py [--smoke] [--only overhead,peers] [--output PATH]

Each benchmark is its own process (bench/overhead.py, bench/recovery.py, bench/peers.py, then any
other script in bench/ that is not an app module) and writes its own section of the output,
with the exact command it ran and the machine it ran on. This script then writes the part above
the first section: when, the machine, the versions, the command, and each benchmark's wall time
and exit status. A benchmark that fails leaves its previous section in place, and the header
says so. ``--smoke`` passes small sizes to each benchmark; its header says it is a smoke run.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: The known benchmarks in the order they run; any other script in bench/ runs after them.
ORDER = ("overhead", "recovery", "peers")
#: Arguments ``--smoke`` passes: small sizes, every code path still taken.
SMOKE_ARGS = {
    "overhead": ["--tasks", "200", "--repeats", "1"],
    "recovery": shlex.split(
        "--runs 1 --variants vanilla,guarded_sql --cap 15"
        " --load-tasks 20 --load-seconds 20 --window 3"
    ),
    "peers": ["--tasks", "200", "--repeats", "1"],
    "publish_tracking": ["--publishes", "200", "--repeats", "1"],
    "scale": shlex.split("--rows 20000 --seconds 5 --workers 2 --tasks 200"),
    "claim_cost": ["--tasks", "200", "--repeats", "1"],
    "body_transaction": ["--tasks", "200", "--repeats", "1"],
    "pool_cost": ["--from", "20", "--to", "60", "--rounds", "1", "--calls"],
}
#: A benchmark that runs longer than this is stopped (by PID) and reported as failed.
TIMEOUT = 3 * 3600
#: Not run here: ``soak`` is run by hand (it loads the machine for about 15 minutes) and
#: ``profile_worker``, ``instructions`` (valgrind, about 15 minutes) and ``bytecodes`` are
#: profilers to run by hand; ``canvas``, ``pgbouncer_claims`` and
#: ``pgbouncer_recovery`` print their tables for a note or docs/pgbouncer.md, by hand, and
#: write no section; ``cpu``, ``floor`` and ``pool_probe`` are helper modules of the
#: benchmarks, not ones.
NOT_BENCHMARKS = {
    "__init__",
    "run_all",
    "soak",
    "profile_worker",
    "instructions",
    "bytecodes",
    "canvas",
    "pgbouncer_claims",
    "pgbouncer_recovery",
    "cpu",
    "floor",
    "pool_probe",
}
VERSIONED = {
    "celery": "celery",
    "kombu": "kombu",
    "redis-py": "redis",
    "SQLAlchemy": "SQLAlchemy",
    "psycopg": "psycopg",
    "celery-once (peer)": "celery_once",
    "celery-singleton (peer)": "celery-singleton",
}


def benchmarks() -> list[str]:
    """Every runnable benchmark in bench/: scripts other than app modules and this one."""
    found = {
        path.stem
        for path in (ROOT / "bench").glob("*.py")
        if path.stem not in NOT_BENCHMARKS and not path.stem.endswith("_app")
    }
    return [name for name in ORDER if name in found] + sorted(found - set(ORDER))


@dataclass
class Outcome:
    name: str
    command: str
    seconds: float
    code: int | None  # None: stopped after TIMEOUT


def run(name: str, extra: list[str], output: Path) -> Outcome:
    argv = [
        os.path.relpath(sys.executable, ROOT),
        f"bench/{name}.py",
        *extra,
        "--output",
        os.path.relpath(output, ROOT),
    ]
    command = shlex.join(argv)
    print(f"\n=== {command}", flush=True)
    started = time.monotonic()
    # Its own session, so that a timeout can stop it and everything it started, by its PID.
    proc = subprocess.Popen(argv, cwd=ROOT, start_new_session=True)
    try:
        code: int | None = proc.wait(TIMEOUT)
    except subprocess.TimeoutExpired:
        from tests.rig import procs

        # SIGINT, so its finally blocks and atexit handler stop the servers and workers it
        # started; then SIGKILL to whatever of its tree is left after 60 s.
        procs.terminate_tree(proc, signal.SIGINT, timeout=60)
        code = None
    except KeyboardInterrupt:
        from tests.rig import procs

        procs.terminate_tree(proc, signal.SIGINT, timeout=60)  # as the terminal would have
        raise
    seconds = time.monotonic() - started
    print(f"=== {name}: exit {code}, {seconds:.0f} s", flush=True)
    return Outcome(name, command, seconds, code)


def version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def server_version(argv: list[str], pattern: str) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    except OSError as exc:
        return f"unknown ({exc})"
    match = re.search(pattern, done.stdout)
    return match.group(1) if match else done.stdout.strip() or "unknown"


def machine() -> dict[str, str]:
    from bench.overhead import code_revision
    from tests.rig.servers import PG_BIN, REDIS_SERVER

    cpuinfo = Path("/proc/cpuinfo").read_text()
    model = re.search(r"^model name\s*:\s*(.*)$", cpuinfo, re.M)
    mem_kb = re.search(r"^MemTotal:\s*(\d+)", Path("/proc/meminfo").read_text(), re.M)
    release = Path("/etc/os-release")
    text = release.read_text() if release.exists() else ""
    pretty = re.search(r'^PRETTY_NAME="?([^"\n]*)', text, re.M)
    info = {
        "CPU": f"{model.group(1) if model else 'unknown'}, {os.cpu_count()} cores "
        f"(nproc {len(os.sched_getaffinity(0))})",
        "RAM": f"{int(mem_kb.group(1)) / 2**20:.1f} GiB" if mem_kb else "unknown",
        "OS": f"{pretty.group(1) if pretty else platform.system()}, kernel {platform.release()}",
        "Python": platform.python_version(),
        "celery_guard": code_revision(),
    }
    info.update({label: version(dist) for label, dist in VERSIONED.items()})
    info["PostgreSQL"] = server_version([str(PG_BIN / "postgres"), "--version"], r"\) (\S+.*)")
    info["Redis server"] = server_version([REDIS_SERVER, "--version"], r"v=(\S+)")
    return info


def header(
    outcomes: list[Outcome], command: str, smoke: bool, info: dict[str, str], wall: float
) -> str:
    today = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    via = "`make bench`, which ran " if os.environ.get("MAKELEVEL") else ""
    out = ["# Benchmarks", ""]
    if smoke:
        out += [
            "**SMOKE RUN**: small sizes, to check that every benchmark runs end to end; these "
            "are not figures to quote. `make bench` without `--smoke` writes the real ones.",
            "",
        ]
    ran = [outcome.name for outcome in outcomes]
    if ran == benchmarks():
        which = "every benchmark in `bench/`, one after the other"
    else:
        older = [name for name in benchmarks() if name not in ran]
        which = f"only {', '.join(ran)} (the sections of {', '.join(older)} are older)"
    out += [
        f"Written {today} by {via}`{command}`: {which}, in {wall / 60:.0f} min. Each section "
        "below gives the exact command it ran, its method, and the machine's load while it ran.",
        "",
        "| Benchmark | Command | Wall time | Result |",
        "|---|---|---:|---|",
    ]
    for outcome in outcomes:
        if outcome.code == 0:
            result = "written below"
        elif outcome.code is None:
            result = f"**stopped after {TIMEOUT} s**; its section below, if any, is older"
        else:
            result = f"**failed (exit {outcome.code})**; its section below, if any, is older"
        out.append(f"| {outcome.name} | `{outcome.command}` | {outcome.seconds:.0f} s | {result} |")
    out += ["", "Machine and versions:", ""]
    out += [f"- {key}: {value}" for key, value in info.items()]
    return "\n".join(out) + "\n"


def write_header(path: Path, text: str) -> None:
    """Replace everything above the first ``## `` section of ``path`` with ``text``."""
    old = path.read_text() if path.exists() else ""
    first = re.search(r"^## ", old, re.M)
    rest = old[first.start() :] if first else ""
    path.write_text(text + ("\n" + rest if rest else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="small sizes (a pipeline check)")
    parser.add_argument("--only", help=f"comma-separated subset of {','.join(benchmarks())}")
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "benchmarks.md")
    args = parser.parse_args()
    names = benchmarks()
    if args.only:
        unknown = set(args.only.split(",")) - set(names)
        if unknown:
            parser.error(f"unknown benchmarks {sorted(unknown)}; known: {names}")
        names = [name for name in names if name in args.only.split(",")]
    command = shlex.join([os.path.relpath(sys.executable, ROOT), *sys.argv])
    output = args.output.resolve()

    started = time.monotonic()
    outcomes = [run(name, SMOKE_ARGS.get(name, []) if args.smoke else [], output) for name in names]
    wall = time.monotonic() - started
    write_header(output, header(outcomes, command, args.smoke, machine(), wall))
    print(f"\nwritten to {output}; total wall time {wall:.0f} s")
    for outcome in outcomes:
        print(f"  {outcome.name:10s} {outcome.seconds:6.0f} s  exit {outcome.code}")
    if any(outcome.code != 0 for outcome in outcomes):
        sys.exit(1)


if __name__ == "__main__":
    main()
