-- dispatch.lua: hand events whose slots have come to the route's ready stream, at most as fast
-- as the route's rate allows *now*, each at most once. The events come in slot order; the gate
-- judges each (gcra.lua `judge`): it goes now, comes back shortly with its slot kept, moves to a
-- later slot within its deadline (recorded), or leaves the route because even that is too late.
-- Nothing is written until every argument is checked; the ready entries come before the
-- decisions that say they were written.
--
-- KEYS[1]     the route's bucket (hash: tat, dtat, last; µs)
-- KEYS[2]     the route's ready stream
-- KEYS[3..]   h decision hashes, then s input streams this call may acknowledge (in its slot)
-- ARGV[1]     interval_us
-- ARGV[2]     tolerance_us
-- ARGV[3]     decision time to live, ms
-- ARGV[4]     approximate MAXLEN of the ready stream
-- ARGV[5]     the consumer group of the input streams
-- ARGV[6]     the route's name (the ready entries' pacer_route)
-- ARGV[7..9]  h, s, n (the number of events)
-- then per decision hash, in KEYS order: the index of its input stream among the s (0: the
--             worker acknowledges), and that stream's name
-- then per event, in slot order:
--   hash      index of its decision hash (1..h)
--   entry     its input entry id
--   slot      its slot (µs); it was decided with "s<slot>:<deadline>"
--   deadline  the latest it may go (µs)
--   decided   when it was first decided on this route (its wait counts from then, µs)
--   cost      units of the rate it uses
--   nfields, name1, value1, ...   its own fields, carried to the ready entry
-- Returns { now_us, then per event a code and a value, then end_us } (lib.lua's codes):
--   DISPATCHED, ready entry ms   written with its slot, or (woken too late for it) with now as a
--                                new slot; the decision now says "d<ms>"
--   NOT_BEFORE, at_us            not yet (its slot is ahead, or the gate's delay is within the
--                                tolerance); its slot stands, nothing changed
--   SLEEP, slot_us               its slot could no longer be met: moved to this one, before its
--                                deadline ("s<slot>:<deadline>")
--   TOO_LONG, wait_us            not even a later slot fits its deadline: passed over ("x<wait>")
--   SUPERSEDED, decision         the decision on record is no longer the one it was made with
--                                ("" if there is none): another worker dispatched, moved or
--                                voided it; nothing changed
-- The ready entry holds pacer_route, pacer_source_stream, pacer_source_id, pacer_slot_us and
-- pacer_wait_ms, then the event's own fields.
--
-- The decision is compared and set in the same step as the XADD, so no event is dispatched
-- twice whatever the workers do; the gate is checked on Redis's clock at that same step, so the
-- ready stream holds the rate whenever its entries are written.

local interval, tol = num(1, 'interval'), num(2, 'tolerance')
local ttl, maxlen, group, route = num(3, 'ttl'), num(4, 'maxlen'), ARGV[5], ARGV[6]
local h, s, n = num(7, 'h'), num(8, 's'), num(9, 'n')
if #KEYS ~= 2 + h + s then
  bad('key count')
end
local at = 10
local hash_stream, hash_name = {}, {}
for k = 1, h do
  hash_stream[k], hash_name[k] = index(at, s, true, 'stream'), ARGV[at + 1]
  at = at + 2
end
local ev_hash, ev_entry, ev_slot, ev_deadline, ev_decided, ev_cost = {}, {}, {}, {}, {}, {}
local ev_fields, ev_stop = {}, {}
for i = 1, n do
  ev_hash[i], ev_entry[i] = index(at, h, false, 'hash'), ARGV[at + 1]
  ev_slot[i], ev_deadline[i] = num(at + 2, 'slot'), num(at + 3, 'deadline')
  ev_decided[i], ev_cost[i] = num(at + 4, 'decided'), num(at + 5, 'cost')
  if ev_cost[i] < 1 then
    bad('cost')
  end
  ev_fields[i] = at + 6
  ev_stop[i] = fields_end(at + 6)
  at = ev_stop[i]
end
if at - 1 ~= #ARGV then
  bad('argument count')
end

local now, tat, dtat, last, decided = read_route(h, s, group, ev_hash, ev_entry)

local out = { now }
local changed = false
local wrote = false
local acks = lists(s)
local t, tq = dispatch_clock(now, last)
local id_ms = int(tq / 1000)
local dispatched = decision('d', tq / 1000)
-- The gate as the events of this call find it: each refused one queues behind the ones before.
local judging = dtat
for i = 1, n do
  local code, value
  local slot, deadline, cost, k = ev_slot[i], ev_deadline[i], ev_cost[i], ev_hash[i]
  -- What is on record, or what an earlier copy of this entry in the call made of it.
  local current = decided.get(k, ev_entry[i])
  if current ~= decision('s', slot, deadline) then
    code, value = SUPERSEDED, current or ''
  else
    local verdict, g, next_gate, next_tat = judge(judging, tat, t, tq, slot, deadline, cost,
      interval, tol)
    judging, changed = next_gate, changed or next_tat ~= tat
    tat = next_tat
    if verdict == 'pass' then
      code, value = DISPATCHED, tq / 1000
      redis.call('XADD', KEYS[2], id_ms .. '-*', 'pacer_route', route,
        'pacer_source_stream', hash_name[k], 'pacer_source_id', ev_entry[i], 'pacer_slot_us',
        int(g), 'pacer_wait_ms', int(math.floor(math.max(0, g - ev_decided[i]) / 1000)),
        unpack(ARGV, ev_fields[i] + 1, ev_stop[i] - 1))
      dtat, last, changed, wrote = next_gate, t, true, true
      decided.set(k, ev_entry[i], dispatched)
      if hash_stream[k] > 0 then
        local list = acks[hash_stream[k]]
        list[#list + 1] = ev_entry[i]
      end
    elseif verdict == 'wait' then
      code, value = NOT_BEFORE, g
    elseif verdict == 'replan' then
      -- Moved to the plan's next slot (judge took it from the plan).
      code, value = SLEEP, g
      decided.set(k, ev_entry[i], decision('s', g, deadline))
    else
      -- Passed over; its reservation was given back if it was the plan's last (judge).
      code, value = TOO_LONG, g - t
      decided.set(k, ev_entry[i], decision('x', g - t))
    end
  end
  out[#out + 1] = code
  out[#out + 1] = value
end

decided.save(ttl)
save_route(now, tat, dtat, last, changed, wrote, maxlen)
ack_all(3 + h, group, acks)
out[#out + 1] = redis_now_us()
return out
