"""The worker bootstep: runs the reaper in the worker's main process and tracks its lifecycle."""

from __future__ import annotations

import logging
import time
from typing import Any

from celery import bootsteps

from celery_guard.errors import StoreError
from celery_guard.reaper import Reaper
from celery_guard.worker_state import WorkerState

logger = logging.getLogger("celery_guard.worker")


class GuardStep(bootsteps.StartStopStep):  # type: ignore[misc]  # celery ships no types
    """Started after the pool (so no thread of ours is ever forked into a child)."""

    label = "celery_guard"
    requires = ("celery.worker.components:Pool",)

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.reaper: Reaper | None = None

    def create(self, parent: Any) -> None:
        # No service object: Celery would call its stop()/terminate() without the parent.
        return None

    def start(self, parent: Any) -> None:
        from celery_guard.install import get_runtime  # install imports this module

        runtime = get_runtime(parent.app)
        runtime.states.set_lifecycle_ready()
        if runtime.config.reaper_enabled:
            self.reaper = Reaper(
                parent.app,
                runtime.store,
                runtime.leases,
                interval=runtime.config.reaper_interval,
                lease_ttl=runtime.config.lease_ttl,
                holder=parent.hostname,
            )
            self.reaper.start()
            runtime.reaper = self.reaper

    def stop(self, parent: Any) -> None:
        """Warm shutdown: drain, then hand back what did not finish in time."""
        from celery_guard.install import get_runtime

        runtime = get_runtime(parent.app)
        runtime.states.set_lifecycle(WorkerState.DRAINING, reason="warm shutdown")
        self._stop_reaper()
        drain(runtime, parent.hostname)

    def terminate(self, parent: Any) -> None:
        """Cold shutdown: no drain; running keys' leases expire and the reaper recovers them."""
        from celery_guard.install import get_runtime

        get_runtime(parent.app).states.set_lifecycle(WorkerState.DRAINING, reason="cold shutdown")
        self._stop_reaper()

    def _stop_reaper(self) -> None:
        if self.reaper is not None:
            self.reaper.stop()
            self.reaper = None

    def shutdown(self, parent: Any) -> None:
        from celery_guard.install import get_runtime

        get_runtime(parent.app).states.set_lifecycle(WorkerState.STOPPED, reason="shutdown")


def drain(runtime: Any, hostname: str) -> list[str]:
    """Wait up to ``guard_drain_timeout`` for this worker's running bodies, then revoke the rest.

    Celery has stopped consuming and waits for the pool; the bodies commit to the store as they
    finish, so the store is what is watched (the main process's event loop no longer runs).
    Keys still running at the deadline are revoked: their token moves on and their lease ends,
    so the reaper re-publishes them to a live worker now, and the late commits here are
    refused. Returns the revoked keys.
    """
    owner_prefix = f"{hostname}/"
    deadline = time.monotonic() + runtime.config.drain_timeout
    try:
        while runtime.store.count_running_owned(owner_prefix) and time.monotonic() < deadline:
            time.sleep(min(0.25, max(0.0, deadline - time.monotonic())))
        if not runtime.store.count_running_owned(owner_prefix):
            return []
        revoked = runtime.store.revoke_owned(owner_prefix)
        for key, old_token in revoked:
            if not runtime.leases.in_store:
                runtime.leases.release(key, old_token)
    except StoreError as exc:
        logger.warning("celery_guard drain could not use the store: %s", exc)
        return []
    keys = [key for key, _ in revoked]
    logger.warning(
        "celery_guard drain timeout (%ss): revoked %d running key(s) for other workers: %s",
        runtime.config.drain_timeout,
        len(keys),
        ", ".join(keys[:20]),
    )
    return keys
