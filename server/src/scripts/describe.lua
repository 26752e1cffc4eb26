-- Reads one lock of any kind in a single consistent snapshot.
-- KEYS[1] lock key, KEYS[2] fencing counter, KEYS[3] fair queue, KEYS[4] semaphore hash,
-- KEYS[5] fair deadlines
-- Returns {kind (as lib.lua's held_as), pttl, the latest grant's token or false, flat
-- field/value list of the lock hash (or of the semaphore hash), the fair queue, flat
-- hold id/expiry list of a semaphore's live holds, Redis' clock in ms, flat
-- reader/pttl list of a read/write lock's readers}. The queue holds the live waiters
-- only: one whose deadline passed (lib.lua's live_head) waits no more.
local kind = inspected_as(KEYS[1], KEYS[4])
local now = now_ms()
-- The latest grant's token (lib.lua's latest_token). (A foreign key under the queue's
-- names reads as absent too.)
local last = latest_token(KEYS[1], KEYS[2])
local fields, holds, readers = {}, {}, {}
if kind == 'semaphore' then
    fields = redis.call('hgetall', KEYS[4])
    -- Live holds only: an expired one's permits are free (the next try takes it out).
    holds = redis.call('zrangebyscore', KEYS[1], '(' .. now, '+inf', 'withscores')
elseif kind ~= 'none' and kind ~= 'other' then
    fields = redis.call('hgetall', KEYS[1])
end
if kind == 'read' or kind == 'write' then
    -- Each read hold n has its own lease, its timeout key `{lock}:<owner>:rwlock_timeout:<n>`
    -- (Redisson's layout), and so does a latchkey write hold (`<owner>:write` in place of
    -- the owner): a holder's is the longest of its holds' (-2 when none is left: lapsed,
    -- as the lock scripts take it, lib.lua's `write_lapsed`). A Redisson writer's hold has
    -- no timeout key, its lease is the lock's: -1.
    local prefix = rw_prefix(KEYS[1])
    for i = 1, #fields, 2 do
        local count = tonumber(fields[i + 1])
        if fields[i] ~= 'mode' and count then
            local writer = string.match(fields[i], '^(.*):write$')
            readers[#readers + 1] = fields[i]
            if writer and not refreshed(writer) then
                readers[#readers + 1] = -1
            else
                readers[#readers + 1] = longest_timeout(prefix .. ':' .. fields[i] .. ':rwlock_timeout', count)
            end
        end
    end
end
-- The queue in order, less the waiters whose deadline passed, in a few reads, not one
-- a waiter: a Watch reads a fair lock's queue of thousands at each change. Every script
-- keeps a deadline for each entry of the queue, so with as many deadlines as entries,
-- none of them past, the whole queue waits (the common case, and a third of the work).
local queue = typed_call('lrange', KEYS[3], 0, -1) or {}
local waiters = queue
if #queue > 0 and (typed_call('zcount', KEYS[5], '-inf', now) ~= 0 or typed_call('zcard', KEYS[5]) ~= #queue) then
    local live = {}
    for _, owner in ipairs(typed_call('zrangebyscore', KEYS[5], '(' .. now, '+inf') or {}) do
        live[owner] = true
    end
    waiters = {}
    for _, owner in ipairs(queue) do
        if live[owner] then
            waiters[#waiters + 1] = owner
        end
    end
end
-- A semaphore's key lives as long as the longest lease it ever granted: its TTL is its
-- latest live hold's.
local pttl = redis.call('pttl', KEYS[1])
if kind == 'semaphore' and #holds > 0 then
    pttl = math.min(pttl, math.max(tonumber(holds[#holds]) - now, 1))
end
return {kind, pttl, last, fields, waiters, holds, now, readers}
