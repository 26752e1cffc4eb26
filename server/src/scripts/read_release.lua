-- Gives back one read hold. The lock then lives as long as its longest remaining read
-- hold; when no hold remains it is deleted and the read-unlock message wakes waiters,
-- as it does when the lock's TTL was cut short.
-- KEYS[1] lock hash, KEYS[2] rw channel, KEYS[3] hold record, KEYS[4] this reader's timeout prefix,
-- KEYS[5] the lock's timeout-key prefix
-- ARGV[1] owner id, ARGV[2] publish command, ARGV[3] '1' to revoke a missing record, '2'
--   for a give-back its stream tries again after (release.lua's ARGV[2])
-- Returns the owner's remaining read holds, or -1 when this hold was not held.
local kind = held_as(KEYS[1])
local own = lease_left(KEYS[3])
local live = take_record(KEYS[3], ARGV[3], KEYS[1])
if kind ~= 'read' and kind ~= 'write' then
    return -1
end
if not live then
    -- Its lease ran out: a Redisson reader's renewal may have kept its timeout key, and
    -- with it the read in the lock. It goes, with any other such read.
    if kind == 'read' and drop_lapsed_reads(KEYS[1]) then
        redis.call(ARGV[2], KEYS[2], '0')
    end
    return -1
end
if redis.call('hexists', KEYS[1], ARGV[1]) == 0 then
    return -1
end
local count = redis.call('hincrby', KEYS[1], ARGV[1], -1)
if count == 0 then
    redis.call('hdel', KEYS[1], ARGV[1])
end
give_back_timeout(KEYS[4], count, own, KEYS[1], KEYS[3])
changed(KEYS[1])
-- In write mode the reads are the writer's own (its reads under its write). A write of
-- latchkey's whose every timeout key ran out lapsed (its server died): it goes now,
-- and other owners' readers may join the reads left, rather than wait for the lock's
-- TTL, which a longer read of the owner may have set.
local mode = redis.call('hget', KEYS[1], 'mode')
-- Whether the read-unlock message went already (it wakes every waiter): once is enough.
local told = false
if mode == 'write' and write_lapsed(KEYS[1], ARGV[1]) then
    if drop_lapsed_write(KEYS[1], ARGV[1], KEYS[2]) then
        return count
    end
    mode, told = 'read', true
end
if redis.call('hlen', KEYS[1]) > 1 then
    local fields = redis.call('hgetall', KEYS[1])
    local holds = 0
    for i = 2, #fields, 2 do
        holds = holds + (tonumber(fields[i]) or 0)
    end
    -- More holds than any lock counts (an application's hash of too many fields to be
    -- looked over at a try): their keys are not read one by one, and the TTL stands.
    if holds > INSPECTED_HOLDS then
        return count
    end
    local longest = -3
    for i = 1, #fields, 2 do
        local n = tonumber(fields[i + 1])
        if n then
            longest = math.max(longest, longest_timeout(KEYS[5] .. ':' .. fields[i] .. ':rwlock_timeout', n))
        end
    end
    local ttl = redis.call('pttl', KEYS[1])
    -- A write of Redisson's has no timeout keys: its watchdog keeps the lock, whose
    -- TTL stands. A write of latchkey's counts by its keys, above.
    if mode == 'write' and not refreshed(ARGV[1]) then
        longest = math.max(longest, ttl)
    end
    if longest > 0 then
        redis.call('pexpire', KEYS[1], longest)
        if longest < ttl and not told then
            -- The lock now ends before the TTL its waiters were told to look again at,
            -- and a hold left may run out with no unlock message (a holder that
            -- died): they look again now and learn the new TTL. Redisson's read-unlock
            -- message: it wakes every thread of a Java client that waits (its unlock
            -- message wakes one).
            redis.call(ARGV[2], KEYS[2], '1')
        end
        return count
    end
end
redis.call('del', KEYS[1])
-- Redisson's unlock message: a writer may proceed.
if not told then
    redis.call(ARGV[2], KEYS[2], '0')
end
return count
