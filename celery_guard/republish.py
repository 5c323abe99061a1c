"""Publishing a stored task message again (the reaper's recovery, a dead letter's replay)."""

from __future__ import annotations

from typing import Any

from celery_guard.outbox import untracked


def republish(app: Any, message: dict[str, Any]) -> None:
    """Send the task of a stored message again: same name, arguments, headers, id and routing.

    The stored ``workflow`` (link, link_error, chain, chord, group and parent ids) goes along,
    so a recovered or replayed task still hands its result on to the rest of its canvas.
    """
    options: dict[str, Any] = {"headers": message.get("headers") or {}}
    options.update(message.get("workflow") or {})
    exchange, routing_key = message.get("exchange"), message.get("routing_key")
    if not exchange and routing_key:
        # Sent to the default exchange: the routing key is the queue (as Celery's retry does).
        options["queue"] = routing_key
    elif exchange:
        options["exchange"] = exchange
        options["routing_key"] = routing_key
    if message.get("priority") is not None:
        options["priority"] = message["priority"]
    if message.get("expires"):
        options["expires"] = message["expires"]
    # The store knows this key already (its row, or a tracked publish): never record it again.
    with untracked():
        app.send_task(
            message["task"],
            args=message.get("args") or [],
            kwargs=message.get("kwargs") or {},
            task_id=message.get("id"),
            **options,
        )
