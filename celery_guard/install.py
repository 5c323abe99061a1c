"""``celery_guard.install(app)``: wire the per-process hooks; settings are read when needed."""

from __future__ import annotations

import functools
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from celery import Celery, signals
from celery.app import utils as celery_app_utils
from celery.concurrency.prefork import TaskPool as PreforkPool
from celery.exceptions import Ignore, Reject, Retry

from celery_guard import metrics
from celery_guard.bootsteps import CircuitStep, GuardStep
from celery_guard.circuit import Circuit
from celery_guard.config import GuardConfig
from celery_guard.deadletters import DeadLetterSink
from celery_guard.errors import ConfigurationError, StoreError
from celery_guard.execution import AtomicFactory
from celery_guard.handler import GuardHandler
from celery_guard.keys import HEADER_KEY, key_from_option
from celery_guard.lease.backends import LeaseBackend, RedisLeases, SqlLeases
from celery_guard.lease.heartbeat import Heartbeat
from celery_guard.lease.liveness import ProcessLiveness, liveness_store
from celery_guard.lease.relay import RelayRenewer, RenewalRelay
from celery_guard.messages import PUBLISHED_AT_HEADER, preset_stamp
from celery_guard.outbox import PublishTracker, connect_tracking
from celery_guard.reaper import Reaper
from celery_guard.runtime import find_runtime, set_runtime
from celery_guard.store.sql import SqlStore
from celery_guard.task import GuardedTask, TaskRuntime
from celery_guard.worker_state import StateTracker

logger = logging.getLogger("celery_guard")


@dataclass(frozen=True, kw_only=True)
class Integration:
    """What a framework integration adds to an app's runtime (``celery_guard.contrib.django``).

    Given to :func:`install`; the core never imports the framework itself.
    """

    #: Names it by in errors ("Django").
    name: str
    #: Values for settings the app's config does not set (field name -> value).
    defaults: Mapping[str, Any] = field(default_factory=dict)
    #: Called with the settings read from the app's config; returns the settings to use (the
    #: store's URL made from the framework's own database settings, for one).
    configure: Callable[[GuardConfig], GuardConfig] | None = None
    #: What ``self.guard.atomic()`` opens.
    atomic: AtomicFactory | None = None


@dataclass(frozen=True)
class _Parts:
    """Everything built from the settings, together, once."""

    config: GuardConfig
    store: SqlStore
    leases: LeaseBackend
    heartbeat: Heartbeat
    dead_letters: DeadLetterSink
    handler: GuardHandler
    tracker: PublishTracker | None
    circuit: Circuit


class GuardRuntime:
    """What celery_guard holds per app: its config, its store and the delivery handler.

    The parts are built from the app's settings when first used (a worker's start, the first
    publish, the first task call), not by :func:`install`: Celery reads its own settings that
    late too, so ``install(app)`` may come before ``app.config_from_object(...)``. A bad
    setting raises :class:`ConfigurationError` from that first use, and from every later one.
    """

    def __init__(
        self,
        app: Celery,
        config: GuardConfig | None = None,
        integration: Integration | None = None,
    ) -> None:
        self.app = app
        #: The framework integration it was installed with, if any.
        self.integration = integration
        #: The settings to use instead of the app's (read when first needed when ``None``).
        self._given_config = config
        self._parts: _Parts | None = None
        self._lock = threading.Lock()
        self.states = StateTracker()
        #: The reaper, in a worker's main process once the worker has started.
        self.reaper: Reaper | None = None
        #: A prefork worker on PostgreSQL: the main process's renewal relay (bound in
        #: ``worker_init``, served by ``GuardStep``), known to every pool process.
        self.relay: RenewalRelay | None = None

    def _built(self) -> _Parts:
        parts = self._parts
        if parts is not None:
            return parts
        with self._lock:
            if self._parts is None:
                self._parts = self._build()
            return self._parts

    def _build(self) -> _Parts:
        app = self.app
        config = self._given_config
        integration = self.integration
        if config is None:
            defaults = integration.defaults if integration is not None else None
            config = GuardConfig.from_celery_conf(app.conf, app.namespace, defaults)
        if integration is not None and integration.configure is not None:
            config = integration.configure(config)
        elif config.database is not None:
            raise ConfigurationError(
                f"guard_database ({config.database!r}) names a Django database alias, read only "
                "when the app is installed with celery_guard.contrib.django.install(app); "
                "remove it, or install the Django integration (docs/django.md)"
            )
        store = SqlStore(config)
        leases: LeaseBackend = (
            SqlLeases(store.keys)
            if config.lease_url is None
            else RedisLeases(config.lease_url, timeout=config.store_timeout)
        )
        heartbeat = Heartbeat(leases, interval=config.renew_interval)
        liveness_db = liveness_store(config, store.db)
        dead_letters = DeadLetterSink(app, store.dead_letters, config.dead_letter_queue)
        handler = GuardHandler(
            store.keys,
            leases,
            heartbeat,
            lease_ttl=config.lease_ttl,
            dead_letters=dead_letters,
            backoff_base=config.backoff_base,
            backoff_max=config.backoff_max,
            control_flow=(Retry, Ignore, Reject),
            states=self.states,
            liveness=(
                ProcessLiveness(liveness_db, recheck_after=config.lease_ttl)
                if liveness_db is not None
                else None
            ),
            max_payload_bytes=config.max_payload_bytes,
            atomic=integration.atomic if integration is not None else None,
        )
        tracker = (
            PublishTracker(
                app,
                store.publishes,
                max_payload_bytes=config.max_payload_bytes,
                is_guarded=_is_guarded,
                key_for=_key_for,
            )
            if config.track_publishes
            else None
        )
        # -- backpressure (celery_guard.circuit): circuit breaker, adaptive concurrency --
        circuit = Circuit(config)
        circuit.watch(store, leases)
        return _Parts(config, store, leases, heartbeat, dead_letters, handler, tracker, circuit)

    @property
    def config(self) -> GuardConfig:
        """The validated settings (read from the app's config on first access)."""
        return self._built().config

    @property
    def store(self) -> SqlStore:
        """The SQL store: keys, dead letters, workers, tracked publishes."""
        return self._built().store

    @property
    def leases(self) -> LeaseBackend:
        """Where leases live: the store's rows or Redis (``guard_lease_url``)."""
        return self._built().leases

    @property
    def heartbeat(self) -> Heartbeat:
        """Renews the leases of this process's running bodies."""
        return self._built().heartbeat

    @property
    def dead_letters(self) -> DeadLetterSink:
        """Keeps dead letters in the store and the dead-letter queue."""
        return self._built().dead_letters

    @property
    def handler(self) -> GuardHandler:
        """Runs one delivery: claim, body, completion."""
        return self._built().handler

    @property
    def tracker(self) -> PublishTracker | None:
        """Publish tracking (``guard_track_publishes``): records this app's guarded publishes."""
        return self._built().tracker

    @property
    def circuit(self) -> Circuit:
        """The store's circuit breaker and adaptive concurrency."""
        return self._built().circuit

    def delivery_parts(self) -> tuple[GuardConfig, GuardHandler, Circuit]:
        """The settings, the handler and the circuit: what each delivery reads, in one call."""
        parts = self._built()
        return parts.config, parts.handler, parts.circuit

    def load(self) -> GuardConfig:
        """Read and check the settings now (once), build the parts, and return the settings.

        :class:`ConfigurationError` names a bad setting as the config spells it.
        """
        return self._built().config

    def migrate(self) -> list[str]:
        """Create the store's tables when missing and upgrade existing ones to the current
        schema (idempotent); returns the upgrade's statements (none when it was current)."""
        return self.store.migrate()


def install(app: Celery, integration: Integration | None = None) -> GuardRuntime:
    """Connect celery_guard to the app's publishes and worker lifecycle.

    Call it once, before a worker starts; before or after the app is configured
    (``config_from_object``), as the ``guard_*`` settings are read, and checked, when first
    needed: at worker start (a bad one stops the worker before it consumes), at the first
    publish, at the first task call. It does not touch the network or read the settings.
    Calling it again returns the runtime already installed (with the same ``integration``;
    another one is refused). Django projects call ``celery_guard.contrib.django.install(app)``,
    which passes Django's integration.
    """
    existing = find_runtime(app)
    if isinstance(existing, GuardRuntime):
        if existing.integration != integration:
            had = existing.integration.name if existing.integration else "no integration"
            wants = integration.name if integration else "no integration"
            raise ConfigurationError(
                f"celery_guard was installed on the Celery app {app.main!r} with {had} "
                f"already; installing it again with {wants} would leave the two disagreeing "
                "about where the store lives: call one install(app) only"
            )
        return existing
    runtime = GuardRuntime(app, integration=integration)
    set_runtime(app, runtime)
    _mask_in_celery_views()
    # The other recorders are connected at worker start, when the settings say metrics are on.
    metrics.connect_state_signals()
    signals.before_task_publish.connect(
        _stamp_publish_time, weak=False, dispatch_uid="celery_guard.published_at"
    )
    connect_tracking()  # after the stamp: a tracked record keeps the header's value
    _wrap_send_task(app, runtime)
    _connect_worker_signals(app, runtime)
    app.steps["worker"].add(GuardStep)
    app.steps["worker"].add(CircuitStep)  # backpressure: the circuit's monitor
    return runtime


def _wrap_send_task(app: Celery, runtime: GuardRuntime) -> None:
    """Every publish of the app goes through ``send_task`` (``apply_async`` calls it too): the
    first one reads the settings, so a bad one fails in the caller, and tracking applies."""
    original = app.send_task

    @functools.wraps(original)
    def send_task(*args: Any, **kwargs: Any) -> Any:
        tracker = runtime.tracker
        if tracker is None:
            return original(*args, **kwargs)
        return tracker.publish(original, *args, **kwargs)

    app.send_task = send_task


#: Settings whose values may carry a password (``user:password@`` in the URL).
_SECRET_SETTINGS = "GUARD_STORE_URL|GUARD_LEASE_URL"


def _mask_in_celery_views() -> None:
    """Have Celery mask our URL settings where it shows the configuration.

    ``celery inspect conf`` (and Flower's config page, which asks the workers the same),
    ``celery report`` and ``app.conf.table()`` mask settings whose names match Celery's
    ``HIDDEN_SETTINGS`` (KEY, PASS, SECRET, ...), which ``guard_store_url`` and
    ``guard_lease_url`` do not: their passwords were shown in clear.
    """
    hidden = getattr(celery_app_utils, "HIDDEN_SETTINGS", None)
    if isinstance(hidden, re.Pattern) and _SECRET_SETTINGS not in hidden.pattern:
        celery_app_utils.HIDDEN_SETTINGS = re.compile(
            f"{hidden.pattern}|{_SECRET_SETTINGS}", hidden.flags
        )


def get_runtime(app: Celery) -> GuardRuntime:
    """The runtime :func:`install` attached to ``app``; a clear error when it was not called."""
    runtime = find_runtime(app)
    if not isinstance(runtime, GuardRuntime):
        raise ConfigurationError(
            f"celery_guard.install(app) was not called for the Celery app {app.main!r}; "
            "guarded tasks need it"
        )
    return runtime


def _serves_tasks(runtime: GuardRuntime) -> TaskRuntime:
    """Never called: mypy checks here that a GuardRuntime is what GuardedTask expects."""
    return runtime


def _is_guarded(task: Any) -> bool:
    """Publish tracking records the publishes of GuardedTask's tasks only."""
    return isinstance(task, GuardedTask)


def _key_for(task: Any, args: Any, kwargs: Any) -> str | None:
    """The key a guarded task's ``idempotency_key`` option gives a call, as its worker will
    compute it (``GuardedTask.apply_async`` does the same); ``None`` without a key option."""
    return key_from_option(
        task.idempotency_key, task_name=task.name, fun=task.run, args=args, kwargs=kwargs
    )


def _stamp_publish_time(headers: dict[str, Any] | None = None, **_: Any) -> None:
    """Every published message carries its publish time: queue lag and oldest-waiting age."""
    if headers is not None:
        headers[PUBLISHED_AT_HEADER] = preset_stamp() or time.time()


def _is_prefork(worker: Any) -> bool:
    """Whether ``worker`` (a ``WorkController``) runs its bodies in prefork pool processes."""
    pool_cls = getattr(worker, "pool_cls", None)
    return isinstance(pool_cls, type) and issubclass(pool_cls, PreforkPool)


def _prepare_budget(runtime: GuardRuntime, worker: Any) -> None:
    """A prefork worker's main process on PostgreSQL: N + 2 connections in all.

    The main keeps to its liveness session and a pool of one (reaper, sampler, worker
    heartbeat, the relay's renewals); each pool process to one, its hot connection; the
    relay carries the pool processes' renewal rounds and tells when one of them dies.
    """
    db = runtime.store.db
    db.budget = "main"
    db.worker_tag = str(os.getpid())
    liveness = runtime.handler.liveness
    if liveness is not None:
        liveness.store.worker_tag = db.worker_tag  # guard_liveness_url: an engine of its own
    hostname = worker.hostname
    owner = f"{hostname}/{os.getpid()}"
    leases = runtime.leases

    def renew(pairs: list[tuple[str, int]], ttl: float) -> set[str]:
        return leases.renew_leases(pairs, ttl)

    def process_gone(pid: int) -> None:
        reaper = runtime.reaper
        if reaper is not None:
            reaper.end_owner(f"{hostname}/{pid}")

    def tick() -> None:
        if liveness is not None:
            liveness.hold_for_worker(owner)

    relay = RenewalRelay(renew, on_process_gone=process_gone, tick=tick)
    relay.bind()
    runtime.relay = relay


def _connect_worker_signals(app: Celery, runtime: GuardRuntime) -> None:
    def on_worker_init(sender: Any = None, **_: Any) -> None:
        if getattr(sender, "app", app) is not app:
            return
        try:
            config = runtime.load()
        except ConfigurationError:
            # GuardStep raises it while the worker is set up, so the worker stops before it
            # consumes; raised here, Celery's signal would only log it and go on.
            return
        # Before the pool forks: every child writes its metrics where the main process reads,
        # and records them only when they are served.
        metrics.enable_multiprocess()
        metrics.connect_signals(config.metrics_port is not None)
        if _is_prefork(sender) and runtime.store.db.dialect_name == "postgresql":
            # Before the first connection: the main process keeps to two (docs/operations.md).
            _prepare_budget(runtime, sender)
        if config.create_tables:
            # Once in the main process, before the pool forks, so children do not race to
            # create the same tables; then drop the connection so no child inherits it.
            try:
                runtime.store.ensure_schema()
            except StoreError as exc:
                # Not fatal: each process tries again on first use, and until the store
                # answers, deliveries are deferred rather than lost.
                logger.error("celery_guard could not prepare the store at worker start: %s", exc)
        runtime.store.dispose()
        if runtime.relay is not None and runtime.handler.liveness is not None:
            # The worker's one liveness lock, held before the pool forks (and after the
            # dispose, which would close it), so a pool process's first claim records a lock
            # that is held.
            runtime.handler.liveness.hold_for_worker(f"{sender.hostname}/{os.getpid()}")
        runtime.circuit.on_worker_init()  # backpressure: shared block, before the pool forks

    def on_task_unknown(
        sender: Any = None, message: Any = None, name: str = "", id: str = "", **_: Any
    ) -> None:
        # Celery has rejected (dropped) the message already: keep it as a dead letter.
        if getattr(sender, "app", app) is not app or message is None:
            return
        runtime.dead_letters.keep_unknown_task(name, id, message)
        if runtime.tracker is not None:
            # A dead letter now, replayed by an operator: no key row will ever forget it.
            key = (getattr(message, "headers", None) or {}).get(HEADER_KEY) or id
            runtime.tracker.forget(key, id, why="unknown task, kept as a dead letter")

    def on_task_revoked(sender: Any = None, request: Any = None, **_: Any) -> None:
        # A revoked (or expired) message is discarded unrun: no claim will ever forget its
        # record, and the reaper would send it again and again.
        if runtime.tracker is None or getattr(sender, "app", None) is not app or request is None:
            return
        task_id = getattr(request, "id", None)
        if task_id:
            key = getattr(request, HEADER_KEY, None) or task_id
            runtime.tracker.forget(key, task_id, why="revoked or expired before it ran")

    def on_worker_process_init(**_: Any) -> None:
        relay = runtime.relay
        if relay is None:
            runtime.store.reset_after_fork()
        else:
            # One connection for this process's claims, bodies and completions; renewals go
            # through the main process (celery_guard/lease/relay.py).
            runtime.store.reset_after_fork(budget="child")
            renewer = RelayRenewer(
                relay.address,
                timeout=2 * runtime.config.store_timeout + 1,
                observer=runtime.circuit.observe,
            )
            renewer.announce()
            if runtime.leases.in_store:
                runtime.heartbeat.backend = renewer
        runtime.circuit.on_child_start()  # backpressure: count this child's store calls

    def on_worker_process_shutdown(**_: Any) -> None:
        metrics.flush()  # the counts of this child's last deliveries (metrics.FLUSH_EVERY)
        runtime.heartbeat.stop()
        runtime.store.dispose()

    # weak=False: these closures are only referenced by the signal.
    signals.worker_init.connect(on_worker_init, weak=False)
    signals.task_unknown.connect(on_task_unknown, weak=False)
    signals.task_revoked.connect(on_task_revoked, weak=False)
    signals.worker_process_init.connect(on_worker_process_init, weak=False)
    signals.worker_process_shutdown.connect(on_worker_process_shutdown, weak=False)
