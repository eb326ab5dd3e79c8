-- complete: the owner stores its outcome (see Store.Complete).
-- KEYS[1] the record, KEYS[2] its slot's in-flight index. ARGV: token,
-- encoded response, retention ms, the publish command (PUBLISH, or SPUBLISH
-- on a cluster).
local rec = KEYS[1]
local cur = redis.pcall('HMGET', rec, 's', 't', 'w', 'f', 'o')
if cur.err or cur[1] ~= 'p' or cur[2] ~= ARGV[1] then
  return redis.error_reply('FENCED not the current owner')
end
-- The completed record replaces the hash with one string (see claim.lua).
redis.call('SET', rec, 'c' .. cur[4] .. string.char(#cur[5]) .. cur[5] .. ARGV[2], 'PX', ARGV[3])
redis.call('ZREM', KEYS[2], rec)
-- Only a registered waiter costs a publish: the happy path pays nothing.
if cur[3] then
  redis.call(ARGV[4], rec, 'c')
end
return 1
