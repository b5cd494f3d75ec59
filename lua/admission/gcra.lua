-- admission/gcra.lua: a token bucket as GCRA, one number per limit (src/admission/gcra.rs in
-- Rust). Prepended to admit.lua after admission.lua.

-- gcra: v holds t<i>, the theoretical arrival time of limit i (µs), for each limit; then last.
local gcra = { empty = { 0 } }

function gcra.load(text, rule, key)
  return load_numbers(gcra, text, rule, key)
end

-- Whether `cost` more events conform: the schedule cost - 1 intervals on is within tolerance.
function gcra.check(st, rule, cost)
  local retry, lim = cost > 0 and spacing_check(st.last, rule) or 0, 0
  local tats = st.v
  for i = 1, rule.nlimits do
    local l = rule.limits[i]
    local earliest = math.max(tats[i], now) + (cost - 1) * l.interval - l.tol
    if now < earliest then
      retry, lim = worse(retry, lim, earliest - now, i)
    end
  end
  return retry, lim
end

function gcra.charge(st, rule, passed, cost)
  local tats = st.v
  for i = 1, rule.nlimits do
    local l = rule.limits[i]
    local nxt = math.max(tats[i], now) + cost * l.interval
    if not passed then
      -- A rejected attempt's debt stops at one full bucket.
      nxt = math.min(nxt, now + l.tol + l.interval)
    end
    tats[i] = nxt
  end
  st.last, st.dirty = now, true
end

-- The state matters until the latest tat (an empty bucket after).
-- The room left: events that conform at once, for the limit with the least, and the µs until
-- its bucket is full (src/admission/gcra.rs, `room`).
function gcra.room(st, rule)
  local left, lim, reset = math.huge, 0, 0
  for i = 1, rule.nlimits do
    local l = rule.limits[i]
    local ahead = math.max(st.v[i], now) - now
    local n = math.max(0, math.floor((l.tol - ahead) / l.interval) + 1)
    if n < left then
      left, lim, reset = n, i, ahead
    end
  end
  return spacing_room(st.last, rule, left, lim, reset)
end

function gcra.save(st)
  local n, until_t = st.rule.nlimits, 0
  for i = 1, n do
    until_t = math.max(until_t, st.v[i])
  end
  save_numbers(st, n, until_t)
end

-- fixed_window: v holds w<i> (window number of limit i) and c<i> (its count) for each limit;
