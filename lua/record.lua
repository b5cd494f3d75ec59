-- record.lua: record one decision for inbound entries that have none on record yet (the
-- fail policy's, when admission cannot be asked; or a poison entry's void), and say what
-- stands for each, in one step. A script rather than MULTI/EXEC: the ACL user the README gives
-- may run scripts and not MULTI, and with it this step failed for good (found by review: a
-- partition's entries stayed pending after its master failed over).
--
-- KEYS[1..n]  per entry, the hash its decision is recorded in (all in the partition's slot,
--             src/keys.rs InboundKeys::decisions)
-- ARGV[1]     decision time to live, ms (each hash written lives that long after the call)
-- ARGV[2]     the decision to record where none is
-- ARGV[2+i]   entry i's owner ("<entry id>@<stream>", its field in KEYS[i])
-- Returns per entry the decision that stands after the call: ARGV[2] where none was recorded,
-- else the one an earlier step recorded.

if #ARGV ~= #KEYS + 2 then
  bad('one owner per key')
end
local ttl = num(1, 'ttl')
local value = ARGV[2]
local stands = {}
local renewed = nil
for i = 1, #KEYS do
  local hash, owner = KEYS[i], ARGV[2 + i]
  redis.call('HSETNX', hash, owner, value)
  stands[i] = redis.call('HGET', hash, owner)
  -- Entries of one span share a hash, and come in order: each hash renewed once.
  if hash ~= renewed then
    redis.call('PEXPIRE', hash, ttl)
    renewed = hash
  end
end
return stands
