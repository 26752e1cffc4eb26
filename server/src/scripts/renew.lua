-- Renews many stream-scoped leases in one call (the watchdog's batch).
-- KEYS: the first lease's lock hash, hold record and fencing counter; they route the
--   call. On a cluster the batch spans the slots of one node, so the other leases' keys
--   come in ARGV and the cluster variant of this script declares allow-cross-slot-keys.
-- ARGV[1] lease ms, ARGV[2] grace ms the records outlive the lease, then for each lease i:
--   ARGV[4i-1] lock hash, ARGV[4i] hold record, ARGV[4i+1] fencing counter, ARGV[4i+2] owner id
-- Returns the 1-based indexes of the leases that are no longer held.
local lost = {}
local lease = tonumber(ARGV[1])
local keep = lease + tonumber(ARGV[2])
for i = 1, (#ARGV - 2) / 4 do
    local lock, hold, fence, owner = ARGV[4 * i - 1], ARGV[4 * i], ARGV[4 * i + 1], ARGV[4 * i + 2]
    if redis.call('exists', hold) == 1 and redis.call('hexists', lock, owner) == 1 then
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
