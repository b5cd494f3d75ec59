-- admission/fixed_window.lua: a counter per calendar window (src/admission/fixed_window.rs in
-- Rust). Prepended to admit.lua after admission.lua.

-- then last.
local fixed_window = { empty = { -1, 0 } }

-- Limit i's window now and what it has counted. A window on record newer than Redis's clock's
-- (the clock stepped back) is still the current one: reading it as empty admitted a whole
-- limit again on every step back (found by review: 6 of 3/min across a 120 s step).
local function current_window(v, i, window)
  local current = window_of(window)
  if v[2 * i - 1] >= current then
    return v[2 * i - 1], v[2 * i]
  end
  return current, 0
end

function fixed_window.load(text, rule, key)
  return load_numbers(fixed_window, text, rule, key)
end

-- Whether `cost` more events fit the current windows.
function fixed_window.check(st, rule, cost)
  local retry, lim = cost > 0 and spacing_check(st.last, rule) or 0, 0
  local v = st.v
  for i = 1, rule.nlimits do
    local l = rule.limits[i]
    local current, used = current_window(v, i, l.window)
    if used + cost > l.count then
      retry, lim = worse(retry, lim, (current + 1) * l.window - now, i)
    end
  end
  return retry, lim
end

function fixed_window.charge(st, rule, passed, cost)
  local v = st.v
  for i = 1, rule.nlimits do
    local current = window_of(rule.limits[i].window)
    if v[2 * i - 1] < current then
      v[2 * i - 1], v[2 * i] = current, 0
    end
    v[2 * i] = v[2 * i] + cost
  end
  st.last, st.dirty = now, true
end

-- The state matters until the latest window ends.
-- The room left in the current windows, for the limit with the least, and the µs until that
-- window ends (src/admission/fixed_window.rs, `room`).
function fixed_window.room(st, rule)
  local left, lim, reset = math.huge, 0, 0
  local v = st.v
  for i = 1, rule.nlimits do
    local l = rule.limits[i]
    local current, used = current_window(v, i, l.window)
    local n = math.max(0, l.count - used)
    if n < left then
      left, lim, reset = n, i, (current + 1) * l.window - now
    end
  end
  return spacing_room(st.last, rule, left, lim, reset)
end

-- How long a lease of this rule's tokens may be spent: to the end of the earliest current
-- window, so that a token counted in one window is never spent in the next.
function fixed_window.lease_span(rule)
  local span = math.huge
  for i = 1, rule.nlimits do
    local w = rule.limits[i].window
    span = math.min(span, (window_of(w) + 1) * w - now)
  end
  return span == math.huge and 0 or span
end

function fixed_window.save(st)
  local rule, until_t = st.rule, 0
  for i = 1, rule.nlimits do
    until_t = math.max(until_t, (st.v[2 * i - 1] + 1) * rule.limits[i].window)
  end
  save_numbers(st, 2 * rule.nlimits, until_t)
end

