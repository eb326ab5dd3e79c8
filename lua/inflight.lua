-- inflight: the records of one hash slot in flight, abandoned ones
-- included, for an operator (see RedisStore.ListInFlight).
-- KEYS[1] the slot's in-flight index. ARGV[1] the earliest lease end, in
-- ms; ARGV[2] the most records to return; ARGV[3] the suffix of a record's
-- key that makes the key of its recovery points.
-- Returns this server's clock in ms, then record key, record, time to live
-- in ms, the entries of its recovery points, record key, ... the earliest
-- lease end first. Stale entries
-- (records settled or gone) are left for abandoned.lua to remove.
local out = {now()}
local recs = redis.call('ZRANGEBYSCORE', KEYS[1], ARGV[1], '+inf', 'LIMIT', 0, tonumber(ARGV[2]))
for _, rec in ipairs(recs) do
  local v = redis.call('GET', rec)
  if v and state(v) == IN_FLIGHT then
    out[#out + 1] = rec
    out[#out + 1] = v
    out[#out + 1] = redis.call('PTTL', rec)
    out[#out + 1] = recordPoints(v, rec .. ARGV[3])
  end
end
return out
