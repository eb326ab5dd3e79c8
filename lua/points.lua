-- points: the owner reads its record's recovery points (see
-- RedisStore.RecoveryPoints).
-- KEYS[1] the record, KEYS[2] its recovery points. ARGV: token.
-- Returns the points' entries (internal/wire), empty when there are none.
local v, op = owned(KEYS[1], ARGV[1])
if not v then
  return fenced()
end
local p, head = redis.call('GET', KEYS[2]), pointsHead(op)
if p and string.sub(p, 1, #head) == head then
  return string.sub(p, #head + 1)
end
return ''
