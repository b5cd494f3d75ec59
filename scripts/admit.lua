-- admit.lua: decide a batch of inbound events against their rules' limits, record each decision
-- and forward the accepted events, all in one step. The same algorithms as src/admission/*.rs,
-- held to the same answers by tests/admit_differential.rs (which replays each call's now_us).
-- Every key is in the forward stream's hash slot (src/keys.rs, InboundKeys).
--
-- KEYS[1]      the forward stream
-- KEYS[2..]    per event, in order: its decision marker, then one limiter key per check
-- ARGV[1]      marker time to live, ms
-- ARGV[2]      approximate MAXLEN of the forward stream
-- ARGV[3]      r, the number of rules; then per rule:
--                name, algorithm (sliding_log | gcra | fixed_window), shadow (0/1),
--                count_rejected (0/1), spacing_us (0: none), spacing label, horizon_us,
--                log cap (most entries a sliding log keeps), nlimits, then per limit:
--                window_us, count, interval_us, tolerance_us (gcra), label
-- then         n, the number of events; then per event:
--                owner ("<stream>:<entry id>": a sliding log's member), nchecks, then per check:
--                rule index (1-based), key field name; then the forward entry's fields:
--                nfields, name1, value1, ...
-- Returns { now_us, then per event: code, decision, verdicts }:
--   code 1   decided now: decision "A" (accepted, and written to the forward stream) or
--            "r<retry_us>|<rule>|<limit>|<key field>" (rejected: the enforcing check that frees up
--            last); verdicts holds one character per rule, '1' passed, '0' over its limits
--            (shadow rules included: their '0's are the would-be rejections)
--   code 2   an earlier delivery decided it: decision is what it recorded, verdicts ''
--
-- Checking comes before charging: every limit of every identity of every rule is checked, and
-- only then is anything charged, so a rejected event uses up nothing (a rule with count_rejected
-- charges every attempt). Redis's clock, read once, is the time of every event of the batch.

local now = redis_now_us()
local ttl, maxlen = ARGV[1], ARGV[2]
local at = 3

local rules = {}
local nrules = tonumber(ARGV[at])
at = at + 1
for r = 1, nrules do
  local rule = {
    name = ARGV[at], alg = ARGV[at + 1], shadow = ARGV[at + 2] == '1',
    count_rejected = ARGV[at + 3] == '1', spacing = tonumber(ARGV[at + 4]),
    spacing_label = ARGV[at + 5], horizon = tonumber(ARGV[at + 6]), cap = tonumber(ARGV[at + 7]),
    limits = {},
  }
  local nl = tonumber(ARGV[at + 8])
  at = at + 9
  for l = 1, nl do
    rule.limits[l] = {
      window = tonumber(ARGV[at]), count = tonumber(ARGV[at + 1]),
      interval = tonumber(ARGV[at + 2]), tol = tonumber(ARGV[at + 3]), label = ARGV[at + 4],
    }
    at = at + 5
  end
  rules[r] = rule
end

-- A verdict is (retry, limit): retry 0 passes, else the µs until it would pass; limit is the
-- index of the binding limit, 0 for min_spacing. The later one binds; a tie keeps the first.
local function worse(retry, lim, retry2, lim2)
  if retry2 > retry then
    return retry2, lim2
  end
  return retry, lim
end

local function spacing_check(last, rule)
  if last and rule.spacing > 0 and now - last < rule.spacing then
    return last + rule.spacing - now
  end
  return 0
end

-- Milliseconds from now until `t`, at least 1.
local function ms_until(t)
  return math.max(1, math.ceil((t - now) / 1000))
end

-- The window number of `now` (fmod is exact on doubles, a float division is not always).
local function window_of(window)
  return (now - math.fmod(now, window)) / window
end

-- sliding_log: a sorted set of charged events scored by µs. Checks read it with ZCOUNT and,
-- when a window is full, the entry that frees it; the batch's own charges (all at `now`) are
-- kept in `added` and written at the end.
local log = {}

function log.load(key, rule)
  return { counts = {}, added = {} }
end

function log.check(st, key, rule)
  local n = #st.added
  local retry, lim = 0, 0
  if rule.spacing > 0 then
    local last
    if n > 0 then
      last = now
    else
      if st.newest == nil then
        local r = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
        st.newest = r[2] and tonumber(r[2]) or false
      end
      last = st.newest or nil
    end
    retry = spacing_check(last, rule)
  end
  for i, l in ipairs(rule.limits) do
    if st.counts[i] == nil then
      st.counts[i] = redis.call('ZCOUNT', key, '(' .. int(now - l.window), '+inf')
    end
    if st.counts[i] + n >= l.count then
      -- The window frees up when its count-th newest entry leaves it.
      local nth = now
      if l.count > n then
        local r = redis.call('ZRANGE', key, n - l.count, n - l.count, 'WITHSCORES')
        nth = tonumber(r[2])
      end
      retry, lim = worse(retry, lim, nth + l.window - now, i)
    end
  end
  return retry, lim
end

function log.charge(st, rule, passed, owner)
  st.added[#st.added + 1] = owner
end

function log.save(st, key, rule)
  if #st.added == 0 then
    return
  end
  redis.call('ZREMRANGEBYSCORE', key, '-inf', int(now - rule.horizon))
  local args = { 'ZADD', key }
  for i, member in ipairs(st.added) do
    args[#args + 1] = int(now)
    args[#args + 1] = member
    if #args >= 2000 or i == #st.added then
      redis.call(unpack(args))
      args = { 'ZADD', key }
    end
  end
  if rule.count_rejected then
    -- Rejected attempts are logged too: keep the newest `cap`, which decide every limit exactly.
    redis.call('ZREMRANGEBYRANK', key, 0, -(rule.cap + 1))
  end
  redis.call('PEXPIRE', key, int(math.ceil(rule.horizon / 1000)))
end

-- gcra and fixed_window keep their state in one string of numbers joined by ':' (read with
-- GET, written with SET PX: two commands per identity, where a hash takes three with its
-- PEXPIRE). A missing or unreadable value reads as all-absent.
local function load_numbers(key, n)
  local v = redis.call('GET', key)
  local nums = {}
  if v then
    for part in string.gmatch(v, '[^:]+') do
      nums[#nums + 1] = tonumber(part)
    end
  end
  if #nums ~= n then
    nums = {}
  end
  return nums
end

-- The save of a string-state algorithm, from its `numbers(st, rule)`: the state's numbers and
-- the time until which it matters. `last` is appended, and the key lives until that time or
-- until min_spacing after `last`, whichever is later.
local function numbers_save(numbers)
  return function(st, key, rule)
    if not st.dirty then
      return
    end
    local nums, until_t = numbers(st, rule)
    nums[#nums + 1] = st.last
    until_t = math.max(until_t, st.last + rule.spacing)
    local text = {}
    for i, v in ipairs(nums) do
      text[i] = int(v)
    end
    redis.call('SET', key, table.concat(text, ':'), 'PX', int(ms_until(until_t)))
  end
end

-- gcra: t<i> (the theoretical arrival time of limit i, µs) for each limit, then last.
local gcra = {}

function gcra.load(key, rule)
  local n = #rule.limits
  local v = load_numbers(key, n + 1)
  local st = { tats = {}, last = v[n + 1] }
  for i = 1, n do
    st.tats[i] = v[i] or 0
  end
  return st
end

function gcra.check(st, key, rule)
  local retry, lim = spacing_check(st.last, rule), 0
  for i, l in ipairs(rule.limits) do
    local earliest = st.tats[i] - l.tol
    if now < earliest then
      retry, lim = worse(retry, lim, earliest - now, i)
    end
  end
  return retry, lim
end

function gcra.charge(st, rule, passed, owner)
  for i, l in ipairs(rule.limits) do
    local nxt = math.max(st.tats[i], now) + l.interval
    if not passed then
      -- A rejected attempt's debt stops at one full bucket.
      nxt = math.min(nxt, now + l.tol + l.interval)
    end
    st.tats[i] = nxt
  end
  st.last, st.dirty = now, true
end

-- The tats; the state matters until the latest of them (an empty bucket after).
gcra.save = numbers_save(function(st, rule)
  local nums, until_t = {}, 0
  for i, tat in ipairs(st.tats) do
    nums[i] = tat
    until_t = math.max(until_t, tat)
  end
  return nums, until_t
end)

-- fixed_window: w<i> (window number of limit i) and c<i> (its count) for each limit, then last.
local fixed = {}

function fixed.load(key, rule)
  local n = #rule.limits
  local v = load_numbers(key, 2 * n + 1)
  local st = { w = {}, c = {}, last = v[2 * n + 1] }
  for i = 1, n do
    st.w[i] = v[2 * i - 1] or -1
    st.c[i] = v[2 * i] or 0
  end
  return st
end

function fixed.check(st, key, rule)
  local retry, lim = spacing_check(st.last, rule), 0
  for i, l in ipairs(rule.limits) do
    local current = window_of(l.window)
    if st.w[i] == current and st.c[i] >= l.count then
      retry, lim = worse(retry, lim, (current + 1) * l.window - now, i)
    end
  end
  return retry, lim
end

function fixed.charge(st, rule, passed, owner)
  for i, l in ipairs(rule.limits) do
    local current = window_of(l.window)
    if st.w[i] ~= current then
      st.w[i], st.c[i] = current, 0
    end
    st.c[i] = st.c[i] + 1
  end
  st.last, st.dirty = now, true
end

-- Window number and count per limit; the state matters until the latest window ends.
fixed.save = numbers_save(function(st, rule)
  local nums, until_t = {}, 0
  for i, l in ipairs(rule.limits) do
    nums[2 * i - 1] = st.w[i]
    nums[2 * i] = st.c[i]
    until_t = math.max(until_t, (st.w[i] + 1) * l.window)
  end
  return nums, until_t
end)

local algorithms = { sliding_log = log, gcra = gcra, fixed_window = fixed }

-- Each identity's state is read once per call and written once at its end.
local states, order = {}, {}
local function state(key, rule)
  local st = states[key]
  if not st then
    local alg = algorithms[rule.alg]
    st = alg.load(key, rule)
    st.alg, st.key, st.rule = alg, key, rule
    states[key] = st
    order[#order + 1] = st
  end
  return st
end

local n = tonumber(ARGV[at])
at = at + 1
local out = { now }
local k = 2
for _ = 1, n do
  local owner, nchecks = ARGV[at], tonumber(ARGV[at + 1])
  at = at + 2
  local marker = KEYS[k]
  k = k + 1
  local checks = {}
  for c = 1, nchecks do
    checks[c] = { r = tonumber(ARGV[at]), field = ARGV[at + 1], key = KEYS[k] }
    at = at + 2
    k = k + 1
  end
  local fields_at = at
  at = fields_end(at)

  -- Check everything first.
  local passed = {}
  for r = 1, nrules do
    passed[r] = '1'
  end
  local best, best_lim, binding = 0, 0, nil
  for _, c in ipairs(checks) do
    local rule = rules[c.r]
    c.st = state(c.key, rule)
    local retry, lim = c.st.alg.check(c.st, c.key, rule)
    if retry > 0 then
      passed[c.r] = '0'
      if not rule.shadow and retry > best then
        best, best_lim, binding = retry, lim, c
      end
    end
  end
  local accepted = binding == nil
  local decision = 'A'
  if not accepted then
    local rule = rules[binding.r]
    local label = (best_lim == 0 and rule.spacing_label) or rule.limits[best_lim].label
    decision = 'r' .. int(best) .. '|' .. rule.name .. '|' .. label .. '|' .. binding.field
  end

  -- Record it, unless an earlier delivery did: then that decision stands and nothing is charged.
  local prev = redis.call('SET', marker, decision, 'NX', 'GET', 'PX', ttl)
  if prev then
    out[#out + 1] = 2
    out[#out + 1] = prev
    out[#out + 1] = ''
  else
    for _, c in ipairs(checks) do
      local rule = rules[c.r]
      local ok = accepted and passed[c.r] == '1'
      if ok or rule.count_rejected then
        c.st.alg.charge(c.st, rule, ok, owner)
      end
    end
    if accepted then
      xadd(KEYS[1], maxlen, '*', fields_at, {})
    end
    out[#out + 1] = 1
    out[#out + 1] = decision
    out[#out + 1] = table.concat(passed)
  end
end

for _, st in ipairs(order) do
  st.alg.save(st, st.key, st.rule)
end
return out
