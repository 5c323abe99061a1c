-- Recovery's statements written by hand (celery_guard/store/recovery.py): PostgreSQL only.

-- name: dead_owners
-- RUNNING keys whose owner's liveness lock is gone: (key, token, whether the lease still runs).
-- A session-level advisory lock on a bigint shows in pg_locks as classid (high 32 bits) and
-- objid (low 32 bits) with objsubid 1; lock ids are positive, so the shift cannot overflow.
SELECT k.key, k.fencing_token,
       k.lease_expires_at > CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS DOUBLE PRECISION)
           AS live
FROM celery_guard_keys AS k
WHERE k.state = 'RUNNING' AND k.owner_lock IS NOT NULL
  -- Claimed before the server (re)started: every session's lock died with it, the owner's
  -- proves nothing. The lease decides.
  AND k.updated_at > CAST(EXTRACT(EPOCH FROM pg_postmaster_start_time()) AS DOUBLE PRECISION)
  -- At least 2 s old: a worker's main process notices a lost session within about half a
  -- second (celery_guard/lease/relay.py) and takes the same lock id again on a new one; a
  -- claim its pool made in between (right after a server restart) recorded that id while no
  -- session held it, and is no proof of a death until the main has had time to take it again.
  AND k.updated_at < CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS DOUBLE PRECISION) - 2
  AND NOT EXISTS (
      SELECT 1 FROM pg_locks AS l
      WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
        AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
        AND ((l.classid::bigint << 32) | l.objid::bigint) = k.owner_lock)
LIMIT :p_limit
