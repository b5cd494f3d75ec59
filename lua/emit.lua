-- emit.lua: write input entries to a shared output stream (rejected or dead letters) exactly
-- once, however often the entries are delivered, and acknowledge them where this call may.
-- Nothing is written until every argument is checked; the output entries come before the
-- records that say they were written.
--
-- KEYS[1]     the output stream
-- KEYS[2..]   h write-once hashes in the output stream's slot (field: input entry id), then s
--             input streams this call may acknowledge (in its slot)
-- ARGV[1]     record time to live, ms
-- ARGV[2]     the output stream's length (lib.lua trim: about it, never below what a group needs)
-- ARGV[3]     the consumer group of the input streams
-- ARGV[4..6]  h, s, n (the number of entries); then per entry:
--               hash      index of its write-once hash (1..h)
--               stream    index of its input stream among the s (0: the worker acknowledges)
--               entry     its input entry id
--               nfields, name1, value1, ...   the output entry's fields
-- Returns { code1, code2, ... }: 1 written now, 0 written by an earlier delivery (not again).

local ttl, maxlen, group = num(1, 'ttl'), num(2, 'maxlen'), ARGV[3]
local h, s, n = num(4, 'h'), num(5, 's'), num(6, 'n')
if #KEYS ~= 1 + h + s then
  bad('key count')
end
local ev = {}
local ev_hash, ev_entry = {}, {}
local at = 7
for i = 1, n do
  local e = {
    hash = index(at, h, false, 'hash'), stream = index(at + 1, s, true, 'stream'),
    entry = ARGV[at + 2], fields = at + 3,
  }
  e.stop = fields_end(e.fields)
  if e.stop - e.fields < 3 then
    bad('an output entry needs a field')
  end
  ev[i] = e
  ev_hash[i], ev_entry[i] = e.hash, e.entry
  at = e.stop
end
if at - 1 ~= #ARGV then
  bad('argument count')
end

-- The output stream must be a stream (a read, so a wrong type fails before any write).
redis.call('XLEN', KEYS[1])
local gone = check_groups(2 + h, s, group)
-- What was written before, or (an entry that comes twice in one call, from a worker holding two
-- deliveries of it) by this call.
local written = records(2, h, ev_hash, ev_entry)

local out, acks = {}, lists(s)
local wrote = false
for i = 1, n do
  local e = ev[i]
  if written.get(e.hash, e.entry) then
    out[i] = 0
  else
    redis.call('XADD', KEYS[1], '*', unpack(ARGV, e.fields + 1, e.stop - 1))
    wrote = true
    written.set(e.hash, e.entry, '1')
    out[i] = 1
  end
  if e.stream > 0 then
    local list = acks[e.stream]
    list[#list + 1] = e.entry
  end
end
written.save(ttl)
if wrote then
  trim(KEYS[1], maxlen)
end
ack_all(2 + h, group, acks, gone)
return out
