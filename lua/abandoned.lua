-- abandoned: the records of one hash slot that are in flight with a lease
-- that ran out (see Store.Abandoned).
-- KEYS[1] the slot's in-flight index. ARGV: the most records to return.
-- Returns record key, fingerprint, lease deadline, record key, ... oldest
-- lease first.
local leases = KEYS[1]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {}
local due = redis.call('ZRANGEBYSCORE', leases, '-inf', now, 'LIMIT', 0, tonumber(ARGV[1]))
for _, rec in ipairs(due) do
  local cur = redis.pcall('HMGET', rec, 's', 'l', 'f')
  if cur.err then
    -- A completed record (a string, see claim.lua): the entry is stale.
    redis.call('ZREM', leases, rec)
  elseif cur[1] == 'p' and tonumber(cur[2]) <= now then
    out[#out + 1] = rec
    out[#out + 1] = cur[3]
    out[#out + 1] = cur[2]
  elseif not cur[1] then
    -- The record's retention ran out: the entry is stale.
    redis.call('ZREM', leases, rec)
  end
end
return out
