-- lib.lua: the helpers every script shares, prepended to each one when pacer is built
-- (src/scripts.rs joins the files). Nothing here decides anything: checking arguments, reading
-- them, numbers as text, Redis's clock, the reply codes and the decision codec.
--
-- Every script follows one rule: everything that can fail (argument counts, numbers, sizes, key
-- types) is checked before the first write, so a script that fails has changed nothing; and
-- each output is written before the record that says it was written.

-- Reply codes, one meaning each in every script that uses them. src/scripts.rs (`reply`) holds
-- the same numbers, and a unit test there reads them from this file.
local DISPATCHED = 1 -- written to the ready stream now
local SLEEP = 2 -- a slot was reserved: sleep until it
local TOO_LONG = 3 -- would wait longer than max_wait: nothing reserved
local DECIDED = 4 -- an earlier delivery decided this entry: its recorded decision stands
local NOT_BEFORE = 5 -- not yet: come back at the time given
local SUPERSEDED = 6 -- the decision this call was to carry out is no longer the recorded one
local ADMITTED = 7 -- an inbound event decided by this call
local DUPLICATE = 8 -- its event id belongs to another entry (the owner given)
local EXPIRED = 9 -- its entry was older than max_age when read: not placed
local STALE = 10 -- its entry is older than dedupe_ttl and no decision is on record: not decided

-- The most fields one event may carry through a script: Lua's unpack stops at about 8,000
-- values, and an XADD of an event passes two per field and a few more (src/event.rs caps
-- events well below, at outbound/inbound.max_event_fields).
local MAX_FIELDS = 3500

-- Fails the call, before anything was written, naming what is wrong.
local function bad(what)
  error('pacer: bad arguments: ' .. what)
end

-- ARGV[i] as a number (a whole one, unless `real`); fails the call if it is not one.
local function num(i, what)
  local v = tonumber(ARGV[i])
  if v == nil or v ~= v then
    bad(what .. ' (ARGV[' .. i .. '])')
  end
  return v
end

-- ARGV[i] as an index into a list of `n` (0 allowed when `zero`).
local function index(i, n, zero, what)
  local v = num(i, what)
  if v ~= math.floor(v) or v > n or v < (zero and 0 or 1) then
    bad(what .. ' out of range (ARGV[' .. i .. '])')
  end
  return v
end

-- Checks the fields of one event at ARGV[at] (their count, then name/value pairs) and returns
-- the index just past them.
local function fields_end(at)
  local n = num(at, 'field count')
  if n < 0 or n > MAX_FIELDS or n ~= math.floor(n) then
    bad('field count ' .. tostring(ARGV[at]))
  end
  local stop = at + 1 + 2 * n
  if stop - 1 > #ARGV then
    bad('fields run past the arguments')
  end
  return stop
end

-- Integers as text. Lua's own number-to-string keeps 14 digits (1.7952982012077e+15), which
-- would corrupt microsecond times in decisions and commands.
local function int(n)
  return string.format('%d', n)
end

-- Redis's own clock: the one clock every decision uses, whatever the workers' clocks say.
local function redis_now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

-- Reads the fields list[from..to] of hash `key` in one HMGET (at most 1000 a time: unpack has
-- a stack limit); returns their values in order (false where absent).
local function hmget(key, list, from, to)
  if to - from < 1000 then
    return redis.call('HMGET', key, unpack(list, from, to))
  end
  local out, o = {}, 0
  for a = from, to, 1000 do
    local part = redis.call('HMGET', key, unpack(list, a, math.min(a + 999, to)))
    for j = 1, #part do
      out[o + j] = part[j]
    end
    o = o + #part
  end
  return out
end

-- A record hash a call writes WIDE_FROM records or more to is filling fast: hset makes it a
-- hash table before it writes them, by writing WIDE (256 bytes, longer than Redis's
-- hash-max-listpack-value: 64 by default) under WIDE_FIELD beside them. A small hash is a
-- listpack, whose every read and write of a field scans what it holds: filled by such calls on
-- its way to 128 fields (where Redis converts it anyway), those scans were a sixth of what
-- schedule.lua cost (`benches/script_cost.rs`, instructions per event: 49,634 before and 40,379
-- after in calls of 128, 61,337 and 49,476 in calls of 26). Written in smaller calls (a route
-- too slow for the scans to count) it stays a listpack: about 40 bytes a record against 98 in
-- a hash table. WIDE_FIELD is not an entry id: no read by id finds it. (WIDE is made at the
-- first use: a Function's library may call nothing as it loads.)
local WIDE_FROM, WIDE_FIELD, WIDE = 16, '~', nil

-- Writes name/value pairs to hash `key` (at most 500 pairs a time) and renews its time to live.
local function hset(key, pairs, ttl)
  for from = 1, #pairs, 1000 do
    local to = math.min(from + 999, #pairs)
    if from == 1 and #pairs >= 2 * WIDE_FROM then
      WIDE = WIDE or string.rep('-', 256)
      redis.call('HSET', key, WIDE_FIELD, WIDE, unpack(pairs, from, to))
    else
      redis.call('HSET', key, unpack(pairs, from, to))
    end
  end
  redis.call('PEXPIRE', key, ttl)
end

-- Acknowledges entry ids of one input stream (at most 1000 a time).
local function xack(stream, group, ids)
  for from = 1, #ids, 1000 do
    redis.call('XACK', stream, group, unpack(ids, from, math.min(from + 999, #ids)))
  end
end

-- Whether stream id a is below stream id b ("<ms>-<seq>", no leading zeros), compared as text:
-- either part may pass 2^53, where Lua's numbers would round.
local function id_below(a, b)
  local am, as = string.match(a, '^(%d+)-(%d+)$')
  local bm, bs = string.match(b, '^(%d+)-(%d+)$')
  if #am ~= #bm then
    return #am < #bm
  elseif am ~= bm then
    return am < bm
  elseif #as ~= #bs then
    return #as < #bs
  end
  return as < bs
end

-- Trims output stream `key` to about `maxlen` entries, but never an entry a consumer group on
-- it still needs: its oldest pending entry and what it has not been delivered yet (the floor
-- examples/trim.lua keeps). Pacer's outputs are others' inputs (a forward stream pacer's own
-- outbound reads, a ready stream the senders read): a plain MAXLEN deleted 786 of 1,000
-- accepted events the outbound group had not read yet. A stream with no group is cut as before.
-- It waits for 1% more than maxlen (100 at least), so that a stream kept near its length costs
-- an XINFO once per hundredth of maxlen written; below that, only an XLEN. While a group a whole
-- maxlen behind holds the stream past that, every call that writes it reads the groups (XINFO,
-- and an XPENDING per group with entries pending): the cost of a consumer that far behind.
-- Reading the groups may fail (an ACL user without XINFO): then nothing is trimmed, since this
-- runs after the call's writes and must not fail it.
local function trim(key, maxlen)
  local len = redis.call('XLEN', key)
  if len <= maxlen + math.max(100, math.floor(maxlen / 100)) then
    return
  end
  local groups = redis.pcall('XINFO', 'GROUPS', key)
  if type(groups) ~= 'table' or groups.err then
    return
  end
  if #groups == 0 then
    redis.call('XTRIM', key, 'MAXLEN', '~', maxlen)
    return
  end
  local floor
  for _, fields in ipairs(groups) do
    local g = {}
    for i = 1, #fields, 2 do
      g[fields[i]] = fields[i + 1]
    end
    -- Kept: its oldest pending entry, or (nothing pending) its last delivered one and after.
    local need = g['last-delivered-id']
    if g['pending'] > 0 then
      local summary = redis.pcall('XPENDING', key, g['name'])
      if type(summary) ~= 'table' or summary.err or not summary[2] then
        return
      end
      need = summary[2]
    end
    if floor == nil or id_below(need, floor) then
      floor = need
    end
  end
  -- At most what is over maxlen, and nothing from the floor on (MINID keeps the floor itself).
  redis.call('XTRIM', key, 'MINID', '~', floor, 'LIMIT', len - maxlen)
end

-- One empty list per index 1..n (per decision hash, per input stream).
local function lists(n)
  local t = {}
  for k = 1, n do
    t[k] = {}
  end
  return t
end

-- Whether a redis.pcall's reply `r` is Redis's WRONGTYPE (the key holds another kind of value);
-- any other error fails the call.
local function wrong_kind(r)
  if type(r) == 'table' and r.err then
    if string.sub(r.err, 1, 9) ~= 'WRONGTYPE' then
      error(r)
    end
    return true
  end
  return false
end

-- Checks that the s input streams KEYS[first..] have the consumer group, before any write: a
-- stream or group gone fails the call here, not after its outputs. (A read: after a script's
-- first write Redis lets it write past maxmemory, so no write may come before the outputs.)
-- Returns the streams (by index 1..s) whose key now holds another kind of value: replaced
-- while their entries were out, they hold nothing to acknowledge any more, and failing would
-- only hold those entries' outputs until someone fixed the key.
local function check_groups(first, s, group)
  local gone = {}
  for k = 1, s do
    if wrong_kind(redis.pcall('XPENDING', KEYS[first + k - 1], group, '-', '+', 1)) then
      gone[k] = true
    end
  end
  return gone
end

-- Acknowledges, per input stream KEYS[first + k - 1], the entry ids in acks[k], but in none of
-- the streams check_groups found `gone`.
local function ack_all(first, group, acks, gone)
  for k = 1, #acks do
    if #acks[k] > 0 and not gone[k] then
      xack(KEYS[first + k - 1], group, acks[k])
    end
  end
end

-- What a call's h record hashes (KEYS[first..]) hold for its entries, read in one HMGET per
-- hash: hash k's are lists[k][from[k] .. to[k]]. `get` sees what this call `set` since, so an
-- entry that comes twice in one call (a worker holding two deliveries of it) finds what the
-- first copy decided, and `save` writes what changed, once, after the outputs it speaks of.
-- `held` (per hash: entry -> value) and `changed` (per hash: entry, value, entry, value...) are
-- what `get` reads and `set` writes, for loops that read and write them without a call.
local function records_of(first, h, lists, from, to)
  local held, changed = {}, {}
  for k = 1, h do
    local seen, list = {}, lists[k]
    held[k], changed[k] = seen, {}
    if to[k] >= from[k] then
      local values = hmget(KEYS[first + k - 1], list, from[k], to[k])
      for j = from[k], to[k] do
        local v = values[j - from[k] + 1]
        if v then
          seen[list[j]] = v
        end
      end
    end
  end
  return {
    held = held,
    changed = changed,
    get = function(k, entry)
      return held[k][entry]
    end,
    set = function(k, entry, value)
      held[k][entry] = value
      local c = changed[k]
      c[#c + 1], c[#c + 2] = entry, value
    end,
    save = function(ttl)
      for k = 1, h do
        if #changed[k] > 0 then
          hset(KEYS[first + k - 1], changed[k], ttl)
        end
      end
    end,
  }
end

-- The same, for entries[i] in hash hashes[i].
local function records(first, h, hashes, entries)
  local per, from, to = lists(h), {}, {}
  for i = 1, #entries do
    local list = per[hashes[i]]
    list[#list + 1] = entries[i]
  end
  for k = 1, h do
    from[k], to[k] = 1, #per[k]
  end
  return records_of(first, h, per, from, to)
end

-- Decisions, as recorded per input entry: "<kind><number>" or "s<slot>:<deadline>", the same
-- codec as src/marker.rs. Kinds: s (slot reserved, µs, and the deadline it must go by), d
-- (dispatched, the ready entry's ms), x (passed over, the wait it would have had, µs), v
-- (voided: the entry was delivered too often).
local function decision(kind, n, deadline)
  if deadline then
    return kind .. int(n) .. ':' .. int(deadline)
  end
  return kind .. int(n)
end

local function decision_kind(value)
  return string.sub(value, 1, 1)
end
