"""Recovery: what the reaper and a draining worker ask of the keys and leaders tables.

Leadership (one reaper holder per cluster, ``celery_guard_leaders``), orphans (RUNNING keys
whose lease expired) and their re-publish marks, owners whose liveness lock is gone, a draining
worker's keys (counted, then revoked), and pruning of COMPLETED keys past their retention with
the token floor that keeps fencing tokens rising across a prune.
"""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import case, delete, exists, func, or_, select, text, update

from celery_guard.store.base import KeyRecord
from celery_guard.store.engine import StoreEngine, only_row
from celery_guard.store.keys import COMPLETED_SQL, RUNNING, RUNNING_SQL, owned_by_token
from celery_guard.store.queries import texts
from celery_guard.store.schema import TOKEN_FLOOR, db_epoch_now, keys, leaders, published

#: The hand-written statements, by name (queries/recovery.sql).
SQL = texts("celery_guard.store.queries", "recovery.sql")

#: Keys one pruning statement deletes, and batches one :meth:`Recovery.prune_pass` runs at
#: most: a batch is three short statements (bench/scale.py measures their pace).
PRUNE_BATCH = 1000
PRUNE_MAX_BATCHES = 50


class Recovery:
    """The reaper's primitives: leadership, orphans, dead owners, revocation and pruning."""

    def __init__(self, db: StoreEngine) -> None:
        self.db = db

    # -- leadership ---------------------------------------------------------------------------

    def acquire_leadership(self, name: str, holder: str, ttl: float) -> bool:
        """Take or keep the named lease for ``holder``; True while ``holder`` has it."""
        now = db_epoch_now()
        insert = self.db.upsert(leaders).values(
            name=name, holder=holder, term=1, expires_at=now + ttl
        )
        new = insert.excluded
        free = or_(leaders.c.expires_at <= now, leaders.c.holder == new.holder)
        statement = insert.on_conflict_do_update(
            index_elements=[leaders.c.name],
            set_={
                "holder": case((free, new.holder), else_=leaders.c.holder),
                "term": case(
                    (leaders.c.holder == new.holder, leaders.c.term),
                    (free, leaders.c.term + 1),
                    else_=leaders.c.term,
                ),
                "expires_at": case((free, new.expires_at), else_=leaders.c.expires_at),
            },
        ).returning(leaders.c.holder)
        row = only_row(self.db.call(lambda: self.db.execute_single(statement))[0])
        return bool(row["holder"] == holder)

    def resign_leadership(self, name: str, holder: str) -> None:
        """Give the named lease up at once (clean shutdown), if ``holder`` has it."""
        statement = (
            update(leaders)
            .where(leaders.c.name == name, leaders.c.holder == holder)
            .values(expires_at=db_epoch_now())
        )
        self.db.call(lambda: self.db.execute_single(statement))

    def leader(self, name: str) -> tuple[str, int, float] | None:
        """The named leader lease as (holder, term, expires_at), or ``None`` if never taken."""
        statement = select(leaders).where(leaders.c.name == name)
        rows = self.db.call(lambda: self.db.execute_single(statement, read_only=True))[0]
        if not rows:
            return None
        return str(rows[0]["holder"]), int(rows[0]["term"]), float(rows[0]["expires_at"])

    # -- orphans and dead owners --------------------------------------------------------------

    def orphans(self, republish_after: float, limit: int) -> list[KeyRecord]:
        """RUNNING keys whose lease expired, not re-published in the last ``republish_after`` s."""
        now = db_epoch_now()
        statement = (
            select(keys)
            .where(
                keys.c.state == RUNNING_SQL,
                keys.c.lease_expires_at <= now,
                or_(
                    keys.c.republished_at.is_(None),
                    keys.c.republished_at <= now - republish_after,
                ),
            )
            .order_by(keys.c.lease_expires_at)
            .limit(limit)
        )
        rows = self.db.call(lambda: self.db.execute_single(statement, read_only=True))[0]
        return [KeyRecord.from_mapping(row) for row in rows]

    def mark_republished(self, key: str, token: int, republish_after: float) -> bool:
        """Record a re-publish; False when someone claimed or re-published the key meanwhile."""
        now = db_epoch_now()
        statement = (
            update(keys)
            .where(
                keys.c.key == key,
                keys.c.fencing_token == token,
                keys.c.state == RUNNING,
                keys.c.lease_expires_at <= now,
                or_(
                    keys.c.republished_at.is_(None),
                    keys.c.republished_at <= now - republish_after,
                ),
            )
            .values(republished_at=now)
        )
        return self.db.call(lambda: self.db.execute_single(statement))[1] == 1

    def dead_owner_keys(self, limit: int) -> list[tuple[str, int, bool]]:
        """RUNNING keys whose owner's liveness lock is gone (PostgreSQL only).

        Returns (key, fencing token, whether the row's lease is still running).
        """
        if self.db.dialect_name != "postgresql":
            return []
        rows = self.db.call(
            lambda: self.db.execute_single(_DEAD_OWNERS, {"p_limit": limit}, read_only=True)
        )[0]
        return [(row["key"], int(row["fencing_token"]), bool(row["live"])) for row in rows]

    def expire_lease(self, key: str, token: int) -> bool:
        """End a running lease now (its owner is dead), so the orphan pass takes it over."""
        parameters = {"p_key": key, "p_token": token}
        return self.db.call(lambda: self.db.execute_single(_EXPIRE_LEASE, parameters))[1] == 1

    def running_of(self, owner: str, limit: int) -> list[tuple[str, int, bool]]:
        """RUNNING keys whose owner is exactly ``owner`` (one pool process that died).

        Returns (key, fencing token, whether the row's lease is still running).
        """
        statement = (
            select(
                keys.c.key,
                keys.c.fencing_token,
                (keys.c.lease_expires_at > db_epoch_now()).label("live"),
            )
            .where(keys.c.state == RUNNING, keys.c.owner == owner)
            .limit(limit)
        )
        rows = self.db.call(lambda: self.db.execute_single(statement, read_only=True))[0]
        return [(row["key"], int(row["fencing_token"]), bool(row["live"])) for row in rows]

    # -- a draining worker's keys -------------------------------------------------------------

    def count_running_owned(self, owner_prefix: str) -> int:
        """RUNNING keys whose owner string starts with ``owner_prefix`` (one worker's)."""
        statement = (
            select(func.count())
            .select_from(keys)
            .where(
                keys.c.state == RUNNING_SQL,
                func.substr(keys.c.owner, 1, len(owner_prefix)) == owner_prefix,
            )
        )
        rows = self.db.call(lambda: self.db.execute_single(statement, read_only=True))[0]
        return int(next(iter(rows[0].values())))

    def revoke_owned(self, owner_prefix: str) -> list[tuple[str, int]]:
        """Move the token on and end the lease of a worker's RUNNING keys.

        Its executions are fenced (renewal and commit refused) and the reaper recovers the keys
        at once. Returns (key, the token that was revoked).
        """
        statement = (
            update(keys)
            .where(
                keys.c.state == RUNNING_SQL,
                func.substr(keys.c.owner, 1, len(owner_prefix)) == owner_prefix,
            )
            .values(
                fencing_token=keys.c.fencing_token + 1,
                lease_expires_at=db_epoch_now(),
                updated_at=db_epoch_now(),
            )
            .returning(keys.c.key, keys.c.fencing_token)
        )
        rows = self.db.call(lambda: self.db.execute_single(statement))[0]
        return [(row["key"], int(row["fencing_token"]) - 1) for row in rows]

    # -- pruning ------------------------------------------------------------------------------

    def prune_completed(self, limit: int, keep_tracked: bool = False) -> int:
        """Delete up to ``limit`` COMPLETED keys whose retention ended; return how many.

        A deleted row takes its fencing tokens with it, and the key's next claim inserts a new
        row. So the token floor is raised to the highest token of the rows about to go, and only
        rows at or below the floor are deleted: a new row starts above the floor
        (:data:`~celery_guard.store.schema.TOKEN_FLOOR`), and an execution still holding a token
        of the old row stays fenced.

        ``keep_tracked`` (publish tracking on): a key whose tracked publish is still recorded
        stays until the reaper has forgotten that record. Pruned first, the record would look
        never claimed and be re-published, running a ``guard_result_ttl = 0`` task again.
        """
        db = self.db
        # The database's clock read once, then bound as a number: an expression on
        # clock_timestamp() is volatile, so PostgreSQL can only filter the index with it, not
        # bound the scan; once the backlog was gone every batch read the whole index to find
        # its few rows (0.9 s per statement at a million rows, bench/scale.py).
        now = db.now()
        expired: tuple[Any, ...] = (
            keys.c.state == COMPLETED_SQL,
            keys.c.expires_at.is_not(None),
            keys.c.expires_at <= now,
        )
        if keep_tracked:
            expired += (~exists().where(published.c.key == keys.c.key),)
        # In expiry order: the planner then reads the partial index (schema.PRUNABLE_INDEX)
        # from its oldest entry. Without an order it chose a sequential scan (EXPLAIN at a
        # million rows), which reads the pages earlier batches emptied before it finds rows.
        batch = (
            select(keys.c.fencing_token)
            .where(*expired)
            .order_by(keys.c.expires_at)
            .limit(limit)
            .subquery()
        )
        highest = select(func.max(batch.c.fencing_token).label("highest"))
        rows = db.call(lambda: db.execute_single(highest, read_only=True))[0]
        if only_row(rows)["highest"] is None:
            return 0
        raise_floor = db.upsert(leaders).values(
            name=TOKEN_FLOOR, holder="", term=int(only_row(rows)["highest"]), expires_at=0.0
        )
        new = raise_floor.excluded
        statement = raise_floor.on_conflict_do_update(
            index_elements=[leaders.c.name],
            set_={"term": case((new.term > leaders.c.term, new.term), else_=leaders.c.term)},
        ).returning(leaders.c.term)
        floor = int(only_row(db.call(lambda: db.execute_single(statement))[0])["term"])
        doomed = (
            select(keys.c.key)
            .where(*expired, keys.c.fencing_token <= floor)
            .order_by(keys.c.expires_at)
            .limit(limit)
            .scalar_subquery()
        )
        # The conditions again on the deleted row itself: a claim may take an expired key
        # over between the subquery's snapshot and the delete, and PostgreSQL re-checks only
        # the outer conditions against the row's new version (READ COMMITTED's re-check).
        statement = delete(keys).where(
            keys.c.key.in_(doomed), *expired, keys.c.fencing_token <= floor
        )
        return db.call(lambda: db.execute_single(statement))[1]

    def prune_pass(
        self,
        budget: float,
        keep_tracked: bool = False,
        batch: int = PRUNE_BATCH,
        max_batches: int = PRUNE_MAX_BATCHES,
    ) -> int:
        """Prune batches of ``batch`` keys (:meth:`prune_completed`) until a batch comes back
        short, ``budget`` seconds have passed, or ``max_batches`` ran; return how many.

        Bounded three ways, so a reaper pass that meets a large expired backlog (a retention
        shortened, a cluster that was down) still ends in time, and the next pass goes on.
        """
        deadline = time.monotonic() + budget
        pruned = 0
        for _ in range(max_batches):
            deleted = self.prune_completed(batch, keep_tracked=keep_tracked)
            pruned += deleted
            if deleted < batch or time.monotonic() >= deadline:
                break
        return pruned

    def token_floor(self) -> int:
        """The highest fencing token of any pruned row (0 when none was pruned)."""
        leader = self.leader(TOKEN_FLOOR)
        return 0 if leader is None else leader[1]

    def now(self) -> float:
        """The database's clock, in epoch seconds (what every lease time is in)."""
        return self.db.now()


_EXPIRE_LEASE = (
    update(keys)
    .where(owned_by_token, keys.c.lease_expires_at > db_epoch_now())
    .values(lease_expires_at=db_epoch_now())
)

_DEAD_OWNERS = text(SQL["dead_owners"])
