-- Gives back a semaphore hold's permits and tells waiters how many are free now.
-- KEYS[1] holds, KEYS[2] semaphore hash, KEYS[3] channel, KEYS[4] the stream's hold record
-- ARGV[1] hold id, ARGV[2] publish command, ARGV[3] '1' to revoke a hold not found (its
--   grant's outcome is unknown: it may still reach Redis, and must then grant nothing)
-- Returns 0, or -1 when the hold was not held (already released or expired). A hold past
-- its expiry that no try swept yet is taken out here all the same, its permits given
-- back, and answered -1: renewal would have called it lost, and so does its release.
-- A key that is no sorted set (the name taken as another kind since) holds no hold.
local expiry = typed_call('zscore', KEYS[1], ARGV[1])
local removed = typed_call('zrem', KEYS[1], ARGV[1])
if ARGV[3] == '1' then
    -- A try of this stream may still be on its way: it must take nothing when it comes.
    -- After the removal: at its memory limit Redis refuses a SET before a script's
    -- first write, and the give-back must go through there.
    redis.call('set', KEYS[4], REVOKED, 'px', REVOKED_MS)
end
if not removed or removed == 0 then
    return -1
end
local limit = tonumber(redis.call('hget', KEYS[2], 'limit') or '0')
local used = drop_permits(KEYS[2], KEYS[1], ARGV[1])
if redis.call('zcard', KEYS[1]) == 0 then
    -- What waiters were told stays until then, for the next grant (semaphore_acquire).
    local told = redis.call('hget', KEYS[2], 'told')
    redis.call('del', KEYS[2])
    if told then
        redis.call('hset', KEYS[2], 'told', told)
        redis.call('pexpireat', KEYS[2], told)
    end
end
redis.call(ARGV[2], KEYS[3], tostring(limit - used))
changed(KEYS[1])
if tonumber(expiry) <= now_ms() then
    return -1
end
return 0
