-- claim: one atomic claim of a record (see Store.Claim in store.go).
-- KEYS[1] the record (a hash), KEYS[2] the token sequence of its hash slot,
-- KEYS[3] the slot's in-flight index (a sorted set: record -> lease deadline),
-- which lets a sweeper find abandoned records without scanning the keyspace.
-- ARGV: fingerprint, operation id for a new record, lease ms, retention ms,
-- watch ("1": remember that a waiter waits, so that settling publishes).
-- Fields: s state (p in flight, c completed, r released), f fingerprint,
-- o operation id, a attempt, t owner's token, l lease deadline (ms, by this
-- server's clock), r stored response, w someone waits.
local rec, seq, leases = KEYS[1], KEYS[2], KEYS[3]
local fp, op, lease, retention = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local cur = redis.call('HMGET', rec, 's', 'f', 'o', 'a', 'l', 'r')
local state = cur[1]
if not state then
  -- The sequence never expires, so a token is never issued twice, even
  -- after a record expires and is made again: fencing survives expiry.
  local tok = string.format('%d', redis.call('INCR', seq))
  local deadline = string.format('%d', now + lease)
  redis.call('HSET', rec, 's', 'p', 'f', fp, 'o', op, 'a', '1', 't', tok, 'l', deadline)
  redis.call('PEXPIRE', rec, retention)
  redis.call('ZADD', leases, deadline, rec)
  return {'owner', op, '1', tok, '0'}
end
if cur[2] ~= fp then
  return {'mismatch'}
end
if state == 'c' then
  return {'completed', cur[3], cur[6]}
end
if state == 'p' then
  local left = tonumber(cur[5]) - now
  if left > 0 then
    if ARGV[5] == '1' then
      redis.call('HSET', rec, 'w', '1')
    end
    return {'inflight', string.format('%d', left)}
  end
end
-- Released, or in flight past its lease: take over. The new token fences
-- the previous owner off; the operation id stays.
local tok = string.format('%d', redis.call('INCR', seq))
local attempt = string.format('%d', tonumber(cur[4]) + 1)
local deadline = string.format('%d', now + lease)
redis.call('HSET', rec, 's', 'p', 'a', attempt, 't', tok, 'l', deadline)
redis.call('ZADD', leases, deadline, rec)
-- The new owner must not lose the record to expiry while it runs.
if redis.call('PTTL', rec) < tonumber(retention) then
  redis.call('PEXPIRE', rec, retention)
end
local abandoned = '0'
if state == 'p' then
  abandoned = '1'
end
return {'owner', cur[3], attempt, tok, abandoned}
