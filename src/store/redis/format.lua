-- The store's record format version (docs/operations.md, "Upgrade").
-- KEYS[1]: the format key; ARGV[1]: this binary's version. Answers the
-- version recorded before (0: none) and records ARGV[1] when there was none
-- or an older one; a record that is not a whole number from 1 is left as it
-- is and answered as an error.
local found = redis.call('GET', KEYS[1])
if not found then
  redis.call('SET', KEYS[1], ARGV[1])
  return 0
end
local n = tonumber(found)
if n == nil or n < 1 or n ~= math.floor(n) or string.find(found, '^%s*%d+%s*$') == nil then
  return redis.error_reply('the format record ' .. KEYS[1] .. ' holds ' .. string.format('%q', string.sub(found, 1, 32)) .. ', not a cronlease format version: claiming nothing; remove it if no cronlease wrote it (docs/operations.md, "Upgrade")')
end
if n < tonumber(ARGV[1]) then
  redis.call('SET', KEYS[1], ARGV[1])
end
return n
