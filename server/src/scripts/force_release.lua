-- Deletes a lock whatever its holders (Redisson forceUnlock) and tells everyone.
-- KEYS[1] lock hash, KEYS[2] unlock channel
-- ARGV[1] publish command for KEYS[2], ARGV[2] the servers' force-release channel
-- Returns 1 when a lock was deleted, 0 when it was free.
if redis.call('del', KEYS[1]) == 1 then
    redis.call(ARGV[1], KEYS[2], '0')
    redis.call('publish', ARGV[2], KEYS[1])
    return 1
end
return 0
