-- release: the owner ends its attempt without an outcome (Store.Release),
-- or deletes the record (Store.Forget).
-- KEYS[1] the record, KEYS[2] its recovery points, which a release keeps
-- for the next attempt, KEYS[3] its slot's in-flight index. ARGV: token,
-- forget ("1": delete the record and its recovery points), the publish
-- command.
local rec = KEYS[1]
local v, op, _, attempt, _, waited = owned(rec, ARGV[1])
if not v then
  return fenced()
end
redis.call('ZREM', KEYS[3], rec)
if ARGV[2] == '1' then
  redis.call('DEL', rec, KEYS[2])
else
  redis.call('SET', rec, encode(RELEASED, fingerprint(v), op, '0', '0', attempt, '0', '0', ''), 'KEEPTTL')
end
-- Waiters re-claim when woken: one becomes the owner, the others register
-- again.
if waited == '1' then
  redis.call(ARGV[3], rec, RELEASED)
end
return 1
