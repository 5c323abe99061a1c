"""A real ``celery worker`` subprocess that tests can start, stop, kill, freeze and inspect."""

from __future__ import annotations

import itertools
import os
import re
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType

from celery.utils.nodenames import default_nodename, host_format

from . import procs

_counter = itertools.count(1)
# Celery logs "<hostname> ready." once the consumer is up; hostname contains the "@".
_READY = re.compile(r"@\S+ ready\.")


class WorkerProcess:
    """``python -m celery -A app worker`` in its own process group, logging to a temp file.

    The main process is the group leader (start_new_session=True), so the prefork pool
    children share its process group and ``kill()``/``freeze()`` reach the whole tree.
    """

    def __init__(
        self,
        app: str,
        env: dict[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        concurrency: int = 2,
        pool: str = "prefork",
        queues: str | None = None,
        hostname: str | None = None,
        loglevel: str = "INFO",
        extra_args: list[str] | None = None,
    ) -> None:
        self.app = app
        self.env = dict(env or {})
        self.cwd = str(cwd) if cwd is not None else os.getcwd()
        self.concurrency = concurrency
        self.pool = pool
        self.queues = queues
        self.hostname = hostname or f"w{next(_counter)}-{uuid.uuid4().hex[:6]}@%h"
        self.loglevel = loglevel
        self.extra_args = list(extra_args or [])
        self._tmp = Path(tempfile.mkdtemp(prefix="rig-worker-"))
        procs.remove_at_exit(self._tmp)
        self.log_path = self._tmp / "worker.log"
        self._proc: subprocess.Popen[bytes] | None = None
        #: request_warm_shutdown sent SIGTERM already: stop() waits for it, sends none again.
        self._warm_requested = False

    def argv(self) -> list[str]:
        argv = [sys.executable, "-m", "celery", "-A", self.app, "worker"]
        argv += ["--loglevel", self.loglevel, "--concurrency", str(self.concurrency)]
        argv += ["--pool", self.pool, "--hostname", self.hostname]
        argv += ["--without-mingle", "--without-gossip"]
        if self.queues:
            argv += ["--queues", self.queues]
        return argv + self.extra_args

    def start(self, wait_ready: bool = True, timeout: float = 60) -> None:
        """Spawn the worker; with ``wait_ready`` block until it logs "ready." (bounded)."""
        if self._proc is not None:
            raise RuntimeError("worker already started")
        # TMPDIR: billiard's pymp-* dirs would otherwise pile up in /tmp after kill().
        env = {**os.environ, "TMPDIR": str(self._tmp), **self.env, "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                self.argv(),
                cwd=self.cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        procs.register(self)
        if wait_ready:
            self.wait_ready(timeout)

    def wait_ready(self, timeout: float = 60) -> None:
        def ready() -> bool:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise RuntimeError(f"worker exited with code {self._proc.returncode}")
            return bool(_READY.search(self.log_text()))

        try:
            procs.wait_until(ready, timeout, f"worker {self.hostname} to be ready", 0.1)
        except Exception as exc:
            tail = procs.log_tail(self.log_path)
            self.kill()
            raise RuntimeError(f"{exc}\n--- worker log tail ---\n{tail}") from None

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise RuntimeError("worker not started")
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        return None if self._proc is None else self._proc.poll()

    def is_alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def child_pids(self) -> list[int]:
        """PIDs of the pool processes (direct children of the main process)."""
        return procs.child_pids(self.pid)

    def stop(self, timeout: float = 20) -> int | None:
        """Warm shutdown (SIGTERM); SIGKILL the whole group after ``timeout`` s. Returns exit code.

        Waits (bounded) until no process of the group is left, including orphaned children.
        """
        code = None
        if self._proc is not None:
            procs.terminate_tree(
                self._proc, signal.SIGTERM, timeout, already_signalled=self._warm_requested
            )
            code = self._proc.returncode
        procs.unregister(self)
        return code

    def request_warm_shutdown(self) -> None:
        """Send SIGTERM to the main process and return at once (``stop()`` then waits)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            self._warm_requested = True

    def kill(self) -> None:
        """SIGKILL the main process and all pool children at once (simulates a crash/OOM)."""
        if self._proc is not None:
            procs.terminate_tree(self._proc, signal.SIGKILL, timeout=10)
        procs.unregister(self)

    def kill_child(self, pid: int) -> None:
        """SIGKILL one pool child; the main process normally replaces it."""
        if pid not in self.child_pids():
            raise ValueError(f"{pid} is not a child of worker {self.pid}")
        os.kill(pid, signal.SIGKILL)

    def freeze(self) -> None:
        """SIGSTOP every process of the worker (looks like a hung/partitioned host)."""
        procs.signal_tree(self.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        procs.signal_tree(self.pid, signal.SIGCONT)

    @property
    def node_name(self) -> str:
        """The name the worker answers remote control under (``%h`` expanded, as Celery does).

        Addressing an inspect call to it (``destination=[node_name]``) returns as soon as the
        worker replies; a broadcast waits out its whole timeout for replies that never come.
        """
        return str(host_format(default_nodename(self.hostname)))

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def emergency_kill(self) -> None:
        procs.kill_tree_now(self._proc)

    def cleanup(self) -> None:
        """Stop if running and delete the log directory."""
        self.stop()
        procs.remove_tree(self._tmp)

    def __enter__(self) -> WorkerProcess:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def stop_all(workers: Iterable[WorkerProcess], timeout: float = 20) -> list[int | None]:
    """Stop every worker by PID (:meth:`WorkerProcess.stop`), their warm shutdowns side by side.

    Each shutdown spends ~2 s joining billiard's pool threads, which poll on 0.8-1 s sleeps;
    signalled together, the workers wait them out at once instead of one after another.
    """
    workers = list(workers)
    for worker in workers:
        worker.request_warm_shutdown()
    return [worker.stop(timeout) for worker in workers]
