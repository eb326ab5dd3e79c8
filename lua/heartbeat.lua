-- heartbeat: the owner extends its lease (see Store.Heartbeat).
-- KEYS[1] the record. ARGV: token, lease ms.
local rec = KEYS[1]
local cur = redis.call('HMGET', rec, 's', 't')
if cur[1] ~= 'p' or cur[2] ~= ARGV[1] then
  return redis.error_reply('FENCED not the current owner')
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', rec, 'l', string.format('%d', now + tonumber(ARGV[2])))
return 1
