-- decide.lua: synchronous admission (POST /v1/admit, Envoy's ShouldRateLimit): decide one
-- request against its rules' limits now, charge it, and lease tokens to the caller where it
-- asks. Nothing is recorded per request and no stream is written: the caller has the answer in
-- the reply. The same algorithms, keys and state as admit.lua, so that stream events and
-- synchronous calls on one rule and identity draw on the same limits. Held to src/admission.rs's
-- `Engine::decide` by tests/decide_differential.rs (which replays each call's now_us).
--
-- KEYS[1..c]  the request's identities' limiter keys, one per check, all in one slot
-- ARGV[1]     entries per read (admit.lua's ARGV[4]: when a sliding log is read by entry)
-- ARGV[2..]   the rules (admission.lua's read_rules)
-- then        cost (events the request counts for, >= 1), c; then per check: its rule's index
--             (1-based), its key field's index in the rule, and what is asked of it:
--               0   decide it;
--               -1  the caller spent a leased token on it: neither checked nor charged here;
--               k>0 decide it, then, if the request is accepted, lease up to k more tokens
--                   (charged now, spent by the caller; gcra and fixed_window only)
-- Returns { now_us, accepted (1/0), retry_us (0 if accepted), binding check (0: none),
--           binding limit (0: min_spacing), then per check six numbers: passed (1/0),
--           remaining (-1: no limit), limit (0: min_spacing), reset_us, granted tokens,
--           lease_us (how long they may be spent: a fixed window's time to its end; 0: no
--           bound here, the caller's lease ttl) }
-- Checking comes before charging, as in admit.lua: a rejected request uses up nothing (but
-- under count_rejected).

local rules, nrules, at = read_rules(2, num(1, 'entries per read'))
local algorithms = { sliding_log = sliding_log, gcra = gcra, fixed_window = fixed_window }

local cost = num(at, 'cost')
local c = num(at + 1, 'checks')
at = at + 2
if cost < 1 or cost % 1 ~= 0 then
  bad('cost')
end
local check_rule, check_field, ask = {}, {}, {}
for x = 1, c do
  check_rule[x] = index(at, nrules, false, 'rule')
  ask[x] = num(at + 2, 'ask')
  local rule = rules[check_rule[x]]
  check_field[x] = rule.fields[index(at + 1, #rule.fields, false, 'field')]
  if ask[x] > 0 and rule.alg == 'sliding_log' then
    bad('lease of a sliding log')
  end
  at = at + 3
end
if at - 1 ~= #ARGV then
  bad('argument count')
end
if c ~= #KEYS then
  bad('key count')
end

-- Each identity's state, loaded once (the ones read whole in one MGET).
local texts, loading = {}, {}
for x = 1, c do
  if ask[x] >= 0 and not rules[check_rule[x]].by_entry and texts[KEYS[x]] == nil then
    texts[KEYS[x]] = false
    loading[#loading + 1] = KEYS[x]
  end
end
if #loading > 0 then
  for j, v in ipairs(redis.call('MGET', unpack(loading))) do
    texts[loading[j]] = v
  end
end
local states, order = {}, {}
local function state(x)
  local key = KEYS[x]
  local st = states[key]
  if not st then
    local rule = rules[check_rule[x]]
    st = algorithms[rule.alg].load(texts[key], rule, key)
    states[key] = st
    order[#order + 1] = st
  end
  return st
end

-- Check everything first.
local passed, rule_passed = {}, {}
local best, best_lim, binding = 0, 0, 0
for x = 1, c do
  passed[x] = true
  if ask[x] >= 0 then
    local r = check_rule[x]
    local rule = rules[r]
    local retry, lim = state(x).alg.check(state(x), rule, cost)
    if retry > 0 then
      passed[x], rule_passed[r] = false, false
      if not rule.shadow and retry > best then
        best, best_lim, binding = retry, lim, x
      end
    end
  end
end
local accepted = binding == 0

-- Then charge, then lease.
for x = 1, c do
  if ask[x] >= 0 then
    local r = check_rule[x]
    local rule = rules[r]
    local ok = accepted and rule_passed[r] ~= false
    if ok or rule.count_rejected then
      local st = state(x)
      st.alg.charge(st, rule, ok, cost)
    end
  end
end

local out = { now, accepted and 1 or 0, int(best), binding, best_lim }
for x = 1, c do
  local granted, span, left, lim, reset = 0, 0, -1, 0, 0
  if ask[x] >= 0 then
    local rule = rules[check_rule[x]]
    local st = state(x)
    if accepted and ask[x] > 0 then
      left = st.alg.room(st, rule)
      granted = math.min(ask[x], left)
      if granted > 0 then
        st.alg.charge(st, rule, true, granted)
      end
      if rule.alg == 'fixed_window' then
        span = fixed_window.lease_span(rule)
      end
    end
    left, lim, reset = st.alg.room(st, rule)
    if left == math.huge then
      left = -1
    end
  end
  local o = #out
  out[o + 1], out[o + 2], out[o + 3] = passed[x] and 1 or 0, int(left), lim
  out[o + 4], out[o + 5], out[o + 6] = int(reset), int(granted), int(span)
end

for _, st in ipairs(order) do
  st.alg.save(st)
end
return out
