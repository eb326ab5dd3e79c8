-- claim: one atomic claim of a record (see Store.Claim in store.go).
-- KEYS[1] the record, KEYS[2] its recovery points, KEYS[3] the token
-- sequence of its hash slot, KEYS[4] the slot's in-flight index (a sorted
-- set: record -> lease deadline), which lets a sweeper find abandoned
-- records without scanning the keyspace.
-- ARGV: fingerprint, this claim's id (the operation ID of a record it
-- makes), lease ms, retention ms, watch ("1": remember that a waiter waits,
-- so that settling publishes).
-- Replies, the common ones the smallest: a new record, its token (an
-- integer); completed, the record itself (a string); otherwise an array:
-- {'owner', operation ID, attempt, token, abandoned}, {'inflight', ms left}
-- or {'mismatch'}.
local rec, pts, seq, leases = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local fp, id, lease = ARGV[1], ARGV[2], tonumber(ARGV[3])

local v = redis.call('GET', rec)
if not v then
  -- The sequence never expires, so a token is never issued twice, even
  -- after a record expires and is made again: fencing survives expiry.
  -- Recovery points left by an earlier record of the key are under its
  -- operation ID, not this one: they count as none.
  local token = redis.call('INCR', seq)
  local deadline = string.format('%d', now() + lease)
  redis.call('SET', rec, encode(IN_FLIGHT, fp, id, deadline, string.format('%d', token), '1', '0', '0', ''), 'PX', ARGV[4])
  redis.call('ZADD', leases, deadline, rec)
  return token
end
if fingerprint(v) ~= fp then
  return {'mismatch'}
end
local st = state(v)
if st == COMPLETED then
  -- Replays cost no clock read.
  return v
end
if st ~= IN_FLIGHT and st ~= RELEASED then
  -- Not a record this version writes (another program's value, or a newer
  -- version's state): taken over, it would run the operation again.
  return redis.error_reply('RECORD state ' .. string.format('%q', st) .. ' unknown')
end
local op, deadline, token, attempt, abandoned, waited, claimer = decode(v)
if not op then
  return redis.error_reply('RECORD malformed')
end
if st == IN_FLIGHT and (claimer == '' and op or claimer) == id then
  -- This very claim ran before and its reply was lost (a client retries a
  -- script after a network error): the caller is the owner already.
  return {'owner', op, attempt, token, abandoned}
end
local t = now()
if st == IN_FLIGHT then
  local left = tonumber(deadline) - t
  if left > 0 then
    if ARGV[5] == '1' and waited == '0' then
      redis.call('SET', rec, encode(st, fp, op, deadline, token, attempt, abandoned, '1', claimer), 'KEEPTTL')
    end
    return {'inflight', string.format('%d', left)}
  end
end
-- Released, or in flight past its lease: take over. The new token fences
-- the previous owner off; the operation ID stays, and so does the waited
-- flag of an expired lease's waiters (a release cleared it and woke them:
-- they register again).
-- A record still in flight was abandoned by its owner.
abandoned = st == IN_FLIGHT and '1' or '0'
token = string.format('%d', redis.call('INCR', seq))
attempt = string.format('%d', tonumber(attempt) + 1)
deadline = string.format('%d', t + lease)
v = encode(IN_FLIGHT, fp, op, deadline, token, attempt, abandoned, waited, id)
-- The new owner must not lose the record to expiry while it runs, nor the
-- recovery points of the attempts before it.
if redis.call('PTTL', rec) < tonumber(ARGV[4]) then
  redis.call('SET', rec, v, 'PX', ARGV[4])
  redis.call('PEXPIRE', pts, ARGV[4])
else
  redis.call('SET', rec, v, 'KEEPTTL')
end
redis.call('ZADD', leases, deadline, rec)
return {'owner', op, attempt, token, abandoned}
