-- admission/states.lua: the identity states of one call, shared by admit.lua and decide.lua.
-- Prepended after the three algorithms. Each state is read once per call (all of them in MGETs,
-- but for logs read by entry), kept here while the call checks and charges it, and written
-- once at its end (`save_states`).

local algorithms = { sliding_log = sliding_log, gcra = gcra, fixed_window = fixed_window }
local states, states_order, state_texts, state_loading

-- Starts a call: reads Redis's clock and empties what the files before keep per call. The
-- first thing admit.lua and decide.lua do; decide.lua also runs as a Redis Function, whose
-- library is loaded once and then called many times, where nothing per call may be set at load.
local function start_call()
  now = redis_now_us()
  struct_unpack, struct_pack = struct.unpack, struct.pack
  packed_now = struct_pack('<d', now)
  states, states_order, state_texts, state_loading = {}, {}, {}, {}
end

-- Marks `key` (of `rule`) to be read in the call's MGET (a log read by entry reads itself).
local function want_state(key, rule)
  if state_texts[key] == nil and not rule.by_entry then
    state_texts[key] = false
    state_loading[#state_loading + 1] = key
  end
end

-- Reads every state wanted, 1000 keys an MGET (unpack has a stack limit).
local function read_states()
  local l = state_loading
  for from = 1, #l, 1000 do
    local got = redis.call('MGET', unpack(l, from, math.min(from + 999, #l)))
    for j, v in ipairs(got) do
      state_texts[l[from + j - 1]] = v
    end
  end
end

-- The state of `key` under `rule`, loaded on first use.
local function state_of(key, rule)
  local st = states[key]
  if not st then
    st = algorithms[rule.alg].load(state_texts[key], rule, key)
    states[key] = st
    states_order[#states_order + 1] = st
  end
  return st
end

-- Writes every state the call changed.
local function save_states()
  for _, st in ipairs(states_order) do
    st.alg.save(st)
  end
end
