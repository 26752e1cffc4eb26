-- Gives back one hold of each given mutex or fair lock; a lock it frees goes to whoever
-- may take it (`freed`): the first live fair waiter, a claim, or every waiter.
-- KEYS: for each name i, KEYS[5i-4] lock hash, KEYS[5i-3] unlock channel, KEYS[5i-2] hold
--   record, KEYS[5i-1] fair queue, KEYS[5i] fair deadlines
-- ARGV[1] owner id, ARGV[2] '1' to revoke: a try of the stream had an unknown outcome, so
--   a revoked record stands in place of the hold record, whatever was there; '2' for the
--   give-back of what a try that answered took, the stream trying again (take_record's
--   `retrying`); '0' otherwise, ARGV[3] the
--   stream's claim on the first name to forget, or '', ARGV[4] '1' when the releasing
--   server listens on the first name's channel with nobody waiting (see grant_claim),
--   ARGV[5] for the give-back of a queued fair waiter's grant that its replicas did not
--   acknowledge (with '2'): how long it stays at the head of the queue, where it goes
--   back to try again in its turn; '' or absent otherwise
-- ARGV[6] with '3' (PASSED), the give-back of what a failed recording of a pass in memory
--   may have left the stream (relay.rs): the token the pass told it. A record of another
--   grant is the stream's own try's, which the stream holds and releases itself: it
--   stays, and nothing is given back. Otherwise as '1'.
-- Returns how many of the holds were still held. Safe to retry: a hold record is gone
-- after the first run.
-- Every release is announced (changed): Watch does not listen on the unlock channel.
local released = 0
local stays = tonumber(ARGV[5] or '')
local giving = ARGV[2]
if giving == PASSED then
    local record = redis.call('get', KEYS[3])
    if record and record ~= ARGV[6] and record ~= REVOKED then
        return 0
    end
    giving = REVOKE
end
forget_claim(KEYS[1], ARGV[3])
for i = 1, #KEYS / 5 do
    local lock, channel, hold = KEYS[5 * i - 4], KEYS[5 * i - 3], KEYS[5 * i - 2]
    -- Only a mutex or fair lock: a stale hold never touches a newer lock of another kind.
    local count = take_record(hold, giving, lock) and lock_holds(lock, ARGV[1])
    if count then
        released = released + 1
        if count > 1 then
            redis.call('hincrby', lock, ARGV[1], -1)
            changed(lock)
        else
            redis.call('del', lock)
            local queue = KEYS[5 * i - 1]
            if stays and i == 1 then
                -- Its grant took it out of the queue: it goes back to the head, first
                -- in line as it was (a grant the replicas did not acknowledge: second
                -- behind a Java waiter), and whoever is first hears that the lock is free.
                local head = back_at_head(queue, KEYS[5 * i], ARGV[1], stays, giving == RETRY)
                freed(lock, channel, head, nil)
            -- No fair waiter and no claim (the common case): every waiter hears
            -- Redisson's unlock message, as `freed` would send it, one command sooner.
            elseif redis.call('exists', queue, claims_of(lock)) == 0 then
                redis.call(PUBLISH, channel, '0')
                changed(lock)
            else
                local head = live_head(queue, KEYS[5 * i])
                freed(lock, channel, head, i == 1 and ARGV[4] == '1' and server_of(hold) or nil)
            end
        end
    end
end
return released
