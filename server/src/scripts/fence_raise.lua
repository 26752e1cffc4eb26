-- Raises a fencing counter to at least a given token (a RedLock grant's token, the
-- largest of its majority), so the next grant on this node answers a larger one. A
-- counter at the token or past it already is left as it is, and counts as raised too:
-- nothing lowers a counter (a failed try leaves its token drawn). Either way the counter lives at
-- least as long as the grant's lease and grace, never shorter than it would have: a
-- counter that expired during the grant would draw its next token from the node's
-- clock, which may be below the grant's token.
-- KEYS[1] fencing counter
-- ARGV[1] token, ARGV[2] ms the counter lives at least
-- Returns 1 when raised, 0 when the counter was at the token or past it.
local keep = tonumber(ARGV[2])
local ttl = redis.call('pttl', KEYS[1])
if tonumber(redis.call('get', KEYS[1]) or '0') < tonumber(ARGV[1]) then
    if ttl == -1 then
        redis.call('set', KEYS[1], ARGV[1], 'keepttl')
    else
        redis.call('set', KEYS[1], ARGV[1], 'px', math.max(ttl, keep))
    end
    return 1
end
if ttl >= 0 and ttl < keep then
    redis.call('pexpire', KEYS[1], keep)
end
return 0
