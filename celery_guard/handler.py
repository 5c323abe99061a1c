"""The claim → run → complete state machine of one delivery, free of Celery.

:class:`GuardedTask` turns a message into a :class:`Delivery` and acts on what this module
answers; the store does the SQL. Nothing here knows about brokers: tests/unit/test_handler.py
runs every branch against an in-memory store built from the property tests' reference model.
"""

from __future__ import annotations

import logging
import random
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from celery_guard import serialization, signals
from celery_guard.errors import (
    DeadLettered,
    Fenced,
    GuardError,
    IdempotencyConflict,
    ResultNotSerializable,
    ResultTooLarge,
    StoreError,
    TransactionMisuse,
)
from celery_guard.execution import AtomicFactory, Execution
from celery_guard.keys import KeySource
from celery_guard.lease.backends import LeaseBackend
from celery_guard.lease.heartbeat import Heartbeat, Lease
from celery_guard.lease.liveness import ProcessLiveness
from celery_guard.policy import Decision, ErrorClass, ErrorPolicy, decide
from celery_guard.store.base import ClaimOutcome, ClaimRequest, DeadLetter, KeyStore
from celery_guard.store.schema import KeyState
from celery_guard.worker_state import StateTracker

logger = logging.getLogger("celery_guard")

COMPLETED_STATE = KeyState.COMPLETED.value

#: Longest error text kept on a released key.
MAX_ERROR_TEXT = 2000


@dataclass(frozen=True, kw_only=True)
class TaskTerms:
    """What every delivery of one task shares: built once per task and configuration
    (``GuardedTask``), as Celery's tracer reads a task's options once when it is built."""

    task_name: str
    #: Seconds a COMPLETED key keeps deduplicating (``None``: until pruned).
    retention: float | None
    #: Progress mode: seconds without ``self.guard.progress()`` before renewal stops.
    progress_timeout: float | None = None
    #: Classifies the task's errors (``GuardedTask.classify_error``).
    classify: Callable[[BaseException], ErrorClass] = ErrorPolicy().classify
    #: Executions a key may have before it is dead-lettered (``guard_max_attempts``, or the
    #: task's ``max_attempts``).
    max_attempts: int = 5
    #: Exceptions Celery's own ``autoretry_for`` retries for this task: when one escapes the
    #: body, Celery's retries are spent, so it is dead-lettered rather than retried again.
    celery_retries_for: tuple[type[BaseException], ...] = ()
    #: Result to the store's JSON text and back (``GuardedTask`` prepares results as the
    #: app's result backend does: ``serialization.ResultCodec``).
    encode_result: Callable[[Any], str] = serialization.dumps
    decode_result: Callable[[str], Any] = serialization.loads


class Delivery(NamedTuple):
    """One delivery of a task message, as the handler needs it (a named tuple, as
    :class:`~celery_guard.store.base.ClaimRequest` is: one is built per delivery)."""

    terms: TaskTerms
    key: str
    key_source: KeySource
    fingerprint: str | None
    #: JSON text of what re-publishing the task needs, or ``None``.
    message: str | None
    owner: str
    #: How many times this message was already deferred (drives the deferral backoff).
    deferrals: int = 0
    #: The message's first delivery (no retry, no deferral, not marked redelivered by the
    #: broker): its key most likely has no row yet (``ClaimRequest.likely_new``).
    first_delivery: bool = True
    #: Seconds after which the lease stops being renewed (``None``: no deadline).
    hard_deadline: float | None = None
    #: The Celery task id (for dead letters).
    task_id: str | None = None
    #: Executions the key may have before this delivery dead-letters it: the task's limit,
    #: plus the retries its body asked Celery for (those are Celery's, bounded by max_retries).
    max_attempts: int = 5
    #: When the message became due: its publish time (``guard_published_at`` header, epoch
    #: seconds) or its ETA if later. ``None`` when unknown.
    due_at: float | None = None


class RetryLater(GuardError):
    """The body failed transiently: the task must be retried (same id and key) after ``delay``."""

    def __init__(self, delay: float, attempts: int) -> None:
        self.delay = delay
        self.attempts = attempts
        super().__init__(f"retry in {delay:.2f}s after attempt {attempts}")


class DeliveryDeferred(GuardError):
    """No body ran; the delivery must be re-published to be tried again in ``countdown`` seconds.

    Raised for a key in flight elsewhere and for a store that did not answer: neither may lose
    the message nor acknowledge it as done.
    """

    def __init__(self, reason: str, countdown: float) -> None:
        self.reason = reason
        self.countdown = countdown
        super().__init__(f"delivery deferred by {countdown:.2f}s: {reason}")


Body = Callable[[Execution], Any]


class DeadLetterWriter(Protocol):
    """Where the handler sends a key's dead letter (``celery_guard.deadletters``' sink): kept
    behind this protocol so the Celery-free core never loads the broker-facing parts."""

    def send(self, token: int, letter: DeadLetter) -> DeadLetter:
        """Mark the key DEAD and record ``letter`` (token-checked); return the stored letter."""
        ...


def _failed_task_id(delivery: Delivery, message: str | None) -> str | None:
    """The task id of the delivery that dead-lettered a key: it claimed last, so its message
    is the one stored with the key (and a task-id key is that id)."""
    if delivery.key_source is KeySource.TASK_ID:
        return delivery.key
    try:
        task_id = serialization.loads(message).get("id") if message else None
    except (TypeError, ValueError, AttributeError):
        return None
    return task_id if isinstance(task_id, str) else None


def oversize(text: str, limit: int | None) -> int | None:
    """The UTF-8 size of ``text`` if it is above ``limit`` bytes, else ``None``."""
    if limit is None or len(text) * 4 <= limit:  # UTF-8 takes at most 4 bytes a character
        return None
    size = len(text.encode("utf-8", "surrogatepass"))
    return size if size > limit else None


class GuardHandler:
    """Runs one delivery against the store: claim, run the body, complete or release."""

    def __init__(
        self,
        store: KeyStore,
        leases: LeaseBackend,
        heartbeat: Heartbeat,
        *,
        lease_ttl: float,
        dead_letters: DeadLetterWriter | None = None,
        backoff_base: float = 1.0,
        backoff_max: float = 60.0,
        control_flow: tuple[type[BaseException], ...] = (),
        states: StateTracker | None = None,
        liveness: ProcessLiveness | None = None,
        rng: random.Random | None = None,
        max_payload_bytes: int | None = None,
        atomic: AtomicFactory | None = None,
    ) -> None:
        #: What ``self.guard.atomic()`` opens (a framework integration's), or ``None``.
        self.atomic = atomic
        self.liveness = liveness
        #: Largest result (JSON bytes) a completion stores; ``None``: no bound.
        self.max_payload_bytes = max_payload_bytes
        self.dead_letters = dead_letters
        self.backoff_base = backoff_base
        self.backoff_max = backoff_max
        #: Exceptions that steer Celery (Retry, Ignore, Reject): the key is released, no policy.
        self.control_flow = control_flow
        self.store = store
        self.leases = leases
        self.heartbeat = heartbeat
        self.states = states or StateTracker()
        self.lease_ttl = lease_ttl
        self._random = rng or random.Random()

    def execute(self, task: Any, delivery: Delivery, body: Body) -> Any:
        """Run ``body`` at most once per key and return its result (or the stored one)."""
        try:
            acquisition = self.leases.acquire(delivery.key, self.lease_ttl)
        except StoreError as exc:
            self._emit(task, delivery.key, signals.STORE_UNAVAILABLE_DEFERRED)
            raise DeliveryDeferred(str(exc), self._store_backoff(delivery.deferrals)) from exc
        if not acquisition.acquired:
            self._emit(task, delivery.key, signals.IN_FLIGHT_DEFERRED)
            countdown = self._in_flight_backoff(acquisition.remaining, delivery.deferrals)
            raise DeliveryDeferred(f"key {delivery.key!r} is leased elsewhere", countdown)
        try:
            claim = self.store.claim(
                ClaimRequest(
                    key=delivery.key,
                    task_name=delivery.terms.task_name,
                    fingerprint=delivery.fingerprint,
                    check_fingerprint=delivery.key_source is not KeySource.TASK_ID,
                    owner=delivery.owner,
                    message=delivery.message,
                    lease_ttl=self.lease_ttl,
                    external_token=acquisition.handle,
                    owner_lock=(
                        self.liveness.lock_id(delivery.owner) if self.liveness is not None else None
                    ),
                    likely_new=delivery.first_delivery,
                )
            )
        except StoreError as exc:
            self._release_lease(delivery.key, acquisition.handle)
            self._emit(task, delivery.key, signals.STORE_UNAVAILABLE_DEFERRED)
            raise DeliveryDeferred(str(exc), self._store_backoff(delivery.deferrals)) from exc

        record = claim.record
        if claim.outcome is not ClaimOutcome.CLAIMED:
            self._release_lease(delivery.key, acquisition.handle)
        if claim.outcome is ClaimOutcome.DEAD:
            self._emit(task, delivery.key, signals.DEAD_LETTER_SKIPPED, record.fencing_token)
            raise DeadLettered(
                delivery.key,
                "dead-lettered earlier; replay it to run it again",
                failed_task_id=_failed_task_id(delivery, record.message),
            )
        if claim.outcome is ClaimOutcome.CONFLICT:
            self._emit(task, delivery.key, signals.PAYLOAD_CONFLICT)
            raise IdempotencyConflict(delivery.key, record.task_name, delivery.terms.task_name)
        if claim.outcome is ClaimOutcome.DUPLICATE:
            self._emit(task, delivery.key, signals.DUPLICATE_PREVENTED, record.fencing_token)
            return (
                delivery.terms.decode_result(record.result) if record.result is not None else None
            )
        if claim.outcome is ClaimOutcome.IN_FLIGHT:
            self._emit(task, delivery.key, signals.IN_FLIGHT_DEFERRED, record.fencing_token)
            countdown = self._in_flight_backoff(claim.lease_remaining, delivery.deferrals)
            raise DeliveryDeferred(
                f"key {delivery.key!r} is in flight on {record.owner}", countdown
            )

        if record.attempts > delivery.max_attempts:
            # Counting at claim catches what no error handler sees: a body that kills its own
            # process every time (segfault, os._exit, the OOM killer).
            self._release_lease(delivery.key, acquisition.handle)
            reason = (
                f"attempt limit ({delivery.max_attempts}) reached at claim: the earlier "
                "executions ended without reporting (a poison pill that kills its process?)"
            )
            self._dead_letter(
                task,
                delivery,
                record.fencing_token,
                attempts=record.attempts - 1,
                error_class="poison",
                error_type="AttemptLimitReached",
                error=record.last_error or "the worker process died during every attempt",
                traceback_text=None,
                reason=reason,
            )
            raise DeadLettered(delivery.key, reason)

        lease = Lease(
            delivery.key,
            record.fencing_token,
            handle=acquisition.handle,
            ttl=self.lease_ttl,
            hard_deadline=delivery.hard_deadline,
            progress_timeout=delivery.terms.progress_timeout,
            on_fence=self._lease_lost,
        )
        execution = Execution(
            self.store,
            key=delivery.key,
            fencing_token=record.fencing_token,
            attempts=record.attempts,
            claim_reason=record.claim_reason,
            lease=lease,
            atomic=self.atomic,
        )
        logger.debug(
            "celery_guard claimed key=%s token=%s attempts=%s reason=%s",
            delivery.key,
            record.fencing_token,
            record.attempts,
            record.claim_reason,
        )
        signals.claimed.send(
            sender=task,
            key=delivery.key,
            reason=record.claim_reason,
            fencing_token=record.fencing_token,
            attempts=record.attempts,
            queue_lag=None if delivery.due_at is None else max(0.0, time.time() - delivery.due_at),
        )
        lease.description = {
            "task": delivery.terms.task_name,
            "task_id": delivery.task_id,
            "owner": delivery.owner,
            "attempts": record.attempts,
        }
        self.states.execution_started(lease.key, lease.token)
        self.heartbeat.hold(lease)
        try:
            return self._run(task, delivery, execution, body)
        finally:
            self.heartbeat.drop(lease)
            if lease.fenced_reason is None and acquisition.handle is not None:
                self._release_lease(lease.key, acquisition.handle)
            self.states.execution_ended(
                lease.key, lease.token, fenced=lease.fenced_reason is not None
            )

    def _run(self, task: Any, delivery: Delivery, execution: Execution, body: Body) -> Any:
        try:
            value = body(execution)
        except BaseException as exc:
            execution.abort()
            misuse = execution.misuse
            if (
                misuse is not None
                and isinstance(exc, Exception)
                and not isinstance(exc, (TransactionMisuse, *self.control_flow))
            ):
                # The body went on after its commit, rollback or close was refused, and what
                # failed next (a closed connection, an inactive transaction) follows from that:
                # report the cause, so the dead letter says what to fix.
                self._fail(task, delivery, execution, misuse)
                raise misuse from exc
            self._fail(task, delivery, execution, exc)
            lost = isinstance(exc, Fenced) or (
                execution.fenced
                and isinstance(exc, Exception)
                and not isinstance(exc, self.control_flow)
            )
            if lost:
                # Whatever this body did no longer counts: the newer owner's outcome does.
                return self._winner_result(delivery)
            raise
        try:
            result = delivery.terms.encode_result(value)
        except (TypeError, ValueError) as exc:
            execution.abort()
            error = ResultNotSerializable(
                f"{delivery.terms.task_name} returned {type(value).__name__}, which cannot be "
                f"stored as JSON; nothing was committed ({exc})"
            )
            self._fail(task, delivery, execution, error)
            raise error from exc
        size = oversize(result, self.max_payload_bytes)
        if size is not None:
            execution.abort()
            error = ResultTooLarge(
                f"{delivery.terms.task_name} returned {size} bytes of JSON, more than "
                f"guard_max_payload_bytes ({self.max_payload_bytes}); nothing was committed"
            )
            self._fail(task, delivery, execution, error)
            raise error
        try:
            execution.finish(result, delivery.terms.retention)
        except Fenced:
            self._emit(
                task,
                delivery.key,
                signals.FENCED,
                execution.fencing_token,
                seconds=execution.elapsed(),
            )
            logger.warning(
                "celery_guard completion refused (fenced) key=%s token=%s: rolled back",
                delivery.key,
                execution.fencing_token,
            )
            return self._winner_result(delivery)
        except StoreError as exc:
            # The commit may or may not have landed; either way the next delivery finds out from
            # the store (COMPLETED, or our lease expiring), so deferring loses nothing.
            raise DeliveryDeferred(str(exc), self._store_backoff(delivery.deferrals)) from exc
        except Exception as exc:
            # Anything else (TransactionMisuse, an SQLAlchemy error about the body's use of its
            # connection) is a failure of this execution like one raised by the body: classified,
            # and the key released for a retry or dead-lettered with the real error. Left
            # RUNNING, the key would be re-run by the reaper as an orphan until the attempt
            # limit called it a poison pill.
            self._fail(task, delivery, execution, exc)
            raise
        self._emit(
            task,
            delivery.key,
            signals.COMPLETED,
            execution.fencing_token,
            execution.attempts,
            seconds=execution.elapsed(),
        )
        return value

    def _fail(
        self, task: Any, delivery: Delivery, execution: Execution, exc: BaseException
    ) -> None:
        """Apply the failure policy to an exception that escaped the body.

        Returns when the caller should re-raise ``exc`` (released or dead-lettered); raises
        :class:`RetryLater` or :class:`DeliveryDeferred` when the delivery must come back.
        """
        if (
            isinstance(exc, self.control_flow)
            or not isinstance(exc, Exception)
            or isinstance(exc, Fenced)
            or execution.fenced
        ):
            self._release(task, execution, exc)
            return
        assert execution.key is not None and execution.fencing_token is not None
        if isinstance(exc, StoreError):
            # Coordination: not the task's fault, and no attempt is charged to the policy.
            self._release(task, execution, exc)
            raise DeliveryDeferred(str(exc), self._store_backoff(delivery.deferrals)) from exc
        error_class = delivery.terms.classify(exc)
        if delivery.terms.celery_retries_for and isinstance(exc, delivery.terms.celery_retries_for):
            decision = Decision(
                "dead_letter", error_class, reason="Celery's own retries (autoretry_for) are spent"
            )
        else:
            decision = decide(
                error_class,
                attempts=execution.attempts,
                max_attempts=delivery.max_attempts,
                base=self.backoff_base,
                cap=self.backoff_max,
                rng=self._random,
            )
        if decision.action == "retry" and decision.delay is not None:
            # One delivery, one outcome: "retried" says the key was released for the retry.
            self._release(task, execution, exc, outcome=None)
            self._emit(
                task,
                execution.key,
                signals.RETRIED,
                execution.fencing_token,
                execution.attempts,
                delay=decision.delay,
                error_class=error_class.value,
                seconds=execution.elapsed(),
            )
            raise RetryLater(decision.delay, execution.attempts) from exc
        self._dead_letter(
            task,
            delivery,
            execution.fencing_token,
            attempts=execution.attempts,
            error_class=error_class.value,
            error_type=type(exc).__name__,
            error=str(exc)[:MAX_ERROR_TEXT] or type(exc).__name__,
            traceback_text="".join(traceback.format_exception(exc))[:20_000],
            reason=decision.reason,
            seconds=execution.elapsed(),
        )

    def _dead_letter(
        self,
        task: Any,
        delivery: Delivery,
        token: int,
        *,
        attempts: int,
        error_class: str,
        error_type: str,
        error: str,
        traceback_text: str | None,
        reason: str,
        seconds: float | None = None,
    ) -> None:
        letter = DeadLetter(
            key=delivery.key,
            task_name=delivery.terms.task_name,
            task_id=delivery.task_id,
            message=delivery.message,
            error_class=error_class,
            error_type=error_type,
            error=error,
            traceback=traceback_text,
            reason=reason,
            attempts=attempts,
        )
        if self.dead_letters is None:
            self.store.dead_letter(token, letter)
        else:
            try:
                letter = self.dead_letters.send(token, letter)
            except (StoreError, Fenced) as exc:
                # Not recorded: the key stays RUNNING and its lease expires, so the delivery
                # comes back (reaper) and the policy runs again; nothing is lost.
                logger.error("celery_guard could not dead-letter key=%s: %s", delivery.key, exc)
                return
        logger.warning(
            "celery_guard dead-lettered key=%s id=%s class=%s attempts=%s: %s",
            delivery.key,
            letter.id,
            error_class,
            attempts,
            reason,
        )
        self._emit(
            task,
            delivery.key,
            signals.DEAD_LETTERED,
            token,
            attempts,
            error_class=error_class,
            reason=reason,
            **({} if seconds is None else {"seconds": seconds}),
        )

    def _lease_lost(self, lease: Lease) -> None:
        self.states.execution_fenced(lease.key, lease.token)
        signals.lease_lost.send(None, cause=lease.fenced_cause or "expired")

    def _release_lease(self, key: str, handle: int | None) -> None:
        """Best effort: a lease that is not released expires on its own."""
        if handle is None:
            return  # the row's lease (no backend holds one without a handle): the row ends it
        try:
            self.leases.release(key, handle)
        except StoreError as exc:
            logger.warning("celery_guard could not release the lease of key=%s: %s", key, exc)

    def _winner_result(self, delivery: Delivery) -> Any:
        """After a lost lease: the newer owner's result if it has completed; else come back.

        Never a failure: this delivery's task id may be the very one the newer owner is running
        (a re-published message shares it), and a FAILURE stored now would stand until the
        newer owner's SUCCESS replaced it. A deferred copy answers with the stored result once
        the key is COMPLETED (or takes it over if the newer owner dies too).
        """
        try:
            record = self.store.get(delivery.key)
        except StoreError:
            record = None
        if record is not None and record.state == COMPLETED_STATE and record.result is not None:
            return delivery.terms.decode_result(record.result)
        raise DeliveryDeferred(
            f"key {delivery.key!r}: this execution was fenced, a newer owner runs it",
            self._in_flight_backoff(self.lease_ttl, delivery.deferrals),
        )

    def _release(
        self,
        task: Any,
        execution: Execution,
        exc: BaseException,
        outcome: str | None = signals.RELEASED,
    ) -> None:
        assert execution.key is not None and execution.fencing_token is not None
        if isinstance(exc, Fenced) or execution.fenced:
            # Never release a lost lease: the key stays RUNNING until it expires, and the
            # reaper re-publishes it. A RELEASED key would wait for a delivery that may not come.
            self._emit(
                task,
                execution.key,
                signals.FENCED,
                execution.fencing_token,
                seconds=execution.elapsed(),
            )
            return
        error = f"{type(exc).__name__}: {exc}"[:MAX_ERROR_TEXT]
        try:
            self.store.release(execution.key, execution.fencing_token, error)
        except StoreError as store_exc:
            # The lease expires on its own; the next delivery takes the key over then.
            logger.warning(
                "celery_guard could not release key=%s token=%s: %s",
                execution.key,
                execution.fencing_token,
                store_exc,
            )
        if outcome is not None:
            self._emit(
                task,
                execution.key,
                outcome,
                execution.fencing_token,
                seconds=execution.elapsed(),
            )

    def _in_flight_backoff(self, lease_remaining: float, deferrals: int) -> float:
        # Check back soon for short tasks, never later than the holder's lease can last.
        ceiling = min(max(lease_remaining, 0.05), 0.25 * 2 ** min(deferrals, 16), self.lease_ttl)
        return float(ceiling * self._random.uniform(0.5, 1.0))

    def _store_backoff(self, deferrals: int) -> float:
        return float(min(30.0, 0.5 * 2 ** min(deferrals, 16)) * self._random.uniform(0.5, 1.0))

    @staticmethod
    def _emit(
        task: Any,
        key: str,
        outcome: str,
        fencing_token: int | None = None,
        attempts: int | None = None,
        **extra: Any,
    ) -> None:
        signals.outcome.send(
            sender=task,
            key=key,
            outcome=outcome,
            fencing_token=fencing_token,
            attempts=attempts,
            **extra,
        )
