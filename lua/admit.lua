-- admit.lua: decide a batch of inbound events against their rules' limits, record each decision
-- and forward the accepted events (when the forward stream shares the call's slot), and write
-- the rejected ones (when the rejected stream does), all in one step. The same algorithms as src/admission/*.rs,
-- held to the same answers by tests/admit_differential.rs (which replays each call's now_us).
-- Every key is in one slot: the forward stream's, or the inbound partition's (src/keys.rs,
-- InboundKeys).
--
-- KEYS[1..w]   the streams this call writes, as ARGV[3] says: the forward stream (bit 1), then
--              the rejected stream (bit 2); each shares the call's slot (one whose key holds
--              another kind of value is not written: its events come back "a" or "r…")
-- KEYS[w+1..]  s input streams whose entries this call may acknowledge (in its slot); then
--              per event, in order: the hash its decision is recorded in (field: its owner),
--              then its identities' limiter keys, one per check: every key field of every
--              rule, rule by rule, in the order the rules list them
-- ARGV[1]      decision time to live, ms (each decision hash lives that long after a write)
-- ARGV[2]      the forward and rejected streams' length: each is trimmed to about it once per
--              call that wrote it, never below what a consumer group on it needs (lib.lua trim)
-- ARGV[3]      the outputs written here, bits: 1 the accepted events (to the forward stream),
--              2 the rejected ones; the caller writes the others
-- ARGV[4]      the consumer group of the input streams
-- ARGV[5]      s, the number of input streams to acknowledge in
-- ARGV[6]      stale_us: an entry this old with no decision on record may have had one expire:
--              it is not decided (STALE)
-- ARGV[7]      the oldest entry's milliseconds: when no entry can be too old, none is looked at
-- ARGV[8]      the rules' digest (of ARGV[10..] as they are when the rules follow)
-- ARGV[9]      1: the rules follow; 0: they do not (a Redis Function's library may keep them,
--              admission.lua's rules_by_digest, as decide.lua's does)
-- ARGV[10]     if they follow: entries per read: a sliding log whose cap is more than this many
--              entries per command that reading it by entry takes is read by entry, else whole
--              (see `log`)
-- ARGV[11..]   if they follow: the rules (admission.lua's read_rules)
-- then         n, the number of events; then per event:
--                owner ("<entry id>@<stream>": its field in the decision hash),
--                its input stream's index among the s (0: the worker acknowledges it),
--                then the forward entry's fields: nfields, name1, value1, ...
-- Returns { now_us, then per event: code, decision, verdicts } (the codes are lib.lua's):
--   ADMITTED decided now: decision "A" (accepted, and written to the forward stream), "a" (the
--            same, for the caller to write), or
--            "r<retry_us>|<rule>|<limit>|<key field>" (rejected: the enforcing check that frees up
--            last), "R…" the same when it was also written to the rejected stream; verdicts holds one character per rule, '1' passed, '0' over its limits
--            (shadow rules included: their '0's are the would-be rejections)
--   DECIDED  an earlier delivery decided it: decision is what it recorded, verdicts ''
--   STALE    older than stale_us with no decision on record: decision is its age (µs),
--            nothing charged or recorded, verdicts ''
-- or, when the rules did not follow and are not kept here, the status reply RESEND: call again
-- with them (nothing was written).
-- Entries whose output this call wrote (or an earlier delivery wrote, "A" and "R…") are
-- acknowledged here where their stream is in reach. Nothing is written until every argument is
-- checked, and outputs are written before the decisions that record them.
--
-- Checking comes before charging: every limit of every identity of every rule is checked, and
-- only then is anything charged, so a rejected event uses up nothing (a rule with count_rejected
-- charges every attempt). Redis's clock, read once, is the time of every event of the batch.
--
-- The inbound flow's speed rests on this script, and its cost is mostly per command and per
-- value, so it spends few of either per event: the decisions of a batch are read (HMGET) and
-- written (HSET) a hash at a time, the states of its identities read in one MGET and each
-- written once, with numbers packed in binary (struct) rather than printed and parsed; the
-- checks are implied by the rules instead of spelled out per event; an accepted event's fields
-- go from ARGV to XADD without a copy; and an event an earlier delivery decided is not checked.

start_call()
local ttl, maxlen = num(1, 'ttl'), num(2, 'maxlen')
-- Writing an output here, in the step that decides it, makes it atomic with its record: no
-- write-once marker and no second call, which a stream in another slot needs.
local here = num(3, 'outputs')
if here < 0 or here > 3 or here % 1 ~= 0 then
  bad('outputs (ARGV[3])')
end
local stream_at = 1
local forward, rejected = false, false
if here % 2 == 1 then
  forward, stream_at = KEYS[stream_at], stream_at + 1
end
if math.floor(here / 2) % 2 == 1 then
  rejected, stream_at = KEYS[stream_at], stream_at + 1
end
local group, nstreams = ARGV[4], num(5, 'streams')
local stale, oldest = num(6, 'stale'), num(7, 'oldest')
local rules, nrules, at = rules_by_digest(8)
if not rules then
  return redis.status_reply('RESEND')
end

-- The checks every event makes, in order: (rule index, key field) for each key of each rule.
local check_rule, check_field = {}, {}
for r, rule in ipairs(rules) do
  for _, field in ipairs(rule.fields) do
    check_rule[#check_rule + 1] = r
    check_field[#check_field + 1] = field
  end
end
local nchecks = #check_rule


-- Runs `cmd` (on `key`, if not nil) with `args` appended, at most 1000 at a time (unpack has a
-- stack limit that a big batch's argument list could pass); returns the replies, concatenated.
local function chunked(cmd, key, args)
  local out = {}
  for from = 1, #args, 1000 do
    local part = { cmd }
    if key then
      part[2] = key
    end
    for j = from, math.min(from + 999, #args) do
      part[#part + 1] = args[j]
    end
    local r = redis.call(unpack(part))
    if type(r) == 'table' then
      for _, v in ipairs(r) do
        out[#out + 1] = v
      end
    end
  end
  return out
end

-- The events: owner, decision hash and where its fields start, in flat arrays (a table per
-- event would cost more than its use); event i's check x uses KEYS[key_at[i] + x].
local n = num(at, 'events')
at = at + 1
local owner, hash, key_at, fields_at, ack_in = {}, {}, {}, {}, {}
local hashes, in_hash = {}, {}
local k = stream_at + nstreams
for i = 1, n do
  owner[i] = ARGV[at]
  ack_in[i] = index(at + 1, nstreams, true, 'stream')
  fields_at[i] = at + 2
  at = fields_end(at + 2)
  local h = KEYS[k]
  hash[i], key_at[i] = h, k
  k = k + 1 + nchecks
  local members = in_hash[h]
  if not members then
    members = {}
    in_hash[h] = members
    hashes[#hashes + 1] = h
  end
  members[#members + 1] = i
end
if at - 1 ~= #ARGV then
  bad('argument count')
end
if k - 1 ~= #KEYS then
  bad('key count')
end
-- Check the streams this call writes or acknowledges before anything is written: a group gone
-- fails the call here rather than halfway. (Reads only: after a script's first write Redis lets
-- it write past maxmemory.) An output whose key holds another kind of value is left to the
-- caller, as one in another slot is: its events are decided and recorded all the same ("a",
-- "r…"), and the worker holds them until the key is fixed. Failing the call instead would turn
-- one broken output into fail_policy deciding every event (fail_open forwarding them unchecked).
if forward and wrong_kind(redis.pcall('XLEN', forward)) then
  forward = false
end
if rejected and wrong_kind(redis.pcall('XLEN', rejected)) then
  rejected = false
end
local gone = check_groups(stream_at, nstreams, group)

-- Decisions earlier deliveries recorded: those stand, and nothing is charged for them. Read on
-- every call, not only for redeliveries: a call that timed out on the client may still run
-- after a retry or a fail_policy decision, and must then find the decision made.
-- Kept by hash and owner, and updated as this call decides: an entry that comes twice in one
-- call (a worker holding two deliveries of it) finds what its first copy decided.
local prev, on_record = {}, {}
for _, h in ipairs(hashes) do
  local fields = {}
  for j, i in ipairs(in_hash[h]) do
    fields[j] = owner[i]
  end
  local got = chunked('HMGET', h, fields)
  on_record[h] = {}
  for j, i in ipairs(in_hash[h]) do
    prev[i] = got[j]
    on_record[h][owner[i]] = got[j] or nil
  end
end

-- Entries older than stale_us with no decision on record may have had one expire: not decided
-- (the worker dead-letters them as expired). Looked at only when the oldest could be that old.
local stale_age = {}
if now - oldest * 1000 > stale then
  for i = 1, n do
    if not prev[i] then
      local age = now - tonumber(string.match(owner[i], '^%d+') or 0) * 1000
      if age > stale then
        stale_age[i] = age
      end
    end
  end
end

-- Entries to acknowledge here, per input stream: those whose output this call writes, or an
-- earlier delivery wrote ("A", "R…").
local acks = lists(nstreams)
local function ack(i)
  local s = ack_in[i]
  if s > 0 then
    local list = acks[s]
    list[#list + 1] = string.match(owner[i], '^[^@]+')
  end
end

-- Each identity's state is read once per call and written once at its end (states.lua).
for i = 1, n do
  if not prev[i] and not stale_age[i] then
    for x = 1, nchecks do
      want_state(KEYS[key_at[i] + x], rules[check_rule[x]])
    end
  end
end
read_states()

local out, o = { now }, 1
local wrote_forward, wrote_rejected = false, false
-- A forwarded entry's id carries the decision's millisecond (`now`), not the moment its XADD ran,
-- as a ready entry carries its slot's: so counted by entry id, the forward stream holds an
-- identity's limits as the rules do. A call that Redis's process was kept from running (a
-- loaded host) wrote its entries milliseconds after it decided them, and the ids of two calls
-- about a window apart could then look closer. Should the stream's newest entry be past `now`
-- (the clock stepped back), XADD refuses the id, and the call goes on with Redis's own ids.
local forward_id = int(math.floor(now / 1000)) .. '-*'
local record, recorded = {}, {}
local passed = {}
-- Per check of the event at hand: what it said before anything was charged.
local first_retry, first_lim = {}, {}
local all_passed = string.rep('1', nrules)
for i = 1, n do
  local earlier = on_record[hash[i]][owner[i]]
  if earlier then
    out[o + 1], out[o + 2], out[o + 3] = DECIDED, earlier, ''
    o = o + 3
    local kind = string.sub(earlier, 1, 1)
    if kind == 'A' or kind == 'R' then
      ack(i)
    end
  elseif stale_age[i] then
    out[o + 1], out[o + 2], out[o + 3] = STALE, stale_age[i], ''
    o = o + 3
  else
    -- Check everything first.
    local base = key_at[i]
    local best, best_lim, binding = 0, 0, nil
    local failed = false
    for x = 1, nchecks do
      local r = check_rule[x]
      local rule = rules[r]
      local st = state_of(KEYS[base + x], rule)
      local retry, lim = st.alg.check(st, rule, 1)
      first_retry[x], first_lim[x] = retry, lim
      if retry > 0 then
        if not failed then
          failed = true
          for q = 1, nrules do
            passed[q] = '1'
          end
        end
        passed[r] = '0'
        if not rule.shadow and retry > best then
          best, best_lim, binding = retry, lim, x
        end
      end
    end
    local accepted = binding == nil
    -- Then charge.
    for x = 1, nchecks do
      local r = check_rule[x]
      local rule = rules[r]
      local ok = accepted and (not failed or passed[r] == '1')
      if ok or rule.count_rejected then
        local st = states[KEYS[base + x]]
        st.alg.charge(st, rule, ok, 1)
      end
    end
    if not accepted then
      -- retry_after as the charges left it (admission.lua `rebind`).
      local again, again_lim, again_x = rebind(1, nchecks, first_retry, first_lim, function(x)
        return rules[check_rule[x]], states[KEYS[base + x]], 1
      end)
      if again_x then
        best, best_lim, binding = again, again_lim, again_x
      end
    end
    local decision = forward and 'A' or 'a'
    if not accepted then
      local rule = rules[check_rule[binding]]
      local label = (best_lim == 0 and rule.spacing_label) or rule.limits[best_lim].label
      local field = check_field[binding]
      local tail = int(best) .. '|' .. rule.name .. '|' .. label .. '|' .. field
      if rejected then
        -- The fields of src/event/inbound.rs's rejected_fields, in its order: the reasons,
        -- then the forward entry's (the carried fields and where the entry came from).
        local f = fields_at[i]
        redis.call('XADD', rejected, '*', 'pacer_reason', 'rate_limited',
          'pacer_rule', rule.name, 'pacer_limit', label, 'pacer_key', field,
          'pacer_retry_after_ms', int(math.ceil(best / 1000)), unpack(ARGV, f + 1, fields_end(f) - 1))
        decision = 'R' .. tail
        wrote_rejected = true
        ack(i)
      else
        decision = 'r' .. tail
      end
    end
    if accepted and forward then
      local f = fields_at[i]
      if type(redis.pcall('XADD', forward, forward_id, unpack(ARGV, f + 1, fields_end(f) - 1)))
          == 'table' then
        forward_id = '*'
        redis.call('XADD', forward, '*', unpack(ARGV, f + 1, fields_end(f) - 1))
      end
      wrote_forward = true
      ack(i)
    end
    local h = hash[i]
    local rec, m = record[h], recorded[h]
    if not rec then
      rec, m = {}, 0
      record[h] = rec
    end
    rec[m + 1], rec[m + 2] = owner[i], decision
    recorded[h] = m + 2
    on_record[h][owner[i]] = decision
    out[o + 1], out[o + 2] = ADMITTED, decision
    out[o + 3] = failed and table.concat(passed, '', 1, nrules) or all_passed
    o = o + 3
  end
end

-- One trim per stream written, not a MAXLEN on every XADD (each is more arguments to convert).
if wrote_forward then
  trim(forward, maxlen)
end
if wrote_rejected then
  trim(rejected, maxlen)
end
save_states()
for _, h in ipairs(hashes) do
  if record[h] then
    hset(h, record[h], ttl)
  end
end
ack_all(stream_at, group, acks, gone)
return out
