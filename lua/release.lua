-- release: the owner ends its attempt without an outcome (see Store.Release).
-- KEYS[1] the record, KEYS[2] its slot's in-flight index. ARGV: token,
-- forget ("1": delete the record), the publish command.
local rec = KEYS[1]
local cur = redis.pcall('HMGET', rec, 's', 't', 'w')
if cur.err or cur[1] ~= 'p' or cur[2] ~= ARGV[1] then
  return redis.error_reply('FENCED not the current owner')
end
redis.call('ZREM', KEYS[2], rec)
if ARGV[2] == '1' then
  redis.call('DEL', rec)
else
  redis.call('HSET', rec, 's', 'r')
  redis.call('HDEL', rec, 't', 'l', 'w', 'n', 'x')
end
-- Waiters re-claim when woken: one becomes the owner, the others register
-- again.
if cur[3] then
  redis.call(ARGV[3], rec, 'r')
end
return 1
