"""Where an app's celery_guard runtime lives: an attribute on the Celery app.

A leaf: it imports nothing above it, so the parts the runtime holds (the task class, the
bootsteps) can find their app's runtime without importing :mod:`celery_guard.install`, which
imports them. ``install(app)`` builds the runtime and stores it here.
"""

from __future__ import annotations

from typing import Any

from celery_guard.errors import ConfigurationError

#: The app attribute holding the runtime.
RUNTIME_ATTRIBUTE = "_celery_guard_runtime"


def find_runtime(app: Any) -> Any | None:
    """The runtime stored on ``app``, or ``None`` when ``install(app)`` was not called."""
    return getattr(app, RUNTIME_ATTRIBUTE, None)


def get_runtime(app: Any) -> Any:
    """The runtime stored on ``app``; a clear error when ``install(app)`` was not called."""
    runtime = find_runtime(app)
    if runtime is None:
        raise ConfigurationError(
            f"celery_guard.install(app) was not called for the Celery app "
            f"{getattr(app, 'main', app)!r}; guarded tasks need it"
        )
    return runtime


def set_runtime(app: Any, runtime: Any) -> None:
    """Store ``runtime`` on ``app`` (``install(app)``, once per app)."""
    setattr(app, RUNTIME_ATTRIBUTE, runtime)
