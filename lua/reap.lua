-- reap.lua: delete the consumers of a group that hold no pending entry and have not read for a
-- long time (workers that exited: each run of pacer joins under a new name). Done in a script
-- so that a consumer cannot read an entry between the check and the delete: deleting a
-- consumer drops its pending entries with it, which would lose them.
--
-- KEYS[1]     the input stream
-- ARGV[1]     the consumer group
-- ARGV[2]     least idle time of a consumer to delete, ms
-- ARGV[3]     the calling consumer's name (never deleted)
-- Returns the number of consumers deleted.

local consumers = redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])
local min_idle = tonumber(ARGV[2])
local deleted = 0
for _, c in ipairs(consumers) do
  local f = {}
  for i = 1, #c, 2 do
    f[c[i]] = c[i + 1]
  end
  if f['pending'] == 0 and f['idle'] >= min_idle and f['name'] ~= ARGV[3] then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], f['name'])
    deleted = deleted + 1
  end
end
return deleted
