"""Configuration: the ``guard_*`` keys of a Celery config, validated once, in one place.

Precedence, written down once: a per-call value (message header) beats a per-task option, which
beats the app-wide ``guard_*`` key, which beats the default documented here.

Spelling, the way Celery spells its own settings (``celery/app/utils.py`` ``Settings``, and
``Celery.config_from_object(..., namespace=...)``):

- Without a namespace, a setting is ``guard_<field>`` (``guard_store_url``); the upper-case
  ``GUARD_STORE_URL`` is the same setting.
- Under the app's namespace (``config_from_object("django.conf:settings", namespace="CELERY")``,
  or ``Celery(namespace=...)``), it is ``<NAMESPACE>_GUARD_<FIELD>``
  (``CELERY_GUARD_STORE_URL``), as Celery reads ``CELERY_BROKER_URL`` for ``broker_url``. The
  plain ``guard_<field>`` spelling is still accepted there, as Celery still reads an unprefixed
  ``broker_url`` under a namespace; a config giving one setting in both spellings with
  different values is refused rather than one of them silently winning.
- An unknown key in either spelling (``CELERY_GUARD_LEASE_TLL``) is refused with the closest
  known key in the same spelling. So is a ``CELERY_GUARD_*`` key in an app without a namespace:
  Celery would ignore it, and the guard would silently fall back to its defaults.

The settings are read when first needed (:class:`celery_guard.install.GuardRuntime`), not by
``install()``, so ``install(app)`` may come before or after ``config_from_object()``.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

from celery_guard.errors import ConfigurationError
from celery_guard.policy import ErrorClass, ErrorPolicy, import_classes

CONFIG_PREFIX = "guard_"

#: The prefix of the guard's settings in an app without a namespace whose settings look
#: namespaced (Django's convention): refused, since nothing would read them.
_DJANGO_STYLE_PREFIX = "celery_" + CONFIG_PREFIX

#: The embedded default store: a SQLite file in the worker's working directory.
DEFAULT_STORE_URL = "sqlite:///celery_guard.sqlite3"

SUPPORTED_SCHEMES = ("sqlite", "postgresql")

#: ``guard_store_pooling``: how the connections to the store's URL are pooled on the way to
#: PostgreSQL. "session": a server session per connection that takes startup ``options``
#: (PostgreSQL itself); "transaction": a pooler that may hand each transaction to any server
#: session and refuses startup ``options`` (PgBouncer, docs/pgbouncer.md).
POOLING_MODES = ("session", "transaction")

#: Default port of the worker's metrics endpoint.
DEFAULT_METRICS_PORT = 9819

#: Default bound on the JSON celery_guard stores per delivery (message, result): 16 MiB.
DEFAULT_MAX_PAYLOAD_BYTES = 16 * 1024 * 1024

#: PostgreSQL's ``synchronous_commit`` levels, weakest first
#: (https://www.postgresql.org/docs/15/runtime-config-wal.html#GUC-SYNCHRONOUS-COMMIT).
SYNCHRONOUS_COMMIT_LEVELS = ("off", "local", "remote_write", "on", "remote_apply")


@dataclass(frozen=True, kw_only=True)
class GuardConfig:
    """App-wide settings, built from the Celery config by :meth:`from_celery_conf`.

    Each field is read from the Celery key ``guard_<field>``, or ``<NAMESPACE>_GUARD_<FIELD>``
    when the app has a namespace (see the module docstring for the spelling rules).
    """

    #: SQLAlchemy URL of the store (the idempotency table lives in this database, and so must the
    #: tables a task writes through ``self.guard.transaction()``). ``postgresql://`` URLs use
    #: psycopg 3.
    store_url: str = DEFAULT_STORE_URL
    #: How the store URL's connections reach PostgreSQL: ``"session"`` (directly) or
    #: ``"transaction"`` (through PgBouncer, in transaction pooling or session pooling). In
    #: ``"transaction"`` the engine sends no startup ``options`` (set ``statement_timeout`` and
    #: ``lock_timeout`` on the role instead), psycopg prepares no statement, and the liveness
    #: locks need ``guard_liveness_url`` (or are off: a dead worker's keys then wait out the
    #: lease TTL). docs/pgbouncer.md.
    store_pooling: str = "session"
    #: PostgreSQL URL of the same database as the store, reached without a transaction pooler:
    #: the session the liveness locks are held on. ``None``: the store's URL, or no liveness
    #: locks when ``guard_store_pooling`` is ``"transaction"``.
    liveness_url: str | None = None
    #: Seconds any single store call may take (connect, lock wait, statement) before the delivery
    #: is treated as a coordination failure and tried again later.
    store_timeout: float = 5.0
    #: PostgreSQL: the ``synchronous_commit`` level of the claim's own commit; ``None`` keeps the
    #: session's. ``"off"`` lets the claim return without waiting for its WAL flush. A claim is
    #: a lock, not an effect: the completion marker and dead letters still commit durably, and
    #: WAL is flushed in order, so a durable completion makes its claim durable too. What a
    #: database crash can lose is a claim younger than about three ``wal_writer_delay``; its
    #: redelivery then claims again (docs/performance.md). Ignored on SQLite.
    claim_synchronous_commit: str | None = "off"
    #: Seconds a claim's lease lasts; a RUNNING key whose lease expired may be taken over.
    lease_ttl: float = 10.0
    #: Seconds a COMPLETED key keeps deduplicating (per task: ``idempotency_ttl``). ``None`` keeps
    #: it until pruned by hand; ``0`` dedups only while in flight.
    result_ttl: float | None = 7 * 24 * 3600.0
    #: Create the store's tables when a process first uses the store (``CREATE ... IF NOT
    #: EXISTS``). Turn off when the schema is managed by your own Alembic migrations.
    create_tables: bool = True
    #: Redis URL holding the leases (``SET NX PX``, Lua renew/release, ``INCR`` fencing
    #: counter), so heartbeats write nothing to the database. ``None``: leases live in the store.
    lease_url: str | None = None
    #: Seconds between lease renewals while a body runs; ``None`` means a third of the TTL.
    lease_renew_interval: float | None = None
    #: Seconds after which a running body's lease stops being renewed, so a body hung on I/O
    #: is taken over. ``None``: the task's ``time_limit`` if it has one, else no deadline.
    hard_deadline: float | None = None
    #: Progress mode: a body that has not called ``self.guard.progress()`` for this many
    #: seconds stops being renewed ("heartbeat but no progress"). ``None`` turns it off; per task:
    #: the ``progress_timeout`` option.
    progress_timeout: float | None = None
    #: Seconds between two passes of the reaper (recovery of orphaned keys, pruning).
    reaper_interval: float = 2.0
    #: Run the reaper in this worker (one worker at a time holds the reaper's lease).
    reaper_enabled: bool = True
    #: Seconds a warm shutdown waits for this worker's running bodies; keys still running then
    #: are revoked (token moved on, lease ended) so another worker takes them over at once.
    drain_timeout: float = 30.0
    #: On PostgreSQL, each worker process holds an advisory lock on a connection of its own, so
    #: the reaper can take a dead process's keys over at once instead of after the lease TTL.
    #: Costs one idle connection per process. Ignored on SQLite.
    liveness_locks: bool = True
    #: Executions a key may have (claims, counted in the store so crashes count too) before it
    #: is dead-lettered. Per task: ``max_attempts``.
    max_attempts: int = 5
    #: Full-jitter backoff: retry n waits random(0, min(backoff_max, backoff_base * 2**n)) s.
    backoff_base: float = 1.0
    backoff_max: float = 60.0
    #: Exception classes (or "module:Name" strings) to retry / to dead-letter at once, app-wide.
    #: Per task: ``transient_errors`` / ``permanent_errors``, consulted first.
    transient_errors: Any = ()
    permanent_errors: Any = ()
    #: Class of an exception nothing declares or recognises: "transient" or "permanent".
    default_error_class: str = "transient"
    #: Durable broker queue dead letters are also published to (nothing consumes it).
    dead_letter_queue: str = "celery_guard.dead_letters"
    #: Largest JSON, in bytes, celery_guard writes to the store for one delivery: a task's result
    #: above it is refused (``ResultTooLarge``, dead-lettered, nothing committed), and a task
    #: message above it is not stored with the claim (the task still runs, but after a whole
    #: worker dies only the broker's redelivery brings it back). ``None``: no bound, and a huge
    #: payload may then outlast ``guard_store_timeout`` on every attempt.
    max_payload_bytes: int | None = DEFAULT_MAX_PAYLOAD_BYTES
    #: Port the worker's main process serves Prometheus metrics on (children's values summed),
    #: or ``None`` for none. Not Flower's 5555 nor celery-exporter's 9808. Several workers on
    #: one host each need their own port; one that cannot bind logs an error and goes on.
    metrics_port: int | None = DEFAULT_METRICS_PORT
    #: Address the metrics endpoint listens on.
    metrics_address: str = "0.0.0.0"
    #: Store circuit breaker (backpressure): when too many of this worker's store calls fail,
    #: the worker stops consuming, probes the store, and resumes once it answers again.
    circuit_enabled: bool = True
    #: Share of store calls in the window that must fail for the circuit to open.
    circuit_failure_ratio: float = 0.5
    #: Fewest store calls in the window before the circuit may open (or the pool may shrink).
    circuit_min_calls: int = 5
    #: Seconds of store calls the breaker and adaptive concurrency look back over; the pool is
    #: resized at most once per window.
    circuit_window: float = 10.0
    #: Seconds between two probes of the store (``SELECT`` of its clock) while the circuit is
    #: open; the circuit closes after two probes in a row succeed.
    circuit_probe_interval: float = 1.0
    #: Seconds a delivery already prefetched waits for an open circuit to close before its
    #: message is given back to the broker unacknowledged (``Reject(requeue=True)``).
    circuit_hold: float = 5.0
    #: Prefork only: shrink the pool by one process when store calls time out (down to one
    #: process, at most once per window) and grow it back by one per healthy window.
    adaptive_concurrency: bool = True
    #: Share of store calls in the window that timed out above which the pool shrinks; a window
    #: below half of it is healthy.
    adaptive_timeout_ratio: float = 0.2
    #: Mean store-call latency (seconds) in the window above which the pool shrinks too;
    #: ``None``: only timeouts count.
    adaptive_latency: float | None = None
    #: Publish tracking (opt-in): a producer records each guarded publish in the store before
    #: sending it (one INSERT), and the reaper re-publishes those no worker ever claimed: a
    #: message the broker transport lost before any claim (kombu's Redis BRPOP window), or one
    #: a whole worker took with it when SIGKILLed. Turn it on in producers and workers alike.
    track_publishes: bool = False
    #: Seconds a tracked publish may stay unclaimed past its due time (its ETA, if any) before
    #: the reaper re-publishes it, and between two re-publishes of the same one. Longer than a
    #: message normally waits in a queue or prefetched by a busy worker.
    unclaimed_republish_after: float = 300.0
    #: Django only (``celery_guard.contrib.django``): the alias in ``DATABASES`` the store lives
    #: on; ``None`` means ``"default"``. Refused without the Django integration, where nothing
    #: would read it.
    database: str | None = None

    def __post_init__(self) -> None:
        _check_number("guard_store_timeout", self.store_timeout, minimum=0.001)
        _check_number("guard_lease_ttl", self.lease_ttl, minimum=0.1)
        if self.result_ttl is not None:
            _check_number("guard_result_ttl", self.result_ttl, minimum=0.0)
        for name in ("create_tables", "reaper_enabled", "liveness_locks"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigurationError(
                    f"guard_{name} must be True or False, got {getattr(self, name)!r}"
                )
        for name in ("lease_renew_interval", "hard_deadline", "progress_timeout"):
            if getattr(self, name) is not None:
                _check_number(f"guard_{name}", getattr(self, name), minimum=0.01)
        _check_number("guard_reaper_interval", self.reaper_interval, minimum=0.01)
        _check_number("guard_drain_timeout", self.drain_timeout, minimum=0.0)
        if isinstance(self.max_attempts, bool) or not isinstance(self.max_attempts, int):
            raise ConfigurationError(
                f"guard_max_attempts must be an integer, got {self.max_attempts!r}"
            )
        if self.max_attempts < 1:
            raise ConfigurationError(
                f"guard_max_attempts must be at least 1, got {self.max_attempts}"
            )
        _check_number("guard_backoff_base", self.backoff_base, minimum=0.0)
        _check_number("guard_backoff_max", self.backoff_max, minimum=0.0)
        if self.claim_synchronous_commit not in (None, *SYNCHRONOUS_COMMIT_LEVELS):
            raise ConfigurationError(
                "guard_claim_synchronous_commit must be None or one of "
                f"{', '.join(map(repr, SYNCHRONOUS_COMMIT_LEVELS))}, got "
                f"{self.claim_synchronous_commit!r}"
            )
        if self.default_error_class not in ("transient", "permanent"):
            raise ConfigurationError(
                "guard_default_error_class must be 'transient' or 'permanent', got "
                f"{self.default_error_class!r}"
            )
        if not isinstance(self.dead_letter_queue, str) or not self.dead_letter_queue:
            raise ConfigurationError(
                f"guard_dead_letter_queue must be a queue name, got {self.dead_letter_queue!r}"
            )
        for name in ("transient_errors", "permanent_errors"):
            object.__setattr__(self, name, import_classes(f"guard_{name}", getattr(self, name)))
        if self.lease_url is not None and (
            not isinstance(self.lease_url, str)
            or not self.lease_url.startswith(("redis://", "rediss://", "unix://"))
        ):
            raise ConfigurationError(
                f"guard_lease_url must be a redis://, rediss:// or unix:// URL, got "
                f"{_hide_password(self.lease_url)!r}"
            )
        if self.lease_renew_interval is not None and self.lease_renew_interval >= self.lease_ttl:
            raise ConfigurationError(
                f"guard_lease_renew_interval ({self.lease_renew_interval}) must be shorter than "
                f"guard_lease_ttl ({self.lease_ttl}), or the lease lapses between renewals"
            )
        if self.max_payload_bytes is not None and (
            isinstance(self.max_payload_bytes, bool)
            or not isinstance(self.max_payload_bytes, int)
            or self.max_payload_bytes < 1024
        ):
            raise ConfigurationError(
                f"guard_max_payload_bytes must be a number of bytes >= 1024 or None, got "
                f"{self.max_payload_bytes!r}"
            )
        if self.metrics_port is not None and (
            isinstance(self.metrics_port, bool)
            or not isinstance(self.metrics_port, int)
            or not 0 <= self.metrics_port <= 65535
        ):
            raise ConfigurationError(
                f"guard_metrics_port must be a TCP port (0-65535) or None, got "
                f"{self.metrics_port!r}"
            )
        if not isinstance(self.metrics_address, str) or not self.metrics_address:
            raise ConfigurationError(
                f"guard_metrics_address must be a host address, got {self.metrics_address!r}"
            )
        for name in ("circuit_enabled", "adaptive_concurrency"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigurationError(
                    f"guard_{name} must be True or False, got {getattr(self, name)!r}"
                )
        for name in ("circuit_failure_ratio", "adaptive_timeout_ratio"):
            _check_ratio(f"guard_{name}", getattr(self, name))
        if (
            isinstance(self.circuit_min_calls, bool)
            or not isinstance(self.circuit_min_calls, int)
            or self.circuit_min_calls < 1
        ):
            raise ConfigurationError(
                f"guard_circuit_min_calls must be an integer >= 1, got {self.circuit_min_calls!r}"
            )
        _check_number("guard_circuit_window", self.circuit_window, minimum=0.1)
        _check_number("guard_circuit_probe_interval", self.circuit_probe_interval, minimum=0.01)
        _check_number("guard_circuit_hold", self.circuit_hold, minimum=0.0)
        if self.adaptive_latency is not None:
            _check_number("guard_adaptive_latency", self.adaptive_latency, minimum=0.001)
        if not isinstance(self.track_publishes, bool):
            raise ConfigurationError(
                f"guard_track_publishes must be True or False, got {self.track_publishes!r}"
            )
        _check_positive("guard_unclaimed_republish_after", self.unclaimed_republish_after)
        if self.database is not None and (not isinstance(self.database, str) or not self.database):
            raise ConfigurationError(
                f"guard_database must be a database alias of Django's DATABASES, got "
                f"{self.database!r}"
            )
        # Normalises and checks the URL; the result is stored back on the frozen instance.
        object.__setattr__(self, "store_url", normalize_store_url(self.store_url))
        self._check_pooling()

    def _check_pooling(self) -> None:
        """``store_pooling`` and ``liveness_url``: PostgreSQL only, and consistent."""
        if self.store_pooling not in POOLING_MODES:
            raise ConfigurationError(
                f"guard_store_pooling must be one of {', '.join(map(repr, POOLING_MODES))}, got "
                f"{self.store_pooling!r}"
            )
        postgres = make_url(self.store_url).get_backend_name() == "postgresql"
        if self.store_pooling == "transaction" and not postgres:
            raise ConfigurationError(
                "guard_store_pooling = 'transaction' is for a PostgreSQL store behind a "
                f"transaction pooler (PgBouncer); the store is {self.safe_store_url()!r}"
            )
        if self.liveness_url is None:
            return
        if not postgres:
            raise ConfigurationError(
                "guard_liveness_url is for a PostgreSQL store; the store is "
                f"{self.safe_store_url()!r}"
            )
        if not self.liveness_locks:
            raise ConfigurationError(
                "guard_liveness_url is set but guard_liveness_locks is False: nothing would "
                "connect to it; remove one of them"
            )
        try:
            url = normalize_store_url(self.liveness_url)
        except ConfigurationError as exc:
            raise ConfigurationError(
                str(exc).replace("guard_store_url", "guard_liveness_url")
            ) from None
        if make_url(url).get_backend_name() != "postgresql":
            raise ConfigurationError(
                "guard_liveness_url must be a postgresql:// URL (a direct session to the "
                f"store's database), got {_hide_password(self.liveness_url)!r}"
            )
        object.__setattr__(self, "liveness_url", url)

    def __repr__(self) -> str:
        # Never the URLs' passwords: a repr ends up in logs and error reports (frame locals).
        shown = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "store_url"}
        shown["lease_url"] = _hide_password(self.lease_url)
        shown["liveness_url"] = _hide_password(self.liveness_url)
        text = ", ".join(f"{name}={value!r}" for name, value in shown.items())
        return f"GuardConfig(store_url={self.safe_store_url()!r}, {text})"

    @classmethod
    def from_celery_conf(
        cls,
        conf: Mapping[str, Any],
        namespace: str | None = None,
        defaults: Mapping[str, Any] | None = None,
    ) -> GuardConfig:
        """Build from a Celery config; unknown guard keys are refused with a suggestion.

        ``namespace`` is the app's (``app.namespace``); by default the one a Celery ``Settings``
        carries as its ``prefix``. Under it, ``<NAMESPACE>_GUARD_<FIELD>`` and ``guard_<field>``
        are both read; the two with different values are refused. ``defaults`` (field name ->
        value) replace the documented defaults of fields the config does not set: an
        integration's (Django's migrations own the schema, so ``create_tables`` is off there).
        """
        keys = list(conf.keys())  # first: a pending Celery config learns its prefix on loading
        if namespace is None:
            carried = getattr(conf, "prefix", None)
            namespace = carried if isinstance(carried, str) else None
        names = {f.name for f in fields(cls)}
        prefixes = [CONFIG_PREFIX]
        if namespace:
            prefixes.insert(0, f"{namespace.rstrip('_')}_{CONFIG_PREFIX}".lower())
        found: dict[str, tuple[str, Any]] = {}
        for raw_key in keys:
            raw = str(raw_key)
            key = raw.lower()
            prefix = next((p for p in prefixes if key.startswith(p)), None)
            if prefix is None:
                if not namespace and key.startswith(_DJANGO_STYLE_PREFIX):
                    plain = raw[len(_DJANGO_STYLE_PREFIX) - len(CONFIG_PREFIX) :]
                    raise ConfigurationError(
                        f"celery_guard setting {raw!r} is not read: the app has no namespace. "
                        "Pass namespace='CELERY' to app.config_from_object(), or spell it "
                        f"{plain!r}"
                    )
                continue
            name = key[len(prefix) :]
            if name not in names:
                hint = difflib.get_close_matches(name, names, n=1)
                suggestion = (
                    f"; did you mean {_spelled_like(raw, len(prefix), hint[0])!r}?" if hint else ""
                )
                raise ConfigurationError(f"unknown celery_guard setting {raw!r}{suggestion}")
            value = _raw_value(conf, raw_key)
            if name in found:
                other, other_value = found[name]
                if not _same(value, other_value):
                    raise ConfigurationError(
                        f"celery_guard setting {name!r} is set twice, as {other!r} and {raw!r}, "
                        "with different values; keep one"
                        + (
                            f", {_namespaced(namespace, name)!r} under the app's namespace"
                            if namespace
                            else ""
                        )
                    )
                continue
            found[name] = (raw, value)
        values = dict(defaults or {})
        values.update((name, value) for name, (_, value) in found.items())
        try:
            return cls(**values)
        except ConfigurationError as exc:
            spelled = {name: raw for name, (raw, _) in found.items()}
            message = _respell(str(exc), names, spelled, namespace)
            if message == str(exc):
                raise
            raise ConfigurationError(message) from None

    @property
    def error_policy(self) -> ErrorPolicy:
        """The app-wide classification (tasks add their own layer in front)."""
        return ErrorPolicy(
            layers=((self.transient_errors, self.permanent_errors),),
            default=ErrorClass(self.default_error_class),
        )

    @property
    def renew_interval(self) -> float:
        """Seconds between renewals: the configured interval or a third of the lease TTL."""
        return self.lease_renew_interval or self.lease_ttl / 3

    def safe_store_url(self) -> str:
        """The store URL with its password hidden, for logs and error messages."""
        return make_url(self.store_url).render_as_string(hide_password=True)


def _raw_value(conf: Mapping[str, Any], key: Any) -> Any:
    """``conf[key]`` as written: a Celery ``Settings`` with a prefix would answer a plain
    ``guard_x`` with the namespaced ``NS_GUARD_X`` (``ConfigurationView._to_keys``), hiding a
    conflict between the two."""
    for mapping in getattr(conf, "maps", ()):
        try:
            return mapping[key]
        except KeyError:
            continue
    return conf[key]


def _same(one: Any, other: Any) -> bool:
    try:
        return bool(one == other)
    except Exception:  # a value whose __eq__ fails cannot be shown to agree
        return False


def _spelled_like(raw: str, prefix_length: int, name: str) -> str:
    """``name`` behind ``raw``'s prefix, in the case ``raw`` uses (``GUARD_X`` / ``guard_x``)."""
    prefix = raw[:prefix_length]
    text = prefix + name
    return text.upper() if prefix.isupper() else text


def _namespaced(namespace: str, name: str) -> str:
    """The spelling Celery reads under ``namespace`` (``celery.utils.collections.match_case``)."""
    key = f"{namespace.rstrip('_')}_{CONFIG_PREFIX}{name}"
    return key.upper() if namespace.isupper() else key.lower()


#: A field named in a validation message: ``guard_lease_ttl`` (not ``celery_guard``).
_NAMED_FIELD = re.compile(r"\bguard_([a-z_]+[a-z])\b")


def _respell(
    message: str, names: set[str], spelled: Mapping[str, str], namespace: str | None
) -> str:
    """A validation message naming each setting as the config spells it."""

    def name(match: re.Match[str]) -> str:
        field = match.group(1)
        if field not in names:
            return match.group(0)
        if field in spelled:
            return spelled[field]
        return _namespaced(namespace, field) if namespace else match.group(0)

    return _NAMED_FIELD.sub(name, message)


def normalize_store_url(url: object) -> str:
    """Check a store URL and pin PostgreSQL to the psycopg 3 driver."""
    if isinstance(url, URL):
        parsed = url
    elif isinstance(url, str) and url:
        try:
            parsed = make_url(url)
        except (ArgumentError, ValueError) as exc:  # ValueError: a port that is not a number
            raise ConfigurationError(f"guard_store_url is not a database URL: {exc}") from None
    else:
        raise ConfigurationError(f"guard_store_url must be a URL string, got {url!r}")
    if parsed.drivername == "postgres":  # the spelling Heroku-style URLs use
        parsed = parsed.set(drivername="postgresql")
    backend = parsed.get_backend_name()
    if backend not in SUPPORTED_SCHEMES:
        raise ConfigurationError(
            f"guard_store_url scheme {parsed.drivername!r} is not supported; use one of "
            f"{', '.join(s + '://' for s in SUPPORTED_SCHEMES)}"
        )
    driver = parsed.get_driver_name()
    if backend == "postgresql":
        if parsed.drivername not in ("postgresql", "postgresql+psycopg"):
            raise ConfigurationError(
                f"guard_store_url driver {parsed.drivername!r} is not supported; celery_guard "
                "talks to PostgreSQL through psycopg 3 (postgresql+psycopg://)"
            )
        parsed = parsed.set(drivername="postgresql+psycopg")
    elif driver not in ("pysqlite", ""):
        raise ConfigurationError(
            f"guard_store_url driver {parsed.drivername!r} is not supported; use sqlite:///PATH"
        )
    return parsed.render_as_string(hide_password=False)


def _hide_password(url: object) -> object:
    """``url`` with the password of its ``user:password@`` part replaced by ``***``, even
    when the URL is malformed (no ``://``)."""
    if not isinstance(url, str) or "@" not in url:
        return url
    scheme, separator, rest = url.partition("://")
    prefix = scheme + separator if separator else ""
    credentials, _, host = (rest if separator else url).rpartition("@")
    user = credentials.split(":", 1)[0]
    return f"{prefix}{user}:***@{host}" if ":" in credentials else url


def _check_number(name: str, value: object, *, minimum: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigurationError(f"{name} must be a number of seconds, got {value!r}")
    if not math.isfinite(value) or value < minimum:
        raise ConfigurationError(f"{name} must be a finite number >= {minimum}, got {value!r}")


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigurationError(f"{name} must be a number of seconds, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ConfigurationError(f"{name} must be a finite number of seconds > 0, got {value!r}")


def _check_ratio(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigurationError(f"{name} must be a number between 0 and 1, got {value!r}")
    if not math.isfinite(value) or not 0 < value <= 1:
        raise ConfigurationError(f"{name} must be a number > 0 and <= 1, got {value!r}")


def check_ttl_option(name: str, value: object) -> float | None:
    """Validate a retention in seconds (``None`` = forever) given as a task option."""
    if value is None:
        return None
    _check_number(name, value, minimum=0.0)
    return float(value)  # type: ignore[arg-type]


OptionChecker = Callable[[str, object], object]
