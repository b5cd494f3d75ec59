-- admission/fixed_window.lua: a counter per calendar window (src/admission/fixed_window.rs in
-- Rust). Prepended to admit.lua after admission.lua.

-- then last.
local fixed_window = { empty = { -1, 0 } }

function fixed_window.load(text, rule, key)
  return load_numbers(fixed_window, text, rule, key)
end

function fixed_window.check(st, rule)
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

function fixed_window.charge(st, rule, passed)
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
function fixed_window.save(st)
  local rule, until_t = st.rule, 0
  for i = 1, rule.nlimits do
    until_t = math.max(until_t, (st.v[2 * i - 1] + 1) * rule.limits[i].window)
  end
  save_numbers(st, 2 * rule.nlimits, until_t)
end

