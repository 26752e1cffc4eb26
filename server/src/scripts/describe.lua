-- Reads one lock in a single consistent snapshot.
-- KEYS[1] lock hash, KEYS[2] fencing counter
-- Returns {type, pttl, last fencing token or false, flat field/value list of the hash}.
local kind = redis.call('type', KEYS[1])['ok']
local fields = {}
if kind == 'hash' then
    fields = redis.call('hgetall', KEYS[1])
end
return {kind, redis.call('pttl', KEYS[1]), redis.call('get', KEYS[2]), fields}
