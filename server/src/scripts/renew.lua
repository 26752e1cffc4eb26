-- Renews many stream-scoped leases in one call (the watchdog's batch).
-- KEYS: for each lease i, KEYS[3i-2] lock hash, KEYS[3i-1] hold record, KEYS[3i] fencing counter
-- ARGV[1] lease ms, ARGV[2] grace ms the records outlive the lease, ARGV[2+i] owner id of lease i
-- Returns the 1-based indexes of the leases that are no longer held.
local lost = {}
local lease = tonumber(ARGV[1])
local keep = lease + tonumber(ARGV[2])
for i = 1, #KEYS / 3 do
    local lock, hold, fence = KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i]
    if redis.call('exists', hold) == 1 and redis.call('hexists', lock, ARGV[2 + i]) == 1 then
        -- Never shorten a lock another hold of the same owner has extended.
        if redis.call('pttl', lock) < lease then
            redis.call('pexpire', lock, lease)
        end
        redis.call('pexpire', hold, keep)
        redis.call('pexpire', fence, keep)
    else
        lost[#lost + 1] = i
    end
end
return lost
