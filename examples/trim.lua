-- trim.lua: removes from a stream the entries that every consumer group has both received and
-- acknowledged, and nothing else. The examples' consumers run it after each XACK; run it the same
-- way from any client (EVAL/EVALSHA, or `redis-cli --eval trim.lua <stream>`).
--
-- KEYS[1]  the stream
-- returns  how many entries were removed
--
-- What a group still needs:
--   * its oldest pending entry (delivered but not acknowledged: its consumer may crash, and
--     another consumer then claims it with XAUTOCLAIM), if it has any;
--   * otherwise every entry after its last-delivered-id (not delivered yet).
-- The floor is the lowest of these over all groups, and XTRIM MINID removes only the entries
-- below it. Everything below was delivered to every group and acknowledged by it.
--
-- A script, because it runs atomically: no consumer reads, acknowledges or claims between the
-- moment the floor is computed and the trim, so any number of consumers in any number of groups
-- may run it at once. (Done from the client in several commands it is still safe, since a
-- floor computed a moment ago is only ever too low, but that takes some reasoning; this does not.)
-- XDEL of each acknowledged entry is the other common way, but it is only correct while the
-- stream has a single group: it would delete entries another group has not read yet.
--
-- Left alone: a stream that does not exist or has no group (nobody has said what they need). A
-- group created later at id 0 does not see what was trimmed before it existed.

if redis.call('EXISTS', KEYS[1]) == 0 then
  return 0
end
local groups = redis.call('XINFO', 'GROUPS', KEYS[1])
if #groups == 0 then
  return 0
end

-- Stream ids are "<ms>-<seq>"; both parts fit a Lua number exactly (below 2^53) in practice.
local function parse(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return tonumber(ms), tonumber(seq)
end

local floor_ms, floor_seq
for _, fields in ipairs(groups) do
  local g = {}
  for i = 1, #fields, 2 do
    g[fields[i]] = fields[i + 1]
  end
  local ms, seq
  if g['pending'] > 0 then
    -- XPENDING's summary form: count, smallest pending id, greatest pending id, consumers.
    ms, seq = parse(redis.call('XPENDING', KEYS[1], g['name'])[2])
  else
    -- Nothing pending: the last delivered entry is done too, so the floor is just past it.
    ms, seq = parse(g['last-delivered-id'])
    seq = seq + 1
  end
  if floor_ms == nil or ms < floor_ms or (ms == floor_ms and seq < floor_seq) then
    floor_ms, floor_seq = ms, seq
  end
end

-- Exact MINID, so that the examples' tests can see the stream empty. `MINID ~` is cheaper (it
-- removes whole internal nodes only, keeping a few entries longer) and just as safe.
return redis.call('XTRIM', KEYS[1], 'MINID', string.format('%.0f-%.0f', floor_ms, floor_seq))
