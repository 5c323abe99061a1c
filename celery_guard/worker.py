"""The worker bootstep: runs the reaper in the worker's main process and tracks its lifecycle."""

from __future__ import annotations

import logging
from typing import Any

from celery import bootsteps

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

    def create(self, parent: Any) -> GuardStep:
        return self

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
        from celery_guard.install import get_runtime

        runtime = get_runtime(parent.app)
        # Celery's warm shutdown has stopped consuming and waits for the running bodies, whose
        # heartbeats keep their leases alive meanwhile; a cold shutdown leaves them to expire.
        runtime.states.set_lifecycle(WorkerState.DRAINING, reason="shutdown")
        if self.reaper is not None:
            self.reaper.stop()
            self.reaper = None

    def shutdown(self, parent: Any) -> None:
        from celery_guard.install import get_runtime

        get_runtime(parent.app).states.set_lifecycle(WorkerState.STOPPED, reason="shutdown")
