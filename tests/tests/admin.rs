//! Describe, List and ForceRelease show and break every kind of lock truthfully.

use latchkey_client::{Client, LockKind, LostReason};
use latchkey_tests::process::raw_command;
use latchkey_tests::proxy::Proxy;
use latchkey_tests::redis_client;
use latchkey_tests::redisson::{random_owner, RedissonLock};
use latchkey_tests::server::Latchkey;
use latchkey_tests::{bounded, RedisCluster, RedisServer};
use std::collections::BTreeSet;
use std::time::Duration;

const T: Duration = Duration::from_secs(10);

#[tokio::test]
async fn list_shows_every_kind_with_its_holders() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let c = server.client().await;
    let _m = c.lock("k/mutex").acquire().await.unwrap();
    let _f = c.lock("k/fair").kind(LockKind::Fair).acquire().await.unwrap();
    let _r1 = c.lock("k/read").kind(LockKind::Read).acquire().await.unwrap();
    let _r2 = c.lock("k/read").kind(LockKind::Read).acquire().await.unwrap();
    let _w = c
        .lock("k/write")
        .kind(LockKind::Write)
        .owner("w:1")
        .acquire()
        .await
        .unwrap();
    let _s = c
        .lock("k/sem")
        .kind(LockKind::Semaphore)
        .limit(5)
        .permits(2)
        .acquire()
        .await
        .unwrap();
    let listed = c.list_all("k/").await.unwrap();
    let kinds: Vec<(String, i32, usize)> = listed
        .iter()
        .map(|l| (l.name.clone(), l.kind, l.holders.len()))
        .collect();
    assert_eq!(
        kinds,
        vec![
            ("k/fair".to_owned(), LockKind::Mutex as i32, 1),
            ("k/mutex".to_owned(), LockKind::Mutex as i32, 1),
            ("k/read".to_owned(), LockKind::Read as i32, 2),
            ("k/sem".to_owned(), LockKind::Semaphore as i32, 1),
            ("k/write".to_owned(), LockKind::Write as i32, 1),
        ],
        "a fair lock without waiters reads as its RLock hash"
    );
    let write = listed.iter().find(|l| l.name == "k/write").unwrap();
    assert_eq!(write.holders[0].owner, "w:1");
    let sem = listed.iter().find(|l| l.name == "k/sem").unwrap();
    assert_eq!(sem.holders[0].hold_count, 2);
    assert!(sem.holders[0].ttl.is_some());
}

#[tokio::test]
async fn force_release_breaks_every_kind_and_wakes_its_waiters() {
    let redis = RedisServer::start();
    let a = Latchkey::start(&redis.url()).await;
    let b = Latchkey::start(&redis.url()).await;
    let (ca, cb) = (a.client().await, b.client().await);
    for (name, kind, limit) in [
        ("f/fair", LockKind::Fair, 0),
        ("f/write", LockKind::Write, 0),
        ("f/read", LockKind::Read, 0),
        ("f/sem", LockKind::Semaphore, 1),
    ] {
        let mut holder = ca.lock(name).kind(kind);
        let waiting_kind = if kind == LockKind::Read { LockKind::Write } else { kind };
        let mut waiter = cb.lock(name).kind(waiting_kind).wait(T);
        if limit > 0 {
            holder = holder.limit(limit);
            waiter = waiter.limit(limit);
        }
        let lease = holder.acquire().await.unwrap();
        let waiting = tokio::spawn(waiter.acquire());
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(ca.force_release(name).await.unwrap(), "{name} was held");
        let reason = tokio::time::timeout(Duration::from_secs(2), lease.lost())
            .await
            .expect("told at once");
        assert_eq!(reason, LostReason::ForceReleased, "{name}");
        let granted = tokio::time::timeout(Duration::from_secs(2), waiting)
            .await
            .expect("woken")
            .unwrap();
        granted.unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}

/// A holder on a fixed lease (which no renewal round visits) is still told when its
/// lock was broken while the server's pub/sub connection was down and the notice went
/// nowhere: once subscribed again, the server checks every lease, fixed ones too.
#[tokio::test]
async fn a_fixed_lease_is_checked_once_missed_notices_are_noticed() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let c = server.client().await;
    let lease = c.lock("fixed").lease(Duration::from_secs(60)).acquire().await.unwrap();
    // One transaction: the server's pub/sub connection goes, and the lock with it.
    let killed = raw_command(redis.port(), "MULTI\r\nCLIENT KILL TYPE pubsub\r\nDEL fixed\r\nEXEC");
    assert_eq!(killed.as_deref(), Some("+OK"));
    let reason = tokio::time::timeout(T, lease.lost()).await.expect("told in time");
    assert_eq!(reason, LostReason::NotHeld);
}

/// Missed notices are noticed while a renewal call is out (its reply on its way; a
/// round of many leases takes seconds): the check of every lease they ask for found
/// that node busy and skipped it, so a lock deleted meanwhile was found gone only at
/// the next round, a third of the timeout later. The node is now checked as soon as
/// its call ends.
#[tokio::test]
async fn missed_notices_during_a_renewal_are_checked_once_it_ends() {
    use latchkey_tests::proxy::Proxy;
    let redis = RedisServer::start();
    let proxy = Proxy::to_redis(&redis).await;
    // Rounds every 10 s.
    let flags = ["--watchdog-timeout", "30s", "--redis-timeout", "5s"];
    let server = Latchkey::start_with(&proxy.redis_url(), &flags).await;
    let c = server.client().await;
    let lease = c.lock("checked-late").acquire().await.unwrap();
    // The next round's reply (no lease lost) comes 4 s after Redis ran it.
    proxy.hold_back_replies_matching(Some((b"*0\r\n", Duration::from_secs(4))));
    let out = latchkey_tests::poll_until(Duration::from_secs(15), || proxy.holding() > 0).await;
    assert!(out, "a renewal's reply is held back");
    proxy.hold_back_replies_matching(None);
    let killed = raw_command(
        redis.port(),
        "MULTI\r\nCLIENT KILL TYPE pubsub\r\nDEL checked-late\r\nEXEC",
    );
    assert_eq!(killed.as_deref(), Some("+OK"));
    let reason = tokio::time::timeout(Duration::from_secs(7), lease.lost())
        .await
        .expect("told once the renewal out ended, not at the next round");
    assert_eq!(reason, LostReason::NotHeld);
}

/// ForceRelease's writes on `name` without its notice (raw commands publish nothing),
/// after `first` in the same transaction (a command and its CRLF, or nothing): the
/// break floor at `token`, the lock gone.
fn break_unheard(redis: &RedisServer, name: &str, token: u64, first: &str) {
    let floor = latchkey_server::keys::Keys::default().lock(name).broken();
    let broken = format!("MULTI\r\n{first}SET {floor} {token}\r\nDEL {name}\r\nEXEC");
    assert_eq!(raw_command(redis.port(), &broken).as_deref(), Some("+OK"));
}

/// A lease of `name` as `kind`, a semaphore of one permit.
async fn hold(c: &latchkey_client::Client, name: &str, kind: LockKind) -> latchkey_client::Lease {
    let lock = c.lock(name).kind(kind);
    let lock = if kind == LockKind::Semaphore {
        lock.limit(1)
    } else {
        lock
    };
    lock.acquire().await.unwrap()
}

/// A holder whose lock ForceRelease broke while the notice went nowhere (the server's
/// pub/sub connection was down, or not yet made at its start) is told the true reason
/// once the server checks its leases: its grant is at or below the break floor. A mutex
/// (its hold record) and a semaphore (its hold's token) alike.
#[tokio::test]
async fn a_break_whose_notice_went_unheard_is_told_as_force_released() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let c = server.client().await;
    for kind in [LockKind::Mutex, LockKind::Semaphore] {
        let name = format!("unheard-{}", kind.as_str_name());
        let lease = hold(&c, &name, kind).await;
        // As the pub/sub connection goes.
        break_unheard(&redis, &name, lease.fencing_token(), "CLIENT KILL TYPE pubsub\r\n");
        let reason = tokio::time::timeout(T, lease.lost()).await.expect("told in time");
        assert_eq!(reason, LostReason::ForceReleased, "{name}");
    }
}

/// A hold broken by a ForceRelease whose notice went unheard, released before any
/// check of the leases, is told FORCE_RELEASED, as a check would have told it; the
/// release used to read as any hold found gone, NOT_HELD. A mutex, a semaphore and a
/// multi-lock broken on a name other than its first alike.
#[tokio::test]
async fn a_release_of_a_hold_broken_without_a_notice_is_told_force_released() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let c = server.client().await;
    let mut leases = Vec::new();
    for kind in [LockKind::Mutex, LockKind::Semaphore] {
        let name = format!("broken-release-{}", kind.as_str_name());
        let lease = hold(&c, &name, kind).await;
        break_unheard(&redis, &name, lease.fencing_token(), "");
        leases.push((name, lease));
    }
    let names = ["multi-broken-1", "multi-broken-2"];
    let multi = c.lock_all(names).acquire().await.unwrap();
    break_unheard(&redis, names[1], multi.fencing_tokens()[1], "");
    leases.push(("multi".into(), multi));
    for (name, lease) in leases {
        let err = lease.release().await.expect_err("the hold was broken");
        assert!(
            matches!(err, latchkey_client::Error::Lost(LostReason::ForceReleased)),
            "{name}: {err}"
        );
    }
}

/// A hash that is no lock (an application's, a Java `RMap`) is left alone by
/// ForceRelease, as Describe reads it free: the script took any hash without a `mode`
/// (or with any `mode`) for a lock, deleted it and answered `released`.
#[tokio::test]
async fn force_release_leaves_a_hash_that_is_no_lock() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let c = server.client().await;
    redis.cli(&["HSET", "profile", "name", "bob"]);
    redis.cli(&["HSET", "prefs", "mode", "dark"]);
    // Counts too large for a hold count (timestamps), and a mode beside no hold count.
    redis.cli(&["HSET", "stamps", "created", "1718000000000"]);
    redis.cli(&["HSET", "session", "mode", "read", "owner", "bob"]);
    // A mode no lock writes, beside a field that could be a hold count.
    redis.cli(&["HSET", "visits", "mode", "lock", "home", "5"]);
    for name in ["profile", "prefs", "stamps", "session", "visits"] {
        assert!(!c.describe(name).await.unwrap().locked, "{name}: no lock");
        assert!(!c.force_release(name).await.unwrap(), "{name}: nothing was held");
    }
    assert_eq!(redis.cli(&["HGET", "profile", "name"]).trim(), "bob");
    assert_eq!(redis.cli(&["HGET", "prefs", "mode"]).trim(), "dark");
    assert_eq!(redis.cli(&["HGET", "stamps", "created"]).trim(), "1718000000000");
    assert_eq!(redis.cli(&["HGET", "session", "owner"]).trim(), "bob");
    assert_eq!(redis.cli(&["HGET", "visits", "home"]).trim(), "5");
}

/// A read/write hash none of whose holds is live is left alone by ForceRelease, as
/// Describe reads it free: an application's hash of a read lock's shape (`mode` and
/// small counts) without timeout keys, and a read lock whose only reader's timeout key
/// is gone. ForceRelease deleted both, answered `released` and left a break floor and
/// a fencing counter under a name that held nothing.
#[tokio::test]
async fn force_release_leaves_a_read_write_hash_that_holds_nothing() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let c = server.client().await;
    redis.cli(&["HSET", "app-limits", "mode", "read", "retries", "3"]);
    redis.cli(&["HSET", "stale-rw", "mode", "read", "dead", "1"]);
    redis.cli(&["PEXPIRE", "stale-rw", "60000"]);
    for name in ["app-limits", "stale-rw"] {
        assert!(!c.describe(name).await.unwrap().locked, "{name}: free");
        assert!(!c.force_release(name).await.unwrap(), "{name}: nothing was held");
    }
    assert_eq!(redis.cli(&["HGET", "app-limits", "retries"]).trim(), "3");
    assert_eq!(redis.cli(&["HGET", "stale-rw", "dead"]).trim(), "1");
    assert_eq!(redis.cli(&["DBSIZE"]).trim(), "2", "nothing written beside them");
    // A read lock held is still broken.
    let reader = c.lock("held-rw").kind(LockKind::Read).acquire().await.unwrap();
    assert!(c.force_release("held-rw").await.unwrap(), "a held read lock is broken");
    let lost = tokio::time::timeout(T, reader.lost()).await.expect("told");
    assert_eq!(lost, LostReason::ForceReleased);
}

/// A hash that looks like a read lock but counts more holds than any lock in use (an
/// application's `{mode: read, limit: 30000000}`) reads as another key at once, and
/// Redis stays free for everyone: Describe read a read/write lock's timeout keys one per
/// hold, 30 million `PTTL`s in one script, and every other client got `BUSY`.
#[tokio::test]
async fn a_hash_counting_more_holds_than_any_lock_is_read_at_once() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let c = server.client().await;
    redis.cli(&["HSET", "app-settings", "mode", "read", "limit", "30000000"]);
    let state = bounded(Duration::from_secs(2), "Describe", c.describe("app-settings")).await;
    assert!(!state.unwrap().locked, "no lock");
    let page = bounded(Duration::from_secs(2), "List", c.list("app-", 10, String::new())).await;
    assert!(page.unwrap().locks.is_empty(), "nothing listed");
    assert!(!c.force_release("app-settings").await.unwrap(), "nothing was held");
    assert_eq!(redis.cli(&["HGET", "app-settings", "limit"]).trim(), "30000000");
    // A read lock's own holds are read as before.
    let lease = c.lock("app-read").kind(LockKind::Read).acquire().await.unwrap();
    assert!(c.describe("app-read").await.unwrap().locked);
    lease.release().await.unwrap();
}

/// An application's hash of more fields than any lock has (a cache, a Java RMap) under
/// a lock's name is no lock, found without reading it. Describe, List, ForceRelease and
/// a semaphore's try read every field of it (`HGETALL`) inside a script, and one of
/// millions blocked Redis for every client; a Watch of it read it again every second.
/// (This one, every field a count, read as a mutex of 70 000 holders.)
#[tokio::test]
async fn a_hash_of_more_fields_than_any_lock_is_not_read() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let c = server.client().await;
    let fill = "for i = 1, 70000 do redis.call('hset', KEYS[1], 'f' .. i, i) end";
    redis.cli(&["EVAL", fill, "1", "app-cache"]);
    let before = redis.command_calls("hgetall");
    let state = bounded(T, "Describe", c.describe("app-cache")).await.unwrap();
    assert!(!state.locked, "{} holders", state.holders.len());
    let page = bounded(T, "List", c.list("app-", 10, String::new())).await.unwrap();
    assert!(page.locks.is_empty(), "listed");
    assert!(!c.force_release("app-cache").await.unwrap(), "nothing was held");
    let semaphore = c.lock("app-cache").kind(LockKind::Semaphore).limit(1).try_once();
    assert!(bounded(T, "a semaphore's try", semaphore.acquire()).await.is_err());
    assert_eq!(redis.command_calls("hgetall"), before, "the hash was read whole");
    assert_eq!(redis.cli(&["HLEN", "app-cache"]).trim(), "70000", "left as it was");
}

/// A lock latchkey never granted (held by a Java Redisson client) shows no fencing
/// token once broken: the break floor, nobody's grant, read as the latest token.
#[tokio::test]
async fn a_break_of_a_lock_latchkey_never_granted_shows_no_token() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let c = server.client().await;
    let conn = redis_client(&redis.url()).await;
    let java = RedissonLock::new(&conn, "java-only", &random_owner());
    assert_eq!(java.try_lock(30_000).await, None, "redisson holds");
    assert!(c.force_release("java-only").await.unwrap());
    let state = c.describe("java-only").await.unwrap();
    assert!(!state.locked);
    assert_eq!(state.last_fencing_token, 0, "{state:?}");
}

/// A fixed lease that was force-released before its end, read only after that end, is
/// told FORCE_RELEASED, the notice it got, not LEASE_EXPIRED. `lost()` used to look at
/// the lease's clock before reading the notices that had already come.
#[tokio::test]
async fn a_fixed_lease_broken_before_its_end_is_told_force_released_after_it() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let c = server.client().await;
    let lease_len = Duration::from_millis(400);
    let lease = c.lock("broken-fixed").lease(lease_len).acquire().await.unwrap();
    assert!(c.force_release("broken-fixed").await.unwrap());
    // The notice comes within milliseconds; the lease's own end passes unread.
    tokio::time::sleep(lease_len + Duration::from_millis(200)).await;
    let reason = tokio::time::timeout(T, lease.lost()).await.expect("told");
    assert_eq!(reason, LostReason::ForceReleased);
}

/// `is_lost()` reads a notice that has come while a `lost()` future is pending but not
/// being polled (a `select!` running one of its other branches, a future kept for
/// later), and every task waiting in `lost()` is told. That future used to hold the
/// stream to itself, so `is_lost()` said held.
#[tokio::test]
async fn is_lost_reads_a_notice_while_a_lost_future_waits_unpolled() {
    use std::future::Future;
    use std::task::{Context, Waker};
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let c = server.client().await;
    let lease = std::sync::Arc::new(c.lock("watched").acquire().await.unwrap());
    let mut lost = Box::pin(lease.lost());
    let mut cx = Context::from_waker(Waker::noop());
    assert!(lost.as_mut().poll(&mut cx).is_pending(), "held");
    // Another task waits too, and is woken as well.
    let shared = lease.clone();
    let other = tokio::spawn(async move { shared.lost().await });
    assert!(c.force_release("watched").await.unwrap());
    let seen = latchkey_tests::poll_until(T, || lease.is_lost()).await;
    assert!(seen, "is_lost() missed the force release");
    assert_eq!(lease.lost_reason(), Some(LostReason::ForceReleased));
    assert_eq!(lost.await, LostReason::ForceReleased);
    let told = tokio::time::timeout(T, other).await.expect("the other task is woken");
    assert_eq!(told.unwrap(), LostReason::ForceReleased);
}

/// List scans the hashes and sorted sets under a prefix: a fair lock's waiter leaves a
/// sorted set of deadlines (`redisson_lock_timeout:{name}`), and neither it nor any
/// other sorted set without a semaphore's hash is listed as a lock.
#[tokio::test]
async fn list_shows_no_lock_for_a_fair_queues_deadlines_or_a_foreign_sorted_set() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let c = server.client().await;
    let held = c.lock("q").kind(LockKind::Fair).acquire().await.unwrap();
    let waiter = {
        let c = c.clone();
        tokio::spawn(async move { c.lock("q").kind(LockKind::Fair).wait(T).acquire().await })
    };
    let deadline = std::time::Instant::now() + T;
    while c.describe("q").await.unwrap().waiters.is_empty() {
        assert!(std::time::Instant::now() < deadline, "the fair waiter queues");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // An application's sorted set, one score as low as a double goes.
    redis.cli(&["ZADD", "scores", "-inf", "m"]);
    let listed = c.list_all("").await.unwrap();
    let names: Vec<(&str, i32)> = listed.iter().map(|l| (l.name.as_str(), l.kind)).collect();
    assert_eq!(names, vec![("q", LockKind::Fair as i32)], "{listed:?}");
    let scores = c.describe("scores").await.unwrap();
    assert!(!scores.locked && scores.holders.is_empty(), "{scores:?}");
    held.release().await.unwrap();
    latchkey_tests::server::each_granted(vec![waiter], T).await;
}

/// List shows only names Describe and ForceRelease take: a hash named as one whole
/// hash tag (a Redisson lock `{orders}`, whose keys are those of the lock `orders`) was
/// listed, with a state read partly from `orders`' keys, and could not be looked at
/// or broken by the name shown.
#[tokio::test]
async fn list_shows_only_names_describe_takes() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let c = server.client().await;
    let _held = c.lock("orders").acquire().await.unwrap();
    redis.cli(&["HSET", "{orders}", "a-redisson-owner:1", "1"]);
    redis.cli(&["PEXPIRE", "{orders}", "30000"]);
    let err = c.describe("{orders}").await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err}");
    let listed = c.list_all("").await.unwrap();
    let names: Vec<&str> = listed.iter().map(|l| l.name.as_str()).collect();
    assert_eq!(names, vec!["orders"], "{listed:?}");
}

/// Every read hold has its own lease (its timeout keys, `{name}:<owner>:rwlock_timeout:<n>`
/// in Redisson's layout), and Describe tells each reader's: a reader on a fixed lease of
/// 2 s was shown the lock's 30 s, the lease of the longest reader.
#[tokio::test]
async fn describe_tells_each_readers_own_lease() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let c = server.client().await;
    let read = |owner: &str| c.lock("shared").kind(LockKind::Read).owner(owner);
    let _short = read("short").lease(Duration::from_secs(2)).acquire().await.unwrap();
    let _long = read("long").acquire().await.unwrap();
    let state = c.describe("shared").await.unwrap();
    let ttl = |owner: &str| {
        let holder = state.holders.iter().find(|h| h.owner == owner).expect("a holder");
        Duration::try_from(holder.ttl.expect("a ttl")).unwrap()
    };
    assert!(ttl("short") <= Duration::from_secs(2), "{state:?}");
    assert!(ttl("long") > Duration::from_secs(20), "{state:?}");
}

/// A writer's hold has its own timeout key too, and Describe tells its lease, not the
/// lock's: a writer on a fixed lease of 5 s whose owner also reads on 60 s was shown
/// the read's 60 s, though its hold ends at 4.9 s.
#[tokio::test]
async fn describe_tells_a_writers_own_lease() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let c = server.client().await;
    let hold = |kind: LockKind, secs: u64| {
        c.lock("rw-leases")
            .kind(kind)
            .owner("o")
            .lease(Duration::from_secs(secs))
    };
    let _write = hold(LockKind::Write, 5).acquire().await.unwrap();
    let _read = hold(LockKind::Read, 60).acquire().await.unwrap();
    let state = c.describe("rw-leases").await.unwrap();
    let mut ttls: Vec<Duration> = state
        .holders
        .iter()
        .map(|h| Duration::try_from(h.ttl.expect("a ttl")).unwrap())
        .collect();
    ttls.sort();
    assert_eq!(ttls.len(), 2, "the owner's write and read holds: {state:?}");
    assert!(
        ttls[0] <= Duration::from_secs(5),
        "the write hold's own lease: {state:?}"
    );
    assert!(ttls[1] > Duration::from_secs(50), "the read hold's: {state:?}");
}

/// A reader whose holds' leases all ran out (its timeout keys gone, its field left in
/// the lock's hash until the next release cleans it up) holds nothing: Describe
/// showed it as a holder with the lock's TTL.
#[tokio::test]
async fn describe_shows_no_reader_whose_leases_ran_out() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let c = server.client().await;
    let _live = c
        .lock("stale")
        .kind(LockKind::Read)
        .owner("live")
        .acquire()
        .await
        .unwrap();
    redis.cli(&["HSET", "stale", "dead", "1"]);
    let state = c.describe("stale").await.unwrap();
    let owners: Vec<&str> = state.holders.iter().map(|h| h.owner.as_str()).collect();
    assert_eq!(owners, ["live"], "{state:?}");
}

/// A key beside a lock that holds another type than the layout's (a Redisson client's
/// lock named as the lock's fair queue or fencing counter) is no part of the lock:
/// Describe, List and Watch read the lock as it is. They failed with UNAVAILABLE
/// ("redis is unavailable"), List for every name on the server, and no retry helped.
#[tokio::test]
async fn a_foreign_key_beside_a_lock_fails_no_inspection() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let c = server.client().await;
    let _held = c.lock("orders").acquire().await.unwrap();
    java_locks_beside_orders(&redis).await;
    for name in ["orders", "stock"] {
        let state = c.describe(name).await.expect("described");
        assert!(state.locked && state.waiters.is_empty(), "{state:?}");
    }
    // The Java locks named as another lock's keys are no names the API takes.
    let listed = c.list_all("").await.expect("listed");
    let names: Vec<&str> = listed.iter().map(|l| l.name.as_str()).collect();
    assert_eq!(names, vec!["orders", "stock"], "{listed:?}");
    let mut watch = c.watch("orders").await.unwrap();
    let first = tokio::time::timeout(T, watch.next()).await.expect("in time");
    assert!(first.expect("a state").expect("open").locked);
}

/// Java (Redisson) locks on `stock` and on keys named as `orders`' fair queue and
/// `stock`'s fencing counter: foreign keys beside latchkey's locks.
async fn java_locks_beside_orders(redis: &RedisServer) {
    let conn = redis_client(&redis.url()).await;
    for name in ["redisson_lock_queue:{orders}", "latchkey_fence:{stock}", "stock"] {
        let java = RedissonLock::new(&conn, name, &random_owner());
        assert_eq!(java.try_lock(30_000).await, None, "{name}");
    }
}

/// ForceRelease of a lock beside a foreign key: a queue key of another type (a Java
/// lock named as the lock's fair queue) holds no waiter, and the lock is broken, its
/// holder told at once; a fencing counter that holds no count refuses the break before
/// any write, FAILED_PRECONDITION `WRONG_KIND` naming the lock, which stays held. The
/// script failed part way on the queue (the lock deleted, the servers untold, the
/// operator answered UNAVAILABLE), and the counter's failure read as UNAVAILABLE.
#[tokio::test]
async fn force_release_beside_a_foreign_key_breaks_or_refuses_whole() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let c = server.client().await;
    let held = c.lock("orders").acquire().await.unwrap();
    java_locks_beside_orders(&redis).await;
    assert!(c.force_release("orders").await.expect("broken"), "orders was held");
    let reason = tokio::time::timeout(T, held.lost()).await.expect("told in time");
    assert_eq!(reason, LostReason::ForceReleased);
    let err = c.force_release("stock").await.expect_err("refused");
    let status = err.status().expect("a status");
    assert_eq!(status.code(), tonic::Code::FailedPrecondition, "{status:?}");
    assert!(status.message().contains("\"stock\""), "{}", status.message());
    assert!(c.describe("stock").await.unwrap().locked, "stock is still held");
    for key in ["redisson_lock_queue:{orders}", "latchkey_fence:{stock}"] {
        assert_eq!(redis.cli(&["EXISTS", key]).trim(), "1", "the Java lock {key} is intact");
    }
}

/// A fair waiter whose deadline passed (its server or Redisson client died without
/// leaving the queue) waits no more: the next try drops it, and no release wakes it.
/// Describe and Watch showed it as a waiter until a try reached it (a Redisson entry
/// has no lifetime). Nor is a queue entry without a deadline.
#[tokio::test]
async fn describe_shows_no_fair_waiter_past_its_deadline() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let c = server.client().await;
    let _held = c.lock("queue").kind(LockKind::Fair).acquire().await.unwrap();
    let keys = latchkey_server::keys::Keys::default().lock("queue");
    // A Java waiter that died: queued, with a deadline long past.
    redis.cli(&["RPUSH", &keys.queue(), "dead:1"]);
    redis.cli(&["ZADD", &keys.timeouts(), "1", "dead:1"]);
    let state = c.describe("queue").await.unwrap();
    assert!(state.locked && state.waiters.is_empty(), "{state:?}");
    // Behind it a live one; then an entry with no deadline at all (no script leaves
    // one), which is no waiter either; then only the live one.
    let waiters =
        |state: latchkey_client::LockState| -> Vec<String> { state.waiters.into_iter().map(|w| w.owner).collect() };
    redis.cli(&["RPUSH", &keys.queue(), "java:1"]);
    redis.cli(&["ZADD", &keys.timeouts(), "99999999999999", "java:1"]);
    assert_eq!(waiters(c.describe("queue").await.unwrap()), ["java:1"]);
    redis.cli(&["LREM", &keys.queue(), "0", "dead:1"]);
    redis.cli(&["ZREM", &keys.timeouts(), "dead:1"]);
    redis.cli(&["LPUSH", &keys.queue(), "orphan:1"]);
    assert_eq!(waiters(c.describe("queue").await.unwrap()), ["java:1"]);
    redis.cli(&["LREM", &keys.queue(), "0", "orphan:1"]);
    assert_eq!(waiters(c.describe("queue").await.unwrap()), ["java:1"]);
}

/// A sorted set is a semaphore only beside its hash (`latchkey_semaphore:{name}`), as
/// Describe and List read it: ForceRelease of an application's own sorted set, which
/// Describe showed free, deleted it and answered `released: true`.
#[tokio::test]
async fn force_release_leaves_a_sorted_set_that_is_no_semaphore() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let c = server.client().await;
    redis.cli(&["ZADD", "scores", "1", "m"]);
    assert!(!c.describe("scores").await.unwrap().locked, "no lock");
    assert!(!c.force_release("scores").await.unwrap(), "nothing was held");
    assert_eq!(redis.cli(&["ZCARD", "scores"]).trim(), "1", "the sorted set is intact");
    let sem = c
        .lock("pool")
        .kind(LockKind::Semaphore)
        .limit(2)
        .acquire()
        .await
        .unwrap();
    assert!(c.force_release("pool").await.unwrap(), "a semaphore is broken");
    let reason = tokio::time::timeout(T, sem.lost()).await.expect("told in time");
    assert_eq!(reason, LostReason::ForceReleased);
}

/// A semaphore whose holds all ran out (their servers died; the sorted set and hash
/// stay until the next try cleans them up) holds nothing: ForceRelease answered
/// `released: true` and logged a break for it, though Describe showed it free.
#[tokio::test]
async fn force_release_of_a_semaphore_whose_holds_all_ran_out_releases_nothing() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let c = server.client().await;
    let hash = "latchkey_semaphore:{pool}";
    redis.cli(&["HSET", hash, "limit", "2", "used", "1", "p:dead", "1", "o:dead", "gone"]);
    redis.cli(&["ZADD", "pool", "1", "dead"]);
    assert!(!c.describe("pool").await.unwrap().locked, "no live hold");
    assert!(!c.force_release("pool").await.unwrap(), "nothing was held");
    let sem = c
        .lock("pool")
        .kind(LockKind::Semaphore)
        .limit(2)
        .permits(2)
        .acquire()
        .await
        .expect("both permits are free");
    assert!(!sem.is_lost());
}

/// List answers on a Redis with many keys and few locks: each page of its scan is a
/// call of its own under the Redis timeout, however long the scan. The timeout was on
/// each key found, and a long run of keys that are not locks failed the call.
#[tokio::test]
async fn list_answers_on_a_redis_with_many_other_keys() {
    let redis = RedisServer::start_with(&["--enable-debug-command", "yes"]);
    let server = Latchkey::start_with(&redis.url(), &["--redis-timeout", "300ms"]).await;
    let client = server.client().await;
    let _lease = client.lock("a-lock").acquire().await.unwrap();
    // Strings, which are no lock: a scan for locks finds none among them.
    redis.cli(&["DEBUG", "POPULATE", "1500000", "other", "8"]);
    // Two scans of 1.5 M keys, 1 000 at a time: seconds, more on a loaded machine.
    let listed = bounded(3 * T, "List", client.list_all("")).await.expect("listed");
    let names: Vec<&str> = listed.iter().map(|l| l.name.as_str()).collect();
    assert_eq!(names, ["a-lock"]);
}

/// The names of a paging run of `prefix`, `page_size` at a time, asserting each page
/// bounded, sorted after the one before, and an end reached within `names + 2` pages.
async fn page_through(client: &Client, prefix: &str, page_size: u32, names: usize) -> Vec<String> {
    let mut seen: Vec<String> = Vec::new();
    let mut token = String::new();
    for _ in 0..names + 2 {
        let page = client.list(prefix, page_size, token.clone()).await.expect("list");
        assert!(page.locks.len() <= page_size as usize, "page over its size");
        for lock in page.locks {
            assert!(lock.locked, "{}: listed while free", lock.name);
            if let Some(last) = seen.last() {
                assert!(
                    lock.name > *last,
                    "{} after {last}: repeated or out of order",
                    lock.name
                );
            }
            seen.push(lock.name);
        }
        if page.next_page_token.is_empty() {
            return seen;
        }
        assert!(page.next_page_token > token, "the token went back");
        token = page.next_page_token;
    }
    panic!("no end after {} pages", names + 2);
}

/// Names that exercise paging: hash tags, colons, unicode, a name that is a prefix of
/// another, free names between held ones.
fn paging_names(n: usize) -> Vec<String> {
    (0..n)
        .map(|i| match i % 5 {
            0 => format!("pg/{i:04}"),
            1 => format!("pg/{i:04}:{{tag{}}}", i % 7),
            2 => format!("pg/ü{i}"),
            3 => format!("pg/{i:04}/x"),
            _ => format!("pg/{{t{i}}}"),
        })
        .collect()
}

/// Paging through `pg/` lists exactly `names`, in order, at every page size.
async fn assert_lists_every_name(client: &Client, names: &[String]) {
    let mut want: Vec<String> = names.to_vec();
    want.sort();
    for page_size in [1, 7, 100, 1000] {
        let seen = page_through(client, "pg/", page_size, names.len()).await;
        if seen != want {
            let got: BTreeSet<&String> = seen.iter().collect();
            let missing: Vec<&String> = want.iter().filter(|n| !got.contains(n)).collect();
            panic!(
                "page size {page_size}: {} listed of {}, missing {missing:?}",
                seen.len(),
                want.len()
            );
        }
    }
}

/// List pages through every held name once, in order, on a standalone Redis, with free
/// names (a released lock) between them, for page sizes from 1 to the maximum.
#[tokio::test]
async fn list_pages_every_held_name_once_on_a_standalone_redis() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let names = paging_names(120);
    let mut leases = Vec::new();
    for name in &names {
        leases.push(client.lock(name.as_str()).acquire().await.expect("granted"));
    }
    // Free names among them: taken and given back (a hash is left for none, but
    // fencing counters stay).
    for i in 0..20 {
        client
            .lock(format!("pg/{i:04}-free"))
            .acquire()
            .await
            .unwrap()
            .release()
            .await
            .unwrap();
    }
    assert_lists_every_name(&client, &names).await;
    drop(leases);
    server.stop().await;
}

/// List pages through every held name once, in order, on a 3-master cluster: every
/// master is scanned for every page.
#[tokio::test]
async fn list_pages_every_held_name_once_on_a_cluster() {
    let cluster = RedisCluster::start(3, 0);
    let server = Latchkey::start(&cluster.url()).await;
    let client = server.client().await;
    let names = paging_names(150);
    let masters: BTreeSet<u16> = names.iter().map(|n| cluster.master_for_key(n)).collect();
    assert_eq!(masters.len(), 3, "the names cover every master");
    let mut leases = Vec::new();
    for name in &names {
        leases.push(client.lock(name.as_str()).acquire().await.expect("granted"));
    }
    assert_lists_every_name(&client, &names).await;
    drop(leases);
    server.stop().await;
}

/// A ForceRelease draws its break floor from the fencing counter, and Describe showed
/// that floor as the latest grant's token, one nobody was granted. It shows the broken
/// hold's token until a new grant, then the new one's.
#[tokio::test]
async fn describe_after_a_force_release_shows_the_latest_grants_token() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let c = server.client().await;
    let held = c.lock("broken-token").acquire().await.unwrap();
    let token = held.fencing_token();
    assert!(c.force_release("broken-token").await.unwrap());
    let state = c.describe("broken-token").await.unwrap();
    assert_eq!(
        state.last_fencing_token, token,
        "the broken grant's, not the floor: {state:?}"
    );
    let again = c.lock("broken-token").acquire().await.unwrap();
    assert!(again.fencing_token() > token + 1, "above the floor");
    let state = c.describe("broken-token").await.unwrap();
    assert_eq!(state.last_fencing_token, again.fencing_token());
    again.release().await.unwrap();
}

/// A lock whose state is larger than gRPC's default 4 MiB (thousands of holders with
/// long owner ids: a read lock, a semaphore) is described, listed and watched: the
/// client took no message over 4 MiB, and one such lock broke every listing holding it.
#[tokio::test]
async fn a_lock_larger_than_four_mib_is_described_listed_and_watched() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let many = "for i = 1, 5000 do redis.call('hset', KEYS[1], string.rep('o', 1000) .. i, 1) end \
        redis.call('pexpire', KEYS[1], 60000)";
    redis.cli(&["EVAL", many, "1", "big"]);
    assert_eq!(client.describe("big").await.unwrap().holders.len(), 5000);
    assert_eq!(client.list_all("").await.unwrap().len(), 1);
    let mut watch = client.watch("big").await.unwrap();
    let state = tokio::time::timeout(T, watch.next()).await.expect("a state in time");
    assert_eq!(state.expect("watched").expect("a state").holders.len(), 5000);
}

/// ForceRelease of a read/write lock takes its holds' timeout keys with it: the broken
/// streams give nothing back, and a key left would live out its hold's lease (an hour
/// here) and keep from a reader a lock whose keys are the same strings (`{t}:orders`
/// read by owner `eu:w1`, `{t}:orders:eu` by owner `w1`). A Redisson hold's key, which
/// names no lock, is left to its TTL.
#[tokio::test]
async fn force_release_takes_a_read_write_locks_timeout_keys() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let c = server.client().await;
    let hour = Duration::from_secs(3600);
    let held = |name: &'static str, kind, owner: &'static str| {
        c.lock(name).kind(kind).owner(owner).lease(hour).try_once().acquire()
    };
    let (read, write) = (
        held("{t}:orders", LockKind::Read, "eu:w1").await.unwrap(),
        held("{t}:stock", LockKind::Write, "w2").await.unwrap(),
    );
    // A Redisson reader beside it, as its read script leaves one.
    let java = random_owner();
    let java_key = format!("{{t}}:orders:{java}:rwlock_timeout:1");
    redis.cli(&["HSET", "{t}:orders", &java, "1"]);
    redis.cli(&["SET", &java_key, "1", "PX", "30000"]);
    let keys = [
        "{t}:orders:eu:w1:rwlock_timeout:1",
        "{t}:stock:w2:write:rwlock_timeout:1",
    ];
    for key in keys {
        assert_eq!(redis.cli(&["EXISTS", key]).trim(), "1", "{key} is there while held");
    }
    for (name, lease) in [("{t}:orders", read), ("{t}:stock", write)] {
        assert!(c.force_release(name).await.unwrap());
        let reason = tokio::time::timeout(T, lease.lost()).await.expect("told");
        assert_eq!(reason, LostReason::ForceReleased);
    }
    for key in keys {
        assert_eq!(redis.cli(&["EXISTS", key]).trim(), "0", "{key} went with the break");
    }
    assert_eq!(
        redis.cli(&["EXISTS", &java_key]).trim(),
        "1",
        "Redisson's key is left to its TTL"
    );
    let beside = held("{t}:orders:eu", LockKind::Read, "w1").await;
    assert!(
        beside.is_ok(),
        "the reader of the lock whose keys are the same: {:?}",
        beside.err()
    );
}

/// At most four List calls run on a server at once; one more is refused at once with
/// `RESOURCE_EXHAUSTED`, saying why. Each scans the whole key space and any identity may
/// list its own names: unbounded, a few clients' Lists in a loop kept Redis busy with
/// scans, every tenant's grants waiting behind them.
#[tokio::test]
async fn lists_beyond_four_at_once_are_refused() {
    let redis = RedisServer::start();
    let proxy = Proxy::to_redis(&redis).await;
    let server = Latchkey::start(&proxy.redis_url()).await;
    let client = server.client().await;
    // Every scan reaches Redis late: the first Lists still run when the others come.
    proxy.hold_back_matching(Some((b"SCAN", Duration::from_millis(700))));
    let calls = (0..12).map(|_| client.list("app-", 10, String::new()));
    let answers = bounded(T, "12 Lists", futures::future::join_all(calls)).await;
    proxy.hold_back_matching(None);
    let refused: Vec<_> = answers.iter().filter_map(|a| a.as_ref().err()).collect();
    assert_eq!(answers.len() - refused.len(), 4, "Lists answered: {refused:?}");
    for e in refused {
        assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e}");
        assert!(e.to_string().contains("4 List calls are running"), "{e}");
    }
    // Once they answered, List runs again.
    bounded(T, "List", client.list("app-", 10, String::new()))
        .await
        .expect("listed");
}

/// Describe of a read lock with the most readers it reads (65 536) shows every one
/// (the time it takes is `describe.rs`'s unit test's: it held a worker for the square
/// of the readers).
#[tokio::test]
async fn describe_of_a_read_lock_with_many_readers_shows_them_all() {
    let redis = RedisServer::start();
    // Reading 65 536 readers' keys took Redis 6.2 more than the default Redis timeout
    // once, under the suite's load: every reader shown is under test, not the speed.
    let server = Latchkey::start_with(&redis.url(), &["--redis-timeout", "10s"]).await;
    let c = server.client().await;
    let made = redis.cli(&[
        "EVAL",
        "redis.call('hset', KEYS[1], 'mode', 'read') \
         for i = 1, 65536 do \
           redis.call('hset', KEYS[1], 'r' .. i, 1) \
           redis.call('set', '{' .. KEYS[1] .. '}:r' .. i .. ':rwlock_timeout:1', 1, 'px', 600000) \
         end \
         return redis.call('pexpire', KEYS[1], 600000)",
        "1",
        "readers",
    ]);
    assert_eq!(made.trim(), "1");
    let state = bounded(T, "Describe", c.describe("readers")).await.unwrap();
    assert!(state.locked);
    assert_eq!(state.holders.len(), 65536);
}

/// A lock hash with a field that is no UTF-8 (written by another client) reads as the
/// lock ForceRelease breaks: each field kept in its pair. The field was dropped and
/// every later pair shifted, so Describe showed free the lock ForceRelease broke.
#[tokio::test]
async fn describe_reads_a_lock_with_a_field_that_is_no_utf8_as_held() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let c = server.client().await;
    let script = "redis.call('hset', KEYS[1], '\\255x', 1, 'alice', 1) return redis.call('pexpire', KEYS[1], 60000)";
    assert_eq!(redis.cli(&["EVAL", script, "1", "bytes"]).trim(), "1");
    let state = c.describe("bytes").await.unwrap();
    assert!(state.locked, "{state:?}");
    assert_eq!(state.holders.len(), 2, "{state:?}");
    assert!(c.force_release("bytes").await.unwrap());
}
