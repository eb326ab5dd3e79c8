-- heartbeat: the owner extends its lease (see Store.Heartbeat).
-- KEYS[1] the record, KEYS[2] its slot's in-flight index. ARGV: token,
-- lease ms (0 gives the record up: it stays in flight, abandoned).
local rec = KEYS[1]
local cur = redis.pcall('HMGET', rec, 's', 't')
if cur.err or cur[1] ~= 'p' or cur[2] ~= ARGV[1] then
  return redis.error_reply('FENCED not the current owner')
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local deadline = string.format('%d', now + tonumber(ARGV[2]))
redis.call('HSET', rec, 'l', deadline)
redis.call('ZADD', KEYS[2], deadline, rec)
return 1
