-- abandoned: the records of one hash slot that are in flight with a lease
-- that ran out (see Store.Abandoned).
-- KEYS[1] the slot's in-flight index. ARGV: the most records to return.
-- Returns record key, fingerprint, lease deadline, record key, ... oldest
-- lease first.
local leases = KEYS[1]
local t = now()
local out = {}
local due = redis.call('ZRANGEBYSCORE', leases, '-inf', t, 'LIMIT', 0, tonumber(ARGV[1]))
for _, rec in ipairs(due) do
  local v = redis.call('GET', rec)
  if v and state(v) == IN_FLIGHT then
    local _, deadline = decode(v)
    if tonumber(deadline) <= t then
      out[#out + 1] = rec
      out[#out + 1] = fingerprint(v)
      out[#out + 1] = deadline
    end
  else
    -- Completed, released or expired: the entry is stale.
    redis.call('ZREM', leases, rec)
  end
end
return out
