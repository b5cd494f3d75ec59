-- admission.lua: what the inbound algorithms share (src/admission.rs in Rust): the call's one
-- instant, how a verdict is kept, min_spacing, expiry, and states packed as numbers. Prepended,
-- after lib.lua, to admit.lua together with the three algorithms in lua/admission/.

-- Redis's clock, read once: the time of every decision of the call.
local now = redis_now_us()

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

