"""Process helpers shared by the servers and workers: bounded waits, /proc lookups, cleanup.

Every process the rig starts is the leader of its own session (``start_new_session=True``),
so its process group id equals its PID and ``os.killpg`` reaches Celery pool children even
after the leader died. PostgreSQL children setsid() themselves, so trees are also walked
through /proc/<pid>/task/*/children.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol, TypeVar


class Managed(Protocol):
    """Anything in the registry: it can be killed without waiting, e.g. at interpreter exit."""

    def emergency_kill(self) -> None: ...


_REGISTRY: list[Managed] = []
_TEMP_DIRS: list[Path] = []


def register(obj: Managed) -> None:
    """Track a started process so ``kill_all``/atexit can reap it if a test forgets."""
    if obj not in _REGISTRY:
        _REGISTRY.append(obj)


def unregister(obj: Managed) -> None:
    with contextlib.suppress(ValueError):
        _REGISTRY.remove(obj)


def registered() -> list[Managed]:
    """Everything started and not yet stopped, oldest first."""
    return list(_REGISTRY)


def kill_all() -> int:
    """SIGKILL everything the rig started and has not stopped; return how many there were.

    Call it from a session fixture's teardown; it also runs at interpreter exit.
    """
    leftovers = list(reversed(_REGISTRY))
    for obj in leftovers:
        with contextlib.suppress(Exception):
            obj.emergency_kill()
        unregister(obj)
    return len(leftovers)


def remove_at_exit(path: Path) -> None:
    """Delete ``path`` at interpreter exit (worker logs are kept for the test's assertions)."""
    _TEMP_DIRS.append(path)


def _at_exit() -> None:
    kill_all()
    for path in _TEMP_DIRS:
        shutil.rmtree(path, ignore_errors=True)


atexit.register(_at_exit)


_T = TypeVar("_T")


def side_by_side(calls: Iterable[Callable[[], _T]], at_once: int = 2) -> list[_T]:
    """Run independent calls (subprocesses a test starts and waits for) ``at_once`` at a time;
    their results in order. A CLI subprocess is a CPU-bound Python start-up of ~1.5 s, and
    the machine has two cores: two at a time nearly halves a chain of them."""
    with ThreadPoolExecutor(max_workers=at_once) as pool:
        return list(pool.map(lambda call: call(), calls))


def wait_until(
    predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.05
) -> None:
    """Poll ``predicate`` until truthy; raise TimeoutError naming ``what`` after ``timeout`` s.

    The predicate may raise to abort early (e.g. when the process being waited for died).
    """
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the ``(comm)`` field: state, ppid, pgrp, ..."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return raw[raw.rindex(")") + 2 :].split()


def pid_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie (orphans may never be reaped by PID 1 here)."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def process_state(pid: int) -> str | None:
    """The one-letter /proc state (R, S, T, Z, ...) or None if the process is gone."""
    fields = _stat_fields(pid)
    return fields[0] if fields else None


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid``, from every thread's /proc children list (or ``pgrep -P``)."""
    tasks = Path(f"/proc/{pid}/task")
    try:
        files = list(tasks.glob("*/children"))
    except OSError:
        files = []
    if not files:
        out = subprocess.run(
            ["pgrep", "-P", str(pid)], capture_output=True, text=True, timeout=10, check=False
        ).stdout
        return sorted(int(p) for p in out.split())
    found: set[int] = set()
    for f in files:
        with contextlib.suppress(OSError):
            found.update(int(p) for p in f.read_text().split())
    return sorted(p for p in found if pid_alive(p))


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is ``pgid``."""
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat_fields(int(entry))
            if fields and fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
                members.append(int(entry))
    return members


def descendants(pid: int) -> list[int]:
    """All live descendants of ``pid`` (children first found, then theirs)."""
    found: list[int] = []
    todo = [pid]
    while todo:
        kids = child_pids(todo.pop())
        found += kids
        todo += kids
    return found


def signal_group(pgid: int, sig: int) -> None:
    """``killpg`` that ignores an already-empty group."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def signal_tree(pid: int, sig: int) -> None:
    """Signal ``pid``'s process group and every descendant.

    Descendants are signalled one by one because PostgreSQL children call setsid() and so
    leave the postmaster's process group; Celery pool children stay in it.
    """
    signal_group(pid, sig)
    for child in descendants(pid):
        _kill(child, sig)


def _kill(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def terminate_tree(
    proc: subprocess.Popen[bytes],
    sig: int,
    timeout: float,
    kill_timeout: float = 10,
    *,
    already_signalled: bool = False,
) -> None:
    """Send ``sig`` to the leader, wait ``timeout`` s, then SIGKILL the group and descendants.

    ``already_signalled``: the caller sent ``sig`` itself; it is not sent again (a second
    SIGTERM can reach a Celery worker after its warm shutdown restored the default handler,
    and kill it with -15 instead of letting it exit 0).

    Leftovers (orphaned children of a dead leader, still in its group or known from a
    snapshot taken before signalling) are killed too, and we wait (bounded) until none is
    alive, so callers can rely on the whole tree being gone.
    """
    pgid = proc.pid
    tree = descendants(pgid)
    signal_tree(pgid, signal.SIGCONT)  # a frozen process cannot handle ``sig``
    if proc.poll() is None:
        if not already_signalled:
            _kill(pgid, sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            tree += descendants(pgid)
            signal_tree(pgid, signal.SIGKILL)
            proc.wait(kill_timeout)

    def leftovers() -> list[int]:
        return group_members(pgid) + [p for p in tree if pid_alive(p)]

    if leftovers():
        signal_group(pgid, signal.SIGKILL)
        for pid in tree:
            _kill(pid, signal.SIGKILL)
        wait_until(lambda: not leftovers(), kill_timeout, f"process tree of {pgid} to die")


def kill_tree_now(proc: subprocess.Popen[bytes] | None) -> None:
    """SIGKILL the tree and reap the leader without raising (used for emergency cleanup)."""
    if proc is None:
        return
    with contextlib.suppress(Exception):
        signal_tree(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)


def log_tail(path: Path, lines: int = 40) -> str:
    """Last ``lines`` lines of a log file, for error messages."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return "<no log file>"
    return "\n".join(text.splitlines()[-lines:])


def remove_tree(path: Path | None) -> None:
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)
