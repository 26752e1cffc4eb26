-- Gives back one hold of each given mutex or fair lock and wakes who can proceed: the
-- general channel's waiters (Redisson RLock, latchkey mutex) and the first live fair waiter.
-- KEYS: for each name i, KEYS[5i-4] lock hash, KEYS[5i-3] unlock channel, KEYS[5i-2] hold
--   record, KEYS[5i-1] fair queue, KEYS[5i] fair deadlines
-- ARGV[1] owner id, ARGV[2] publish command ('publish', or 'spublish' on a cluster),
--   ARGV[3] '1' to revoke: a try of the stream had an unknown outcome, so a revoked record
--   stands in place of the hold record, whatever was there
-- Returns how many of the holds were still held. Safe to retry: a hold record is gone
-- after the first run.
-- Watch hears a full release on the unlock channel, so only a partial one is announced.
local released = 0
for i = 1, #KEYS / 5 do
    local lock, channel, hold = KEYS[5 * i - 4], KEYS[5 * i - 3], KEYS[5 * i - 2]
    -- Only a mutex or fair lock: a stale hold never touches a newer lock of another kind.
    local count = take_record(hold, ARGV[3] == '1', lock) and lock_holds(lock, ARGV[1])
    if count then
        released = released + 1
        if count > 1 then
            redis.call('hincrby', lock, ARGV[1], -1)
            changed(lock)
        else
            redis.call('del', lock)
            -- Redisson's unlock message "0", so Redisson waiters wake too.
            redis.call(ARGV[2], channel, '0')
            local head = live_head(KEYS[5 * i - 1], KEYS[5 * i])
            if head then
                redis.call(ARGV[2], channel .. ':' .. head, '0')
            end
        end
    end
end
return released
