-- claim: one atomic claim of a record (see Store.Claim in store.go).
-- KEYS[1] the record, KEYS[2] the token sequence of its hash slot, KEYS[3]
-- the slot's in-flight index (a sorted set: record -> lease deadline), which
-- lets a sweeper find abandoned records without scanning the keyspace.
-- ARGV: fingerprint, operation id for a new record (also this claim's own
-- id), lease ms, retention ms, watch ("1": remember that a waiter waits, so
-- that settling publishes).
--
-- A record in flight or released is a hash: s state (p in flight, r
-- released), f fingerprint, o operation id, a attempt, t owner's token, l
-- lease deadline (ms, by this server's clock), n the id of the claim that
-- took over (absent: the record's maker, whose id is o), x that takeover's
-- predecessor was abandoned, w someone waits. A completed record is one string, which Redis keeps compactly
-- whatever the response's size: "c", the fingerprint (32 bytes), the
-- operation id's length (one byte), the operation id, the response.
local rec, seq, leases = KEYS[1], KEYS[2], KEYS[3]
local fp, op, lease, retention = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]

-- GET first: it answers the two common cases, no record and completed,
-- without raising an error; only a record in flight or released needs more.
local v = redis.pcall('GET', rec)
if v and not v.err then
  -- Completed. Replays cost no clock read.
  if string.sub(v, 2, 33) ~= fp then
    return {'mismatch'}
  end
  local n = string.byte(v, 34)
  return {'completed', string.sub(v, 35, 34 + n), string.sub(v, 35 + n)}
end
local cur = {}
if v then
  cur = redis.call('HMGET', rec, 's', 'f', 'o', 'a', 'l', 't', 'n', 'x')
end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
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
if state == 'p' and (cur[7] or cur[3]) == op then
  -- This very claim ran before and its reply was lost (a client retries a
  -- script after a network error): the caller is the owner already.
  return {'owner', cur[3], cur[4], cur[6], cur[8] or '0'}
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
local abandoned = '0'
if state == 'p' then
  abandoned = '1'
end
redis.call('HSET', rec, 's', 'p', 'a', attempt, 't', tok, 'l', deadline, 'n', op, 'x', abandoned)
redis.call('ZADD', leases, deadline, rec)
-- The new owner must not lose the record to expiry while it runs.
if redis.call('PTTL', rec) < tonumber(retention) then
  redis.call('PEXPIRE', rec, retention)
end
return {'owner', cur[3], attempt, tok, abandoned}
