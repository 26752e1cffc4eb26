-- Runs several calls of the catalogue in one: the calls of one scheduler round, sent to
-- Redis as one command. run(name, KEYS, ARGV) runs the body of the script called name.
-- ARGV[i]: call i, MessagePack of its script's name, the array of its keys and the
--   array of its arguments (unpacked in C: as RESP arguments of their own, a round's
--   keys and arguments cost the server a tenth of its work per lock cycle). KEYS[1],
--   the first call's first key, only routes the batch: on a cluster it spans the slots
--   of one node.
-- Returns two entries per call, in order: 1 and its reply (false for none), or 0 and
-- its error message; flat, as a table per call cost Redis 5 % of a lock cycle. An
-- error stops its own call only, as it would a call of its own.
local replies = {}
for i = 1, #ARGV do
    local name, keys, args = cmsgpack.unpack(ARGV[i])
    local ok, reply = pcall(run, name, keys, args)
    if not ok then
        reply = type(reply) == 'table' and reply.err or tostring(reply)
    elseif reply == nil then
        -- A hole would end the array there.
        reply = false
    end
    replies[2 * i - 1], replies[2 * i] = ok and 1 or 0, reply
end
return replies
