-- Runs several calls of the catalogue in one: the calls of one scheduler round, sent to
-- Redis as one command. run(name, KEYS, ARGV) runs the body of the script called name.
-- ARGV[i]: call i, MessagePack of its script's name, the array of its keys and the
--   array of its arguments (unpacked in C: as RESP arguments of their own, a round's
--   keys and arguments cost the server a tenth of its work per lock cycle). KEYS[1],
--   the first call's first key, only routes the batch: on a cluster it spans the slots
--   of one node.
-- Returns two entries per call, in order: 1 and its reply (false for none), 0 and its
-- error message, or 2 and the error that kept it from running on this node (nothing of
-- it was written; the server sends it alone, so its client follows the redirection);
-- flat, as a table per call cost Redis 5 % of a lock cycle. An error stops its own call
-- only, as it would a call of its own.
local replies = {}
for i = 1, #ARGV do
    local name, keys, args = cmsgpack.unpack(ARGV[i])
    -- On a cluster, the check Redis makes of a script's declared keys before it runs
    -- (a batch declares one key): a call whose slot this node does not serve (moved
    -- since the server grouped the round) or no longer holds all of (being migrated)
    -- fails here, before any of its commands.
    local refused = CLUSTER and #keys > 0 and redis.pcall('exists', unpack(keys))
    local flag, reply = 2, nil
    if type(refused) == 'table' then
        reply = refused.err
    else
        local ok
        ok, reply = pcall(run, name, keys, args)
        if not ok then
            reply = error_text(reply)
            -- A read-only replica (a demoted primary) refuses every write, so no call of
            -- the batch wrote anything: flag 2. Any other error: 0.
            if string.sub(reply, 1, 9) ~= 'READONLY ' then
                flag = 0
            end
        else
            flag = 1
            if reply == nil then
                -- A hole would end the array there.
                reply = false
            end
        end
    end
    replies[2 * i - 1], replies[2 * i] = flag, reply
end
return replies
