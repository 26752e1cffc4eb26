-- Deletes a lock of any kind whatever its holders (Redisson forceUnlock), wakes its
-- waiters, and tells every server which lock was broken.
-- KEYS[1] lock key, KEYS[2] unlock channel, KEYS[3] fair queue, KEYS[4] fair deadlines,
-- KEYS[5] rw channel, KEYS[6] semaphore hash, KEYS[7] semaphore channel, KEYS[8] fencing
--   counter
-- ARGV[1] publish command, ARGV[2] the servers' force-release channel, ARGV[3] grace ms
--   hold records outlive their lease
-- Returns the break floor (a token: every hold it broke had one at or below it, every
-- later grant has one above) when a lock was deleted, 0 when there was none.
-- A key that Describe reads as no lock (a string, a list, a sorted set without a
-- semaphore's hash) is left alone. A fencing counter that holds no count fails the
-- script at its first write (WRONGTYPE, or not an integer), with nothing changed.
local kind = inspected_as(KEYS[1], KEYS[6])
if kind == 'none' or kind == 'other' then
    return 0
end
-- A semaphore whose holds all ran out (their servers died; the next try cleans them up)
-- holds nothing, as Describe reads it: there is nothing to break.
if kind == 'semaphore' and redis.call('zcount', KEYS[1], '(' .. now_ms(), '+inf') == 0 then
    return 0
end
-- A read/write lock none of whose holds is live (their timeout keys all gone: their
-- servers died), or an application's hash of its shape, holds nothing either, as
-- Describe reads it (describe.lua's holders: a Redisson writer, which has no timeout key,
-- holds as long as the lock). (Inline, not a helper of lib.lua: batch.lua's one function
-- runs every batched script, and Lua bounds the helpers a function can name.)
if kind == 'read' or kind == 'write' then
    local fields, prefix, live = redis.call('hgetall', KEYS[1]), rw_prefix(KEYS[1]), false
    for i = 1, #fields, 2 do
        local count, writer = tonumber(fields[i + 1]), string.match(fields[i], '^(.*):write$')
        if fields[i] ~= 'mode' and count then
            live = live or (writer and not refreshed(writer))
                or longest_timeout(prefix .. ':' .. fields[i] .. ':rwlock_timeout', count) ~= -2
        end
    end
    if not live then
        return 0
    end
end
-- The broken holds' records stay behind (their streams end when told, and give back
-- nothing): the break floor outlives them, being kept as long as the lock's lease had
-- to run, which no hold's lease exceeds, and never less long than an earlier break's
-- floor had still to run (its broken records are below this floor too).
local broken = suffixed('latchkey_broken', KEYS[1])
local keep = math.max(redis.call('pttl', KEYS[1]), redis.call('pttl', broken) - tonumber(ARGV[3]), 0)
    + tonumber(ARGV[3])
local latest = latest_token(KEYS[1], KEYS[8])
local floor = string.format('%d', next_token(KEYS[8], keep))
redis.call('set', broken, floor, 'px', keep)
-- The floor is nobody's grant: while the counter stands there, Describe and Watch show
-- the latest grant's token, 0 when latchkey granted none (a lock only Redisson held, or
-- a counter that had expired).
local passed = (latest or '0') .. ':' .. floor
redis.call('set', fence_passed_of(KEYS[1]), passed, 'px', math.max(redis.call('pttl', KEYS[8]), 1))
if kind == 'read' or kind == 'write' then
    drop_own_timeouts(KEYS[1])
end
redis.call('del', KEYS[1])
if kind == 'semaphore' then
    -- Every waiter looks again: the times they were told (the hash's `told`) go with it.
    redis.call('del', KEYS[6])
    redis.call(ARGV[1], KEYS[7], RECHECK)
elseif kind == 'read' or kind == 'write' then
    redis.call(ARGV[1], KEYS[5], '1')
else
    redis.call(ARGV[1], KEYS[2], '0')
    local head = live_head(KEYS[3], KEYS[4])
    if head then
        redis.call(ARGV[1], KEYS[2] .. ':' .. head, '0')
    end
end
-- Servers end the holds they serve that have a token at or below the floor (a notice
-- that arrives late must not end a hold granted after the break).
-- The floor goes last, after a newline, which no lock key has (names hold no control
-- characters): an older server's message, the key alone, never reads as one with a floor.
redis.call('publish', ARGV[2], KEYS[1] .. '\n' .. floor)
changed(KEYS[1])
return tonumber(floor)
