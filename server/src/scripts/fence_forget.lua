-- Forgets a token that was never handed out (a RedLock attempt that failed and was
-- rolled back), so a failed attempt leaves no key behind. Only while the counter
-- still holds that token: any later grant keeps its own.
-- KEYS[1] fencing counter
-- ARGV[1] token
-- Returns 1 when forgotten.
if redis.call('get', KEYS[1]) == ARGV[1] then
    redis.call('del', KEYS[1])
    return 1
end
return 0
