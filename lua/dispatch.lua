-- dispatch.lua: hand events whose slots have come to their routes' ready streams, at most as
-- fast as each route's rate allows *now*, each at most once. The events come in slot order; the gate
-- judges each (gcra.lua `judge`): it goes now, comes back shortly with its slot kept, moves to a
-- later slot within its deadline (recorded), or leaves the route because even that is too late.
-- Nothing is written until every argument is checked; the ready entries come before the
-- decisions that say they were written.
--
-- The routes a worker has due at one moment go in one call (in a cluster, those whose keys share
-- a slot): judged at one reading of Redis's clock, so that no route's dispatch waits in Redis
-- behind another route's call. Ten routes due in the same millisecond, each its own call, landed
-- up to 2 ms after their slots on a two-core machine; together, within one.
--
-- KEYS[2r - 1], KEYS[2r]  route r's bucket (hash: tat, dtat, last; µs) and ready stream (r = 1..R)
-- KEYS[2R + 1..]  h decision hashes, then s input streams this call may acknowledge (in its slot)
-- ARGV[1]     decision time to live, ms
-- ARGV[2]     the ready streams' length (lib.lua trim: about it, never below what a group needs)
-- ARGV[3]     the consumer group of the input streams
-- ARGV[4..6]  R, h, s
-- then per route: interval_us, tolerance_us, its name (the ready entries' pacer_route), and n,
--             the number of its events
-- then per decision hash, in KEYS order: the index of its input stream among the s (0: the
--             worker acknowledges), and that stream's name
-- then per event, route after route, in slot order within its route:
--   hash      index of its decision hash (1..h)
--   entry     its input entry id
--   slot      its slot (µs); it was decided with "s<slot>:<deadline>"
--   deadline  the latest it may go (µs)
--   decided   when it was first decided on this route (its wait counts from then, µs)
--   cost      units of the rate it uses
--   nfields, name1, value1, ...   its own fields, carried to the ready entry
-- Returns { now_us, then per event, in the order given, a code and a value, then end_us }
-- (lib.lua's codes):
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

local ttl, maxlen, group = num(1, 'ttl'), num(2, 'maxlen'), ARGV[3]
local routes, h, s = num(4, 'routes'), num(5, 'h'), num(6, 's')
if routes < 1 or #KEYS ~= 2 * routes + h + s then
  bad('key count')
end
local at = 7
local rt_interval, rt_tol, rt_name, rt_n = {}, {}, {}, {}
local n = 0
for r = 1, routes do
  rt_interval[r], rt_tol[r] = num(at, 'interval'), num(at + 1, 'tolerance')
  rt_name[r], rt_n[r] = ARGV[at + 2], num(at + 3, 'n')
  n = n + rt_n[r]
  at = at + 4
end
local first_hash = 2 * routes + 1
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

-- Read before any write (reading also checks every key's type, so nothing fails once writing
-- starts): Redis's clock, each route's bucket and its ready stream's newest entry, that the
-- input streams have the group, and the decisions on record.
local now = redis_now_us()
local rt_tat, rt_dtat, rt_last = {}, {}, {}
for r = 1, routes do
  rt_tat[r], rt_dtat[r], rt_last[r] = read_bucket(2 * r - 1, 2 * r)
end
local gone = check_groups(first_hash + h, s, group)
local decided = records(first_hash, h, ev_hash, ev_entry)

local out = { now }
local acks = lists(s)
local rt_changed, rt_wrote = {}, {}
local i = 0
for r = 1, routes do
  local interval, tol, route, ready = rt_interval[r], rt_tol[r], rt_name[r], KEYS[2 * r]
  local tat, dtat, last = rt_tat[r], rt_dtat[r], rt_last[r]
  local changed, wrote = false, false
  local t, tq = dispatch_clock(now, last)
  local xadd_id = int(tq / 1000) .. '-*'
  local dispatched = decision('d', tq / 1000)
  -- The gate as the events of this call find it: each refused one queues behind the ones
  -- before.
  local judging = dtat
  for _ = 1, rt_n[r] do
    i = i + 1
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
        redis.call('XADD', ready, xadd_id, 'pacer_route', route,
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
  rt_tat[r], rt_dtat[r], rt_last[r], rt_changed[r], rt_wrote[r] = tat, dtat, last, changed, wrote
end

-- Record, after the ready entries they speak of: the decisions, the buckets, then the
-- acknowledgements.
decided.save(ttl)
for r = 1, routes do
  save_route(2 * r - 1, now, rt_tat[r], rt_dtat[r], rt_last[r], rt_changed[r], rt_wrote[r], maxlen)
end
ack_all(first_hash + h, group, acks, gone)
out[#out + 1] = redis_now_us()
return out
