-- Takes permits of a counting semaphore (modelled on Redisson's RPermitExpirableSemaphore:
-- every hold expires with its lease, so a crashed server's permits come back).
-- KEYS[1] holds (sorted set: hold id -> expiry ms), KEYS[2] fencing counter,
-- KEYS[3] semaphore hash (limit, used, p:<id> permits, o:<id> owner, t:<id> token, told: see
--   below), KEYS[4] channel,
-- KEYS[5] the stream's hold record (only ever a revoked one: see semaphore_release),
-- KEYS[6] the fair waiters' deadlines
-- ARGV[1] lease ms, ARGV[2] hold id, ARGV[3] grace ms, ARGV[4] permits, ARGV[5] limit,
-- ARGV[6] owner id, ARGV[7] publish command
-- Returns {1, token, permits}, {0, ms until the first hold expires, 0} when too few permits
-- are free, {2} for another kind, {3, limit} when the live semaphore has another limit.
local kind = inspected_as(KEYS[1], KEYS[3])
if kind ~= 'none' and kind ~= 'semaphore' then
    return {2}
end
if fair_between_holders(kind, KEYS[6]) then
    return {2}
end
-- A try of a stream that has ended, reaching Redis late: it grants nothing.
if redis.call('get', KEYS[5]) == REVOKED then
    return {0, -1, 0}
end
local token = redis.call('hget', KEYS[3], 't:' .. ARGV[2])
-- A hold whose lease ran out is no grant to replay: it is taken out below.
if token and tonumber(redis.call('zscore', KEYS[1], ARGV[2]) or '0') > now_ms() then
    -- A replayed grant starts its lease again (see replay in lib.lua). A PEXPIRE first,
    -- whatever the holds' lifetime (another hold's may be longer): at the memory limit
    -- it is a write Redis allows, after which it runs the ZADD (an existing member's
    -- score).
    local lease = tonumber(ARGV[1])
    redis.call('pexpire', KEYS[1], math.max(redis.call('pttl', KEYS[1]), lease))
    lengthen(KEYS[3], lease)
    -- Its fencing counter too, as at the grant (replay in lib.lua).
    lengthen(KEYS[2], lease + tonumber(ARGV[3]))
    redis.call('zadd', KEYS[1], now_ms() + lease, ARGV[2])
    -- A hold whose permits field is gone (see drop_permits) holds what it asks again.
    return {1, tonumber(token), tonumber(redis.call('hget', KEYS[3], 'p:' .. ARGV[2]) or ARGV[4])}
end
local now = now_ms()
-- The latest time a waiter was told to look again (a busy try's answer), read before
-- the hash may go: a hold that may run out before it must wake the waiters.
local told = tonumber(redis.call('hget', KEYS[3], 'told') or '0')
local expired = redis.call('zrangebyscore', KEYS[1], '-inf', now)
for _, id in ipairs(expired) do
    redis.call('zrem', KEYS[1], id)
    drop_permits(KEYS[3], KEYS[1], id)
end
if redis.call('zcard', KEYS[1]) == 0 then
    redis.call('del', KEYS[3])
end
local limit = tonumber(ARGV[5])
local live = tonumber(redis.call('hget', KEYS[3], 'limit') or ARGV[5])
local used = tonumber(redis.call('hget', KEYS[3], 'used') or '0')
if #expired > 0 then
    -- Waiters learn of the permits the expired holds freed, whatever this try's answer:
    -- one refused for another limit too.
    redis.call(ARGV[7], KEYS[4], tostring(live - used))
end
if live ~= limit then
    return {3, live}
end
local permits = tonumber(ARGV[4])
if used + permits > limit then
    local first = tonumber(redis.call('zrange', KEYS[1], 0, 0, 'withscores')[2])
    if first > told then
        -- Caught: at the memory limit Redis refuses this first write, and the try is
        -- still busy. Waiters told of `first` then miss only the early end of a hold
        -- granted later, of a lease shorter than the wait (its server dead), which
        -- they look again for at `first` at the latest.
        redis.pcall('hset', KEYS[3], 'told', string.format('%d', first))
    end
    return {0, first - now, 0}
end
local lease = tonumber(ARGV[1])
local keep = lease + tonumber(ARGV[3])
local t = next_token(KEYS[2], keep)
redis.call('zadd', KEYS[1], now + lease, ARGV[2])
redis.call('hset', KEYS[3], 'limit', limit, 'used', used + permits, 'p:' .. ARGV[2], permits,
    'o:' .. ARGV[2], ARGV[6], 't:' .. ARGV[2], string.format('%d', t))
for _, key in ipairs({KEYS[1], KEYS[3]}) do
    redis.call('pexpire', key, math.max(redis.call('pttl', key), lease))
end
if told > now + lease then
    -- A waiter sleeps until after this hold may run out, and a hold's end sends no
    -- message when its server dies: every waiter looks again now, and learns when.
    redis.call('hdel', KEYS[3], 'told')
    redis.call(ARGV[7], KEYS[4], RECHECK)
elseif told > now then
    redis.call('hset', KEYS[3], 'told', string.format('%d', told))
end
changed(KEYS[1])
return {1, t, permits}
