-- Gives back one write hold. The last one frees the lock (or leaves the owner's own
-- read holds) and sends the read-unlock message, which wakes every waiting reader.
-- KEYS[1] lock hash, KEYS[2] rw channel, KEYS[3] hold record, KEYS[4] the owner's read
--   timeout prefix, KEYS[5] the write field's timeout prefix
-- ARGV[1] the owner's write field, ARGV[2] publish command, ARGV[3] '1' to revoke a
--   missing record, '2' for a give-back its stream tries again after (release.lua's
--   ARGV[2]), ARGV[4] the owner (its read field)
-- Returns the remaining write holds, or -1 when this hold was not held.
local kind = held_as(KEYS[1])
local own = lease_left(KEYS[3])
if not take_record(KEYS[3], ARGV[3], KEYS[1]) or kind ~= 'write' or redis.call('hexists', KEYS[1], ARGV[1]) == 0 then
    -- A hold past its lease, its owner's last write, while the owner's reads keep the
    -- lock up: dropped as a try or a renewal drops it. Left, it kept Redisson's readers
    -- (told the lock's TTL, never the write's end) out until a renewal round came.
    if kind == 'write' and write_lapsed(KEYS[1], ARGV[4]) then
        drop_lapsed_write(KEYS[1], ARGV[4], KEYS[2])
    end
    return -1
end
local count = redis.call('hincrby', KEYS[1], ARGV[1], -1)
give_back_timeout(KEYS[5], count, own, KEYS[1], KEYS[3])
changed(KEYS[1])
if count > 0 and refreshed(ARGV[4]) and longest_timeout(KEYS[5], count) <= 0 then
    -- The owner's other write holds all lapsed (write_lapsed): this was its last live one.
    count = 0
end
if count > 0 then
    -- The lock lives as long as the owner's longest remaining hold, not as long as this
    -- one had left (another of its streams may hold on a shorter lease, and die). A
    -- write hold without a key of an owner shaped like Redisson's may be a Redisson
    -- writer's, whose watchdog renews the lock every third of its timeout: the lock
    -- then keeps at least that timeout (Redisson's default). One of latchkey's own
    -- (`refreshed`) has lapsed: its server died.
    local reads = redis.call('hget', KEYS[1], ARGV[4]) or '0'
    local missing = not refreshed(ARGV[4]) and REDISSON_WATCHDOG_MS or nil
    local writes = longest_timeout(KEYS[5], count, missing)
    local longest = math.max(writes, longest_timeout(KEYS[4], reads))
    if longest < redis.call('pttl', KEYS[1]) then
        redis.call('pexpire', KEYS[1], longest)
        -- Waiters were told the longer TTL: they look again now and learn the new one.
        -- Redisson's read-unlock message, which wakes every thread of a Java client
        -- that waits (its unlock message wakes one).
        redis.call(ARGV[2], KEYS[2], '1')
    elseif not missing and writes < own then
        -- Other owners' readers were told to look again when the owner's longest write
        -- may lapse (read_acquire), which this one was: the writes left may lapse
        -- sooner, though the owner's reads keep the lock's TTL.
        redis.call(ARGV[2], KEYS[2], '1')
    end
    return count
end
redis.call('hdel', KEYS[1], ARGV[1])
-- The writer's own read holds remain: other readers may join them, and the lock lives
-- as long as the longest of them, not as long as the write lease had left (their
-- holder may die, and nothing else would free it sooner). None left alive frees it.
local longest = longest_timeout(KEYS[4], redis.call('hget', KEYS[1], ARGV[4]) or '0')
if redis.call('hlen', KEYS[1]) == 1 or longest <= 0 then
    redis.call('del', KEYS[1])
else
    redis.call('hset', KEYS[1], 'mode', 'read')
    if longest < redis.call('pttl', KEYS[1]) then
        redis.call('pexpire', KEYS[1], longest)
    end
end
redis.call(ARGV[2], KEYS[2], '1')
return 0
