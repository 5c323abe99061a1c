"""Signals celery_guard sends, for metrics and logs to subscribe to (Celery's own dispatcher).

``outcome`` is sent once per guarded delivery with ``sender`` = the task, and keyword arguments
``key`` (str), ``outcome`` (one of :data:`OUTCOMES`), ``fencing_token`` (int or None) and
``attempts`` (int or None). Outcomes that end an execution whose body ran (completed, fenced,
released, retried, dead_lettered) also carry ``seconds``: from the claim to that end.

``claimed`` is sent when a delivery owns its key and its body is about to run, with ``key``,
``reason`` (``NEW``, ``RETRY`` after a release, ``TAKEOVER`` of an expired lease),
``fencing_token``, ``attempts`` and ``queue_lag`` (seconds from publish, or the message's ETA
if later, to the claim; ``None`` when the message carried no publish time).
"""

from __future__ import annotations

from typing import Final

from celery.utils.dispatch import Signal

#: The delivery's body ran and its COMPLETED marker committed.
COMPLETED: Final = "completed"
#: The key was COMPLETED already: no body ran, the stored result was returned.
DUPLICATE_PREVENTED: Final = "duplicate_prevented"
#: Another execution held a live lease: no body ran, the delivery was re-published for later.
IN_FLIGHT_DEFERRED: Final = "in_flight_deferred"
#: The store could not be reached: no body ran, the delivery was re-published for later.
STORE_UNAVAILABLE_DEFERRED: Final = "store_unavailable_deferred"
#: Same key, different payload: refused with IdempotencyConflict.
PAYLOAD_CONFLICT: Final = "payload_conflict"
#: The body ran but its completion was refused: another owner holds a newer fencing token.
FENCED: Final = "fenced"
#: The body raised (Celery's retry() or replace(), Ignore, Reject, a store error) and the key
#: was released for the next delivery; not sent for the failures below (one outcome each).
RELEASED: Final = "released"
#: The body failed transiently; the key was released and the task is retried after a
#: full-jitter delay. Extra keyword arguments: ``delay`` (seconds) and ``error_class``.
RETRIED: Final = "retried"
#: Dead-lettered (permanent error, attempts exhausted, poison pill). Extra: ``error_class``,
#: ``reason``.
DEAD_LETTERED: Final = "dead_lettered"
#: The key was dead-lettered earlier: this delivery did not run.
DEAD_LETTER_SKIPPED: Final = "dead_letter_skipped"
#: The store circuit breaker was open and stayed open for ``guard_circuit_hold`` seconds: no
#: body ran, the message went back to the broker unacknowledged.
CIRCUIT_OPEN_DEFERRED: Final = "circuit_open_deferred"

OUTCOMES: Final = (
    COMPLETED,
    DUPLICATE_PREVENTED,
    IN_FLIGHT_DEFERRED,
    STORE_UNAVAILABLE_DEFERRED,
    PAYLOAD_CONFLICT,
    FENCED,
    RELEASED,
    RETRIED,
    DEAD_LETTERED,
    DEAD_LETTER_SKIPPED,
    CIRCUIT_OPEN_DEFERRED,
)

outcome = Signal(name="celery_guard.outcome")
claimed = Signal(name="celery_guard.claimed")
