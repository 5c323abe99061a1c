-- The Redis lease scripts (celery_guard/lease/backends.py, RedisLeases), each run atomically by
-- Redis. A lease is the key KEYS[1] holding its fencing token; the counter that issues tokens
-- and the live status entry sit beside it in the same hash slot.

-- name: acquire
-- Take the lease if free: {1, new token, ttl ms}; else {0, holder's token, ms left}.
-- KEYS: lease, fence counter. ARGV: ttl in ms.
if redis.call('EXISTS', KEYS[1]) == 1 then
  return {0, tonumber(redis.call('GET', KEYS[1])) or 0, redis.call('PTTL', KEYS[1])}
end
local token = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], token, 'PX', ARGV[1])
return {1, token, tonumber(ARGV[1])}

-- name: renew
-- Extend the lease if the token still holds it, writing the live status beside it: 1, else 0.
-- KEYS: lease, status. ARGV: token, ttl in ms, status JSON ('' for none).
if redis.call('GET', KEYS[1]) == ARGV[1] then
  if ARGV[3] ~= '' then
    redis.call('SET', KEYS[2], ARGV[3], 'PX', ARGV[2])
  end
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0

-- name: release
-- Drop the lease and its status if the token still holds it: 1, else 0.
-- KEYS: lease, status. ARGV: token.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[2])
  return redis.call('DEL', KEYS[1])
end
return 0
