-- sizes.lua: how many entries of one stream, taken in order, fit in a byte budget, counted in
-- Redis so that nothing large is sent to learn it. Asked before a worker takes entries it knows
-- nothing of: what a claimer takes from a silent consumer, what a reader takes up that its
-- consumer name held before a restart (a worker may have been killed for holding either), and
-- a reader's first new read (src/worker/budget.rs).
--
-- KEYS[1]   the stream
-- ARGV[1]   the budget, bytes of field names and values
-- ARGV[2]   'ids', then entry ids in the order they would be taken; or
--           'new', then a consumer group and a count: the entries the group would deliver
--           next (after its last-delivered-id), at most that many
-- Returns how many of them, from the first, fit in the budget together: at least one (an
-- entry larger than the budget goes alone); none for no ids; for 'new', the count when the
-- group has fewer entries to deliver (the read takes what comes). An entry no longer in the
-- stream counts 0 bytes. It stops at the first entry that does not fit: none after it is read.

local budget, mode = tonumber(ARGV[1]), ARGV[2]
if budget == nil or (mode ~= 'ids' and mode ~= 'new') then
  error('pacer: bad arguments: budget and mode (ARGV[1..2])')
end

-- The bytes of entry `found` (an XRANGE reply), 0 for none.
local function size(found)
  local n = 0
  if found[1] then
    for _, v in ipairs(found[1][2]) do
      n = n + #v
    end
  end
  return n
end

local used = 0
if mode == 'ids' then
  for i = 3, #ARGV do
    used = used + size(redis.call('XRANGE', KEYS[1], ARGV[i], ARGV[i]))
    if used > budget then
      return math.max(i - 3, 1)
    end
  end
  return #ARGV - 2
end

local group, most = ARGV[3], tonumber(ARGV[4])
if group == nil or most == nil then
  error('pacer: bad arguments: group and count (ARGV[3..4])')
end
local after
for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
  local f = {}
  for i = 1, #g, 2 do
    f[g[i]] = g[i + 1]
  end
  if f['name'] == group then
    after = f['last-delivered-id']
  end
end
if after == nil then
  return most
end
-- One entry at a time: an XRANGE of `most` would bring them all into the script at once.
for taken = 0, most - 1 do
  local found = redis.call('XRANGE', KEYS[1], '(' .. after, '+', 'COUNT', 1)
  if not found[1] then
    return most
  end
  used = used + size(found)
  if used > budget then
    return math.max(taken, 1)
  end
  after = found[1][1]
end
return most
