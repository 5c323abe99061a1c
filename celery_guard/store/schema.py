"""The store's schema, as SQLAlchemy ``MetaData`` so it can live under a user's own Alembic.

Times are seconds since the epoch *by the database's clock* (:class:`db_epoch_now`): every lease
comparison is made by one clock, so workers whose clocks disagree still agree on who owns a key.
"""

from __future__ import annotations

import enum
from typing import Any

from sqlalchemy import (
    BigInteger,
    Column,
    Double,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    text,
)
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.functions import FunctionElement

from celery_guard.keys import MAX_KEY_LENGTH

#: Add it to your Alembic ``target_metadata`` (a list of MetaData is accepted) to manage the
#: celery_guard tables with your own migrations.
metadata = MetaData()


class KeyState(str, enum.Enum):
    """States of an idempotency key. COMPLETED never goes back to RUNNING while retained."""

    #: Claimed by an execution that holds the lease.
    RUNNING = "RUNNING"
    #: Finished; the stored result answers every later delivery until the retention ends.
    COMPLETED = "COMPLETED"
    #: The last execution ended without completing (an error, ``retry()``, ``replace()``); the
    #: next delivery may claim it.
    RELEASED = "RELEASED"
    #: Dead-lettered (a permanent error, exhausted attempts, a poison pill): final until an
    #: operator replays it.
    DEAD = "DEAD"


class ClaimReason(str, enum.Enum):
    """How the current owner got the key; kept on the row for operators and metrics."""

    NEW = "NEW"  #: no live row: a first run (or the retention of an old result ended)
    RETRY = "RETRY"  #: the key had been RELEASED by an earlier execution
    TAKEOVER = "TAKEOVER"  #: the previous owner's lease had expired


#: The partial index of the RUNNING keys (the reaper's orphan and dead-owner scans).
RUNNING_INDEX = "ix_celery_guard_keys_running"
RUNNING_PREDICATE = "state = 'RUNNING'"
#: The partial index pruning reads: COMPLETED keys that have an expiry, by expiry.
PRUNABLE_INDEX = "ix_celery_guard_keys_prunable"
PRUNABLE_PREDICATE = "state = 'COMPLETED' AND expires_at IS NOT NULL"
#: The first schema's indexes on the keys table, replaced by the two above
#: (:mod:`celery_guard.store.upgrade` drops them).
LEGACY_KEY_INDEXES = ("ix_celery_guard_keys_state_lease", "ix_celery_guard_keys_expires_at")
#: PostgreSQL storage parameters of the keys table (``CREATE TABLE ... WITH``).
KEYS_TABLE_OPTIONS = {
    "autovacuum_vacuum_scale_factor": "0.05",
    "autovacuum_vacuum_insert_scale_factor": "0.05",
}

keys = Table(
    "celery_guard_keys",
    metadata,
    Column("key", String(MAX_KEY_LENGTH), primary_key=True),
    Column("task_name", String(255), nullable=False),
    Column("state", String(16), nullable=False),
    Column("attempts", Integer, nullable=False),
    Column("fencing_token", BigInteger, nullable=False),
    Column("lease_expires_at", Double, nullable=True),
    Column("owner", String(255), nullable=True),
    # The advisory-lock id the owner process holds on PostgreSQL while it lives (NULL when it
    # holds none): a dead owner's lock vanishes with its connection, so the reaper can tell
    # dead from slow without waiting out the lease.
    Column("owner_lock", BigInteger, nullable=True),
    # Random per claim call: tells the claimer "this row is now yours" from the RETURNING row
    # alone, and makes a claim resent after a lost reply recognise itself.
    Column("claim_id", String(32), nullable=True),
    Column("claim_reason", String(16), nullable=True),
    Column("fingerprint", String(64), nullable=True),
    # JSON of what re-publishing the task needs (name, args, kwargs, routing, headers).
    Column("message", Text, nullable=True),
    Column("result", Text, nullable=True),
    Column("last_error", Text, nullable=True),
    Column("duplicates", Integer, nullable=False, default=0),
    Column("created_at", Double, nullable=False),
    Column("updated_at", Double, nullable=False),
    Column("completed_at", Double, nullable=True),
    # When a COMPLETED key stops deduplicating; NULL keeps it until pruned by hand.
    Column("expires_at", Double, nullable=True),
    # When the reaper last re-published this orphaned key's message (cleared by a claim).
    Column("republished_at", Double, nullable=True),
    # Partial indexes: each holds only the rows its scan reads. The RUNNING keys the reaper
    # and ``guard status`` look at are a few thousand however large the table grows; keyed on
    # updated_at, which a lease renewal and a re-publish mark leave alone, so those updates
    # stay HOT (no new index entries). The second is what pruning reads, in expiry order.
    Index(
        RUNNING_INDEX,
        "updated_at",
        postgresql_where=text(RUNNING_PREDICATE),
        sqlite_where=text(RUNNING_PREDICATE),
    ),
    Index(
        PRUNABLE_INDEX,
        "expires_at",
        postgresql_where=text(PRUNABLE_PREDICATE),
        sqlite_where=text(PRUNABLE_PREDICATE),
    ),
    # A vacuum every 5% of dead rows instead of 20%: pruning deletes as fast as claims
    # insert, and at ten million rows 20% is two million dead rows. No fillfactor: 90 made
    # the duplicates' counter updates HOT but the table 14% larger at ten million rows, more
    # than the partial indexes saved (bench/scale.py, measured both ways).
    postgresql_with=KEYS_TABLE_OPTIONS,
)


#: Dead letters: what failed, why, and everything needed to replay it.
dead_letters = Table(
    "celery_guard_dead_letters",
    metadata,
    Column(
        "id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    ),
    Column("key", String(MAX_KEY_LENGTH), nullable=False),
    Column("task_name", String(255), nullable=False),
    Column("task_id", String(255), nullable=True),
    # JSON of the original message: task, id, args, kwargs, headers, routing.
    Column("message", Text, nullable=True),
    Column("error_class", String(16), nullable=False),
    Column("error_type", String(255), nullable=False),
    Column("error", Text, nullable=False),
    Column("traceback", Text, nullable=True),
    Column("reason", Text, nullable=False),
    Column("attempts", Integer, nullable=False),
    Column("created_at", Double, nullable=False),
    Column("replayed_at", Double, nullable=True),
    Index("ix_celery_guard_dead_letters_task_created", "task_name", "created_at"),
)

#: Leases that elect one holder across the cluster (the reaper's, for one). The row named
#: ``celery_guard.token_floor`` is no lease: its ``term`` is the highest fencing token of any
#: pruned key row, and a key's new row starts above it.
leaders = Table(
    "celery_guard_leaders",
    metadata,
    Column("name", String(100), primary_key=True),
    Column("holder", String(255), nullable=False),
    Column("term", BigInteger, nullable=False),
    Column("expires_at", Double, nullable=False),
)

#: The ``celery_guard_leaders`` row whose ``term`` is the highest fencing token of any pruned
#: key row: a key's new row starts above it, so tokens rise across a prune too.
TOKEN_FLOOR = "celery_guard.token_floor"


#: One row per running worker, written by its main process every reaper interval: who is alive
#: (by heartbeat, not by broker events) and in which state, for ``guard status`` and metrics.
workers = Table(
    "celery_guard_workers",
    metadata,
    Column("hostname", String(255), primary_key=True),
    Column("pid", Integer, nullable=False),
    Column("state", String(16), nullable=False),
    Column("running", Integer, nullable=False),
    Column("fenced", Integer, nullable=False),
    Column("circuit", String(16), nullable=True),
    Column("started_at", Double, nullable=False),
    Column("seen_at", Double, nullable=False),
    Column("expires_at", Double, nullable=False),
)


#: Publish tracking (``guard_track_publishes``, opt-in): one row per idempotency key a producer
#: published that no worker has claimed yet, written before the message reaches the broker. A
#: message the broker transport loses before any claim (kombu's Redis BRPOP window) leaves no
#: key row for the reaper to see; this row is what it re-publishes instead. The reaper deletes
#: a row once its key has a row in ``celery_guard_keys``.
published = Table(
    "celery_guard_published",
    metadata,
    Column("key", String(MAX_KEY_LENGTH), primary_key=True),
    Column("task_name", String(255), nullable=False),
    Column("task_id", String(255), nullable=False),
    # JSON of what re-publishing needs, in the keys table's ``message`` format.
    Column("message", Text, nullable=False),
    Column("published_at", Double, nullable=False),
    # The producer's ``guard_published_at`` header (its own clock): compared with the headers of
    # the messages waiting in a Redis queue, which carry the same kind of clock.
    Column("publisher_stamp", Double, nullable=True),
    # Publish time plus the ETA/countdown, by the database's clock.
    Column("due_at", Double, nullable=False),
    Column("expires_at", Double, nullable=True),
    # When the reaper's delay starts counting: the due time, then the last re-publish (or the
    # last pass that found the message still waiting in its queue).
    Column("waiting_since", Double, nullable=False),
    Column("republished_at", Double, nullable=True),
    Column("republishes", Integer, nullable=False, default=0),
    Index("ix_celery_guard_published_waiting_since", "waiting_since"),
)


#: The database's clock in epoch seconds, as SQL text per dialect: what :class:`db_epoch_now`
#: compiles to, and what the hand-written claim (``queries/keys.sql``) is given as ``{now}``.
EPOCH_NOW_SQL = {
    # clock_timestamp(), not now(): now() is frozen at transaction start, and a long user
    # transaction must not complete against a stale clock.
    "postgresql": "CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS DOUBLE PRECISION)",
    "sqlite": "((julianday('now') - 2440587.5) * 86400.0)",
}


class db_epoch_now(FunctionElement[float]):  # reads like the SQL function it is
    """The database's current time in epoch seconds (fractional), evaluated per statement."""

    type = Double()
    inherit_cache = True
    name = "db_epoch_now"


@compiles(db_epoch_now, "postgresql")
def _pg_epoch_now(element: db_epoch_now, compiler: Any, **kw: Any) -> str:
    return EPOCH_NOW_SQL["postgresql"]


@compiles(db_epoch_now, "sqlite")
def _sqlite_epoch_now(element: db_epoch_now, compiler: Any, **kw: Any) -> str:
    return EPOCH_NOW_SQL["sqlite"]


@compiles(db_epoch_now)
def _default_epoch_now(element: db_epoch_now, compiler: Any, **kw: Any) -> str:
    raise NotImplementedError(f"celery_guard has no clock expression for {compiler.dialect.name}")
