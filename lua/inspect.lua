-- inspect: one record as it is, for an operator (see RedisStore.Inspect).
-- KEYS[1] the record.
-- Returns the record (false when there is none), its time to live in ms,
-- and this server's clock in ms.
return {redis.call('GET', KEYS[1]), redis.call('PTTL', KEYS[1]), now()}
