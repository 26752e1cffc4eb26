-- Gives back one hold of a mutex or fair lock (as release.lua does) and, when that frees
-- the lock, grants it in the same step to a waiter of this server (the candidate): no
-- unlock message, no second script, and no moment at which the lock is free. Also
-- records passes of the lock that the server made in memory (relay.rs), and queues the
-- fair waiters that lined up behind them.
-- KEYS[1] lock hash, KEYS[2] unlock channel, KEYS[3] hold record, KEYS[4] fair queue,
--   KEYS[5] fair deadlines, KEYS[6] fencing counter, KEYS[7] the candidate's hold record
-- ARGV[1] owner id, ARGV[2] the candidate's owner id, ARGV[3] its kind ('mutex' or
--   'fair'), ARGV[4] its lease ms, ARGV[5] grace ms its hold record outlives the lease,
--   ARGV[6] the candidate's claim (granted here, it is forgotten), or '', ARGV[7] the
--   token the candidate was told already, or '': the server passed it the lock in
--   memory, and this run records that pass, ARGV[8] how many tokens past the
--   candidate's to reserve for such passes (0: none), ARGV[9] how long a fair waiter
--   stays queued without polling (ms), ARGV[10] the releasing stream's claim to forget
--   (as release.lua's), or ''; for a recording: ARGV[11] the number p of
--   holders passed the lock in memory since the last recording, ARGV[12..11+p] those
--   holders (a mutex's claims to forget, a fair lock's owner ids to take from the
--   queue), ARGV[12+p..] the owner ids of the fair waiters that lined up behind the
--   chain since, to queue in that order
-- Returns {released, token, more, reserved}: released 1 when the hold was still held,
-- token > 0 when the candidate was granted (with hold count 1), -1 when the hold was not
-- held because ForceRelease broke it (its record at or below the break floor), -2 when
-- the release freed the lock for every waiter with Redisson's unlock message (which the
-- candidate's server hears too), 0 when it did not grant the candidate otherwise (the
-- lock still held, or granted to another server's claim); more 1 when the
-- lock may go on being passed in memory (a mutex: this server alone listens, no fair
-- waiter is queued, and it has been passed on for less than PASS_FOR_MS; a fair lock:
-- every waiter in its queue is this server's), or 1 + the ms that passes may go on for
-- (a mutex in this server's turn, see turn_left), else 0; reserved the highest
-- token reserved (0: none). Safe to retry: the hold record is gone after the first run,
-- and a retry grants nothing; a recording sent again answers as its first run did
-- (without more passes or reservations), which left the candidate holding the told token.
local lock, channel, hold, queue, deadlines = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local told = tonumber(ARGV[7])
-- The releasing stream's claim goes whatever happens, as a release's does: a claiming
-- try of it that raced the handoff which granted it may have left one.
forget_claim(lock, ARGV[10])
local live, broken = take_record(hold, RELEASE, lock)
local count = live and lock_holds(lock, ARGV[1])
-- A recording written again after a reconnect cut its first run's reply off (the pool
-- writes a call again): the first run gave the candidate the told token.
if not count and told and typed_call('get', KEYS[7]) == string.format('%d', told) and lock_holds(lock, ARGV[2]) then
    return {1, told, 0, 0}
end
if not count then
    -- A recording that fails still forgets the claims of the mutex holders it names:
    -- their server ends their leases, and no release may grant their streams again.
    if told and ARGV[3] ~= 'fair' then
        forget_claim(lock, ARGV[6])
        for i = 12, 11 + (tonumber(ARGV[11]) or 0) do
            forget_claim(lock, ARGV[i])
        end
    end
    return {0, broken and -1 or 0, 0, 0}
end
if count > 1 then
    redis.call('hincrby', lock, ARGV[1], -1)
    changed(lock)
    return {1, 0, 0, 0}
end

-- Whether the candidate may have the lock now. A fair lock goes to the head of its
-- queue only. A mutex goes to the candidate only while this server is the only one
-- listening on its unlock channel, or in its turn (turn_left: every other listener is a
-- server with a claim, granted once the turn is over): a waiter elsewhere (another
-- latchkey server, a Redisson client) must see the lock free, or it could wait
-- forever. Otherwise the lock goes as a release's does (`freed`): to a fair waiter, a
-- claim, or every waiter. A pass made in memory cannot be undone: it is recorded
-- whoever listens, and only whether more may follow depends on them.
local head = live_head(queue, deadlines)
local fair = ARGV[3] == 'fair'
local next_in_line, stays, turn
if fair then
    next_in_line = head == ARGV[2] or told ~= nil
else
    -- The lock stays with this server's waiters: for good while it alone listens, or
    -- for what is left of its turn.
    stays = not head and redis.call('pubsub', PUBSUB_NUMSUB, channel)[2] <= 1
    if not head and not stays then
        turn = turn_left(lock, channel, server_of(hold))
        stays = turn ~= nil
    end
    next_in_line = stays or told ~= nil
end
-- Nor while the candidate's stream has a hold record: a revoked one (its stream left
-- while an earlier handoff's outcome was unknown) must stay revoked, and a grant it
-- already has is found by its own try.
next_in_line = next_in_line and redis.call('exists', KEYS[7]) == 0
local lease = tonumber(ARGV[4])
local keep = lease + tonumber(ARGV[5])
-- Nor a mutex passed on long enough (see may_pass): it goes as a release's does. A pass
-- in memory only learns whether more may follow (passed_on).
local more = false
if not fair and told then
    more = passed_on(lock, keep) and stays
elseif not fair then
    next_in_line = next_in_line and may_pass(lock, keep)
    more = next_in_line
end
-- The token before the lock changes hands (see grant), and the tokens reserved past it.
-- A counter that cannot count (a foreign key under its name) hands nothing: the lock is
-- released as usual, and the candidate's own try reports the key.
local token, reserved = told, 0
if next_in_line and not told then
    next_in_line, token = pcall(next_token, KEYS[6], keep)
end
local ahead = tonumber(ARGV[8]) or 0
redis.call('del', lock)
if not next_in_line then
    -- This server's waiters just had the lock: a claim of another server goes first.
    return {1, freed(lock, channel, head, server_of(hold)) and -2 or 0, 0, 0}
end
local passed = tonumber(ARGV[11]) or 0
if not fair then
    forget_claim(lock, ARGV[6])
    for i = 12, 11 + passed do
        forget_claim(lock, ARGV[i])
    end
elseif told then
    -- The holders passed the fair lock in memory left the queue's head in turn; the
    -- waiters that lined up behind them join it.
    for i = 12, 11 + passed do
        leave_queue(queue, deadlines, ARGV[i])
    end
    leave_queue(queue, deadlines, ARGV[2])
    -- Keeps the queue alive itself when it queues anyone.
    if not join_queue(queue, deadlines, ARGV, 12 + passed, tonumber(ARGV[9])) then
        keep_queue(queue, deadlines, now_ms(), tonumber(ARGV[9]))
    end
else
    leave_queue(queue, deadlines, head)
    keep_queue(queue, deadlines, now_ms(), tonumber(ARGV[9]))
end
-- Whether a fair lock may go on in memory: read only for a pass made or allowed, not
-- on every fair handoff.
if fair and (told or ahead > 0) then
    more = queued_here(queue, server_of(hold))
end
-- Tokens are reserved only for passes that may follow: reserved at every handoff, a
-- lock changing hands between servers thousands of times a second would raise its
-- counter faster than the clock, the floor tokens start from once the counter is lost.
-- A counter that cannot count (a foreign key under its name) reserves nothing, and
-- nothing is passed.
if more and ahead > 0 then
    local counted, top = pcall(reserve_tokens, KEYS[6], lock, token, token + ahead, keep)
    more = counted
    reserved = counted and top or 0
elseif told then
    -- A recording after which no pass may follow reserves nothing, but its holder's
    -- token is the latest grant still: Describe would show the record's earlier one.
    pcall(reserve_tokens, KEYS[6], lock, token, token, keep)
end
redis.call('hset', lock, ARGV[2], 1)
redis.call('pexpire', lock, lease)
return {1, grant(lock, token, KEYS[7], keep), more and 1 + (turn or 0) or 0, reserved}
