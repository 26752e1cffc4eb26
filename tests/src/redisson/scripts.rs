//! The Lua scripts Redisson 3.x sends, fragment for fragment as its Java sources
//! concatenate them (`RedissonLock`, `RedissonBaseLock`, `RedissonFairLock`,
//! `RedissonReadLock`, `RedissonWriteLock`), so the bytes on the wire match.

/// `RedissonLock.tryLockInnerAsync` (`EVAL_LONG` and `EVAL_NULL_BOOLEAN` alike).
/// KEYS: lock. ARGV: lease ms, owner. Returns nil when acquired, else the lock's PTTL.
pub const LOCK_TRY_LOCK: &str = concat!(
    "if ((redis.call('exists', KEYS[1]) == 0) ",
    "or (redis.call('hexists', KEYS[1], ARGV[2]) == 1)) then ",
    "redis.call('hincrby', KEYS[1], ARGV[2], 1); ",
    "redis.call('pexpire', KEYS[1], ARGV[1]); ",
    "return nil; ",
    "end; ",
    "return redis.call('pttl', KEYS[1]);",
);

/// `RedissonLock.unlockInnerAsync(threadId, requestId, timeout)`.
/// KEYS: lock, channel, unlock latch. ARGV: unlock message, lease ms, owner, publish
/// command, latch timeout ms. Returns nil (not held), 0 (still held) or 1 (released).
pub const LOCK_UNLOCK: &str = concat!(
    "local val = redis.call('get', KEYS[3]); ",
    "if val ~= false then ",
    "return tonumber(val);",
    "end; ",
    "if (redis.call('hexists', KEYS[1], ARGV[3]) == 0) then ",
    "return nil;",
    "end; ",
    "local counter = redis.call('hincrby', KEYS[1], ARGV[3], -1); ",
    "if (counter > 0) then ",
    "redis.call('pexpire', KEYS[1], ARGV[2]); ",
    "redis.call('set', KEYS[3], 0, 'px', ARGV[5]); ",
    "return 0; ",
    "else ",
    "redis.call('del', KEYS[1]); ",
    "redis.call(ARGV[4], KEYS[2], ARGV[1]); ",
    "redis.call('set', KEYS[3], 1, 'px', ARGV[5]); ",
    "return 1; ",
    "end; ",
);

/// `RedissonBaseLock.renewExpirationAsync` (the watchdog; also the write lock's).
/// KEYS: lock. ARGV: lease ms, owner. Returns 1 when renewed, 0 when not held.
pub const LOCK_RENEW: &str = concat!(
    "if (redis.call('hexists', KEYS[1], ARGV[2]) == 1) then ",
    "redis.call('pexpire', KEYS[1], ARGV[1]); ",
    "return 1; ",
    "end; ",
    "return 0;",
);

/// `RedissonLock.forceUnlockAsync`.
/// KEYS: lock, channel. ARGV: unlock message, publish command. Returns 1 when deleted.
pub const LOCK_FORCE_UNLOCK: &str = concat!(
    "if (redis.call('del', KEYS[1]) == 1) then ",
    "redis.call(ARGV[2], KEYS[2], ARGV[1]); ",
    "return 1 ",
    "else ",
    "return 0 ",
    "end",
);

/// The stale-waiter sweep that opens the fair-lock acquire scripts; the argument is the
/// ARGV index holding the current time in ms.
macro_rules! fair_sweep {
    ($now:literal) => {
        concat!(
            "while true do ",
            "local firstThreadId2 = redis.call('lindex', KEYS[2], 0);",
            "if firstThreadId2 == false then ",
            "break;",
            "end;",
            "local timeout = redis.call('zscore', KEYS[3], firstThreadId2);",
            "if timeout ~= false and tonumber(timeout) <= tonumber(ARGV[",
            $now,
            "]) then ",
            "redis.call('zrem', KEYS[3], firstThreadId2);",
            "redis.call('lpop', KEYS[2]);",
            "else ",
            "break;",
            "end;",
            "end;",
        )
    };
}

/// The same sweep as `fair_sweep!` with the spacing `unlockInnerAsync` and
/// `forceUnlockAsync` use.
macro_rules! fair_sweep_spaced {
    ($now:literal) => {
        concat!(
            "while true do ",
            "local firstThreadId2 = redis.call('lindex', KEYS[2], 0);",
            "if firstThreadId2 == false then ",
            "break;",
            "end; ",
            "local timeout = redis.call('zscore', KEYS[3], firstThreadId2);",
            "if timeout ~= false and tonumber(timeout) <= tonumber(ARGV[",
            $now,
            "]) then ",
            "redis.call('zrem', KEYS[3], firstThreadId2); ",
            "redis.call('lpop', KEYS[2]); ",
            "else ",
            "break;",
            "end; ",
            "end;",
        )
    };
}

/// The part of the fair-lock acquire scripts (`EVAL_LONG`) after the sweep that takes a
/// free lock whose queue is empty or headed by this owner (the others' deadlines
/// shortened by the wait time), or reenters this owner's hold.
macro_rules! fair_take_or_reenter {
    () => {
        concat!(
            "if (redis.call('exists', KEYS[1]) == 0) ",
            "and ((redis.call('exists', KEYS[2]) == 0) ",
            "or (redis.call('lindex', KEYS[2], 0) == ARGV[2])) then ",
            "redis.call('lpop', KEYS[2]);",
            "redis.call('zrem', KEYS[3], ARGV[2]);",
            "local keys = redis.call('zrange', KEYS[3], 0, -1);",
            "for i = 1, #keys, 1 do ",
            "redis.call('zincrby', KEYS[3], -tonumber(ARGV[3]), keys[i]);",
            "end;",
            "redis.call('hset', KEYS[1], ARGV[2], 1);",
            "redis.call('pexpire', KEYS[1], ARGV[1]);",
            "return nil;",
            "end;",
            "if redis.call('hexists', KEYS[1], ARGV[2]) == 1 then ",
            "redis.call('hincrby', KEYS[1], ARGV[2],1);",
            "redis.call('pexpire', KEYS[1], ARGV[1]);",
            "return nil;",
            "end;",
        )
    };
}

/// `RedissonFairLock.tryLockInnerAsync` with `EVAL_LONG` (`lock()`, `tryLock(wait, …)`).
/// KEYS: lock, queue, timeout set. ARGV: lease ms, owner, wait ms, now ms.
/// Returns nil when acquired, else a TTL to wait (and enqueues the owner).
pub const FAIR_TRY_LOCK: &str = concat!(
    fair_sweep!("4"),
    fair_take_or_reenter!(),
    "local timeout = redis.call('zscore', KEYS[3], ARGV[2]);",
    "if timeout ~= false then ",
    "local ttl = redis.call('pttl', KEYS[1]);",
    "return math.max(0, ttl); ",
    "end;",
    "local lastThreadId = redis.call('lindex', KEYS[2], -1);",
    "local ttl;",
    "if lastThreadId ~= false and lastThreadId ~= ARGV[2] and redis.call('zscore', KEYS[3], lastThreadId) ~= false then ",
    "ttl = tonumber(redis.call('zscore', KEYS[3], lastThreadId)) - tonumber(ARGV[4]);",
    "else ",
    "ttl = redis.call('pttl', KEYS[1]);",
    "end;",
    "local timeout = ttl + tonumber(ARGV[3]) + tonumber(ARGV[4]);",
    "if redis.call('zadd', KEYS[3], timeout, ARGV[2]) == 1 then ",
    "redis.call('rpush', KEYS[2], ARGV[2]);",
    "end;",
    "return ttl;",
);

/// `RedissonFairLock.tryLockInnerAsync` (`EVAL_LONG`) as Redisson sent it before 3.32.0
/// (the version of redisson/redisson@4339c99 and of 3.12–3.31): a queued waiter's retry
/// answers `timeout - threadWaitTime - now`, which `RedissonLock.lock()` waits out with
/// no bound (`latch.acquireUninterruptibly()`) once it is negative. KEYS: lock, queue,
/// timeout set. ARGV: lease ms, owner, wait ms, now ms.
pub const FAIR_TRY_LOCK_BEFORE_3_32: &str = concat!(
    "while true do ",
    "local firstThreadId2 = redis.call('lindex', KEYS[2], 0);",
    "if firstThreadId2 == false then ",
    "break;",
    "end;",
    "local timeout = tonumber(redis.call('zscore', KEYS[3], firstThreadId2));",
    "if timeout <= tonumber(ARGV[4]) then ",
    "redis.call('zrem', KEYS[3], firstThreadId2);",
    "redis.call('lpop', KEYS[2]);",
    "else ",
    "break;",
    "end;",
    "end;",
    fair_take_or_reenter!(),
    "local timeout = redis.call('zscore', KEYS[3], ARGV[2]);",
    "if timeout ~= false then ",
    "return timeout - tonumber(ARGV[3]) - tonumber(ARGV[4]);",
    "end;",
    "local lastThreadId = redis.call('lindex', KEYS[2], -1);",
    "local ttl;",
    "if lastThreadId ~= false and lastThreadId ~= ARGV[2] then ",
    "ttl = tonumber(redis.call('zscore', KEYS[3], lastThreadId)) - tonumber(ARGV[4]);",
    "else ",
    "ttl = redis.call('pttl', KEYS[1]);",
    "end;",
    "local timeout = ttl + tonumber(ARGV[3]) + tonumber(ARGV[4]);",
    "if redis.call('zadd', KEYS[3], timeout, ARGV[2]) == 1 then ",
    "redis.call('rpush', KEYS[2], ARGV[2]);",
    "end;",
    "return ttl;",
);

/// `RedissonFairLock.tryLockInnerAsync` with `EVAL_NULL_BOOLEAN` (`tryLock()`: one
/// attempt, never enqueues). KEYS: lock, queue, timeout set. ARGV: lease ms, owner,
/// now ms, wait ms. Returns nil when acquired, 1 when not.
pub const FAIR_TRY_LOCK_ONCE: &str = concat!(
    fair_sweep!("3"),
    "if (redis.call('exists', KEYS[1]) == 0) ",
    "and ((redis.call('exists', KEYS[2]) == 0) ",
    "or (redis.call('lindex', KEYS[2], 0) == ARGV[2])) then ",
    "redis.call('lpop', KEYS[2]);",
    "redis.call('zrem', KEYS[3], ARGV[2]);",
    "local keys = redis.call('zrange', KEYS[3], 0, -1);",
    "for i = 1, #keys, 1 do ",
    "redis.call('zincrby', KEYS[3], -tonumber(ARGV[4]), keys[i]);",
    "end;",
    "redis.call('hset', KEYS[1], ARGV[2], 1);",
    "redis.call('pexpire', KEYS[1], ARGV[1]);",
    "return nil;",
    "end;",
    "if (redis.call('hexists', KEYS[1], ARGV[2]) == 1) then ",
    "redis.call('hincrby', KEYS[1], ARGV[2], 1);",
    "redis.call('pexpire', KEYS[1], ARGV[1]);",
    "return nil;",
    "end;",
    "return 1;",
);

/// `RedissonFairLock.acquireFailedAsync`: leaves the queue after a timed-out wait.
/// KEYS: queue, timeout set. ARGV: owner, wait ms.
pub const FAIR_ACQUIRE_FAILED: &str = concat!(
    "local queue = redis.call('lrange', KEYS[1], 0, -1);",
    "local i = 1;",
    "while i <= #queue and queue[i] ~= ARGV[1] do ",
    "i = i + 1;",
    "end;",
    "i = i + 1;",
    "while i <= #queue do ",
    "redis.call('zincrby', KEYS[2], -tonumber(ARGV[2]), queue[i]);",
    "i = i + 1;",
    "end;",
    "redis.call('zrem', KEYS[2], ARGV[1]);",
    "redis.call('lrem', KEYS[1], 0, ARGV[1]);",
);

/// `RedissonFairLock.unlockInnerAsync`. KEYS: lock, queue, timeout set, channel,
/// unlock latch. ARGV: unlock message, lease ms, owner, now ms, publish command, latch
/// timeout ms. Publishes to `channel:<next owner>` only.
pub const FAIR_UNLOCK: &str = concat!(
    "local val = redis.call('get', KEYS[5]); ",
    "if val ~= false then ",
    "return tonumber(val);",
    "end; ",
    fair_sweep_spaced!("4"),
    "if (redis.call('exists', KEYS[1]) == 0) then ",
    "local nextThreadId = redis.call('lindex', KEYS[2], 0); ",
    "if nextThreadId ~= false then ",
    "redis.call(ARGV[5], KEYS[4] .. ':' .. nextThreadId, ARGV[1]); ",
    "end; ",
    "redis.call('set', KEYS[5], 1, 'px', ARGV[6]); ",
    "return 1; ",
    "end;",
    "if (redis.call('hexists', KEYS[1], ARGV[3]) == 0) then ",
    "return nil;",
    "end; ",
    "local counter = redis.call('hincrby', KEYS[1], ARGV[3], -1); ",
    "if (counter > 0) then ",
    "redis.call('pexpire', KEYS[1], ARGV[2]); ",
    "redis.call('set', KEYS[5], 0, 'px', ARGV[6]); ",
    "return 0; ",
    "end; ",
    "redis.call('del', KEYS[1]); ",
    "redis.call('set', KEYS[5], 1, 'px', ARGV[6]); ",
    "local nextThreadId = redis.call('lindex', KEYS[2], 0); ",
    "if nextThreadId ~= false then ",
    "redis.call(ARGV[5], KEYS[4] .. ':' .. nextThreadId, ARGV[1]); ",
    "end; ",
    "return 1; ",
);

/// `RedissonFairLock.forceUnlockAsync`. KEYS: lock, queue, timeout set, channel.
/// ARGV: unlock message, now ms, publish command.
pub const FAIR_FORCE_UNLOCK: &str = concat!(
    fair_sweep_spaced!("2"),
    "if (redis.call('del', KEYS[1]) == 1) then ",
    "local nextThreadId = redis.call('lindex', KEYS[2], 0); ",
    "if nextThreadId ~= false then ",
    "redis.call(ARGV[3], KEYS[4] .. ':' .. nextThreadId, ARGV[1]); ",
    "end; ",
    "return 1; ",
    "end; ",
    "return 0;",
);

/// `RedissonReadLock.tryLockInnerAsync`. KEYS: lock, read timeout prefix
/// (`{name}:<owner>:rwlock_timeout`). ARGV: lease ms, owner, owner + `:write`.
pub const READ_TRY_LOCK: &str = concat!(
    "local mode = redis.call('hget', KEYS[1], 'mode'); ",
    "if (mode == false) then ",
    "redis.call('hset', KEYS[1], 'mode', 'read'); ",
    "redis.call('hset', KEYS[1], ARGV[2], 1); ",
    "redis.call('set', KEYS[2] .. ':1', 1); ",
    "redis.call('pexpire', KEYS[2] .. ':1', ARGV[1]); ",
    "redis.call('pexpire', KEYS[1], ARGV[1]); ",
    "return nil; ",
    "end; ",
    "if (mode == 'read') or (mode == 'write' and redis.call('hexists', KEYS[1], ARGV[3]) == 1) then ",
    "local ind = redis.call('hincrby', KEYS[1], ARGV[2], 1); ",
    "local key = KEYS[2] .. ':' .. ind;",
    "redis.call('set', key, 1); ",
    "redis.call('pexpire', key, ARGV[1]); ",
    "local remainTime = redis.call('pttl', KEYS[1]); ",
    "redis.call('pexpire', KEYS[1], math.max(remainTime, ARGV[1])); ",
    "return nil; ",
    "end;",
    "return redis.call('pttl', KEYS[1]);",
);

/// `RedissonReadLock.unlockInnerAsync`. KEYS: lock, channel, read timeout prefix, key
/// prefix (`{name}`), unlock latch. ARGV: unlock message, owner, publish command, latch
/// timeout ms.
pub const READ_UNLOCK: &str = concat!(
    "local val = redis.call('get', KEYS[5]); ",
    "if val ~= false then ",
    "return tonumber(val);",
    "end; ",
    "local mode = redis.call('hget', KEYS[1], 'mode'); ",
    "if (mode == false) then ",
    "redis.call(ARGV[3], KEYS[2], ARGV[1]); ",
    "redis.call('set', KEYS[5], 1, 'px', ARGV[4]); ",
    "return nil; ",
    "end; ",
    "local lockExists = redis.call('hexists', KEYS[1], ARGV[2]); ",
    "if (lockExists == 0) then ",
    "return nil;",
    "end; ",
    "local counter = redis.call('hincrby', KEYS[1], ARGV[2], -1); ",
    "if (counter == 0) then ",
    "redis.call('hdel', KEYS[1], ARGV[2]); ",
    "end;",
    "redis.call('del', KEYS[3] .. ':' .. (counter+1)); ",
    "if (redis.call('hlen', KEYS[1]) > 1) then ",
    "local maxRemainTime = -3; ",
    "local keys = redis.call('hkeys', KEYS[1]); ",
    "for n, key in ipairs(keys) do ",
    "counter = tonumber(redis.call('hget', KEYS[1], key)); ",
    "if type(counter) == 'number' then ",
    "for i=counter, 1, -1 do ",
    "local remainTime = redis.call('pttl', KEYS[4] .. ':' .. key .. ':rwlock_timeout:' .. i); ",
    "maxRemainTime = math.max(remainTime, maxRemainTime);",
    "end; ",
    "end; ",
    "end; ",
    "if maxRemainTime > 0 then ",
    "redis.call('pexpire', KEYS[1], maxRemainTime); ",
    "redis.call('set', KEYS[5], 0, 'px', ARGV[4]); ",
    "return 0; ",
    "end;",
    "if mode == 'write' then ",
    "redis.call('set', KEYS[5], 0, 'px', ARGV[4]); ",
    "return 0;",
    "end; ",
    "end; ",
    "redis.call('del', KEYS[1]); ",
    "redis.call(ARGV[3], KEYS[2], ARGV[1]); ",
    "redis.call('set', KEYS[5], 1, 'px', ARGV[4]); ",
    "return 1; ",
);

/// `RedissonReadLock.renewExpirationAsync`. KEYS: lock, key prefix (`{name}`).
/// ARGV: lease ms, owner. Also extends every reader's `rwlock_timeout` key.
pub const READ_RENEW: &str = concat!(
    "local counter = redis.call('hget', KEYS[1], ARGV[2]); ",
    "if (counter ~= false) then ",
    "redis.call('pexpire', KEYS[1], ARGV[1]); ",
    "if (redis.call('hlen', KEYS[1]) > 1) then ",
    "local keys = redis.call('hkeys', KEYS[1]); ",
    "for n, key in ipairs(keys) do ",
    "counter = tonumber(redis.call('hget', KEYS[1], key)); ",
    "if type(counter) == 'number' then ",
    "for i=counter, 1, -1 do ",
    "redis.call('pexpire', KEYS[2] .. ':' .. key .. ':rwlock_timeout:' .. i, ARGV[1]); ",
    "end; ",
    "end; ",
    "end; ",
    "end; ",
    "return 1; ",
    "end; ",
    "return 0;",
);

/// `RedissonReadLock.forceUnlockAsync`. KEYS: lock, channel. ARGV: unlock message,
/// publish command.
pub const READ_FORCE_UNLOCK: &str = concat!(
    "if (redis.call('hget', KEYS[1], 'mode') == 'read') then ",
    "redis.call('del', KEYS[1]); ",
    "redis.call(ARGV[2], KEYS[2], ARGV[1]); ",
    "return 1; ",
    "end; ",
    "return 0; ",
);

/// `RedissonWriteLock.tryLockInnerAsync`. KEYS: lock. ARGV: lease ms, owner + `:write`.
pub const WRITE_TRY_LOCK: &str = concat!(
    "local mode = redis.call('hget', KEYS[1], 'mode'); ",
    "if (mode == false) then ",
    "redis.call('hset', KEYS[1], 'mode', 'write'); ",
    "redis.call('hset', KEYS[1], ARGV[2], 1); ",
    "redis.call('pexpire', KEYS[1], ARGV[1]); ",
    "return nil; ",
    "end; ",
    "if (mode == 'write') then ",
    "if (redis.call('hexists', KEYS[1], ARGV[2]) == 1) then ",
    "redis.call('hincrby', KEYS[1], ARGV[2], 1); ",
    "local currentExpire = redis.call('pttl', KEYS[1]); ",
    "redis.call('pexpire', KEYS[1], currentExpire + ARGV[1]); ",
    "return nil; ",
    "end; ",
    "end;",
    "return redis.call('pttl', KEYS[1]);",
);

/// `RedissonWriteLock.unlockInnerAsync`. KEYS: lock, channel, unlock latch. ARGV:
/// read-unlock message (`1`), lease ms, owner + `:write`, publish command, latch
/// timeout ms. Publishes only when no reader remains; otherwise hands over to `read`.
pub const WRITE_UNLOCK: &str = concat!(
    "local val = redis.call('get', KEYS[3]); ",
    "if val ~= false then ",
    "return tonumber(val);",
    "end; ",
    "local mode = redis.call('hget', KEYS[1], 'mode'); ",
    "if (mode == false) then ",
    "redis.call(ARGV[4], KEYS[2], ARGV[1]); ",
    "redis.call('set', KEYS[3], 1, 'px', ARGV[5]); ",
    "return nil; ",
    "end;",
    "if (mode == 'write') then ",
    "local lockExists = redis.call('hexists', KEYS[1], ARGV[3]); ",
    "if (lockExists == 0) then ",
    "return nil;",
    "else ",
    "local counter = redis.call('hincrby', KEYS[1], ARGV[3], -1); ",
    "if (counter > 0) then ",
    "redis.call('pexpire', KEYS[1], ARGV[2]); ",
    "redis.call('set', KEYS[3], 0, 'px', ARGV[5]); ",
    "return 0; ",
    "else ",
    "redis.call('hdel', KEYS[1], ARGV[3]); ",
    "if (redis.call('hlen', KEYS[1]) == 1) then ",
    "redis.call('del', KEYS[1]); ",
    "redis.call(ARGV[4], KEYS[2], ARGV[1]); ",
    "else ",
    "redis.call('hset', KEYS[1], 'mode', 'read'); ",
    "end; ",
    "redis.call('set', KEYS[3], 1, 'px', ARGV[5]); ",
    "return 1; ",
    "end; ",
    "end; ",
    "end; ",
    "return nil;",
);

/// `RedissonWriteLock.forceUnlockAsync`. KEYS: lock, channel. ARGV: read-unlock
/// message (`1`), publish command.
pub const WRITE_FORCE_UNLOCK: &str = concat!(
    "if (redis.call('hget', KEYS[1], 'mode') == 'write') then ",
    "redis.call('del', KEYS[1]); ",
    "redis.call(ARGV[2], KEYS[2], ARGV[1]); ",
    "return 1; ",
    "end; ",
    "return 0; ",
);
