-- bucket.lua: the leaky-bucket maths and the helpers every script shares (reading fields from
-- ARGV, XADD, saving the bucket), prepended to each script when pacer is built (src/scripts.rs). The same functions as src/pacing.rs, held to the
-- same answers by tests/bucket_differential.rs. All times are microseconds of Redis's clock;
-- integers below 2^53, so Lua's doubles compute them exactly.

-- The slot of an event of `cost` planned at `now` against the plan `tat`, and the next plan.
local function plan(tat, now, cost, interval, tol)
  return math.max(now, tat - tol), math.max(tat, now) + cost * interval
end

-- The first whole millisecond (in µs) at or after `x`.
local function ceil_ms(x)
  return math.ceil(x / 1000) * 1000
end

-- Whether a dispatch judged at `tq` (a whole millisecond, see dispatch_clock) keeps the rate
-- given the gate `dtat`: true and the next gate, or false and the first millisecond it would
-- pass. An entry written in millisecond m stands for the earliest instant it could have had in
-- that millisecond, not below the gate: so GCRA runs exactly on the entries' ids, and a slot
-- that falls inside a millisecond costs no drift.
local function gate(dtat, tq, cost, interval, tol)
  local earliest = dtat - tol
  if tq < earliest then
    return false, ceil_ms(earliest)
  end
  return true, math.max(dtat, tq - 999) + cost * interval
end

-- The time a dispatch happens at and the time the gate judges it by: the ready entry's id
-- millisecond (in µs). The rate is promised on entry ids, so judging by them is exact for that
-- promise, and a dispatch a fraction of a millisecond late does not hold back the next one.
local function dispatch_clock(now, last)
  local t = math.max(now, last)
  return t, math.floor(t / 1000) * 1000
end

-- Integers as text. Lua's own number-to-string keeps 14 digits (1.7952982012077e+15), which
-- would corrupt microsecond times in markers and commands.
local function int(n)
  return string.format('%d', n)
end

-- Redis's own clock: the one clock every decision uses, whatever the workers' clocks say.
local function redis_now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

-- The index just past an event's fields (their count at ARGV[at], then name/value pairs).
local function fields_end(at)
  return at + 1 + 2 * tonumber(ARGV[at])
end

-- XADDs to `stream`, trimmed to about `maxlen` entries, at `id` ('<ms>-*' or '*'): the fields
-- at ARGV[at], then the name/value pairs in `extra`. Returns the new entry's id.
local function xadd(stream, maxlen, id, at, extra)
  local args = { 'XADD', stream, 'MAXLEN', '~', maxlen, id }
  for j = at + 1, fields_end(at) - 1 do
    args[#args + 1] = ARGV[j]
  end
  for _, v in ipairs(extra) do
    args[#args + 1] = v
  end
  return redis.call(unpack(args))
end

-- Saves the bucket and lets it expire a minute after its last reservation falls due: an idle
-- route leaves nothing behind, and a bucket is never dropped while slots are still ahead.
local function save_bucket(key, now, tat, dtat, last)
  redis.call('HSET', key, 'tat', int(tat), 'dtat', int(dtat), 'last', int(last))
  local ahead_ms = math.floor((math.max(tat, dtat, now) - now) / 1000)
  redis.call('PEXPIRE', key, int(ahead_ms + 60000))
end

-- Ends a pacing script: saves the bucket (KEYS[1]) if it changed, and appends Redis's clock as
-- the script ends, which workers map their timers with.
local function finish(out, changed, now, tat, dtat, last)
  if changed then
    save_bucket(KEYS[1], now, tat, dtat, last)
  end
  out[#out + 1] = redis_now_us()
  return out
end

