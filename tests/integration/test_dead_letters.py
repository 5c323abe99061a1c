"""Dead letters in the store, and a replay that cannot publish putting everything back."""

from __future__ import annotations

import pytest
from celery import Celery

from celery_guard import Fenced
from celery_guard.deadletters import DeadLetterSink
from celery_guard.store import ClaimOutcome, ClaimRequest, SqlStore
from celery_guard.store.base import DeadLetter
from tests.rig.ports import free_port
from tests.rig.procs import wait_until
from tests.rig.servers import RedisServer

MESSAGE = '{"task": "t", "id": "id-1", "args": [1], "kwargs": {}, "routing_key": "q"}'


def dead(store: SqlStore, key: str = "k") -> DeadLetter:
    claim = store.keys.claim(
        ClaimRequest(
            key=key,
            task_name="t",
            fingerprint="fp",
            check_fingerprint=True,
            owner="w/1",
            message=MESSAGE,
            lease_ttl=30,
        )
    )
    assert claim.outcome is ClaimOutcome.CLAIMED
    letter = DeadLetter(
        key=key,
        task_name="t",
        task_id="id-1",
        message=MESSAGE,
        error_class="permanent",
        error_type="ValueError",
        error="bad",
        traceback="Traceback ...",
        reason="permanent error",
        attempts=1,
    )
    return store.dead_letters.dead_letter(claim.record.fencing_token, letter)


def test_dead_lettering_is_atomic_with_the_key_and_needs_the_token(store: SqlStore) -> None:
    letter = dead(store)
    assert letter.id is not None and letter.created_at is not None
    record = store.keys.get("k")
    assert record is not None and (record.state, record.last_error) == ("DEAD", "bad")
    assert store.dead_letters.list_dead_letters() == [letter]
    with pytest.raises(Fenced):
        store.dead_letters.dead_letter(record.fencing_token, letter)  # the key is no longer RUNNING
    assert len(store.dead_letters.list_dead_letters()) == 1


def test_revive_once_resets_attempts_and_a_second_revive_is_a_no_op(store: SqlStore) -> None:
    letter = dead(store)
    assert letter.id is not None
    revived = store.dead_letters.revive(letter.id)
    assert revived is not None and revived.replayed_at is not None
    record = store.keys.get("k")
    assert record is not None and (record.state, record.attempts) == ("RELEASED", 0)
    assert store.dead_letters.revive(letter.id) is None


def test_a_replay_that_cannot_publish_leaves_the_letter_replayable(
    store: SqlStore, redis_server: RedisServer
) -> None:
    letter = dead(store)
    assert letter.id is not None
    down = Celery("down", broker=f"redis://127.0.0.1:{free_port()}/0", set_as_current=False)
    down.conf.broker_connection_max_retries = 1
    down.conf.broker_connection_timeout = 1
    try:
        with pytest.raises(Exception):  # noqa: B017 - whatever the broker client raises
            DeadLetterSink(down, store.dead_letters, "dlq").replay(letter.id)
    finally:
        down.close()
    again = store.dead_letters.get_dead_letter(letter.id)
    assert again is not None and again.replayed_at is None
    record = store.keys.get("k")
    assert record is not None and record.state == "DEAD"
    up = Celery("up", broker=redis_server.url_for(13), set_as_current=False)
    try:
        outcome, _ = DeadLetterSink(up, store.dead_letters, "dlq").replay(letter.id)
        assert outcome == "replayed"
        assert DeadLetterSink(up, store.dead_letters, "dlq").replay(letter.id)[0] == "already"
        assert DeadLetterSink(up, store.dead_letters, "dlq").replay(letter.id + 100) == (
            "unknown",
            None,
        )
    finally:
        up.close()


def test_purge_before_a_time_keeps_newer_letters(store: SqlStore) -> None:
    old = dead(store, "old")
    assert old.created_at is not None
    # SQLite's clock has millisecond steps: let it move on, so the two letters differ.
    wait_until(lambda: store.now() > (old.created_at or 0) + 0.01, 5, "the clock to move")
    new = dead(store, "new")
    assert new.created_at is not None and new.created_at > old.created_at
    assert store.dead_letters.purge_dead_letters(before=new.created_at) == [old.id]
    assert [letter.key for letter in store.dead_letters.list_dead_letters()] == ["new"]
