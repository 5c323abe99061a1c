"""``celery_guard_keys``: the hot path (claim, complete, release) and the key queries.

The claim, the completion marker and the release are what every delivery runs: each is one
statement in one round trip (a claim of a key thought new that exists after all, two), on
PostgreSQL through :meth:`StoreEngine.execute_hot` (the hot connection and the
compiled-statement cache). The claim is hand-written SQL (``queries/keys.sql``); everything
else is SQLAlchemy Core.

The operator's reads of the keys table (``guard status``, ``guard keys``, the sampler) are here
too, beside the table they read, in their own section: a consumer sees only the part it needs
through its protocol in :mod:`celery_guard.store.base`.
"""

from __future__ import annotations

import functools
import itertools
import os
from collections.abc import Callable, Iterable
from typing import Any

import psycopg
from sqlalchemy import (
    BigInteger,
    Connection,
    Double,
    RootTransaction,
    and_,
    bindparam,
    func,
    literal_column,
    or_,
    select,
    text,
    tuple_,
    update,
)
from sqlalchemy import exc as sa_exc
from sqlalchemy.sql.elements import ColumnClause

from celery_guard.errors import Fenced
from celery_guard.store.base import (
    ClaimOutcome,
    ClaimRequest,
    ClaimResult,
    DeadLetter,
    DeadLetterStore,
    KeyRecord,
    assembled,
)
from celery_guard.store.engine import StoreEngine, only_row
from celery_guard.store.queries import texts
from celery_guard.store.schema import (
    EPOCH_NOW_SQL,
    TOKEN_FLOOR,
    ClaimReason,
    KeyState,
    db_epoch_now,
    keys,
)

RUNNING = KeyState.RUNNING.value
COMPLETED = KeyState.COMPLETED.value
RELEASED = KeyState.RELEASED.value
DEAD = KeyState.DEAD.value

#: The states as SQL literals, not bound parameters, where a scan must match a partial index
#: (schema.RUNNING_INDEX, schema.PRUNABLE_INDEX): a prepared statement's generic plan cannot
#: prove that ``state = $1`` implies the index's predicate, and would scan the table instead.
RUNNING_SQL: ColumnClause[str] = literal_column(f"'{RUNNING}'")
COMPLETED_SQL: ColumnClause[str] = literal_column(f"'{COMPLETED}'")

#: The hand-written parts of the claim, by name (queries/keys.sql).
SQL = texts("celery_guard.store.queries", "keys.sql")


class _ClaimIds:
    """Unique claim ids without a random draw per claim: this process's random prefix and a
    counter (32 hex digits, as a uuid4's hex), drawn again in a forked child."""

    def __init__(self) -> None:
        self._start()
        os.register_at_fork(after_in_child=self._start)

    def _start(self) -> None:
        self._prefix = os.urandom(8).hex()
        self._counter = itertools.count()

    def next(self) -> str:
        return f"{self._prefix}{next(self._counter):016x}"


_claim_ids = _ClaimIds()


class Keys:
    """The idempotency keys: one delivery's claim, completion and release, and the key reads."""

    def __init__(self, db: StoreEngine, dead_letters: DeadLetterStore) -> None:
        self.db = db
        self._dead_letters = dead_letters

    # -- the primitives -----------------------------------------------------------------------

    def claim(self, request: ClaimRequest) -> ClaimResult:
        """Insert or take over the key's row and say what happened.

        The record is the row as the claim left it, except that its ``message`` is read back
        only for a DEAD key and its ``result`` only for a COMPLETED one (``None`` otherwise):
        what the handler reads, without sending the stored texts back on every claim.

        On PostgreSQL, when ``request.likely_new``, a key without a row is claimed by a plain
        insert (``claim_new`` in queries/keys.sql), a quarter cheaper for the server than the
        upsert (bench/claim_cost.py), which then runs only when the key exists; a claim of a
        key that likely exists (a retry, a deferral, a redelivery) goes to the upsert at once,
        as two statements would cost it more. Both are in one store call: a resent insert
        whose first reply was lost finds its own row, and the upsert answers CLAIMED for it
        (the claim id matches).
        """
        claim_id = _claim_ids.next()
        db = self.db
        variant = (
            db.dialect_name,
            request.check_fingerprint,
            request.external_token is not None,
            db.config.claim_synchronous_commit,
        )
        parameters = {
            "p_key": request.key,
            "p_task_name": request.task_name,
            "p_owner": request.owner,
            "p_owner_lock": request.owner_lock,
            "p_claim_id": claim_id,
            "p_fingerprint": request.fingerprint,
            "p_message": request.message,
            "p_lease_ttl": request.lease_ttl,
        }
        if request.external_token is not None:
            parameters["p_external_token"] = request.external_token
        first_try = (
            _claim_new_statement(*variant)
            if request.likely_new and db.dialect_name == "postgresql"
            else None
        )

        def claim() -> tuple[dict[str, Any], bool]:
            if first_try is not None:
                rows = db.execute_hot(first_try, parameters)[0]
                if rows:
                    return rows[0], True
            return only_row(db.execute_hot(_claim_statement(*variant), parameters)[0]), False

        row, new = db.call(claim)
        if new:
            return ClaimResult(
                outcome=ClaimOutcome.CLAIMED,
                record=_new_record(request, claim_id, row),
                lease_remaining=float(row["lease_remaining"]),
            )
        record = KeyRecord.from_mapping(row)
        return ClaimResult(
            outcome=_classify(record, request, claim_id),
            record=record,
            lease_remaining=float(row["lease_remaining"] or 0.0),
        )

    def complete(
        self,
        key: str,
        token: int,
        result: str,
        retention: float | None,
        connection: Connection | None = None,
    ) -> None:
        """Mark the key COMPLETED with its result if ``token`` still owns it, else raise Fenced.

        With ``connection`` the marker joins that open transaction (the task's own writes) and the
        caller commits; without it the marker is one autocommitted statement.
        """
        db = self.db
        statement, parameters = completion(key, token, result, retention)
        if connection is not None and db.dialect_name == "postgresql":
            rowcount = db.call(
                lambda: db.execute_in_transaction(connection, statement, parameters), retry=False
            )
        elif connection is not None:
            rowcount = db.call(lambda: connection.execute(statement, parameters).rowcount)
        else:
            rowcount = db.call(lambda: db.execute_hot(statement, parameters))[1]
        if rowcount == 1:
            return
        if connection is None:
            # A resent autocommit statement whose first reply was lost finds its own row.
            record = self.get(key)
            if record is not None and record.state == COMPLETED and record.fencing_token == token:
                return
        raise Fenced(key, token)

    def release(self, key: str, token: int, error: str | None) -> bool:
        """Give the key up after an execution that did not complete; False if it was not ours."""
        db = self.db
        parameters = {"p_key": key, "p_token": token, "p_error": error}
        return db.call(lambda: db.execute_hot(_RELEASE, parameters))[1] == 1

    def dead_letter(self, token: int, letter: DeadLetter) -> DeadLetter:
        """Mark the key DEAD (if ``token`` still owns it) and store the letter, atomically.

        The end of an execution like :meth:`release`, so the handler finds it here; the
        statement is the dead-letter table's (:meth:`DeadLetters.dead_letter`).
        """
        return self._dead_letters.dead_letter(token, letter)

    def get(self, key: str) -> KeyRecord | None:
        """The key's row, or ``None``."""
        db = self.db
        parameters = {"p_key": key}
        rows = db.call(lambda: db.execute_single(_GET, parameters, read_only=True))[0]
        return KeyRecord.from_mapping(rows[0]) if rows else None

    def renew_leases(self, leases: Iterable[tuple[str, int]], ttl: float) -> set[str]:
        """Extend the leases still held by their tokens, in one statement; return those keys."""
        pairs = list(leases)
        if not pairs:
            return set()
        now = db_epoch_now()
        statement = (
            update(keys)
            .where(
                tuple_(keys.c.key, keys.c.fencing_token).in_(pairs),
                keys.c.state == RUNNING,
            )
            .values(lease_expires_at=now + ttl)
            .returning(keys.c.key)
        )
        rows = self.db.call(lambda: self.db.execute_single(statement))[0]
        return {row["key"] for row in rows}

    # -- the body's own transaction -----------------------------------------------------------

    def connect(self, on_boundary: Callable[[str], None] | None = None) -> Connection:
        """A new connection for a task's own transaction; the caller closes it.

        ``on_boundary`` is called with ``"commit"`` or ``"rollback"`` before SQLAlchemy ends a
        transaction on this connection, however it is asked to (``Connection.commit()``, an ORM
        ``Session`` that controls it, ``close()``); an exception it raises stops the statement
        from being sent. ``Execution`` uses it so a task body cannot end the transaction that
        must commit with the key's COMPLETED marker. Savepoints are not reported.
        """
        db = self.db
        engine = db.ready_engine()
        connection = None
        if db.budget == "child" and db.dialect_name == "postgresql":
            # The connection the claim ran on, out of autocommit until the loan ends: a pool
            # process holds one connection in all (docs/design.md).
            connection = db.call(lambda: db.lend(engine, transaction=True, on_boundary=on_boundary))
        if connection is None:
            connection = db.call(lambda: db.connect(engine, on_boundary))
        return connection

    def commit(self, transaction: RootTransaction) -> None:
        """Commit a task's transaction; failures are store errors (never resent: not idempotent)."""
        self.db.commit(transaction)

    def transaction_failed(self, connection: Connection) -> bool:
        """True when a statement failed in the open transaction on ``connection`` and the
        transaction can now only roll back (PostgreSQL's "current transaction is aborted"); a
        failed SQLite statement leaves its transaction usable."""
        if self.db.dialect_name != "postgresql" or connection.closed:
            return False
        try:
            driver = connection.connection.dbapi_connection
        except sa_exc.SQLAlchemyError:
            return False
        status = getattr(getattr(driver, "info", None), "transaction_status", None)
        return status == psycopg.pq.TransactionStatus.INERROR

    # -- operator reads (guard status, guard keys, the sampler) -------------------------------
    # Read-only, bounded, one statement each.

    def count_keys_by_state(self) -> dict[str, int]:
        """How many keys are in each state (states without keys are absent)."""
        statement = select(keys.c.state, func.count().label("n")).group_by(keys.c.state)
        rows = self.db.call(lambda: self.db.execute_single(statement, read_only=True))[0]
        return {str(row["state"]): int(row["n"]) for row in rows}

    def oldest_running(self) -> KeyRecord | None:
        """The RUNNING key claimed longest ago (a claim sets ``updated_at``), or ``None``."""
        statement = (
            select(keys)
            .where(keys.c.state == RUNNING_SQL)
            .order_by(keys.c.updated_at, keys.c.key)
            .limit(1)
        )
        rows = self.db.call(lambda: self.db.execute_single(statement, read_only=True))[0]
        return KeyRecord.from_mapping(rows[0]) if rows else None

    def count_expired_leases(self) -> int:
        """RUNNING keys whose row lease has expired (what the reaper treats as orphans)."""
        statement = (
            select(func.count().label("n"))
            .select_from(keys)
            .where(
                keys.c.state == RUNNING_SQL,
                or_(keys.c.lease_expires_at.is_(None), keys.c.lease_expires_at <= db_epoch_now()),
            )
        )
        rows = self.db.call(lambda: self.db.execute_single(statement, read_only=True))[0]
        return int(only_row(rows)["n"])

    def running_keys(
        self, *, expired_only: bool = False, after: str | None = None, limit: int = 1000
    ) -> list[KeyRecord]:
        """RUNNING keys in key order, after ``after`` (keyset paging); ``expired_only`` keeps
        those whose row lease has expired."""
        statement = (
            select(keys).where(keys.c.state == RUNNING_SQL).order_by(keys.c.key).limit(limit)
        )
        if expired_only:
            statement = statement.where(
                or_(keys.c.lease_expires_at.is_(None), keys.c.lease_expires_at <= db_epoch_now())
            )
        if after is not None:
            statement = statement.where(keys.c.key > after)
        rows = self.db.call(lambda: self.db.execute_single(statement, read_only=True))[0]
        return [KeyRecord.from_mapping(row) for row in rows]

    def get_many(self, key_names: list[str]) -> dict[str, KeyRecord]:
        """The rows of ``key_names`` that exist, by key (one statement; pass a bounded list)."""
        if not key_names:
            return {}
        statement = select(keys).where(keys.c.key.in_(key_names))
        rows = self.db.call(lambda: self.db.execute_single(statement, read_only=True))[0]
        return {str(row["key"]): KeyRecord.from_mapping(row) for row in rows}

    def now(self) -> float:
        """The database's clock, in epoch seconds (what every time in the table is in)."""
        return self.db.now()


#: What ``claim_new`` writes as the claim reason (read once: an enum's ``value`` is a descriptor).
_NEW = ClaimReason.NEW.value


def _new_record(request: ClaimRequest, claim_id: str, row: dict[str, Any]) -> KeyRecord:
    """The row ``claim_new`` inserted: the request's values, and the database's token and
    times (what the upsert would have returned for it)."""
    return assembled(
        KeyRecord,
        {
            "key": request.key,
            "task_name": request.task_name,
            "state": RUNNING,
            "attempts": 1,
            "fencing_token": row["fencing_token"],
            "lease_expires_at": row["lease_expires_at"],
            "owner": request.owner,
            "owner_lock": request.owner_lock,
            "claim_id": claim_id,
            "claim_reason": _NEW,
            "fingerprint": request.fingerprint,
            "message": None,
            "result": None,
            "last_error": None,
            "duplicates": 0,
            "created_at": row["created_at"],
            "updated_at": row["updated_at"],
            "completed_at": None,
            "expires_at": None,
            "republished_at": None,
        },
    )


def _classify(record: KeyRecord, request: ClaimRequest, claim_id: str) -> ClaimOutcome:
    if record.claim_id == claim_id and record.state == RUNNING:
        return ClaimOutcome.CLAIMED
    if record.state == DEAD:
        return ClaimOutcome.DEAD
    if (
        request.check_fingerprint
        and record.fingerprint is not None
        and record.fingerprint != request.fingerprint
    ):
        return ClaimOutcome.CONFLICT
    if record.state == COMPLETED:
        return ClaimOutcome.DUPLICATE
    return ClaimOutcome.IN_FLIGHT


#: The row is still owned by the execution holding ``p_token``.
owned_by_token = and_(
    keys.c.key == bindparam("p_key"),
    keys.c.fencing_token == bindparam("p_token", type_=BigInteger),
    keys.c.state == RUNNING,
)


def end_ownership(state: str) -> Any:
    """The token-checked end of an execution that did not complete (RELEASED or DEAD)."""
    return (
        update(keys)
        .where(owned_by_token)
        .values(
            state=state,
            lease_expires_at=None,
            last_error=bindparam("p_error"),
            updated_at=db_epoch_now(),
        )
    )


_RELEASE = end_ownership(RELEASED)

_GET = select(keys).where(keys.c.key == bindparam("p_key"))


def completion(
    key: str, token: int, result: str, retention: float | None
) -> tuple[Any, dict[str, Any]]:
    """The completion marker (a token-checked UPDATE, Core) and its parameters: what
    :meth:`Keys.complete` runs, and what an integration runs on its framework's own connection
    (``celery_guard.contrib.django``). Exactly one row changes when ``token`` owns ``key``."""
    parameters = {"p_key": key, "p_token": token, "p_result": result, "p_retention": retention}
    return _complete_statement(retention is not None), parameters


@functools.cache
def _complete_statement(expires: bool) -> Any:
    """The completion marker, token-checked; built once per retention kind."""
    now = db_epoch_now()
    return (
        update(keys)
        .where(owned_by_token)
        .values(
            state=COMPLETED,
            result=bindparam("p_result"),
            last_error=None,
            lease_expires_at=None,
            completed_at=now,
            updated_at=now,
            expires_at=now + bindparam("p_retention", type_=Double) if expires else None,
        )
    )


@functools.cache
def _claim_new_statement(
    dialect_name: str, check_fingerprint: bool, external_lease: bool, synchronous_commit: str | None
) -> Any:
    """The claim of a key without a row (``claim_new``), for one variant, built once."""
    return _claim_text(
        "claim_new", dialect_name, check_fingerprint, external_lease, synchronous_commit
    )


@functools.cache
def _claim_statement(
    dialect_name: str, check_fingerprint: bool, external_lease: bool, synchronous_commit: str | None
) -> Any:
    """The claim SQL for one variant, built once (SQLAlchemy then reuses its compiled form).

    ``synchronous_commit`` (``guard_claim_synchronous_commit``, a validated PostgreSQL level)
    is the claim's own commit level on PostgreSQL; ``None`` keeps the session's.

    A short text matters: psycopg parses queries over 4 KB on every execution, and a claim built
    from SQLAlchemy expressions repeated its condition in every column (13 KB).
    """
    return _claim_text("claim", dialect_name, check_fingerprint, external_lease, synchronous_commit)


def _claim_text(
    name: str,
    dialect_name: str,
    check_fingerprint: bool,
    external_lease: bool,
    synchronous_commit: str | None,
) -> Any:
    """The named claim text of queries/keys.sql with its fragments filled in, as a statement."""
    first_token = SQL["first_token"].format(token_floor=TOKEN_FLOOR)
    if external_lease:
        # The claimant holds the external (Redis) lease, so the previous owner's has lapsed;
        # the row's token must still rise even if the lease store's counter went backwards.
        first_token = SQL["external_first_token"].format(first_token=first_token)
        lapsed = "TRUE"
        next_token = SQL["external_next_token"]
    else:
        lapsed = SQL["lapsed"]
        next_token = SQL["next_token"]
    now = EPOCH_NOW_SQL[dialect_name]
    sql = SQL[name].format(
        new_row=SQL["new_row"].format(now=now, first_token=first_token),
        now=now,
        first_token=first_token,
        next_token=next_token,
        lapsed=lapsed,
        same=SQL["same_payload"] if check_fingerprint else "TRUE",
        claim_commit=(
            SQL["claim_commit"].format(level=synchronous_commit)
            if dialect_name == "postgresql" and synchronous_commit is not None
            else ""
        ),
    )
    typed = [bindparam("p_lease_ttl", type_=Double), bindparam("p_owner_lock", type_=BigInteger)]
    if external_lease:
        typed.append(bindparam("p_external_token", type_=BigInteger))
    return text(sql).bindparams(*typed)
