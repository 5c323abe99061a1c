"""``GuardedTask``: the Celery glue. It reads options and headers and defers to the handler."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from datetime import datetime
from typing import Any, ClassVar, Protocol

from celery import Task
from celery._state import _task_stack
from celery.exceptions import Ignore, Reject, Retry

from celery_guard import messages
from celery_guard.circuit import Circuit
from celery_guard.config import GuardConfig, check_ttl_option
from celery_guard.deadletters import DeadLetterSink
from celery_guard.errors import (
    ConfigurationError,
    DeadLettered,
    GuardError,
    InFlightElsewhere,
    InvalidIdempotencyKey,
    StoreError,
)
from celery_guard.execution import Execution
from celery_guard.handler import (
    Delivery,
    DeliveryDeferred,
    GuardHandler,
    RetryLater,
    TaskTerms,
    oversize,
)
from celery_guard.keys import (
    HEADER_KEY,
    HEADER_KEY_SOURCE,
    KeyOption,
    KeySource,
    Payload,
    bind_arguments,
    check_key_option,
    encode_payload,
    key_from_option,
    payload_fingerprint,
    resolve_key,
    validate_key,
)
from celery_guard.messages import PUBLISHED_AT_HEADER
from celery_guard.policy import ErrorClass, import_classes
from celery_guard.runtime import RUNTIME_ATTRIBUTE, get_runtime
from celery_guard.serialization import ResultCodec
from celery_guard.store.base import DeadLetter, KeyStore

logger = logging.getLogger("celery_guard")

#: Message headers celery_guard sets (the key's two live in keys.py); prefixed so they never
#: shadow a Celery ``Context`` field.
HEADER_DEFERRALS = "guard_deferrals"
#: How many of the message's ``retries`` were celery_guard's own (transient errors); the rest
#: are the body's ``self.retry()``/``autoretry_for``, which Celery's ``max_retries`` bounds.
HEADER_GUARD_RETRIES = "guard_retries"
#: Epoch seconds at publish, stamped on every message (queue lag = claim time - this).
HEADER_PUBLISHED_AT = PUBLISHED_AT_HEADER

_EXECUTION_ATTRIBUTE = "_celery_guard_execution"


class TaskStore(Protocol):
    """The part of the store a task reaches itself (a direct call's ``self.guard``)."""

    @property
    def keys(self) -> KeyStore: ...


class TaskRuntime(Protocol):
    """What a guarded task uses of its app's runtime (``celery_guard.install.GuardRuntime``,
    found with :func:`celery_guard.runtime.get_runtime` so this module never imports it)."""

    @property
    def config(self) -> GuardConfig: ...
    @property
    def store(self) -> TaskStore: ...
    @property
    def handler(self) -> GuardHandler: ...
    @property
    def circuit(self) -> Circuit: ...
    @property
    def dead_letters(self) -> DeadLetterSink: ...
    def delivery_parts(self) -> tuple[GuardConfig, GuardHandler, Circuit]: ...


def _runtime(app: Any) -> TaskRuntime:
    runtime: TaskRuntime = get_runtime(app)
    return runtime


#: Set on the exception Celery's ``Task.retry()`` raises once ``max_retries`` is spent.
_RETRIES_SPENT_ATTRIBUTE = "_celery_guard_retries_spent"
#: Where Celery defines its built-in tasks (celery/app/builtins.py).
_CELERY_BUILTINS = "celery.app.builtins"


class _Unset:
    def __repr__(self) -> str:
        return "<app default>"


_UNSET: Any = _Unset()

#: Per-task options GuardedTask understands (``@app.task(base=GuardedTask, <option>=...)``).
TASK_OPTIONS = frozenset(
    {
        "idempotency_key",
        "idempotency_ttl",
        "progress_timeout",
        "max_attempts",
        "transient_errors",
        "permanent_errors",
    }
)
_OPTION_PREFIXES = ("idempotency_", "guard_")


class GuardedTask(Task):  # type: ignore[misc]  # celery ships no type information
    """A Celery task whose effect on the store's database happens once per idempotency key.

    Task options (keyword arguments of ``@app.task``):

    ``idempotency_key``
        A format string over the bound arguments (``"charge:{order_id}"``), a callable taking the
        task's arguments, or :data:`celery_guard.BY_ARGUMENTS`. Default: the Celery task id.
        A per-call ``apply_async(..., idempotency_key=...)`` beats it.
    ``idempotency_ttl``
        Seconds a COMPLETED key keeps deduplicating; ``None`` until pruned, ``0`` only while in
        flight. Default: ``guard_result_ttl``.
    ``progress_timeout``
        Progress mode: the lease stops being renewed when the body has not called
        ``self.guard.progress()`` for this many seconds. Default: ``guard_progress_timeout``.
    ``max_attempts``
        Executions the key may have before it is dead-lettered. Default: ``guard_max_attempts``.
    ``transient_errors`` / ``permanent_errors``
        Exception classes to retry / to dead-letter at once, consulted before the app's.

    Override :meth:`classify_error` to decide yourself.
    """

    #: A killed worker's message must come back: acknowledge only after the body ran, and
    #: requeue when the child process dies (docs/design.md#the-celery-seams).
    acks_late = True
    reject_on_worker_lost = True
    #: A copy of a dead-lettered key (and a poison pill stopped at claim) fails with
    #: DeadLettered, an outcome celery_guard has already logged and counted: Celery logs
    #: "expected" failures at INFO without a traceback (celery/app/trace.py get_log_policy),
    #: where each copy would otherwise log an ERROR traceback of celery_guard's internals.
    #: A task's own ``throws`` option is extended, not replaced.
    throws: ClassVar[tuple[type[BaseException], ...]] = (DeadLettered,)
    #: Celery's built-in canvas tasks (``celery.chord_unlock``, ``celery.accumulate``...) get
    #: the app's ``task_cls`` too; they run unguarded, as in plain Celery (no claim per poll).
    guarded: ClassVar[bool] = True
    _result_codec: ResultCodec | None = None
    _task_terms: tuple[GuardConfig, TaskTerms] | None = None

    idempotency_key: ClassVar[KeyOption] = None
    idempotency_ttl: ClassVar[Any] = _UNSET
    progress_timeout: ClassVar[Any] = _UNSET
    max_attempts: ClassVar[Any] = _UNSET
    transient_errors: ClassVar[Any] = ()
    permanent_errors: ClassVar[Any] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        name = cls.__dict__.get("name") or cls.__name__
        if cls.__module__ == _CELERY_BUILTINS:
            cls.guarded = False
            # None: Celery fills them from the app's task_acks_late/... as for a plain Task.
            cls.acks_late = None  # type: ignore[assignment]
            cls.reject_on_worker_lost = None  # type: ignore[assignment]
        for attribute in cls.__dict__:
            if attribute.startswith(_OPTION_PREFIXES) and attribute not in TASK_OPTIONS:
                raise ConfigurationError(
                    f"task {name}: unknown celery_guard option {attribute!r}; known options are "
                    f"{', '.join(sorted(TASK_OPTIONS))}"
                )
        key_option = cls.__dict__.get("idempotency_key")
        check_key_option(name, key_option)
        if (
            key_option is not None
            and not isinstance(key_option, (str, staticmethod))
            and (callable(key_option) and hasattr(key_option, "__get__"))
        ):
            # A function stored on a class becomes a method; the key callable takes the task's
            # arguments only.
            cls.idempotency_key = staticmethod(key_option)
        for option in ("idempotency_ttl", "progress_timeout"):
            value = cls.__dict__.get(option, _UNSET)
            if value is not _UNSET:
                check_ttl_option(f"task {name}: {option}", value)
        attempts = cls.__dict__.get("max_attempts", _UNSET)
        if attempts is not _UNSET and (
            isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1
        ):
            raise ConfigurationError(
                f"task {name}: max_attempts must be an integer >= 1, got {attempts!r}"
            )
        throws = cls.__dict__.get("throws")
        if throws is not None:
            declared = tuple(throws) if isinstance(throws, (tuple, list)) else (throws,)
            if not any(
                isinstance(kind, type) and issubclass(DeadLettered, kind) for kind in declared
            ):
                cls.throws = (*declared, DeadLettered)
        for option in ("transient_errors", "permanent_errors"):
            if option in cls.__dict__:
                setattr(cls, option, import_classes(f"task {name}: {option}", cls.__dict__[option]))

    # -- publishing ---------------------------------------------------------------------------

    def apply_async(
        self,
        args: Any = None,
        kwargs: Any = None,
        task_id: str | None = None,
        producer: Any = None,
        link: Any = None,
        link_error: Any = None,
        shadow: str | None = None,
        **options: Any,
    ) -> Any:
        """Send the task; ``idempotency_key=...`` sets a per-call key (carried in a header).

        The key is computed and checked here when it can be, so a bad key or unserializable
        arguments fail in the caller, before anything is sent. Arguments that do not fit the
        task's signature raise the ``TypeError`` plain Celery raises, before the key is formatted.
        """
        if self.typing:
            # Celery checks the arguments too, but only after the key below is formatted from
            # them: check first, so wrong arguments give the TypeError plain Celery gives.
            check_arguments = getattr(self, "__header__", None)
            if check_arguments is not None:
                check_arguments(*(args or ()), **(kwargs or {}))
        per_call_key = options.pop("idempotency_key", None)
        headers = dict(options.pop("headers", None) or {})
        if per_call_key is not None:
            headers[HEADER_KEY] = validate_key(per_call_key)
            headers[HEADER_KEY_SOURCE] = KeySource.CALL.value
        elif HEADER_KEY not in headers and self.idempotency_key is not None:
            headers[HEADER_KEY] = self._key_from_option(args or (), kwargs or {})
            headers[HEADER_KEY_SOURCE] = KeySource.OPTION.value
        if HEADER_KEY in headers and headers.get(HEADER_KEY_SOURCE) != KeySource.TASK_ID.value:
            # The worker refuses payloads it cannot fingerprint; refuse them here instead.
            payload_fingerprint(self.name, bind_arguments(self.run, args or (), kwargs or {}))
        if headers:
            options["headers"] = headers
        return super().apply_async(
            args, kwargs, task_id, producer, link, link_error, shadow, **options
        )

    # -- executing ----------------------------------------------------------------------------

    @property
    def guard(self) -> Execution:
        """The running execution: ``transaction()``, ``fencing_token``, ``key``, ``attempts``."""
        execution = getattr(self.request, _EXECUTION_ATTRIBUTE, None)
        if execution is None:
            raise GuardError(
                f"{self.name}: self.guard exists only while the task body runs "
                "(declare the task with bind=True)"
            )
        return execution  # type: ignore[no-any-return]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.guarded:
            return super().__call__(*args, **kwargs)
        app = self.app
        # get_runtime's lookup, inline (it runs per delivery); get_runtime raises the error.
        runtime = getattr(app, RUNTIME_ATTRIBUTE, None) or _runtime(app)
        request = self.request
        if request.called_directly:
            return self._call_directly(runtime, args, kwargs)
        config, handler, circuit = runtime.delivery_parts()
        try:
            return self._deliver(runtime, config, handler, circuit, request, args, kwargs)
        finally:
            circuit.tell()  # the delivery's store calls, to the metrics, at once

    def _deliver(
        self,
        runtime: TaskRuntime,
        config: GuardConfig,
        handler: GuardHandler,
        circuit: Circuit,
        request: Any,
        args: Any,
        kwargs: Any,
    ) -> Any:
        try:
            delivery = self._delivery(request, args, kwargs, config)
        except (InvalidIdempotencyKey, TypeError) as exc:
            # TypeError: UnserializableArguments, or arguments that do not fit the signature
            # (a producer that skipped apply_async's check, or a rolling deploy's older task).
            if not request.is_eager:
                self._keep_undeliverable(runtime, request, args, kwargs, exc)
            raise
        circuit.before_claim(self, delivery.key)  # backpressure: hold, or give it back
        try:
            return handler.execute(
                self, delivery, lambda execution: self._run_body(execution, args, kwargs)
            )
        except DeliveryDeferred as deferred:
            raise self._defer(delivery, deferred) from None
        except DeadLettered as dead:
            if dead.failed_task_id is not None and dead.failed_task_id == request.id:
                # This very message failed when the key died, and Celery recorded that failure
                # and ran its errbacks and its chord's error path then: a redelivered or
                # re-sent copy must not run them again, nor count as a chord part twice.
                logger.info(
                    "celery_guard ignored %s[%s]: a copy of a message whose failure "
                    "dead-lettered key %r was already reported",
                    self.name,
                    request.id,
                    dead.key,
                )
                raise Ignore(str(dead)) from None
            raise
        except RetryLater as later:
            # Celery's own retry: same task id and key, retries + 1. The attempt limit is
            # celery_guard's (counted in the store), so Celery's max_retries must not stop it.
            headers = request.headers or {}
            raise Task.retry(
                self,
                exc=later.__cause__,
                countdown=later.delay,
                max_retries=request.retries + 1,
                headers={**headers, HEADER_GUARD_RETRIES: _guard_retries(request, headers) + 1},
            ) from None

    def retry(self, *args: Any, **kwargs: Any) -> Any:
        """Celery's :meth:`celery.Task.retry`; once ``max_retries`` is spent, the exception it
        raises fails the key at once (dead letter) instead of being retried by celery_guard."""
        try:
            return super().retry(*args, **kwargs)
        except Retry:
            raise
        except Exception as exc:
            with contextlib.suppress(AttributeError, TypeError):
                setattr(exc, _RETRIES_SPENT_ATTRIBUTE, True)
            raise

    def _keep_undeliverable(
        self, runtime: TaskRuntime, request: Any, args: Any, kwargs: Any, exc: Exception
    ) -> None:
        """A delivery with no usable key (a producer that skipped ``apply_async``'s checks):
        it fails, and its message is kept as a dead letter instead of being acknowledged away."""
        if isinstance(exc, GuardError):
            reason = "no usable idempotency key: fix the producer (or the key option), then replay"
        else:
            reason = (
                "the arguments do not fit the task's signature: deploy the task version the "
                "producer calls (or fix the producer), then replay"
            )
        message = messages.from_undeliverable_request(self.name, request, args, kwargs)
        letter = DeadLetter(
            key=request.id,
            task_name=self.name,
            task_id=request.id,
            message=message,
            error_class="permanent",
            error_type=type(exc).__name__,
            error=str(exc)[:2000],
            traceback=None,
            reason=reason,
            attempts=0,
        )
        try:
            stored = runtime.dead_letters.keep(letter)
        except StoreError as store_exc:
            logger.error(
                "celery_guard could not keep task %s as a dead letter: %s", request.id, store_exc
            )
            return
        logger.warning(
            "celery_guard dead-lettered task %s (id %s) as dead letter %s: %s",
            self.name,
            request.id,
            stored.id,
            exc,
        )

    def _run_body(self, execution: Execution, args: Any, kwargs: Any) -> Any:
        request = self.request
        setattr(request, _EXECUTION_ATTRIBUTE, execution)
        try:
            return super().__call__(*args, **kwargs)
        finally:
            setattr(request, _EXECUTION_ATTRIBUTE, None)

    def _call_directly(self, runtime: TaskRuntime, args: Any, kwargs: Any) -> Any:
        """A plain function call: no message, no key; ``self.guard.transaction()`` and
        ``atomic()`` still work."""
        execution = Execution(
            runtime.store.keys,
            key=None,
            fencing_token=None,
            attempts=1,
            claim_reason=None,
            atomic=runtime.handler.atomic,
        )
        _task_stack.push(self)
        self.push_request(args=args, kwargs=kwargs)
        setattr(self.request, _EXECUTION_ATTRIBUTE, execution)
        try:
            value = self.run(*args, **kwargs)
        except BaseException:
            execution.abort()
            raise
        finally:
            self.pop_request()
            _task_stack.pop()
        execution.finish("null", None)
        return value

    def _delivery(self, request: Any, args: Any, kwargs: Any, config: GuardConfig) -> Delivery:
        headers = request.headers or {}
        key, source = resolve_key(
            headers.get(HEADER_KEY) or getattr(request, HEADER_KEY, None),
            headers.get(HEADER_KEY_SOURCE) or getattr(request, HEADER_KEY_SOURCE, None),
            # Binds the arguments only when the key is not in the headers (the producer
            # computes an option's key): arguments that do not fit raise the TypeError the
            # call would; with a task-id or header key, the body's call raises it (permanent).
            lambda: self._key_from_option(args, kwargs),
            request.id,
        )
        try:
            # Serialized once: the fingerprint and the stored message share the texts.
            payload: Payload | None = encode_payload(self.name, self.run, args, kwargs)
        except GuardError:
            if source is not KeySource.TASK_ID:
                raise
            # A task-id key never compares payloads; pickled arguments are fine there.
            payload = None
        message = (
            messages.from_request(self.name, request, payload, key, source)
            if payload is not None
            else None
        )
        size = None if message is None else oversize(message, config.max_payload_bytes)
        if size is not None:
            logger.warning(
                "celery_guard does not store the %d-byte message of %s (id %s) with its claim, "
                "above guard_max_payload_bytes: if its worker dies, the broker's redelivery "
                "brings it back, not the reaper",
                size,
                self.name,
                request.id,
            )
            message = None
        deferrals = int(headers.get(HEADER_DEFERRALS) or 0)
        hard_limit = (request.timelimit or (None, None))[0] or self.time_limit
        terms = self._terms(config)
        return Delivery(
            terms=terms,
            key=key,
            key_source=source,
            fingerprint=None if payload is None else payload.fingerprint,
            message=message,
            hard_deadline=config.hard_deadline or hard_limit or None,
            task_id=request.id,
            # Retries the body asked for are Celery's (bounded by max_retries): each is an
            # attempt in the store, but not one guard_max_attempts may stop.
            max_attempts=terms.max_attempts
            + max(0, (request.retries or 0) - _guard_retries(request, headers)),
            owner=_owner(request.hostname),
            deferrals=deferrals,
            # AMQP brokers flag a message they deliver again; a retry or a deferral is a new
            # message for a key claimed before.
            first_delivery=not (
                request.retries or deferrals or (request.delivery_info or {}).get("redelivered")
            ),
            due_at=_due_at(request, headers),
        )

    def _terms(self, config: GuardConfig) -> TaskTerms:
        """What every delivery of this task shares, built at its first delivery under
        ``config``: as Celery's tracer, which reads a task's options once when it is built
        (celery/app/trace.py ``build_tracer``), later changes to the task's attributes do not
        reach a worker that has run it."""
        cached = self._task_terms
        if cached is not None and cached[0] is config:
            return cached[1]
        retention = self.idempotency_ttl
        progress_timeout = self.progress_timeout
        results = self._results
        terms = TaskTerms(
            task_name=self.name,
            retention=config.result_ttl if retention is _UNSET else retention,
            progress_timeout=(
                config.progress_timeout if progress_timeout is _UNSET else progress_timeout
            ),
            classify=self._classify,
            max_attempts=config.max_attempts if self.max_attempts is _UNSET else self.max_attempts,
            celery_retries_for=tuple(getattr(self, "autoretry_for", ()) or ()),
            encode_result=results.dumps,
            decode_result=results.loads,
        )
        self._task_terms = (config, terms)
        return terms

    @property
    def _results(self) -> ResultCodec:
        """Prepares results as the app's result backend does (read from the app's config once)."""
        codec = self._result_codec
        if codec is None or codec.app is not self.app:
            codec = self._result_codec = ResultCodec(self.app)
        return codec

    def _classify(self, exc: BaseException) -> ErrorClass:
        if getattr(exc, _RETRIES_SPENT_ATTRIBUTE, False):
            # Celery's retries for it are spent, as in plain Celery the task fails now.
            return ErrorClass.PERMANENT
        return self.classify_error(exc)

    def classify_error(self, exc: BaseException) -> ErrorClass:
        """Transient (retry), permanent (dead-letter now) or coordination; override to decide.

        The default consults the task's ``transient_errors``/``permanent_errors``, then the
        app's ``guard_*`` lists, then an HTTP status on the error, then the documented defaults.
        """
        policy = _runtime(self.app).config.error_policy
        return policy.with_layer(self.transient_errors, self.permanent_errors).classify(exc)

    def _key_from_option(
        self, args: Any, kwargs: Any, arguments: dict[str, Any] | None = None
    ) -> str | None:
        return key_from_option(
            self.idempotency_key,
            task_name=self.name,
            fun=self.run,
            args=args,
            kwargs=kwargs,
            arguments=arguments,
        )

    def _defer(self, delivery: Delivery, deferred: DeliveryDeferred) -> BaseException:
        """Re-publish this delivery for later and end this one as a retry, losing nothing."""
        request = self.request
        if request.is_eager:
            cause = deferred.__cause__
            return cause if isinstance(cause, StoreError) else InFlightElsewhere(delivery.key)
        headers = {
            **(request.headers or {}),
            HEADER_KEY: delivery.key,
            HEADER_KEY_SOURCE: delivery.key_source.value,
            HEADER_DEFERRALS: delivery.deferrals + 1,
        }
        signature = self.signature_from_request(
            request, countdown=deferred.countdown, headers=headers
        )
        try:
            signature.apply_async()
        except Exception as exc:
            # Cannot re-publish either: hand the message back to the broker unacknowledged.
            rejected: BaseException = Reject(f"celery_guard could not defer: {exc}", requeue=True)
            return rejected
        retry: BaseException = Retry(str(deferred), when=deferred.countdown, sig=signature)
        return retry


#: This process's owner strings by worker hostname; emptied in a forked child (a new pid).
_owners: dict[str | None, str] = {}
os.register_at_fork(after_in_child=_owners.clear)


def _owner(hostname: str | None) -> str:
    """``<worker hostname>/<pid>``: who holds a claim (the reaper's liveness checks read it)."""
    owner = _owners.get(hostname)
    if owner is None:
        owner = _owners[hostname] = f"{hostname or socket.gethostname()}/{os.getpid()}"
    return owner


def _guard_retries(request: Any, headers: dict[str, Any]) -> int:
    """How many of the request's retries celery_guard made (the ``guard_retries`` header)."""
    value = headers.get(HEADER_GUARD_RETRIES) or getattr(request, HEADER_GUARD_RETRIES, None)
    try:
        return int(value or 0)
    except (TypeError, ValueError):
        return 0


def _due_at(request: Any, headers: dict[str, Any]) -> float | None:
    """When the message became due: its publish time, or its ETA if that is later."""
    published = headers.get(HEADER_PUBLISHED_AT) or getattr(request, HEADER_PUBLISHED_AT, None)
    try:
        due = float(published) if published is not None else None
    except (TypeError, ValueError):
        due = None
    eta = request.eta
    if eta:
        try:
            eta_at = (eta if isinstance(eta, datetime) else datetime.fromisoformat(eta)).timestamp()
        except (TypeError, ValueError):
            return due
        due = eta_at if due is None else max(due, eta_at)
    return due
