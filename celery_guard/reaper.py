"""The reaper: re-publishes the messages of keys whose owner died, and prunes old results.

Every worker runs one in its main process; a lease in the store lets only one of them act at a
time. A whole worker SIGKILLed on a Redis broker leaves its unacknowledged message invisible until
the visibility timeout (an hour by default); the reaper brings the work back within about one
lease TTL. When the original message returns later, its claim finds the key COMPLETED and nothing
runs twice.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from celery_guard import serialization, signals
from celery_guard.errors import StoreError
from celery_guard.lease.backends import LeaseBackend
from celery_guard.messages import republish
from celery_guard.outbox import OutboxReport, UnclaimedRepublisher
from celery_guard.store.base import KeyRecord, RecoveryStore

logger = logging.getLogger("celery_guard.reaper")

LEADER_NAME = "reaper"
#: Orphans handled per pass; the next pass takes the rest.
BATCH = 200


@dataclass
class ReaperReport:
    """What one pass did."""

    leader: bool = False
    #: Orphaned keys whose message was re-published.
    recovered: list[str] = field(default_factory=list)
    #: Seconds each recovered key had been orphaned (lease expiry to re-publish).
    orphaned_for: list[float] = field(default_factory=list)
    #: Orphaned keys with no stored message (arguments not JSON): left to broker redelivery.
    unrecoverable: list[str] = field(default_factory=list)
    pruned: int = 0
    #: Keys whose owner process was found dead (liveness lock gone) and taken over early.
    dead_owners: list[str] = field(default_factory=list)
    #: Publish tracking (``guard_track_publishes``): what this pass did with the records.
    outbox: OutboxReport | None = None


class Reaper:
    """One pass at a time: elect, recover orphans, prune expired results."""

    def __init__(
        self,
        app: Any,
        store: RecoveryStore,
        leases: LeaseBackend,
        *,
        interval: float,
        lease_ttl: float,
        holder: str | None = None,
        lead: bool = True,
        on_pass: Callable[[], None] | None = None,
        on_leader_pass: Callable[[], None] | None = None,
        on_report: Callable[[ReaperReport], None] | None = None,
        outbox: UnclaimedRepublisher | None = None,
    ) -> None:
        #: Whether this worker competes for the reaper's lease (``guard_reaper_enabled``);
        #: when not, the loop only runs ``on_pass`` (the worker's own heartbeat).
        self.lead = lead
        self.on_pass = on_pass
        self.on_leader_pass = on_leader_pass
        self.on_report = on_report
        #: Publish tracking's part of the holder's pass, when tracking is on.
        self.outbox = outbox
        #: Whether the last pass held the lease.
        self.leader = False
        self.app = app
        self.store = store
        self.leases = leases
        self.interval = interval
        self.lease_ttl = lease_ttl
        self.holder = holder or f"{socket.gethostname()}/{os.getpid()}"
        #: A re-published message that was never claimed (lost, or stuck behind a long backlog)
        #: is published again after this long; a claim clears the mark, so a key orphaned a
        #: second time is recovered at once.
        self.republish_after = max(6 * lease_ttl, 60.0)
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def run_once(self) -> ReaperReport:
        """One pass; store failures are logged and retried at the next pass."""
        report = ReaperReport()
        if self.on_pass is not None:
            self.on_pass()
        if not self.lead:
            return report
        try:
            # The election lease outlives two missed passes but not a dead holder for long: a
            # SIGKILLed leader delays every recovery until it ends (bench/recovery.py). Two
            # reapers overlapping after a stall is harmless: a re-publish is marked first.
            report.leader = self.store.acquire_leadership(
                LEADER_NAME, self.holder, ttl=3 * self.interval
            )
            self.leader = report.leader
            if not report.leader:
                return report
            self._take_over_dead_owners(report)
            now = self.store.now()
            candidates = self.store.orphans(republish_after=self.republish_after, limit=BATCH)
            # With Redis leases the row's lease time is the claim's, never renewed: a key whose
            # Redis lease is still held is alive, whatever the row says.
            alive = self.leases.held([record.key for record in candidates])
            for record in candidates:
                if record.key not in alive:
                    self._recover(record, now, report)
            tracking = self.outbox
            if tracking is None or self._outbox_step(report, tracking.forget_claimed):
                # With tracking, a key is pruned only once its tracked publish is forgotten.
                # Batches until the expired backlog is gone or half the interval is spent:
                # one batch a pass pruned 500 rows/s at most, less than a busy cluster inserts
                # (bench/scale.py).
                report.pruned = self.store.prune_pass(
                    self.interval / 2, keep_tracked=tracking is not None
                )
                if tracking is not None:
                    self._outbox_step(report, tracking.republish_due)
        except StoreError as exc:
            self.leader = False
            logger.warning("celery_guard reaper pass failed: %s", exc)
        if self.leader and self.on_leader_pass is not None:
            self.on_leader_pass()
        if self.on_report is not None:
            self.on_report(report)
        outbox = report.outbox
        signals.reaper_pass.send(
            None,
            recovered_for=report.orphaned_for,
            dead_owners=len(report.dead_owners),
            unclaimed_republished=0 if outbox is None else len(outbox.republished),
            unclaimed_abandoned=0 if outbox is None else len(outbox.abandoned),
        )
        if report.recovered or report.unrecoverable or report.pruned:
            logger.info(
                "celery_guard reaper: recovered=%d unrecoverable=%d pruned=%d",
                len(report.recovered),
                len(report.unrecoverable),
                report.pruned,
            )
        if outbox is not None and (outbox.republished or outbox.abandoned or outbox.postponed):
            logger.info(
                "celery_guard reaper, tracked publishes: forgotten=%d republished=%d "
                "still_queued=%d abandoned=%d",
                outbox.forgotten,
                len(outbox.republished),
                outbox.postponed,
                len(outbox.abandoned),
            )
        return report

    def _outbox_step(self, report: ReaperReport, step: Callable[[OutboxReport], None]) -> bool:
        """One step of publish tracking; its store failure (a table your migrations have not
        created yet, say) is logged without ending the pass's other work or the sampling."""
        if report.outbox is None:
            report.outbox = OutboxReport()
        try:
            step(report.outbox)
        except StoreError as exc:
            logger.warning("celery_guard reaper: publish tracking failed this pass: %s", exc)
            return False
        return True

    def _take_over_dead_owners(self, report: ReaperReport) -> None:
        """End the leases of keys whose owner process is gone (its liveness lock vanished)."""
        for key, token, live in self.store.dead_owner_keys(limit=BATCH):
            if self._end_lease(key, token, live):
                report.dead_owners.append(key)
                logger.info(
                    "celery_guard reaper: owner of key=%s token=%s is dead (liveness lock "
                    "gone); taking over without waiting for the lease",
                    key,
                    token,
                )

    def end_owner(self, owner: str) -> list[str]:
        """End at once the leases of ``owner``, a pool process of this worker that died while
        the worker lives (its main process saw it go, celery_guard/lease/relay.py); the
        holder's next pass re-publishes their messages. Returns the keys."""
        ended: list[str] = []
        try:
            for key, token, live in self.store.running_of(owner, limit=BATCH):
                if self._end_lease(key, token, live):
                    ended.append(key)
        except StoreError as exc:
            logger.warning("celery_guard could not end the leases of %s: %s", owner, exc)
        if ended:
            logger.info(
                "celery_guard: pool process %s died; ended the leases of %d keys (%s)",
                owner,
                len(ended),
                ", ".join(ended[:5]),
            )
            signals.reaper_pass.send(
                None,
                recovered_for=[],
                dead_owners=len(ended),
                unclaimed_republished=0,
                unclaimed_abandoned=0,
            )
        return ended

    def _end_lease(self, key: str, token: int, live: bool) -> bool:
        # Redis leases: drop the dead owner's lease too (value-checked, so a newer holder's
        # lease is never touched); the row's own lease time was set at claim only.
        dropped = not self.leases.in_store and self.leases.release(key, token)
        return (live and self.store.expire_lease(key, token)) or dropped

    def _recover(self, record: KeyRecord, now: float, report: ReaperReport) -> None:
        if record.message is None:
            if record.republished_at is None:
                report.unrecoverable.append(record.key)
                logger.warning(
                    "celery_guard orphaned key=%s token=%s has no stored message (arguments "
                    "are not JSON); it waits for the broker to redeliver",
                    record.key,
                    record.fencing_token,
                )
                self.store.mark_republished(record.key, record.fencing_token, self.republish_after)
            return
        # Mark first: if two reapers ever overlap, only the one whose mark landed publishes.
        if not self.store.mark_republished(record.key, record.fencing_token, self.republish_after):
            return
        republish(self.app, serialization.loads(record.message))
        orphaned_for = max(0.0, now - (record.lease_expires_at or now))
        report.recovered.append(record.key)
        report.orphaned_for.append(orphaned_for)
        logger.info(
            "celery_guard reaper re-published key=%s token=%s owner=%s orphaned_for=%.1fs",
            record.key,
            record.fencing_token,
            record.owner,
            orphaned_for,
        )

    # -- running in a worker's main process ---------------------------------------------------

    def start(self) -> None:
        """Run passes every ``interval`` seconds in a daemon thread until :meth:`stop`."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="celery_guard-reaper", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        try:
            self.store.resign_leadership(LEADER_NAME, self.holder)
        except StoreError as exc:
            logger.info("celery_guard reaper could not resign: %s", exc)
        if self.outbox is not None:
            self.outbox.close()

    def _run(self) -> None:
        while not self._stopped.wait(self.interval):
            try:
                self.run_once()
            except Exception:  # a bad pass must not end recovery for the worker's lifetime
                logger.exception("celery_guard reaper pass crashed")
