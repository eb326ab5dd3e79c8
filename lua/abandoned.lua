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
  local op, deadline
  if v and state(v) == IN_FLIGHT then
    op, deadline = decode(v)
  end
  if op then
    if tonumber(deadline) <= t then
      out[#out + 1] = rec
      out[#out + 1] = fingerprint(v)
      out[#out + 1] = deadline
    end
  else
    -- Completed, released or expired: the entry is stale. So is one
    -- whose value this version did not write (see decode): no claim takes
    -- it over, so no sweep can settle it, and it must not fail the
    -- listing of the others.
    redis.call('ZREM', leases, rec)
  end
end
return out
