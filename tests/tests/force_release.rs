//! ForceRelease of every kind, held on several servers, by named owners, in a
//! multi-lock or by a Redisson client: every holder is told, waiters are woken at once
//! and in order, and a break racing grants and releases leaves every lease truthful.

use latchkey_client::{Client, LockKind, LostReason};
use latchkey_tests::redis_client;
use latchkey_tests::redisson::{random_owner, RedissonLock};
use latchkey_tests::server::{spawn_queued, Latchkey};
use latchkey_tests::{bounded, RedisServer};
use std::time::{Duration, Instant};

/// Bound on anything a test waits for.
const T: Duration = Duration::from_secs(10);
/// How soon a holder must hear of a break, and a waiter be woken by it.
const PROMPT: Duration = Duration::from_secs(2);

/// A lease of `name` as `kind` for `owner` (a fresh one when empty); a semaphore of
/// `limit` permits.
async fn take(c: &Client, name: &str, kind: LockKind, owner: &str, limit: u32) -> latchkey_client::Lease {
    let mut lock = c.lock(name).kind(kind).wait(T);
    if !owner.is_empty() {
        lock = lock.owner(owner);
    }
    if kind == LockKind::Semaphore {
        lock = lock.limit(limit);
    }
    bounded(T, "acquire", lock.acquire())
        .await
        .unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// ForceRelease of a lock with several holders on two servers (a read lock's readers,
/// a semaphore's holds, a mutex held reentrantly by one owner from both servers) tells
/// every holder at once, and wakes a waiter that needs the whole lock.
#[tokio::test]
async fn force_release_tells_every_holder_on_every_server_and_wakes_the_waiter() {
    let redis = RedisServer::start();
    let a = Latchkey::start(&redis.url()).await;
    let b = Latchkey::start(&redis.url()).await;
    let (ca, cb) = (a.client().await, b.client().await);
    for (name, kind, owner, limit, waiting_kind) in [
        ("shared/read", LockKind::Read, "", 0, LockKind::Write),
        ("shared/read-same", LockKind::Read, "r1", 0, LockKind::Write),
        ("shared/sem", LockKind::Semaphore, "", 3, LockKind::Semaphore),
        ("shared/mutex", LockKind::Mutex, "m1", 0, LockKind::Mutex),
        ("shared/fair", LockKind::Fair, "f1", 0, LockKind::Fair),
        ("shared/write", LockKind::Write, "w1", 0, LockKind::Write),
    ] {
        let holders = vec![
            take(&ca, name, kind, owner, limit).await,
            take(&cb, name, kind, owner, limit).await,
            take(&ca, name, kind, owner, limit).await,
        ];
        let mut waiter = cb.lock(name).kind(waiting_kind).wait(T);
        if waiting_kind == LockKind::Semaphore {
            waiter = waiter.limit(limit).permits(limit);
        }
        let waiting = tokio::spawn(waiter.acquire());
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!waiting.is_finished(), "{name}: the waiter waits");
        assert!(ca.force_release(name).await.unwrap(), "{name} was held");
        for (i, lease) in holders.iter().enumerate() {
            let reason = tokio::time::timeout(PROMPT, lease.lost())
                .await
                .unwrap_or_else(|_| panic!("{name}: holder {i} told at once"));
            assert_eq!(reason, LostReason::ForceReleased, "{name}: holder {i}");
        }
        let granted = tokio::time::timeout(PROMPT, waiting)
            .await
            .unwrap_or_else(|_| panic!("{name}: the waiter woken at once"))
            .unwrap()
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let state = ca.describe(name).await.unwrap();
        assert_eq!(state.holders.len(), 1, "{name}: the waiter alone holds: {state:?}");
        assert_eq!(state.holders[0].owner, granted.owner(), "{name}");
        drop(holders);
        granted.release().await.unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}

/// A lock whose name reads like a server's delivery check on the force channel
/// (`latchkey:probe:…`) is broken on every server as any other: its holder on another
/// server was told nothing, kept its lease beside the new holder until its watchdog's
/// next round, and was then told `NOT_HELD`.
#[tokio::test]
async fn a_lock_named_like_a_delivery_check_is_broken_on_every_server() {
    let redis = RedisServer::start();
    let a = Latchkey::start(&redis.url()).await;
    let b = Latchkey::start(&redis.url()).await;
    let (ca, cb) = (a.client().await, b.client().await);
    let name = "latchkey:probe:jobs";
    let holder = take(&cb, name, LockKind::Mutex, "", 0).await;
    assert!(ca.force_release(name).await.unwrap(), "held");
    let reason = tokio::time::timeout(PROMPT, holder.lost())
        .await
        .expect("the holder on the other server told at once");
    assert_eq!(reason, LostReason::ForceReleased);
}

/// A named owner that takes its lock again right after a break (from another server)
/// keeps that new hold whatever the broken stream does when it ends: the broken
/// stream gives back nothing, so the new hold is neither decremented nor deleted.
#[tokio::test]
async fn a_named_owner_retaking_a_broken_lock_keeps_it_when_the_broken_stream_ends() {
    let redis = RedisServer::start();
    let a = Latchkey::start(&redis.url()).await;
    let b = Latchkey::start(&redis.url()).await;
    let (ca, cb) = (a.client().await, b.client().await);
    for (name, kind, limit) in [
        ("retake/mutex", LockKind::Mutex, 0),
        ("retake/fair", LockKind::Fair, 0),
        ("retake/read", LockKind::Read, 0),
        ("retake/write", LockKind::Write, 0),
        ("retake/sem", LockKind::Semaphore, 1),
    ] {
        let broken = take(&ca, name, kind, "same-owner", limit).await;
        assert!(cb.force_release(name).await.unwrap(), "{name}");
        let again = take(&cb, name, kind, "same-owner", limit).await;
        let reason = tokio::time::timeout(PROMPT, broken.lost()).await.expect("told");
        assert_eq!(reason, LostReason::ForceReleased, "{name}");
        drop(broken);
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!again.is_lost(), "{name}: the new hold is not lost");
        let state = cb.describe(name).await.unwrap();
        assert_eq!(state.holders.len(), 1, "{name}: {state:?}");
        assert_eq!(state.holders[0].hold_count, 1, "{name}: one hold: {state:?}");
        // Nobody else gets it while the new hold lives.
        let other_kind = if kind == LockKind::Read { LockKind::Write } else { kind };
        let other = cb.lock(name).kind(other_kind);
        let other = if kind == LockKind::Semaphore {
            other.limit(limit)
        } else {
            other
        };
        let tried = other.try_once().acquire().await;
        assert!(tried.is_err(), "{name}: the lock is held by the new hold");
        again
            .release()
            .await
            .unwrap_or_else(|e| panic!("{name}: released: {e}"));
        assert!(!cb.describe(name).await.unwrap().locked, "{name}: free");
    }
}

/// A multi-lock one of whose names is force-released: its lease is lost, and its other
/// names are given back by the server at once, though the client still keeps the lease
/// object (the server ended the stream; the names must not wait for the client).
#[tokio::test]
async fn a_broken_multi_lock_gives_back_its_other_names_without_the_client() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let c = server.client().await;
    let held = c.lock_all(["ml/c", "ml/d"]).acquire().await.unwrap();
    let waiter = tokio::spawn(c.lock("ml/c").wait(T).acquire());
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(c.force_release("ml/d").await.unwrap());
    let reason = tokio::time::timeout(PROMPT, held.lost()).await.expect("told");
    assert_eq!(reason, LostReason::ForceReleased);
    let granted = tokio::time::timeout(PROMPT, waiter)
        .await
        .expect("ml/c given back at once")
        .unwrap()
        .unwrap();
    drop(held);
    granted.release().await.unwrap();
}

/// ForceRelease of a lock Redisson holds wakes a latchkey waiter at once (not at the
/// end of Redisson's lease).
#[tokio::test]
async fn force_release_of_a_redisson_lock_wakes_a_latchkey_waiter() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let c = server.client().await;
    let conn = redis_client(&redis.url()).await;
    for kind in [LockKind::Mutex, LockKind::Fair] {
        let name = format!("java/{}", kind.as_str_name());
        let java = RedissonLock::new(&conn, &name, &random_owner());
        assert_eq!(java.try_lock(60_000).await, None, "redisson holds");
        let waiting = tokio::spawn(c.lock(name.as_str()).kind(kind).wait(T).acquire());
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(c.force_release(name.as_str()).await.unwrap());
        let lease = tokio::time::timeout(PROMPT, waiting)
            .await
            .expect("woken at once")
            .unwrap()
            .unwrap();
        lease.release().await.unwrap();
    }
}

/// ForceRelease of a fair lock with a queue of waiters on two servers: the queue's
/// head is granted at once, and each release then passes the lock on at once, in
/// queue order (the break neither strands the queue nor reorders it). The same for a
/// mutex's waiters on two servers (any order).
#[tokio::test]
async fn a_broken_lock_passes_on_through_its_whole_queue_promptly() {
    let redis = RedisServer::start();
    let a = Latchkey::start(&redis.url()).await;
    let b = Latchkey::start(&redis.url()).await;
    let (ca, cb) = (a.client().await, b.client().await);
    for kind in [LockKind::Fair, LockKind::Mutex] {
        let name = format!("queue/{}", kind.as_str_name());
        let holder = take(&ca, &name, kind, "", 0).await;
        let mut waiting = Vec::new();
        for (i, c) in [&ca, &cb, &ca, &cb].into_iter().enumerate() {
            let lock = c.lock(name.as_str()).kind(kind).wait(T).owner(format!("w{i}"));
            // Each queued before the next asks: queue order = arrival order for the fair
            // lock.
            waiting.push(spawn_queued(lock, T).await.0);
        }
        assert!(ca.force_release(name.as_str()).await.unwrap());
        let reason = tokio::time::timeout(PROMPT, holder.lost()).await.expect("told");
        assert_eq!(reason, LostReason::ForceReleased);
        let mut order = Vec::new();
        let mut pending = waiting;
        while !pending.is_empty() {
            let started = tokio::time::Instant::now();
            let lease = loop {
                if let Some(i) = pending.iter().position(|w| w.is_finished()) {
                    break pending
                        .remove(i)
                        .await
                        .unwrap()
                        .unwrap_or_else(|e| panic!("{name}: {e}"));
                }
                assert!(
                    started.elapsed() < PROMPT,
                    "{name}: no waiter granted within {PROMPT:?} after {order:?}"
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            };
            order.push(lease.owner().to_owned());
            lease.release().await.unwrap_or_else(|e| panic!("{name}: {e}"));
        }
        if kind == LockKind::Fair {
            assert_eq!(order, ["w0", "w1", "w2", "w3"], "{name}: queue order");
        }
    }
}

/// ForceRelease racing grants and releases of the same lock on two servers: once the
/// dust settles, a lease that was not told it is lost still holds the lock in Redis
/// (Describe names its owner), and one told FORCE_RELEASED does not. Never a lease
/// that thinks it holds a lock Redis does not show it holding, nor a lock left held
/// by nobody.
#[tokio::test]
async fn force_release_racing_grants_leaves_every_lease_truthful() {
    let redis = RedisServer::start();
    let a = Latchkey::start(&redis.url()).await;
    let b = Latchkey::start(&redis.url()).await;
    let (ca, cb) = (a.client().await, b.client().await);
    for kind in [LockKind::Mutex, LockKind::Fair, LockKind::Write, LockKind::Semaphore] {
        for i in 0..12u32 {
            let name = format!("race/{}/{i}", kind.as_str_name());
            let first = take(&ca, &name, kind, "", 1).await;
            // A second request waits on the other server, and a break comes while the
            // first holder releases.
            let mut second = cb.lock(name.as_str()).kind(kind).wait(T);
            if kind == LockKind::Semaphore {
                second = second.limit(1);
            }
            let second = tokio::spawn(second.acquire());
            tokio::time::sleep(Duration::from_millis(u64::from(i % 5) * 20)).await;
            let breaking = {
                let ca = ca.clone();
                let name = name.clone();
                tokio::spawn(async move { ca.force_release(name).await })
            };
            if i % 3 != 0 {
                let _ = first.release().await;
            } else {
                drop(first);
            }
            breaking.await.unwrap().unwrap();
            let second = bounded(T, "the second request ends", second).await.unwrap();
            let second = second.unwrap_or_else(|e| panic!("{name}: {e}"));
            // The lease and Redis agree once a break's notice reached the lease (PROMPT).
            let agreed = Instant::now() + PROMPT;
            let (state, shown) = loop {
                let state = cb.describe(name.as_str()).await.unwrap();
                let shown = state.holders.iter().any(|h| h.owner == second.owner());
                if shown == second.lost_reason().is_none() || Instant::now() > agreed {
                    break (state, shown);
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            };
            match second.lost_reason() {
                None => assert!(shown, "{name}: the lease holds, Redis says otherwise: {state:?}"),
                Some(reason) => {
                    assert!(!shown, "{name}: told {reason} but still shown holding: {state:?}");
                    assert!(!state.locked, "{name}: held by nobody's lease: {state:?}");
                }
            }
            drop(second);
        }
    }
}

/// A read lock one of whose holders' timeout key names a key of another type (an
/// application's hash) is broken whole, that key left alone: the script failed on it
/// (WRONGTYPE) after it had written the break floor, the lock left held by nobody
/// (every holder told `lost`) and the call answered `WRONG_KIND`.
#[tokio::test]
async fn force_release_of_a_read_lock_beside_a_foreign_timeout_key_breaks_it_whole() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let c = server.client().await;
    redis.cli(&["HSET", "fr/rw", "mode", "read", "r1", "2"]);
    redis.cli(&["PEXPIRE", "fr/rw", "60000"]);
    redis.cli(&["SET", "{fr/rw}:r1:rwlock_timeout:1", "fr/rw", "PX", "60000"]);
    redis.cli(&["HSET", "{fr/rw}:r1:rwlock_timeout:2", "app", "data"]);
    let released = c.force_release("fr/rw").await.map_err(|e| e.to_string());
    assert_eq!(released, Ok(true));
    assert_eq!(
        redis.cli(&["EXISTS", "fr/rw", "{fr/rw}:r1:rwlock_timeout:1"]).trim(),
        "0"
    );
    assert_eq!(redis.cli(&["TYPE", "{fr/rw}:r1:rwlock_timeout:2"]).trim(), "hash");
}
