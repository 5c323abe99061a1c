"""A reference model of one idempotency key's row, written from ``_CLAIM_SQL`` and its siblings.

The property tests drive the real store and this model side by side. Time is the one thing the
model cannot know exactly: a lease or a retention that is short may or may not have run out when
the next statement runs. Such a row is *uncertain* and the model answers with every outcome it
allows; the real answer picks one, and both must then agree on the row.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from celery_guard.store import ClaimOutcome, KeyRecord

RUNNING = "RUNNING"
COMPLETED = "COMPLETED"
RELEASED = "RELEASED"
DEAD = "DEAD"

#: Lease classes of a RUNNING row (by the database's clock).
LIVE = "live"  # far in the future: cannot run out during one example
SHORT = "short"  # may have run out by the next statement, or not
EXPIRED = "expired"  # known to have run out

#: Retention classes of a COMPLETED row.
FOREVER = "forever"  # expires_at IS NULL
LATER = "later"  # far in the future
SOON = "soon"  # may have run out by the next statement, or not
# EXPIRED, as for leases

LONG_TTL = 120.0
SHORT_TTL = 0.03


@dataclass(frozen=True)
class Row:
    """What the model expects a key's row to hold (``state`` ``None``: no row)."""

    state: str | None = None
    token: int = 0
    attempts: int = 0
    fingerprint: str | None = None
    owner: str | None = None
    reason: str | None = None
    result: str | None = None
    last_error: str | None = None
    duplicates: int = 0
    lease: str | None = None
    retention: str | None = None


def same_payload(row: Row, fingerprint: str | None, check: bool) -> bool:
    """``_SAME_PAYLOAD``: equal fingerprints, or a row without one; always without the check."""
    if not check or row.fingerprint is None:
        return True
    return fingerprint is not None and row.fingerprint == fingerprint


def lease_options(row: Row) -> list[bool]:
    """Whether the row's lease has run out, as far as the model can tell."""
    return {LIVE: [False], SHORT: [False, True], EXPIRED: [True]}.get(row.lease or "", [False])


def retention_options(row: Row) -> list[bool]:
    """Whether the row's retention has run out, as far as the model can tell."""
    return {SOON: [False, True], EXPIRED: [True]}.get(row.retention or "", [False])


def ttl_class(ttl: float) -> str:
    return LIVE if ttl >= LONG_TTL else SHORT


def retention_class(retention: float | None) -> str:
    if retention is None:
        return FOREVER
    if retention == 0:
        return EXPIRED
    return LATER if retention >= LONG_TTL else SOON


def claim(
    row: Row,
    *,
    fingerprint: str | None,
    check: bool,
    owner: str,
    ttl: float,
    external: int | None,
    first_token: int,
    lapsed: bool,
    expired: bool,
) -> tuple[ClaimOutcome, Row]:
    """One claim, for one resolution of the time uncertainty (``lapsed``, ``expired``)."""
    if row.state is None:
        return ClaimOutcome.CLAIMED, Row(
            state=RUNNING,
            token=first_token if external is None else max(first_token, external),
            attempts=1,
            fingerprint=fingerprint,
            owner=owner,
            reason="NEW",
            lease=ttl_class(ttl),
        )
    same = same_payload(row, fingerprint, check)
    expired = row.state == COMPLETED and expired
    lapsed = row.state == RUNNING and (external is not None or lapsed) and same
    released = row.state == RELEASED and same
    if expired or lapsed or released:
        token = row.token + 1 if external is None else max(row.token + 1, external)
        return ClaimOutcome.CLAIMED, replace(
            row,
            state=RUNNING,
            token=token,
            attempts=1 if expired else row.attempts + 1,
            fingerprint=fingerprint,
            owner=owner,
            reason="NEW" if expired else "TAKEOVER" if lapsed else "RETRY",
            result=None,
            lease=ttl_class(ttl),
            retention=None,
        )
    replay = row.state == COMPLETED and same
    after = replace(row, duplicates=row.duplicates + 1) if replay else row
    if row.state == DEAD:
        return ClaimOutcome.DEAD, after
    if check and row.fingerprint is not None and row.fingerprint != fingerprint:
        return ClaimOutcome.CONFLICT, after
    if row.state == COMPLETED:
        return ClaimOutcome.DUPLICATE, after
    return ClaimOutcome.IN_FLIGHT, after


def claim_options(row: Row, **request: object) -> list[tuple[ClaimOutcome, Row]]:
    """Every (outcome, row) a claim may give, one per resolution of the time uncertainty."""
    return [
        claim(row, lapsed=lapsed, expired=expired, **request)  # type: ignore[arg-type]
        for lapsed in lease_options(row)
        for expired in retention_options(row)
    ]


def owns(row: Row, token: int) -> bool:
    """Whether ``token`` may complete, release, renew or dead-letter (``_owned_by_token``)."""
    return row.state == RUNNING and row.token == token


def mismatches(row: Row, record: KeyRecord | None, now: float) -> list[str]:
    """How the real row differs from the model's (empty when they agree)."""
    if row.state is None:
        return [] if record is None else [f"a row exists: {record}"]
    if record is None:
        return [f"no row, the model expects {row}"]
    problems = [
        f"{name}: store {got!r}, model {want!r}"
        for name, got, want in (
            ("state", record.state, row.state),
            ("fencing_token", record.fencing_token, row.token),
            ("attempts", record.attempts, row.attempts),
            ("fingerprint", record.fingerprint, row.fingerprint),
            ("owner", record.owner, row.owner),
            ("claim_reason", record.claim_reason, row.reason),
            ("result", record.result, row.result),
            ("last_error", record.last_error, row.last_error),
            ("duplicates", record.duplicates, row.duplicates),
        )
        if got != want
    ]
    lease = record.lease_expires_at
    if row.state == RUNNING:
        if lease is None:
            problems.append("a RUNNING row without a lease")
        elif row.lease == LIVE and lease <= now:
            problems.append(f"the lease should be live, it ended {now - lease:.3f}s ago")
        elif row.lease == EXPIRED and lease > now:
            problems.append(f"the lease should have ended, it has {lease - now:.3f}s left")
    elif lease is not None:
        problems.append(f"a {row.state} row with a lease until {lease}")
    expires = record.expires_at
    if row.state == COMPLETED:
        if row.retention == FOREVER and expires is not None:
            problems.append("a result kept forever has an expiry")
        elif row.retention == LATER and (expires is None or expires <= now):
            problems.append("the result should still be retained")
        elif row.retention == EXPIRED and (expires is None or expires > now):
            problems.append("the result's retention should have ended")
        elif row.retention == SOON and expires is None:
            problems.append("a result with a short retention has no expiry")
    elif expires is not None:
        problems.append(f"a {row.state} row with an expiry")
    return problems


def observe_time(row: Row, record: KeyRecord | None, now: float) -> Row:
    """Settle what the database's clock has decided: a short lease or retention that ran out."""
    if record is None:
        return row
    lease = record.lease_expires_at
    if row.lease == SHORT and lease is not None and lease <= now:
        row = replace(row, lease=EXPIRED)
    if row.retention == SOON and record.expires_at is not None and record.expires_at <= now:
        row = replace(row, retention=EXPIRED)
    return row
