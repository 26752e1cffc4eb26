//! The read/write lock (`LOCK_KIND_READ` / `LOCK_KIND_WRITE`, Redisson's
//! `RReadWriteLock` layout) end to end: readers share, writers exclude readers and each
//! other, a writer's release wakes every reader, write-then-read by one owner, the TTL of
//! the hash follows the longest read hold, kind checks against plain mutexes, the
//! watchdog, and interoperation with Redisson's read and write lock scripts.

use latchkey_client::{Client, Lease, LockKind, LockState};
use latchkey_tests::proxy::Proxy;
use latchkey_tests::redisson::{random_owner, PublishCommand, RedissonReadLock, RedissonWriteLock, Subscription};
use latchkey_tests::server::{spawn_queued, Latchkey};
use latchkey_tests::{bounded, poll_until, redis_client, RedisServer};
use std::time::{Duration, Instant};
use tokio::task::JoinHandle;
use tonic::Code;

/// Bound on anything that should happen promptly but is not timed by the spec.
const T: Duration = Duration::from_secs(10);

/// Polls Describe every 20 ms until `pred` holds; panics after `limit` with the last state.
async fn wait_state(client: &Client, name: &str, limit: Duration, pred: impl Fn(&LockState) -> bool) -> LockState {
    let deadline = Instant::now() + limit;
    loop {
        let state = client.describe(name).await.expect("describe");
        if pred(&state) {
            return state;
        }
        assert!(
            Instant::now() < deadline,
            "{name}: condition not met within {limit:?}: {state:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Takes `kind` on `name` at once (try-once); panics when refused.
async fn take(client: &Client, name: &str, kind: LockKind) -> Lease {
    client
        .lock(name)
        .kind(kind)
        .try_once()
        .acquire()
        .await
        .unwrap_or_else(|err| panic!("{kind:?} on {name} granted at once: {err}"))
}

/// Starts a request for `kind` on `name` that waits up to `T`, once the server has
/// queued it (its first try found the lock busy).
async fn spawn_waiting(
    client: &Client,
    name: &str,
    kind: LockKind,
) -> JoinHandle<Result<Lease, latchkey_client::Error>> {
    spawn_queued(client.lock(name).kind(kind).wait(T), T).await.0
}

/// Asserts that `kind` on `name` is refused (busy) within a short wait.
async fn assert_busy(client: &Client, name: &str, kind: LockKind) {
    let err = client
        .lock(name)
        .kind(kind)
        .wait(Duration::from_millis(300))
        .acquire()
        .await
        .expect_err("the lock is busy");
    assert_eq!(err.code(), Code::DeadlineExceeded, "{kind:?} on {name}: {err}");
}

/// Lets a waiting request settle; it must still be waiting afterwards.
async fn assert_still_waiting<R>(task: &JoinHandle<R>, what: &str) {
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!task.is_finished(), "{what} must still wait");
}

fn pttl(redis: &RedisServer, key: &str) -> i64 {
    redis.cli(&["PTTL", key]).trim().parse().expect("PTTL is a number")
}

#[tokio::test]
async fn readers_share_the_lock() {
    let redis = RedisServer::start();
    let a = Latchkey::start(&redis.url()).await;
    let b = Latchkey::start(&redis.url()).await;
    let (ca, cb) = (a.client().await, b.client().await);
    let r1 = take(&ca, "shared", LockKind::Read).await;
    let r2 = take(&cb, "shared", LockKind::Read).await;
    let r3 = take(&ca, "shared", LockKind::Read).await;
    let state = ca.describe("shared").await.unwrap();
    assert_eq!(state.kind(), LockKind::Read, "{state:?}");
    assert!(state.locked);
    assert_eq!(state.holders.len(), 3, "{state:?}");
    let mut owners: Vec<&str> = state.holders.iter().map(|h| h.owner.as_str()).collect();
    owners.sort_unstable();
    let mut want = vec![r1.owner(), r2.owner(), r3.owner()];
    want.sort_unstable();
    assert_eq!(owners, want);
    assert_eq!(redis.cli(&["HGET", "shared", "mode"]).trim(), "read");
    assert_eq!(redis.cli(&["HGET", "shared", r1.owner()]).trim(), "1");
    assert!(r2.fencing_token() > r1.fencing_token() && r3.fencing_token() > r2.fencing_token());
    for r in [r1, r2, r3] {
        r.release().await.unwrap();
    }
    assert_eq!(redis.cli(&["EXISTS", "shared"]).trim(), "0");
}

#[tokio::test]
async fn writers_exclude_each_other_and_readers() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let w = client
        .lock("excl")
        .kind(LockKind::Write)
        .owner("w:1")
        .try_once()
        .acquire()
        .await
        .unwrap();
    assert_eq!(redis.cli(&["HGET", "excl", "mode"]).trim(), "write");
    assert_eq!(redis.cli(&["HGET", "excl", "w:1:write"]).trim(), "1");
    let state = client.describe("excl").await.unwrap();
    assert_eq!(state.kind(), LockKind::Write, "{state:?}");
    assert_busy(&client, "excl", LockKind::Write).await;
    assert_busy(&client, "excl", LockKind::Read).await;
    let waiting = spawn_waiting(&client, "excl", LockKind::Write).await;
    assert_still_waiting(&waiting, "the second writer").await;
    let first_token = w.fencing_token();
    let released_at = Instant::now();
    w.release().await.unwrap();
    let second = tokio::time::timeout(Duration::from_secs(1), waiting)
        .await
        .expect("the second writer acquires within 1 s")
        .unwrap()
        .unwrap();
    assert!(released_at.elapsed() < Duration::from_secs(1));
    assert!(second.fencing_token() > first_token);
    second.release().await.unwrap();
}

#[tokio::test]
async fn a_writer_waits_for_every_reader() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let r1 = take(&client, "rw", LockKind::Read).await;
    let r2 = take(&client, "rw", LockKind::Read).await;
    let writer = spawn_waiting(&client, "rw", LockKind::Write).await;
    assert_still_waiting(&writer, "the writer (two readers)").await;
    r1.release().await.unwrap();
    assert_still_waiting(&writer, "the writer (one reader left)").await;
    let released_at = Instant::now();
    r2.release().await.unwrap();
    let w = tokio::time::timeout(Duration::from_secs(1), writer)
        .await
        .expect("the writer acquires within 1 s of the last reader leaving")
        .unwrap()
        .unwrap();
    assert!(released_at.elapsed() < Duration::from_secs(1));
    assert_eq!(client.describe("rw").await.unwrap().kind(), LockKind::Write);
    w.release().await.unwrap();
}

#[tokio::test]
async fn a_writers_release_wakes_every_waiting_reader() {
    let redis = RedisServer::start();
    let a = Latchkey::start(&redis.url()).await;
    let b = Latchkey::start(&redis.url()).await;
    let (ca, cb) = (a.client().await, b.client().await);
    let w = take(&ca, "wake", LockKind::Write).await;
    let readers = vec![
        spawn_waiting(&ca, "wake", LockKind::Read).await,
        spawn_waiting(&cb, "wake", LockKind::Read).await,
        spawn_waiting(&ca, "wake", LockKind::Read).await,
    ];
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(readers.iter().all(|r| !r.is_finished()), "readers wait for the writer");
    let released_at = Instant::now();
    w.release().await.unwrap();
    let mut leases = Vec::new();
    for r in readers {
        let lease = tokio::time::timeout_at((released_at + Duration::from_secs(1)).into(), r)
            .await
            .expect("every reader acquires within 1 s of the writer's release")
            .unwrap()
            .unwrap();
        leases.push(lease);
    }
    let state = ca.describe("wake").await.unwrap();
    assert_eq!((state.kind(), state.holders.len()), (LockKind::Read, 3), "{state:?}");
}

#[tokio::test]
async fn the_writer_may_also_read() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let w = client
        .lock("wr")
        .kind(LockKind::Write)
        .owner("x:1")
        .acquire()
        .await
        .unwrap();
    let r = client
        .lock("wr")
        .kind(LockKind::Read)
        .owner("x:1")
        .try_once()
        .acquire()
        .await
        .expect("the write holder takes the read lock at once");
    assert_eq!(redis.cli(&["HGET", "wr", "mode"]).trim(), "write");
    assert_eq!(redis.cli(&["HGET", "wr", "x:1"]).trim(), "1");
    assert!(r.fencing_token() > w.fencing_token());
    assert_busy(&client, "wr", LockKind::Read).await;
    let other = spawn_waiting(&client, "wr", LockKind::Read).await;
    assert_still_waiting(&other, "another owner's reader").await;
    w.release().await.unwrap();
    // Only X's read hold remains: the lock is in read mode, and the other reader joins.
    let joined = tokio::time::timeout(Duration::from_secs(2), other)
        .await
        .expect("the other reader joins once the write hold is gone")
        .unwrap()
        .unwrap();
    let state = client.describe("wr").await.unwrap();
    assert_eq!((state.kind(), state.holders.len()), (LockKind::Read, 2), "{state:?}");
    r.release().await.unwrap();
    joined.release().await.unwrap();
}

/// A read hold whose timeout key is gone (a Redisson thread sharing its owner unlocked
/// by index, or someone deleted it) gives back that gap, never the key of another live
/// hold of its owner: the owner's other stream still reads, and writers wait. It took
/// the key that named the other hold, the lock then read as holding nothing and was
/// deleted, and a writer got in beside a reader.
#[tokio::test]
async fn a_read_hold_whose_key_is_gone_leaves_its_owners_other_key() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let read = || {
        client
            .lock("gap")
            .kind(LockKind::Read)
            .owner("o:1")
            .try_once()
            .acquire()
    };
    let first = read().await.unwrap();
    let second = read().await.unwrap();
    let key = |n: u32| format!("{{gap}}:o:1:rwlock_timeout:{n}");
    assert_eq!(redis.cli(&["EXISTS", &key(2)]).trim(), "1", "the second's key");
    let second_key = redis.cli(&["GET", &key(2)]);
    redis.cli(&["DEL", &key(1)]);
    first.release().await.unwrap();
    assert_eq!(
        redis.cli(&["GET", &key(1)]),
        second_key,
        "the second's key, moved into place"
    );
    assert_busy(&client, "gap", LockKind::Write).await;
    let state = client.describe("gap").await.unwrap();
    assert_eq!((state.kind(), state.holders.len()), (LockKind::Read, 1), "{state:?}");
    second.release().await.unwrap();
}

#[tokio::test]
async fn the_hash_ttl_follows_the_longest_read_hold() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let long = client
        .lock("ttl")
        .kind(LockKind::Read)
        .owner("long:1")
        .lease(Duration::from_secs(10))
        .try_once()
        .acquire()
        .await
        .unwrap();
    let short = client
        .lock("ttl")
        .kind(LockKind::Read)
        .owner("short:1")
        .lease(Duration::from_secs(3))
        .try_once()
        .acquire()
        .await
        .unwrap();
    let ttl = pttl(&redis, "ttl");
    assert!(
        ttl > 5_000 && ttl <= 10_000,
        "a shorter read hold must not shorten the lock: {ttl}"
    );
    let timeouts = redis.cli(&["KEYS", "*rwlock_timeout*"]);
    assert!(
        timeouts.contains("long:1") && timeouts.contains("short:1"),
        "{timeouts}"
    );
    short.release().await.unwrap();
    let ttl = pttl(&redis, "ttl");
    assert!(ttl > 5_000 && ttl <= 10_000, "the longest hold's ttl stays: {ttl}");
    let timeouts = redis.cli(&["KEYS", "*rwlock_timeout*"]);
    assert!(
        timeouts.contains("long:1") && !timeouts.contains("short:1"),
        "{timeouts}"
    );
    assert!(!long.is_lost());
    assert_busy(&client, "ttl", LockKind::Write).await;
    long.release().await.unwrap();
    assert_eq!(redis.cli(&["EXISTS", "ttl"]).trim(), "0");
}

/// Two streams of one owner read on different fixed leases and end in any order: the
/// one that ends first never takes the other's timeout with it, so no writer gets in
/// while the longer reader still holds.
#[tokio::test]
async fn one_owners_readers_keep_their_own_leases() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let read = |lease: u64| {
        client
            .lock("shared-owner")
            .kind(LockKind::Read)
            .owner("reports")
            .lease(Duration::from_secs(lease))
            .try_once()
            .acquire()
    };
    let short = read(10).await.expect("first read");
    let long = read(3600).await.expect("second read, same owner");
    assert_eq!(long.hold_count(), 2);
    // The short hold's timeout key ends 2 ms before its record's lease, as it may when
    // the two were set in different ms (the release then took the long hold's key).
    let records = redis.cli(&["KEYS", "latchkey_hold:{shared-owner}:*"]);
    let record = records
        .lines()
        .min_by_key(|r| pttl(&redis, r))
        .expect("the short hold's record");
    let cut = "redis.call('pexpire', KEYS[1], redis.call('pttl', KEYS[2]) - 5000 - 2)";
    redis.cli(&["EVAL", cut, "2", "{shared-owner}:reports:rwlock_timeout:1", record]);
    short.release().await.unwrap();
    let ttl = pttl(&redis, "shared-owner");
    assert!(ttl > 3_000_000, "the hour-long read hold keeps the lock: {ttl} ms");
    assert_busy(&client, "shared-owner", LockKind::Write).await;
    long.release().await.unwrap();
    assert_eq!(redis.cli(&["EXISTS", "shared-owner"]).trim(), "0");
}

/// One owner's many read holds cost a renewal round commands in proportion to their
/// number: every hold's renewal lengthens all of the owner's timeout keys, and a batch
/// now does that once per owner (before, a thousand holds cost a million `PTTL`s per
/// round, and a few thousand would hold Redis up for seconds). Three hundred holds
/// tell the two apart (90 000 against a bound of 6 000); a release still reads each of
/// the owner's timeout keys, so a thousand released at once cost Redis seconds on a
/// loaded machine (docs/safety.md, findings left).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_owners_many_reads_cost_a_renewal_round_in_proportion() {
    const HOLDS: usize = 300;
    let redis = RedisServer::start();
    let server = Latchkey::start_with(&redis.url(), &["--watchdog-timeout", "3s"]).await;
    let client = server.client().await;
    let reads = (0..HOLDS).map(|_| {
        client
            .lock("many-reads")
            .kind(LockKind::Read)
            .owner("batch")
            .try_once()
            .acquire()
    });
    let leases: Vec<Lease> = futures::future::try_join_all(reads).await.expect("every read granted");
    assert_eq!(leases.iter().map(Lease::hold_count).max(), Some(HOLDS as u32));
    redis.cli(&["CONFIG", "RESETSTAT"]);
    // A round each second, each one call for the 300 holds.
    let renewed = poll_until(Duration::from_secs(5), || redis.evalsha_calls() >= 1).await;
    assert!(renewed, "a round renewed the holds");
    // (Counted after the PTTLs: a round between the two reads only widens the bound.)
    let pttls = redis.command_calls("pttl");
    let rounds = redis.evalsha_calls();
    assert!(
        pttls < 20 * HOLDS * rounds,
        "{pttls} PTTL calls for {HOLDS} holds in {rounds} rounds"
    );
    assert!(leases.iter().all(|l| !l.is_lost()));
    futures::future::try_join_all(leases.into_iter().map(Lease::release))
        .await
        .unwrap();
}

/// A latchkey reader of `name` on a fixed lease of a minute, and a Redisson reader
/// beside it whose hold lasts `java_ms`.
async fn read_beside_java(client: &Client, redis: &RedisServer, name: &str, java_ms: i64) -> (Lease, RedissonReadLock) {
    let reader = client
        .lock(name)
        .kind(LockKind::Read)
        .lease(Duration::from_secs(60))
        .try_once()
        .acquire()
        .await
        .expect("latchkey reads");
    let java = RedissonReadLock::new(&redis_client(&redis.url()).await, name, &random_owner());
    assert_eq!(java.try_lock(java_ms).await, None, "Redisson reads beside it");
    (reader, java)
}

/// A Redisson reader's watchdog renewal sets the lock and every reader's timeout keys
/// to its own lease (30 s by default), cutting a longer fixed read lease of latchkey's.
/// The next check of that lease restores what is left of it, so once the Redisson
/// reader leaves, no writer gets in while the latchkey reader still holds.
#[tokio::test]
async fn a_redisson_readers_renewal_does_not_cut_a_fixed_read_lease() {
    let redis = RedisServer::start();
    let server = Latchkey::start_with(&redis.url(), &["--watchdog-timeout", "3s"]).await;
    let client = server.client().await;
    let (reader, java) = read_beside_java(&client, &redis, "cut", 30_000).await;
    // Its watchdog, with a 2 s lockWatchdogTimeout for the test's sake.
    assert!(java.renew(2_000).await);
    assert!(pttl(&redis, "cut") <= 2_000, "the renewal cut the lock");
    assert_eq!(java.unlock().await, Some(false), "the latchkey reader stays");
    // Within a check round (one a second here), the lock lasts the fixed lease again.
    let restored = poll_until(Duration::from_secs(5), || pttl(&redis, "cut") > 50_000).await;
    assert!(restored, "the lock's TTL is {} ms", pttl(&redis, "cut"));
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    assert!(!reader.is_lost());
    assert_busy(&client, "cut", LockKind::Write).await;
    reader.release().await.unwrap();
}

/// A latchkey reader whose server died beside a Redisson reader: the Java reader's
/// renewal lengthens every reader's timeout key, the dead read's too, and its unlock
/// then kept the lock up for that key's TTL (30 s) with nobody holding, announcing
/// nothing: a latchkey writer waited all of it. The writer's try takes the lapsed read
/// off, and while reads hold it looks again when a latchkey read's lease may lapse.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_gets_past_a_dead_servers_read_kept_by_a_redisson_renewal() {
    let redis = RedisServer::start();
    // A 3 s lease, renewed each second: at least 2 s left at the kill, for the Java
    // reader to unlock while the dead read still counts.
    let args = ["--redis-url", &redis.url(), "--no-metrics", "--watchdog-timeout", "3s"].map(str::to_owned);
    let mut crashing = latchkey_tests::LatchkeyProcess::spawn(&args);
    let doomed = crashing.serving_client().await;
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let _read = take(&doomed, "kept", LockKind::Read).await;
    let java = RedissonReadLock::new(&redis_client(&redis.url()).await, "kept", &random_owner());
    assert_eq!(java.try_lock(30_000).await, None, "Redisson reads beside it");
    crashing.kill();
    let killed = Instant::now();
    // The Java reader's watchdog renews after the kill: the dead read's key lives 30 s.
    assert!(java.renew(30_000).await);
    let writer = {
        let client = client.clone();
        tokio::spawn(async move {
            let wait = client.lock("kept").kind(LockKind::Write).wait(Duration::from_secs(20));
            wait.acquire().await
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(java.unlock().await, Some(false), "the dead read still counts");
    let write = tokio::time::timeout(Duration::from_secs(25), writer)
        .await
        .expect("the writer's wait ends")
        .unwrap()
        .expect("the writer is granted");
    // The dead read's 3 s lease, then the writer's look at it.
    assert!(
        killed.elapsed() < Duration::from_secs(8),
        "granted {:?} after the kill",
        killed.elapsed()
    );
    let keys = redis.cli(&["KEYS", "{kept}:*:rwlock_timeout:*"]);
    let reads: Vec<&str> = keys.lines().filter(|k| !k.contains(":write:")).collect();
    assert!(reads.is_empty(), "read keys left: {reads:?}");
    assert_eq!(redis.cli(&["HLEN", "kept"]).trim(), "2", "the write alone");
    write.release().await.unwrap();
}

/// A Java thread that shares a latchkey writer's owner id reads beside it (the writer's
/// own reads). Redisson's read unlock sets the lock's lifetime to the longest of the
/// holds' timeout keys it finds, every numeric field's: a write hold had none, so the
/// lock could end with a short read's key, long before the writer's next renewal, and
/// another writer got in while the first still held. Each write hold now has a timeout
/// key too (`{name}:<owner>:write:rwlock_timeout:<n>`), which that unlock counts.
#[tokio::test]
async fn a_redisson_read_unlock_by_the_writers_owner_keeps_the_write_lease() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let owner = random_owner();
    let writer = client
        .lock("shared-owner")
        .kind(LockKind::Write)
        .owner(owner.as_str())
        .try_once()
        .acquire()
        .await
        .expect("latchkey writes");
    let java = RedissonReadLock::new(&redis_client(&redis.url()).await, "shared-owner", &owner);
    for _ in 0..2 {
        assert_eq!(java.try_lock(300).await, None, "the writer's owner reads");
    }
    assert_eq!(java.unlock().await, Some(false), "one read is left");
    assert!(
        pttl(&redis, "shared-owner") > 20_000,
        "the lock's TTL is {} ms",
        pttl(&redis, "shared-owner")
    );
    // Past the short read's lease, the write hold still keeps every other writer out.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!writer.is_lost());
    assert_busy(&client, "shared-owner", LockKind::Write).await;
    writer.release().await.unwrap();
}

#[tokio::test]
async fn a_mutex_and_a_read_write_lock_do_not_mix() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;

    let r = take(&client, "as-read", LockKind::Read).await;
    let err = client
        .lock("as-read")
        .kind(LockKind::Mutex)
        .wait(Duration::from_secs(1))
        .acquire()
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "MUTEX on a READ-held name: {err}");
    r.release().await.unwrap();

    let m = take(&client, "as-mutex", LockKind::Mutex).await;
    for kind in [LockKind::Read, LockKind::Write] {
        let err = client
            .lock("as-mutex")
            .kind(kind)
            .wait(Duration::from_secs(1))
            .acquire()
            .await
            .unwrap_err();
        assert_eq!(
            err.code(),
            Code::FailedPrecondition,
            "{kind:?} on a MUTEX-held name: {err}"
        );
    }
    m.release().await.unwrap();
    // The name is free again: any kind may take it.
    take(&client, "as-mutex", LockKind::Read).await.release().await.unwrap();
}

#[tokio::test]
async fn a_writer_waits_for_a_redisson_reader() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let conn = redis_client(&redis.url()).await;
    let java = RedissonReadLock::new(&conn, "java-read", &random_owner());
    assert_eq!(java.try_lock(30_000).await, None, "redisson reads");
    let err = client
        .lock("java-read")
        .kind(LockKind::Write)
        .wait(Duration::from_millis(300))
        .acquire()
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::DeadlineExceeded, "same kind family: waits, {err}");
    let writer = spawn_waiting(&client, "java-read", LockKind::Write).await;
    assert_still_waiting(&writer, "the latchkey writer").await;
    let unlocked_at = Instant::now();
    assert_eq!(java.unlock().await, Some(true));
    tokio::time::timeout(Duration::from_secs(1), writer)
        .await
        .expect("the writer acquires within 1 s of Redisson's read unlock")
        .unwrap()
        .unwrap();
    assert!(unlocked_at.elapsed() < Duration::from_secs(1));
}

#[tokio::test]
async fn a_latchkey_reader_is_woken_by_redissons_write_unlock() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let conn = redis_client(&redis.url()).await;
    let java = RedissonWriteLock::new(&conn, "java-write", &random_owner());
    assert_eq!(java.try_lock(30_000).await, None, "redisson writes");
    assert_busy(&client, "java-write", LockKind::Read).await;
    let reader = spawn_waiting(&client, "java-write", LockKind::Read).await;
    assert_still_waiting(&reader, "the latchkey reader").await;
    let mut sub = java.subscribe().await;
    let unlocked_at = Instant::now();
    assert_eq!(java.unlock().await, Some(true));
    assert_eq!(
        sub.next_message(T).await.as_deref(),
        Some("1"),
        "Redisson publishes \"1\""
    );
    sub.close().await;
    let lease = tokio::time::timeout(Duration::from_secs(1), reader)
        .await
        .expect("the reader acquires within 1 s of Redisson's write unlock")
        .unwrap()
        .unwrap();
    assert!(unlocked_at.elapsed() < Duration::from_secs(1));
    assert!(
        java.try_lock(30_000).await.is_some(),
        "redisson's writer is refused now"
    );
    lease.release().await.unwrap();
}

#[tokio::test]
async fn redisson_readers_wait_for_a_latchkey_writer_and_share_with_latchkey_readers() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let conn = redis_client(&redis.url()).await;
    let java = RedissonReadLock::new(&conn, "mixed", &random_owner());
    let w = take(&client, "mixed", LockKind::Write).await;
    let ttl = java.try_lock(30_000).await.expect("redisson's reader is refused");
    assert!(ttl > 20_000 && ttl <= 30_000, "the writer's ttl: {ttl}");
    let mut sub = java.subscribe().await;
    w.release().await.unwrap();
    assert!(
        sub.next_message(T).await.is_some(),
        "latchkey's write release is published"
    );
    sub.close().await;
    assert_eq!(java.try_lock(30_000).await, None, "redisson reads now");
    let r = take(&client, "mixed", LockKind::Read).await;
    let state = client.describe("mixed").await.unwrap();
    assert_eq!((state.kind(), state.holders.len()), (LockKind::Read, 2), "{state:?}");
    assert_busy(&client, "mixed", LockKind::Write).await;
    r.release().await.unwrap();
    assert_eq!(java.unlock().await, Some(true));
}

#[tokio::test]
async fn the_watchdog_keeps_a_read_hold() {
    let redis = RedisServer::start();
    let server = Latchkey::start_with(&redis.url(), &["--watchdog-timeout", "1500ms"]).await;
    let client = server.client().await;
    let r = client
        .lock("kept")
        .kind(LockKind::Read)
        .owner("reader:1")
        .acquire()
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(4000)).await;
    assert!(!r.is_lost());
    let ttl = pttl(&redis, "kept");
    assert!(ttl > 0 && ttl <= 1500, "pttl {ttl}");
    let timeouts = redis.cli(&["KEYS", "*rwlock_timeout*"]);
    assert!(
        timeouts.contains("reader:1"),
        "the read hold's timeout key is kept: {timeouts:?}"
    );
    let state = wait_state(&client, "kept", T, |s| s.locked).await;
    assert_eq!(state.kind(), LockKind::Read);
    assert_busy(&client, "kept", LockKind::Write).await;
    r.release().await.unwrap();
    assert_eq!(redis.cli(&["EXISTS", "kept"]).trim(), "0");
    assert_eq!(redis.cli(&["KEYS", "*rwlock_timeout*"]).trim(), "");
}

/// A writer that also reads (Redisson allows read within write) lets go of its write
/// hold: the lock goes to read mode under its read hold, and a reader of another owner
/// waiting behind a waiting writer joins within a second. The wake goes to the writer,
/// first in line, whose try finds the lock held for reading and hands the wake to the
/// readers behind it.
#[tokio::test]
async fn a_reader_behind_a_waiting_writer_joins_when_a_write_hold_ends_under_a_read() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let name = "downgrade";
    let hold = |kind| client.lock(name).kind(kind).owner("x:1").try_once().acquire();
    let write = hold(LockKind::Write).await.expect("write");
    let read = hold(LockKind::Read).await.expect("the writer reads too");
    let writer = spawn_waiting(&client, name, LockKind::Write).await;
    assert_still_waiting(&writer, "the writer").await;
    let reader = spawn_waiting(&client, name, LockKind::Read).await;
    assert_still_waiting(&reader, "the reader").await;
    let released_at = Instant::now();
    write.release().await.unwrap();
    assert_eq!(redis.cli(&["HGET", name, "mode"]).trim(), "read");
    let joined = tokio::time::timeout(Duration::from_secs(1), reader)
        .await
        .expect("the reader joins within 1 s of the write hold's end")
        .unwrap()
        .unwrap();
    assert!(released_at.elapsed() < Duration::from_secs(1));
    joined.release().await.unwrap();
    read.release().await.unwrap();
    writer
        .await
        .unwrap()
        .expect("the writer after the readers")
        .release()
        .await
        .unwrap();
}

/// A Redisson writer lets go and a Redisson reader takes the read lock before the
/// latchkey writer woken first tries: that writer loses, and the latchkey reader behind
/// it, which may share the lock with the Java reader, is woken and joins within a
/// second (not at its recheck, the Java hold's 30 s TTL).
#[tokio::test]
async fn a_reader_behind_a_writer_that_lost_to_a_redisson_reader_is_woken() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let conn = redis_client(&redis.url()).await;
    let name = "lost-race";
    let java = RedissonWriteLock::new(&conn, name, &random_owner());
    assert_eq!(java.try_lock(30_000).await, None, "redisson writes");
    let writer = spawn_waiting(&client, name, LockKind::Write).await;
    assert_still_waiting(&writer, "the writer").await;
    let reader = spawn_waiting(&client, name, LockKind::Read).await;
    assert_still_waiting(&reader, "the reader").await;
    // In one step, as Redis would order them: the Java writer unlocks, publishing "1" as
    // RedissonWriteLock does, and a Java reader takes the read lock, before any woken
    // latchkey waiter's try.
    let owner = random_owner();
    let script = "redis.call('del', KEYS[1]); \
                  redis.call('hset', KEYS[1], 'mode', 'read'); \
                  redis.call('hset', KEYS[1], ARGV[1], 1); \
                  redis.call('set', KEYS[2], 1, 'px', 30000); \
                  redis.call('pexpire', KEYS[1], 30000); \
                  redis.call('publish', KEYS[3], '1'); return 1";
    let timeout_key = format!("{{{name}}}:{owner}:rwlock_timeout:1");
    let channel = format!("redisson_rwlock:{{{name}}}");
    let released_at = Instant::now();
    redis.cli(&["EVAL", script, "3", name, &timeout_key, &channel, &owner]);
    let joined = tokio::time::timeout(Duration::from_secs(1), reader)
        .await
        .expect("the reader joins the Java reader within 1 s")
        .unwrap()
        .unwrap();
    assert!(released_at.elapsed() < Duration::from_secs(1));
    joined.release().await.unwrap();
    writer.abort();
}

/// A reader on a long lease lets go while a Java reader on a short one still reads: the
/// hash then lives only as long as the Java hold, which runs out with no unlock message
/// (its process died). The writer waiting since the long reader held it was told to
/// look again at that reader's TTL (a minute here); it must look again once the lock it
/// waits for can expire, and take it within a second of the Java hold's end.
#[tokio::test]
async fn a_writer_waiting_on_a_long_read_takes_the_lock_once_the_shorter_read_left_runs_out() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let name = "shortened";
    let (long, _java) = read_beside_java(&client, &redis, name, 2_000).await;
    let java_ends = Instant::now() + Duration::from_secs(2);
    let writer = spawn_waiting(&client, name, LockKind::Write).await;
    assert_still_waiting(&writer, "the writer").await;
    long.release().await.unwrap();
    let ttl = pttl(&redis, name);
    assert!(ttl > 0 && ttl <= 2_000, "the Java hold alone keeps the lock: {ttl} ms");
    let taken = tokio::time::timeout_at((java_ends + Duration::from_secs(1)).into(), writer)
        .await
        .expect("the writer takes the lock within 1 s of the Java hold's end")
        .unwrap()
        .expect("the writer");
    taken.release().await.unwrap();
}

/// A writer on a long lease also reads (here a Java reader of the same owner, on a
/// short lease), then lets go of the write hold: the lock is then held for reading
/// alone and must live as long as that read hold, not as long as the write lease had
/// left. Once the read hold runs out (its process died: no unlock message), a waiting
/// writer takes the lock within a second.
#[tokio::test]
async fn a_write_hold_that_ends_under_a_shorter_read_leaves_the_lock_that_reads_lease() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let conn = redis_client(&redis.url()).await;
    let name = "downgrade-ttl";
    let owner = "writes:1";
    let write = client
        .lock(name)
        .kind(LockKind::Write)
        .owner(owner)
        .lease(Duration::from_secs(60))
        .try_once()
        .acquire()
        .await
        .expect("the long writer");
    let java = RedissonReadLock::new(&conn, name, owner);
    assert_eq!(java.try_lock(2_000).await, None, "the writer's owner reads for 2 s");
    let java_ends = Instant::now() + Duration::from_secs(2);
    let writer = spawn_waiting(&client, name, LockKind::Write).await;
    assert_still_waiting(&writer, "the second writer").await;
    write.release().await.unwrap();
    assert_eq!(redis.cli(&["HGET", name, "mode"]).trim(), "read");
    let ttl = pttl(&redis, name);
    assert!(ttl > 0 && ttl <= 2_000, "the read hold alone keeps the lock: {ttl} ms");
    let taken = tokio::time::timeout_at((java_ends + Duration::from_secs(1)).into(), writer)
        .await
        .expect("the second writer takes the lock within 1 s of the read hold's end")
        .unwrap()
        .expect("the second writer");
    taken.release().await.unwrap();
}

/// A fixed write lease that runs out while its owner also reads gives the lock back to
/// those reads: another reader shares it at once. The release that ended the lease
/// reached Redis when the hold record had only its grace left, and gave back nothing
/// (a lapsed hold may stand for nothing any more), so the write hold stayed in the
/// lock, which the owner's read kept alive: every other reader and writer waited for as
/// long as the owner read.
#[tokio::test]
async fn a_fixed_write_lease_that_runs_out_under_its_owners_read_shares_the_lock() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let name = "downgrade-by-expiry";
    let hold = |kind| client.lock(name).kind(kind).owner("x:1").try_once();
    let write = hold(LockKind::Write)
        .lease(Duration::from_secs(2))
        .acquire()
        .await
        .unwrap();
    let read = hold(LockKind::Read).acquire().await.expect("the writer reads too");
    let reason = tokio::time::timeout(T, write.lost()).await.expect("told in time");
    assert_eq!(reason, latchkey_client::LostReason::LeaseExpired);
    let other = client
        .lock(name)
        .kind(LockKind::Read)
        .wait(Duration::from_secs(1))
        .acquire()
        .await
        .expect("another reader shares once the write lease ended");
    let state = client.describe(name).await.unwrap();
    assert_eq!(state.kind(), LockKind::Read, "{state:?}");
    other.release().await.unwrap();
    read.release().await.unwrap();
}

/// A mutex's renewal takes only a mutex's hash. A mutex whose key vanished (expired
/// under a paused server, flushed), then taken by a writer of the same owner that also
/// reads (mode `write`, and a reader's field named as the mutex's owner), was renewed
/// as if still held, and its holder went on beside the writer.
#[tokio::test]
async fn a_mutex_renewal_finds_no_hold_in_a_write_locked_hash() {
    let redis = RedisServer::start();
    let server = Latchkey::start_with(&redis.url(), &["--watchdog-timeout", "900ms"]).await;
    let client = server.client().await;
    let name = "mutex-then-write";
    let lock = |kind| client.lock(name).owner("shared-owner").kind(kind).try_once();
    let mutex = lock(LockKind::Mutex).acquire().await.unwrap();
    redis.cli(&["DEL", name]);
    let _write = lock(LockKind::Write).acquire().await.expect("the name is free");
    let _read = lock(LockKind::Read).acquire().await.expect("a writer reads");
    let reason = tokio::time::timeout(Duration::from_secs(5), mutex.lost())
        .await
        .expect("the mutex's loss is heard at its next renewal");
    assert_eq!(reason, latchkey_client::LostReason::NotHeld);
}

/// A read hold given back takes its own timeout key with it, not a lapsed hold's. An
/// owner's timeout keys are numbered by hold count, not by stream: the release took
/// the shortest, and a hold that had lapsed (its server killed) has the shortest of
/// all, an expired one. The live stream's release left its own key behind under the
/// lapsed hold's count, and the lock stayed read-locked by nobody for the rest of the
/// live stream's lease, every writer waiting.
#[tokio::test]
async fn a_read_release_beside_a_lapsed_read_of_its_owner_frees_the_lock() {
    let redis = RedisServer::start();
    let mut short = latchkey_tests::LatchkeyProcess::spawn(
        &["--redis-url", &redis.url(), "--watchdog-timeout", "900ms"].map(str::to_owned),
    );
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let name = "lapsed-reader";
    let read = |c: &Client| c.lock(name).owner("one-owner").kind(LockKind::Read).try_once();
    for lapsed_first in [true, false] {
        let lapsing_client = short.serving_client().await;
        let (lapsing, live) = if lapsed_first {
            let lapsing = read(&lapsing_client).acquire().await.unwrap();
            (lapsing, read(&client).acquire().await.unwrap())
        } else {
            let live = read(&client).acquire().await.unwrap();
            (read(&lapsing_client).acquire().await.unwrap(), live)
        };
        assert_eq!(lapsing.hold_count(), if lapsed_first { 1 } else { 2 });
        short.kill();
        std::mem::forget(lapsing);
        // The killed server's hold lapses with its lease.
        tokio::time::sleep(Duration::from_millis(1200)).await;
        live.release().await.unwrap();
        let writer = client.lock(name).kind(LockKind::Write).try_once().acquire().await;
        let writer = writer.unwrap_or_else(|e| panic!("a writer waits for nobody ({lapsed_first}): {e}"));
        writer.release().await.unwrap();
        short.restart();
    }
}

/// Two read/write locks whose hold keys coincide in Redisson's layout (`{t}:orders` read
/// by owner `eu:w1`, `{t}:orders:eu` read by owner `w1`: both keep
/// `{t}:orders:eu:w1:rwlock_timeout:1`) never share one: the second waits until the
/// first's key is gone. The second reader's release deleted the first's key, after which
/// the first lock read free and a writer was granted beside its live reader.
#[tokio::test]
async fn read_holds_whose_keys_coincide_never_share_them() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let read = |name: &'static str, owner: &'static str| client.lock(name).kind(LockKind::Read).owner(owner);
    let first = read("{t}:orders", "eu:w1").try_once().acquire().await.unwrap();
    let err = read("{t}:orders:eu", "w1")
        .wait(Duration::from_millis(300))
        .acquire()
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::DeadlineExceeded, "{err}");
    assert!(client.describe("{t}:orders").await.unwrap().locked);
    let other = take(&client, "{t}:orders", LockKind::Read).await;
    other.release().await.unwrap();
    assert_busy(&client, "{t}:orders", LockKind::Write).await;
    assert!(!first.is_lost());
    // Once the first is gone the second is granted, and then the first must wait.
    first.release().await.unwrap();
    let second = read("{t}:orders:eu", "w1").try_once().acquire().await.expect("granted");
    let err = read("{t}:orders", "eu:w1").try_once().acquire().await.unwrap_err();
    assert_eq!(err.code(), Code::DeadlineExceeded, "{err}");
    second.release().await.unwrap();
}

/// Streams of one owner hold read (or write) locks on leases of their own. A renewal,
/// or a fixed lease's check, lengthened every timeout key of the owner, not its own:
/// beside a fixed lease of an hour, a stream whose server then died kept its key for
/// that long, and once the fixed lease was released early the lock stayed held by
/// nobody for the hour, every writer waiting. (A write hold's partial release also
/// left the lock the longest lease any of the owner's write holds ever had.)
#[tokio::test]
async fn a_fixed_lease_released_beside_a_crashed_stream_of_its_owner_frees_the_lock() {
    let redis = RedisServer::start();
    // Fixed leases are checked every second.
    let server = Latchkey::start_with(&redis.url(), &["--watchdog-timeout", "3s"]).await;
    let client = server.client().await;
    for kind in [LockKind::Read, LockKind::Write] {
        let name = format!("fixed-beside-crashed-{kind:?}");
        let mut crashing = latchkey_tests::LatchkeyProcess::spawn(
            &["--redis-url", &redis.url(), "--watchdog-timeout", "3s"].map(str::to_owned),
        );
        let other = crashing.serving_client().await;
        let lock = |c: &Client| c.lock(name.as_str()).owner("o").kind(kind).try_once();
        let crashed = lock(&other).acquire().await.unwrap();
        let fixed = lock(&client).lease(Duration::from_secs(3600)).acquire().await.unwrap();
        // A check of the fixed lease while the other stream's key lives.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        fixed.release().await.unwrap();
        crashing.kill();
        std::mem::forget(crashed);
        // The crashed stream's 3 s lease runs out.
        let freed = poll_until(Duration::from_secs(8), || redis.cli(&["EXISTS", &name]).trim() == "0").await;
        assert!(freed, "{kind:?}: the lock left for {} ms more", pttl(&redis, &name));
        take(&client, &name, LockKind::Write).await.release().await.unwrap();
    }
}

/// A read of the writer's own, on a fixed lease longer than its write's, released
/// early: the lock then lives as long as the write's lease, not the read's. It kept the
/// longer TTL the read had set while the lock was in write mode, and once the write's
/// server died the lock stayed held by nobody for the read's hour, every other owner
/// refused.
#[tokio::test]
async fn a_read_under_a_crashed_write_released_early_leaves_the_lock_the_writes_lease() {
    let redis = RedisServer::start();
    let server = Latchkey::start_with(&redis.url(), &["--watchdog-timeout", "3s"]).await;
    let client = server.client().await;
    let name = "read-under-crashed-write";
    let mut crashing = latchkey_tests::LatchkeyProcess::spawn(
        &["--redis-url", &redis.url(), "--watchdog-timeout", "3s"].map(str::to_owned),
    );
    let other = crashing.serving_client().await;
    let write = other
        .lock(name)
        .owner("o")
        .kind(LockKind::Write)
        .try_once()
        .acquire()
        .await
        .unwrap();
    let read = client
        .lock(name)
        .owner("o")
        .kind(LockKind::Read)
        .lease(Duration::from_secs(3600))
        .try_once()
        .acquire()
        .await
        .unwrap();
    read.release().await.unwrap();
    assert!(
        pttl(&redis, name) <= 3_000,
        "the write's lease: {} ms",
        pttl(&redis, name)
    );
    crashing.kill();
    std::mem::forget(write);
    let freed = poll_until(Duration::from_secs(8), || redis.cli(&["EXISTS", name]).trim() == "0").await;
    assert!(freed, "the lock left for {} ms more", pttl(&redis, name));
    take(&client, name, LockKind::Read).await.release().await.unwrap();
}

/// A write hold released beside a lapsed sibling of latchkey's own (its server died)
/// leaves the lock the longest live sibling's lease. The lapsed one's missing key was
/// read as a Redisson writer's (kept 30 s, Redisson's watchdog timeout), though the
/// owner is latchkey's, whose holds all have keys: the lock stayed 30 s where 5 s were
/// left, and everyone waited for it once that sibling's server died too.
#[tokio::test]
async fn a_write_released_beside_a_lapsed_sibling_leaves_the_lock_the_live_ones_lease() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let name = "write-beside-lapsed";
    let mut crashing = latchkey_tests::LatchkeyProcess::spawn(
        &["--redis-url", &redis.url(), "--watchdog-timeout", "2s"].map(str::to_owned),
    );
    let other = crashing.serving_client().await;
    let write = |c: &Client| c.lock(name).owner("o").kind(LockKind::Write).try_once();
    let lapsing = write(&other).acquire().await.unwrap();
    let five = write(&client).lease(Duration::from_secs(5)).acquire().await.unwrap();
    let minute = write(&client).lease(Duration::from_secs(60)).acquire().await.unwrap();
    crashing.kill();
    std::mem::forget(lapsing);
    // The dead server's hold lapses with its key, the first of the owner's.
    let first_key = || redis.cli(&["KEYS", "*:o:write:rwlock_timeout:1"]);
    let lapsed = poll_until(Duration::from_secs(5), || first_key().trim().is_empty()).await;
    assert!(lapsed, "the dead server's hold key stayed: {}", first_key());
    minute.release().await.unwrap();
    let left = pttl(&redis, name);
    assert!(
        left <= 5_000,
        "the lock kept {left} ms; its longest live hold had under 5 000"
    );
    five.release().await.unwrap();
}

/// A release that cuts the lock's TTL short tells waiters with Redisson's read-unlock
/// message ("1"), which wakes every waiting thread of a Java client; its unlock message
/// ("0"), sent before, woke one, and the others slept on the longer TTL.
#[tokio::test]
async fn a_release_that_cuts_the_ttl_wakes_every_redisson_thread() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let name = "ttl-cut-message";
    let conn = redis_client(&redis.url()).await;
    let channel = format!("redisson_rwlock:{{{name}}}");
    let mut messages = Subscription::open(&conn, &channel, PublishCommand::Publish).await;
    let lock = |kind: LockKind| client.lock(name).owner("o").kind(kind).try_once();
    let long = lock(LockKind::Write)
        .lease(Duration::from_secs(60))
        .acquire()
        .await
        .unwrap();
    let short = lock(LockKind::Write).acquire().await.unwrap();
    long.release().await.unwrap();
    let message = messages.next_message(T).await;
    assert_eq!(message.as_deref(), Some("1"), "the TTL-cut notice");
    short.release().await.unwrap();
}

/// The same, the other way round: the crashed stream's key runs out first, then the
/// fixed write lease is released early. A write hold with no key whose owner is shaped
/// like Redisson's ids may be a Redisson writer's, whose watchdog renews the lock every
/// 10 s: the lock keeps 30 s at most (Redisson's default watchdog timeout), not the
/// rest of the hour it kept. Any other owner's lapsed with its stream: the lock goes.
#[tokio::test]
async fn a_fixed_write_lease_released_after_a_crashed_siblings_key_ran_out_keeps_the_lock_no_longer() {
    let redis = RedisServer::start();
    let server = Latchkey::start_with(&redis.url(), &["--watchdog-timeout", "3s"]).await;
    let client = server.client().await;
    let name = "fixed-after-crashed-write";
    for (owner, kept) in [("o", -2..=-2), (random_owner().as_str(), 0..=30_000)].map(|(o, k)| (o.to_owned(), k)) {
        let mut crashing = latchkey_tests::LatchkeyProcess::spawn(
            &["--redis-url", &redis.url(), "--watchdog-timeout", "3s"].map(str::to_owned),
        );
        let other = crashing.serving_client().await;
        let lock = |c: &Client| c.lock(name).owner(owner.as_str()).kind(LockKind::Write).try_once();
        let crashed = lock(&other).acquire().await.unwrap();
        let fixed = lock(&client).lease(Duration::from_secs(3600)).acquire().await.unwrap();
        crashing.kill();
        std::mem::forget(crashed);
        let key = format!("{{{name}}}:{owner}:write:rwlock_timeout:1");
        let ran_out = poll_until(Duration::from_secs(8), || redis.cli(&["EXISTS", &key]).trim() == "0").await;
        assert!(ran_out, "the crashed stream's key runs out with its 3 s lease");
        fixed.release().await.unwrap();
        let left = pttl(&redis, name);
        assert!(kept.contains(&left), "{owner}: the lock left for {left} ms more");
        redis.cli(&["DEL", name]);
    }
}

/// A fair lock is briefly free between two holders while its waiters stay queued: a
/// read, write or semaphore request in that moment was granted (their scripts looked
/// at the lock's key alone), and each queued fair waiter's next try then failed with
/// WRONG_KIND. Now they are refused as a mutex is.
#[tokio::test]
async fn a_free_fair_lock_with_waiters_queued_refuses_every_other_kind() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let keys = latchkey_server::keys::Keys::default().lock("between");
    // A waiter of another server, in line until far ahead: the lock is free meanwhile.
    let deadline = (std::time::SystemTime::now() + Duration::from_secs(600))
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis()
        .to_string();
    redis.cli(&["RPUSH", &keys.queue(), "other:1"]);
    redis.cli(&["ZADD", &keys.timeouts(), &deadline, "other:1"]);
    for kind in [LockKind::Mutex, LockKind::Read, LockKind::Write, LockKind::Semaphore] {
        let lock = client.lock("between").kind(kind).try_once();
        let lock = if kind == LockKind::Semaphore {
            lock.limit(2)
        } else {
            lock
        };
        let err = lock.acquire().await.expect_err("the fair waiter's turn");
        assert_eq!(err.code(), Code::FailedPrecondition, "{kind:?}: {err}");
    }
}

/// A writer that also reads drops its write: another owner's reader joins at once,
/// and another owner's writer takes the lock promptly once the read is gone.
#[tokio::test]
async fn a_downgraded_lock_shares_then_frees() {
    let redis = RedisServer::start();
    let a = Latchkey::start(&redis.url()).await;
    let b = Latchkey::start(&redis.url()).await;
    let ca = a.client().await;
    let cb = b.client().await;
    let w = ca
        .lock("rw")
        .kind(LockKind::Write)
        .owner("o")
        .try_once()
        .acquire()
        .await
        .unwrap();
    let r = ca
        .lock("rw")
        .kind(LockKind::Read)
        .owner("o")
        .try_once()
        .acquire()
        .await
        .unwrap();
    let (writer, _) = spawn_queued(cb.lock("rw").kind(LockKind::Write).wait(T), T).await;
    w.release().await.unwrap();
    let other = cb
        .lock("rw")
        .kind(LockKind::Read)
        .try_once()
        .acquire()
        .await
        .expect("shares the downgraded read");
    other.release().await.unwrap();
    let at = std::time::Instant::now();
    r.release().await.unwrap();
    let lease = writer.await.unwrap().expect("writer granted");
    assert!(
        at.elapsed() < Duration::from_secs(2),
        "writer woken late: {:?}",
        at.elapsed()
    );
    lease.release().await.unwrap();
}

/// Write streams of one named owner wait on two servers behind a Redisson holder, and
/// on the second server another owner's stream of kind `ahead` waits before its own.
/// The holder lets go and the owner's stream on the first server is granted (the
/// second server's Redis link is slowed, so it loses the race): the owner's stream on
/// the second server reenters at once, woken there by the try that found the lock
/// written. The unlock message had woken only the stream ahead of it, and it slept
/// until the holder's 30 s TTL before.
async fn an_owners_write_on_one_server_lets_its_stream_on_another_reenter(ahead: LockKind) {
    let redis = RedisServer::start();
    let proxy = latchkey_tests::proxy::Proxy::to_redis(&redis).await;
    let a = Latchkey::start(&redis.url()).await;
    let b = Latchkey::start(&proxy.redis_url()).await;
    let (ca, cb) = (a.client().await, b.client().await);
    let conn = redis_client(&redis.url()).await;
    let name = "fellow";
    // A reader holds for a writer ahead, a writer for a reader ahead.
    let (java_read, java_write) = (
        RedissonReadLock::new(&conn, name, &random_owner()),
        RedissonWriteLock::new(&conn, name, &random_owner()),
    );
    let held = match ahead {
        LockKind::Write => java_read.try_lock(30_000).await,
        _ => java_write.try_lock(30_000).await,
    };
    assert_eq!(held, None, "a Redisson holder for 30 s");
    let (other, _) = spawn_queued(cb.lock(name).kind(ahead).owner("p").wait(T), T).await;
    let wait = Duration::from_secs(60);
    let (fellow, _) = spawn_queued(cb.lock(name).kind(LockKind::Write).owner("o").wait(wait), T).await;
    let (first, _) = spawn_queued(ca.lock(name).kind(LockKind::Write).owner("o").wait(T), T).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    proxy.set_delay(Duration::from_millis(300));
    let unlocked = match ahead {
        LockKind::Write => java_read.unlock().await,
        _ => java_write.unlock().await,
    };
    assert_eq!(unlocked, Some(true));
    let granted = latchkey_tests::bounded(T, "the owner's first stream", first)
        .await
        .unwrap()
        .expect("granted");
    proxy.set_delay(Duration::ZERO);
    let fellow = tokio::time::timeout(Duration::from_secs(3), fellow)
        .await
        .unwrap_or_else(|_| panic!("{ahead:?} ahead: the owner's stream on b not granted within 3 s"))
        .unwrap()
        .expect("granted");
    assert_eq!(fellow.hold_count(), 2, "reentered");
    fellow.release().await.unwrap();
    granted.release().await.unwrap();
    other.abort();
}

#[tokio::test]
async fn an_owners_write_on_one_server_lets_its_stream_behind_a_writer_on_another_reenter() {
    an_owners_write_on_one_server_lets_its_stream_on_another_reenter(LockKind::Write).await;
}

#[tokio::test]
async fn an_owners_write_on_one_server_lets_its_stream_behind_a_reader_on_another_reenter() {
    an_owners_write_on_one_server_lets_its_stream_on_another_reenter(LockKind::Read).await;
}

/// A writer waiting behind a reader on its server, told an earlier writer's TTL (a
/// minute): the release that wakes the reader has the writer try too, and learn the
/// readers' TTL. The readers' last hold then runs out without a message (a Redisson
/// reader's, whose process left no unlock), and the writer takes the free lock then,
/// not a minute on.
#[tokio::test]
async fn a_writer_behind_a_reader_follows_the_readers_ttl_not_an_earlier_writers() {
    let redis = RedisServer::start();
    let server = Latchkey::start_with(&redis.url(), &["--watchdog-timeout", "1500ms"]).await;
    let client = server.client().await;
    let conn = redis_client(&redis.url()).await;
    let name = "rw-silent";
    let earlier = RedissonWriteLock::new(&conn, name, &random_owner());
    assert_eq!(
        earlier.try_lock(60_000).await,
        None,
        "the earlier writer holds for a minute"
    );
    let mut reader = spawn_waiting(&client, name, LockKind::Read).await;
    let mut writer = spawn_waiting(&client, name, LockKind::Write).await;
    assert_eq!(earlier.unlock().await, Some(true));
    let read = tokio::select! {
        r = &mut reader => r.unwrap().expect("the reader is granted"),
        w = &mut writer => {
            // The writer's try came first: it took the free lock at once.
            w.unwrap().expect("granted").release().await.unwrap();
            let r = bounded(T, "the reader", reader).await.unwrap();
            r.expect("granted").release().await.unwrap();
            return;
        }
    };
    // A Redisson reader's lease outlasts the latchkey reader's: the latter's release
    // leaves the lock's TTL as it is, and publishes nothing.
    let java = RedissonReadLock::new(&conn, name, &random_owner());
    assert_eq!(java.try_lock(3_000).await, None, "the Java reader shares the lock");
    read.release().await.unwrap();
    let free_at = Instant::now() + Duration::from_secs(3);
    let w = bounded(T, "the writer", writer).await.unwrap();
    let late = Instant::now().saturating_duration_since(free_at);
    assert!(
        late < Duration::from_secs(2),
        "granted {late:?} after the lock was free"
    );
    w.expect("granted once the reads ran out").release().await.unwrap();
}

/// An application's hash that happens to have a `mode` field (a Java RMap of settings)
/// is no read/write lock: Describe reads it as none, and a read or write request is
/// refused `FAILED_PRECONDITION` as for a name held as another kind, the hash left as
/// it was. A read request took it for a read lock: it wrote its owner into the hash,
/// gave it a lifetime, and its release deleted the application's data.
#[tokio::test]
async fn a_read_or_write_request_leaves_an_applications_hash_with_a_mode_alone() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    // With no lifetime, as an application's hash mostly is, and with one.
    for (mode, lifetime) in [("read", false), ("write", false), ("read", true), ("write", true)] {
        redis.cli(&["HSET", "settings", "mode", mode, "theme", "dark"]);
        if lifetime {
            redis.cli(&["PEXPIRE", "settings", "600000"]);
        }
        let state = client.describe("settings").await.unwrap();
        assert!(!state.locked, "Describe reads it as no lock: {state:?}");
        for kind in [LockKind::Read, LockKind::Write] {
            let got = client.lock("settings").kind(kind).try_once().acquire().await;
            let hash = redis.cli(&["HGETALL", "settings"]).replace('\n', " ");
            let err = got
                .map(|_| ())
                .expect_err(&format!("{kind:?} granted on a {mode} hash: {hash}"));
            assert_eq!(err.code(), Code::FailedPrecondition, "{kind:?} on {mode}: {err}");
            assert_eq!(hash.trim(), format!("mode {mode} theme dark"), "{kind:?} on {mode}");
            let ttl: i64 = redis.cli(&["PTTL", "settings"]).trim().parse().unwrap();
            assert!(
                if lifetime { ttl > 500_000 } else { ttl == -1 },
                "{kind:?} on {mode}: {ttl}"
            );
        }
        redis.cli(&["DEL", "settings"]);
    }
}

/// A hash counting more holds than any lock (an application's `{mode: read, n: 30000000}`
/// with a lifetime) is no read/write lock to a try, as to Describe; and a read granted
/// in a hash of too many fields to look over at each try, each counting that many, is
/// given back without reading a timeout key per hold counted. A read release reads
/// every holder's keys, one `PTTL` a hold: 30 million of them (then 65 536 for each of
/// 200 fields) kept Redis from answering any client for as long, past `SCRIPT KILL`
/// (the script had written).
#[tokio::test]
async fn a_hash_counting_more_holds_than_any_lock_never_blocks_redis() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    redis.cli(&["HSET", "counts", "mode", "read", "n", "30000000"]);
    redis.cli(&["PEXPIRE", "counts", "600000"]);
    let got = client.lock("counts").kind(LockKind::Read).try_once().acquire().await;
    let err = got.map(|_| ()).expect_err("a read beside 30 million holds");
    assert_eq!(err.code(), Code::FailedPrecondition, "{err}");
    let readers: Vec<String> = (0..200).map(|i| format!("r{i}")).collect();
    let mut hset = vec!["HSET", "crowd", "mode", "read"];
    hset.extend(readers.iter().flat_map(|r| [r.as_str(), "30000000"]));
    redis.cli(&hset);
    redis.cli(&["PEXPIRE", "crowd", "600000"]);
    let lease = take(&client, "crowd", LockKind::Read).await;
    let started = Instant::now();
    bounded(T, "the release", lease.release()).await.unwrap();
    let took = started.elapsed();
    assert!(took < Duration::from_secs(2), "the release held Redis {took:?}");
}

/// An owner that writes through one server and reads through another, the first
/// killed: its write lapses with its lease, and is taken off the lock at the other
/// server's next renewal of its read, so another owner's reader is granted beside that
/// read. The write field stayed, and the read's renewals kept the lock in write mode:
/// other readers waited for as long as the owner read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lapsed_write_under_its_owners_read_lets_other_readers_in() {
    let redis = RedisServer::start();
    let (mut crashing, writer) = latchkey_tests::LatchkeyProcess::to_crash(&redis.url()).await;
    let server = Latchkey::start_with(&redis.url(), &["--watchdog-timeout", "3s"]).await;
    let client = server.client().await;
    let write = writer
        .lock("lapsed")
        .kind(LockKind::Write)
        .owner("app-a")
        .acquire()
        .await
        .unwrap();
    let read = client
        .lock("lapsed")
        .kind(LockKind::Read)
        .owner("app-a")
        .acquire()
        .await
        .unwrap();
    crashing.kill();
    // The write's 1.5 s lease, then this server's next renewal round (a second).
    let other = another_reader_soon_after(&client, "lapsed", Instant::now()).await;
    assert!(!read.is_lost(), "the owner's read stays held");
    other.release().await.unwrap();
    read.release().await.unwrap();
    drop(write);
    assert_eq!(redis.cli(&["EXISTS", "lapsed"]).trim(), "0", "nothing left");
}

/// Another owner's reader of `name`, granted (waiting at most 15 s) within 6 s of
/// `killed`, when the writer's server was killed.
async fn another_reader_soon_after(client: &Client, name: &str, killed: Instant) -> latchkey_client::Lease {
    let other = client
        .lock(name)
        .kind(LockKind::Read)
        .wait(Duration::from_secs(15))
        .acquire()
        .await
        .expect("another owner's reader is granted beside the owner's read");
    assert!(
        killed.elapsed() < Duration::from_secs(6),
        "granted {:?} after the kill",
        killed.elapsed()
    );
    other
}

/// A Java writer whose thread id is negative (Redisson's async APIs take any long) has
/// no timeout keys, as every Redisson writer: a read try took it for a lapsed write of
/// latchkey's, dropped it and was granted beside it.
#[tokio::test]
async fn a_redisson_writer_with_a_negative_thread_id_keeps_readers_out() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let writer = "0a1b2c3d-4e5f-6789-abcd-ef0123456789:-42:write";
    redis.cli(&["HSET", "java-negative", "mode", "write", writer, "1"]);
    redis.cli(&["PEXPIRE", "java-negative", "30000"]);
    let err = client
        .lock("java-negative")
        .kind(LockKind::Read)
        .try_once()
        .acquire()
        .await
        .expect_err("the Java writer holds");
    assert_eq!(err.code(), tonic::Code::DeadlineExceeded, "{err}");
    assert_eq!(
        redis.cli(&["HGET", "java-negative", writer]).trim(),
        "1",
        "the write stays"
    );
}

/// An owner that wrote and read through one server with a long fixed read lease, the
/// server killed: its write lapses with its lease, and no server renews or releases
/// the owner's read to take the write off the lock. Another owner's reader waited in
/// write mode for the read's whole lease; it now looks again once the write may have
/// lapsed, and its try drops the lapsed write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lapsed_write_of_a_dead_server_lets_another_owners_reader_in() {
    let redis = RedisServer::start();
    let (mut crashing, write, read) = write_and_long_read(&redis, "lapsed-alone").await;
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    crashing.kill();
    // The write's 1.5 s lease, then the waiter's next look.
    let other = another_reader_soon_after(&client, "lapsed-alone", Instant::now()).await;
    assert_eq!(redis.cli(&["HGET", "lapsed-alone", "mode"]).trim(), "read");
    other.release().await.unwrap();
    drop((write, read));
}

/// The same lapsed write as inspection sees it: once the write's timeout key is gone,
/// Describe and List show the owner's read alone, as the lock scripts take the lock
/// (another owner's reader is let in). They showed a write held by the owner, with two
/// holds, for the read's whole lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lapsed_write_of_a_dead_server_is_no_holder_in_describe() {
    let redis = RedisServer::start();
    let name = "lapsed-described";
    let (mut crashing, write, read) = write_and_long_read(&redis, name).await;
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let state = client.describe(name).await.unwrap();
    assert_eq!((state.kind(), state.holders.len()), (LockKind::Write, 2), "{state:?}");
    crashing.kill();
    let timeout_key = format!("{{{name}}}:app-b:write:rwlock_timeout:1");
    assert!(
        poll_until(T, || redis.cli(&["EXISTS", &timeout_key]).trim() == "0").await,
        "the write's lease ends"
    );
    let state = client.describe(name).await.unwrap();
    assert!(state.locked, "{state:?}");
    assert_eq!(state.kind(), LockKind::Read, "{state:?}");
    let holds: Vec<_> = state.holders.iter().map(|h| (h.owner.as_str(), h.hold_count)).collect();
    assert_eq!(holds, [("app-b", 1)], "{state:?}");
    let listed = client.list(name, 10, "").await.unwrap();
    assert_eq!(
        listed.locks.first().map(|l| l.kind()),
        Some(LockKind::Read),
        "{listed:?}"
    );
    drop((write, read));
}

/// Owner `app-b`'s write of `name` (the server's 1.5 s lease) and its read with a 60 s
/// fixed lease, through a server about to be killed.
async fn write_and_long_read(redis: &RedisServer, name: &str) -> (latchkey_tests::LatchkeyProcess, Lease, Lease) {
    let (crashing, writer) = latchkey_tests::LatchkeyProcess::to_crash(&redis.url()).await;
    let lock = || writer.lock(name).owner("app-b");
    let write = lock().kind(LockKind::Write).acquire().await.unwrap();
    let read = lock()
        .kind(LockKind::Read)
        .lease(Duration::from_secs(60))
        .acquire()
        .await
        .unwrap();
    (crashing, write, read)
}

/// The same owner's read, or its second write, given back after its write on a killed
/// server lapsed: nothing is left alive, and the lock goes at once, its waiters woken.
/// It stayed in write mode until its TTL, 30 s, and no unlock message was sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_last_live_hold_beside_a_lapsed_write_frees_the_lock() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    for second in [LockKind::Read, LockKind::Write] {
        let (mut crashing, writer) = latchkey_tests::LatchkeyProcess::to_crash(&redis.url()).await;
        let name = format!("lapsed-{second:?}");
        let _write = writer
            .lock(name.as_str())
            .kind(LockKind::Write)
            .owner("app-a")
            .acquire()
            .await
            .unwrap();
        let held = client
            .lock(name.as_str())
            .kind(second)
            .owner("app-a")
            .acquire()
            .await
            .unwrap();
        crashing.kill();
        // Past the killed server's 1.5 s lease (its timeout key gone).
        let prefix = format!("{{{name}}}:app-a:write:rwlock_timeout:1");
        assert!(
            poll_until(T, || redis.cli(&["EXISTS", &prefix]).trim() == "0").await,
            "lapsed"
        );
        let (waiter, _) = spawn_queued(client.lock(name.as_str()).kind(LockKind::Write).wait(T), T).await;
        held.release().await.unwrap();
        let lease = bounded(
            Duration::from_secs(3),
            "the waiter, once the last live hold went",
            waiter,
        )
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("{second:?}: {e}"));
        lease.release().await.unwrap();
    }
}

/// The release of an owner's last read under its own lapsed write (its server died)
/// deletes the lock with one message: the lapsed write's drop announced it, and the
/// release announced it again, which woke a thread of each Java client twice.
#[tokio::test]
async fn a_release_that_drops_a_lapsed_write_and_the_lock_announces_it_once() {
    release_beside_lapsed_holds_announces_once("last-read-under-lapsed-write", false).await;
}

/// The same with a second read of the owner on the dead server, its key run out too: the
/// release drops the lapsed write (one message) and then deletes the lock whose reads all
/// lapsed, which announced it again.
#[tokio::test]
async fn a_release_beside_a_lapsed_write_and_lapsed_reads_announces_it_once() {
    release_beside_lapsed_holds_announces_once("read-beside-lapsed-holds", true).await;
}

/// Owner `o` writes (and with `dead_read` reads too) through a server that is killed,
/// and reads through a live one for an hour: once the dead holds' keys ran out, the live
/// read's release deletes the lock with one read/write-lock message.
async fn release_beside_lapsed_holds_announces_once(name: &str, dead_read: bool) {
    let redis = RedisServer::start();
    // This server's own checks of its read (every third of its timeout) would drop the
    // lapsed write before the release does: none comes within the test.
    let server = Latchkey::start_with(&redis.url(), &["--watchdog-timeout", "60s"]).await;
    let client = server.client().await;
    let mut crashing = latchkey_tests::LatchkeyProcess::spawn(
        &["--redis-url", &redis.url(), "--watchdog-timeout", "3s"].map(str::to_owned),
    );
    let other = crashing.serving_client().await;
    let lock = |c: &Client, kind: LockKind| c.lock(name).owner("o").kind(kind).try_once();
    let mut dead = vec![lock(&other, LockKind::Write).acquire().await.unwrap()];
    let mut keys = vec![format!("{{{name}}}:o:write:rwlock_timeout:1")];
    if dead_read {
        dead.push(lock(&other, LockKind::Read).acquire().await.unwrap());
        keys.push(format!("{{{name}}}:o:rwlock_timeout:1"));
    }
    let read = lock(&client, LockKind::Read)
        .lease(Duration::from_secs(3600))
        .acquire()
        .await
        .unwrap();
    crashing.kill();
    std::mem::forget(dead);
    let ran_out = poll_until(Duration::from_secs(8), || {
        keys.iter().all(|k| redis.cli(&["EXISTS", k]).trim() == "0")
    })
    .await;
    assert!(ran_out, "the crashed holds' keys run out with their 3 s lease");
    assert_eq!(
        redis.cli(&["HGET", name, "mode"]).trim(),
        "write",
        "the lapsed write is still there"
    );
    let conn = redis_client(&redis.url()).await;
    let channel = format!("redisson_rwlock:{{{name}}}");
    let mut messages = Subscription::open(&conn, &channel, PublishCommand::Publish).await;
    read.release().await.unwrap();
    assert_eq!(
        redis.cli(&["EXISTS", name]).trim(),
        "0",
        "the lock went with the last live hold"
    );
    assert!(messages.next_message(T).await.is_some(), "the waiters are told");
    let again = messages.next_message(Duration::from_millis(500)).await;
    assert_eq!(again, None, "told twice");
}

/// A message that cuts a read/write lock's TTL (a reader's release, the holds left
/// ending sooner) wakes one writer of a server, whose try learns the new end; the other
/// writers there look again by then too. They slept on the longer TTL told before: when
/// the woken writer left (its wait ran out) and the last read hold ran out without a
/// message, a writer slept on a free lock until the first reader's fixed lease would
/// have ended.
#[tokio::test]
async fn every_writer_of_a_server_learns_of_a_cut_ttl() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    // Beside it a Java reader whose JVM dies: its hold runs out in 3 s, announcing nothing.
    let (reader, _java) = read_beside_java(&client, &redis, "cut-ttl", 3_000).await;
    let first = client
        .lock("cut-ttl")
        .kind(LockKind::Write)
        .wait(Duration::from_millis(1_500));
    let (first, _) = spawn_queued(first, T).await;
    let second = client
        .lock("cut-ttl")
        .kind(LockKind::Write)
        .wait(Duration::from_secs(30));
    let (second, _) = spawn_queued(second, T).await;
    let started = Instant::now();
    reader.release().await.unwrap();
    let gave_up = tokio::time::timeout(T, first).await.expect("bounded").unwrap();
    assert_eq!(gave_up.unwrap_err().code(), Code::DeadlineExceeded);
    let lease = tokio::time::timeout(T, second)
        .await
        .expect("granted long before the first reader's lease would end")
        .unwrap()
        .expect("granted");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "granted {:?} after the release, the Java read running out by 3 s",
        started.elapsed()
    );
    lease.release().await.unwrap();
}

/// A write whose release reaches Redis after its fixed lease ran out (the server gives
/// a fixed lease back just before its end; here the release waits in the proxy), while
/// its owner's read (a longer lease) keeps the lock up, is dropped by that release, and
/// Redisson's readers are woken: the release answered "not held" and left it, and a
/// Java reader, told the lock's TTL (the read's minute), waited for a renewal round of
/// the read's server to drop it (20 s here).
#[tokio::test]
async fn a_lapsed_writes_release_lets_java_readers_in() {
    let redis = RedisServer::start();
    let proxy = Proxy::to_redis(&redis).await;
    let server = Latchkey::start_with(&proxy.redis_url(), &["--watchdog-timeout", "60s"]).await;
    let client = server.client().await;
    let owned = |kind, lease| {
        (client.lock("lapsing").kind(kind).owner("app-o"))
            .lease(lease)
            .try_once()
    };
    // Only the write's release is held back: set first, whatever the acquires take.
    let release = latchkey_server::scripts::Scripts::new(false)
        .write_release
        .sha()
        .to_owned();
    proxy.hold_back_matching(Some((release.as_bytes(), Duration::from_millis(1500))));
    let write = owned(LockKind::Write, Duration::from_secs(1)).acquire().await.unwrap();
    let _read = owned(LockKind::Read, Duration::from_secs(60)).acquire().await.unwrap();
    let java = RedissonReadLock::new(&redis_client(&redis.url()).await, "lapsing", &random_owner());
    assert!(
        java.lock(Duration::from_secs(8), 30_000).await,
        "in once the write lapsed"
    );
    let forwarded = proxy.first_held().expect("the write's release went through the proxy");
    assert!(
        forwarded.elapsed() < Duration::from_secs(3),
        "in {:?} after the release",
        forwarded.elapsed()
    );
    drop(write);
}

/// A write released while another of its owner, on a shorter lease, stays (its server
/// dead) and the owner's read keeps the lock's TTL: other owners' readers were told to
/// look again when the released write would have lapsed (a minute here), and were not
/// told to look sooner. The release wakes them; they look again when the write left
/// (5 s) lapses and are granted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partial_write_release_wakes_readers_told_of_the_released_write() {
    let redis = RedisServer::start();
    let (mut crashing, crashing_client) = latchkey_tests::LatchkeyProcess::to_crash(&redis.url()).await;
    let server = Latchkey::start_with(&redis.url(), &["--watchdog-timeout", "60s"]).await;
    let client = server.client().await;
    let owned = |client: &Client, kind, lease| {
        (client.lock("partly").kind(kind).owner("app-o"))
            .lease(lease)
            .try_once()
    };
    let _short = owned(&crashing_client, LockKind::Write, Duration::from_secs(5))
        .acquire()
        .await
        .unwrap();
    crashing.kill();
    let long = owned(&client, LockKind::Write, Duration::from_secs(60))
        .acquire()
        .await
        .unwrap();
    let _read = owned(&client, LockKind::Read, Duration::from_secs(120))
        .acquire()
        .await
        .unwrap();
    let (reader, _) = spawn_queued(
        client.lock("partly").kind(LockKind::Read).wait(Duration::from_secs(30)),
        T,
    )
    .await;
    // The short write's key still lives: the release leaves a write that lapses later.
    let short_key = "{partly}:app-o:write:rwlock_timeout:1";
    let left: i64 = redis.cli(&["PTTL", short_key]).trim().parse().unwrap();
    assert!(left > 0, "the short write lapsed before the release ({left})");
    long.release().await.unwrap();
    // The short write lapses within 5 s of its grant.
    let granted = tokio::time::timeout(Duration::from_secs(8), reader).await;
    granted.expect("granted once the short write lapsed").unwrap().unwrap();
}
