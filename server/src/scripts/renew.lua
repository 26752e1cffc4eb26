-- Renews many stream-scoped leases in one call (the watchdog's batch).
-- KEYS: the first lease's lock key and fencing counter; they route the call. On a
--   cluster the batch spans the slots of one node, so the leases' keys come in ARGV and the
--   cluster variant of this script declares allow-cross-slot-keys.
-- ARGV[1] lease ms, ARGV[2] grace ms the records outlive the lease, then 7 values per lease i:
--   kind ('h' mutex/fair hold, 'w' write hold, 'r' read hold, 's' semaphore hold; in capitals, a
--   fixed lease that is only checked, never extended), lock key,
--   hold (record key, or the hold id of a semaphore), fencing counter, field (owner field),
--   extra (a reader's or writer's timeout prefix, or the semaphore hash), token (the grant's
--   fencing token the stream was told, which its hold record (a semaphore's `t:<hold>`)
--   must hold, or '0' to take any live record: a RedLock's nodes each record their own)
-- Returns {lost, failed, error}: lost, the 1-based indexes of the leases that are no longer
-- held, negated for a lease ForceRelease broke (its record at or below the break floor):
-- the stream is told why even when the break's notice never reached this server; failed,
-- the indexes of the leases whose renewal Redis refused (a command of it raised an
-- error), which are neither renewed nor lost and go again with the round's retry; error,
-- the first such error's text (absent when none failed). One lease's error never fails
-- the others: at its memory limit (noeviction) Redis refuses a deny-oom command such as
-- a semaphore's ZADD that comes before any write of the script, and the batch's other
-- leases, renewed by PEXPIRE, must stay held.
local lost, failed, failure = {}, {}, nil
local lease = tonumber(ARGV[1])
local grace = tonumber(ARGV[2])
local keep = lease + grace

-- Each holder's timeout keys as this call first read them, by prefix (timeouts_of): one
-- owner's many holds would otherwise cost the square of their number in commands.
local timeouts = {}

-- Lengthens the timeout key of a reader's or writer's hold (record `hold` of `lock`)
-- among the holder's `count` keys under `prefix` to `ms`, never shortening it.
local function lengthen_hold_timeout(prefix, count, lock, hold, ms)
    timeouts[prefix] = timeouts[prefix] or timeouts_of(prefix, count)
    lengthen_own_timeout(prefix, count, lock, hold, ms, timeouts[prefix])
end

local function renew(kind, lock, hold, fence, field, extra, token)
    local check = kind ~= string.lower(kind)
    kind = string.lower(kind)
    -- A key that is no longer the lock kind the hold took (another client took the
    -- name after it expired) is a lost lease, never an error that fails the batch.
    if kind == 's' then
        -- A key that is no sorted set is no semaphore. A hold gone whose grant is at or
        -- below the break floor: ForceRelease broke it. A hold whose lease ran out is
        -- gone too, though no acquire has taken it out of the set yet.
        -- A hold of another grant than the stream's is lost too: the stream's went (a
        -- failover, a break whose notice was missed) and a late try of the stream
        -- granted the hold id afresh, uncounted in between.
        local expires = tonumber(typed_call('zscore', lock, hold) or '')
        local own = token == '0' or redis.call('hget', extra, 't:' .. hold) == token
        if not expires or expires <= now_ms() or not own then
            local granted = tonumber(token)
            return granted > 0 and granted <= broken_floor(lock) and 'broken'
        end
        if check then
            return true
        end
        -- A PEXPIRE first, whatever the holds' lifetime (a longer fixed lease's may
        -- be longer): at the memory limit it is a write Redis allows, after which it
        -- runs the ZADD (an existing member's score, no more memory).
        redis.call('pexpire', lock, math.max(redis.call('pttl', lock), lease))
        lengthen(extra, lease)
        redis.call('zadd', lock, now_ms() + lease, hold)
    else
        -- The owner's hold count and the lock's mode in one read (held_as's kinds of a
        -- hash; a key that is no hash is 'other'). A missing key has no count.
        local fields = typed_call('hmget', lock, field, 'mode')
        local count = fields and fields[1]
        local held = fields and (fields[2] or 'lock') or 'other'
        -- A reader's field in a write-mode hash is the writer's own read; a mutex's
        -- owner field there is no mutex hold, whoever's owner id it carries.
        local kind_ok = (kind == 'r' and (held == 'read' or held == 'write'))
            or (kind == 'h' and held == 'lock')
            or (kind == 'w' and held == 'write')
        -- A record of another grant than the stream's is a lost lease too: the stream's
        -- own grant went with a failover, and a claim it left was granted again since.
        local record, ttl = redis.call('get', hold), redis.call('pttl', hold)
        local own = token == '0' or record == token
        local floor = broken_floor(lock)
        if not live_record(record, ttl, lock, floor) or not own or not kind_ok or not count then
            -- The stream's own grant, at or below the floor: ForceRelease broke it.
            local granted = tonumber(record or '')
            return own and granted ~= nil and granted <= floor and 'broken'
        end
        -- A reader in a write-mode hash is the writer reading too: its writes on other
        -- servers may have lapsed, which this renewal must not keep alive.
        if kind == 'r' and held == 'write' and write_lapsed(lock, field) then
            drop_lapsed_write(lock, field, suffixed('redisson_rwlock', lock))
        end
        if check then
            -- Redisson sets the lock's TTL to its own lease outright: a reader's renewal
            -- (and every hold's timeout keys), and a reentry, unlock or renewal by a Java
            -- thread sharing this stream's owner. That may cut a longer fixed lease:
            -- what is left of this hold's (its record outlives it by the grace) is
            -- restored.
            if ttl - grace > 0 then
                lengthen(lock, ttl - grace)
                if kind == 'r' or kind == 'w' then
                    lengthen_hold_timeout(extra, count, lock, hold, ttl - grace)
                end
            end
            return true
        end
        lengthen(lock, lease)
        redis.call('pexpire', hold, keep)
        if kind == 'r' or kind == 'w' then
            lengthen_hold_timeout(extra, count, lock, hold, lease)
        end
    end
    lengthen(fence, keep)
    if kind == 'h' then
        -- The record of the latest pass in memory speaks for the counter as long as the
        -- counter lives: expired under a longer hold, Describe would show the reserved
        -- top, a token nobody was granted, and Watch a change that never was.
        lengthen(fence_passed_of(lock), keep)
    end
    return true
end

for i = 0, (#ARGV - 2) / 7 - 1 do
    local a = 3 + 7 * i
    local ok, renewed =
        pcall(renew, ARGV[a], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3], ARGV[a + 4], ARGV[a + 5], ARGV[a + 6])
    if not ok then
        failed[#failed + 1] = i + 1
        local text = error_text(renewed)
        failure = failure or text
        -- A read-only replica (a demoted primary) refuses every write, so no lease was
        -- renewed: its own error goes back, for the Redis client to connect again on
        -- (`READONLY` is one of its reconnect errors), which an answer would not. Each
        -- lease's own: an earlier lease's other error (a foreign key under one of its
        -- names, read before any write) must not hide it.
        if string.sub(text, 1, 9) == 'READONLY ' then
            return redis.error_reply(text)
        end
    elseif renewed == 'broken' then
        lost[#lost + 1] = -(i + 1)
    elseif not renewed then
        lost[#lost + 1] = i + 1
    end
end
return {lost, failed, failure}
