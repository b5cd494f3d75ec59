-- dispatch.lua: hand events whose slots have come to the route's ready stream, at most as fast
-- as the route's rate allows *now*, each at most once.
--
-- KEYS[1]     the route's bucket (hash: tat, dtat, last; µs)
-- KEYS[2]     the route's ready stream
-- KEYS[2+i]   the decision marker of event i
-- ARGV[1]     interval_us
-- ARGV[2]     tolerance_us
-- ARGV[3]     approximate MAXLEN of the ready stream
-- ARGV[4]     n, the number of events; then for each event, in order:
--               expect    the marker value the event was decided with ("s<slot_us>|<owner>")
--               slot_us   its slot
--               cost      units of the rate it uses
--               nfields, name1, value1, ...   the fields of the ready entry
-- Returns { now_us, code1, value1, ..., end_us } where end_us is Redis's clock as the script
-- ends (what workers map their timers with), and for event i:
--   1, ready entry id   dispatched; the marker now says "d<entry id's ms>|owner"
--   0, retry_at_us      not yet: its slot is ahead, or the rate would break now (a late slot
--                       before it); nothing changed
--   2, marker value     the marker no longer holds this decision ("" if it is gone): another
--                       worker dispatched or re-decided the event; nothing changed
--
-- The marker is compared and set in the same step as the XADD, so no event is dispatched twice
-- whatever the workers do; the gate is checked on Redis's clock at that same step, so the ready
-- stream holds the rate whenever its entries are written.

local now = redis_now_us()
local interval, tol = tonumber(ARGV[1]), tonumber(ARGV[2])
local maxlen, n = ARGV[3], tonumber(ARGV[4])
local st = redis.call('HMGET', KEYS[1], 'tat', 'dtat', 'last')
local tat, dtat, last = tonumber(st[1]) or 0, tonumber(st[2]) or 0, tonumber(st[3]) or 0
local changed = false
local out = { now }
local at = 5

for i = 1, n do
  local expect, slot, cost = ARGV[at], tonumber(ARGV[at + 1]), tonumber(ARGV[at + 2])
  local fields_at = at + 3
  local t, tq = dispatch_clock(now, last)
  local code, value
  if t < slot then
    code, value = 0, slot
  else
    local ok, g = gate(dtat, tq, cost, interval, tol)
    if not ok then
      code, value = 0, g
    else
      local id_ms = tq / 1000
      -- The owner part of expect, "|<owner>" (find's first result only: its second would
      -- cut the owner off).
      local owner_part = string.sub(expect, (string.find(expect, '|', 1, true)))
      local prev = redis.call('SET', KEYS[2 + i], 'd' .. int(id_ms) .. owner_part, 'XX', 'GET', 'KEEPTTL')
      if prev ~= expect then
        if prev then
          redis.call('SET', KEYS[2 + i], prev, 'KEEPTTL')
        end
        code, value = 2, prev or ''
      else
        code, value = 1, xadd(KEYS[2], maxlen, int(id_ms) .. '-*', fields_at, {})
        dtat, last, changed = g, t, true
      end
    end
  end
  out[#out + 1] = code
  out[#out + 1] = value
  at = fields_end(fields_at)
end

return finish(out, changed, now, tat, dtat, last)
