"""Keeping a running execution's lease alive, and noticing when it is lost.

One heartbeat thread per process renews the leases of every execution running in that process,
all in one store call per interval. It is started lazily by the first execution after fork, so a
prefork parent never owns a thread its children would inherit half-dead. In a prefork pool
process with leases in the store's rows, that call is one message to the main process's
renewal relay (celery_guard/lease/relay.py): the process's one connection may be in its body's
transaction.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

from celery_guard import forks, signals
from celery_guard.errors import Fenced, StoreError

logger = logging.getLogger("celery_guard.lease")

Clock = Callable[[], float]


class Renewer(Protocol):
    """What the heartbeat needs of a lease backend."""

    def renew_leases(
        self,
        leases: Iterable[tuple[str, int]],
        ttl: float,
        statuses: Mapping[str, str] | None = None,
    ) -> set[str]:
        """Extend each (key, handle) lease still held; return the renewed keys."""
        ...


class Lease:
    """The lease one execution holds, as this process sees it (monotonic clock)."""

    def __init__(
        self,
        key: str,
        token: int,
        *,
        handle: int | None = None,
        ttl: float,
        hard_deadline: float | None,
        progress_timeout: float | None,
        clock: Clock = time.monotonic,
        on_fence: Callable[[Lease], None] | None = None,
    ) -> None:
        now = clock()
        self._on_fence = on_fence
        self.key = key
        self.token = token
        #: What the lease backend checks on renewal: the fencing token for SQL leases, the
        #: value stored in the Redis lease otherwise.
        self.handle = token if handle is None else handle
        self.ttl = ttl
        self._clock = clock
        #: Until when the lease is surely ours: measured from *before* the last successful
        #: renewal was sent, so network delay only ever shortens it.
        self.valid_until = now + ttl
        self.acquired_at = now
        #: When the last successful renewal (or the claim) was sent.
        self.renewed_at = now
        self.deadline = None if hard_deadline is None else now + hard_deadline
        self.progress_timeout = progress_timeout
        self.last_progress = now
        self.progress_info: object = None
        #: Who runs this lease (task, owner...), published as live status where supported.
        self.description: dict[str, object] = {}
        self.fenced_reason: str | None = None
        #: ``taken_over``, ``expired`` or ``store_unreachable`` once fenced.
        self.fenced_cause: str | None = None
        self.renewing = True

    def progress(self, info: object = None) -> None:
        """The body reports it is moving; in progress mode this keeps the lease renewed."""
        self.last_progress = self._clock()
        self.progress_info = info

    def should_renew(self, now: float) -> bool:
        """False once the hard deadline or the progress timeout has passed (never again True)."""
        if not self.renewing or self.fenced_reason is not None:
            return False
        if self.deadline is not None and now >= self.deadline:
            self._stop_renewing("hard deadline passed")
        elif self.progress_timeout is not None and now - self.last_progress > self.progress_timeout:
            self._stop_renewing(f"no progress for {now - self.last_progress:.1f}s")
        return self.renewing

    def status_json(self, now: float) -> str:
        """Live status for operators: who runs the key, since when, its last progress."""
        wall = time.time() - now  # this process's monotonic clock, as wall-clock time
        return json.dumps(
            {
                **self.description,
                "key": self.key,
                "fencing_token": self.token,
                "started_at": round(wall + self.acquired_at, 3),
                "progress_at": round(wall + self.last_progress, 3),
                "progress": self.progress_info,
                "renewed_at": round(wall + now, 3),
            },
            default=str,
        )

    def fence(self, reason: str, cause: str = "expired") -> None:
        if self.fenced_reason is None:
            self.fenced_reason = reason
            self.fenced_cause = cause
            logger.warning(
                "celery_guard lease lost key=%s token=%s: %s", self.key, self.token, reason
            )
            if self._on_fence is not None:
                self._on_fence(self)

    def check(self) -> None:
        """Raise :class:`Fenced` if this execution may no longer commit."""
        if self.fenced_reason is None and self._clock() > self.valid_until:
            self.fence("lease expired without renewal")
        if self.fenced_reason is not None:
            raise Fenced(self.key, self.token)

    def _stop_renewing(self, reason: str) -> None:
        self.renewing = False
        logger.warning(
            "celery_guard stops renewing key=%s token=%s (%s); the lease expires in %.1fs",
            self.key,
            self.token,
            reason,
            max(0.0, self.valid_until - self._clock()),
        )


class Heartbeat:
    """Renews the leases of the executions running in this process every ``interval`` seconds."""

    def __init__(
        self,
        backend: Renewer,
        *,
        interval: float,
        clock: Clock = time.monotonic,
    ) -> None:
        self.backend = backend
        self.interval = interval
        self._clock = clock
        self._leases: dict[int, Lease] = {}
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        #: forks.current of the process whose renewal thread runs (None: none runs)
        self._thread_generation: int | None = None

    def hold(self, lease: Lease) -> None:
        """Start renewing ``lease`` (starts this process's thread on first use)."""
        with self._lock:
            self._leases[id(lease)] = lease
            self._ensure_thread()

    def drop(self, lease: Lease) -> None:
        """Stop renewing ``lease`` (the execution finished, one way or another)."""
        with self._lock:
            self._leases.pop(id(lease), None)

    def held(self) -> list[Lease]:
        with self._lock:
            return list(self._leases.values())

    def beat(self) -> None:
        """One renewal round: renew what is due, fence what was lost."""
        started = self._clock()
        held = self.held()
        signals.heartbeat_round.send(
            None,
            oldest_lease_age=max((started - lease.acquired_at for lease in held), default=0.0),
            oldest_progress_age=max((started - lease.last_progress for lease in held), default=0.0),
        )
        due = [lease for lease in held if lease.should_renew(started)]
        if not due:
            return
        ttl = max(lease.ttl for lease in due)
        try:
            renewed = self.backend.renew_leases(
                [(lease.key, lease.handle) for lease in due],
                ttl,
                {lease.key: lease.status_json(started) for lease in due},
            )
        except StoreError as exc:
            still_held = {id(lease) for lease in self.held()}
            for lease in due:
                if id(lease) in still_held and self._clock() > lease.valid_until:
                    lease.fence(f"store unreachable past the lease ({exc})", "store_unreachable")
            logger.warning("celery_guard lease renewal failed for %d keys: %s", len(due), exc)
            signals.lease_renewal_failed.send(None, reason="store_error")
            return
        still_held = {id(lease) for lease in self.held()}
        for lease in due:
            if lease.key in renewed:
                lease.valid_until = started + lease.ttl
                signals.lease_renewed.send(None, gap=started - lease.renewed_at)
                lease.renewed_at = started
            elif id(lease) in still_held:
                # A lease dropped during the round (its body completed or released the key)
                # is not "taken over": its row simply no longer needs renewing.
                lease.fence("taken over: the token no longer owns the key", "taken_over")
                signals.lease_renewal_failed.send(None, reason="lost")

    def _ensure_thread(self) -> None:
        # The thread clears its generation as it ends: checked here per delivery instead of
        # Thread.is_alive() (a lock probe in Python). A forked child has a new generation and
        # no thread, so it starts its own.
        generation = forks.current
        if self._thread_generation == generation:
            return
        thread = threading.Thread(
            target=self._run, args=(generation,), name="celery_guard-heartbeat", daemon=True
        )
        thread.start()
        self._thread_generation = generation

    def stop(self) -> None:
        """End this process's heartbeat thread (process shutdown)."""
        self._stopped.set()

    def _run(self, generation: int) -> None:
        # Daemon thread: it ends with the process; a killed process's leases simply expire.
        try:
            while not self._stopped.wait(self.interval):
                try:
                    self.beat()
                except Exception:  # keep renewing the others whatever one round hit
                    logger.exception("celery_guard heartbeat round failed")
        finally:
            if self._thread_generation == generation:
                self._thread_generation = None
