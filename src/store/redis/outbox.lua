-- The outbox (docs/protocol.md, "Webhook deliveries handed over"): parcels
-- a node handed over for a peer, a hash of id -> body. KEYS[1] the hash,
-- KEYS[2] Redlock's marks (id -> "taker|ms"); ARGV[1] the mode:
--   put  ARGV[2..]: id, body, id, body ...: written (replacing), unmarked.
--   take ARGV[2] max: the oldest max (id order) answered and deleted, at
--        once: one master (Redis, Sentinel).
--   mark ARGV[2] max, ARGV[3] taker, ARGV[4] stale ms: Redlock. Of the
--        oldest max, those unmarked, marked by this taker, or marked
--        longer ago than stale are marked for this taker (server clock)
--        and answered; a parcel a majority of masters answered is the
--        taker's, which then drops it everywhere.
--   unmark ARGV[2] taker, ARGV[3..]: ids whose mark is this taker's
--        unmarked (a take a majority did not give it: tried again).
--   drop ARGV[2..]: ids deleted with their marks.
-- Reply: put, unmark and drop 1; take and mark {id, body, id, body ...}.
local mode = ARGV[1]
if mode == 'put' then
  for i = 2, #ARGV - 1, 2 do
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
    redis.call('HDEL', KEYS[2], ARGV[i])
  end
  return 1
end
if mode == 'unmark' then
  for i = 3, #ARGV do
    local mark = redis.call('HGET', KEYS[2], ARGV[i])
    if mark and string.sub(mark, 1, #ARGV[2] + 1) == ARGV[2] .. '|' then
      redis.call('HDEL', KEYS[2], ARGV[i])
    end
  end
  return 1
end
if mode == 'drop' then
  for i = 2, #ARGV do
    redis.call('HDEL', KEYS[1], ARGV[i])
    redis.call('HDEL', KEYS[2], ARGV[i])
  end
  return 1
end
local max = tonumber(ARGV[2]) or 0
local ids = redis.call('HKEYS', KEYS[1])
table.sort(ids)
local out = {}
local taken = 0
if mode == 'take' then
  for _, id in ipairs(ids) do
    if taken >= max then break end
    out[#out + 1] = id
    out[#out + 1] = redis.call('HGET', KEYS[1], id)
    redis.call('HDEL', KEYS[1], id)
    taken = taken + 1
  end
  return out
end
if mode ~= 'mark' then
  return redis.error_reply('outbox.lua: unknown mode')
end
local taker = ARGV[3]
local stale = tonumber(ARGV[4]) or 0
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
for _, id in ipairs(ids) do
  if taken >= max then break end
  local mark = redis.call('HGET', KEYS[2], id)
  local ours = true
  if mark then
    local sep = string.find(mark, '|', 1, true)
    if sep then
      local who = string.sub(mark, 1, sep - 1)
      local at = tonumber(string.sub(mark, sep + 1)) or 0
      ours = who == taker or now - at >= stale
    end
  end
  if ours then
    redis.call('HSET', KEYS[2], id, taker .. '|' .. now)
    out[#out + 1] = id
    out[#out + 1] = redis.call('HGET', KEYS[1], id)
    taken = taken + 1
  end
end
return out
