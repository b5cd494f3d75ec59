-- void.lua: settle a poison event's decision on one route, so that it can be dead-lettered
-- without any worker still dispatching it.
--
-- KEYS[1]     the decision marker of the event on this route
-- ARGV[1]     owner, "<entry id>@<input stream>"
-- ARGV[2]     marker time to live, ms
-- Returns the marker's value before the call ("" if there was none). The marker becomes
-- "v0|owner" (voided) unless it already records a final outcome: "d…" (dispatched) or
-- "x…" (passed over for a fallback), or belongs to another entry (a duplicate id). A sleeping
-- worker's dispatch then finds its "s…" decision gone and does nothing.

local old = redis.call('GET', KEYS[1])
if old then
  local kind = string.sub(old, 1, 1)
  local owner = string.match(old, '|(.*)$')
  if kind == 'd' or kind == 'x' or kind == 'v' or owner ~= ARGV[1] then
    return old
  end
end
redis.call('SET', KEYS[1], 'v0|' .. ARGV[1], 'PX', ARGV[2])
return old or ''
