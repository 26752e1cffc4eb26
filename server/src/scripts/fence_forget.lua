-- Gives back a token that was never handed out (a RedLock attempt that failed and was
-- rolled back): the counter steps back to just below it, keeping its lifetime, so the
-- node's next grant may draw that token again. Only while the counter still holds that
-- token: any later grant keeps its own. Deleting the counter instead would let the
-- node's next token fall to its clock, below tokens a majority with a faster-clocked
-- node raised it past: a later majority could then answer a smaller token.
-- KEYS[1] fencing counter
-- ARGV[1] token
-- Returns 1 when given back.
if redis.call('get', KEYS[1]) == ARGV[1] then
    redis.call('decr', KEYS[1])
    return 1
end
return 0
