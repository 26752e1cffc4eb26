-- Takes one hold of a fair lock (Redisson RFairLock layout: the RLock hash, a queue list of
-- owner ids and a sorted set of their deadlines), in strict arrival order.
-- KEYS[1] lock hash, KEYS[2] fencing counter, KEYS[3] hold record, KEYS[4] queue, KEYS[5] deadlines,
--   KEYS[6] unlock channel
-- ARGV[1] lease ms, ARGV[2] owner id, ARGV[3] grace ms, ARGV[4] how long a queued waiter stays
--   without polling again (ms), ARGV[5] '1' to join the queue when busy, '0' to try once
-- Returns {1, token, hold count} when granted; {0, ms until the next check, queue position
-- (1-based, 0 when not queued)} when busy, followed by {1, the holder's PTTL} for a
-- waiter behind another, whose check may come before the holder's end (1: the name, as a
-- multi-lock's script tells it; a negative PTTL: no holder's TTL to tell); {2} when held
-- as another kind.
-- A free name without a queue and with no record of this stream (the common case)
-- needs this one command: nothing to replay, no kind check and no head.
local kind, head = 'none', nil
if redis.call('exists', KEYS[1], KEYS[4], KEYS[3]) > 0 then
    local replayed = replayed_reply(KEYS[3], KEYS[1], ARGV[2], ARGV[1], ARGV[3])
    if replayed then
        return replayed
    end
    kind = held_for_taking(KEYS[1])
    if kind ~= 'none' and kind ~= 'lock' then
        return {2}
    end
    -- A queue key of another type makes the name no fair lock: refused here (WRONGTYPE),
    -- before any write, where a release reads it as an empty queue.
    redis.call('llen', KEYS[4])
    head = live_head(KEYS[4], KEYS[5])
end
if (kind == 'none' and (not head or head == ARGV[2]))
    or (kind == 'lock' and redis.call('hexists', KEYS[1], ARGV[2]) == 1) then
    local lease = tonumber(ARGV[1])
    local keep = lease + tonumber(ARGV[3])
    local token = next_token(KEYS[2], keep)
    if head and leave_queue(KEYS[4], KEYS[5], ARGV[2]) == 1 then
        keep_queue(KEYS[4], KEYS[5], now_ms(), tonumber(ARGV[4]))
    end
    local count = redis.call('hincrby', KEYS[1], ARGV[2], 1)
    if count == 1 then
        redis.call('pexpire', KEYS[1], ARGV[1])
    else
        -- A reentrant grant never shortens the lease another hold of the owner has.
        redis.call('pexpire', KEYS[1], math.max(redis.call('pttl', KEYS[1]), lease))
    end
    return {1, grant(KEYS[1], token, KEYS[3], keep), count}
end
-- A free lock a Redisson entry heads: its holder's lease ran out without a release (its
-- server or JVM died), which announces nothing, and a Java `lock()` before Redisson 3.32
-- whose retries answer a negative TTL waits for a message only, swept out at its
-- deadline (5 min by default) by whoever comes next. Told as a release would tell it.
if kind == 'none' and head and not refreshed(head) then
    redis.call(PUBLISH, KEYS[6] .. ':' .. head, '0')
end
if ARGV[5] ~= '1' then
    return {0, redis.call('pttl', KEYS[1]), 0}
end
-- Join the queue, or refresh this waiter's deadline (to what it needs now, those behind
-- raised to follow it: keep_place): it stays queued while it polls.
local now = now_ms()
local stay = tonumber(ARGV[4])
if keep_place(KEYS[4], KEYS[5], ARGV[2], now + stay) > 0 then
    changed(KEYS[1])
end
keep_queue(KEYS[4], KEYS[5], now, stay)
local pos = redis.call('lpos', KEYS[4], ARGV[2])
if pos == 0 then
    -- First in line: the holder's lease ends (or its release wakes us) first.
    return {0, redis.call('pttl', KEYS[1]), 1}
end
-- Behind someone: check again when the waiter ahead would be given up, or when the
-- holder's lease ends if sooner: the waiter ahead may be granted the lock meanwhile (no
-- message tells those behind it), and a holder gone without a release (its server or
-- JVM dead) leaves the lock then to whoever is first in line, this waiter maybe. A
-- lock free (or held without a TTL) is looked at again within a second, as the server
-- looks at a lock without a TTL: the waiter ahead is about to take it, for a lease this
-- waiter can only learn by looking (a Java waiter's grant announces nothing). A deadline
-- ahead already past (a dead waiter not yet at the head, where it is swept) bounds
-- nothing: it would read as no bound at all.
local ttl = redis.call('pttl', KEYS[1])
local wait = ttl > 0 and ttl or 1000
local ahead = redis.call('lindex', KEYS[4], pos - 1)
local deadline = tonumber(redis.call('zscore', KEYS[5], ahead))
if deadline and deadline > now then
    wait = math.min(wait, deadline - now)
end
return {0, wait, pos + 1, 1, ttl}
