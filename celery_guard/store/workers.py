"""``celery_guard_workers``: each worker's heartbeat, for ``guard status`` and the metrics."""

from __future__ import annotations

from sqlalchemy import case, delete, select

from celery_guard.store.base import WorkerRecord
from celery_guard.store.engine import StoreEngine
from celery_guard.store.schema import db_epoch_now, workers


class Workers:
    """Worker heartbeats: written by each worker's main process, read by operators."""

    def __init__(self, db: StoreEngine) -> None:
        self.db = db

    def beat_worker(
        self,
        hostname: str,
        *,
        pid: int,
        state: str,
        running: int,
        fenced: int,
        circuit: str | None,
        ttl: float,
    ) -> None:
        """Record that ``hostname`` is alive for ``ttl`` more seconds, and its state."""
        now = db_epoch_now()
        insert = self.db.upsert(workers).values(
            hostname=hostname,
            pid=pid,
            state=state,
            running=running,
            fenced=fenced,
            circuit=circuit,
            started_at=now,
            seen_at=now,
            expires_at=now + ttl,
        )
        new = insert.excluded
        statement = insert.on_conflict_do_update(
            index_elements=[workers.c.hostname],
            set_={
                # A restarted worker (new pid) starts a new life.
                "started_at": case(
                    (workers.c.pid == new.pid, workers.c.started_at), else_=new.started_at
                ),
                **{
                    name: getattr(new, name)
                    for name in (
                        "pid",
                        "state",
                        "running",
                        "fenced",
                        "circuit",
                        "seen_at",
                        "expires_at",
                    )
                },
            },
        )
        self.db.call(lambda: self.db.execute_single(statement))

    def remove_worker(self, hostname: str, pid: int) -> None:
        """Forget a worker that shut down cleanly (a killed one just stops beating)."""
        statement = delete(workers).where(workers.c.hostname == hostname, workers.c.pid == pid)
        self.db.call(lambda: self.db.execute_single(statement))

    def list_workers(self, seen_within: float = 3600.0) -> list[WorkerRecord]:
        """Workers seen in the last ``seen_within`` seconds, alive or not, by hostname."""
        now = db_epoch_now()
        statement = (
            select(workers, (workers.c.expires_at > now).label("alive"))
            .where(workers.c.seen_at > now - seen_within)
            .order_by(workers.c.hostname)
        )
        rows = self.db.call(lambda: self.db.execute_single(statement, read_only=True))[0]
        return [WorkerRecord(**{**row, "alive": bool(row["alive"])}) for row in rows]

    def prune_workers(self, older_than: float = 86400.0) -> int:
        """Delete heartbeats not renewed for ``older_than`` seconds (workers long gone)."""
        statement = delete(workers).where(workers.c.seen_at < db_epoch_now() - older_than)
        return self.db.call(lambda: self.db.execute_single(statement))[1]
