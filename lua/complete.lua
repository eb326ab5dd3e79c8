-- complete: the owner stores its outcome (see Store.Complete).
-- KEYS[1] the record, KEYS[2] its recovery points, which the outcome ends,
-- KEYS[3] its slot's in-flight index. ARGV: token,
-- stored response, retention ms, the publish command (PUBLISH, or SPUBLISH
-- on a cluster).
local rec = KEYS[1]
local v, op, _, _, _, waited = owned(rec, ARGV[1])
if not v then
  -- A client resends a script whose reply was lost (go-redis does, after a
  -- network error). Finding this very response stored, the resend answers
  -- as the first send did: the outcome the caller holds is the one kept.
  v = redis.call('GET', rec)
  if v and state(v) == COMPLETED and response(v) == ARGV[2] then
    return 1
  end
  return fenced()
end
redis.call('SET', rec, completed(v, op, ARGV[2]), 'PX', ARGV[3])
redis.call('DEL', KEYS[2])
redis.call('ZREM', KEYS[3], rec)
-- Only a registered waiter costs a publish: the happy path pays nothing.
if waited == '1' then
  redis.call(ARGV[4], rec, COMPLETED)
end
return 1
