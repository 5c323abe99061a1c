"""Stateful property tests of the store's transitions, on SQLite and on a real PostgreSQL.

Hypothesis drives several claimers (worker processes, as far as the store can tell) against a few
keys with every store primitive a worker, the reaper or an operator uses: claim (same or another
payload, task-id keys, Redis-lease claims), complete (alone, or in a transaction with the task's
own write), release, renew, end a lease, dead-letter, replay, revive, revoke a draining worker's
keys, prune expired results, and claims racing from several threads at once. After every step the
real rows must equal a reference model (``tests/property/model.py``) and obey the invariants:

- at most one unfenced owner per key: only the newest token may complete, release, renew or
  dead-letter, and no two executions ever hold the same token of one key;
- fencing tokens strictly increase per key, across every claim in the key's whole history
  (including after its row was pruned);
- COMPLETED never regresses, except through the documented paths (a claim after the retention
  ended, or pruning the row);
- attempts never decrease, except through the documented paths (a claim after the retention
  ended starts again at 1; an operator's replay or revive resets them to 0).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)
from sqlalchemy import BigInteger, Column, Integer, MetaData, String, Table, delete, insert, select

from celery_guard import Fenced
from celery_guard.store import ClaimOutcome, ClaimRequest, KeyRecord, SqlStore
from celery_guard.store.base import DeadLetter
from celery_guard.store.schema import dead_letters, keys, leaders
from tests.property import model
from tests.property.model import (
    COMPLETED,
    DEAD,
    EXPIRED,
    LIVE,
    LONG_TTL,
    RELEASED,
    RUNNING,
    SHORT,
    SHORT_TTL,
    SOON,
    Row,
)
from tests.rig.procs import wait_until

effects_metadata = MetaData()
#: The task's own table: one row per effect a completion committed with it.
effects = Table(
    "prop_effects",
    effects_metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("key", String(255), nullable=False),
    Column("token", BigInteger, nullable=False),
)

KEY_NAMES = ("k0", "k1", "k2")
CLAIMERS = ("wa", "wb", "wc")
FINGERPRINTS = ("fp-a", "fp-b", None)
TASK = "prop.task"

RETENTIONS = st.sampled_from([None, LONG_TTL * 30, 0.0, SHORT_TTL])
TTLS = st.sampled_from([LONG_TTL, SHORT_TTL])


@dataclass(frozen=True)
class Held:
    """A token an execution was given by a claim; it may have gone stale since."""

    key: str
    #: 0 when the claim did not get the key: that execution then acts without ownership, which
    #: must be refused. (Every claim adds one entry to the bundle, whatever the database's clock
    #: decided, so hypothesis can replay a run step by step.)
    token: int
    claimer: str
    serial: int


def owner_of(claimer: str) -> str:
    return f"{claimer}/{CLAIMERS.index(claimer) + 1}"


class StoreMachine(RuleBasedStateMachine):
    """The store and the model, step by step. ``store`` is set per backend by the test."""

    store: SqlStore

    held = Bundle("held")
    letters = Bundle("letters")

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[str, Row] = {}
        #: Every (token, holder serial) ever issued per key, across the row's whole history.
        self.issued: dict[str, list[Held]] = {}
        #: Highest token each key has ever had (claims and revocations).
        self.highest: dict[str, int] = {}
        #: Tokens whose transaction committed an effect, per key.
        self.effects: dict[str, list[int]] = {}
        #: Dead letters: id -> (key, replayed).
        self.dead: dict[int, tuple[str, bool]] = {}
        #: The highest token of every row pruned so far: a new row starts above it.
        self.floor = 0
        self.serial = 0
        self.previous: dict[str, KeyRecord | None] = {}

    # -- setup ----------------------------------------------------------------------------------

    @initialize()
    def empty_store(self) -> None:
        engine = self.store.engine
        effects_metadata.create_all(engine)
        with engine.begin() as connection:
            for table in (keys, dead_letters, leaders, effects):
                connection.execute(delete(table))
        self.floor = self.store.recovery.token_floor()
        self.prefix = uuid.uuid4().hex[:8]
        self.keys = [f"{self.prefix}:{name}" for name in KEY_NAMES]
        for key in self.keys:
            self.rows[key] = Row()
            self.issued[key] = []
            self.highest[key] = 0
            self.effects[key] = []
            self.previous[key] = None

    def key(self, index: int) -> str:
        return self.keys[index]

    def lost(self, key: str, claimer: str) -> Held:
        self.serial += 1
        return Held(key, 0, claimer, self.serial)

    def give(self, key: str, token: int, claimer: str) -> Held:
        self.serial += 1
        held = Held(key, token, claimer, self.serial)
        assert token > self.highest[key], (
            f"fencing token of {key} went from {self.highest[key]} to {token}: a new claim must "
            f"get a higher token than any the key ever had (issued: {self.issued[key]})"
        )
        self.highest[key] = token
        self.issued[key].append(held)
        return held

    # -- claims ---------------------------------------------------------------------------------

    def _claim(
        self,
        index: int,
        claimer: str,
        fingerprint: str | None,
        check: bool,
        ttl: float,
        external: int | None,
    ) -> Any:
        key = self.key(index)
        row = self.rows[key]
        request = ClaimRequest(
            key=key,
            task_name=TASK,
            fingerprint=fingerprint,
            check_fingerprint=check,
            owner=owner_of(claimer),
            message=None,
            lease_ttl=ttl,
            external_token=external,
        )
        result = self.store.keys.claim(request)
        options = model.claim_options(
            row,
            fingerprint=fingerprint,
            check=check,
            owner=owner_of(claimer),
            ttl=ttl,
            external=external,
            first_token=self.floor + 1,
        )
        if result.outcome is ClaimOutcome.CLAIMED:
            held = self.give(key, result.record.fencing_token, claimer)
        else:
            held = self.lost(key, claimer)
        self.rows[key] = self.settle(key, result.outcome, result.record, options)
        return held

    @rule(
        target=held,
        index=st.integers(0, len(KEY_NAMES) - 1),
        claimer=st.sampled_from(CLAIMERS),
        fingerprint=st.sampled_from(FINGERPRINTS),
        check=st.booleans(),
        ttl=TTLS,
    )
    def claim(
        self, index: int, claimer: str, fingerprint: str | None, check: bool, ttl: float
    ) -> Any:
        return self._claim(index, claimer, fingerprint, check, ttl, None)

    @rule(
        target=held,
        index=st.integers(0, len(KEY_NAMES) - 1),
        claimer=st.sampled_from(CLAIMERS),
        fingerprint=st.sampled_from(FINGERPRINTS),
        external=st.integers(1, 12),
    )
    def claim_holding_a_redis_lease(
        self, index: int, claimer: str, fingerprint: str | None, external: int
    ) -> Any:
        """With Redis leases the claimant holds the lease; Redis' counter may lag the row's."""
        return self._claim(index, claimer, fingerprint, True, LONG_TTL, external)

    @rule(
        target=held,
        index=st.integers(0, len(KEY_NAMES) - 1),
        racers=st.integers(2, 4),
        fingerprint=st.sampled_from(FINGERPRINTS[:2]),
    )
    def racing_claims(self, index: int, racers: int, fingerprint: str) -> Any:
        """Several threads claim one key at the same moment: at most one may own it."""
        key = self.key(index)
        claimers = [CLAIMERS[n % len(CLAIMERS)] for n in range(racers)]
        barrier = threading.Barrier(racers)
        answers: dict[int, Any] = {}

        def racer(n: int) -> None:
            barrier.wait(timeout=10)
            try:
                answers[n] = self.store.keys.claim(
                    ClaimRequest(
                        key=key,
                        task_name=TASK,
                        fingerprint=fingerprint,
                        check_fingerprint=True,
                        owner=owner_of(claimers[n]),
                        message=None,
                        lease_ttl=LONG_TTL,
                    )
                )
            except BaseException as exc:  # reported below, in the test's thread
                answers[n] = exc

        threads = [threading.Thread(target=racer, args=(n,)) for n in range(racers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        assert len(answers) == racers, "a racing claim did not return"
        for answer in answers.values():
            if isinstance(answer, BaseException):
                raise answer
        winners = [n for n, answer in answers.items() if answer.outcome is ClaimOutcome.CLAIMED]
        assert len(winners) <= 1, f"{len(winners)} racing claims own {key} at once"
        # The store serialised the claims: the same claims, one after another, give the same
        # answers (all claims are alike but for the owner, which the winner sets).
        observed = sorted(answer.outcome.value for answer in answers.values())
        candidates = []
        for options in self._sequential(self.rows[key], racers, fingerprint, winners, claimers):
            outcomes, row = options
            if sorted(o.value for o in outcomes) == observed:
                candidates.append(row)
        assert candidates, f"racing claims answered {observed}, not what the model allows"
        if winners:
            (winner,) = winners
            held = self.give(key, answers[winner].record.fencing_token, claimers[winner])
        else:
            held = self.lost(key, claimers[0])
        self.rows[key] = self.pick(key, candidates, self.store.keys.get(key))
        return held

    def _sequential(
        self, row: Row, racers: int, fingerprint: str, winners: list[int], claimers: list[str]
    ) -> Iterator[tuple[list[ClaimOutcome], Row]]:
        owner = owner_of(claimers[winners[0]]) if winners else "nobody"
        paths: list[tuple[list[ClaimOutcome], Row]] = [([], row)]
        for _ in range(racers):
            paths = [
                ([*outcomes, outcome], after)
                for outcomes, current in paths
                for outcome, after in model.claim_options(
                    current,
                    fingerprint=fingerprint,
                    check=True,
                    owner=owner,
                    ttl=LONG_TTL,
                    external=None,
                    first_token=self.floor + 1,
                )
            ]
        yield from paths

    # -- an owner's primitives --------------------------------------------------------------------

    @rule(held=held, retention=RETENTIONS)
    def complete(self, held: Held, retention: float | None) -> None:
        row = self.rows[held.key]
        result = f'{{"by": {held.serial}}}'
        try:
            self.store.keys.complete(held.key, held.token, result, retention)
        except Fenced:
            assert not model.owns(row, held.token), f"{held} owns {row} yet was fenced"
            assert not (row.state == COMPLETED and row.token == held.token)
        else:
            if model.owns(row, held.token):
                self.rows[held.key] = replace(
                    row,
                    state=COMPLETED,
                    result=result,
                    last_error=None,
                    lease=None,
                    retention=model.retention_class(retention),
                )
            else:
                # complete() resent after a lost reply finds its own completion: no change.
                assert row.state == COMPLETED and row.token == held.token, (
                    f"a completion with {held} was accepted, the row is {row}"
                )

    @rule(held=held, retention=RETENTIONS)
    def complete_with_the_tasks_own_write(self, held: Held, retention: float | None) -> None:
        """The body's write and the COMPLETED marker commit together, or neither does."""
        row = self.rows[held.key]
        result = f'{{"txn": {held.serial}}}'
        with self.store.keys.connect() as connection:
            transaction = connection.begin()
            connection.execute(insert(effects).values(key=held.key, token=held.token))
            try:
                self.store.keys.complete(
                    held.key, held.token, result, retention, connection=connection
                )
            except Fenced:
                transaction.rollback()
                assert not model.owns(row, held.token), f"{held} owns {row} yet was fenced"
                return
            self.store.keys.commit(transaction)
        assert model.owns(row, held.token), f"a stale {held} committed over {row}"
        self.effects[held.key].append(held.token)
        self.rows[held.key] = replace(
            row,
            state=COMPLETED,
            result=result,
            last_error=None,
            lease=None,
            retention=model.retention_class(retention),
        )

    @rule(held=held)
    def release(self, held: Held) -> None:
        row = self.rows[held.key]
        error = f"released by {held.serial}"
        released = self.store.keys.release(held.key, held.token, error)
        assert released == model.owns(row, held.token), (held, row)
        if released:
            self.rows[held.key] = replace(row, state=RELEASED, lease=None, last_error=error)

    @rule(chosen=st.lists(held, min_size=1, max_size=4), ttl=TTLS)
    def renew(self, chosen: list[Held], ttl: float) -> None:
        renewed = self.store.keys.renew_leases([(h.key, h.token) for h in chosen], ttl)
        expected = {h.key for h in chosen if model.owns(self.rows[h.key], h.token)}
        assert renewed == expected, f"renewed {renewed}, only {expected} are owned"
        for key in expected:
            self.rows[key] = replace(self.rows[key], lease=model.ttl_class(ttl))

    @rule(held=held)
    def end_the_lease(self, held: Held) -> None:
        """``expire_lease``: the owner is known dead, its lease ends now."""
        row = self.rows[held.key]
        ended = self.store.recovery.expire_lease(held.key, held.token)
        if not model.owns(row, held.token):
            assert not ended, f"a stale {held} ended the lease of {row}"
            return
        assert ended in {LIVE: [True], SHORT: [True, False], EXPIRED: [False]}[str(row.lease)]
        self.rows[held.key] = replace(row, lease=EXPIRED)

    @rule(held=held, target=letters)
    def dead_letter(self, held: Held) -> Any:
        row = self.rows[held.key]
        letter = DeadLetter(
            key=held.key,
            task_name=TASK,
            task_id=None,
            message=None,
            error_class="permanent",
            error_type="ValueError",
            error=f"dead-lettered by {held.serial}",
            traceback=None,
            reason="property test",
            attempts=row.attempts,
        )
        before = self.letter_count(held.key)
        try:
            stored = self.store.dead_letters.dead_letter(held.token, letter)
        except Fenced:
            assert not model.owns(row, held.token), f"{held} owns {row} yet was fenced"
            assert self.letter_count(held.key) == before, "a fenced dead letter was stored"
            return 0  # no such letter: replaying it must do nothing
        assert model.owns(row, held.token), f"a stale {held} dead-lettered {row}"
        assert stored.id is not None
        self.dead[stored.id] = (held.key, False)
        self.rows[held.key] = replace(row, state=DEAD, lease=None, last_error=letter.error)
        return stored.id

    # -- operators and the reaper -------------------------------------------------------------

    @rule(letter_id=letters)
    def replay(self, letter_id: int) -> None:
        """``guard dlq replay``: revive the letter's key with fresh attempts (once)."""
        revived = self.store.dead_letters.revive(letter_id)
        if letter_id not in self.dead:
            assert revived is None, f"replayed an unknown dead letter: {revived}"
            return
        key, replayed = self.dead[letter_id]
        assert (revived is None) == replayed, (letter_id, replayed, revived)
        if revived is None:
            return
        self.dead[letter_id] = (key, True)
        if self.rows[key].state == DEAD:
            self.rows[key] = replace(self.rows[key], state=RELEASED, attempts=0)

    @rule(letter_id=letters)
    def undo_replay(self, letter_id: int) -> None:
        """``unrevive``: a replay whose message could not be published is undone."""
        self.store.dead_letters.unrevive(letter_id)
        if letter_id not in self.dead:
            return
        key, _ = self.dead[letter_id]
        self.dead[letter_id] = (key, False)
        row = self.rows[key]
        if row.state == RELEASED and row.attempts == 0:
            self.rows[key] = replace(row, state=DEAD)

    @rule(
        action=st.sampled_from(["revive_key", "revoke", "prune", "wait", "probe"]),
        index=st.integers(0, len(KEY_NAMES) - 1),
        claimer=st.sampled_from(CLAIMERS),
    )
    def maintenance(self, action: str, index: int, claimer: str) -> None:
        """What operators and the reaper do, and the passing of time (one rule, so that the
        claims and the owners' calls stay the bulk of every run)."""
        if action == "revive_key":
            self.revive_key(index)
        elif action == "revoke":
            self.revoke_a_draining_worker(claimer)
        elif action == "prune":
            self.prune()
        elif action == "wait":
            self.wait_for_the_database_clock()
        else:
            self.every_token_but_the_owners_is_fenced(index)

    def revive_key(self, index: int) -> None:
        """``guard key revive``: a DEAD key whose letter was purged becomes claimable."""
        key = self.key(index)
        row = self.rows[key]
        assert self.store.dead_letters.revive_key(key) == (row.state == DEAD)
        if row.state == DEAD:
            self.rows[key] = replace(row, state=RELEASED, attempts=0)

    def revoke_a_draining_worker(self, claimer: str) -> None:
        """A warm shutdown past its drain timeout moves its keys' tokens on and ends leases."""
        prefix = owner_of(claimer).split("/")[0] + "/"
        revoked = sorted(self.store.recovery.revoke_owned(prefix))
        mine = {key for key in self.keys if self.rows[key].owner == owner_of(claimer)}
        expected = sorted(
            (key, self.rows[key].token) for key in mine if self.rows[key].state == RUNNING
        )
        assert revoked == expected
        for key, token in revoked:
            self.rows[key] = replace(self.rows[key], token=token + 1, lease=EXPIRED)
            self.highest[key] = max(self.highest[key], token + 1)

    def prune(self) -> None:
        """The reaper (or ``guard prune``) deletes COMPLETED rows past their retention."""
        before = {key: self.rows[key] for key in self.keys}
        pruned = self.store.recovery.prune_completed(limit=100)
        records = self.store.keys.get_many(self.keys)
        gone = []
        for key, row in before.items():
            if row.state == COMPLETED and key not in records:
                assert row.retention in (EXPIRED, SOON), f"pruned a retained result {row}"
                gone.append(key)
            elif row.state == COMPLETED and row.retention == EXPIRED:
                raise AssertionError(f"{key}'s retention ended but it was not pruned")
        assert pruned == len(gone)
        for key in gone:
            self.floor = max(self.floor, self.rows[key].token)
            self.rows[key] = Row()

    def wait_for_the_database_clock(self) -> None:
        """Let every short lease and retention run out, by the database's clock (bounded)."""
        deadlines = []
        records = self.store.keys.get_many(self.keys)
        for key, row in self.rows.items():
            record = records.get(key)
            if record is None:
                continue
            if row.lease == SHORT and record.lease_expires_at is not None:
                deadlines.append(record.lease_expires_at)
            if row.retention == SOON and record.expires_at is not None:
                deadlines.append(record.expires_at)
        if deadlines:
            latest = max(deadlines)
            wait_until(lambda: self.store.now() > latest, 5, "the database clock", 0.005)
        for key, row in self.rows.items():
            self.rows[key] = replace(
                row,
                lease=EXPIRED if row.lease == SHORT else row.lease,
                retention=EXPIRED if row.retention == SOON else row.retention,
            )

    def every_token_but_the_owners_is_fenced(self, index: int) -> None:
        """Probe every token the key ever issued: at most one execution may still commit."""
        key = self.key(index)
        unfenced = [held for held in self.issued[key] if self.would_commit(held)]
        assert len(unfenced) <= 1, f"{len(unfenced)} executions own {key}: {unfenced}"
        row = self.rows[key]
        owners = [held for held in self.issued[key] if model.owns(row, held.token)]
        assert unfenced == owners, (unfenced, owners, row)

    # -- helpers --------------------------------------------------------------------------------

    def would_commit(self, held: Held) -> bool:
        """Whether ``held``'s completion would be accepted (tried, then rolled back)."""
        with self.store.keys.connect() as connection:
            transaction = connection.begin()
            try:
                self.store.keys.complete(held.key, held.token, "null", None, connection=connection)
            except Fenced:
                return False
            finally:
                transaction.rollback()
        return True

    def letter_count(self, key: str) -> int:
        with self.store.engine.connect() as connection:
            return len(
                connection.execute(select(dead_letters.c.id).where(dead_letters.c.key == key)).all()
            )

    def settle(
        self,
        key: str,
        outcome: ClaimOutcome,
        record: KeyRecord,
        options: list[tuple[ClaimOutcome, Row]],
    ) -> Row:
        """The model row matching what the store answered, among those the model allows."""
        matching = [row for answer, row in options if answer is outcome]
        assert matching, (
            f"claim of {key} answered {outcome.value}; the model allows "
            f"{[answer.value for answer, _ in options]} for {self.rows[key]}"
        )
        return self.pick(key, matching, record)

    def pick(self, key: str, candidates: list[Row], record: KeyRecord | None) -> Row:
        now = self.store.now()
        problems: list[str] = []
        for row in candidates:
            found = model.mismatches(row, record, now)
            if not found:
                return row
            problems += found
        raise AssertionError(f"{key}: the store's row {record} differs from the model: {problems}")

    # -- invariants -----------------------------------------------------------------------------

    @invariant()
    def rows_match_the_model_and_move_only_forward(self) -> None:
        if not hasattr(self, "keys"):
            return
        records = self.store.keys.get_many(self.keys)
        now = self.store.now()
        for key in self.keys:
            record = records.get(key)
            row = model.observe_time(self.rows[key], record, now)
            self.rows[key] = row
            problems = model.mismatches(row, record, now)
            assert not problems, f"{key}: {problems}\nstore: {record}\nmodel: {row}"
            check_transition(self.previous[key], record)
            self.previous[key] = record

    @invariant()
    def no_two_executions_share_a_token(self) -> None:
        for key, issued in self.issued.items():
            tokens = [held.token for held in issued]
            assert len(tokens) == len(set(tokens)), f"{key} issued a token twice: {issued}"

    @invariant()
    def each_effect_committed_once_by_an_owner(self) -> None:
        if not hasattr(self, "keys"):
            return
        with self.store.engine.connect() as connection:
            found = connection.execute(
                select(effects.c.key, effects.c.token).where(effects.c.key.in_(self.keys))
            ).all()
        committed: dict[str, list[int]] = {key: [] for key in self.keys}
        for key, token in found:
            committed[key].append(int(token))
        for key in self.keys:
            assert sorted(committed[key]) == sorted(self.effects[key]), key
            assert len(set(committed[key])) == len(committed[key]), key


def check_transition(before: KeyRecord | None, after: KeyRecord | None) -> None:
    """The documented ways a row may change, judged from two snapshots of the real row."""
    if before is None or after is None:
        if before is not None:
            assert before.state == COMPLETED, f"a {before.state} row was deleted"
            assert before.expires_at is not None, "a result kept forever was deleted"
        return
    what = f"{before.key}: {before.state}/{before.fencing_token}/{before.attempts} -> " + (
        f"{after.state}/{after.fencing_token}/{after.attempts}"
    )
    assert after.fencing_token >= before.fencing_token, f"token went back: {what}"
    if after.fencing_token != before.fencing_token:
        assert after.state == RUNNING, f"a token moved on without a claim: {what}"
    if before.state == COMPLETED and after.state != COMPLETED:
        # Only a claim after the retention ended reopens a result.
        assert after.state == RUNNING and after.claim_reason == "NEW", f"regressed: {what}"
        assert before.expires_at is not None and before.expires_at <= after.updated_at, what
        assert after.attempts == 1, what
    elif before.state == DEAD and after.state != DEAD:
        assert after.state == RELEASED and after.attempts == 0, f"left DEAD without replay: {what}"
    elif after.state == DEAD and before.state not in (RUNNING, DEAD):
        # Undoing a replay that could not be published.
        assert before.state == RELEASED and before.attempts == 0, f"became DEAD: {what}"
    elif after.attempts < before.attempts:
        raise AssertionError(f"attempts went back: {what}")


def run_machine(store: SqlStore, examples: int, steps: int) -> None:
    machine = type("Machine", (StoreMachine,), {"store": store})
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=examples,
            stateful_step_count=steps,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )


def test_store_transitions_with_concurrent_claimers(store: SqlStore) -> None:
    run_machine(store, examples=100, steps=50)
