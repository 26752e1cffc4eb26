-- Takes one read hold (Redisson RReadLock layout: the hash has mode = read|write, the reader's
-- field counts its holds, and each hold n has a timeout key <prefix>:<n>).
-- KEYS[1] lock hash, KEYS[2] fencing counter, KEYS[3] hold record, KEYS[4] this reader's timeout prefix,
--   KEYS[5] the fair waiters' deadlines
-- ARGV[1] lease ms, ARGV[2] owner id, ARGV[3] grace ms, ARGV[4] the owner's write field
-- Returns {1, token, hold count}, {0, pttl, 0} while another owner writes, {2} for another kind.
local replayed = replay(KEYS[3], KEYS[1], ARGV[2], ARGV[1], ARGV[3])
if replayed then
    lengthen_own_timeout(KEYS[4], replayed[3], KEYS[1], KEYS[3], tonumber(ARGV[1]))
    return replayed
elseif replayed == false then
    return {0, -1, 0}
end
local kind = held_for_taking(KEYS[1])
if kind ~= 'none' and kind ~= 'read' and kind ~= 'write' then
    return {2}
end
if fair_between_holders(kind, KEYS[5]) then
    return {2}
end
-- The writer may also read; other readers wait for it, unless its write lapsed: every
-- timeout key of it gone, its server dead with the owner's read (a fixed lease, or a
-- stream on that server too) still keeping the lock up, which no renewal or release of
-- that owner would come to drop. It is dropped here, as such a renewal drops it.
if kind == 'write' and redis.call('hexists', KEYS[1], ARGV[4]) == 0 then
    local writer = writer_of(KEYS[1])
    local left = writer and write_left(KEYS[1], writer)
    if not left or left > 0 then
        -- Looked at again once the write may lapse, not only at the lock's end: nobody
        -- announces a lapsed write.
        local ttl = redis.call('pttl', KEYS[1])
        if left and (ttl < 0 or left < ttl) then
            ttl = left
        end
        return {0, ttl, 0}
    end
    kind = drop_lapsed_write(KEYS[1], writer, suffixed('redisson_rwlock', KEYS[1])) and 'none' or 'read'
end
local timeout, another = next_timeout(KEYS[4], KEYS[1], ARGV[2])
if another then
    return {0, another, 0}
end
local keep = tonumber(ARGV[1]) + tonumber(ARGV[3])
local token = next_token(KEYS[2], keep)
if kind == 'none' then
    redis.call('hset', KEYS[1], 'mode', 'read')
end
local count = redis.call('hincrby', KEYS[1], ARGV[2], 1)
redis.call('set', timeout, timeout_value(KEYS[1], KEYS[3]), 'px', ARGV[1])
-- The lock lives as long as its longest hold.
redis.call('pexpire', KEYS[1], math.max(redis.call('pttl', KEYS[1]), tonumber(ARGV[1])))
return {1, grant(KEYS[1], token, KEYS[3], keep), count}
