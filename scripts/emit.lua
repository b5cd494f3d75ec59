-- emit.lua: write input entries to a shared output stream (rejected or dead letters) exactly
-- once, however often the entries are delivered.
--
-- KEYS[1]     the output stream
-- KEYS[1+i]   the write-once marker of entry i, in the output stream's hash slot
-- ARGV[1]     marker time to live, ms
-- ARGV[2]     approximate MAXLEN of the output stream
-- ARGV[3]     n, the number of entries; then for each: nfields, name1, value1, ...
-- Returns { code1, code2, ... }: 1 written now, 0 written by an earlier delivery (not again)

local ttl, maxlen, n = ARGV[1], ARGV[2], tonumber(ARGV[3])
local out = {}
local at = 4
for i = 1, n do
  if redis.call('SET', KEYS[1 + i], '1', 'NX', 'PX', ttl) then
    xadd(KEYS[1], maxlen, '*', at, {})
    out[i] = 1
  else
    out[i] = 0
  end
  at = fields_end(at)
end
return out
