-- Gives back one hold of a mutex or fair lock and wakes who can proceed: the general
-- channel's waiters (Redisson RLock, latchkey mutex) and the first live fair waiter.
-- KEYS[1] lock hash, KEYS[2] unlock channel, KEYS[3] hold record, KEYS[4] queue, KEYS[5] deadlines
-- ARGV[1] owner id, ARGV[2] publish command ('publish', or 'spublish' on a cluster)
-- Returns the owner's remaining holds, or -1 when this hold was not held (already
-- released, expired or broken). Safe to retry: the hold record is gone after the first run.
if redis.call('del', KEYS[3]) == 0 or redis.call('hexists', KEYS[1], ARGV[1]) == 0 then
    return -1
end
local count = redis.call('hincrby', KEYS[1], ARGV[1], -1)
if count > 0 then
    return count
end
redis.call('del', KEYS[1])
-- Redisson's unlock message "0", so Redisson waiters wake too.
redis.call(ARGV[2], KEYS[2], '0')
local head = live_head(KEYS[4], KEYS[5], now_ms())
if head then
    redis.call(ARGV[2], KEYS[2] .. ':' .. head, '0')
end
return 0
