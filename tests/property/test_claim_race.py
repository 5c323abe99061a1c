"""Threads racing to claim one key, with hypothesis-chosen timings, on SQLite and PostgreSQL.

Whatever state the key starts in and however the claims interleave: while the winner's lease is
live exactly one claimant owns the key (none when the key is not claimable), every other claimant
is told why not, and only the owner's completion lands. With leases short enough to run out during
the race, a later claimant may take the key over: each owner then has its own, higher token, and
only the newest one's completion is accepted.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from celery_guard import Fenced, GuardConfig
from celery_guard.store import ClaimOutcome, ClaimRequest, ClaimResult, SqlStore
from celery_guard.store.base import DeadLetter

LONG_TTL = 120.0
#: Short enough to run out while the racers are still arriving.
SHORT_TTL = 0.004

#: How the key is left before the race, and which fingerprints may claim it then.
STARTS = {
    "absent": {"fp-a", "fp-b"},
    "released": {"fp-a"},
    "lapsed": {"fp-a"},
    "result_expired": {"fp-a", "fp-b"},
    "running": set(),
    "completed": set(),
    "dead": set(),
}


def request(key: str, fingerprint: str, owner: str, ttl: float) -> ClaimRequest:
    return ClaimRequest(
        key=key,
        task_name="race.task",
        fingerprint=fingerprint,
        check_fingerprint=True,
        owner=owner,
        message=None,
        lease_ttl=ttl,
    )


def prepare(store: SqlStore, key: str, start: str) -> int:
    """Leave ``key`` in the ``start`` state (claimed by fp-a); the row's token (0: no row)."""
    if start == "absent":
        return 0
    token = store.keys.claim(request(key, "fp-a", "setup/0", LONG_TTL)).record.fencing_token
    if start == "released":
        assert store.keys.release(key, token, "setup")
    elif start == "lapsed":
        assert store.recovery.expire_lease(key, token)
    elif start == "result_expired":
        store.keys.complete(key, token, '"old"', retention=0.0)
    elif start == "completed":
        store.keys.complete(key, token, '"done"', retention=None)
    elif start == "dead":
        store.dead_letters.dead_letter(
            token,
            DeadLetter(
                key=key,
                task_name="race.task",
                task_id=None,
                message=None,
                error_class="permanent",
                error_type="ValueError",
                error="setup",
                traceback=None,
                reason="setup",
                attempts=1,
            ),
        )
    return token


@dataclass
class Racer:
    fingerprint: str
    #: Seconds after the start signal this racer claims.
    delay: float
    claim: ClaimResult | None = None
    #: The result this racer's completion wrote.
    result: str = ""
    completed: bool | None = None
    error: BaseException | None = None


def racers(*fingerprints: str) -> st.SearchStrategy[list[Racer]]:
    return st.lists(
        st.builds(Racer, st.sampled_from(fingerprints), st.floats(0, 0.006)),
        min_size=2,
        max_size=6,
    )


def race(stores: list[SqlStore], key: str, racers: list[Racer], ttl: float) -> None:
    """Every racer claims after its delay; then all who were told CLAIMED complete at once."""
    start, finish = threading.Barrier(len(racers)), threading.Barrier(len(racers))

    def run(n: int, racer: Racer) -> None:
        store = stores[n % len(stores)]
        try:
            start.wait(timeout=10)
            time.sleep(racer.delay)
            racer.claim = store.keys.claim(request(key, racer.fingerprint, f"r{n}/{n}", ttl))
            finish.wait(timeout=10)
            if racer.claim.outcome is ClaimOutcome.CLAIMED:
                racer.result = f'"racer {n}"'
                try:
                    store.keys.complete(key, racer.claim.record.fencing_token, racer.result, None)
                    racer.completed = True
                except Fenced:
                    racer.completed = False
        except BaseException as exc:
            racer.error = exc

    threads = [threading.Thread(target=run, args=(n, r)) for n, r in enumerate(racers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in threads), "a racer did not finish"
    for racer in racers:
        if racer.error is not None:
            raise racer.error


@pytest.fixture
def stores(store_url: str) -> Iterator[list[SqlStore]]:
    """Four stores (engines) on one database, as four worker processes would have."""
    made = [SqlStore(GuardConfig(store_url=store_url)) for _ in range(4)]
    made[0].ensure_schema()
    try:
        yield made
    finally:
        for store in made:
            store.dispose()


def test_racing_claims_have_one_owner_while_its_lease_lives(stores: list[SqlStore]) -> None:
    @settings(
        max_examples=100,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(
        start=st.sampled_from(sorted(STARTS)),
        racers=racers("fp-a", "fp-b"),
        separate_engines=st.booleans(),
    )
    def check(start: str, racers: list[Racer], separate_engines: bool) -> None:
        key = f"race:{uuid.uuid4().hex}"
        before = prepare(stores[0], key, start)
        race(stores if separate_engines else stores[:1], key, racers, LONG_TTL)

        claims = [r.claim for r in racers if r.claim is not None]
        winners = [r for r in racers if r.claim and r.claim.outcome is ClaimOutcome.CLAIMED]
        eligible = [r for r in racers if r.fingerprint in STARTS[start]]
        assert len(winners) == (1 if eligible else 0), (start, [c.outcome for c in claims])
        record = stores[0].keys.get(key)
        assert record is not None
        if winners:
            (winner,) = winners
            assert winner.completed is True
            assert record.state == "COMPLETED" and record.result == winner.result
            assert winner.claim is not None and winner.claim.record.fencing_token > before
            for racer in racers:
                if racer is not winner:
                    assert racer.claim is not None
                    expected = (
                        ClaimOutcome.IN_FLIGHT
                        if racer.fingerprint == winner.fingerprint
                        else ClaimOutcome.CONFLICT
                    )
                    assert racer.claim.outcome is expected, (start, racer, winner)
        else:
            assert record.fencing_token == before, "nobody claimed, the token stays"
        # Whoever was not told CLAIMED was shown someone else's row, not a token of its own.
        for n, racer in enumerate(racers):
            assert racer.claim is not None
            if racer.claim.outcome is not ClaimOutcome.CLAIMED:
                assert racer.claim.record.owner != f"r{n}/{n}"

    check()


def test_takeovers_during_a_race_each_get_a_newer_token_and_only_the_newest_commits(
    stores: list[SqlStore],
) -> None:
    @settings(
        max_examples=60,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(racers=racers("fp-a"))
    def check(racers: list[Racer]) -> None:
        key = f"race:{uuid.uuid4().hex}"
        race(stores, key, racers, SHORT_TTL)
        owners = [r for r in racers if r.claim and r.claim.outcome is ClaimOutcome.CLAIMED]
        assert owners, "the first claim of a new key owns it"
        tokens = sorted(r.claim.record.fencing_token for r in owners)  # type: ignore[union-attr]
        assert len(set(tokens)) == len(tokens), f"two owners shared a token: {tokens}"
        assert tokens == list(range(tokens[0], tokens[0] + len(tokens))), tokens
        newest = max(owners, key=lambda r: r.claim.record.fencing_token)  # type: ignore[union-attr]
        assert [r.completed for r in owners if r is not newest] == [False] * (len(owners) - 1)
        assert newest.completed is True
        record = stores[0].keys.get(key)
        assert record is not None and record.state == "COMPLETED"
        assert record.fencing_token == tokens[-1]
        for racer in owners:
            if racer is not newest:
                assert racer.claim is not None
                assert racer.claim.record.claim_reason in ("NEW", "TAKEOVER")

    check()
