"""Python bytecodes per task, by function: where GuardedTask's own Python work is, beside the floor.

Run from the repository root::

    .venv/bin/python bench/bytecodes.py --variants floor,guarded --kinds noop --top 40

bench/instructions.py says how many machine instructions a task costs, to 0.1% for a no-op;
it cannot say which Python function they go to (perf and callgrind see the interpreter's C
functions on Python 3.11, not the Python code they run). This counts, with ``sys.settrace``
and ``f_trace_opcodes``, every bytecode the main thread executes per task, by code object:
the same tasks, run as bench/instructions.py runs them (in a pool process forked after
``worker_init``, the key in the headers, Celery's tracer), against a
private PostgreSQL and Redis from tests/rig. Deterministic and about ten times faster than a
callgrind run, it ranks the candidates for a cut; bench/instructions.py then measures the cut.

What it does not see: C code (a bytecode that calls into C counts as one), other threads,
and anything outside the process. A bytecode is not a unit of cost: read the ranking with
bench/instructions.py's figure. Printed only (run by hand, not by ``make bench``).
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # so that ``tests.rig`` and ``bench`` import when run as a script
    sys.path.insert(0, str(ROOT))

KINDS = ("noop", "credit")
VARIANTS = ("plain", "floor", "guarded")
WARM_UP = 30


@contextmanager
def counting() -> Iterator[collections.Counter[CodeType]]:
    """Count the bytecodes this thread executes inside the block, by code object."""
    counts: collections.Counter[CodeType] = collections.Counter()

    def trace(frame: FrameType, event: str, arg: Any) -> Callable[..., Any]:
        frame.f_trace_opcodes = True
        frame.f_trace_lines = False
        code = frame.f_code

        def opcode(frame: FrameType, event: str, arg: Any) -> Callable[..., Any]:
            if event == "opcode":
                counts[code] += 1
            return opcode

        return opcode

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        yield counts
    finally:
        sys.settrace(previous)


def where(code: CodeType) -> str:
    """A code object's file (inside site-packages or this repository), line and name."""
    path = code.co_filename
    if "site-packages/" in path:
        path = path.split("site-packages/", 1)[1]
    elif path.startswith(str(ROOT) + os.sep):
        path = path[len(str(ROOT)) + 1 :]
    elif path == "<string>":
        # dataclasses' generated methods all share one place: their parameters tell them apart
        parameters = code.co_varnames[1 : min(code.co_argcount + code.co_kwonlyargcount, 4)]
        return f"<string> {code.co_qualname.rsplit('.', 1)[-1]}({', '.join(parameters)}, ...)"
    return f"{path}:{code.co_firstlineno} {code.co_qualname}"


def package(code: CodeType) -> str:
    """What a code object belongs to: a package of site-packages, this repository's top-level
    package, the standard library's module, or ``<string>`` (dataclasses' generated code)."""
    path = code.co_filename
    if "site-packages/" in path:
        return path.split("site-packages/", 1)[1].split("/", 1)[0]
    if path.startswith(str(ROOT) + os.sep):
        return path[len(str(ROOT)) + 1 :].split(os.sep, 1)[0]
    return Path(path).name


def per_task(counts: collections.Counter[CodeType], tasks: int) -> dict[str, float]:
    """Bytecodes per task by :func:`where` (code objects of one place summed)."""
    by_place: collections.Counter[str] = collections.Counter()
    for code, count in counts.items():
        by_place[where(code)] += count
    return {place: count / tasks for place, count in by_place.items()}


def render(name: str, counts: collections.Counter[CodeType], tasks: int, top: int) -> list[str]:
    """Total, by package, and the ``top`` places, per task."""
    total = sum(counts.values()) / tasks
    packages: collections.Counter[str] = collections.Counter()
    for code, count in counts.items():
        packages[package(code)] += count
    lines = [f"== {name}: {total:.0f} bytecodes/task"]
    lines += [f"   {label:32s} {count / tasks:8.0f}" for label, count in packages.most_common(12)]
    # This repository's own code by module too: what each part of the guard costs a task.
    modules: collections.Counter[str] = collections.Counter()
    for code, count in counts.items():
        if package(code) == "celery_guard":
            modules[where(code).split(":", 1)[0]] += count
    lines += [f"     {label:30s} {count / tasks:8.0f}" for label, count in modules.most_common()]
    places = sorted(per_task(counts, tasks).items(), key=lambda item: -item[1])[:top]
    lines += [f"   {count:8.1f}  {place}" for place, count in places]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=200, help="tasks counted (200)")
    parser.add_argument("--kinds", default="noop", help=f"of {','.join(KINDS)} (noop)")
    parser.add_argument("--variants", default="floor,guarded", help=f"of {','.join(VARIANTS)}")
    parser.add_argument("--top", type=int, default=40, help="places listed per variant (40)")
    parser.add_argument("--guard-conf", default="", help="celery_guard settings, as JSON")
    args = parser.parse_args()
    kinds = [kind for kind in args.kinds.split(",") if kind]
    variants = [variant for variant in args.variants.split(",") if variant]
    if not kinds or set(kinds) - set(KINDS) or not variants or set(variants) - set(VARIANTS):
        parser.error("unknown --kinds or --variants")
    if args.tasks < 1:
        parser.error("--tasks must be at least 1")

    import sqlalchemy

    from celery_guard import get_runtime
    from tests.rig.servers import PostgresServer, RedisServer

    with PostgresServer(durable=False) as postgres, RedisServer() as redis:
        os.environ.update(
            {
                "BENCH_BROKER_URL": redis.url_for(0),
                "BENCH_REDIS_URL": redis.url_for(1),
                "BENCH_STORE_URL": postgres.url,
                "BENCH_GUARD_CONF": args.guard_conf,
            }
        )
        import bench.overhead_app as bench
        from bench import instructions

        engine = sqlalchemy.create_engine(postgres.url, poolclass=sqlalchemy.NullPool)
        bench.metadata.create_all(engine)
        get_runtime(bench.app).migrate()
        instructions.start_worker()
        first_row = 10_000_000
        for kind in kinds:
            for variant in variants:
                name = f"bench.{variant}_{kind}"
                text = instructions.in_pool_process(
                    functools.partial(measure, name, first_row, args.tasks, args.top)
                )
                first_row += 200_000
                print(text, flush=True)


def measure(name: str, first_row: int, tasks: int, top: int) -> str:
    """In a pool process: the warm-up, then ``tasks`` tasks counted; the report's text."""
    from bench import instructions

    instructions.run_tasks(name, WARM_UP, first_row, warm_up=0)
    with counting() as counts:
        instructions.run_tasks(name, tasks, first_row + 100_000, warm_up=0)
    return "\n".join(render(name, counts, tasks, top))


if __name__ == "__main__":
    main()
