-- The store's record format version (docs/operations.md, "Upgrade").
-- KEYS[1]: the format key; ARGV[1]: this binary's version. Answers the
-- record as it was (nil: none), for the caller to read as a version, and
-- records ARGV[1] when there was none or an older version; a record that is
-- not a version is left as it is.
local found = redis.call('GET', KEYS[1])
if not found then
  redis.call('SET', KEYS[1], ARGV[1])
  return false
end
local n = tonumber(string.match(found, '^%s*(%d+)%s*$'))
if n and n >= 1 and n < tonumber(ARGV[1]) then
  redis.call('SET', KEYS[1], ARGV[1])
end
return found
