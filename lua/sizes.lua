-- sizes.lua: how many of some entries of one stream fit in a byte budget, counted in Redis so
-- that nothing large is sent to learn it. A claimer, or a reader taking up what its consumer
-- name holds pending, asks before it takes entries: a worker may have been killed for holding
-- them (src/worker/budget.rs), and taking them all at once would kill the next one too.
--
-- KEYS[1]   the stream
-- ARGV[1]   the budget, bytes of field names and values
-- ARGV[2..] entry ids, in the order they would be taken
-- Returns how many of the ids, from the first, fit in the budget together; at least one (an
-- entry larger than the budget goes alone), none for no ids. An entry no longer in the stream
-- counts 0 bytes. It stops at the first entry that does not fit: no entry after it is read.

local budget = tonumber(ARGV[1])
if budget == nil then
  error('pacer: bad arguments: budget (ARGV[1])')
end
local used = 0
for i = 2, #ARGV do
  local found = redis.call('XRANGE', KEYS[1], ARGV[i], ARGV[i])
  if found[1] then
    for _, v in ipairs(found[1][2]) do
      used = used + #v
    end
  end
  if used > budget then
    return math.max(i - 2, 1)
  end
end
return #ARGV - 1
