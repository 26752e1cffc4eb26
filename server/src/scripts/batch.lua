-- Runs several calls of the catalogue in one: the calls of one scheduler round, sent to
-- Redis as one command. run(name, KEYS, ARGV) runs the body of the script called name.
-- ARGV[1] the number of calls n; ARGV[2] where their keys are: 'k' in KEYS, 'a' at the
--   end of ARGV (on a cluster, where KEYS declares only the first key, which routes the
--   call: a batch spans the slots of one node); ARGV[3i], ARGV[3i+1], ARGV[3i+2]: call
--   i's script name and its number of keys and of args; then every call's args, in
--   order; then, with 'a', every call's keys, in order.
-- Returns two entries per call, in order: 1 and its reply (false for none), or 0 and
-- its error message; flat, as a table per call cost Redis 5 % of a lock cycle. An
-- error stops its own call only, as it would a call of its own.
local n = tonumber(ARGV[1])
local a = 3 * n + 3
local keys_from, k = KEYS, 1
if ARGV[2] == 'a' then
    local args = 0
    for i = 1, n do
        args = args + tonumber(ARGV[3 * i + 2])
    end
    keys_from, k = ARGV, a + args
end
local replies = {}
for i = 1, n do
    local name, nk, na = ARGV[3 * i], tonumber(ARGV[3 * i + 1]), tonumber(ARGV[3 * i + 2])
    -- Built whole (a table constructor sizes the table once).
    local keys, args = {unpack(keys_from, k, k + nk - 1)}, {unpack(ARGV, a, a + na - 1)}
    k, a = k + nk, a + na
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
