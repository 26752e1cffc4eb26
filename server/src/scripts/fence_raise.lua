-- Raises a fencing counter to at least a given token (a RedLock grant's token, the
-- largest of its majority), so the next grant on this node answers a larger one.
-- KEYS[1] fencing counter
-- ARGV[1] token, ARGV[2] ms the counter lives
-- Returns 1 when raised.
if tonumber(redis.call('get', KEYS[1]) or '0') < tonumber(ARGV[1]) then
    redis.call('set', KEYS[1], ARGV[1], 'px', ARGV[2])
    return 1
end
return 0
