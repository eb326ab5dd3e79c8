-- inspect: one record as it is, for an operator (see RedisStore.Inspect).
-- KEYS[1] the record, KEYS[2] its recovery points.
-- Returns the record (false when there is none), its time to live in ms,
-- this server's clock in ms, and the entries of its recovery points.
local v = redis.call('GET', KEYS[1])
return {v, redis.call('PTTL', KEYS[1]), now(), v and recordPoints(v, KEYS[2]) or ''}
