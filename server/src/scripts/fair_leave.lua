-- A fair waiter gives up (its stream ended): it leaves the queue at once, and when the
-- lock is free the next live waiter is woken directly.
-- KEYS[1] lock hash, KEYS[2] unlock channel, KEYS[3] queue, KEYS[4] deadlines
-- ARGV[1] owner id, ARGV[2] publish command, ARGV[3] how long a queued waiter stays
--   without polling (ms)
-- Returns 1 when the owner was queued, 0 otherwise.
-- A latchkey waiter (`refreshed`) leaves the Redisson waiters behind it spaced from its
-- own deadline, a --fair-wait-timeout ahead at most, where Redisson spaces its first
-- waiter from the holder's lease left: one that is now first in line is raised to be
-- that far behind the lease (and those behind it in turn, `raise_behind`), or, behind a
-- lease longer than its wait, it was swept out of its turn while the lock was held (a
-- pre-3.32 Java `lock()` then waits for good). One further back is spaced from the
-- entry now ahead of it.
if refreshed(ARGV[1]) then
    -- First in line is first among the live: dead entries ahead go first (the leaving
    -- one stays, for leave_queue to take out).
    live_head(KEYS[3], KEYS[4], nil, ARGV[1])
    local pos = redis.call('lpos', KEYS[3], ARGV[1])
    local was = tonumber(redis.call('zscore', KEYS[4], ARGV[1]) or '')
    if pos and was then
        local from
        if pos == 0 then
            from = now_ms() + math.max(redis.call('pttl', KEYS[1]), 0)
        else
            from = tonumber(redis.call('zscore', KEYS[4], redis.call('lindex', KEYS[3], pos - 1)) or '')
        end
        if from and from > was then
            raise_behind(KEYS[3], KEYS[4], pos, was, from)
        end
    end
end
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
