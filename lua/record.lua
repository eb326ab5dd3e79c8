-- record: the record's encoding, shared by every script (each script is this
-- file followed by its own).
--
-- A record is one string, so that one GET reads it in any state and one SET
-- writes it with its expiry:
--   state: one byte, c completed, p in flight, r released;
--   the request's fingerprint: 32 bytes;
--   the operation ID's length: one byte, then the operation ID;
-- then, completed: the encoded response (a replay gets the record whole);
-- in flight or released: "<deadline> <token> <attempt> <x><w> <by>", where
-- deadline is the lease's end (ms, by this server's clock), x is 1 when
-- this owner took over from an abandoned attempt, w is 1 when someone waits
-- (so that settling publishes), and by is the id of the claim that made
-- this owner, empty for the record's maker, whose id is the operation ID.
-- Numbers are written with '%d': Lua's own '%.14g' would round large ones.

local function decode(v)
  local n = string.byte(v, 34)
  local deadline, token, attempt, x, w, by = string.match(v, '^(%d+) (%d+) (%d+) (%d)(%d) (.*)$', 35 + n)
  return string.sub(v, 35, 34 + n), deadline, token, attempt, x, w, by
end

local function encode(state, fp, op, deadline, token, attempt, x, w, by)
  return state .. fp .. string.char(#op) .. op .. deadline .. ' ' .. token .. ' ' .. attempt .. ' ' .. x .. w .. ' ' .. by
end

-- owned reads the record at rec and returns it, decoded, when it is in
-- flight under token, and nothing otherwise.
local function owned(rec, token)
  local v = redis.call('GET', rec)
  if v and string.byte(v) == 112 then
    local op, deadline, tok, attempt, x, w, by = decode(v)
    if tok == token then
      return v, op, deadline, attempt, x, w, by
    end
  end
end

local function fenced()
  return redis.error_reply('FENCED not the current owner')
end

local function now()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

