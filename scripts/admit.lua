-- admit.lua: decide a batch of inbound events against their rules' limits, record each decision
-- and forward the accepted events (and write the rejected ones, when the rejected stream shares
-- the call's slot), all in one step. The same algorithms as src/admission/*.rs,
-- held to the same answers by tests/admit_differential.rs (which replays each call's now_us).
-- Every key is in the forward stream's hash slot (src/keys.rs, InboundKeys).
--
-- KEYS[1]      the forward stream
-- KEYS[2]      the rejected stream, when ARGV[3] is 1 (it shares the call's slot)
-- KEYS[2 or 3..] per event, in order: the hash its decision is recorded in (field: its owner),
--              then its identities' limiter keys, one per check: every key field of every
--              rule, rule by rule, in the order the rules list them
-- ARGV[1]      decision time to live, ms (each decision hash lives that long after a write)
-- ARGV[2]      approximate MAXLEN of the forward and rejected streams
-- ARGV[3]      1: write rejections to KEYS[2] here; 0: the caller writes them
-- ARGV[4]      entries per read: a sliding log whose cap is more than this many entries per
--              command that reading it by entry takes is read by entry, else whole (see `log`)
-- ARGV[5]      r, the number of rules; then per rule:
--                name, algorithm (sliding_log | gcra | fixed_window), shadow (0/1),
--                count_rejected (0/1), spacing_us (0: none), spacing label, horizon_us,
--                log cap (most entries a sliding log keeps), nkeys, the key field names,
--                nlimits, then per limit: window_us, count, interval_us, tolerance_us (gcra),
--                label
-- then         n, the number of events; then per event:
--                owner ("<entry id>@<stream>": its field in the decision hash),
--                then the forward entry's fields: nfields, name1, value1, ...
-- Returns { now_us, then per event: code, decision, verdicts }:
--   code 1   decided now: decision "A" (accepted, and written to the forward stream) or
--            "r<retry_us>|<rule>|<limit>|<key field>" (rejected: the enforcing check that frees up
--            last), "R…" the same when it was also written to the rejected stream; verdicts holds one character per rule, '1' passed, '0' over its limits
--            (shadow rules included: their '0's are the would-be rejections)
--   code 2   an earlier delivery decided it: decision is what it recorded, verdicts ''
--
-- Checking comes before charging: every limit of every identity of every rule is checked, and
-- only then is anything charged, so a rejected event uses up nothing (a rule with count_rejected
-- charges every attempt). Redis's clock, read once, is the time of every event of the batch.
--
-- The inbound flow's speed rests on this script, and its cost is mostly per command and per
-- value, so it spends few of either per event: the decisions of a batch are read (HMGET) and
-- written (HSET) a hash at a time, the states of its identities read in one MGET and each
-- written once, with numbers packed in binary (struct) rather than printed and parsed; the
-- checks are implied by the rules instead of spelled out per event; an accepted event's fields
-- go from ARGV to XADD without a copy; and an event an earlier delivery decided is not checked.

local now = redis_now_us()
local ttl, maxlen = ARGV[1], ARGV[2]
-- Writing a rejection here, in the step that decides it, makes it atomic with its record: no
-- write-once marker and no second call, which the rejected stream in another slot would need.
local rejected = ARGV[3] == '1' and KEYS[2]
local entries_per_read = tonumber(ARGV[4])
local at = 5

local rules = {}
local nrules = tonumber(ARGV[at])
at = at + 1
for r = 1, nrules do
  local rule = {
    name = ARGV[at], alg = ARGV[at + 1], shadow = ARGV[at + 2] == '1',
    count_rejected = ARGV[at + 3] == '1', spacing = tonumber(ARGV[at + 4]),
    spacing_label = ARGV[at + 5], horizon = tonumber(ARGV[at + 6]), cap = tonumber(ARGV[at + 7]),
    fields = {}, limits = {},
  }
  at = at + 8
  for f = 1, tonumber(ARGV[at]) do
    rule.fields[f] = ARGV[at + f]
  end
  at = at + tonumber(ARGV[at]) + 1
  local nl = tonumber(ARGV[at])
  rule.nlimits = nl
  at = at + 1
  for l = 1, nl do
    rule.limits[l] = {
      window = tonumber(ARGV[at]), count = tonumber(ARGV[at + 1]),
      interval = tonumber(ARGV[at + 2]), tol = tonumber(ARGV[at + 3]), label = ARGV[at + 4],
    }
    at = at + 5
  end
  -- Reading a log by entry takes a STRLEN, then a GETRANGE per limit and one for min_spacing.
  local reads = 1 + nl + (rule.spacing > 0 and 1 or 0)
  rule.by_entry = rule.alg == 'sliding_log' and rule.cap > entries_per_read * reads
  rules[r] = rule
end

-- The checks every event makes, in order: (rule index, key field) for each key of each rule.
local check_rule, check_field = {}, {}
for r, rule in ipairs(rules) do
  for _, field in ipairs(rule.fields) do
    check_rule[#check_rule + 1] = r
    check_field[#check_field + 1] = field
  end
end
local nchecks = #check_rule

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

-- Every algorithm keeps an identity's state in one string of numbers packed as little-endian
-- doubles (struct.pack '<dd…'; µs and counts are integers below 2^53, exact as doubles). Read
-- for the whole batch with one MGET, written with PSETEX: one command per identity, where a
-- hash takes two with its PEXPIRE; packed, not printed and parsed, because formatting and
-- splitting text cost more per identity than the SET. A missing or unreadable value reads as
-- all-absent.
local formats = {}
local function packing(n)
  local f = formats[n]
  if not f then
    f = '<' .. string.rep('d', n)
    formats[n] = f
  end
  return f
end

-- The n numbers packed in `v`, or nil when it is absent or unreadable.
local struct_unpack, struct_pack = struct.unpack, struct.pack
local function unpack_numbers(v, n)
  if v and #v == 8 * n then
    local nums = { struct_unpack(packing(n), v) }
    nums[n + 1] = nil -- struct.unpack also returns the position after the last value
    return nums
  end
end

-- A state is one table, built whole by its algorithm's load(text, rule, key) (a table that
-- grows field by field is rehashed at each step, and this runs once per identity per call):
-- its algorithm, key and rule, whether it changed, and the algorithm's own fields.

-- sliding_log: the times (µs) of the charged events, oldest first, packed as little-endian
-- doubles in one string (see `packing` above), like src/admission/sliding_log.rs's Vec: at most
-- `cap` of them (keeping the newest cap is exact, see there). Sorted, so a check reads one entry
-- per limit and a trim binary-searches; and one string per identity, where a sorted set took
-- four or five commands and ~60 bytes per entry. The batch's own charges (all at `now`) are
-- counted in `added` and appended when it is saved.
--
-- Every string Redis hands to Lua, or Lua builds, is hashed byte by byte (~1.3 ns a byte
-- here), so a log costs by its size each time it passes through Lua, and a command ~1-2 µs.
-- Hence two ways to hold one, by the rule's cap against the commands reading by entry takes
-- (ARGV[4] entries per command):
-- - whole (small caps): read in the batch's MGET with the other states, rewritten on save
--   with the entries past the horizon dropped: a log of a few hundred entries costs less
--   than the commands that would spare it;
-- - by entry (large caps): its length from STRLEN, the few entries the checks need from
--   GETRANGE, and the batch's charges APPENDed while nothing needs dropping for the cap; so a
--   log of thousands of entries never passes through Lua on most calls. Entries past the
--   horizon then stay until the cap makes a rewrite drop them: older than every window, no
--   check reads them, and the cap still bounds the log.
-- Measured (µs of script per event, 1,000 identities a batch; one limit unless said): 2,000
-- entries, 16 whole against 10 by entry; a cap of 120, 15.5 against 14.3; 60, 14.4 against
-- 14.8; three limits (cap 240) and min_spacing, whole 10-25% faster.
local log = {}

function log.load(text, rule, key)
  if rule.by_entry then
    -- pcall: a key of another type reads as absent, as a GET in MGET would (and is replaced).
    local len = redis.pcall('STRLEN', key)
    if type(len) ~= 'number' or len % 8 ~= 0 then
      len = 0
    end
    return { alg = log, key = key, rule = rule, len = len / 8, added = 0, entries = {} }
  end
  if not (text and #text % 8 == 0) then
    text = ''
  end
  return { alg = log, key = key, rule = rule, text = text, len = #text / 8, added = 0 }
end

local packed_now = struct_pack('<d', now)

-- The p-th entry of the saved log, oldest first (read by entry: once per call).
local function entry(st, p)
  if st.text then
    return (struct_unpack('<d', st.text, 8 * p - 7))
  end
  local t = st.entries[p]
  if not t then
    t = struct_unpack('<d', redis.call('GETRANGE', st.key, 8 * p - 8, 8 * p - 1))
    st.entries[p] = t
  end
  return t
end

-- How many saved entries are at or before `t` (Vec::partition_point).
local function count_upto(st, t)
  local lo, hi = 0, st.len
  while lo < hi do
    local mid = lo + hi + 1
    mid = (mid - mid % 2) / 2
    if entry(st, mid) <= t then
      lo = mid
    else
      hi = mid - 1
    end
  end
  return lo
end

function log.check(st, rule)
  local n = st.added
  local retry, lim = 0, 0
  if rule.spacing > 0 then
    local last
    if n > 0 then
      last = now
    elseif st.len > 0 then
      last = entry(st, st.len)
    end
    retry = spacing_check(last, rule)
  end
  for i = 1, rule.nlimits do
    local l = rule.limits[i]
    -- A window is a suffix of the sorted log (the saved entries, then this batch's n at now),
    -- so it is full exactly when its count-th newest entry is in it, and frees up when that
    -- entry leaves it: one entry to look at, no search.
    local nth
    if l.count <= n then
      nth = now
    elseif st.len >= l.count - n then
      nth = entry(st, st.len + n - l.count + 1)
    end
    if nth and nth > now - l.window then
      retry, lim = worse(retry, lim, nth + l.window - now, i)
    end
  end
  return retry, lim
end

function log.charge(st, rule, passed)
  st.added = st.added + 1
end

function log.save(st)
  if st.added == 0 then
    return
  end
  local rule = st.rule
  local ttl_ms = ms_until(now + rule.horizon)
  local text = packed_now
  if st.added > 1 then
    text = string.rep(packed_now, math.min(st.added, rule.cap))
  end
  -- The oldest `over` entries go for the cap.
  local over = math.max(0, st.len + st.added - rule.cap)
  if over == 0 and st.len > 0 and not st.text then
    redis.call('APPEND', st.key, text)
    redis.call('PEXPIRE', st.key, ttl_ms)
    return
  end
  if over < st.len then
    -- The kept part, and the entries past the horizon dropped from it. Built with as few
    -- copies as it can (the log is most of what this script moves).
    local kept = st
    if not st.text then
      local t = redis.call('GETRANGE', st.key, 8 * over, -1)
      kept, over = { text = t, len = #t / 8 }, 0
    end
    local floor = now - rule.horizon
    if entry(kept, over + 1) <= floor then
      over = count_upto(kept, floor)
    end
    text = (over > 0 and string.sub(kept.text, 8 * over + 1) or kept.text) .. text
  end
  redis.call('PSETEX', st.key, ttl_ms, text)
end

-- Loads a gcra or fixed_window state: its numbers `v` (alg.width per limit), then `last`; with
-- none stored, alg.empty (one limit's numbers with nothing charged) for each limit.
local function load_numbers(alg, text, rule, key)
  local width = #alg.empty
  local n = width * rule.nlimits
  local v = unpack_numbers(text, n + 1)
  local last
  if v then
    last = v[n + 1]
  else
    v = {}
    for i = 0, rule.nlimits - 1 do
      for j, x in ipairs(alg.empty) do
        v[width * i + j] = x
      end
    end
  end
  return { alg = alg, key = key, rule = rule, v = v, last = last, dirty = false }
end

-- Saves a gcra or fixed_window state, if it changed: its numbers `v` (n of them, `last`
-- appended), living until `until_t` or min_spacing after `last`, whichever is later.
local function save_numbers(st, n, until_t)
  if not st.dirty then
    return
  end
  local v, last = st.v, st.last
  v[n + 1] = last
  until_t = math.max(until_t, last + st.rule.spacing)
  redis.call('PSETEX', st.key, ms_until(until_t), struct_pack(packing(n + 1), unpack(v, 1, n + 1)))
end

-- gcra: v holds t<i>, the theoretical arrival time of limit i (µs), for each limit; then last.
local gcra = { empty = { 0 } }

function gcra.load(text, rule, key)
  return load_numbers(gcra, text, rule, key)
end

function gcra.check(st, rule)
  local retry, lim = spacing_check(st.last, rule), 0
  local tats = st.v
  for i = 1, rule.nlimits do
    local earliest = tats[i] - rule.limits[i].tol
    if now < earliest then
      retry, lim = worse(retry, lim, earliest - now, i)
    end
  end
  return retry, lim
end

function gcra.charge(st, rule, passed)
  local tats = st.v
  for i = 1, rule.nlimits do
    local l = rule.limits[i]
    local nxt = math.max(tats[i], now) + l.interval
    if not passed then
      -- A rejected attempt's debt stops at one full bucket.
      nxt = math.min(nxt, now + l.tol + l.interval)
    end
    tats[i] = nxt
  end
  st.last, st.dirty = now, true
end

-- The state matters until the latest tat (an empty bucket after).
function gcra.save(st)
  local n, until_t = st.rule.nlimits, 0
  for i = 1, n do
    until_t = math.max(until_t, st.v[i])
  end
  save_numbers(st, n, until_t)
end

-- fixed_window: v holds w<i> (window number of limit i) and c<i> (its count) for each limit;
-- then last.
local fixed = { empty = { -1, 0 } }

function fixed.load(text, rule, key)
  return load_numbers(fixed, text, rule, key)
end

function fixed.check(st, rule)
  local retry, lim = spacing_check(st.last, rule), 0
  local v = st.v
  for i = 1, rule.nlimits do
    local l = rule.limits[i]
    local current = window_of(l.window)
    if v[2 * i - 1] == current and v[2 * i] >= l.count then
      retry, lim = worse(retry, lim, (current + 1) * l.window - now, i)
    end
  end
  return retry, lim
end

function fixed.charge(st, rule, passed)
  local v = st.v
  for i = 1, rule.nlimits do
    local current = window_of(rule.limits[i].window)
    if v[2 * i - 1] ~= current then
      v[2 * i - 1], v[2 * i] = current, 0
    end
    v[2 * i] = v[2 * i] + 1
  end
  st.last, st.dirty = now, true
end

-- The state matters until the latest window ends.
function fixed.save(st)
  local rule, until_t = st.rule, 0
  for i = 1, rule.nlimits do
    until_t = math.max(until_t, (st.v[2 * i - 1] + 1) * rule.limits[i].window)
  end
  save_numbers(st, 2 * rule.nlimits, until_t)
end

local algorithms = { sliding_log = log, gcra = gcra, fixed_window = fixed }

-- Runs `cmd` (on `key`, if not nil) with `args` appended, at most 1000 at a time (unpack has a
-- stack limit that a big batch's argument list could pass); returns the replies, concatenated.
local function chunked(cmd, key, args)
  local out = {}
  for from = 1, #args, 1000 do
    local part = { cmd }
    if key then
      part[2] = key
    end
    for j = from, math.min(from + 999, #args) do
      part[#part + 1] = args[j]
    end
    local r = redis.call(unpack(part))
    if type(r) == 'table' then
      for _, v in ipairs(r) do
        out[#out + 1] = v
      end
    end
  end
  return out
end

-- The events: owner, decision hash and where its fields start, in flat arrays (a table per
-- event would cost more than its use); event i's check x uses KEYS[key_at[i] + x].
local n = tonumber(ARGV[at])
at = at + 1
local owner, hash, key_at, fields_at = {}, {}, {}, {}
local hashes, in_hash = {}, {}
local k = rejected and 3 or 2
for i = 1, n do
  owner[i] = ARGV[at]
  fields_at[i] = at + 1
  at = fields_end(at + 1)
  local h = KEYS[k]
  hash[i], key_at[i] = h, k
  k = k + 1 + nchecks
  local members = in_hash[h]
  if not members then
    members = {}
    in_hash[h] = members
    hashes[#hashes + 1] = h
  end
  members[#members + 1] = i
end

-- Decisions earlier deliveries recorded: those stand, and nothing is charged for them. Read on
-- every call, not only for redeliveries: a call that timed out on the client may still run
-- after a retry or a fail_policy decision, and must then find the decision made.
local prev = {}
for _, h in ipairs(hashes) do
  local fields = {}
  for j, i in ipairs(in_hash[h]) do
    fields[j] = owner[i]
  end
  local got = chunked('HMGET', h, fields)
  for j, i in ipairs(in_hash[h]) do
    prev[i] = got[j]
  end
end

-- Each identity's state is read once per call (all of them in one MGET, but for logs read by
-- entry) and written once at its end.
local states, order = {}, {}
local loading, texts = {}, {}
for i = 1, n do
  if not prev[i] then
    for x = 1, nchecks do
      local key = KEYS[key_at[i] + x]
      if texts[key] == nil and not rules[check_rule[x]].by_entry then
        texts[key] = false
        loading[#loading + 1] = key
      end
    end
  end
end
for j, v in ipairs(chunked('MGET', nil, loading)) do
  texts[loading[j]] = v
end
local function state(key, rule)
  local st = states[key]
  if not st then
    st = algorithms[rule.alg].load(texts[key], rule, key)
    states[key] = st
    order[#order + 1] = st
  end
  return st
end

local out, o = { now }, 1
local record, recorded = {}, {}
local passed = {}
local all_passed = string.rep('1', nrules)
for i = 1, n do
  local earlier = prev[i]
  if earlier then
    out[o + 1], out[o + 2], out[o + 3] = 2, earlier, ''
    o = o + 3
  else
    -- Check everything first.
    local base = key_at[i]
    local best, best_lim, binding = 0, 0, nil
    local failed = false
    for x = 1, nchecks do
      local r = check_rule[x]
      local rule = rules[r]
      local st = state(KEYS[base + x], rule)
      local retry, lim = st.alg.check(st, rule)
      if retry > 0 then
        if not failed then
          failed = true
          for q = 1, nrules do
            passed[q] = '1'
          end
        end
        passed[r] = '0'
        if not rule.shadow and retry > best then
          best, best_lim, binding = retry, lim, x
        end
      end
    end
    local accepted = binding == nil
    local decision = 'A'
    if not accepted then
      local rule = rules[check_rule[binding]]
      local label = (best_lim == 0 and rule.spacing_label) or rule.limits[best_lim].label
      local field = check_field[binding]
      local tail = int(best) .. '|' .. rule.name .. '|' .. label .. '|' .. field
      if rejected then
        -- The fields of src/event/inbound.rs's rejected_fields, in its order: the reasons,
        -- then the forward entry's (the carried fields and where the entry came from).
        local f = fields_at[i]
        redis.call('XADD', rejected, 'MAXLEN', '~', maxlen, '*', 'pacer_reason', 'rate_limited',
          'pacer_rule', rule.name, 'pacer_limit', label, 'pacer_key', field,
          'pacer_retry_after_ms', int(math.ceil(best / 1000)), unpack(ARGV, f + 1, fields_end(f) - 1))
        decision = 'R' .. tail
      else
        decision = 'r' .. tail
      end
    end
    -- Then charge.
    for x = 1, nchecks do
      local r = check_rule[x]
      local rule = rules[r]
      local ok = accepted and (not failed or passed[r] == '1')
      if ok or rule.count_rejected then
        local st = states[KEYS[base + x]]
        st.alg.charge(st, rule, ok)
      end
    end
    if accepted then
      local f = fields_at[i]
      redis.call('XADD', KEYS[1], 'MAXLEN', '~', maxlen, '*', unpack(ARGV, f + 1, fields_end(f) - 1))
    end
    local h = hash[i]
    local rec, m = record[h], recorded[h]
    if not rec then
      rec, m = {}, 0
      record[h] = rec
    end
    rec[m + 1], rec[m + 2] = owner[i], decision
    recorded[h] = m + 2
    out[o + 1], out[o + 2] = 1, decision
    out[o + 3] = failed and table.concat(passed, '', 1, nrules) or all_passed
    o = o + 3
  end
end

for _, st in ipairs(order) do
  st.alg.save(st)
end
for _, h in ipairs(hashes) do
  if record[h] then
    chunked('HSET', h, record[h])
    redis.call('PEXPIRE', h, ttl)
  end
end
return out
