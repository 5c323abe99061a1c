-- Dead letters' statements written by hand (celery_guard/store/dead_letters.py).

-- name: advance_id_sequence
-- PostgreSQL: move the dead-letter id sequence past :p_id (a letter inserted under its own id).
-- Nothing happens when the table's id has no sequence or the sequence is past :p_id already.
SELECT setval(s.seq, :p_id) FROM (SELECT CAST(
    pg_get_serial_sequence('celery_guard_dead_letters', 'id') AS regclass
) AS seq) AS s WHERE s.seq IS NOT NULL
  AND COALESCE(pg_sequence_last_value(s.seq), 0) < :p_id
