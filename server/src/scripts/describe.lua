-- Reads one lock of any kind in a single consistent snapshot.
-- KEYS[1] lock key, KEYS[2] fencing counter, KEYS[3] fair queue, KEYS[4] semaphore hash
-- Returns {kind (as lib.lua's held_as), pttl, last token or false, flat field/value list of the
-- lock hash (or of the semaphore hash), the fair queue, flat hold id/expiry list of a
-- semaphore, Redis' clock in ms}.
local kind = held_as(KEYS[1])
local fields, holds = {}, {}
if kind == 'semaphore' then
    fields = redis.call('hgetall', KEYS[4])
    holds = redis.call('zrange', KEYS[1], 0, -1, 'withscores')
elseif kind ~= 'none' and kind ~= 'other' then
    fields = redis.call('hgetall', KEYS[1])
end
return {kind, redis.call('pttl', KEYS[1]), redis.call('get', KEYS[2]), fields,
    redis.call('lrange', KEYS[3], 0, -1), holds, now_ms()}
