-- A fair waiter gives up (its stream ended): it leaves the queue at once, and when the
-- lock is free the next live waiter is woken directly.
-- KEYS[1] lock hash, KEYS[2] unlock channel, KEYS[3] queue, KEYS[4] deadlines
-- ARGV[1] owner id, ARGV[2] publish command, ARGV[3] how long a queued waiter stays
--   without polling (ms)
-- Returns 1 when the owner was queued, 0 otherwise.
local left = leave_queue(KEYS[3], KEYS[4], ARGV[1])
local now = now_ms()
if redis.call('exists', KEYS[1]) == 0 then
    local head = live_head(KEYS[3], KEYS[4], now)
    if head then
        redis.call(ARGV[2], KEYS[2] .. ':' .. head, '0')
    end
end
if left == 1 then
    -- Those behind may have queued after this waiter last kept the queue alive.
    keep_queue(KEYS[3], KEYS[4], now, tonumber(ARGV[3]))
    changed(KEYS[1])
end
return left
