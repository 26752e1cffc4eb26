-- Takes one hold of a reentrant mutex (Redisson RLock layout: a hash of owner id -> hold count).
-- KEYS[1] lock hash, KEYS[2] fencing counter, KEYS[3] hold record of this stream, KEYS[4] fair queue
-- ARGV[1] lease ms, ARGV[2] owner id, ARGV[3] grace ms the records outlive the lease
-- Returns {1, fencing token, hold count} when granted, {0, pttl, 0} when held by another
-- owner, {2} when the name is held as another kind (or used as a fair lock).
-- Safe to retry: a retried grant finds its hold record and returns it unchanged.
local replayed = replay(KEYS[3], KEYS[1], ARGV[2])
if replayed then
    return replayed
end
local kind = held_as(KEYS[1])
if (kind ~= 'none' and kind ~= 'lock') or redis.call('exists', KEYS[4]) == 1 then
    return {2}
end
if kind == 'lock' and redis.call('hexists', KEYS[1], ARGV[2]) == 0 then
    return {0, redis.call('pttl', KEYS[1]), 0}
end
local count = redis.call('hincrby', KEYS[1], ARGV[2], 1)
redis.call('pexpire', KEYS[1], ARGV[1])
return {1, grant(KEYS[2], KEYS[3], tonumber(ARGV[1]) + tonumber(ARGV[3])), count}
