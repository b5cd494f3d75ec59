-- void.lua: settle a poison event's decision on one route, so that it can be dead-lettered
-- without any worker still dispatching it.
--
-- KEYS[1]     the route's decision hash holding the event's input entry
-- KEYS[2]     the event's id claim on this route (optional: only for events that carry an id)
-- ARGV[1]     the input entry id (its field in the hash)
-- ARGV[2]     decision time to live, ms
-- Returns { decision before the call ("" if none), the id claim's owner ("" if none), 1 if
-- the decision hash holds another kind of value (else 0) }. The decision becomes "v0"
-- (voided) unless it already records a final outcome: "d…" (dispatched) or "x…" (passed over
-- for a fallback). A sleeping worker's dispatch then finds its "s…" decision gone and does
-- nothing.
--
-- A key overwritten with another kind of value holds nothing of pacer's: a decision hash of
-- another kind holds no decision to void, an id claim of another kind names no owner. Neither
-- fails the call. Failing kept the entry pending for good, and lost what the other key says:
-- a sleeping decision still to void, or the owner that makes the entry a duplicate.

if #KEYS < 1 or #KEYS > 2 then
  bad('key count')
end
local ttl = num(2, 'ttl')
local old = redis.pcall('HGET', KEYS[1], ARGV[1])
local overwritten = wrong_kind(old)
if overwritten then
  old = false
end
local owner = false
if KEYS[2] then
  local got = redis.pcall('GET', KEYS[2])
  if not wrong_kind(got) then
    owner = got
  end
end
if not overwritten and (not old or decision_kind(old) == 's') then
  hset(KEYS[1], { ARGV[1], decision('v', 0) }, ttl)
end
return { old or '', owner or '', overwritten and 1 or 0 }
