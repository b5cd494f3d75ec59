-- bucket_probe.lua (tests only): runs bucket.lua's functions on given inputs, so that
-- tests/bucket_differential.rs can hold them to src/pacing.rs. Prepended with bucket.lua.
--
-- KEYS        none
-- ARGV[1]     interval_us
-- ARGV[2]     tolerance_us
-- ARGV[3..]   operations of four values each: name, a, b, c
--               'plan'  tat, now, cost   ->  slot, next tat
--               'gate'  dtat, t, cost    ->  1 and next dtat, or 0 and the earliest time
--               'clock' now, last, -     ->  t, the time the gate judges by
-- Returns the two results of each operation, in order, as one flat array.

local interval, tol = tonumber(ARGV[1]), tonumber(ARGV[2])
local out = {}
for i = 3, #ARGV, 4 do
  local op, a, b, c = ARGV[i], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2]), tonumber(ARGV[i + 3])
  local x, y
  if op == 'plan' then
    x, y = plan(a, b, c, interval, tol)
  elseif op == 'gate' then
    local ok
    ok, y = gate(a, b, c, interval, tol)
    x = ok and 1 or 0
  else
    x, y = dispatch_clock(a, b)
  end
  out[#out + 1] = x
  out[#out + 1] = y
end
return out
