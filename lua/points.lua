-- points: the owner reads its record's recovery points (see
-- RedisStore.RecoveryPoints).
-- KEYS[1] the record, KEYS[2] its recovery points. ARGV: token.
-- Returns the points' entries (internal/wire), empty when there are none.
local v, op = owned(KEYS[1], ARGV[1])
if not v then
  return fenced()
end
return pointsOf(KEYS[2], op)
