-- heartbeat: the owner extends its lease (see Store.Heartbeat), or with a
-- lease of 0 gives it up (Store.Abandon): the record stays in flight,
-- abandoned.
-- KEYS[1] the record, KEYS[2] its slot's in-flight index. ARGV: token,
-- lease ms.
local rec = KEYS[1]
local v, op, _, attempt, abandoned, waited, claimer = owned(rec, ARGV[1])
if not v then
  return fenced()
end
local deadline = string.format('%d', now() + tonumber(ARGV[2]))
redis.call('SET', rec, encode(IN_FLIGHT, fingerprint(v), op, deadline, ARGV[1], attempt, abandoned, waited, claimer), 'KEEPTTL')
-- The record outlives the renewed lease: expired under a live owner, it
-- would let a claim make a new record, and a second owner, beside it.
if redis.call('PTTL', rec) < tonumber(ARGV[2]) then
  redis.call('PEXPIRE', rec, ARGV[2])
end
redis.call('ZADD', KEYS[2], deadline, rec)
return 1
