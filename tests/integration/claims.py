"""Claim helpers shared by the integration tests that need a RUNNING key to start from."""

from __future__ import annotations

from celery_guard.store import ClaimOutcome, ClaimRequest, SqlStore


def claim(store: SqlStore, key: str, *, ttl: float = 30.0, message: str | None = None) -> int:
    """Claim ``key`` as a new owner (it must succeed) and return its fencing token."""
    result = store.keys.claim(
        ClaimRequest(
            key=key,
            task_name="shop.record",
            fingerprint="fp",
            check_fingerprint=True,
            owner="w1/1",
            message=message,
            lease_ttl=ttl,
        )
    )
    assert result.outcome is ClaimOutcome.CLAIMED
    return result.record.fencing_token
