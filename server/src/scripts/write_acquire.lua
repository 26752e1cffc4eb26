-- Takes one write hold (Redisson RWriteLock layout: field <owner>:write in the mode = write hash).
-- Each write hold n also has a timeout key <prefix>:<n>, as a read hold has: Redisson's
-- read unlock gives the lock the longest lifetime of every hold's key it finds, the
-- write field's too, so a write hold without one could be cut short by its owner's reads.
-- KEYS[1] lock hash, KEYS[2] fencing counter, KEYS[3] hold record, KEYS[4] the write
--   field's timeout prefix, KEYS[5] the fair waiters' deadlines
-- ARGV[1] lease ms, ARGV[2] the owner's write field, ARGV[3] grace ms
-- Returns {1, token, hold count}, {0, pttl, 0} while others read or write, {2} for another kind.
local lease = tonumber(ARGV[1])
local replayed = replayed_reply(KEYS[3], KEYS[1], ARGV[2], ARGV[1], ARGV[3])
if replayed then
    if replayed[1] == 1 then
        lengthen_own_timeout(KEYS[4], replayed[3], KEYS[1], KEYS[3], lease)
    end
    return replayed
end
local kind = held_for_taking(KEYS[1])
if kind ~= 'none' and kind ~= 'read' and kind ~= 'write' then
    return {2}
end
if fair_between_holders(kind, KEYS[5]) then
    return {2}
end
-- Reads of latchkey's that lapsed beside a Redisson reader go first (drop_lapsed_reads),
-- and while reads hold, the writer looks again when the next of latchkey's may lapse:
-- a Redisson reader's unlock announces nothing while a lapsed read is left.
local swept = false
if kind == 'read' then
    local gone, lapse = drop_lapsed_reads(KEYS[1])
    if not gone then
        local ttl = redis.call('pttl', KEYS[1])
        return {0, lapse and (ttl < 0 or lapse < ttl) and lapse or ttl, 0}
    end
    kind, swept = 'none', true
elseif kind ~= 'none' and redis.call('hexists', KEYS[1], ARGV[2]) == 0 then
    return {0, redis.call('pttl', KEYS[1]), 0}
end
local timeout, another = next_timeout(KEYS[4], KEYS[1], ARGV[2])
if another then
    if swept then
        -- The lapsed reads took the lock with them, and this writer waits on: the others
        -- learn it is free (Redisson's unlock message).
        redis.call(PUBLISH, suffixed('redisson_rwlock', KEYS[1]), '0')
    end
    return {0, another, 0}
end
local keep = lease + tonumber(ARGV[3])
local token = next_token(KEYS[2], keep)
if kind == 'none' then
    redis.call('hset', KEYS[1], 'mode', 'write')
end
local count = redis.call('hincrby', KEYS[1], ARGV[2], 1)
redis.call('set', timeout, timeout_value(KEYS[1], KEYS[3]), 'px', lease)
redis.call('pexpire', KEYS[1], math.max(redis.call('pttl', KEYS[1]), lease))
return {1, grant(KEYS[1], token, KEYS[3], keep), count}
