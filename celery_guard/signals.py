"""Signals celery_guard sends, for metrics and logs to subscribe to (Celery's own dispatcher).

``outcome`` is sent once per guarded delivery with ``sender`` = the task, and keyword arguments
``key`` (str), ``outcome`` (one of :data:`OUTCOMES`), ``fencing_token`` (int or None) and
``attempts`` (int or None). Outcomes that end an execution whose body ran (completed, fenced,
released, retried, dead_lettered) also carry ``seconds``: from the claim to that end.

``claimed`` is sent when a delivery owns its key and its body is about to run, with ``key``,
``reason`` (``NEW``, ``RETRY`` after a release, ``TAKEOVER`` of an expired lease),
``fencing_token``, ``attempts`` and ``queue_lag`` (seconds from publish, or the message's ETA
if later, to the claim; ``None`` when the message carried no publish time).

The others report the parts' own events; :mod:`celery_guard.metrics` records from all of
them but ``store_call`` (``install()`` adds its recorders: :meth:`GuardSignal.record_with`),
and nothing calls the metrics but these signals.
Each is sent with ``sender=None`` in the process where the event happened:

``store_call``
    Store (or Redis lease) calls made for deliveries, ``calls`` (int) of them with one result:
    ``ok`` (bool, the store answered) and ``timed_out`` (bool). Sent by the circuit's counter
    (:mod:`celery_guard.circuit`) in batches, not per call: at the end of each delivery, and
    at least every second while calls are made; only while it has a receiver. The metrics
    read the same counts from the circuit's shared block at scrape time instead.
``executions_changed``
    This process's guarded executions changed: ``running`` and ``fenced`` (ints). Sent by
    :class:`celery_guard.worker_state.StateTracker`, twice per delivery that runs a body.
    Nothing of celery_guard's subscribes to it: a delivery pays for a receiver twice.
``executions_fenced``
    The number of this process's running executions whose lease was lost changed:
    ``fenced`` (int). Sent by the same tracker, only on that change.
``lease_renewed``
    A lease was renewed ``gap`` seconds after its previous renewal (or its claim).
``lease_renewal_failed``
    A renewal round failed: ``reason`` is ``store_error`` (once per round) or ``lost`` (once
    per lease the store no longer grants).
``heartbeat_round``
    After each renewal round: ``oldest_lease_age`` and ``oldest_progress_age`` (seconds).
``lease_lost``
    A running execution lost its lease: ``cause`` is ``taken_over``, ``expired`` or
    ``store_unreachable``.
``reaper_pass``
    One reaper pass ended: ``recovered_for`` (list of seconds each re-published orphan had
    been orphaned), ``dead_owners``, ``unclaimed_republished`` and ``unclaimed_abandoned``
    (ints). Sent in the worker's main process.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Final

from celery.utils.dispatch import Signal

logger = logging.getLogger("celery_guard.signals")

#: A recorder: called as a receiver is (``sender=`` and the signal's keyword arguments).
Recorder = Callable[..., object]


class GuardSignal(Signal):  # type: ignore[misc]  # celery ships no type information
    """Celery's :class:`~celery.utils.dispatch.Signal`, with celery_guard's own recorders
    called directly.

    ``connect`` and ``send`` behave as Celery's: a user's receivers get what they always got.
    The recorders of :mod:`celery_guard.metrics` are not receivers but a plain tuple, called
    before them: Celery's dispatch takes a lock, builds the list of live receivers (weak
    references resolved) and collects every response on each send (its ``use_caching`` is off
    by default), which for the two signals of every delivery cost a guarded task about as much
    as the metrics' own recording (bench/profile_worker.py). With no receiver connected,
    Celery's ``send`` returns at its first check. A recorder that raises is logged and the
    others still run, as Celery does for receivers.
    """

    def __init__(self, name: str) -> None:
        super().__init__(name=name)
        self.recorders: tuple[Recorder, ...] = ()

    def record_with(self, recorder: Recorder, enabled: bool = True) -> None:
        """Add ``recorder`` (once), or with ``enabled=False`` remove it (idempotent)."""
        others = tuple(r for r in self.recorders if r is not recorder)
        self.recorders = (*others, recorder) if enabled else others

    @property
    def listened(self) -> bool:
        """Whether a send reaches anything: a recorder or a receiver."""
        return bool(self.recorders or self.receivers)

    def send(self, sender: Any, **named: Any) -> list[tuple[Any, Any]]:
        for recorder in self.recorders:
            try:
                recorder(sender=sender, **named)
            except Exception:
                logger.exception("celery_guard recorder %r of %s raised", recorder, self.name)
        if not self.receivers:
            return []
        return super().send(sender, **named)  # type: ignore[no-any-return]


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

outcome = GuardSignal(name="celery_guard.outcome")
claimed = GuardSignal(name="celery_guard.claimed")
store_call = GuardSignal(name="celery_guard.store_call")
executions_changed = GuardSignal(name="celery_guard.executions_changed")
executions_fenced = GuardSignal(name="celery_guard.executions_fenced")
lease_renewed = GuardSignal(name="celery_guard.lease_renewed")
lease_renewal_failed = GuardSignal(name="celery_guard.lease_renewal_failed")
heartbeat_round = GuardSignal(name="celery_guard.heartbeat_round")
lease_lost = GuardSignal(name="celery_guard.lease_lost")
reaper_pass = GuardSignal(name="celery_guard.reaper_pass")
