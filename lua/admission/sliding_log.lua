-- admission/sliding_log.lua: the exact rolling window (src/admission/sliding_log.rs in Rust).
-- Prepended to admit.lua after admission.lua.

-- sliding_log: the times (µs) of the charged events, oldest first, packed as little-endian
-- doubles in one string (see `packing` above), like src/admission/sliding_log.rs's Vec: at most
-- `cap` of them (keeping the newest cap is exact, see there). Sorted, so a check reads one entry
-- per limit and a trim binary-searches; and one string per identity, where a sorted set took
-- four or five commands and ~60 bytes per entry. The batch's own charges (all at `now`) are
-- counted in `added` and appended when it is saved.
--
-- Every string Redis hands to Lua, or Lua builds, is hashed byte by byte, so a log costs by
-- its size each time it passes through Lua, and a command costs a fixed amount around its
-- work. Hence two ways to hold one, by the rule's cap against the commands reading by entry takes
-- (ARGV[4] entries per command):
-- - whole (small caps): read in the batch's MGET with the other states, rewritten on save
--   with the entries past the horizon dropped: a log of a few hundred entries costs less
--   than the commands that would spare it;
-- - by entry (large caps): its length from STRLEN, the few entries the checks need from
--   GETRANGE, and the batch's charges APPENDed while nothing needs dropping for the cap; so a
--   log of thousands of entries never passes through Lua on most calls. Entries past the
--   horizon then stay until the cap makes a rewrite drop them: older than every window, no
--   check reads them, and the cap still bounds the log.
-- Where the two ways cross was measured (README, "Inbound admission"); ARGV[4] carries it.
local sliding_log = {}

function sliding_log.load(text, rule, key)
  if rule.by_entry then
    -- pcall: a key of another type reads as absent, as a GET in MGET would (and is replaced).
    local len = redis.pcall('STRLEN', key)
    if type(len) ~= 'number' or len % 8 ~= 0 then
      len = 0
    end
    return { alg = sliding_log, key = key, rule = rule, len = len / 8, added = 0, entries = {} }
  end
  if not (text and #text % 8 == 0) then
    text = ''
  end
  return { alg = sliding_log, key = key, rule = rule, text = text, len = #text / 8, added = 0 }
end

-- `now` as a log entry (set by start_call, states.lua).
local packed_now

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

-- Whether `cost` more events fit: the batch's own `added` charges (all at now) count as if
-- logged, and a cost of c needs room for c - 1 more beside it.
function sliding_log.check(st, rule, cost)
  local n = st.added + cost - 1
  local retry, lim = 0, 0
  if rule.spacing > 0 and cost > 0 then
    local last
    if st.added > 0 then
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
    -- entry leaves it: one entry to look at, no search. The log keeps its newest `cap`
    -- entries, so a check of 0 on a limit of the largest count has no entry past it to find
    -- (the batch's `added` may run past the cap until it is saved).
    local nth
    if l.count - cost >= rule.cap then
      nth = nil
    elseif l.count <= n then
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

function sliding_log.charge(st, rule, passed, cost)
  st.added = st.added + cost
end

-- The room left: the events each window still takes, for the limit with the least, and the µs
-- until the newest entry in that window leaves it (src/admission/sliding_log.rs, `room`).
function sliding_log.room(st, rule)
  local left, lim, reset = math.huge, 0, 0
  local newest = now
  if st.added == 0 then
    newest = st.len > 0 and entry(st, st.len) or nil
  end
  for i = 1, rule.nlimits do
    local l = rule.limits[i]
    local held = st.len - count_upto(st, now - l.window) + st.added
    local n = math.max(0, l.count - held)
    if n < left then
      left, lim = n, i
      reset = (newest and newest > now - l.window) and newest + l.window - now or 0
    end
  end
  local last = st.added > 0 and now or newest
  return spacing_room(last, rule, left, lim, reset)
end

function sliding_log.save(st)
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

