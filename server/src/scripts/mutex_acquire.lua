-- Takes one hold of one or more reentrant mutexes, all or none (Redisson RLock layout: a
-- hash of owner id -> hold count). A multi-lock passes every name of one cluster slot.
-- KEYS: for each name i, KEYS[4i-3] lock hash, KEYS[4i-2] fencing counter, KEYS[4i-1] hold
--   record of this stream, KEYS[4i] the fair waiters' deadlines
-- ARGV[1] lease ms, ARGV[2] owner id, ARGV[3] grace ms the records outlive the lease,
--   ARGV[4] a single name's waiter's claim (see lib.lua's grant_claim), or '': made when the
--   name is busy (until a little after the holder's TTL, when the waiter tries again),
--   forgotten when granted
-- ARGV[5] '1' for a RedLock try: a replayed grant draws a new token (below), else absent
-- Returns {1, token1, count1, token2, count2, ...} when every name is granted,
-- {0, pttl, 0, i} when name i is held by another owner, {2, i} when name i is held as
-- another kind (or used as a fair lock).
-- Safe to retry: a retried grant finds its hold records and returns them unchanged, and
-- one that comes after its release (revoked records) grants nothing. A RedLock try's
-- replayed grant takes a new token instead, rewritten into its record: the record's
-- token was drawn when that node alone was taken, maybe before another majority's grant
-- raised the counter past it, and the majority this try makes must answer more than
-- that grant's token. (No one was told the old token unless an earlier try reached a
-- majority, whose stream then holds and tries no more.)
local names = #KEYS / 4
local claim = ARGV[4] or ''
local fresh = ARGV[5] == '1'
local replayed = {}
for i = 1, names do
    local lock, hold, deadlines = KEYS[4 * i - 3], KEYS[4 * i - 1], KEYS[4 * i]
    -- A free name with no record of this stream (the common case) needs this one
    -- command: nothing to replay and nothing to check.
    local busy = redis.call('exists', lock, deadlines, passing_of(lock), hold) > 0
    if busy then
        replayed[i] = replay(hold, lock, ARGV[2], ARGV[1], ARGV[3])
    end
    if replayed[i] == false then
        return {0, -1, 0, i}
    elseif busy and not replayed[i] then
        -- Held, used as a fair lock, or passed on of late: the checks below (on a free
        -- name they find nothing).
        local kind = held_for_taking(lock)
        if (kind ~= 'none' and kind ~= 'lock') or fair_waiting(deadlines) then
            return {2, i}
        end
        local yielding = kind == 'none' and left_to_others(lock)
        if yielding then
            return {0, yielding, 0, i}
        end
        -- A reentry adds to the owner's count (held_for_taking found it one).
        local count = kind == 'lock' and redis.call('hget', lock, ARGV[2])
        if kind == 'lock' and not count then
            local ttl = redis.call('pttl', lock)
            if claim ~= '' then
                local claims = claims_of(lock)
                local last = math.max(ttl, 1000) + CLAIM_SLACK_MS
                -- An application's key there takes no claim: the waiter waits without.
                if typed_call('zadd', claims, now_ms() + last, claim) then
                    lengthen(claims, last)
                end
            end
            return {0, ttl, 0, i}
        end
    end
end
local reply = {1}
local lease = tonumber(ARGV[1])
local keep = lease + tonumber(ARGV[3])
-- Every token before the first write (see grant).
local tokens = {}
for i = 1, names do
    if fresh or not replayed[i] then
        tokens[i] = next_token(KEYS[4 * i - 2], keep)
    end
end
forget_claim(KEYS[1], claim)
for i = 1, names do
    local token, count
    if replayed[i] and fresh then
        token, count = tokens[i], replayed[i][3]
        redis.call('set', KEYS[4 * i - 1], string.format('%d', token), 'px', keep)
    elseif replayed[i] then
        token, count = replayed[i][2], replayed[i][3]
    else
        local lock = KEYS[4 * i - 3]
        count = redis.call('hincrby', lock, ARGV[2], 1)
        if count == 1 then
            redis.call('pexpire', lock, ARGV[1])
        else
            -- A reentrant grant never shortens the lease another hold of the owner has.
            redis.call('pexpire', lock, math.max(redis.call('pttl', lock), lease))
        end
        token = grant(lock, tokens[i], KEYS[4 * i - 1], keep)
    end
    reply[#reply + 1] = token
    reply[#reply + 1] = count
end
return reply
