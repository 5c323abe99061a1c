"""Lease backends: where a running key's lease lives and is renewed.

The SQL store always decides completion (its row holds the highest fencing token). The lease
may live beside it, in the same row (the default), or in Redis (``guard_lease_url``) so that
heartbeats write nothing to the database: ``SET NX PX`` to acquire, token-checked renew and
release in Lua, ``INCR`` for the fencing counter (docs/design.md#where-state-lives).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

import redis

from celery_guard.errors import StoreUnavailable
from celery_guard.store.base import LeaseRows
from celery_guard.store.queries import texts


@dataclass(frozen=True)
class Acquisition:
    """The lease part of a claim."""

    #: False when another execution holds the lease: the delivery is in flight elsewhere.
    acquired: bool
    #: What renew and release check (Redis: the value stored in the lease); ``None`` when the
    #: SQL row itself is the lease.
    handle: int | None = None
    #: Seconds left on the holder's lease when not acquired.
    remaining: float = 0.0


#: What :meth:`SqlLeases.acquire` answers: the claim itself takes the row's lease.
_IN_THE_ROW = Acquisition(acquired=True)


class LeaseBackend(Protocol):
    """The operations the handler, the heartbeat and the reaper need of a lease backend."""

    #: True when leases live in the store's rows (the claim itself takes them).
    in_store: bool

    def acquire(self, key: str, ttl: float) -> Acquisition: ...

    def renew_leases(
        self,
        leases: Iterable[tuple[str, int]],
        ttl: float,
        statuses: Mapping[str, str] | None = None,
    ) -> set[str]:
        """Extend each (key, handle) lease still held; return the renewed keys.

        ``statuses`` (key -> JSON) is what runs, for operators; a backend may publish it
        beside the lease (Redis does) or ignore it. It never decides anything.
        """
        ...

    def release(self, key: str, handle: int | None) -> bool:
        """Drop the lease if ``handle`` still holds it; True when it did. A ``None`` handle
        holds nothing to release (the handler does not call it then)."""
        ...

    def held(self, keys: list[str]) -> set[str]:
        """Which of ``keys`` have a live lease (the reaper skips those)."""
        ...


class SqlLeases:
    """Leases in the idempotency rows: the claim takes them, the heartbeat updates the rows."""

    in_store = True

    def __init__(self, store: LeaseRows) -> None:
        self.store = store

    def acquire(self, key: str, ttl: float) -> Acquisition:
        return _IN_THE_ROW  # immutable: one for every delivery

    def renew_leases(
        self,
        leases: Iterable[tuple[str, int]],
        ttl: float,
        statuses: Mapping[str, str] | None = None,
    ) -> set[str]:
        # The rows hold owner and lease times already; live status is a Redis-backend feature.
        return self.store.renew_leases(leases, ttl)

    def release(self, key: str, handle: int | None) -> bool:
        """Nothing to do: completing or releasing the row ends its lease."""
        return False

    def held(self, keys: list[str]) -> set[str]:
        # The reaper's query already keeps only rows whose lease expired.
        return set()


#: The Lua scripts of :class:`RedisLeases` by name (``scripts.lua``), read once at import.
SCRIPTS = texts("celery_guard.lease", "scripts.lua")


class RedisLeases:
    """Leases in Redis; one client per process, created after fork."""

    in_store = False

    def __init__(self, url: str, *, timeout: float, prefix: str = "celery_guard") -> None:
        self.url = url
        self.timeout = timeout
        self.prefix = prefix
        self._lock = threading.Lock()
        self._client: redis.Redis | None = None
        self._client_pid: int | None = None
        self._scripts: dict[str, Any] = {}

    def lease_key(self, key: str) -> str:
        # The hash tag keeps a key's lease and counter in one slot on Redis Cluster.
        return f"{self.prefix}:{{{key}}}:lease"

    def fence_key(self, key: str) -> str:
        return f"{self.prefix}:{{{key}}}:fence"

    def status_key(self, key: str) -> str:
        return f"{self.prefix}:{{{key}}}:status"

    @property
    def client(self) -> redis.Redis:
        pid = os.getpid()
        with self._lock:
            if self._client is None or self._client_pid != pid:
                # A client inherited across fork shares the parent's sockets: never reuse it.
                self._client = redis.Redis.from_url(
                    self.url,
                    socket_timeout=self.timeout,
                    socket_connect_timeout=self.timeout,
                    health_check_interval=30,
                )
                self._client_pid = pid
                self._scripts = {
                    name: self._client.register_script(SCRIPTS[name])
                    for name in ("acquire", "renew", "release")
                }
            return self._client

    def acquire(self, key: str, ttl: float) -> Acquisition:
        client = self.client
        try:
            acquired, token, pttl = self._scripts["acquire"](
                keys=[self.lease_key(key), self.fence_key(key)],
                args=[max(1, int(ttl * 1000))],
                client=client,
            )
        except redis.RedisError as exc:
            raise self._unavailable(exc) from exc
        return Acquisition(
            acquired=bool(acquired), handle=int(token), remaining=max(0, int(pttl)) / 1000
        )

    def renew_leases(
        self,
        leases: Iterable[tuple[str, int]],
        ttl: float,
        statuses: Mapping[str, str] | None = None,
    ) -> set[str]:
        pairs = list(leases)
        if not pairs:
            return set()
        client = self.client
        statuses = statuses or {}
        try:
            # One round trip for every lease this process holds; the live status rides along
            # (for ``guard status``: what runs now, readable without touching the database).
            pipeline = client.pipeline(transaction=False)
            for key, handle in pairs:
                self._scripts["renew"](
                    keys=[self.lease_key(key), self.status_key(key)],
                    args=[handle, max(1, int(ttl * 1000)), statuses.get(key, "")],
                    client=pipeline,
                )
            answers = pipeline.execute()
        except redis.RedisError as exc:
            raise self._unavailable(exc) from exc
        return {key for (key, _), answer in zip(pairs, answers, strict=True) if answer == 1}

    def release(self, key: str, handle: int | None) -> bool:
        if handle is None:
            return False
        client = self.client
        try:
            dropped = self._scripts["release"](
                keys=[self.lease_key(key), self.status_key(key)], args=[handle], client=client
            )
        except redis.RedisError as exc:
            raise self._unavailable(exc) from exc
        return bool(dropped == 1)

    def held(self, keys: list[str]) -> set[str]:
        if not keys:
            return set()
        try:
            values = self.client.mget([self.lease_key(key) for key in keys])
        except redis.RedisError as exc:
            raise self._unavailable(exc) from exc
        return {key for key, value in zip(keys, values, strict=True) if value is not None}

    def live_statuses(self, limit: int = 1000) -> list[dict[str, Any]]:
        """What runs now, from the status entries renewals write (at most ``limit``).

        For operators only (``guard status``): an entry lives as long as its lease, and is
        never used to decide anything; the store decides (docs/design.md#where-state-lives).
        """
        entries: list[dict[str, Any]] = []
        try:
            client = self.client
            names = []
            for name in client.scan_iter(match=f"{self.prefix}:{{*}}:status", count=500):
                names.append(name)
                if len(names) >= limit:
                    break
            raw_values = client.mget(names) if names else []
        except redis.RedisError as exc:
            raise self._unavailable(exc) from exc
        for raw in raw_values:
            if raw is None:
                continue  # expired between SCAN and MGET
            try:
                entry = json.loads(raw)
            except ValueError:
                continue
            if isinstance(entry, dict):
                entries.append(entry)
        return sorted(entries, key=lambda entry: float(entry.get("started_at") or 0))

    def close(self) -> None:
        with self._lock:
            if self._client is not None and self._client_pid == os.getpid():
                self._client.close()
            self._client = None

    def _unavailable(self, exc: Exception) -> StoreUnavailable:
        where = urlsplit(self.url)  # host and port only: the URL may carry a password
        return StoreUnavailable(
            f"lease store {where.scheme}://{where.hostname}:{where.port} unavailable: {exc}"
        )
