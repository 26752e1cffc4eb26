//! The semaphore (`LOCK_KIND_SEMAPHORE`) end to end: never more permits in use than its
//! limit under concurrent load over two servers, limit checks, wake-ups when permits
//! return, permits of a crashed server expiring with their lease, fixed leases,
//! Describe, the validation of `limit` and `permits`, and no permit left behind by
//! dropped streams, tries in doubt or a Redis restart.

use latchkey_client::{Client, LockKind, LostReason};
use latchkey_tests::proxy::Proxy;
use latchkey_tests::server::{each_granted_then, semaphore, spawn_queued, Latchkey, Waiting};
use latchkey_tests::{LatchkeyProcess, RedisServer};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tonic::Code;
use tonic_types::StatusExt;

/// Bound on anything that should happen promptly but is not timed by the spec.
const T: Duration = Duration::from_secs(10);

/// Starts a request for `permits` of `name` (of `limit`) that waits up to `T`; returns
/// once the server has said it is queued.
async fn queue_semaphore(client: &Client, name: &str, limit: u32, permits: u32) -> Waiting {
    spawn_queued(semaphore(client, name, limit, permits).wait(T), T).await.0
}

#[tokio::test]
async fn never_more_permits_in_use_than_the_limit() {
    let redis = RedisServer::start();
    let a = Latchkey::start(&redis.url()).await;
    let b = Latchkey::start(&redis.url()).await;
    let in_use = Arc::new(AtomicU32::new(0));
    let max_seen = Arc::new(AtomicU32::new(0));
    let grants = Arc::new(AtomicU32::new(0));
    let mut tasks = Vec::new();
    for i in 0..12u32 {
        let client = if i % 2 == 0 { a.client().await } else { b.client().await };
        let permits = if i % 3 == 0 { 2 } else { 1 };
        let (in_use, max_seen, grants) = (in_use.clone(), max_seen.clone(), grants.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..10 {
                let lease = client
                    .lock("pool")
                    .kind(LockKind::Semaphore)
                    .limit(3)
                    .permits(permits)
                    .wait(Duration::from_secs(30))
                    .acquire()
                    .await
                    .unwrap_or_else(|err| panic!("{permits} permits granted: {err}"));
                assert_eq!(lease.hold_count(), permits);
                let now = in_use.fetch_add(permits, Ordering::SeqCst) + permits;
                assert!(now <= 3, "{now} permits in use at once, limit 3");
                max_seen.fetch_max(now, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(2)).await;
                in_use.fetch_sub(permits, Ordering::SeqCst);
                grants.fetch_add(1, Ordering::SeqCst);
                lease.release().await.expect("released");
            }
        }));
    }
    for task in tasks {
        tokio::time::timeout(Duration::from_secs(60), task)
            .await
            .expect("the stress test finishes")
            .expect("task");
    }
    assert_eq!(grants.load(Ordering::SeqCst), 120);
    let max = max_seen.load(Ordering::SeqCst);
    assert!(max > 1, "the permits were really shared: at most {max} in use at once");
}

#[tokio::test]
async fn default_permits_is_one() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let first = client
        .lock("one")
        .kind(LockKind::Semaphore)
        .limit(2)
        .try_once()
        .acquire()
        .await
        .unwrap();
    assert_eq!(first.hold_count(), 1);
    let second = client
        .lock("one")
        .kind(LockKind::Semaphore)
        .limit(2)
        .try_once()
        .acquire()
        .await
        .expect("one permit left");
    let err = client
        .lock("one")
        .kind(LockKind::Semaphore)
        .limit(2)
        .try_once()
        .acquire()
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::DeadlineExceeded, "{err}");
    assert!(second.fencing_token() > first.fencing_token());
}

#[tokio::test]
async fn a_different_limit_is_refused_while_held_and_accepted_when_free() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let held = client
        .lock("lim")
        .kind(LockKind::Semaphore)
        .limit(3)
        .acquire()
        .await
        .unwrap();
    let err = client
        .lock("lim")
        .kind(LockKind::Semaphore)
        .limit(4)
        .wait(Duration::from_secs(1))
        .acquire()
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err}");
    held.release().await.unwrap();
    let lease = client
        .lock("lim")
        .kind(LockKind::Semaphore)
        .limit(4)
        .permits(4)
        .try_once()
        .acquire()
        .await
        .expect("a free semaphore takes the new limit");
    assert_eq!(lease.hold_count(), 4);
}

#[tokio::test]
async fn waiters_wake_when_enough_permits_return() {
    let redis = RedisServer::start();
    let a = Latchkey::start(&redis.url()).await;
    let b = Latchkey::start(&redis.url()).await;
    let (ca, cb) = (a.client().await, b.client().await);
    let all = ca
        .lock("wake")
        .kind(LockKind::Semaphore)
        .limit(2)
        .permits(2)
        .acquire()
        .await
        .unwrap();
    let waiter_b = queue_semaphore(&ca, "wake", 2, 1).await;
    let waiter_c = queue_semaphore(&cb, "wake", 2, 1).await;
    let released_at = Instant::now();
    all.release().await.unwrap();
    let deadline = tokio::time::Instant::from(released_at + Duration::from_secs(1));
    let mut leases = Vec::new();
    for w in [waiter_b, waiter_c] {
        let lease = tokio::time::timeout_at(deadline, w)
            .await
            .expect("both waiters acquire within 1 s")
            .unwrap()
            .unwrap();
        leases.push(lease);
    }
    let state = ca.describe("wake").await.unwrap();
    assert_eq!(state.holders.len(), 2, "{state:?}");
}

/// Server one, reaching Redis through a proxy (to slow its tries), and server two, with
/// a client of each, and every permit of a semaphore of 2 held through server two.
struct Beside {
    _redis: RedisServer,
    proxy: Proxy,
    _servers: (Latchkey, Latchkey),
    c1: Client,
    c2: Client,
    all: latchkey_client::Lease,
}

async fn beside_a_holder_of_all(name: &str) -> Beside {
    let redis = RedisServer::start();
    let proxy = Proxy::to_redis(&redis).await;
    let one = Latchkey::start(&proxy.redis_url()).await;
    let two = Latchkey::start(&redis.url()).await;
    let (c1, c2) = (one.client().await, two.client().await);
    let all = c2
        .lock(name)
        .kind(LockKind::Semaphore)
        .limit(2)
        .permits(2)
        .acquire()
        .await
        .unwrap();
    Beside {
        _redis: redis,
        proxy,
        _servers: (one, two),
        c1,
        c2,
        all,
    }
}

/// A waiter woken for permits whose client leaves while its try is in flight (and the
/// try then finds too few: a waiter of another server took some first) passes its wake
/// on as if it had read that answer: the waiter of its server wanting fewer, which the
/// wake passed over, is granted promptly, not at the old holder's expiry (the 30 s
/// watchdog lease here, past its wait).
#[tokio::test]
async fn a_waiter_that_leaves_during_its_try_passes_its_wake_on() {
    let name = "leave-trying";
    let b = beside_a_holder_of_all(name).await;
    let (proxy, c1, c2, all) = (&b.proxy, &b.c1, &b.c2, b.all);
    let big = queue_semaphore(c1, name, 2, 2).await;
    let small = queue_semaphore(c1, name, 2, 1).await;
    let other = queue_semaphore(c2, name, 2, 1).await;
    // Server one's tries reach Redis a second late: server two's waiter takes a permit
    // first, and the big waiter's client leaves while its try is on the way.
    let scripts = latchkey_server::scripts::Scripts::new(false);
    let tries = scripts.by_name("semaphore_acquire").expect("the acquire script").sha();
    proxy.hold_back_matching(Some((tries.as_bytes(), Duration::from_secs(1))));
    let released_at = Instant::now();
    all.release().await.unwrap();
    let trying = latchkey_tests::poll_until(T, || proxy.holding() > 0).await;
    assert!(trying, "the big waiter tries");
    big.abort();
    let other = tokio::time::timeout(T, other)
        .await
        .expect("server two's waiter is granted")
        .unwrap()
        .expect("granted");
    let small = tokio::time::timeout(T, small)
        .await
        .expect("the waiter wanting one permit is granted")
        .unwrap()
        .expect("granted, not at the old lease's end");
    let took = released_at.elapsed();
    assert!(took < Duration::from_secs(5), "granted {took:?} after the release");
    proxy.hold_back_matching(None);
    small.release().await.unwrap();
    other.release().await.unwrap();
}

/// A waiter woken for permits it then does not get (a waiter of another server took
/// some first) leaves the rest to a waiter of its server wanting fewer, which the
/// wake passed over: that one is granted promptly, not when it re-checks at the old
/// holder's expiry (the 30 s watchdog lease here).
#[tokio::test]
async fn a_waiter_that_loses_its_permits_wakes_one_wanting_fewer() {
    // Server one reaches Redis slowly: it hears the release and tries after server two.
    let b = beside_a_holder_of_all("lose").await;
    let (proxy, c1, c2, all) = (&b.proxy, &b.c1, &b.c2, b.all);
    let (big, _) = spawn_queued(
        c1.lock("lose")
            .kind(LockKind::Semaphore)
            .limit(2)
            .permits(2)
            .wait(Duration::from_secs(20)),
        T,
    )
    .await;
    let small = queue_semaphore(c1, "lose", 2, 1).await;
    let other = queue_semaphore(c2, "lose", 2, 1).await;
    proxy.set_delay(Duration::from_millis(100));
    let released_at = Instant::now();
    all.release().await.unwrap();
    let other = tokio::time::timeout(T, other)
        .await
        .expect("server two's waiter is granted")
        .unwrap()
        .expect("granted");
    let small = tokio::time::timeout(Duration::from_secs(5), small)
        .await
        .expect("the waiter wanting one permit is granted within 5 s, not at the old lease's end")
        .unwrap()
        .expect("granted");
    let took = released_at.elapsed();
    assert!(took < Duration::from_secs(3), "granted {took:?} after the release");
    proxy.set_delay(Duration::ZERO);
    small.release().await.unwrap();
    other.release().await.unwrap();
    let big = tokio::time::timeout(T, big)
        .await
        .expect("granted")
        .unwrap()
        .expect("granted");
    assert_eq!(big.hold_count(), 2);
    big.release().await.unwrap();
}

#[tokio::test]
async fn permits_of_a_crashed_server_expire_with_their_lease() {
    let redis = RedisServer::start();
    let (mut process, remote) = LatchkeyProcess::to_crash(&redis.url()).await;
    let held = remote
        .lock("crash")
        .kind(LockKind::Semaphore)
        .limit(2)
        .permits(2)
        .acquire()
        .await
        .unwrap();
    assert_eq!(held.hold_count(), 2);
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let waiter = queue_semaphore(&client, "crash", 2, 1).await;
    let killed_at = Instant::now();
    process.kill();
    tokio::time::timeout(Duration::from_secs(3), waiter)
        .await
        .expect("the permits come back within the 1.5 s lease + 1.5 s")
        .unwrap()
        .expect("the waiter acquires");
    let took = killed_at.elapsed();
    assert!(took < Duration::from_secs(3), "took {took:?}");
    drop(held);
}

#[tokio::test]
async fn a_fixed_lease_on_a_semaphore_expires() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let lease = client
        .lock("fixed")
        .kind(LockKind::Semaphore)
        .limit(2)
        .lease(Duration::from_millis(500))
        .acquire()
        .await
        .unwrap();
    let granted = std::time::Instant::now();
    // A tenth less than asked: the server gives it back that early.
    assert_eq!(lease.lease(), Some(Duration::from_millis(450)));
    let reason = tokio::time::timeout(T, lease.lost()).await.expect("lost in time");
    assert_eq!(reason, LostReason::LeaseExpired);
    // At the lease's end, not at once nor long after (450 ms from the asking).
    let lasted = granted.elapsed();
    assert!(
        lasted >= Duration::from_millis(400) && lasted < Duration::from_secs(2),
        "told lost {lasted:?} after the grant"
    );
    client
        .lock("fixed")
        .kind(LockKind::Semaphore)
        .limit(2)
        .permits(2)
        .wait(Duration::from_secs(2)) // the client's clock may end the lease just before Redis'
        .acquire()
        .await
        .expect("every permit is back after the lease");
}

#[tokio::test]
async fn describe_shows_one_holder_per_stream_with_its_permits() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let two = client
        .lock("desc")
        .kind(LockKind::Semaphore)
        .limit(3)
        .permits(2)
        .acquire()
        .await
        .unwrap();
    let one = client
        .lock("desc")
        .kind(LockKind::Semaphore)
        .limit(3)
        .acquire()
        .await
        .unwrap();
    let state = client.describe("desc").await.unwrap();
    assert_eq!(state.kind(), LockKind::Semaphore, "{state:?}");
    assert!(state.locked);
    assert_eq!(state.holders.len(), 2, "{state:?}");
    let count_of = |owner: &str| {
        state
            .holders
            .iter()
            .find(|h| h.owner == owner)
            .unwrap_or_else(|| panic!("{owner} listed: {state:?}"))
            .hold_count
    };
    assert_eq!((count_of(two.owner()), count_of(one.owner())), (2, 1));
    assert!(state.last_fencing_token >= one.fencing_token());
    two.release().await.unwrap();
    one.release().await.unwrap();
    let state = client.describe("desc").await.unwrap();
    assert!(!state.locked && state.holders.is_empty(), "{state:?}");
}

#[tokio::test]
async fn bad_limits_and_permits_are_named() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let cases = [(0, 1, "open.limit"), (2, 3, "open.permits")];
    for (limit, permits, field) in cases {
        let err = client
            .lock("bad")
            .kind(LockKind::Semaphore)
            .limit(limit)
            .permits(permits)
            .try_once()
            .acquire()
            .await
            .unwrap_err();
        assert_eq!(
            err.code(),
            Code::InvalidArgument,
            "limit {limit} permits {permits}: {err}"
        );
        let status = err.status().expect("a status");
        assert!(status.message().contains(field), "{:?} names {field}", status.message());
        let info = status.get_details_error_info().expect("ErrorInfo attached");
        assert_eq!(info.metadata.get("field").map(String::as_str), Some(field));
    }
    assert_eq!(redis.cli(&["DBSIZE"]).trim(), "0", "nothing left behind");
}

/// A semaphore hold of a server that died stays in the sorted set past its expiry
/// while another holder's renewals keep the key alive; its permits are free (the next
/// try takes it out), and Describe shows only the live hold.
#[tokio::test]
async fn describe_shows_no_semaphore_hold_past_its_expiry() {
    let redis = RedisServer::start();
    let mut dying = LatchkeyProcess::spawn(&[
        "--redis-url".to_owned(),
        redis.url(),
        "--watchdog-timeout".to_owned(),
        "1s".to_owned(),
    ]);
    let semaphore = |client: &Client, owner: &str| {
        client
            .lock("sem")
            .kind(LockKind::Semaphore)
            .limit(2)
            .owner(owner)
            .acquire()
    };
    let _dead = semaphore(&dying.serving_client().await, "dead:1").await.unwrap();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let live = semaphore(&client, "live:1").await.unwrap();
    dying.kill();
    // The dead hold's 1 s lease runs out.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let state = client.describe("sem").await.unwrap();
    let owners: Vec<&str> = state.holders.iter().map(|h| h.owner.as_str()).collect();
    assert_eq!(owners, ["live:1"], "{state:?}");
    live.release().await.unwrap();
}

/// A waiter told to look again when the first hold then held runs out (a minute here)
/// must not sleep past a hold granted after it that runs out sooner: once the long
/// hold is given back (its freed permit too few to wake the waiter), the only other
/// hold is a crashed server's, which runs out with no message. The waiter takes the
/// permits within its lease and a little more, not at the minute's end.
#[tokio::test]
async fn a_waiter_is_not_held_past_a_later_hold_that_runs_out_sooner() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let long = client
        .lock("sooner")
        .kind(LockKind::Semaphore)
        .limit(2)
        .lease(Duration::from_secs(60))
        .try_once()
        .acquire()
        .await
        .expect("the minute-long hold");
    let waiter = queue_semaphore(&client, "sooner", 2, 2).await;
    let (mut process, remote) = LatchkeyProcess::to_crash(&redis.url()).await;
    let short = remote
        .lock("sooner")
        .kind(LockKind::Semaphore)
        .limit(2)
        .try_once()
        .acquire()
        .await
        .expect("the crashing server's hold");
    long.release().await.unwrap();
    let killed_at = Instant::now();
    process.kill();
    let granted = tokio::time::timeout(Duration::from_secs(3), waiter)
        .await
        .expect("the permits come back within the 1.5 s lease + 1.5 s")
        .unwrap()
        .expect("the waiter acquires");
    assert_eq!(granted.hold_count(), 2);
    let took = killed_at.elapsed();
    assert!(took < Duration::from_secs(3), "took {took:?}");
    granted.release().await.unwrap();
    drop(short);
}

/// A sorted set is a semaphore only beside its hash (`latchkey_semaphore:{name}`), as
/// Describe, List and ForceRelease read it: a semaphore request on an application's
/// own sorted set is refused as another kind and leaves the set as it was. It took the
/// set for a semaphore: removed every member scored below Redis' clock in ms, granted a
/// hold, and gave the set a lifetime, so it expired after the holder let go.
#[tokio::test]
async fn a_semaphore_is_refused_on_a_sorted_set_that_is_no_semaphore() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let c = server.client().await;
    redis.cli(&["ZADD", "scores", "1", "alice", "2", "bob"]);
    let err = c
        .lock("scores")
        .kind(LockKind::Semaphore)
        .limit(2)
        .try_once()
        .acquire()
        .await
        .expect_err("no semaphore there");
    assert_eq!(err.code(), Code::FailedPrecondition, "{err}");
    assert_eq!(redis.cli(&["ZRANGE", "scores", "0", "-1"]).trim(), "alice\nbob");
    assert_eq!(redis.cli(&["PTTL", "scores"]).trim(), "-1", "still persistent");
    assert_eq!(redis.cli(&["EXISTS", "latchkey_semaphore:{scores}"]).trim(), "0");
}

/// A hold whose lease ran out is lost, even while no acquire has taken it out of the
/// set yet: a renewal gave it a new lease (Describe and ForceRelease already counted it
/// free), and a release of a hold whose name is now another kind of lock failed
/// (`WRONGTYPE`) instead of telling the holder its lease was lost.
#[tokio::test]
async fn a_semaphore_hold_that_ran_out_is_lost_not_renewed() {
    let redis = RedisServer::start();
    let server = Latchkey::start_with(&redis.url(), &["--watchdog-timeout", "900ms"]).await;
    let client = server.client().await;
    let sem = |name: &str| client.lock(name).kind(LockKind::Semaphore).limit(2).try_once();
    let ran_out = sem("ran-out").acquire().await.unwrap();
    let hold = redis.cli(&["ZRANGE", "ran-out", "0", "0"]);
    redis.cli(&["ZADD", "ran-out", "XX", "1", hold.trim()]);
    let reason = tokio::time::timeout(Duration::from_secs(3), ran_out.lost())
        .await
        .expect("told at the next renewal");
    assert_eq!(reason, latchkey_client::LostReason::NotHeld);

    let taken = sem("taken-over").acquire().await.unwrap();
    redis.cli(&["DEL", "taken-over", "latchkey_semaphore:{taken-over}"]);
    redis.cli(&["HSET", "taken-over", "someone-else", "1"]);
    let err = taken.release().await.expect_err("the hold is gone");
    assert!(
        matches!(err, latchkey_client::Error::Lost(latchkey_client::LostReason::NotHeld)),
        "{err}"
    );
}

/// A release of a hold past its expiry that no try swept out yet is told its lease was
/// lost, as its renewal would have been (the release used to answer `released`), and
/// the hold's permits still come back.
#[tokio::test]
async fn a_release_of_a_semaphore_hold_past_its_expiry_is_told_lost() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let held = semaphore(&client, "past-expiry", 2, 1)
        .try_once()
        .acquire()
        .await
        .unwrap();
    let hold = redis.cli(&["ZRANGE", "past-expiry", "0", "0"]);
    redis.cli(&["ZADD", "past-expiry", "XX", "1", hold.trim()]);
    let err = held.release().await.expect_err("the lease had run out");
    assert!(
        matches!(err, latchkey_client::Error::Lost(latchkey_client::LostReason::NotHeld)),
        "{err}"
    );
    assert_eq!(redis.cli(&["EXISTS", "past-expiry"]).trim(), "0", "no hold left");
    let used = redis.cli(&["HGET", "latchkey_semaphore:{past-expiry}", "used"]);
    assert_eq!(used.trim(), "", "no permit counted");
}

/// A hold whose permits field is gone from the semaphore's hash (the hash evicted or
/// edited apart from its holds) is taken out all the same, by its release and by the
/// sweep of a try after its expiry, and the used count is counted again from the holds
/// left. Both scripts failed on it (`HINCRBY` refused the `-0` they gave back) after
/// taking the hold out: the release answered an error and the count stayed up, and
/// every later try of the name failed.
#[tokio::test]
async fn a_hold_without_its_permits_field_breaks_no_later_try() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let hash = "latchkey_semaphore:{no-field}";
    let only_hold = || redis.cli(&["ZRANGE", "no-field", "0", "0"]).trim().to_owned();

    let all = semaphore(&client, "no-field", 2, 2).try_once().acquire().await.unwrap();
    redis.cli(&["HDEL", hash, &format!("p:{}", only_hold())]);
    all.release().await.expect("released");
    let again = semaphore(&client, "no-field", 2, 2).try_once().acquire().await;
    again.expect("every permit free again").release().await.unwrap();

    let swept = semaphore(&client, "no-field", 2, 1).try_once().acquire().await.unwrap();
    let id = only_hold();
    let _beside = semaphore(&client, "no-field", 2, 1).try_once().acquire().await.unwrap();
    redis.cli(&["ZADD", "no-field", "XX", "1", &id]);
    redis.cli(&["HDEL", hash, &format!("p:{id}")]);
    let after = semaphore(&client, "no-field", 2, 1).try_once().acquire().await;
    let _after = after.expect("the swept hold's permit is free");
    assert_eq!(redis.cli(&["HGET", hash, "used"]).trim(), "2", "counted again");
    drop(swept);
}

/// A name a Redisson semaphore has taken (`RSemaphore.trySetPermits` writes the free
/// permits as a string at the name) is no latchkey semaphore: the two never share
/// permits. latchkey refuses it with FAILED_PRECONDITION `WRONG_KIND`, and Describe shows
/// the name free, as the README says.
#[tokio::test]
async fn a_redisson_semaphores_name_is_refused_as_another_kind() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    redis.cli(&["SET", "java-pool", "3"]);
    let err = client
        .lock("java-pool")
        .kind(LockKind::Semaphore)
        .limit(3)
        .try_once()
        .acquire()
        .await
        .unwrap_err();
    let status = err.status().expect("a status").clone();
    assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
    assert_eq!(err.reason().as_deref(), Some("WRONG_KIND"), "{status:?}");
    assert!(!client.describe("java-pool").await.unwrap().locked);
    assert_eq!(
        redis.cli(&["GET", "java-pool"]).trim(),
        "3",
        "Redisson's permits untouched"
    );
}

/// A semaphore's key lives as long as the longest lease it ever granted; Describe told
/// that as the semaphore's TTL (600 s after a 600 s hold was released beside a 30 s
/// one). It tells its latest live hold's.
#[tokio::test]
async fn describe_tells_a_semaphores_ttl_by_its_live_holds() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let permit = || client.lock("ttl-sem").kind(LockKind::Semaphore).limit(2).try_once();
    let long = permit().lease(Duration::from_secs(600)).acquire().await.unwrap();
    let _short = permit().acquire().await.unwrap();
    long.release().await.unwrap();
    let state = client.describe("ttl-sem").await.unwrap();
    let ttl = Duration::try_from(state.ttl.expect("a ttl")).unwrap();
    assert!(ttl <= Duration::from_secs(30), "the live hold's lease: {state:?}");
}

/// Semaphore waiters of two servers wanting 1 and 2 permits of 2: whoever wins, the
/// other is granted promptly after.
#[tokio::test]
async fn semaphore_waiters_of_different_sizes_on_two_servers_all_get_through() {
    for _ in 0..5 {
        let redis = RedisServer::start();
        let a = Latchkey::start(&redis.url()).await;
        let b = Latchkey::start(&redis.url()).await;
        let ca = a.client().await;
        let cb = b.client().await;
        let sem = |c: &Client, p: u32| c.lock("s").kind(LockKind::Semaphore).limit(2).permits(p);
        let holder = sem(&ca, 2).try_once().acquire().await.unwrap();
        let (two, _) = spawn_queued(sem(&ca, 2).wait(T), T).await;
        let (one, _) = spawn_queued(sem(&cb, 1).wait(T), T).await;
        let (one_a, _) = spawn_queued(sem(&ca, 1).wait(T), T).await;
        holder.release().await.unwrap();
        let hold = || tokio::time::sleep(Duration::from_millis(20));
        each_granted_then(vec![two, one, one_a], Duration::from_secs(3), hold).await;
    }
}

/// Once every stream has ended the semaphore's holds are gone from Redis (within
/// `within`) and its whole limit can be taken at once: no permit leaked.
async fn assert_no_permit_leaked(redis: &RedisServer, client: &Client, name: &str, limit: u32, within: Duration) {
    let hash = format!("latchkey_semaphore:{{{name}}}");
    let mut last = String::new();
    let clean = latchkey_tests::poll_until(within, || {
        let holds = redis.cli(&["ZCARD", name]);
        let used = redis.cli(&["HGET", &hash, "used"]);
        last = format!("holds {holds:?}, used {used:?}, {:?}", redis.cli(&["HGETALL", &hash]));
        holds.trim() == "0" && matches!(used.trim(), "" | "0")
    })
    .await;
    assert!(clean, "a hold left after every stream ended: {last}");
    let all = tokio::time::timeout(T, semaphore(client, name, limit, limit).try_once().acquire())
        .await
        .expect("answered")
        .unwrap_or_else(|e| panic!("the whole limit is free at the end: {e}; {last}"));
    assert_eq!(all.hold_count(), limit);
    all.release().await.unwrap();
}

/// Streams over two servers, one of them reaching Redis through a proxy whose replies
/// now and then come after its `--redis-timeout` (tries in doubt), dropped at random
/// moments while waiting or holding: never more permits told held than the limit, and
/// none left behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_streams_and_tries_in_doubt_leave_no_permit_behind() {
    let redis = RedisServer::start();
    let proxy = Proxy::to_redis(&redis).await;
    let a = Latchkey::start_with(&proxy.redis_url(), &["--redis-timeout", "200ms"]).await;
    let b = Latchkey::start(&redis.url()).await;
    let in_use = Arc::new(AtomicU32::new(0));
    let over = Arc::new(AtomicU32::new(0));
    let grants = Arc::new(AtomicU32::new(0));
    let stop = tokio_util::sync::CancellationToken::new();
    let mut tasks = Vec::new();
    for i in 0..8u32 {
        let client = if i % 2 == 0 { a.client().await } else { b.client().await };
        let (in_use, over, grants, stop) = (in_use.clone(), over.clone(), grants.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            while !stop.is_cancelled() {
                let permits = if i % 4 == 0 { 2 } else { 1 };
                let acquire = semaphore(&client, "pool", 3, permits)
                    .wait(Duration::from_secs(3))
                    .acquire();
                // Half the time the stream is dropped after a moment, granted or not.
                let lease = if fastrand::bool() {
                    let give_up = Duration::from_millis(fastrand::u64(0..8));
                    match tokio::time::timeout(give_up, acquire).await {
                        Ok(lease) => lease,
                        Err(_) => continue,
                    }
                } else {
                    acquire.await
                };
                let Ok(lease) = lease else { continue };
                if in_use.fetch_add(permits, Ordering::SeqCst) + permits > 3 {
                    over.fetch_add(1, Ordering::SeqCst);
                }
                grants.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(fastrand::u64(0..4))).await;
                in_use.fetch_sub(permits, Ordering::SeqCst);
                if fastrand::bool() {
                    let _ = lease.release().await;
                }
            }
        }));
    }
    // Every third half second, A's replies come after its Redis timeout.
    for round in 0..12 {
        let delay = if round % 3 == 1 { 300 } else { fastrand::u64(0..2) };
        proxy.set_delay(Duration::from_millis(delay));
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    proxy.set_delay(Duration::ZERO);
    stop.cancel();
    for task in tasks {
        tokio::time::timeout(Duration::from_secs(30), task)
            .await
            .expect("the tasks end")
            .expect("task");
    }
    assert_eq!(over.load(Ordering::SeqCst), 0, "more permits told held than the limit");
    assert!(grants.load(Ordering::SeqCst) > 10, "the load ran");
    assert_no_permit_leaked(&redis, &b.client().await, "pool", 3, Duration::from_secs(40)).await;
}

/// Redis restarts empty under a semaphore of one held on one server, waited for on
/// another: the waiter is granted, the holder told `lost`, and the count stays right
/// (a second permit is refused while the waiter holds, and all is free after).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_restart_under_a_held_semaphore_keeps_its_count() {
    let mut redis = RedisServer::start();
    let args = ["--watchdog-timeout", "1500ms", "--redis-timeout", "300ms"];
    let a = Latchkey::start_with(&redis.url(), &args).await;
    let b = Latchkey::start_with(&redis.url(), &args).await;
    let (ca, cb) = (a.client().await, b.client().await);
    let holder = semaphore(&ca, "r", 1, 1).acquire().await.unwrap();
    let (waiter, _) = spawn_queued(semaphore(&cb, "r", 1, 1).wait(Duration::from_secs(20)), T).await;
    redis.restart();
    let lost = tokio::time::timeout(T, holder.lost())
        .await
        .expect("the holder is told lost");
    let granted = tokio::time::timeout(T, waiter)
        .await
        .expect("the waiter is answered")
        .unwrap()
        .expect("the waiter is granted after the restart");
    drop(holder);
    // The dropped stream's end reaches its server a moment later: a give-back that
    // freed the waiter's permit would show after it.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let second = semaphore(&ca, "r", 1, 1).try_once().acquire().await.err();
    assert_eq!(
        second.map(|e| e.code()),
        Some(Code::DeadlineExceeded),
        "a second permit of one while the waiter holds (the old holder told {lost:?})"
    );
    let state = ca.describe("r").await.unwrap();
    assert_eq!(state.holders.len(), 1, "{state:?}");
    granted.release().await.unwrap();
    assert_no_permit_leaked(&redis, &ca, "r", 1, Duration::from_secs(40)).await;
}

/// SIGTERM while a server's semaphore streams are busy taking, holding and giving back
/// permits (tries in flight, waiters, holders): the process exits 0, and once it has,
/// Redis holds no permit of it within a few seconds (none left for the 30 s lease to
/// clean up).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_in_the_middle_of_semaphore_churn_leaves_no_permit() {
    let redis = RedisServer::start();
    let checker = Latchkey::start(&redis.url()).await;
    let check = checker.client().await;
    for round in 0..3u32 {
        let mut process = LatchkeyProcess::start(&redis.url());
        let client = process.serving_client().await;
        let name = format!("churn/{round}");
        let mut tasks = Vec::new();
        for i in 0..16u32 {
            let (client, name) = (client.clone(), name.clone());
            tasks.push(tokio::spawn(async move {
                loop {
                    let permits = 1 + i % 2;
                    let acquire = semaphore(&client, &name, 3, permits).wait(Duration::from_secs(5));
                    let Ok(lease) = acquire.acquire().await else {
                        return;
                    };
                    tokio::time::sleep(Duration::from_millis(u64::from(i % 5))).await;
                    if lease.release().await.is_err() {
                        return;
                    }
                }
            }));
        }
        tokio::time::sleep(Duration::from_millis(300 + 97 * u64::from(round))).await;
        process.terminate();
        let status = process.wait_exit(Duration::from_secs(20)).expect("exits");
        assert!(status.success(), "round {round}: {status}");
        for t in tasks {
            let _ = tokio::time::timeout(T, t).await.expect("a client task ends");
        }
        assert_no_permit_leaked(&redis, &check, &name, 3, Duration::from_secs(3)).await;
    }
}
