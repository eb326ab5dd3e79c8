-- point: the owner saves a recovery point (see
-- RedisStore.SaveRecoveryPoint).
-- KEYS[1] the record, KEYS[2] its recovery points. ARGV: token, the point's
-- entry (internal/wire).
local rec, pts = KEYS[1], KEYS[2]
local v, op = owned(rec, ARGV[1])
if not v then
  return fenced()
end
-- A resent save appends its entry again: the first of a step is the one
-- read, so it adds nothing.
local head = pointsHead(op)
if redis.call('GETRANGE', pts, 0, #head - 1) == head then
  redis.call('APPEND', pts, ARGV[2])
else
  redis.call('SET', pts, head .. ARGV[2])
end
-- The points expire with the record, and not before: PTTL rounds the
-- record's time to live down to the millisecond, so the points get one
-- more (points that outlive their record a moment belong to no record made
-- after it, whose operation ID differs).
local ttl = redis.call('PTTL', rec)
if ttl >= 0 then
  redis.call('PEXPIRE', pts, string.format('%d', ttl + 1))
end
return 1
