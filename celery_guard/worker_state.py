"""Worker states (docs/concepts.md#self-healing): READY, PROCESSING, DRAINING, FENCED, STOPPED.

Each process keeps its own: a prefork child is PROCESSING while a guarded body runs in it and
FENCED while one of its bodies has lost its lease; the main process goes READY, DRAINING on warm
shutdown, then STOPPED. Every transition is logged with what caused it: the per-task
READY <-> PROCESSING at DEBUG, the others at INFO.
"""

from __future__ import annotations

import enum
import logging
import threading

from celery_guard import signals

logger = logging.getLogger("celery_guard.worker")


class WorkerState(str, enum.Enum):
    READY = "READY"
    PROCESSING = "PROCESSING"
    DRAINING = "DRAINING"
    FENCED = "FENCED"
    STOPPED = "STOPPED"


#: The two states every delivery moves between (a tuple: membership by identity first, where
#: a set would call the str-enum's Python ``__hash__`` twice per transition).
_ROUTINE = (WorkerState.READY, WorkerState.PROCESSING)
_READY, _PROCESSING = _ROUTINE


class StateTracker:
    """This process's state, with running/fenced execution counts behind PROCESSING/FENCED."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.state = WorkerState.READY
        self._running = 0
        self._fenced: set[tuple[str, int]] = set()
        self._lifecycle: WorkerState | None = None  # DRAINING or STOPPED, when set
        self._fenced_told = 0
        #: No lifecycle state and nothing fenced: a delivery's start and end can then only
        #: move between READY and PROCESSING (kept by _settle, which every other change runs).
        self._plain = True

    def counts(self) -> tuple[int, int]:
        """Executions running and fenced in this process."""
        with self._lock:
            return self._running, len(self._fenced)

    @property
    def lifecycle(self) -> WorkerState | None:
        """DRAINING or STOPPED once set; ``None`` while executions decide the state."""
        return self._lifecycle

    def execution_started(self, key: str, token: int) -> None:
        changed = signals.executions_changed
        with self._lock:
            self._running += 1
            if self._plain and not (changed.recorders or changed.receivers):
                # _settle's decision for the common case, inline: it ran twice per delivery.
                old = self.state
                if old is not _PROCESSING:
                    self.state = _PROCESSING
                    if logger.isEnabledFor(logging.DEBUG):
                        _log_routine(old, _PROCESSING, key, token)
                return
            self._settle(key, token)

    def execution_fenced(self, key: str, token: int) -> None:
        with self._lock:
            self._fenced.add((key, token))
            self._settle(key, token)

    def execution_ended(self, key: str, token: int, fenced: bool) -> None:
        changed = signals.executions_changed
        with self._lock:
            self._running = max(0, self._running - 1)
            if self._plain and not (changed.recorders or changed.receivers):
                old = self.state
                new = _PROCESSING if self._running else _READY
                if old is not new:
                    self.state = new
                    if logger.isEnabledFor(logging.DEBUG):
                        _log_routine(old, new, key, token)
                return
            # Whatever the heartbeat thread decided meanwhile, this execution is over.
            self._fenced.discard((key, token))
            self._settle(key, token)

    def set_lifecycle(self, state: WorkerState, reason: str) -> None:
        with self._lock:
            self._lifecycle = state
            self._settle(reason=reason)

    def set_lifecycle_ready(self) -> None:
        """The worker started: per-execution states decide from now on."""
        with self._lock:
            self._lifecycle = None
            self._settle(reason="worker started")

    def _settle(
        self, key: str | None = None, token: int | None = None, reason: str | None = None
    ) -> None:
        # Under the lock, so receivers see the changes in the order they happened.
        fenced = len(self._fenced)
        changed = signals.executions_changed
        if changed.recorders or changed.receivers:  # none of celery_guard's: twice per delivery
            changed.send(None, running=self._running, fenced=fenced)
        if fenced != self._fenced_told:
            # Rare (a lease lost while its body runs), unlike the two changes of every
            # delivery above: what the worker's main process reads from its children.
            self._fenced_told = fenced
            signals.executions_fenced.send(None, fenced=fenced)
        self._plain = self._lifecycle is None and not fenced
        old = self.state
        new = combine_state(self._lifecycle, self._running, fenced)
        if new is old:
            return
        self.state = new
        # READY <-> PROCESSING happens twice per task: at INFO it would double a worker's
        # log volume (Celery already logs each task received and done). The
        # celery_guard_worker_state gauge shows it; the rarer transitions stay at INFO.
        level = logging.DEBUG if old in _ROUTINE and new in _ROUTINE else logging.INFO
        if logger.isEnabledFor(level):
            details = f"reason={reason}" if reason is not None else f"key={key} token={token}"
            logger.log(
                level, "celery_guard worker state %s -> %s %s", old.value, new.value, details
            )


def _log_routine(old: WorkerState, new: WorkerState, key: str, token: int) -> None:
    # As _settle logs it: READY <-> PROCESSING at DEBUG.
    logger.debug(
        "celery_guard worker state %s -> %s key=%s token=%s", old.value, new.value, key, token
    )


def combine_state(lifecycle: WorkerState | None, running: int, fenced: int) -> WorkerState:
    """A worker's state from its lifecycle and its executions (a fenced one outranks running)."""
    if lifecycle is not None:
        return lifecycle
    if fenced:
        return WorkerState.FENCED
    if running:
        return WorkerState.PROCESSING
    return WorkerState.READY
