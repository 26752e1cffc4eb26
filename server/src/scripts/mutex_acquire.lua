-- Takes one hold of a reentrant mutex (Redisson RLock layout: a hash of owner id -> hold count).
-- KEYS[1] lock hash, KEYS[2] fencing counter, KEYS[3] hold record of this stream
-- ARGV[1] lease ms, ARGV[2] owner id, ARGV[3] grace ms the records outlive the lease
-- Returns {1, fencing token, hold count} when granted, {0, pttl} when held by another
-- owner, {2} when the name is held as another kind.
-- Safe to retry: a retried grant finds its hold record and returns it unchanged.
local record = redis.call('get', KEYS[3])
if record then
    local count = redis.call('hget', KEYS[1], ARGV[2])
    if count then
        return {1, tonumber(record), tonumber(count)}
    end
    redis.call('del', KEYS[3])
end
local kind = redis.call('type', KEYS[1])['ok']
if kind ~= 'none' and (kind ~= 'hash' or redis.call('hexists', KEYS[1], 'mode') == 1) then
    return {2}
end
if kind == 'hash' and redis.call('hexists', KEYS[1], ARGV[2]) == 0 then
    return {0, redis.call('pttl', KEYS[1])}
end
local count = redis.call('hincrby', KEYS[1], ARGV[2], 1)
redis.call('pexpire', KEYS[1], ARGV[1])
-- The token is the larger of the last token + 1 and Redis' clock in microseconds, so
-- it keeps increasing even after the counter key has expired.
local now = redis.call('time')
local token = math.max(tonumber(redis.call('get', KEYS[2]) or '0') + 1,
    tonumber(now[1]) * 1000000 + tonumber(now[2]))
local keep = tonumber(ARGV[1]) + tonumber(ARGV[3])
redis.call('set', KEYS[2], string.format('%d', token), 'px', keep)
redis.call('set', KEYS[3], string.format('%d', token), 'px', keep)
return {1, token, count}
