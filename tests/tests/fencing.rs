//! Semaphores and fencing tokens: permits never above the limit and never stranded,
//! tokens that only grow (across kinds, breaks, passes in memory, the counter's expiry
//! and a Redis restart), and a semaphore's expired holds keeping no other kind off.

use latchkey_client::{Client, LockKind, LostReason};
use latchkey_tests::proxy::Proxy;
use latchkey_tests::server::{each_granted_then, semaphore, spawn_queued, Grants, Latchkey};
use latchkey_tests::{bounded, LatchkeyProcess, RedisCluster, RedisServer};
use std::time::{Duration, Instant};
use tonic::Code;

/// Bound on anything that should happen promptly.
const T: Duration = Duration::from_secs(10);

/// A semaphore hold of a crashed server that ran out keeps no other kind off the name,
/// which Describe shows free and ForceRelease finds nothing to break on: the next try
/// of another kind clears it. (It used to refuse them WRONG_KIND for as long as the
/// semaphore's sorted set lived: the longest lease it ever granted, here 600 s.)
#[tokio::test]
async fn an_expired_semaphore_hold_keeps_other_kinds_off_a_free_name() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    // A long fixed lease gives the semaphore's sorted set a 600 s life ...
    let long = semaphore(&client, "gone", 2, 1)
        .lease(Duration::from_secs(600))
        .try_once()
        .acquire()
        .await
        .expect("the long hold");
    // ... and a server that then dies leaves its hold behind in the set.
    let (mut process, remote) = LatchkeyProcess::to_crash(&redis.url()).await;
    let _crashed = semaphore(&remote, "gone", 2, 1)
        .try_once()
        .acquire()
        .await
        .expect("the crashing server's hold");
    long.release().await.expect("the long hold is given back");
    process.kill();
    // The crashed hold's 1.5 s lease runs out.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let state = client.describe("gone").await.unwrap();
    assert!(!state.locked, "Describe shows the name free: {state:?}");
    let broke = client.force_release("gone").await.unwrap();
    let set = redis.cli(&["ZCARD", "gone"]);
    let ttl = redis.cli(&["PTTL", "gone"]);
    for kind in [LockKind::Mutex, LockKind::Fair, LockKind::Read, LockKind::Write] {
        let taken = client.lock("gone").kind(kind).try_once().acquire().await;
        match taken {
            Ok(lease) => lease.release().await.unwrap(),
            Err(e) => panic!(
                "{kind:?} on a name Describe shows free (no live hold; ForceRelease answered \
                 released={broke}) refused: {:?} {:?}; sorted set: {} members, PTTL {} ms",
                e.code(),
                e.reason(),
                set.trim(),
                ttl.trim()
            ),
        }
    }
}

/// Fencing tokens of one name grow across every kind that takes it (mutex, fair, read,
/// write, semaphore, a multi-lock naming it), across ForceRelease, across the fencing
/// counter's expiry and across a Redis restart with persistence off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_grow_across_kinds_breaks_counter_expiry_and_a_redis_restart() {
    let mut redis = RedisServer::start();
    let args = ["--watchdog-timeout", "1500ms", "--redis-timeout", "300ms"];
    let a = Latchkey::start_with(&redis.url(), &args).await;
    let b = Latchkey::start_with(&redis.url(), &args).await;
    let (ca, cb) = (a.client().await, b.client().await);
    let seen = Grants::default();
    let name = "fence/all";
    for round in 0..2 {
        let c = if round == 0 { &ca } else { &cb };
        for kind in [LockKind::Mutex, LockKind::Fair, LockKind::Read, LockKind::Write] {
            let lease = c.lock(name).kind(kind).wait(T).acquire().await.unwrap();
            seen.record(lease.fencing_token(), format!("{round} {kind:?}"));
            lease.release().await.unwrap();
        }
        let s1 = semaphore(c, name, 3, 2).wait(T).acquire().await.unwrap();
        seen.record(s1.fencing_token(), format!("{round} semaphore 1"));
        let s2 = semaphore(c, name, 3, 1).wait(T).acquire().await.unwrap();
        seen.record(s2.fencing_token(), format!("{round} semaphore 2"));
        // A break, then whatever comes next.
        assert!(c.force_release(name).await.unwrap());
        assert_eq!(bounded(T, "lost", s1.lost()).await, LostReason::ForceReleased);
        assert_eq!(bounded(T, "lost", s2.lost()).await, LostReason::ForceReleased);
        drop((s1, s2));
        let multi = c.lock_all([name, "fence/other"]).wait(T).acquire().await.unwrap();
        let at = multi.names().iter().position(|n| n == name).unwrap();
        seen.record(multi.fencing_tokens()[at], format!("{round} multi"));
        multi.release().await.unwrap();
    }
    // The counter expires 5 s after the last lease ends; the next grant is larger still.
    let short = ca.lock(name).lease(Duration::from_millis(200)).acquire().await.unwrap();
    seen.record(short.fencing_token(), "short".into());
    short.release().await.unwrap();
    let fence = format!("latchkey_fence:{{{name}}}");
    let gone =
        latchkey_tests::poll_until(Duration::from_secs(12), || redis.cli(&["EXISTS", &fence]).trim() == "0").await;
    assert!(gone, "the counter expires");
    let after = semaphore(&cb, name, 1, 1).acquire().await.unwrap();
    seen.record(after.fencing_token(), "after expiry".into());
    after.release().await.unwrap();
    // Redis restarts empty (no persistence): the next grant is larger again.
    let held = ca.lock(name).acquire().await.unwrap();
    seen.record(held.fencing_token(), "before restart".into());
    redis.restart();
    let lost = bounded(T, "the holder told lost", held.lost()).await;
    assert_eq!(lost, LostReason::NotHeld);
    let again = bounded(T, "a grant after the restart", async {
        loop {
            match cb.lock(name).wait(T).acquire().await {
                Ok(l) => return l,
                Err(e) if e.code() == Code::Unavailable => tokio::time::sleep(Duration::from_millis(100)).await,
                Err(e) => panic!("{e}"),
            }
        }
    })
    .await;
    seen.record(again.fencing_token(), "after restart".into());
    again.release().await.unwrap();
    seen.assert_increasing();
}

/// Permits held by a stream whose connection is reset (the proxy between client and
/// server cuts it) come back at once, not at the lease's end: a waiter on another
/// server that needs every permit is granted promptly.
#[tokio::test]
async fn permits_of_a_reset_connection_come_back_at_once() {
    let redis = RedisServer::start();
    let a = Latchkey::start(&redis.url()).await;
    let b = Latchkey::start(&redis.url()).await;
    let proxy = Proxy::start(a.endpoint().trim_start_matches("http://")).await;
    let via_proxy = Client::connect(&proxy.endpoint())
        .await
        .expect("connects through the proxy");
    let held = semaphore(&via_proxy, "reset", 3, 2).acquire().await.unwrap();
    let one = semaphore(&b.client().await, "reset", 3, 1).acquire().await.unwrap();
    let cb = b.client().await;
    let (waiter, _) = spawn_queued(semaphore(&cb, "reset", 3, 3).wait(Duration::from_secs(20)), T).await;
    let (small, _) = spawn_queued(semaphore(&cb, "reset", 3, 2).wait(Duration::from_secs(20)), T).await;
    let cut_at = Instant::now();
    proxy.cut();
    // The two permits come back: the waiter of two is granted at once.
    let small = bounded(Duration::from_secs(5), "the waiter of two", small)
        .await
        .unwrap()
        .expect("granted");
    assert!(cut_at.elapsed() < Duration::from_secs(3), "took {:?}", cut_at.elapsed());
    let _ = held;
    small.release().await.unwrap();
    one.release().await.unwrap();
    let all = bounded(Duration::from_secs(5), "the waiter of three", waiter)
        .await
        .unwrap()
        .expect("granted");
    assert_eq!(all.hold_count(), 3);
    all.release().await.unwrap();
}

/// A release of two permits with waiters wanting 1, 2 and 2 spread over two servers
/// (and a try-once newcomer barging in): nobody is stranded, and never more than the
/// limit is held. Rounds in a loop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn released_permits_reach_waiters_of_every_size_on_both_servers() {
    let redis = RedisServer::start();
    let a = Latchkey::start(&redis.url()).await;
    let b = Latchkey::start(&redis.url()).await;
    let (ca, cb) = (a.client().await, b.client().await);
    for round in 0..4 {
        let name = format!("sizes/{round}");
        let two = semaphore(&ca, &name, 3, 2).try_once().acquire().await.unwrap();
        let one = semaphore(&cb, &name, 3, 1).try_once().acquire().await.unwrap();
        let w = |c: &Client, p: u32| semaphore(c, &name, 3, p).wait(Duration::from_secs(20));
        let (w2a, _) = spawn_queued(w(&ca, 2), T).await;
        let (w1b, _) = spawn_queued(w(&cb, 1), T).await;
        let (w2b, _) = spawn_queued(w(&cb, 2), T).await;
        let (w1a, _) = spawn_queued(w(&ca, 1), T).await;
        two.release().await.unwrap();
        // A newcomer barges once.
        let barged = semaphore(&ca, &name, 3, 1).try_once().acquire().await.ok();
        if let Some(b) = barged {
            tokio::time::sleep(Duration::from_millis(50)).await;
            b.release().await.unwrap();
        }
        one.release().await.unwrap();
        let (ca, name) = (&ca, &name);
        let limit_kept = move || async move {
            let state = ca.describe(name).await.unwrap();
            let used: u32 = state.holders.iter().map(|h| h.hold_count).sum();
            assert!(used <= 3, "round {round}: {used} permits held: {state:?}");
            tokio::time::sleep(Duration::from_millis(30)).await;
        };
        each_granted_then(vec![w2a, w1b, w2b, w1a], Duration::from_secs(4), limit_kept).await;
    }
}

/// A semaphore `limit` other than the live one's is refused FAILED_PRECONDITION
/// `LIMIT_MISMATCH` naming the live limit (`metadata.limit`); once nobody holds it, a
/// new limit applies.
#[tokio::test]
async fn a_limit_mismatch_names_the_live_limit() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let c = server.client().await;
    let held = semaphore(&c, "lim", 1, 1).acquire().await.unwrap();
    let err = semaphore(&c, "lim", 4, 1).try_once().acquire().await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err}");
    assert_eq!(err.reason().as_deref(), Some("LIMIT_MISMATCH"));
    let info = err.error_info().expect("ErrorInfo");
    assert_eq!(info.metadata.get("limit").map(String::as_str), Some("1"), "{info:?}");
    held.release().await.unwrap();
    let new = semaphore(&c, "lim", 5, 5)
        .try_once()
        .acquire()
        .await
        .expect("a free semaphore takes a new limit");
    assert_eq!(new.hold_count(), 5);
}

/// A holder whose server loses Redis (its link frozen) past the lease is told `lost`
/// before a waiter on another server is granted the permit its hold gave up: never
/// two holders of a semaphore of one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_cut_off_from_redis_is_told_lost_before_its_permit_is_granted_again() {
    for round in 0..3 {
        let redis = RedisServer::start();
        let proxy = Proxy::to_redis(&redis).await;
        let args = ["--watchdog-timeout", "1500ms", "--redis-timeout", "300ms"];
        let a = Latchkey::start_with(&proxy.redis_url(), &args).await;
        let b = Latchkey::start_with(&redis.url(), &args).await;
        let (ca, cb) = (a.client().await, b.client().await);
        let held = semaphore(&ca, "cut", 1, 1).acquire().await.unwrap();
        let (waiter, _) = spawn_queued(semaphore(&cb, "cut", 1, 1).wait(T), T).await;
        proxy.freeze();
        let frozen_at = Instant::now();
        let lost = bounded(T, "the holder told lost", held.lost()).await;
        let lost_at = frozen_at.elapsed();
        assert_eq!(lost, LostReason::NotHeld, "round {round}");
        let granted = bounded(T, "the waiter", waiter).await.unwrap().expect("granted");
        let granted_at = frozen_at.elapsed();
        assert!(
            lost_at < granted_at,
            "round {round}: lost at {lost_at:?}, the permit granted again at {granted_at:?}"
        );
        assert!(granted.fencing_token() > held.fencing_token());
        granted.release().await.unwrap();
        proxy.thaw();
    }
}

/// On a 3-master cluster, semaphores on names of several slots (with and without hash
/// tags): a waiter on another server is woken promptly by a release over sharded
/// pub/sub, the limit holds, Describe shows the permits, ForceRelease wakes a waiter of
/// the whole limit, and tokens grow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_semaphores_wake_other_servers_and_keep_their_limit() {
    let cluster = RedisCluster::start(3, 0);
    let a = Latchkey::start(&cluster.url()).await;
    let b = Latchkey::start(&cluster.url()).await;
    let (ca, cb) = (a.client().await, b.client().await);
    for name in ["cs/a", "cs/b", "cs/c", "{tag}:cs", "cs/{tag}"] {
        let h1 = semaphore(&ca, name, 3, 2).try_once().acquire().await.unwrap();
        let h2 = semaphore(&ca, name, 3, 1).try_once().acquire().await.unwrap();
        assert!(h2.fencing_token() > h1.fencing_token(), "{name}");
        let err = semaphore(&cb, name, 3, 1).try_once().acquire().await.unwrap_err();
        assert_eq!(err.code(), Code::DeadlineExceeded, "{name}: {err}");
        let state = cb.describe(name).await.unwrap();
        let mut permits: Vec<u32> = state.holders.iter().map(|h| h.hold_count).collect();
        permits.sort();
        assert_eq!(permits, [1, 2], "{name}: {state:?}");
        let (waiter, _) = spawn_queued(semaphore(&cb, name, 3, 2).wait(T), T).await;
        let released = Instant::now();
        h1.release().await.unwrap();
        let w = bounded(T, "the waiter", waiter).await.unwrap().expect("granted");
        assert!(
            released.elapsed() < Duration::from_secs(1),
            "{name}: {:?}",
            released.elapsed()
        );
        assert!(w.fencing_token() > h2.fencing_token(), "{name}");
        let (all, _) = spawn_queued(semaphore(&ca, name, 3, 3).wait(T), T).await;
        assert!(cb.force_release(name).await.unwrap(), "{name}");
        assert_eq!(bounded(T, "lost", w.lost()).await, LostReason::ForceReleased);
        assert_eq!(bounded(T, "lost", h2.lost()).await, LostReason::ForceReleased);
        let all = bounded(Duration::from_secs(2), "the waiter of all", all)
            .await
            .unwrap()
            .expect("granted after the break");
        assert!(all.fencing_token() > w.fencing_token(), "{name}");
        all.release().await.unwrap();
    }
}

/// A mutex passed in memory among many waiters of one server (tokens handed without
/// Redis, reserved ahead), then taken as a semaphore, a read lock and a fair lock: every
/// token is above every token handed in memory, and a ForceRelease's floor above them
/// too (a holder granted before the break is told FORCE_RELEASED).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_after_passes_in_memory_grow_for_every_kind() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let c = server.client().await;
    let seen = Grants::default();
    let name = "passed/kinds";
    let mut tasks = Vec::new();
    for i in 0..8 {
        let (c, seen) = (c.clone(), seen.clone());
        tasks.push(tokio::spawn(async move {
            for round in 0..25 {
                let lease = c.lock(name).wait(T).acquire().await.expect("granted");
                seen.record(lease.fencing_token(), format!("mutex {i}/{round}"));
                lease.release().await.expect("released");
            }
        }));
    }
    for t in tasks {
        bounded(Duration::from_secs(60), "workers", t).await.unwrap();
    }
    let s = semaphore(&c, name, 2, 1).wait(T).acquire().await.unwrap();
    seen.record(s.fencing_token(), "semaphore".into());
    s.release().await.unwrap();
    let r = c.lock(name).kind(LockKind::Read).wait(T).acquire().await.unwrap();
    seen.record(r.fencing_token(), "read".into());
    r.release().await.unwrap();
    let f = c.lock(name).kind(LockKind::Fair).wait(T).acquire().await.unwrap();
    seen.record(f.fencing_token(), "fair".into());
    assert!(c.force_release(name).await.unwrap());
    assert_eq!(bounded(T, "lost", f.lost()).await, LostReason::ForceReleased);
    let after = c.lock(name).wait(T).acquire().await.unwrap();
    seen.record(after.fencing_token(), "after the break".into());
    after.release().await.unwrap();
    seen.assert_increasing();
}
