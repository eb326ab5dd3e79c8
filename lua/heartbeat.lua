-- heartbeat: the owner extends its lease (see Store.Heartbeat), or with a
-- lease of 0 gives it up (Store.Abandon): the record stays in flight,
-- abandoned.
-- KEYS[1] the record, KEYS[2] its recovery points, KEYS[3] its slot's
-- in-flight index. ARGV: token, lease ms.
local rec = KEYS[1]
local v, op, deadline, attempt, abandoned, waited, claimer = owned(rec, ARGV[1])
if not v then
  return fenced()
end
local lease = tonumber(ARGV[2])
local renewed = now() + lease
local renewedText = string.format('%d', renewed)
redis.call('SET', rec, encode(IN_FLIGHT, fingerprint(v), op, renewedText, ARGV[1], attempt, abandoned, waited, claimer), 'KEEPTTL')
-- The expiry moves with the lease, as Store.Heartbeat says, and the
-- recovery points' with it.
local moved, ttl = renewed - tonumber(deadline), redis.call('PTTL', rec)
if moved > 0 and ttl >= 0 then
  local expiry = string.format('%d', math.max(ttl + moved, lease))
  redis.call('PEXPIRE', rec, expiry)
  redis.call('PEXPIRE', KEYS[2], expiry)
end
redis.call('ZADD', KEYS[3], renewedText, rec)
return 1
