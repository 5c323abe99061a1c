"""The store's records built in one step (``celery_guard.store.base.assembled``) are the records
their constructors build: equal, hashed alike, still frozen, with every field set."""

from __future__ import annotations

import dataclasses

import pytest

from celery_guard.store import keys as store_keys
from celery_guard.store.base import ClaimRequest, KeyRecord, assembled


def _row_values() -> dict[str, object]:
    return {
        "key": "order:1",
        "task_name": "shop.charge",
        "state": "RUNNING",
        "attempts": 2,
        "fencing_token": 7,
        "lease_expires_at": 1700000030.5,
        "owner": "w1/42",
        "owner_lock": 99,
        "claim_id": "c1",
        "claim_reason": "takeover",
        "fingerprint": "f" * 64,
        "message": '{"id":"t1"}',
        "result": None,
        "last_error": "TimeoutError: x",
        "duplicates": 1,
        "created_at": 1700000000.0,
        "updated_at": 1700000001.0,
        "completed_at": None,
        "expires_at": None,
        "republished_at": None,
    }


def test_an_assembled_key_record_is_the_record_its_constructor_builds() -> None:
    values = _row_values()
    built = KeyRecord(**values)  # type: ignore[arg-type]
    fast = assembled(KeyRecord, dict(values))
    assert fast == built and hash(fast) == hash(built) and repr(fast) == repr(built)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.state = "COMPLETED"  # type: ignore[misc]
    # What assembled() relies on: no slots, no __post_init__ to skip.
    assert "__slots__" not in KeyRecord.__dict__
    assert not hasattr(KeyRecord, "__post_init__")


def test_a_row_read_back_is_a_key_record_with_every_column() -> None:
    row = {**_row_values(), "not_a_field": "ignored"}
    record = KeyRecord.from_mapping(row)
    assert record == KeyRecord(**_row_values())  # type: ignore[arg-type]
    with pytest.raises(KeyError):
        KeyRecord.from_mapping({name: value for name, value in row.items() if name != "owner"})


def test_a_new_claims_record_sets_every_field_as_the_upsert_would_return_them() -> None:
    request = ClaimRequest(
        key="order:1",
        task_name="shop.charge",
        fingerprint="f" * 64,
        check_fingerprint=True,
        owner="w1/42",
        message='{"id":"t1"}',
        lease_ttl=30.0,
        owner_lock=99,
    )
    row = {
        "fencing_token": 3,
        "lease_expires_at": 1700000030.0,
        "created_at": 1700000000.0,
        "updated_at": 1700000000.0,
    }
    record = store_keys._new_record(request, "c1", row)
    assert set(vars(record)) == {field.name for field in dataclasses.fields(KeyRecord)}
    assert record == KeyRecord(**vars(record))
    assert (record.state, record.attempts, record.claim_reason, record.fencing_token) == (
        "RUNNING",
        1,
        "NEW",
        3,
    )
    # The stored texts are not read back with a claim (Keys.claim's docstring).
    assert record.message is None and record.result is None
