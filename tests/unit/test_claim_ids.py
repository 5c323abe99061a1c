"""Claim ids: unique per claim without a random draw each, and across forked processes."""

from __future__ import annotations

import os

from celery_guard.store import keys


def test_claim_ids_are_unique_fit_the_column_and_a_forked_child_draws_its_own() -> None:
    ids = {keys._claim_ids.next() for _ in range(1000)}
    assert len(ids) == 1000
    assert {len(claim_id) for claim_id in ids} == {32}  # celery_guard_keys.claim_id: 32
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a prefork pool process
        os.write(write, keys._claim_ids.next().encode())
        os._exit(0)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    child_id = os.read(read, 64).decode()
    os.close(read)
    assert status == 0
    assert child_id[:16] != keys._claim_ids.next()[:16]  # its own prefix, not the parent's
