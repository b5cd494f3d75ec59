-- gcra.lua: the leaky bucket that paces a route, as plain functions: the plan (slots) and the
-- gate (the rate at the moment of dispatch), and saving the bucket. Prepended (after lib.lua)
-- to the scripts that pace: schedule.lua and dispatch.lua. The same maths as src/pacing.rs,
-- held to the same answers by tests/bucket_differential.rs. All times are microseconds of
-- Redis's clock; integers below 2^53, so Lua's doubles compute them exactly.

-- The slot of an event of `cost` planned at `now` against the plan `tat`, and the next plan. It
-- needs room for all its units at once, so no window holds more than rate x W + burst units
-- (src/pacing.rs `plan`); an event costing more than the burst never fits (`fits`).
local function plan(tat, now, cost, interval, tol)
  return math.max(now, tat - tol + (cost - 1) * interval), math.max(tat, now) + cost * interval
end

local function fits(cost, interval, tol)
  return cost >= 1 and (cost - 1) * interval <= tol
end

-- The first whole millisecond (in µs) at or after `x`.
local function ceil_ms(x)
  return math.ceil(x / 1000) * 1000
end

-- Whether a dispatch judged at `tq` (a whole millisecond, see dispatch_clock) keeps the rate
-- given the gate `dtat`: true and the next gate, or false and the first millisecond it would
-- pass. An entry written in millisecond m is charged at tq - 1000 µs (not below the gate), the
-- start of the previous millisecond: ids in one window of W whole milliseconds are then charged
-- at most W ms apart, so the window keeps the bound (src/pacing.rs `gate` has the argument), a
-- slot that falls inside a millisecond costs no drift, and an entry written in the millisecond
-- after its slot does not push the next one on its route past its own.
local function gate(dtat, tq, cost, interval, tol)
  local earliest = dtat - tol + (cost - 1) * interval
  if tq < earliest then
    return false, ceil_ms(earliest)
  end
  return true, math.max(dtat, tq - 1000) + cost * interval
end

-- How late (µs) the gate may make an event before its slot is re-planned (src/pacing.rs LATE_US).
local LATE = 1000

-- An event leaving the route gives its reservation at `slot` back if it is still the plan's
-- last (any later one would have pushed the plan at least an interval further).
local function give_back(tat, slot, cost, interval, tol)
  if tat - slot <= tol + cost * interval then
    return tat - cost * interval
  end
  return tat
end

-- What the gate says about one due event at dispatch (src/pacing.rs `judge`): one of
-- 'pass' (go now, with the slot given: its own, or now if it was woken too late for it),
-- 'wait' (sleep until `at`, the slot stands), 'replan' (the slot moves to `at`, the plan's next
-- slot, within the deadline) or 'late' (not within the deadline), then `at` (or the slot, for
-- a pass), then the gate and the plan for the next event of the call. The gate is charged for a
-- pass, and as if it went at `at` for an event told to wait, so that events refused in one call
-- queue one behind the other. A moved event takes its new slot from the plan's end, never a
-- millisecond the plan gave another event: that would book it twice and cascade.
local function judge(dtat, tat, t, tq, slot, deadline, cost, interval, tol)
  if t < slot then
    return 'wait', slot, dtat, tat
  end
  local missed = t > slot + LATE
  if missed and t > deadline then
    -- When a retry could go: the plan's next slot, never now (a wait of 0 read 'retry at once').
    local next = math.max(plan(tat, t, cost, interval, tol), t + 1)
    return 'late', ceil_ms(next), dtat, give_back(tat, slot, cost, interval, tol)
  end
  local ok, g = gate(dtat, tq, cost, interval, tol)
  if ok then
    return 'pass', missed and t or slot, g, tat
  end
  if not missed and g <= slot + LATE then
    local _, queued = gate(dtat, g, cost, interval, tol)
    return 'wait', g, queued, tat
  end
  if g - slot < cost * interval and g <= deadline then
    -- Held back by less than a move to the plan's end would cost the route: moved to when
    -- the gate allows (src/pacing.rs judge says why).
    local _, queued = gate(dtat, g, cost, interval, tol)
    return 'replan', g, queued, math.max(tat, g + cost * interval)
  end
  local new_slot, new_tat = plan(tat, g, cost, interval, tol)
  new_slot = ceil_ms(new_slot)
  if new_slot > deadline then
    return 'late', new_slot, dtat, give_back(tat, slot, cost, interval, tol)
  end
  return 'replan', new_slot, dtat, new_tat
end

-- The time a dispatch happens at and the time the gate judges it by: the ready entry's id
-- millisecond (in µs). The rate is promised on entry ids, so judging by them is exact for that
-- promise, and a dispatch a fraction of a millisecond late does not hold back the next one.
local function dispatch_clock(now, last)
  local t = math.max(now, last)
  return t, math.floor(t / 1000) * 1000
end

-- The newest ready entry's time (µs of its id's ms) when its millisecond is past `last`'s (µs:
-- the route's last dispatch as its bucket records it), else 0. A dispatch id must not go below
-- the stream's newest, or XADD would fail; pacer's own entries are never past `last`, so the
-- range stops there and Redis answers nothing in the usual case. Reading the newest entry
-- itself, its fields made into Lua tables, cost twice as much (2.2 against 1.0 µs a call). Read
-- in every pacing call before any write, which also checks that the ready stream is a stream.
local function ready_top_us(stream, last)
  local after = '(' .. int(math.floor(last / 1000)) .. '-18446744073709551615'
  local top = redis.call('XREVRANGE', stream, '+', after, 'COUNT', 1)[1]
  if top then
    return tonumber(string.match(top[1], '^(%d+)')) * 1000
  end
  return 0
end

-- Reads a route's bucket (KEYS index `bucket`) and its ready stream's newest entry: the plan, the
-- gate and the last dispatch time (never below the newest ready id).
local function read_bucket(bucket, ready)
  local st = redis.call('HMGET', KEYS[bucket], 'tat', 'dtat', 'last')
  local last = tonumber(st[3]) or 0
  return tonumber(st[1]) or 0, tonumber(st[2]) or 0, math.max(last, ready_top_us(KEYS[ready], last))
end

-- Saves the bucket and lets it expire a minute after its last reservation falls due: an idle
-- route leaves nothing behind, and a bucket is never dropped while slots are still ahead.
local function save_bucket(key, now, tat, dtat, last)
  redis.call('HSET', key, 'tat', int(tat), 'dtat', int(dtat), 'last', int(last))
  local ahead_ms = math.floor((math.max(tat, dtat, now) - now) / 1000)
  redis.call('PEXPIRE', key, int(ahead_ms + 60000))
end

-- Ends a pacing call's writes to a route (KEYS[bucket] its bucket, KEYS[bucket + 1] its ready
-- stream): the bucket if the call changed it, and one trim of the ready stream if the call wrote
-- to it (once per call rather than per entry: each MAXLEN is more arguments to convert; and
-- lib.lua's trim keeps what a consumer group of the stream still needs).
local function save_route(bucket, now, tat, dtat, last, changed, wrote, maxlen)
  if changed then
    save_bucket(KEYS[bucket], now, tat, dtat, last)
  end
  if wrote then
    trim(KEYS[bucket + 1], maxlen)
  end
end

-- Reads what a pacing call starts from, before any write (reading also checks every key's type,
-- so nothing fails once writing starts): Redis's clock, the bucket (KEYS[1]) and the ready
-- stream's newest entry (KEYS[2]), that the `s` input streams after the `h` decision hashes have
-- the group, and the decisions on record (KEYS[3 .. 2 + h], lib.lua `records_of`: hash k's
-- entries are entries[from[k] .. to[k]]); last, the input streams `check_groups` found gone.
local function read_route(h, s, group, entries, from, to)
  local now = redis_now_us()
  local tat, dtat, last = read_bucket(1, 2)
  local gone = check_groups(3 + h, s, group)
  local lists = {}
  for k = 1, h do
    lists[k] = entries
  end
  return now, tat, dtat, last, records_of(3, h, lists, from, to), gone
end
