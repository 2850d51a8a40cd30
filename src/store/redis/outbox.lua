-- The outbox (docs/protocol.md, "Webhook deliveries handed over"): parcels
-- a node handed over for a peer, a hash of id -> body. KEYS[1] the hash,
-- KEYS[2] Redlock's marks (id -> "taker|ms"), KEYS[3] when each was
-- handed over (id -> ms, server clock). ARGV[1] the mode:
--   put  ARGV[2..]: id, body, id, body ...: written (replacing), unmarked.
--   take ARGV[2] max, ARGV[3] prefix: the oldest max whose id starts with
--        prefix (id order), answered and deleted at once: one master
--        (Redis, Sentinel).
--   mark ARGV[2] max, ARGV[3] prefix, ARGV[4] taker, ARGV[5] hold ms,
--        ARGV[6] max age ms: Redlock. In id order, a parcel of the prefix
--        older than max age is deleted (a copy left on a minority of
--        masters); one marked by another taker less than hold ago is
--        passed over; the others (unmarked, this taker's, or lapsed) are
--        marked for this taker and answered, until max are.
--   unmark ARGV[2] taker, ARGV[3..]: ids whose mark is this taker's
--        unmarked (a take a majority did not give it: tried again).
--   drop ARGV[2] taker, ARGV[3..]: ids whose mark is this taker's
--        deleted, with their marks; answered.
-- Reply: put and unmark 1; take and mark {id, body, id, body ...}; drop
-- the ids deleted.
local mode = ARGV[1]
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function forget(id)
  redis.call('HDEL', KEYS[1], id)
  redis.call('HDEL', KEYS[2], id)
  redis.call('HDEL', KEYS[3], id)
end
local function marked_by(id, taker)
  local mark = redis.call('HGET', KEYS[2], id)
  return mark and string.sub(mark, 1, #taker + 1) == taker .. '|'
end
if mode == 'put' then
  local now = now_ms()
  for i = 2, #ARGV - 1, 2 do
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
    redis.call('HDEL', KEYS[2], ARGV[i])
    redis.call('HSET', KEYS[3], ARGV[i], now)
  end
  return 1
end
if mode == 'unmark' or mode == 'drop' then
  local done = {}
  for i = 3, #ARGV do
    if marked_by(ARGV[i], ARGV[2]) then
      if mode == 'drop' then
        forget(ARGV[i])
        done[#done + 1] = ARGV[i]
      else
        redis.call('HDEL', KEYS[2], ARGV[i])
      end
    end
  end
  if mode == 'drop' then return done end
  return 1
end
local max = tonumber(ARGV[2]) or 0
local prefix = ARGV[3] or ''
local ids = {}
for _, id in ipairs(redis.call('HKEYS', KEYS[1])) do
  if string.sub(id, 1, #prefix) == prefix then ids[#ids + 1] = id end
end
table.sort(ids)
local out = {}
local taken = 0
if mode == 'take' then
  for _, id in ipairs(ids) do
    if taken >= max then break end
    out[#out + 1] = id
    out[#out + 1] = redis.call('HGET', KEYS[1], id)
    forget(id)
    taken = taken + 1
  end
  return out
end
if mode ~= 'mark' then
  return redis.error_reply('outbox.lua: unknown mode')
end
local taker = ARGV[4]
local hold = tonumber(ARGV[5]) or 0
local max_age = tonumber(ARGV[6]) or 0
local now = now_ms()
for _, id in ipairs(ids) do
  if taken >= max then break end
  local at = tonumber(redis.call('HGET', KEYS[3], id) or '')
  if at and max_age > 0 and now - at > max_age then
    forget(id)
  else
    local mark = redis.call('HGET', KEYS[2], id)
    local ours = true
    if mark then
      local sep = string.find(mark, '|', 1, true)
      if sep then
        local who = string.sub(mark, 1, sep - 1)
        local since = tonumber(string.sub(mark, sep + 1)) or 0
        ours = who == taker or now - since >= hold
      end
    end
    if ours then
      redis.call('HSET', KEYS[2], id, taker .. '|' .. now)
      out[#out + 1] = id
      out[#out + 1] = redis.call('HGET', KEYS[1], id)
      taken = taken + 1
    end
  end
end
return out
