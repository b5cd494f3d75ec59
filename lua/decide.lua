-- decide.lua: synchronous admission (POST /v1/admit, Envoy's ShouldRateLimit): decide a batch
-- of requests, one after the other, against their rules' limits now, charge each, and lease
-- tokens to the caller where it asks. Nothing is recorded per request and no stream is
-- written: the caller has the answers in the reply. The same algorithms, keys and state as
-- admit.lua, so that stream events and synchronous calls on one rule and identity draw on the
-- same limits. Held to src/admission.rs's `Engine::decide` (each request in turn, at the
-- call's now_us) by tests/admit_differential.rs.
--
-- A batch is the requests a worker has in hand at once: one call for them all spares each the
-- per-call cost (calling Redis at all, reading the rules).
--
-- It runs as a Redis Function (src/scripts/function.rs), whose library keeps the rules it has
-- read by their digest (admission.lua's rules_by_digest), so a call usually passes none; as a
-- script, its rules always follow.
--
-- KEYS        every request's identities' limiter keys, one per check, request by request;
--             all in one slot
-- ARGV[1]     the rules' digest (of ARGV[3..] as they are when the rules follow)
-- ARGV[2]     1: the rules follow; 0: they do not (the library may have them)
-- ARGV[3]     if they follow: entries per read (admit.lua's ARGV[4]: when a sliding log is read
--             by entry)
-- ARGV[4..]   if they follow: the rules (admission.lua's read_rules)
-- then        n, the number of requests; then per request: cost (events it counts for, >= 1;
--             0 for a check that charges nothing, an Envoy descriptor's hits_addend of 0:
--             refused only where a count is already past its limit, as under count_rejected,
--             and asking nothing else), c (its checks); then per check: its rule's index
--             (1-based), its key field's index in the rule, and what is asked of it:
--               0   decide it;
--               -1  the caller spent a leased token on it: neither checked nor charged here;
--               k>0 decide it, then, if the request is accepted, lease up to k more tokens
--                   (charged now, spent by the caller; gcra and fixed_window only); then three
--                   more numbers: the gap between fetch turns (µs, see admission.lua's
--                   book_turn) for a fetch that comes back short or refused; p, the
--                   request's tokens the caller spent from what its lease still held
--                   (0 <= p < cost); and when those leases end (µs, Redis's clock). Before
--                   then, the check is decided and charged for cost - p (the p were charged
--                   when leased); from then on for the whole cost, as their tokens may no
--                   longer be spent (a fixed window's lease ends with its window)
-- Returns { now_us, then per request: accepted (1/0), retry_us (0 if accepted), binding check
--           (its index among the request's checks; 0: none), binding limit (0: min_spacing),
--           then per check seven numbers: passed (1/0), remaining (-1: no limit), limit (0:
--           min_spacing), reset_us, granted tokens, lease_us (how long they may be spent: a
--           fixed window's time to its end; 0: no bound here, the caller's lease ttl), turn_us
--           (a lease asked for came back short, or leaves less room than it asked, or was
--           refused: Redis's time of this worker's next fetch turn on it; else 0) }
-- or, when the rules did not follow and are not kept here, the status reply RESEND: call again
-- with them.
-- Checking comes before charging, as in admit.lua: a rejected request uses up nothing (but
-- under count_rejected).

start_call()
local rules, nrules, at = rules_by_digest(1)
if not rules then
  return redis.status_reply('RESEND')
end

-- The requests, flat: request q's checks are x = first[q] .. first[q + 1] - 1.
local n = num(at, 'requests')
at = at + 1
local cost, first = {}, {}
local check_rule, check_field, ask, gap, units = {}, {}, {}, {}, {}
local x = 0
for q = 1, n do
  cost[q] = num(at, 'cost')
  if cost[q] < 0 or cost[q] % 1 ~= 0 then
    bad('cost')
  end
  local c = num(at + 1, 'checks')
  at = at + 2
  first[q] = x + 1
  for _ = 1, c do
    x = x + 1
    check_rule[x] = index(at, nrules, false, 'rule')
    ask[x] = num(at + 2, 'ask')
    if cost[q] == 0 and ask[x] ~= 0 then
      bad('a check of cost 0 asks nothing more')
    end
    local rule = rules[check_rule[x]]
    check_field[x] = rule.fields[index(at + 1, #rule.fields, false, 'field')]
    units[x] = cost[q]
    if ask[x] > 0 then
      if rule.alg == 'sliding_log' then
        bad('lease of a sliding log')
      end
      gap[x] = num(at + 3, 'gap')
      local paid = num(at + 4, 'paid')
      if paid < 0 or paid >= cost[q] or paid % 1 ~= 0 then
        bad('paid')
      end
      if now < num(at + 5, 'paid until') then
        units[x] = cost[q] - paid
      end
      at = at + 3
    end
    at = at + 3
  end
end
first[n + 1] = x + 1
if at - 1 ~= #ARGV then
  bad('argument count')
end
if x ~= #KEYS then
  bad('key count')
end

-- Each identity's state, read once for the batch and written once at its end (states.lua).
for y = 1, x do
  if ask[y] >= 0 then
    want_state(KEYS[y], rules[check_rule[y]])
  end
end
read_states()
local function state(y)
  return state_of(KEYS[y], rules[check_rule[y]])
end

local out = { now }
for q = 1, n do
  local from, to = first[q], first[q + 1] - 1
  -- Check everything first.
  local passed, rule_passed = {}, {}
  local first_retry, first_lim = {}, {}
  local best, best_lim, binding = 0, 0, 0
  for y = from, to do
    passed[y] = true
    if ask[y] >= 0 then
      local r = check_rule[y]
      local rule = rules[r]
      local st = state(y)
      local retry, lim = st.alg.check(st, rule, units[y])
      first_retry[y], first_lim[y] = retry, lim
      if retry > 0 then
        passed[y], rule_passed[r] = false, false
        if not rule.shadow and retry > best then
          best, best_lim, binding = retry, lim, y - from + 1
        end
      end
    end
  end
  local accepted = binding == 0
  -- Then charge, then lease.
  for y = from, to do
    if ask[y] >= 0 then
      local rule = rules[check_rule[y]]
      local ok = accepted and rule_passed[check_rule[y]] ~= false
      if units[y] > 0 and (ok or rule.count_rejected) then
        local st = state(y)
        st.alg.charge(st, rule, ok, units[y])
      end
    end
  end
  if not accepted then
    -- retry_after as the charges left it (admission.lua `rebind`).
    local again, again_lim, again_y = rebind(from, to, first_retry, first_lim, function(y)
      if ask[y] >= 0 then
        return rules[check_rule[y]], state(y), units[y]
      end
    end)
    if again_y then
      best, best_lim, binding = again, again_lim, again_y - from + 1
    end
  end
  local o = #out
  -- Numbers go back as integer replies (whole, and below 2^53): no text to format.
  out[o + 1], out[o + 2], out[o + 3], out[o + 4] = accepted and 1 or 0, best, binding, best_lim
  for y = from, to do
    local granted, span, left, lim, reset, turn = 0, 0, -1, 0, 0, 0
    if ask[y] >= 0 then
      local rule = rules[check_rule[y]]
      local st = state(y)
      if accepted and ask[y] > 0 then
        left = st.alg.room(st, rule)
        granted = math.min(ask[y], left)
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
      -- At the limit: the lease came back short, or the next as large would, or the request
      -- was refused here.
      local short = accepted and (granted < ask[y] or left >= 0 and left < ask[y])
      if ask[y] > 0 and (short or not accepted and not passed[y]) then
        turn = book_turn(KEYS[y], gap[y])
      end
    end
    o = #out
    out[o + 1], out[o + 2], out[o + 3] = passed[y] and 1 or 0, left, lim
    out[o + 4], out[o + 5], out[o + 6], out[o + 7] = reset, granted, span, turn
  end
end

save_states()
return out
