-- schedule.lua: decide a batch of events on one route. Each is dispatched at once, given a slot
-- to sleep until, or passed over because it would wait longer than it accepts; an event an
-- earlier delivery decided gets that decision back, an event whose id another entry owns is a
-- duplicate, and an entry read too old is not placed. Nothing is written until every argument
-- is checked; then the ready entries, then the decisions that say they were written, then the
-- bucket and the acknowledgements.
--
-- What an event passes costs Redis by the argument (each is parsed, then made a Lua string), so
-- an event passes only its entry id, a usually empty string of exceptions and its own fields;
-- what is the same for a whole group (its stream, the route, the defaults) is passed once.
--
-- KEYS[1]     the route's bucket (hash: tat = plan, dtat = gate, last = last dispatch; µs)
-- KEYS[2]     the route's ready stream
-- KEYS[3..]   h decision hashes (field: input entry id; value: its decision, lib.lua's codec),
--             then s input streams whose entries this call may acknowledge (in its slot),
--             then c id claims (string: the entry that owns an event id)
-- ARGV[1]     interval_us: microseconds one unit of cost occupies
-- ARGV[2]     tolerance_us: (burst - 1) * interval
-- ARGV[3]     decision time to live, ms (also the id claims')
-- ARGV[4]     the ready stream's length (lib.lua trim: about it, never below what a group needs)
-- ARGV[5]     the consumer group of the input streams
-- ARGV[6]     stale_us: an entry this old with no decision on record may have had one expire:
--             it is not decided (STALE)
-- ARGV[7]     max_age_us: an entry older than this when first decided is not placed (EXPIRED);
--             0 for no limit
-- ARGV[8]     the route's name (the ready entries' pacer_route)
-- ARGV[9]     the events' max_wait_us unless an event says otherwise
-- ARGV[10]    the oldest entry's milliseconds: when no entry can be too old, none is looked at
-- ARGV[11..14] h, s, c, n (the number of events)
-- then per decision hash, in KEYS order: its event count, the index of its input stream among
--             the s (0: the worker acknowledges), and that stream's name
-- then per event, grouped by decision hash in that order:
--   entry     its input entry id
--   spec      its field count, alone for an event with the defaults, else "<nfields>,<cost>,
--             <max_wait_us>,<claim index>,<deadline_us>,<since_us>,<expect>" where cost
--             defaults to 1, max_wait_us to ARGV[9], claim (its id claim's index, if it carries
--             an id) to 0, deadline_us (Redis µs by which it must go: a late event passed on to
--             its fallback has only what is left of its first route's wait) to 0 for none,
--             since_us (Redis µs its wait counts from: such an event's first decision, so that
--             its ready entry's pacer_wait_ms holds its wait on the route that gave it up) to 0
--             for now, and expect (a decision on record it may replace) to "" (one argument,
--             not two: each costs Redis its parsing and a Lua string, per event)
--   name1, value1, ...   its own fields, carried to the ready entry
-- Returns { now_us, tat_us, then per event a code and a value, then end_us } (lib.lua's codes),
-- events in the order given; now_us is the route's time the call decided at (Redis's clock, or
-- the route's last dispatch if that is later: see below) and tat_us the plan after the call:
--   DISPATCHED                   dispatched now, in the ready entry of now_us's millisecond
--                                (decision "d<ms>"); the one code with no value: most events
--                                take it, and each value is a conversion to the reply
--   SLEEP, slot_us               slot reserved, to go by now + max_wait + gcra.lua's LATE
--                                ("s<slot>:<deadline>")
--   TOO_LONG, wait_us            would wait longer than max_wait ("x<wait>"); nothing reserved
--   DECIDED, decision            an earlier delivery decided it: that decision stands
--   DUPLICATE, owner             its id belongs to that other entry ("<entry id>@<stream>")
--   EXPIRED, age_us              read older than max_age: not placed, nothing recorded
--   STALE, age_us                older than stale_us with nothing on record: not decided
-- end_us is Redis's clock as the script ends (what workers map their timers with). The ready
-- entry holds pacer_route, pacer_source_stream, pacer_source_id, pacer_slot_us and
-- pacer_wait_ms (0, or the time since the event's since_us), then the event's own fields.

-- Check everything first.
local interval, tol = num(1, 'interval'), num(2, 'tolerance')
local ttl, maxlen, group = num(3, 'ttl'), num(4, 'maxlen'), ARGV[5]
local stale, max_age = num(6, 'stale'), num(7, 'max_age')
local route, default_wait, oldest = ARGV[8], num(9, 'max_wait'), num(10, 'oldest')
local h, s, c, n = num(11, 'h'), num(12, 's'), num(13, 'c'), num(14, 'n')
if #KEYS ~= 2 + h + s + c then
  bad('key count')
end
local at = 15
-- Per event, in flat arrays: its entry id, where its fields start (its spec, then the
-- pairs), and its exceptions if it has any ({ cost, max_wait_us, claim, expect }). Its hash,
-- stream and name are its group's (events come grouped by decision hash: group k's are
-- first[k] .. last[k]). A table per event, or an array per property, would cost more than its
-- use: growing tables and collecting them is a large part of what a call costs Redis.
local ev_entry, ev_fields, ev_extra = {}, {}, {}
local g_stream, g_name, first, last = {}, {}, {}, {}
local counts = {}
for k = 1, h do
  counts[k], g_stream[k], g_name[k] = num(at, 'count'), index(at + 1, s, true, 'stream'), ARGV[at + 2]
  at = at + 3
end
local nargs = #ARGV
local i = 0
for k = 1, h do
  first[k] = i + 1
  for _ = 1, counts[k] do
    i = i + 1
    ev_entry[i] = ARGV[at]
    local spec = ARGV[at + 1]
    if spec == nil then
      bad('events run past the arguments')
    end
    local nf = tonumber(spec)
    if not nf then
      local f, cost, wait, claim, deadline, since, expect =
        string.match(spec, '^(%d+),(%d+),(%d+),(%d+),(%d+),(%d+),(.*)$')
      nf, cost, wait, claim, deadline, since = tonumber(f), tonumber(cost), tonumber(wait),
        tonumber(claim), tonumber(deadline), tonumber(since)
      if not (nf and cost and wait and claim and deadline and since) or cost < 1 or claim > c then
        bad('spec ' .. spec)
      end
      ev_extra[i] = { cost, wait, claim, expect, deadline, since }
    end
    -- lib.lua fields_end, inlined: this loop runs once per event, and a call per event is
    -- a measurable part of what the script costs.
    if nf < 0 or nf > MAX_FIELDS or nf % 1 ~= 0 then
      bad('field count ' .. spec)
    end
    ev_fields[i] = at + 1
    at = at + 2 + 2 * nf
    if at - 1 > nargs then
      bad('fields run past the arguments')
    end
  end
  last[k] = i
end
if i ~= n or at - 1 ~= nargs then
  bad('argument count')
end
local args_end = at + 1 -- as ev_fields would be for an event after the last

-- Then read: the bucket, the ready stream's newest entry, the decisions on record, the id
-- claims (reading also checks every key's type, so nothing fails once writing starts).
local now, tat, dtat, last_us, decided, gone = read_route(h, s, group, ev_entry, first, last)
local claimed = {}
for k = 1, c do
  claimed[k] = redis.call('GET', KEYS[2 + h + s + k])
end

-- Decide, in order; the plan and gate move as each event takes its share.
local out, o = { 0, 0 }, 2
local held, records = decided.held, decided.changed
local changed = false
local wrote = false
local acks, acked = lists(s), {} -- per input stream index: entry ids, and their count
for k = 1, s do
  acked[k] = 0
end
local claims = {} -- id claims to write: key index -> owner
-- Pacer's time on this route never goes back: ready ids must increase, and a Redis clock
-- stepped back leaves `last` ahead until it catches up.
local t, tq = dispatch_clock(now, last_us)
out[1] = t
-- The ready entries' id and what they record, made once for the call (a Lua string is hashed
-- when it is made, and a call may dispatch a thousand events).
local xadd_id = int(tq / 1000) .. '-*'
local dispatched = decision('d', tq / 1000)
local t_text = int(t)
-- Writes event i's ready entry, dispatched now: its slot is now (a slot ahead sleeps), and
-- it waited `waited` ms (text). Its fields end where the next event's begin (entry, spec), the
-- last's at the arguments' end: no second reading of the count.
local function write_ready(i, name, entry, waited)
  redis.call('XADD', KEYS[2], xadd_id, 'pacer_route', route, 'pacer_source_stream', name,
    'pacer_source_id', entry, 'pacer_slot_us', t_text, 'pacer_wait_ms', waited,
    unpack(ARGV, ev_fields[i] + 1, (ev_fields[i + 1] or args_end) - 2))
end
-- Whether any entry of the call could be too old (the worker passes the oldest).
local aged = t - oldest * 1000 > math.min(stale, max_age > 0 and max_age or stale)
-- Whether the usual path may take plain events (a negative wait, refused by the workers,
-- would make it decide otherwise than the general path).
local usual = not aged and default_wait >= 0
for k = 1, h do
  local stream, name, seen, record = g_stream[k], g_name[k], held[k], records[k]
  local nrec = #record
  for i = first[k], last[k] do
    local entry, x = ev_entry[i], ev_extra[i]
    -- The usual event first: no exceptions, nothing on record, not too old, one unit, and
    -- the plan and the gate both open now. This is plan, fits and gate below (gcra.lua) for
    -- one unit with their calls inlined; anything else takes the general path, which decides
    -- these alike. The path most events take, so each step here costs Redis per event.
    local base = tat > dtat and tat or dtat
    if usual and not x and not seen[entry] and base - tol <= t and tq >= dtat - tol then
      write_ready(i, name, entry, '0')
      tat = (base > t and base or t) + interval
      dtat = (dtat > tq - 1000 and dtat or tq - 1000) + interval
      last_us, changed, wrote = t, true, true
      if stream > 0 then
        acked[stream] = acked[stream] + 1
        acks[stream][acked[stream]] = entry
      end
      seen[entry] = dispatched
      record[nrec + 1], record[nrec + 2] = entry, dispatched
      nrec = nrec + 2
      o = o + 1
      out[o] = DISPATCHED
    else
      local code, value
      local cost, wait, claim, expect = 1, default_wait, 0, ''
      if x then
        cost, wait, claim, expect = x[1], x[2], x[3], x[4]
        if x[5] > 0 then
          -- What is left of the wait it was first given: none left, and nothing takes it.
          wait = math.min(wait, x[5] - t)
        end
      end
      -- What is on record, or what an earlier copy of this entry in the call made of it.
      local had = seen[entry]
      local age = 0
      if aged and expect == '' then
        age = t - tonumber(string.match(entry, '^%d+') or 0) * 1000
      end
      if had and had ~= expect then
        code, value = DECIDED, had
        if decision_kind(had) == 'd' and stream > 0 then
          -- Dispatched by an earlier delivery that never got to acknowledge it.
          acked[stream] = acked[stream] + 1
          acks[stream][acked[stream]] = entry
        end
      elseif claim > 0 and claimed[claim] and claimed[claim] ~= entry .. '@' .. name then
        code, value = DUPLICATE, claimed[claim]
      elseif age > stale then
        code, value = STALE, age
      elseif max_age > 0 and age > max_age then
        code, value = EXPIRED, age
      elseif not fits(cost, interval, tol) then
        -- More units than the burst: it could never pass (the worker refuses such events first).
        code, value = TOO_LONG, 2 ^ 53
      else
        local slot, next_tat = plan(math.max(tat, dtat), t, cost, interval, tol)
        -- A slot ahead is slept until the first millisecond it can be written in; the wait is
        -- judged on that, so the recorded slot is never past the deadline.
        if slot > t then
          slot = ceil_ms(slot)
        end
        if slot - t > wait then
          code, value = TOO_LONG, slot - t
        elseif slot <= t then
          local ok, g = gate(dtat, tq, cost, interval, tol)
          if ok then
            code = DISPATCHED
            local since = x and x[6] or 0
            write_ready(i, name, entry,
              since > 0 and int(math.floor(math.max(0, t - since) / 1000)) or '0')
            dtat, last_us, tat, changed, wrote = g, t, next_tat, true, true
            if stream > 0 then
              acked[stream] = acked[stream] + 1
              acks[stream][acked[stream]] = entry
            end
          elseif g - t <= wait then
            -- An earlier slot went out late: this one waits until the gate lets it through.
            code, value = SLEEP, g
            tat, changed = math.max(next_tat, g + cost * interval), true
          else
            code, value = TOO_LONG, g - t
          end
        else
          code, value = SLEEP, slot
          tat, changed = next_tat, true
        end
        local made
        if code == DISPATCHED then
          made = dispatched
        elseif code == SLEEP then
          -- It must go by its wait, give or take the small lateness tolerance (gcra.lua LATE).
          made = decision('s', value, t + wait + LATE)
        else
          made = decision('x', value)
        end
        -- As decided.set(k, entry, made), without a call per event.
        seen[entry] = made
        record[nrec + 1], record[nrec + 2] = entry, made
        nrec = nrec + 2
        if claim > 0 and not claimed[claim] then
          -- Taken now: a later event of this call with the same id is its duplicate.
          local owner = entry .. '@' .. name
          claims[claim] = owner
          claimed[claim] = owner
        end
      end
      if code == DISPATCHED then
        o = o + 1
        out[o] = code
      else
        out[o + 1], out[o + 2] = code, value
        o = o + 2
      end
    end
  end
end

-- Record: the decisions (after the ready entries they speak of), the claims, the bucket, then
-- the acknowledgements.
decided.save(ttl)
for k, owner in pairs(claims) do
  redis.call('SET', KEYS[2 + h + s + k], owner, 'PX', ttl)
end
out[2] = tat
save_route(1, now, tat, dtat, last_us, changed, wrote, maxlen)
ack_all(3 + h, group, acks, gone)
out[o + 1] = redis_now_us()
return out
