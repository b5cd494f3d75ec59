-- admission.lua: what the inbound algorithms share (src/admission.rs in Rust): the call's one
-- instant, how a verdict is kept, min_spacing, expiry, and states packed as numbers. Prepended,
-- after lib.lua, to admit.lua together with the three algorithms in lua/admission/.

-- Redis's clock, read once by start_call (states.lua): the time of every decision of the call.
local now

-- A verdict is (retry, limit): retry 0 passes, else the µs until it would pass; limit is the
-- index of the binding limit, 0 for min_spacing. The later one binds; a tie keeps the first.
local function worse(retry, lim, retry2, lim2)
  if retry2 > retry then
    return retry2, lim2
  end
  return retry, lim
end

-- min_spacing against the last charged event. An algorithm's check of cost 0 (decide.lua: a
-- check that charges nothing) asks whether a count is already past its limit; min_spacing
-- counts nothing, so it does not ask this (src/admission.rs `spacing_check`).
local function spacing_check(last, rule)
  if last and rule.spacing > 0 and now - last < rule.spacing then
    return last + rule.spacing - now
  end
  return 0
end

-- Folds min_spacing into an algorithm's room (left, lim, reset for its limits; left is
-- math.huge for a rule with none): one at once when the last charge is far enough back, none
-- until it is (src/admission.rs, `spacing_room`; a tie keeps the limit).
local function spacing_room(last, rule, left, lim, reset)
  if rule.spacing > 0 then
    local wait = spacing_check(last, rule)
    local n = wait > 0 and 0 or 1
    if n < left then
      return n, 0, wait
    end
  end
  return left, lim, reset
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

-- Set by start_call (states.lua): a Redis Function's library is loaded where `struct` is not
-- yet in reach.
local struct_unpack, struct_pack

-- The n numbers packed in `v`, or nil when it is absent or unreadable.
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


-- Reads the rules from ARGV[at..] as src/scripts/admit.rs's `push_rules` writes them: r, then
-- per rule name, algorithm (sliding_log | gcra | fixed_window), shadow (0/1), count_rejected
-- (0/1), spacing_us (0: none), spacing label, horizon_us, log cap (most entries a sliding log
-- keeps), nkeys, the key field names, nlimits, then per limit: window_us, count, interval_us,
-- tolerance_us (gcra), label. A sliding log whose cap is more than entries_per_read entries per
-- command that reading it by entry takes is read by entry. Returns the rules, their number and
-- the index after them.
local function read_rules(at, entries_per_read)
  local rules = {}
  local nrules = num(at, 'rules')
  at = at + 1
  local known = { sliding_log = true, gcra = true, fixed_window = true }
  for r = 1, nrules do
    local rule = {
      name = ARGV[at], alg = ARGV[at + 1], shadow = ARGV[at + 2] == '1',
      count_rejected = ARGV[at + 3] == '1', spacing = num(at + 4, 'spacing'),
      spacing_label = ARGV[at + 5], horizon = num(at + 6, 'horizon'), cap = num(at + 7, 'cap'),
      fields = {}, limits = {},
    }
    if not known[rule.alg] then
      bad('algorithm ' .. tostring(rule.alg))
    end
    at = at + 8
    local nf = num(at, 'key count')
    for f = 1, nf do
      rule.fields[f] = ARGV[at + f]
    end
    at = at + nf + 1
    local nl = num(at, 'limit count')
    rule.nlimits = nl
    at = at + 1
    for l = 1, nl do
      rule.limits[l] = {
        window = num(at, 'window'), count = num(at + 1, 'count'),
        interval = num(at + 2, 'interval'), tol = num(at + 3, 'tolerance'), label = ARGV[at + 4],
      }
      at = at + 5
    end
    -- Reading a log by entry takes a STRLEN, then a GETRANGE per limit and one for min_spacing.
    local reads = 1 + nl + (rule.spacing > 0 and 1 or 0)
    rule.by_entry = rule.alg == 'sliding_log' and rule.cap > entries_per_read * reads
    rules[r] = rule
  end
  return rules, nrules, at
end

-- Rules read by earlier calls, by their digest. Only a Redis Function keeps them: its library
-- outlives each call, where a script starts every call with none. Reading one rule's twenty
-- arguments (each made a Lua string, its numbers parsed, its tables built) is about a quarter
-- of what a leased fetch costs Redis, and the rules change only with a worker's config. The
-- digest is of the arguments read_rules would read and the entries per read: rules with the
-- same digest are the same rules. A worker whose rules are not here (a new config, Redis
-- restarted, another master) is told so and sends them.
--
-- Kept in two generations, bounded by the rules they hold: a call finds its rules in either
-- (moving them from the old to the new), and once the new holds RULES_KEPT rules it becomes
-- the old, the one before it dropped. So the configs in use stay kept however many there are
-- up to that, and those no longer used go; clearing everything at a bound instead made one
-- config past it send its rules again on nearly every call, in turn with the others.
local RULES_KEPT = 1024
local rules_new, rules_old, rules_new_count = {}, {}, 0

local function keep_rules(digest, kept)
  if rules_new_count >= RULES_KEPT then
    rules_old, rules_new, rules_new_count = rules_new, {}, 0
  end
  rules_new[digest] = kept
  rules_new_count = rules_new_count + math.max(kept[2], 1)
end

-- Reads ARGV[at] (the rules' digest), ARGV[at + 1] (1: the entries per read and the rules
-- follow, as read_rules reads them; 0: they do not); returns the rules, their number and the
-- index after them, or nothing when they did not follow and are not kept here.
local function rules_by_digest(at)
  local digest, follow = ARGV[at], ARGV[at + 1]
  if follow == '0' then
    local kept = rules_new[digest]
    if not kept then
      kept = rules_old[digest]
      if not kept then
        return
      end
      rules_old[digest] = nil
      keep_rules(digest, kept)
    end
    return kept[1], kept[2], at + 2
  elseif follow ~= '1' then
    bad('rules follow (ARGV[' .. (at + 1) .. '])')
  end
  local rules, nrules, after = read_rules(at + 3, num(at + 2, 'entries per read'))
  if not rules_new[digest] then
    rules_old[digest] = nil
    keep_rules(digest, { rules, nrules })
  end
  return rules, nrules, after
end

-- Each leased identity's last fetch turn booked (µs), kept like the rules: only a Redis
-- Function keeps them; as a script every turn is booked from now. A hint, never a limit: a
-- lost turn makes a worker fetch sooner, nothing more.
local turns, turns_count = {}, 0

-- Books a fetch turn on `key` for a worker whose fetch at the limit came back short (or was
-- refused): `gap` µs after the last turn booked, or after now if that has passed. Workers that
-- share an identity at its limit so fetch one at a time, a gap apart, each finding what the
-- bucket gathered in the gap, where each polling on its own would make the calls grow with
-- their number. Round the turns go in the order they were booked, so each gets its share.
local function book_turn(key, gap)
  local last = turns[key]
  if not last then
    if turns_count >= 10000 then
      -- Identities once at their limit: start again rather than grow.
      turns, turns_count = {}, 0
    end
    turns_count = turns_count + 1
  end
  if not last or last < now then
    last = now
  end
  turns[key] = last + gap
  return last + gap
end

-- After a refused request's charges, the check that binds it (src/admission.rs `rebind`, the
-- same rule): a count_rejected rule charged the attempt too, so its check is made again, since
-- its room now comes later than its first answer said (a client waiting that answer was refused
-- every time); the others keep their first answer. Checks from..to, each with its first
-- `first_retry[x], first_lim[x]`; `at(x)` gives its rule, state and the units it is decided
-- for, or nothing for a check not made (a leased token spent). Returns retry, limit and x of
-- the latest, or 0, 0, nil.
local function rebind(from, to, first_retry, first_lim, at)
  local best, best_lim, best_x = 0, 0, nil
  for x = from, to do
    local rule, st, units = at(x)
    if rule and not rule.shadow then
      local retry, lim = first_retry[x], first_lim[x]
      if rule.count_rejected then
        retry, lim = st.alg.check(st, rule, units)
      end
      if retry > best then
        best, best_lim, best_x = retry, lim, x
      end
    end
  end
  return best, best_lim, best_x
end
