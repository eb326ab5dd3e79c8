-- heartbeat: the owner extends its lease (see Store.Heartbeat).
-- KEYS[1] the record, KEYS[2] its slot's in-flight index. ARGV: token,
-- lease ms (0 gives the record up: it stays in flight, abandoned).
local rec = KEYS[1]
local v, op, _, attempt, x, w, by = owned(rec, ARGV[1])
if not v then
  return fenced()
end
local deadline = string.format('%d', now() + tonumber(ARGV[2]))
redis.call('SET', rec, encode('p', string.sub(v, 2, 33), op, deadline, ARGV[1], attempt, x, w, by), 'KEEPTTL')
redis.call('ZADD', KEYS[2], deadline, rec)
return 1
