"""The one error tree of celery_guard.

Everything celery_guard raises on purpose derives from :class:`GuardError`, so callers can catch
the whole family; store failures keep their driver exception as ``__cause__``.
"""

from __future__ import annotations


class GuardError(Exception):
    """Root of every error celery_guard raises on purpose."""


class TransientError(Exception):
    """Base for your own errors that are worth retrying (a timeout, a busy dependency)."""


class PermanentError(Exception):
    """Base for your own errors that will fail again (validation, not found, a business rule).

    A guarded task raising one is dead-lettered at once, without retries.
    """


class ConfigurationError(GuardError, ValueError):
    """A ``guard_*`` setting or a per-task guard option has a wrong value; the message names it."""


class InvalidIdempotencyKey(GuardError, ValueError):
    """An idempotency key is not a non-empty string, or is longer than the store's column."""


class UnserializableArguments(GuardError, TypeError):
    """Task arguments cannot be fingerprinted (they are not JSON-serializable)."""


class ResultNotSerializable(GuardError, TypeError):
    """A guarded task returned a value that cannot be stored as JSON; nothing was committed."""


class ResultTooLarge(ResultNotSerializable):
    """A guarded task's result is larger than ``guard_max_payload_bytes`` as JSON; nothing was
    committed, and the delivery is dead-lettered (a permanent error)."""


class IdempotencyConflict(GuardError):
    """The same idempotency key arrived with a different payload (task or arguments).

    This is never a silent skip: two different calls sharing one business key is a bug in the
    caller's key, and running either one would be wrong.
    """

    def __init__(self, key: str, stored_task: str, task: str) -> None:
        # args are the constructor's arguments: Celery's JSON result backend rebuilds an
        # exception as ``cls(*args)`` in the caller, so the caller gets this very class.
        super().__init__(key, stored_task, task)
        self.key = key
        self.stored_task = stored_task
        self.task = task

    def __str__(self) -> str:
        return (
            f"idempotency key {self.key!r} is already used by a call of {self.stored_task} with "
            f"a different payload; this call of {self.task} was not run"
        )


class StoreError(GuardError):
    """The store could not be used."""


class StoreUnavailable(StoreError):
    """The store did not answer within ``guard_store_timeout`` (or refused the connection).

    A coordination failure: the delivery is not acknowledged as done and is tried again later.
    """


class Fenced(GuardError):
    """This execution no longer owns its idempotency key: its fencing token was superseded.

    Its completion commit is refused and its own writes in ``self.guard.transaction()`` roll back.
    """

    def __init__(self, key: str, token: int) -> None:
        super().__init__(key, token)
        self.key = key
        self.token = token

    def __str__(self) -> str:
        return (
            f"execution of key {self.key!r} with fencing token {self.token} was fenced: another "
            "owner took the key over, nothing of this execution was committed"
        )


class TransactionMisuse(GuardError):
    """A task body tried to end the transaction of ``self.guard.transaction()`` itself.

    That transaction belongs to celery_guard: it commits once, with the key's COMPLETED marker,
    when the body returns. A body's ``commit()``, ``rollback()`` or ``close()`` on its
    connection (directly, or through an ORM ``Session`` that controls it) is refused with this
    error before it reaches the database, and nothing of the execution is committed. It is a
    programming error, so it is classified permanent: the key is dead-lettered at once, to be
    replayed once the task is fixed.
    """


class InFlightElsewhere(GuardError):
    """Another execution holds the key's live lease.

    A worker re-publishes such a delivery for later; only an eager call (``task.apply()``), which
    has no broker to come back through, sees this error.
    """

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key

    def __str__(self) -> str:
        return f"idempotency key {self.key!r} is being run by another execution right now"


class DeadLettered(GuardError):
    """The key is dead-lettered: this delivery did not run it. An operator's replay revives it.

    Raised for a delivery that finds its key DEAD, and for a poison pill stopped at claim.
    """

    def __init__(self, key: str, reason: str, *, failed_task_id: str | None = None) -> None:
        super().__init__(key, reason)
        self.key = key
        self.reason = reason
        #: For a delivery that found the key DEAD: the task id of the delivery whose failure
        #: dead-lettered it (Celery recorded that failure and ran its errbacks then).
        self.failed_task_id = failed_task_id

    def __str__(self) -> str:
        return f"idempotency key {self.key!r} is dead-lettered ({self.reason}); not run"
