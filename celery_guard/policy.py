"""The failure policy: which errors are worth retrying, and when to retry them.

Small, pure pieces (tenacity's shape): :class:`ErrorPolicy` classifies an exception,
:func:`full_jitter` spaces retries, :func:`decide` turns both into a :class:`Decision`. Nothing
here touches Celery or the store.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from celery.exceptions import SoftTimeLimitExceeded

from celery_guard.errors import (
    ConfigurationError,
    IdempotencyConflict,
    InvalidIdempotencyKey,
    PermanentError,
    ResultNotSerializable,
    TransactionMisuse,
    TransientError,
    UnserializableArguments,
)


class ErrorClass(str, enum.Enum):
    """What kind of failure an exception is (docs/failure-policy.md)."""

    #: Worth trying again later: timeouts, connection errors, 5xx, 429.
    TRANSIENT = "transient"
    #: Will fail again: validation, not found, business rules. Dead-lettered at once.
    PERMANENT = "permanent"
    #: The execution could not coordinate (store unreachable, lease lost): not the task's fault.
    COORDINATION = "coordination"


#: Built-in defaults; task options and ``guard_*`` keys come before these.
DEFAULT_TRANSIENT: tuple[type[BaseException], ...] = (
    TransientError,
    ConnectionError,
    TimeoutError,
    SoftTimeLimitExceeded,
)
#: Programming errors are here too: a retry runs the same code and fails the same way, while
#: five retries hide the bug and delay its dead letter. Dead-lettered at once, the delivery is
#: replayed once the fix is deployed. ``ModuleNotFoundError`` is an ``ImportError``,
#: ``UnboundLocalError`` a ``NameError``, ``IndentationError`` a ``SyntaxError``. A task (or the
#: app) that wants one of them retried lists it in ``transient_errors``: the layers come first.
DEFAULT_PERMANENT: tuple[type[BaseException], ...] = (
    PermanentError,
    ValueError,
    KeyError,
    TypeError,
    NameError,
    AttributeError,
    ImportError,
    SyntaxError,
    NotImplementedError,
    AssertionError,
    IdempotencyConflict,
    InvalidIdempotencyKey,
    UnserializableArguments,
    ResultNotSerializable,
    TransactionMisuse,
)


@dataclass(frozen=True)
class ErrorPolicy:
    """Classifies exceptions.

    Order: the declared layers (a task's own before the app's), in each the listed type nearest
    the exception's own type wins; then an HTTP status the error carries (5xx and 429
    transient, other 4xx permanent); then the built-in defaults; then ``default``.
    """

    #: (transient, permanent) exception classes, most specific layer first.
    layers: tuple[tuple[tuple[type[BaseException], ...], tuple[type[BaseException], ...]], ...] = ()
    default: ErrorClass = ErrorClass.TRANSIENT

    def classify(self, exc: BaseException) -> ErrorClass:
        for transient, permanent in self.layers:
            declared = _most_specific(exc, transient, permanent)
            if declared is not None:
                return declared
        status = http_status(exc)
        if status is not None and 400 <= status < 600:
            return ErrorClass.TRANSIENT if status >= 500 or status == 429 else ErrorClass.PERMANENT
        builtin = _most_specific(exc, DEFAULT_TRANSIENT, DEFAULT_PERMANENT)
        return builtin if builtin is not None else self.default

    def with_layer(
        self,
        transient: Iterable[type[BaseException]] = (),
        permanent: Iterable[type[BaseException]] = (),
    ) -> ErrorPolicy:
        """A policy that consults these classes before its own (a task's over the app's)."""
        layer = (tuple(transient), tuple(permanent))
        if not layer[0] and not layer[1]:
            return self
        return ErrorPolicy(layers=(layer, *self.layers), default=self.default)


def _most_specific(
    exc: BaseException,
    transient: tuple[type[BaseException], ...],
    permanent: tuple[type[BaseException], ...],
) -> ErrorClass | None:
    """The class whose listed type sits nearest ``exc``'s own type in its MRO."""
    mro = type(exc).__mro__
    best: tuple[int, ErrorClass] | None = None
    for classes, verdict in ((transient, ErrorClass.TRANSIENT), (permanent, ErrorClass.PERMANENT)):
        for cls in classes:
            if cls in mro:
                distance = mro.index(cls)
                if best is None or distance < best[0]:
                    best = (distance, verdict)
    return None if best is None else best[1]


def http_status(exc: BaseException) -> int | None:
    """The HTTP status an error object carries (``status_code``, ``status``, or its response's)."""
    for holder in (exc, getattr(exc, "response", None)):
        if holder is None:
            continue
        for name in ("status_code", "status"):
            value = getattr(holder, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


def full_jitter(attempt: int, *, base: float, cap: float, rng: random.Random) -> float:
    """Seconds to wait before retry number ``attempt`` (1-based): uniform in
    ``[0, min(cap, base * 2 ** attempt)]`` ("full jitter")."""
    ceiling = min(cap, base * 2 ** min(attempt, 62))
    return rng.uniform(0.0, ceiling)


@dataclass(frozen=True)
class Decision:
    """What to do with a failed execution."""

    #: "retry", or "dead_letter".
    action: str
    error_class: ErrorClass
    #: Seconds to wait before the retry (``None`` when not retrying).
    delay: float | None = None
    #: Why, in words, for logs and the dead letter.
    reason: str = ""


def decide(
    error_class: ErrorClass,
    *,
    attempts: int,
    max_attempts: int,
    base: float,
    cap: float,
    rng: random.Random,
) -> Decision:
    """Retry a transient failure while attempts remain; dead-letter everything else."""
    if error_class is ErrorClass.PERMANENT:
        return Decision("dead_letter", error_class, reason="permanent error")
    if attempts >= max_attempts:
        return Decision(
            "dead_letter", error_class, reason=f"attempts exhausted ({attempts}/{max_attempts})"
        )
    delay = full_jitter(attempts, base=base, cap=cap, rng=rng)
    return Decision("retry", error_class, delay=delay, reason=f"attempt {attempts} failed")


def import_classes(setting: str, names: Any) -> tuple[type[BaseException], ...]:
    """Exception classes from a setting: classes, or ``"module:Name"``/``"module.Name"``."""
    if names is None:
        return ()
    if isinstance(names, (str, type)):
        names = [names]
    found: list[type[BaseException]] = []
    for name in names:
        cls = _import_class(setting, name) if isinstance(name, str) else name
        if not (isinstance(cls, type) and issubclass(cls, BaseException)):
            raise ConfigurationError(f"{setting} lists {name!r}, which is not an exception class")
        found.append(cls)
    return tuple(found)


def _import_class(setting: str, path: str) -> Any:
    import importlib

    module_name, _, attribute = path.replace(":", ".").rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigurationError(f"{setting}: cannot import {path!r} ({exc})") from None
