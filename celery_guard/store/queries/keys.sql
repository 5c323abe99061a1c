-- celery_guard_keys: the statements of the hot path written by hand (celery_guard/store/keys.py).
-- The claim is one text with placeholders ({now}, {first_token}, ...) that keys.py fills with the
-- fragments below, once per dialect and claim variant.

-- name: claim
-- Insert or take over the key's row in one statement, one round trip, whatever the outcome
-- (a first delivery sends claim_new before it, below).
-- The inner SELECT decides once what kind of claim this is; every column then reads that
-- decision. ``k`` is the existing row, ``excluded`` the row this claim proposed, whose
-- updated_at is "now" by the database's clock. A claim that does not own the key rewrites the
-- row with its own values (a no-op) but for the duplicates counter, so the RETURNING row always
-- answers: owned (claim_id is ours), COMPLETED, in flight or a payload conflict.
-- It returns the row but for the two texts, each only where the handler reads it: the stored
-- message of a DEAD key (its failed task id), the result a duplicate answers with.
-- A claim stores its delivery's message (what the reaper re-publishes); a RETRY or TAKEOVER
-- whose message is the stored one keeps the stored value, so PostgreSQL writes a large
-- (TOASTed) message once, not again with every claim of the key.
{new_row}
ON CONFLICT (key) DO UPDATE SET (
    state, attempts, fencing_token, lease_expires_at, owner, owner_lock, claim_id, claim_reason,
    task_name, fingerprint, message, result, completed_at, expires_at, created_at,
    updated_at, republished_at, duplicates
) = (
    SELECT
        CASE WHEN d.claim THEN 'RUNNING' ELSE k.state END,
        CASE WHEN d.expired THEN 1 WHEN d.claim THEN k.attempts + 1 ELSE k.attempts END,
        CASE WHEN d.claim THEN {next_token} ELSE k.fencing_token END,
        CASE WHEN d.claim THEN excluded.lease_expires_at ELSE k.lease_expires_at END,
        CASE WHEN d.claim THEN excluded.owner ELSE k.owner END,
        CASE WHEN d.claim THEN excluded.owner_lock ELSE k.owner_lock END,
        CASE WHEN d.claim THEN excluded.claim_id ELSE k.claim_id END,
        CASE WHEN d.resent THEN k.claim_reason WHEN d.expired THEN 'NEW'
             WHEN d.lapsed THEN 'TAKEOVER' WHEN d.released THEN 'RETRY'
             ELSE k.claim_reason END,
        CASE WHEN d.claim THEN excluded.task_name ELSE k.task_name END,
        CASE WHEN d.claim THEN excluded.fingerprint ELSE k.fingerprint END,
        CASE WHEN d.claim AND (k.message IS NULL OR excluded.message IS NULL
                               OR excluded.message <> k.message)
             THEN excluded.message ELSE k.message END,
        CASE WHEN d.claim THEN NULL ELSE k.result END,
        CASE WHEN d.claim THEN NULL ELSE k.completed_at END,
        CASE WHEN d.claim THEN NULL ELSE k.expires_at END,
        CASE WHEN d.expired THEN excluded.created_at ELSE k.created_at END,
        CASE WHEN d.claim THEN excluded.updated_at ELSE k.updated_at END,
        CASE WHEN d.claim THEN NULL ELSE k.republished_at END,
        CASE WHEN d.replay THEN k.duplicates + 1 ELSE k.duplicates END
    FROM (
        SELECT c.resent, c.expired, c.lapsed, c.released,
               (c.resent OR c.expired OR c.lapsed OR c.released) AS claim,
               (k.state = 'COMPLETED' AND NOT c.expired AND c.same) AS replay
        FROM (
            SELECT
                COALESCE(k.claim_id = excluded.claim_id, FALSE) AS resent,
                (k.state = 'COMPLETED'
                 AND COALESCE(k.expires_at <= excluded.updated_at, FALSE)) AS expired,
                (k.state = 'RUNNING' AND {lapsed} AND {same}) AS lapsed,
                (k.state = 'RELEASED' AND {same}) AS released,
                {same} AS same
        ) AS c
    ) AS d
)
RETURNING key, task_name, state, attempts, fencing_token, lease_expires_at, owner, owner_lock,
    claim_id, claim_reason, fingerprint, last_error, duplicates, created_at, updated_at,
    completed_at, expires_at, republished_at,
    CASE WHEN state = 'DEAD' THEN message END AS message,
    CASE WHEN state = 'COMPLETED' THEN result END AS result,
    lease_expires_at - {now} AS lease_remaining{claim_commit}

-- name: claim_new
-- The claim of a key that has no row yet, the common case: the same new row, or nothing.
-- PostgreSQL sets up the executor state of an ON CONFLICT DO UPDATE clause (its SET list of
-- CASE expressions and its sub-SELECT) on every execution, conflict or not: about 50 us of
-- server CPU per claim, a third of the claim's cost (bench/claim_cost.py). A new key needs none
-- of it, so the claim tries this first and sends the full upsert only when the key exists.
-- RETURNING gives what the client cannot know: the token and the database's times.
{new_row}
ON CONFLICT (key) DO NOTHING
RETURNING fencing_token, lease_expires_at, created_at, updated_at,
    lease_expires_at - {now} AS lease_remaining{claim_commit}

-- name: new_row
-- The row a claim proposes: a RUNNING key at attempt 1 with its first token (both claims).
INSERT INTO celery_guard_keys AS k (
    key, task_name, state, attempts, fencing_token, lease_expires_at, owner, owner_lock,
    claim_id, claim_reason, fingerprint, message, duplicates, created_at, updated_at)
VALUES (
    :p_key, :p_task_name, 'RUNNING', 1, {first_token}, {now} + :p_lease_ttl, :p_owner,
    :p_owner_lock, :p_claim_id, 'NEW', :p_fingerprint, :p_message, 0, {now}, {now})

-- name: claim_commit
-- PostgreSQL: the synchronous_commit level of the claim's own (autocommitted) transaction,
-- set for that transaction only; evaluated in RETURNING, which every claim reaches (its upsert
-- always returns its one row), and read by PostgreSQL when the statement commits.
, set_config('synchronous_commit', '{level}', true) AS synchronous_commit

-- name: first_token
-- A new row's first token: above every token of the key's pruned rows (see prune_completed).
(COALESCE((SELECT f.term FROM celery_guard_leaders AS f WHERE f.name = '{token_floor}'), 0) + 1)

-- name: next_token
-- A claim of an existing row: the row's token plus one.
k.fencing_token + 1

-- name: external_first_token
-- With a Redis lease: a new row's first token, at least the lease store's token.
CASE WHEN {first_token} > :p_external_token THEN {first_token} ELSE :p_external_token END

-- name: external_next_token
-- With a Redis lease: the row's token must rise even if the lease store's counter went back.
CASE WHEN k.fencing_token + 1 > :p_external_token THEN k.fencing_token + 1 ELSE :p_external_token END

-- name: lapsed
-- The row's own lease has expired (by the claim's "now").
COALESCE(k.lease_expires_at <= excluded.updated_at, FALSE)

-- name: same_payload
-- Same payload: the fingerprints match (a row without one accepts any).
COALESCE(k.fingerprint = excluded.fingerprint OR k.fingerprint IS NULL, FALSE)

