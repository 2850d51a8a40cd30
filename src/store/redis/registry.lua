-- The node registry in one hash: owner -> "LAST_SEEN EXPIRES_AT JSON", the
-- instants in ms on the server's clock. A record is live while EXPIRES_AT
-- is ahead of TIME; a heartbeat deletes records dead for FORGET ms.
-- KEYS[1] the hash. ARGV: 'beat' | 'list' | 'leave', owner, ttl ms,
-- record JSON, FORGET ms.
-- Reply: {now, owner, last_seen, expires_at, json, owner, ...} for the
-- live records ({} for 'leave').
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local op = ARGV[1]
if op == 'leave' then
  redis.call('HDEL', KEYS[1], ARGV[2])
  return {}
end
if op == 'beat' then
  local ends = now + tonumber(ARGV[3])
  redis.call('HSET', KEYS[1], ARGV[2], string.format('%d %d %s', now, ends, ARGV[4]))
end
local all = redis.call('HGETALL', KEYS[1])
local out = {string.format('%d', now)}
for i = 1, #all, 2 do
  local seen, ends, data = string.match(all[i + 1], '^(%d+) (%d+) (.*)$')
  local e = tonumber(ends)
  if e and e > now then
    table.insert(out, all[i])
    table.insert(out, seen)
    table.insert(out, ends)
    table.insert(out, data)
  elseif op == 'beat' and (e == nil or e < now - tonumber(ARGV[5])) then
    redis.call('HDEL', KEYS[1], all[i])
  end
end
return out
