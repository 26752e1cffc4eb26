-- Gives back one write hold. The last one frees the lock (or leaves the owner's own
-- read holds) and sends the read-unlock message, which wakes every waiting reader.
-- KEYS[1] lock hash, KEYS[2] rw channel, KEYS[3] hold record
-- ARGV[1] the owner's write field, ARGV[2] publish command, ARGV[3] '1' to revoke a
--   missing record
-- Returns the remaining write holds, or -1 when this hold was not held.
if not take_record(KEYS[3], ARGV[3] == '1', KEYS[1]) or held_as(KEYS[1]) ~= 'write' or redis.call('hexists', KEYS[1], ARGV[1]) == 0 then
    return -1
end
local count = redis.call('hincrby', KEYS[1], ARGV[1], -1)
changed(KEYS[1])
if count > 0 then
    return count
end
redis.call('hdel', KEYS[1], ARGV[1])
if redis.call('hlen', KEYS[1]) == 1 then
    redis.call('del', KEYS[1])
else
    -- The writer's own read holds remain: other readers may join them.
    redis.call('hset', KEYS[1], 'mode', 'read')
end
redis.call(ARGV[2], KEYS[2], '1')
return 0
