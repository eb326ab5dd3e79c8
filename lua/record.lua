-- record: the record's layout, shared by every script (each script is this
-- file followed by its own). redis_record.go reads the same layout: change
-- the two together (TestRecordLayout checks that they agree).
--
-- A record is one string, so that one GET reads it in any state and one SET
-- writes it with its expiry:
--   byte 1: the state, COMPLETED, IN_FLIGHT or RELEASED;
--   bytes 2-33: the request's fingerprint;
--   byte 34: the operation ID's length, then the operation ID;
-- then, completed: the stored response (internal/wire), so that a replay
-- gets the record whole; in flight or released, the fields
-- "<deadline> <token> <attempt> <abandoned><waited> <claimer>":
--   deadline: the lease's end, in ms by this server's clock;
--   token: the owner's fencing token; attempt: its number, from 1;
--   abandoned: 1 when this owner took over from an attempt whose lease ran
--     out unsettled;
--   waited: 1 when a waiter is registered, so that settling publishes;
--   claimer: the id of the claim that made this owner, empty for the
--     record's maker, whose id is the operation ID.
-- Numbers are written with '%d': Lua's own '%.14g' would round large ones.
--
-- A record's recovery points (RecoveryPointStore) are one string under a key
-- of their own, the record's key followed by " points", in the record's
-- hash slot:
--   byte 1: POINTS, which is no state;
--   byte 2: the record's operation ID's length, then the operation ID;
-- then the points' entries (internal/wire), in the order saved, a resent
-- save's entry after the first (which is the one that counts). Points under
-- another operation ID are an earlier record's of the same key, and count
-- as none. The points key expires when the record does: every script that
-- moves the record's expiry moves the points key's, and a save gives the
-- points key the record's. A completion and a forgetting delete it.

local COMPLETED, IN_FLIGHT, RELEASED = 'c', 'p', 'r'
local FINGERPRINT_FIRST, FINGERPRINT_LAST = 2, 33
local OP_LEN_AT = 34
local POINTS = 's'

local function state(v)
  return string.sub(v, 1, 1)
end

local function fingerprint(v)
  return string.sub(v, FINGERPRINT_FIRST, FINGERPRINT_LAST)
end

-- decode returns the operation ID and the fields of a record in flight or
-- released, or nothing when v is not one this version writes. The deadline
-- and the attempt are computed with, so they must be numbers a double holds
-- exactly and '%d' formats back (Redis's Lua formats 1e20 as a negative
-- number); the token is only compared, as text.
local function decode(v)
  local n = string.byte(v, OP_LEN_AT)
  if not n or n == 0 then
    return
  end
  local deadline, token, attempt, abandoned, waited, claimer =
    string.match(v, '^(%d+) (%d+) (%d+) ([01])([01]) (.*)$', OP_LEN_AT + 1 + n)
  if not deadline or #deadline > 15 or #attempt > 15 then
    return
  end
  return string.sub(v, OP_LEN_AT + 1, OP_LEN_AT + n), deadline, token, attempt, abandoned, waited, claimer
end

local function encode(st, fp, op, deadline, token, attempt, abandoned, waited, claimer)
  return st .. fp .. string.char(#op) .. op ..
    deadline .. ' ' .. token .. ' ' .. attempt .. ' ' .. abandoned .. waited .. ' ' .. claimer
end

-- completed turns v, a record in flight whose operation ID is op, into the
-- completed record of response.
local function completed(v, op, response)
  return COMPLETED .. string.sub(v, FINGERPRINT_FIRST, OP_LEN_AT + #op) .. response
end

-- response is the stored response of v, a completed record, or nothing
-- when v has no operation ID.
local function response(v)
  local n = string.byte(v, OP_LEN_AT)
  if n and n > 0 then
    return string.sub(v, OP_LEN_AT + 1 + n)
  end
end

-- owned reads the record at rec and returns it, decoded, when it is in
-- flight under token, and nothing otherwise.
local function owned(rec, token)
  local v = redis.call('GET', rec)
  if v and state(v) == IN_FLIGHT then
    local op, deadline, tok, attempt, abandoned, waited, claimer = decode(v)
    if tok == token then
      return v, op, deadline, attempt, abandoned, waited, claimer
    end
  end
end

-- pointsHead is how the recovery points of the record whose operation ID
-- is op begin: recovery points that begin otherwise count as none.
local function pointsHead(op)
  return POINTS .. string.char(#op) .. op
end

-- pointsOf returns the entries of the recovery points at key pts, when
-- they are those of the record whose operation ID is op, and '' otherwise.
local function pointsOf(pts, op)
  local p, head = redis.call('GET', pts), pointsHead(op)
  if p and string.sub(p, 1, #head) == head then
    return string.sub(p, #head + 1)
  end
  return ''
end

-- recordPoints returns the entries of the recovery points at key pts of
-- the record v, in flight or released, and '' for any other.
local function recordPoints(v, pts)
  local op = decode(v)
  if op and state(v) ~= COMPLETED then
    return pointsOf(pts, op)
  end
  return ''
end

local function fenced()
  return redis.error_reply('FENCED not the current owner')
end

local function now()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

