-- schedule.lua: plan a batch of events on one route, dispatching at once those due now.
--
-- KEYS[1]     the route's bucket (hash: tat = plan, dtat = gate, last = last dispatch; µs)
-- KEYS[2]     the route's ready stream
-- KEYS[2+i]   the decision marker of event i (string "<kind><number>|<owner>", see below)
-- ARGV[1]     interval_us: microseconds one unit of cost occupies
-- ARGV[2]     tolerance_us: (burst - 1) * interval
-- ARGV[3]     marker time to live, ms
-- ARGV[4]     approximate MAXLEN of the ready stream
-- ARGV[5]     n, the number of events; then for each event, in order:
--               owner        "<entry id>@<input stream>", the entry that carries the event
--               expect       "" for a first decision; else the marker value this decision may
--                            replace (a claimed event whose old slot has passed)
--               cost         units of the rate the event uses (integer >= 1)
--               max_wait_us  the longest wait the event accepts on this route
--               nfields, name1, value1, ...   the fields of the ready entry, should it go now
-- Returns { now_us, tat_us, code1, value1, ..., end_us } where end_us is Redis's clock as the
-- script ends (what workers map their timers with), and for event i:
--   1, ready entry id   dispatched now (marker "d<entry id's ms>|owner")
--   2, slot_us          slot reserved; sleep until it (marker "s<slot_us>|owner")
--   3, wait_us          would wait longer than max_wait: nothing reserved (marker "x<wait>|owner")
--   4, marker value     an earlier delivery already decided this event: that decision stands

local now = redis_now_us()
local interval, tol = tonumber(ARGV[1]), tonumber(ARGV[2])
local ttl, maxlen, n = ARGV[3], ARGV[4], tonumber(ARGV[5])
local st = redis.call('HMGET', KEYS[1], 'tat', 'dtat', 'last')
local tat, dtat, last = tonumber(st[1]) or 0, tonumber(st[2]) or 0, tonumber(st[3]) or 0
local changed = false
local out = { now, 0 }
local at = 6

for i = 1, n do
  local owner, expect = ARGV[at], ARGV[at + 1]
  local cost, max_wait = tonumber(ARGV[at + 2]), tonumber(ARGV[at + 3])
  local fields_at = at + 4
  local marker = KEYS[2 + i]
  local slot, next_tat = plan(tat, now, cost, interval, tol)
  local t, tq = dispatch_clock(now, last)
  local code, value
  if slot - now > max_wait then
    code, value = 3, slot - now
  elseif slot <= now then
    local ok, g = gate(dtat, tq, cost, interval, tol)
    if ok then
      code = 1
    else
      -- An earlier slot went out late: this one waits until the gate lets it through.
      code, value, slot = 2, g, g
    end
  else
    -- Sleep until the first millisecond the slot can be written in.
    slot = ceil_ms(slot)
    code, value = 2, slot
  end

  local id_ms = tq / 1000
  local record = (code == 1 and ('d' .. int(id_ms))) or (code == 2 and ('s' .. int(slot))) or ('x' .. int(value))
  record = record .. '|' .. owner
  local prev
  if expect == '' then
    prev = redis.call('SET', marker, record, 'NX', 'GET', 'PX', ttl)
  else
    prev = redis.call('GET', marker)
    if prev == expect then
      prev = false
    end
    if not prev then
      redis.call('SET', marker, record, 'PX', ttl)
    end
  end

  if prev then
    code, value = 4, prev
  elseif code == 1 then
    local extra = { 'pacer_slot_ms', int(math.floor(slot / 1000)), 'pacer_wait_ms', '0' }
    value = xadd(KEYS[2], maxlen, int(id_ms) .. '-*', fields_at, extra)
    local _, next_dtat = gate(dtat, tq, cost, interval, tol)
    dtat, last, tat, changed = next_dtat, t, next_tat, true
  elseif code == 2 then
    tat, changed = next_tat, true
  end
  out[#out + 1] = code
  out[#out + 1] = value
  at = fields_end(fields_at)
end

out[2] = tat
return finish(out, changed, now, tat, dtat, last)
