-- cronlease pause and resume (see docs/protocol.md, "Pause"): sets each
-- job's pause mark in its state hash, which claim.lua (and Redlock's phase 1)
-- read in the same atomic step as the rest of the claim. Nothing else is
-- touched: a held lease, the fence and a running run stay as they are.
-- KEYS: the jobs' state hashes. ARGV[1] "1" to pause, "0" to resume;
-- ARGV[2] the generation to write, or "" for one above the stored one.
-- Redlock writes the same generation to every master (one above the highest
-- a majority reported) and keeps the mark of the highest generation it reads,
-- so a master that missed a resume cannot keep a job paused.
-- A mark is written only over a lower generation. Reply: how many were written.
local written = 0
for i = 1, #KEYS do
  local stored = tonumber(redis.call('HGET', KEYS[i], 'pause_gen') or '0') or 0
  local gen = tonumber(ARGV[2]) or (stored + 1)
  if gen > stored then
    redis.call('HSET', KEYS[i], 'paused', ARGV[1], 'pause_gen', string.format('%d', gen))
    written = written + 1
  end
end
return written
