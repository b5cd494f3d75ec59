-- bucket_probe.lua (tests only): runs gcra.lua's functions on given inputs, so that
-- tests/bucket_differential.rs can hold them to src/pacing.rs. Prepended with lib.lua and
-- gcra.lua.
--
-- KEYS        none
-- ARGV[1]     interval_us
-- ARGV[2]     tolerance_us
-- ARGV[3..]   operations of six values each: name, a, b, c, d, e
--               'plan'  tat, now, cost, -, -              ->  slot, next tat
--               'gate'  dtat, t, cost, -, -               ->  1 and next dtat, or 0 and the earliest time
--               'clock' now, last, -, -, -                ->  t, the time the gate judges by
--               'fits'  cost, -, -, -, -                  ->  1 or 0, and 0
--               'judge' dtat, now, slot, deadline, cost   ->  verdict (1 pass, 2 wait, 3 replan,
--                                                            4 late), at, next dtat, next tat
--                                                            (four values)
--               'tat'   tat, -, -, -, -                   ->  nothing; sets the plan the next
--                                                            'judge' operations start from
-- Returns the results of each operation, in order, as one flat array.

local interval, tol = tonumber(ARGV[1]), tonumber(ARGV[2])
local verdicts = { pass = 1, wait = 2, replan = 3, late = 4 }
local out = {}
local tat = 0
for i = 3, #ARGV, 6 do
  local op = ARGV[i]
  local a, b, c = tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2]), tonumber(ARGV[i + 3])
  local d, e = tonumber(ARGV[i + 4]), tonumber(ARGV[i + 5])
  if op == 'plan' then
    out[#out + 1], out[#out + 2] = plan(a, b, c, interval, tol)
  elseif op == 'gate' then
    local ok, y = gate(a, b, c, interval, tol)
    out[#out + 1], out[#out + 2] = ok and 1 or 0, y
  elseif op == 'clock' then
    out[#out + 1], out[#out + 2] = dispatch_clock(a, b)
  elseif op == 'fits' then
    out[#out + 1], out[#out + 2] = fits(a, interval, tol) and 1 or 0, 0
  elseif op == 'tat' then
    tat = a
  else
    local t, tq = dispatch_clock(b, 0)
    local verdict, at, dtat, next_tat = judge(a, tat, t, tq, c, d, e, interval, tol)
    out[#out + 1], out[#out + 2], out[#out + 3] = verdicts[verdict], at, dtat
    out[#out + 1] = next_tat
  end
end
return out
