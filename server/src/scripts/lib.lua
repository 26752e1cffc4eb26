-- Helpers shared by every script of the catalogue (prepended to each one).

-- The semaphore message that has every waiter look again (the hub wakes them all, with
-- no count of free permits): each learns anew when to look again.
local RECHECK = 'latchkey:recheck'

-- Redis' clock in milliseconds: every deadline in Redis uses the server's time.
local function now_ms()
    local t = redis.call('time')
    return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- `redis.call`, except that a key holding another type than the command reads answers
-- nil (the caller reads it as no longer the kind it looked for). Any other error fails
-- the script as `redis.call`'s would (a key this node does not serve, a refused ACL, a
-- read-only replica): the command, which did nothing, is called again to raise it, as
-- Redis 6.2 cannot raise an error reply (its handler fails on the table).
local function typed_call(...)
    local reply = redis.pcall(...)
    if type(reply) == 'table' and reply.err then
        if string.find(reply.err, 'WRONGTYPE', 1, true) then
            return nil
        end
        return redis.call(...)
    end
    return reply
end

-- Redis's own words for the error `pcall` caught: Redis 7 raises a table {err = text};
-- 6.2 a string, which for a command refused before it ran (on a read-only replica, with
-- too few replicas) starts with the script's place and the reply's dash
-- ('@user_script: 12: -READONLY You can't write…'), taken off here: the code comes
-- first, as the checks of an error and the Redis client's reconnection read it.
local function error_text(e)
    local text = (type(e) == 'table' and e.err) or tostring(e)
    return string.match(text, '^.-: %-?%d+: %-(.-)%s*$') or text
end

-- The next fencing token of a name: the larger of one more than the last and Redis'
-- clock in microseconds, so tokens keep increasing after the counter key expired, and
-- on a promoted replica whose counter missed the old primary's last grants (those came
-- earlier on the clock). The counter lives at least `keep` ms from this grant, never
-- less than it had: a grant of a shorter lease beside a longer hold leaves it to outlive
-- that hold (Describe's latest token).
local function next_token(fence, keep)
    local token = redis.call('incr', fence)
    local t = redis.call('time')
    local clock = tonumber(t[1]) * 1000000 + tonumber(t[2])
    local ttl = redis.call('pttl', fence)
    if token < clock then
        token = clock
        redis.call('set', fence, string.format('%d', token), 'px', math.max(ttl, keep))
    elseif ttl < keep then
        redis.call('pexpire', fence, keep)
    end
    return token
end

-- `prefix:{lock}`, or `prefix:lock` when the lock's name carries a hash tag: a name in
-- the lock's cluster slot (Redisson's naming rule, as keys.rs builds them).
local function suffixed(prefix, lock)
    if string.find(lock, '{', 1, true) then
        return prefix .. ':' .. lock
    end
    return prefix .. ':{' .. lock .. '}'
end

-- The record of the latest token `lock` was passed with in memory (reserve_tokens').
local function fence_passed_of(lock)
    return suffixed('latchkey_fence_passed', lock)
end

-- Reserves the fencing tokens up to `top` for a server that passes `lock` between its
-- waiters in memory, from the grant of `token` on: the counter is raised to `top` (never
-- lowered), so any grant made elsewhere later answers a larger token, and so does
-- ForceRelease's break floor. Beside it, `latchkey_fence_passed` records `token` with the
-- counter it leaves: while the counter stays there, no token was taken since, and
-- `token` is the latest grant (describe.lua's), not the reserved top. Both live `keep`
-- ms from now at least, the record as long as the counter (a longer lease's grant may
-- have left the counter longer to live: a record gone before it, the top would read as
-- the latest grant). With `top` at `token`, nothing is reserved: a grant is recorded as
-- the latest. Returns `top`.
local function reserve_tokens(fence, lock, token, top, keep)
    local counter = tonumber(redis.call('get', fence) or '0')
    local ttl = redis.call('pttl', fence)
    local lives = math.max(ttl, keep)
    if counter < top then
        counter = top
        redis.call('set', fence, string.format('%d', top), 'px', lives)
    elseif ttl < keep then
        redis.call('pexpire', fence, keep)
    end
    local passed = string.format('%d:%d', token, counter)
    redis.call('set', fence_passed_of(lock), passed, 'px', lives)
    return top
end

-- The channel on which every change of a lock is announced (Watch listens there).
local function watch_channel(lock)
    return suffixed('latchkey_watch', lock)
end

-- The break floor of a lock: the token ForceRelease took when it last broke the lock.
-- Every hold granted before the break has a token at or below it, every later one
-- above, so a hold record at or below it belongs to a broken hold. Its owner may hold
-- the lock again through another stream: the broken record must give back, renew or
-- replay nothing of that newer hold.
-- A key of another type or a value that is no number there (an application's, under
-- that name) was written by no ForceRelease, which replaces whatever it finds: no floor.
-- Read so, it fails no script: a release of several names would otherwise fail at that
-- name's floor after freeing the names before it, leaving those after it held.
local function broken_floor(lock)
    return tonumber(typed_call('get', suffixed('latchkey_broken', lock)) or '') or 0
end

-- Whether a hold record stands for a hold that may still be held: a grant's token
-- (`record`) above the lock's break floor (not revoked, not broken), on a lease that
-- has not run out. A record lives GRACE_MS past its lease, set beside the lock's own
-- expiry in the same script: with `ttl` (the record's PTTL) no more than that, the
-- lease ended, and the lock may have expired and been taken anew by another stream
-- of the same owner, whose hold this record must not give back, renew or replay.
-- `floor` when read already.
local function live_record(record, ttl, lock, floor)
    local token = tonumber(record or '')
    return token ~= nil and ttl > GRACE_MS and token > (floor or broken_floor(lock))
end

-- Announces that a lock changed: granted, released, queued, broken. PUBLISH is set by
-- the catalogue: sharded on a cluster.
local function changed(lock)
    redis.call(PUBLISH, watch_channel(lock), '1')
end

-- Records a grant of `lock` with its `token` in the stream's hold record. A script
-- takes the token (next_token) before its first write: Redis keeps what a script wrote
-- before an error, and a fencing counter that is no counter (a foreign key under the
-- name) must fail the script before it changed anything.
local function grant(lock, token, hold, keep)
    redis.call('set', hold, string.format('%d', token), 'px', keep)
    changed(lock)
    return token
end

-- What a release leaves in place of a hold record it did not find: the grant it gave
-- back may still be on its way (a call whose reply timed out, still queued on a
-- connection), and when it comes it must grant nothing.
local REVOKED = 'revoked'

-- What a give-back leaves of the hold record it takes: the release scripts' argument
-- (GiveBack::flag in the server). PASSED: the give-back of a pass in memory whose
-- recording failed (release.lua), REVOKE unless the record holds another grant.
local RELEASE, REVOKE, RETRY, PASSED = '0', '1', '2', '3'

-- Gives back a hold record of `lock`, true when it was there and not broken. `giving`
-- REVOKE (a release of a stream some try of which had an unknown outcome: it may still
-- be on its way): a revoked record stands in its place for REVOKED_MS, whatever was
-- there. RELEASE: so does one in place of a record revoked, lapsed or broken already.
-- RETRY (the give-back of what a try that answered took, its stream trying again):
-- only a revoked one stays revoked; a lapsed or broken record left revoked would answer
-- each later try of the stream busy.
-- Second, whether the record was a grant's at or below the floor: ForceRelease broke it.
local function take_record(hold, giving, lock)
    local floor = broken_floor(lock)
    local ttl = redis.call('pttl', hold)
    local record = redis.call('getdel', hold)
    local live = live_record(record, ttl, lock, floor)
    if giving == REVOKE or (record and not live and (record == REVOKED or giving ~= RETRY)) then
        redis.call('set', hold, REVOKED, 'px', REVOKED_MS)
    end
    local granted = tonumber(record or '')
    return live, granted ~= nil and granted <= floor
end

-- Extends `key` to live at least `ms` more, never shortening it (a key that is not
-- there stays so).
local function lengthen(key, ms)
    local ttl = redis.call('pttl', key)
    if ttl ~= -2 and ttl < ms then
        redis.call('pexpire', key, ms)
    end
end

-- Takes a semaphore hold's fields out of its hash (`semaphore`) and gives its permits
-- back; answers the permits used after. A hold whose permits field is gone (the hash
-- evicted or edited apart from the holds) has its count unknown: the used count is
-- counted again from the holds left in `holds`, rather than a `-0` that HINCRBY would
-- refuse, failing the script after its first write and leaving the count up for good.
local function drop_permits(semaphore, holds, id)
    local permits = redis.call('hget', semaphore, 'p:' .. id)
    redis.call('hdel', semaphore, 'p:' .. id, 'o:' .. id, 't:' .. id)
    if permits then
        return redis.call('hincrby', semaphore, 'used', -tonumber(permits))
    end
    local used = 0
    for _, other in ipairs(redis.call('zrange', holds, 0, -1)) do
        used = used + tonumber(redis.call('hget', semaphore, 'p:' .. other) or '0')
    end
    if redis.call('exists', semaphore) == 1 then
        redis.call('hset', semaphore, 'used', used)
    end
    return used
end

-- Redisson's default lockWatchdogTimeout: its watchdog renews a lock every third of it.
local REDISSON_WATCHDOG_MS = 30000

-- What a read/write hold's timeout key holds: `<lock>\n<hold record key>`, the lock
-- it belongs to and the hold it times (Redisson's hold 1, which tells neither; an
-- older latchkey's the lock alone). Lock keys hold no control characters.
local function timeout_value(lock, hold)
    return lock .. '\n' .. hold
end

-- The timeout key of the next read/write hold of `field` on `lock` (`<prefix>:<n>`, n its
-- holds plus one), and the key's PTTL when another lock keeps it (else nil).
-- Redisson's layout builds the key from the lock's name and the owner
-- (`{lock}:<owner>:rwlock_timeout:<n>`), so one lock's and owner's key can be another's:
-- `{t}:a` read by owner `eu:w1` and `{t}:a:eu` read by owner `w1`. latchkey's keys name
-- their lock (timeout_value): a live one of another lock keeps this hold from being
-- granted until it ends, so that neither lock's holds cut the other's short.
local function next_timeout(prefix, lock, field)
    local timeout = prefix .. ':' .. (tonumber(redis.call('hget', lock, field) or '0') + 1)
    local kept_by = redis.call('get', timeout)
    if kept_by and kept_by ~= '1' and string.match(kept_by, '^[^\n]*') ~= lock then
        return timeout, redis.call('pttl', timeout)
    end
    return timeout, nil
end

-- What a read/write lock's per-hold timeout keys start with (Redisson's key prefix:
-- `{lock}`, or the lock itself when it carries a hash tag; keys.rs's rw_prefix).
local function rw_prefix(lock)
    return string.find(lock, '{', 1, true) and lock or '{' .. lock .. '}'
end

-- The most holds a hash with a `mode` may count in all to be read as a read/write lock
-- (by a try, Describe, List and ForceRelease), and the most timeout keys of one holder
-- a script reads: they are read one per hold, and an application's hash that looks
-- like a lock (a `mode` of read and a count in the millions) would otherwise block
-- Redis for every client while one script read them, past SCRIPT KILL once it wrote.
-- No read/write lock in use holds this many.
local INSPECTED_HOLDS = 65536

-- How many of a holder's `count` timeout keys a script reads (INSPECTED_HOLDS).
local function keys_read(count)
    return math.min(tonumber(count), INSPECTED_HOLDS)
end

-- Deletes the timeout keys of every hold the read/write lock `lock` counts that name
-- it (timeout_value; an older latchkey's, the lock alone): its holds broken, nothing
-- gives them back, and a key left would live out its hold's lease (an hour, for a long
-- fixed lease) and keep a lock whose keys are the same strings from being granted
-- (next_timeout). Redisson's keys (`1`) name no lock and may be another's: they go
-- at their TTL, which Redisson no longer renews once its hold is gone. A key of
-- another type is no timeout key: left alone, not an error after the break's writes.
local function drop_own_timeouts(lock)
    local fields = redis.call('hgetall', lock)
    for i = 1, #fields, 2 do
        local count = tonumber(fields[i + 1])
        if fields[i] ~= 'mode' and count then
            local prefix = rw_prefix(lock) .. ':' .. fields[i] .. ':rwlock_timeout:'
            for n = 1, keys_read(count) do
                local value = typed_call('get', prefix .. n)
                if value and string.match(value, '^[^\n]*') == lock then
                    redis.call('del', prefix .. n)
                end
            end
        end
    end
end

-- The longest PTTL of a holder's `count` timeout keys under `prefix` (`<prefix>:<n>`),
-- -2 for none; a key missing or without expiry counts as `missing`, when given.
local function longest_timeout(prefix, count, missing)
    local longest = -2
    for i = keys_read(count), 1, -1 do
        local ttl = redis.call('pttl', prefix .. ':' .. i)
        if ttl < 0 and missing then
            ttl = missing
        end
        longest = math.max(longest, ttl)
    end
    return longest
end

-- A holder's `count` timeout keys under `prefix` (`<prefix>:<n>`), read once: `named`,
-- the index of each that names its hold, by its value; `unnamed`, the indexes of the
-- others that are there (Redisson's, an older latchkey's: many may hold one value).
local function timeouts_of(prefix, count)
    local named, unnamed = {}, {}
    for i = 1, keys_read(count) do
        local value = redis.call('get', prefix .. ':' .. i)
        if value and string.find(value, '\n', 1, true) then
            named[value] = i
        elseif value then
            unnamed[#unnamed + 1] = i
        end
    end
    return {named = named, unnamed = unnamed}
end

-- Lengthens the timeout key of the hold whose record is `hold` (of `lock`), among a
-- holder's `count` keys under `prefix`, to `ms`, never shortening it. Only its own:
-- streams of one owner hold on leases of their own, and one that lapsed (its server
-- gone) must not live on with another's time. A hold whose key names no hold (one an
-- older latchkey made, or a key gone) lengthens the keys that name none, as every key
-- was. `at`: timeouts_of's answer, when read already.
local function lengthen_own_timeout(prefix, count, lock, hold, ms, at)
    at = at or timeouts_of(prefix, count)
    local own = at.named[timeout_value(lock, hold)]
    if own then
        lengthen(prefix .. ':' .. own, ms)
        return
    end
    for _, i in ipairs(at.unnamed) do
        lengthen(prefix .. ':' .. i, ms)
    end
end

-- Which of a holder's `count` timeout keys under `prefix` (`keys`: timeouts_of's
-- answer) a hold whose own key is not among them gives back, its own lease having
-- `own` ms left. Never a key that names another hold, which is that hold's: a key gone
-- first (this hold's, deleted: a Redisson unlock by index of a thread sharing the
-- owner, or by hand); else of those that name none (an older latchkey's), the shortest
-- that lasts at least `own`, so no other live hold's is cut short (none lasting that
-- long: a key another client shortened; the shortest goes).
local function unnamed_timeout(prefix, count, own, keys)
    local others = {}
    for _, i in pairs(keys.named) do
        others[i] = true
    end
    local fits, fits_at, shortest, shortest_at = nil, nil, nil, nil
    for i = keys_read(count), 1, -1 do
        local ttl = others[i] == nil and redis.call('pttl', prefix .. ':' .. i)
        if ttl == -2 then
            return i
        elseif ttl and ttl >= own and (fits == nil or ttl < fits) then
            fits, fits_at = ttl, i
        end
        if ttl and (shortest == nil or ttl < shortest) then
            shortest, shortest_at = ttl, i
        end
    end
    return fits_at or shortest_at or count
end

-- Moves the timeout key `from` to `to`: its value and TTL, or `to` deleted when `from`
-- is gone or lasts no more (read as gone when of another type). `from` stays.
local function move_timeout(from, to)
    local value, ttl = typed_call('get', from), redis.call('pttl', from)
    if value and ttl > 0 then
        redis.call('set', to, value, 'px', ttl)
    else
        redis.call('del', to)
    end
end

-- Gives back one of a holder's timeout keys as its hold (record `hold` of `lock`)
-- goes: `left` holds remain, so `<prefix>:<left + 1>` is the key to drop, and the
-- hold's own key takes its place, value and TTL. The keys are numbered by hold count,
-- not by stream, and streams of one owner may end in any order. A hold whose key names
-- no hold, or is gone, gives back the one unnamed_timeout picks.
local function give_back_timeout(prefix, left, own, lock, hold)
    local last = prefix .. ':' .. (left + 1)
    local keys = timeouts_of(prefix, left + 1)
    local at = keys.named[timeout_value(lock, hold)] or unnamed_timeout(prefix, left + 1, own, keys)
    if at ~= left + 1 then
        move_timeout(last, prefix .. ':' .. at)
    end
    redis.call('del', last)
end

-- What is left of a hold's lease, from its record (which outlives the lease by the
-- grace), less a few ms: the hold's timeout key and record are set by one script but
-- not in the same ms (Redis 7.0 does not stop its clock for a script), so the key may
-- end a ms before the record's lease does, and it must still be found to be this hold's.
local function lease_left(hold)
    return redis.call('pttl', hold) - GRACE_MS - 5
end

-- A replayed grant: the hold record exists and its field still holds the lock. A
-- record whose hold has gone (the lease ran out, or ForceRelease broke it) is removed
-- and not a grant. A replay starts the lease again (`lease` ms, the record `grace` ms
-- longer): the server counts the lease from the try that hears of the grant, which may
-- come long after the try that made it. Returns the grant's reply, nil when there is
-- none, false when the hold was revoked.
local function replay(hold, lock, field, lease, grace)
    local record = redis.call('get', hold)
    if not record then
        return nil
    end
    if record == REVOKED then
        return false
    end
    local count = live_record(record, redis.call('pttl', hold), lock) and redis.call('hget', lock, field)
    if count then
        local keep = tonumber(lease) + tonumber(grace)
        lengthen(lock, tonumber(lease))
        redis.call('pexpire', hold, keep)
        -- The counters that tell the latest token live as long as the hold's record,
        -- as at its grant: Describe shows the token, and the next grant draws above it.
        lengthen(suffixed('latchkey_fence', lock), keep)
        lengthen(fence_passed_of(lock), keep)
        return {1, tonumber(record), tonumber(count)}
    end
    redis.call('del', hold)
    return nil
end

-- A single name's replayed grant as its acquire replies: the grant, {0, -1, 0} when the
-- hold was revoked (a try that finds it busy, with nothing to wait for), or nil when
-- there is none to replay.
local function replayed_reply(hold, lock, field, lease, grace)
    local replayed = replay(hold, lock, field, lease, grace)
    if replayed == false then
        return {0, -1, 0}
    end
    return replayed
end

-- What a lock key is held as: 'none', 'lock' (mutex or fair), 'read', 'write',
-- 'semaphore', or 'other' (a key that is no lock: a hash whose `mode` is none a lock
-- writes is an application's).
local function held_as(lock)
    local t = redis.call('type', lock)['ok']
    if t == 'none' then
        return 'none'
    elseif t == 'zset' then
        return 'semaphore'
    elseif t ~= 'hash' then
        return 'other'
    end
    local mode = redis.call('hget', lock, 'mode')
    if not mode then
        return 'lock'
    elseif mode == 'read' or mode == 'write' then
        return mode
    end
    return 'other'
end

-- Whether a fair waiter still waits (its deadline, in `deadlines`, not passed): a queue
-- left by waiters that are gone (a crashed client's entries, which only a fair request
-- sweeps) keeps no other kind off the name.
local function fair_waiting(deadlines)
    return redis.call('zcount', deadlines, '(' .. now_ms(), '+inf') > 0
end

-- Whether a name that `kind` (held_as) reads as free is a fair lock between two holders,
-- its waiters still waiting (`deadlines`): theirs, and no other kind's.
local function fair_between_holders(kind, deadlines)
    return kind == 'none' and fair_waiting(deadlines)
end

-- Whether every field of the hash `lock` but `mode` is a hold count as Describe reads
-- one: a positive integer of 32 bits; with `bounded`, at most INSPECTED_HOLDS in all.
local function only_hold_counts(lock, bounded)
    -- A lock's hash has a field per owner holding it, and its mode: one with more
    -- fields than the holds inspected is none, found without reading it (reading an
    -- application's hash of millions of fields would block Redis for every client).
    if redis.call('hlen', lock) > INSPECTED_HOLDS + 1 then
        return false
    end
    local fields = redis.call('hgetall', lock)
    local holds = 0
    for i = 2, #fields, 2 do
        local count = fields[i]
        local valid = string.match(count, '^[1-9]%d*$') and #count <= 10 and tonumber(count) <= 4294967295
        if fields[i - 1] ~= 'mode' then
            if not valid then
                return false
            end
            holds = holds + tonumber(count)
        end
    end
    return not bounded or holds <= INSPECTED_HOLDS
end

-- held_as for a try of another kind than a semaphore: a latchkey semaphore whose holds
-- all ran out (their servers died before giving them back, and no semaphore try has
-- cleared them since) holds nothing, as Describe reads it, and is cleared for the name
-- to be taken. Any other sorted set stays, and keeps the name. A hash is an
-- application's (a try would join it, a waiter wait on it for good, and a read's
-- release delete it) when a mutex's has more than its one holder's field, when one of
-- a few fields is no hold count or they count more holds than any lock, as Describe
-- reads them, or when a read/write hash has no lifetime, which every lock's hash has
-- (Redisson's and latchkey's). A mutex's without one is taken for a lock whose
-- lifetime an operator took (`PERSIST`): its waiters wait, as they would have before.
-- A read/write hash of many fields with a lifetime is taken for a lock, as reading
-- every reader's field at each try would cost a lock of thousands of readers the
-- square of their number (its scripts read at most INSPECTED_HOLDS keys a holder).
local LOOKED_OVER_FIELDS = 64
local function held_for_taking(lock)
    local kind = held_as(lock)
    if kind == 'semaphore' then
        local semaphore = suffixed('latchkey_semaphore', lock)
        if redis.call('zcount', lock, '(' .. now_ms(), '+inf') == 0 and redis.call('type', semaphore)['ok'] == 'hash' then
            redis.call('del', lock, semaphore)
            return 'none'
        end
    elseif kind ~= 'none' and kind ~= 'other' then
        local fields = redis.call('hlen', lock)
        if (kind == 'lock' and fields > 1) or (kind ~= 'lock' and redis.call('pttl', lock) == -1)
            or (fields <= LOOKED_OVER_FIELDS and not only_hold_counts(lock, kind ~= 'lock')) then
            return 'other'
        end
    end
    return kind
end

-- How far past its lease a latchkey read's timeout key must last to have been lengthened
-- by another than its server (a Redisson reader's renewal): more than the few ms
-- between the key's and its record's writes in one script.
local KEPT_PAST_MS = 1000
-- The most holds a writer's try looks through for lapsed reads: each costs a read or
-- three, at every try of every waiting writer.
local SWEPT_HOLDS = 1024

-- Renumbers a holder's timeout keys under `prefix` (`<prefix>:<n>`, `count` of them)
-- to those at `kept` (their indexes, rising), in order from 1, deleting the rest; a
-- missing key stays missing in its new place (a hold still counted).
local function keep_timeouts(prefix, kept, count)
    for i, n in ipairs(kept) do
        if n ~= i then
            move_timeout(prefix .. ':' .. n, prefix .. ':' .. i)
        end
    end
    for n = #kept + 1, count do
        redis.call('del', prefix .. ':' .. n)
    end
end

-- Takes off the read/write lock `lock` the read holds of latchkey's whose lease ran out
-- unreleased (their server died, or lost Redis), their timeout keys kept by a Redisson
-- reader's renewal, which lengthens every reader's: a Redisson reader's unlock would
-- keep the lock up for those keys' TTL (its watchdog's 30 s) with nobody else holding,
-- announcing nothing. Each such key names its hold record (timeout_value), which
-- outlives a lease by the grace: a key whose record is no longer live marks a lapsed
-- hold (every key of a stream granted again under its record after such a lapse). A
-- write's keys stay (write_lapsed judges a write), and so do keys that name no hold
-- (Redisson's, an older latchkey's), which time out with their owner. A lock of more
-- fields than a try looks over (held_for_taking), or more holds than SWEPT_HOLDS, is
-- not read. A holder with a key of another type among its keys keeps them all.
-- Returns whether the lock went with the last hold, and the ms until the first latchkey
-- read left may lapse, for a writer to look again then, while something may keep its
-- key past its lease (a reader of Redisson's shape among the holds, or a key already
-- lengthened past it), else nil: a key that ends with its lease ends the lock with it.
local function drop_lapsed_reads(lock)
    if redis.call('hlen', lock) > LOOKED_OVER_FIELDS + 1 then
        return false, nil
    end
    local fields = redis.call('hgetall', lock)
    local holds = 0
    for i = 2, #fields, 2 do
        holds = holds + math.max(tonumber(fields[i]) or 0, 0)
    end
    if holds > SWEPT_HOLDS then
        return false, nil
    end
    -- Each hold record's lease left (false: no longer live), read once.
    local floor, records, dropped, lapse, kept = broken_floor(lock), {}, false, nil, false
    for i = 1, #fields, 2 do
        local count = tonumber(fields[i + 1])
        if fields[i] ~= 'mode' and count and not string.find(fields[i], ':write$') then
            local prefix = rw_prefix(lock) .. ':' .. fields[i] .. ':rwlock_timeout'
            -- `foreign`: a key of another type among them (an application's), which a
            -- renumbering would delete or overwrite: the holder's keys stay as they are.
            local staying, foreign = {}, false
            for n = 1, count do
                local value = typed_call('get', prefix .. ':' .. n)
                foreign = foreign or (not value and redis.call('exists', prefix .. ':' .. n) == 1)
                local of, hold = string.match(value or '', '^([^\n]*)\n(.*)$')
                if of == lock and records[hold] == nil then
                    local ttl = redis.call('pttl', hold)
                    records[hold] = live_record(typed_call('get', hold), ttl, lock, floor) and ttl - GRACE_MS
                end
                -- nil: no hold of latchkey's on this lock; false: one that lapsed.
                local left = nil
                if of == lock then
                    left = records[hold]
                end
                if left then
                    lapse = math.min(lapse or math.huge, left)
                    kept = kept or redis.call('pttl', prefix .. ':' .. n) > left + KEPT_PAST_MS
                elseif value and of ~= lock then
                    kept = true
                end
                if left ~= false then
                    staying[#staying + 1] = n
                end
            end
            if #staying < count and not foreign then
                keep_timeouts(prefix, staying, count)
                if #staying == 0 then
                    redis.call('hdel', lock, fields[i])
                else
                    redis.call('hset', lock, fields[i], #staying)
                end
                dropped = true
            end
        end
    end
    lapse = kept and lapse or nil
    if not dropped then
        return false, lapse
    end
    changed(lock)
    if redis.call('hlen', lock) > 1 then
        return false, lapse
    end
    redis.call('del', lock)
    return true, lapse
end

-- held_as for Describe, List and ForceRelease, which meet any key under a name: a sorted
-- set is a semaphore only beside its hash `semaphore` (Redisson's fair deadline sets,
-- latchkey's claim sets and an application's own sorted sets are none), and a hash is a
-- lock only when its mode (none, read or write) and every other field are a lock's (an
-- application's hash, a Java RMap, is none), else 'other'.
local function inspected_as(lock, semaphore)
    local kind = held_as(lock)
    if kind == 'semaphore' and redis.call('type', semaphore)['ok'] ~= 'hash' then
        return 'other'
    elseif kind == 'none' or kind == 'semaphore' or kind == 'other' then
        return kind
    elseif not only_hold_counts(lock, kind ~= 'lock') then
        return 'other'
    end
    return kind
end

-- The latest grant's token of `lock`, whose fencing counter is `fence`: the counter's,
-- but while the counter stands where a recording of passes in memory (reserve_tokens)
-- or a break (force_release.lua) left it, the grant that record names. False for none.
-- (A foreign key under the counter's or the record's name, such as another client's
-- lock named so, is none: it reads as absent.)
local function latest_token(lock, fence)
    local last = typed_call('get', fence) or false
    local passed, left = string.match(typed_call('get', fence_passed_of(lock)) or '', '^(%d+):(%d+)$')
    if last and left == last then
        return passed
    end
    return last
end

-- The hold count of `field` on a mutex or fair lock, or nil when the field holds none
-- there (or the key is another kind: a read/write lock's hash has a mode field, a
-- semaphore is no hash at all).
local function lock_holds(lock, field)
    local v = typed_call('hmget', lock, field, 'mode')
    if not v or v[2] or not v[1] then
        return nil
    end
    return tonumber(v[1])
end

-- Removes the fair waiters at the head of the queue whose deadline passed (their
-- server stopped refreshing them), and returns the first live one. `now` (Redis' clock
-- in ms) is read only when there is a head to check, unless given.
-- A queue key of another type (an application's, a Java lock named like it) holds no
-- waiter: read as none, not failing the script after the writes of a release. (A fair
-- acquire refuses such a name first.) `keep`, when given, is taken for live at the head
-- whatever its deadline (its own script takes it out).
local function live_head(queue, timeouts, now, keep)
    while true do
        local head = typed_call('lindex', queue, 0)
        if not head then
            return nil
        end
        now = now or now_ms()
        local deadline = tonumber(redis.call('zscore', timeouts, head))
        if head == keep or (deadline and deadline > now) then
            return head
        end
        redis.call('lpop', queue)
        redis.call('zrem', timeouts, head)
    end
end

-- Bounded passing. A mutex handed from its holder straight to a waiter (a handoff to a
-- waiter of the releasing server, or a claim's grant) is never free in between, so a
-- waiter that no release can count would never find it free: a Redisson client
-- subscribed on a replica (Redisson's default `subscriptionMode` with Sentinel or
-- master/replica servers), or one that polls with tryLock (which hits the moments
-- below by chance only). So a mutex passed on for PASS_FOR_MS since it was last free
-- is freed once (with the unlock message, which replicas relay), and latchkey's tries
-- leave it free for YIELD_MS: whoever else waits takes it then, or latchkey's waiters
-- take it after.
local PASS_FOR_MS = 2000
local YIELD_MS = 5

-- The passing marker of a mutex: the Redis time of its first direct pass since it was
-- last free (a try that finds the lock free forgets it), or YIELDING while it is left
-- to others. It lives a pass's `keep` from the last pass.
local YIELDING = 'yield'
local function passing_of(lock)
    return suffixed('latchkey_passing', lock)
end

-- Whether the freed mutex `lock` may be passed straight to a waiter now (the pass's
-- hold record lives `keep` ms). False once it has been passed on for PASS_FOR_MS: it
-- is then left to others for YIELD_MS, and the caller publishes the unlock message.
-- `now` (Redis' clock in ms) is read here unless given.
local function may_pass(lock, keep, now)
    local key = passing_of(lock)
    local since = redis.call('get', key)
    if since == YIELDING then
        return false
    end
    now = now or now_ms()
    since = tonumber(since or '') or now
    if now - since >= PASS_FOR_MS then
        redis.call('set', key, YIELDING, 'px', YIELD_MS)
        return false
    end
    redis.call('set', key, string.format('%d', since), 'px', keep)
    return true
end

-- For a pass the server made in memory, which cannot be undone: keeps the marker as
-- may_pass does, and says whether more passes may follow. Once PASS_FOR_MS have gone
-- it leaves the marker as it was, and the next release's may_pass yields the lock.
local function passed_on(lock, keep)
    local key = passing_of(lock)
    local since = redis.call('get', key)
    if since == YIELDING then
        return false
    end
    local now = now_ms()
    since = tonumber(since or '') or now
    redis.call('set', key, string.format('%d', since), 'px', keep)
    return now - since < PASS_FOR_MS
end

-- For a try that found the mutex `lock` free with a passing marker: the ms it is still
-- left to others (at least 1), or nil, the marker forgotten, when that passing is over.
local function left_to_others(lock)
    local key = passing_of(lock)
    if redis.call('get', key) == YIELDING then
        return math.max(redis.call('pttl', key), 1)
    end
    redis.call('del', key)
    return nil
end

-- How long a claim outlives the holder's TTL its waiter was told: the waiter tries
-- again by then (renewing its claim), unless its server is gone.
local CLAIM_SLACK_MS = 2000

-- Mutex waiters of any server that a release may grant the lock to directly (claims): a
-- sorted set of `<hold id>\n<lease ms>\n<grace ms>\n<owner>` by deadline (Redis' clock).
-- A hold id starts with its server's id (`<server>:<n>`).
local function claims_of(lock)
    return suffixed('latchkey_claims', lock)
end

-- The message a granted claim's server hears on the unlock channel (Redisson's
-- subscribers ignore it, and none listens when it is sent):
-- `latchkey:granted\n<hold id>\n<token>\n<lock>\n<owner>\n<lease ms>`. The lock and
-- owner let the server give the grant back when no waiter of its stands for the claim
-- any more; the lease tells other servers' waiters when to look again at the latest.
local CLAIM_GRANTED = 'latchkey:granted\n'

-- The server id of a hold id or of a hold record's key (`…<server>:<n>`).
local function server_of(hold)
    return string.match(hold, '([^:]*):%d+$')
end

-- Whether `server` listens on its presence channel of `lock`, which it subscribes
-- while a waiter of its may leave a claim there (keys.rs's `presence`): a claim of a
-- server gone without removing it (crashed, cut off) is then told from a live one,
-- whatever other listeners stand in for it on the lock's channel.
local function present(lock, server)
    local channel = suffixed('latchkey_present', lock) .. ':' .. server
    return redis.call('pubsub', PUBSUB_NUMSUB, channel)[2] > 0
end

-- A server's turn on a hot mutex: for TURN_MS after a release granted it a claim, the
-- server may pass the lock among its own waiters (by a handoff, then in memory) while
-- every other listener is a server with a claim, which gets the lock when the turn is
-- over. Servers that take turns grant by grant make each grant a handoff between two
-- processes through Redis; a turn lets the passes in memory of one server run a
-- little. The handoff tells the server how long its turn has left, and it passes in
-- memory no longer (relay.rs). The key names the server whose turn it is, and lives
-- TURN_MS.
local TURN_MS = 2
local function turn_of(lock)
    return suffixed('latchkey_turn', lock)
end

-- The live claims on the mutex `lock` (each `{claim, hold id, lease, grace, owner}`, in
-- deadline order), and Redis' time in ms, when the listeners on its unlock channel but `own` are exactly the
-- servers with claims (no Redisson client or unclaimed waiter is passed over); nil
-- otherwise. The claims of a server that is not present (`present`: its connection is
-- gone) are dropped first, so that neither is one of them granted nor does another
-- listener (a Redisson client) make up its count. `own`, when given, is the releasing
-- server, which listens and whose claims are left out. A claim whose deadline passed
-- (its server stopped trying) is dropped.
local function claimants(lock, channel, own)
    -- Listeners first: an uncontended lock has none, and costs no more.
    local listeners = redis.call('pubsub', PUBSUB_NUMSUB, channel)[2] - (own and 1 or 0)
    if listeners < 1 then
        return nil
    end
    local claims = claims_of(lock)
    local now = now_ms()
    -- An application's key there holds no claim: the release goes as a plain one.
    if not typed_call('zremrangebyscore', claims, '-inf', now) then
        return nil
    end
    local live, servers, count = {}, {}, 0
    for _, claim in ipairs(redis.call('zrange', claims, 0, -1)) do
        local hold_id, lease, grace, owner = string.match(claim, '^([^\n]*)\n(%d+)\n(%d+)\n(.*)$')
        local server = hold_id and server_of(hold_id)
        if server and server ~= own and servers[server] == nil then
            servers[server] = present(lock, server)
            count = count + (servers[server] and 1 or 0)
        end
        if server and servers[server] == false then
            redis.call('zrem', claims, claim)
        elseif server == nil or server ~= own then
            live[#live + 1] = {claim, hold_id, lease, grace, owner}
        end
    end
    if listeners ~= count then
        return nil
    end
    return live, now
end

-- The ms left of the turn of `server`, which holds the mutex `lock` (at least 1), when
-- it is in its turn and every other listener waits for the lock with a claim: it may
-- keep the lock among its own waiters that long. Nil otherwise; a server never granted
-- a claim has no turn.
local function turn_left(lock, channel, server)
    local turn = turn_of(lock)
    if redis.call('get', turn) ~= server or not claimants(lock, channel, server) then
        return nil
    end
    return math.max(redis.call('pttl', turn), 1)
end

-- Grants the freed mutex `lock` to a live claim (claimants) and tells the claim's
-- server, whose turn begins. `own`, when given, is the releasing server, which listens
-- and is passed over, its claims too: it has nobody waiting (its subscription outlives
-- its last waiter a moment), or its waiters just had the lock (a handoff to them
-- refused because others listen, its turn over). Servers with waiters then take turns.
-- Returns whether it granted. A claim whose stream has a hold record (revoked: its
-- waiter left) is dropped. A grant is a pass (may_pass): a lock passed on long enough
-- is not granted.
local function grant_claim(lock, channel, own)
    local live, now = claimants(lock, channel, own)
    if not live then
        return false
    end
    local claims = claims_of(lock)
    for _, parts in ipairs(live) do
        local claim, hold_id, lease, grace, owner = unpack(parts)
        local hold = hold_id and suffixed('latchkey_hold', lock) .. ':' .. hold_id
        if hold and redis.call('exists', hold) == 0 then
            local keep = tonumber(lease) + tonumber(grace)
            -- A lock passed on long enough goes to nobody in particular; the claim stays.
            if not may_pass(lock, keep, now) then
                return false
            end
            redis.call('zrem', claims, claim)
            local ok, token = pcall(next_token, suffixed('latchkey_fence', lock), keep)
            if not ok then
                return false
            end
            redis.call('hset', lock, owner, 1)
            redis.call('pexpire', lock, lease)
            grant(lock, token, hold, keep)
            redis.call('set', turn_of(lock), server_of(hold_id), 'px', TURN_MS)
            local message = {hold_id, string.format('%d', token), lock, owner, lease}
            redis.call(PUBLISH, channel, CLAIM_GRANTED .. table.concat(message, '\n'))
            return true
        end
        redis.call('zrem', claims, claim)
    end
    return false
end

-- Wakes who may take a freed mutex or fair lock: `head`, the first live fair waiter
-- (live_head), and the general channel, for Redisson's waiters; else a claim granted at
-- once (announced as a grant); else every waiter with Redisson's unlock message "0".
-- Watch hears of the release on the watch channel: it does not listen on the unlock
-- channel, whose listeners grant_claim and the handoff count. (`own` as in grant_claim.)
-- Returns whether it sent the unlock message "0", which every server's waiters hear.
local function freed(lock, channel, head, own)
    if head then
        redis.call(PUBLISH, channel, '0')
        redis.call(PUBLISH, channel .. ':' .. head, '0')
    elseif grant_claim(lock, channel, own) then
        return false
    else
        redis.call(PUBLISH, channel, '0')
    end
    changed(lock)
    return true
end

-- Redisson's owner ids: its client's UUID and a thread id (a Java long, negative too:
-- Redisson's async APIs take whatever id their caller gives).
local REDISSON_ID = '^%x%x%x%x%x%x%x%x%-%x%x%x%x%-%x%x%x%x%-%x%x%x%x%-%x%x%x%x%x%x%x%x%x%x%x%x:%-?%d+$'

-- Whether a fair queue entry is one only latchkey queues, whose server keeps its
-- deadline fresh while it waits: a stream's own owner id (`<server id>:<n>`), or an
-- owner a client named that Redisson would not make. An entry shaped like Redisson's
-- may be a Redisson waiter (or a Java thread's id a client named to share its holds):
-- it is never refreshed, or may be granted the lock by Redisson's script, which takes
-- a Redisson wait off every deadline in the queue. Those behind such an entry are
-- pushed out by that wait (`needed`), so a crashed server's waiter among them keeps
-- the free lock from everyone until then; named owners of other shapes do not.
local function refreshed(entry)
    return string.sub(entry, 1, #SERVER_ID_PREFIX) == SERVER_ID_PREFIX or not string.find(entry, REDISSON_ID)
end

-- Whether the write holds of `owner` on the read/write lock `lock` all lapsed: it has
-- a write field, its every timeout key is gone, and it is latchkey's (`refreshed`: a
-- Redisson writer's holds have no timeout keys, its watchdog keeps the lock). A
-- latchkey write hold's timeout key lives as long as its lease: gone, the hold's server
-- died or lost Redis before giving it back, and its field would keep other owners'
-- readers out for as long as the owner's reads on other servers keep the lock alive.
-- `write_left`: how long the longest of those holds has left (0 or less: all lapsed),
-- nil when `owner` has no write or it is not latchkey's.
local function write_left(lock, owner)
    local field = owner .. ':write'
    local count = tonumber(redis.call('hget', lock, field) or '')
    if not count or not refreshed(owner) then
        return nil
    end
    return longest_timeout(rw_prefix(lock) .. ':' .. field .. ':rwlock_timeout', count)
end
local function write_lapsed(lock, owner)
    local left = write_left(lock, owner)
    return left ~= nil and left <= 0
end

-- The owner of a write-mode lock's write. A write-mode hash holds one owner's write and
-- reads beside its `mode`: one with more fields is no lock of Redisson's layout, and is
-- not read.
local function writer_of(lock)
    if redis.call('hlen', lock) > 3 then
        return nil
    end
    for _, field in ipairs(redis.call('hkeys', lock)) do
        local owner = string.match(field, '^(.+):write$')
        if owner then
            return owner
        end
    end
    return nil
end

-- Takes `owner`'s lapsed write (write_lapsed) off the lock `lock`: the owner's reads stay,
-- the lock now in read mode for other readers to join, or the lock goes; the
-- read-unlock message on `channel` wakes every waiting reader. True when the lock went.
local function drop_lapsed_write(lock, owner, channel)
    redis.call('hdel', lock, owner .. ':write')
    local gone = redis.call('hlen', lock) <= 1
    if gone then
        redis.call('del', lock)
    else
        redis.call('hset', lock, 'mode', 'read')
    end
    redis.call(PUBLISH, channel, '1')
    changed(lock)
    return gone
end

-- Keeps a fair lock's queue keys alive past every entry's deadline (Redisson's entries
-- included), so a queue whose waiters all died goes away, and a live entry never loses
-- its queue: `stay` ms past the latest deadline, as a Redisson waiter that queues
-- behind the last entry takes that entry's deadline plus its wait time, and sets no
-- lifetime. A queue without one (Redisson's, or one a Redisson waiter ended once) gets
-- one once a latchkey entry is last: the lifetime lies past every deadline in it,
-- and a Redisson waiter that joins later is seen at the next refresh. (Given back only
-- to a queue this script created, a queue whose end a Redisson-shaped owner had once
-- held stayed for good after its latchkey waiters crashed.) Run whenever a script
-- changes the queue; a queue left empty is gone already.
local function keep_queue(queue, deadlines, now, stay)
    local last = redis.call('zrange', deadlines, -1, -1, 'withscores')
    if not last[2] then
        return
    end
    -- A Redisson waiter joined at the end: it never refreshes the lifetime, and one that
    -- joins behind it takes a deadline past it. Its queue lives as Redisson's do, with
    -- no lifetime; Redisson's sweeps take out its dead entries.
    if not refreshed(redis.call('lindex', queue, -1) or SERVER_ID_PREFIX) then
        redis.call('persist', queue)
        redis.call('persist', deadlines)
        return
    end
    -- Set, not only raised: once the deadlines that pushed it out come down, a queue
    -- of waiters whose server then crashed goes as soon as they do.
    local keep = math.max(tonumber(last[2]) - now, stay) + stay + 1000
    redis.call('pexpire', queue, keep)
    redis.call('pexpire', deadlines, keep)
end

-- How long Redisson's fair waiters wait (`fairLockWaitTimeout`, 5 min by default).
-- Redisson gives a waiter the deadline of the one ahead plus this once, never refreshes
-- it, and takes this off every deadline in the queue when one of its clients is granted
-- the lock from it: its waiters stay this far apart, or a grant leaves them expired.
local REDISSON_WAIT_MS = 300000

-- How far ahead of a waiter a refresh looks for entries Redisson may have queued, when
-- it looks: a refresh costs no more than this in a long queue. A waiter further back is
-- refreshed again, and counts them, long before its turn comes near, unless that many
-- grants pass within one refresh (a third of --fair-wait-timeout); it is then given up
-- at the head should a Redisson grant have taken its wait off meanwhile, and queues
-- again at its next try.
local FOREIGN_AHEAD_MOST = 256

-- How many entries ahead of position `pos` (0-based) Redisson may have queued (not
-- `refreshed`).
local function foreign_ahead(queue, pos)
    if pos <= 0 then
        return 0
    end
    local count = 0
    for _, entry in ipairs(redis.call('lrange', queue, math.max(0, pos - FOREIGN_AHEAD_MOST), pos - 1)) do
        if not refreshed(entry) then
            count = count + 1
        end
    end
    return count
end

-- The deadline a waiter at position `pos` (0-based) that stays until `at` needs now:
-- `at` plus a Redisson wait for each entry ahead that Redisson may have queued. Each
-- grant of one takes a Redisson wait off every deadline behind it (Redisson's script
-- does; latchkey's does too, `give_back_wait`), and each such entry that gives up
-- takes it off those behind (Redisson's acquireFailed; fair_leave.lua): the waiter
-- keeps its own wait through them, and one whose server crashed comes back to it as
-- they go. Counted, not copied from the entry ahead: a deadline copied from there (the
-- entry pushed out behind one since gone) was kept by the next waiter behind, and the
-- next, and each owner passing through added five minutes, to hours in a hot queue that
-- never emptied; a crashed server's waiter among them then blocked the free lock that
-- long. The queue is read only behind an entry Redisson may have queued, or behind a
-- latchkey entry pushed out: one that is not had none ahead when its deadline was set
-- (a live one is set again well within a Redisson wait), and entries join at the end
-- (but for a waiter whose grant was given back, at the head where it stood). A latchkey
-- entry whose deadline passed says nothing of what is ahead of it: its server died, and
-- the entry stays until a script sweeps it from the head.
local function needed(queue, deadlines, pos, at)
    local ahead = pos > 0 and redis.call('lindex', queue, pos - 1)
    if not ahead then
        return at
    end
    if refreshed(ahead) then
        local deadline = tonumber(redis.call('zscore', deadlines, ahead) or '')
        if not deadline or (deadline <= at and deadline > now_ms()) then
            return at
        end
    end
    return at + REDISSON_WAIT_MS * foreign_ahead(queue, pos)
end

-- Takes `wait` ms off the deadlines of latchkey's entries (`refreshed`) from position
-- `from` (0-based) on: a Redisson wait when an entry Redisson may have queued leaves
-- (granted the lock, or giving up), which they counted (`needed`). A live one would
-- lower itself at its next refresh; a crashed server's comes back to its own wait. The
-- Redisson waiters behind keep theirs: spaced from the entry ahead when they queued (a
-- latchkey entry refreshed with nothing ahead is only its own wait out), a wait taken
-- off left one behind a granted owner to be swept out of its turn should the lock be
-- held longer than that.
local function give_back_wait(queue, deadlines, from, wait)
    for _, entry in ipairs(redis.call('lrange', queue, from, -1)) do
        if refreshed(entry) then
            redis.call('zadd', deadlines, 'XX', 'INCR', -wait, entry)
        end
    end
end

-- Takes `owner` (granted the lock, or giving up) from a fair lock's queue and
-- deadlines; those behind an owner Redisson may have queued get its wait back
-- (give_back_wait). Returns 1 when it was queued, else 0; the list is searched only
-- then (a reentrant grant, or a grant given back, finds the owner out of the queue).
local function leave_queue(queue, deadlines, owner)
    if redis.call('zrem', deadlines, owner) == 0 then
        return 0
    end
    local pos = not refreshed(owner) and redis.call('lpos', queue, owner)
    redis.call('lrem', queue, 1, owner)
    if pos then
        give_back_wait(queue, deadlines, pos, REDISSON_WAIT_MS)
    end
    return 1
end

-- Raises the Redisson entries behind position `pos` (0-based), whose deadline moved
-- from `was` to `at` (Redisson never refreshes its waiters' deadlines), to stay as far
-- behind it as Redisson put them, at most a Redisson wait (ZADD GT: never lowered), up
-- to the first that already is: a Java waiter whose process died is then swept out as
-- soon after the one ahead as Redisson's own layout would. An entry only latchkey queues (`refreshed`) is passed over, not raised: its
-- server refreshes it while it waits, and raising it would keep a crashed server's
-- waiter alive for as long as a live one waits ahead of it, to block the lock for its
-- deadline at the head, each in turn (such a waiter, its deadline gone by, is swept out
-- as the walk passes it). The walk ends at a live one (its deadline still ahead): its
-- own refreshes raise those behind it, so a queue of latchkey waiters costs each
-- refresh one read behind, not the queue.
local function raise_behind(queue, deadlines, pos, was, at)
    local now = now_ms()
    -- The tail is read a few entries at a time: the walk usually stops at the first.
    while pos do
        local tail = redis.call('lrange', queue, pos + 1, pos + 8)
        local removed = 0
        for _, entry in ipairs(tail) do
            local deadline = tonumber(redis.call('zscore', deadlines, entry) or '')
            if refreshed(entry) then
                if (deadline or 0) >= now then
                    return
                end
                -- A crashed server's waiter (its deadline gone by unrefreshed): swept
                -- out here, as it would be at the head (live_head), so that those behind
                -- keep their distance from the live one ahead, not from a deadline that
                -- no longer moves. A server that was only late queues it again at the end.
                redis.call('lrem', queue, 1, entry)
                redis.call('zrem', deadlines, entry)
                removed = removed + 1
                was = deadline or was
            else
                -- As far behind the one ahead as Redisson put it (its `tryLock` wait, or
                -- its fairLockWaitTimeout), at most a Redisson wait: when the entry ahead
                -- gave a wait back, the distance grew by as much, which is not its own.
                local behind = deadline and deadline - was
                if not behind or behind <= 0 or behind > REDISSON_WAIT_MS then
                    behind = REDISSON_WAIT_MS
                end
                if redis.call('zadd', deadlines, 'XX', 'GT', 'CH', at + behind, entry) == 0 then
                    return
                end
                was, at = deadline, at + behind
            end
        end
        pos = #tail == 8 and pos + 8 - removed or nil
    end
end

-- Queues the fair waiter `owner` at the end with the deadline it needs to stay until
-- `at` (`needed`), or, queued already, moves its deadline there: lower too, once the
-- entries that pushed it out are gone (an entry shaped like Redisson's that latchkey
-- refreshes is a live stream's: raised behind another by the walk below, as a Redisson
-- waiter must be, it needs no more than its own). Since Redisson never refreshes its
-- waiters' deadlines, when a deadline rises, the Redisson entries behind it are raised
-- in turn (`raise_behind`).
-- Returns the queue's length when `owner` joined it, else 0.
local function keep_place(queue, deadlines, owner, at)
    local current = redis.call('zscore', deadlines, owner)
    local pos = current and redis.call('lpos', queue, owner)
    if not pos then
        -- Not queued, or a deadline left without its place in line (the list deleted or
        -- gone before its set): it joins at the end, as its callers read it after.
        redis.call('zadd', deadlines, needed(queue, deadlines, redis.call('llen', queue), at), owner)
        return redis.call('rpush', queue, owner)
    end
    at = needed(queue, deadlines, pos, at)
    current = tonumber(current)
    if current == at then
        return 0
    end
    redis.call('zadd', deadlines, at, owner)
    if current > at then
        -- Lowered: those behind keep theirs, as far from it as they were or further.
        return 0
    end
    raise_behind(queue, deadlines, pos, current, at)
    return 0
end

-- Puts the fair waiter `owner` at the head of the queue, staying `stay` ms without
-- polling, whose grant was given back for want of replica acknowledgements: the grant
-- took it out of the queue, and it tries again first in line, as it stood. With
-- `yielding` (a grant the replicas did not acknowledge), behind a waiter Redisson may
-- have queued that is now first in line, though: Redisson needs no replica's word, and
-- while the replicas stay away the owner's grants would be given back one after the
-- other, keeping the Java waiter out all along; it goes first, the owner second. The
-- latchkey entries behind an owner Redisson may have queued count it again (the grant
-- gave its wait back: `leave_queue`), or their deadlines would go one wait lower at
-- each grant given back, to be swept out of their turn.
-- Returns the waiter first in line, to be told the lock is free.
local function back_at_head(queue, deadlines, owner, stay, yielding)
    leave_queue(queue, deadlines, owner)
    local now = now_ms()
    local head = yielding and live_head(queue, deadlines, now)
    local pos = 0
    if head and not refreshed(head) then
        redis.call('linsert', queue, 'AFTER', head, owner)
        pos = 1
    else
        redis.call('lpush', queue, owner)
        head = owner
    end
    redis.call('zadd', deadlines, needed(queue, deadlines, pos, now + stay), owner)
    if not refreshed(owner) then
        give_back_wait(queue, deadlines, pos + 1, -REDISSON_WAIT_MS)
    end
    keep_queue(queue, deadlines, now, stay)
    return head
end

-- Queues the fair waiters `owners[from..]` in order, each staying `stay` ms without
-- polling (one already queued keeps its place, its deadline refreshed: keep_place).
-- Returns whether there were any (the queue's lifetime is then kept here).
local function join_queue(queue, deadlines, owners, from, stay)
    if from > #owners then
        return false
    end
    local now = now_ms()
    for i = from, #owners do
        keep_place(queue, deadlines, owners[i], now + stay)
    end
    keep_queue(queue, deadlines, now, stay)
    return true
end

-- Whether every waiter in a fair lock's queue is a stream of `server` (a stream's own
-- owner id is its hold id, `<server>:<n>`): its waiters may then be passed the lock in
-- memory, in the order they queued, with nobody else's turn passed over. The whole
-- entry is matched: an owner a client named may end like one (`x:<server>:<n>`).
-- A queue longer than QUEUED_HERE_MOST is not read (it would be at every recording):
-- the lock then goes through Redis, one handoff a release.
local QUEUED_HERE_MOST = 256
local function queued_here(queue, server)
    if redis.call('llen', queue) > QUEUED_HERE_MOST then
        return false
    end
    for _, owner in ipairs(redis.call('lrange', queue, 0, -1)) do
        if string.match(owner, '^([^:]*):%d+$') ~= server then
            return false
        end
    end
    return true
end

-- Forgets a claim of this stream (`claim`, or '' for none).
local function forget_claim(lock, claim)
    if claim and claim ~= '' then
        typed_call('zrem', claims_of(lock), claim)
    end
end
