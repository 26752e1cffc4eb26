//! Many clients on two servers taking every kind at random: single mutexes beside
//! multi-locks on the same names, readers beside writers, and random waits, cancels,
//! drops and releases (with and without shared named owners). Never two holders of a
//! name, nobody stranded, and nothing left held in Redis once they are done.

use latchkey_client::{Client, LockKind};
use latchkey_tests::server::Latchkey;
use latchkey_tests::RedisServer;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Single mutex holders (hot, passed in memory on each server) and multi-locks over the
/// same names, on two servers: never two holders of a name at once, nobody stranded.
#[tokio::test]
async fn stress_multi_and_single_mutexes_on_the_same_names() {
    let redis = RedisServer::start();
    let a = Latchkey::start(&redis.url()).await;
    let b = Latchkey::start(&redis.url()).await;
    let names = ["x", "y", "z"];
    let inside: Arc<HashMap<&'static str, AtomicU32>> =
        Arc::new(names.iter().map(|n| (*n, AtomicU32::new(0))).collect());
    let mut tasks = Vec::new();
    let sets: Vec<Vec<&'static str>> = vec![
        vec!["x"],
        vec!["x"],
        vec!["x"],
        vec!["y"],
        vec!["y"],
        vec!["x", "y"],
        vec!["y", "z", "x"],
        vec!["z", "x"],
        vec!["z"],
    ];
    for (i, set) in sets.into_iter().enumerate() {
        for server in [&a, &b] {
            let client = server.client().await;
            let inside = inside.clone();
            let set = set.clone();
            tasks.push(tokio::spawn(async move {
                for round in 0..25 {
                    let builder = if set.len() == 1 {
                        client.lock(set[0])
                    } else {
                        client.lock_all(set.clone())
                    };
                    let lease = builder
                        .wait(Duration::from_secs(30))
                        .acquire()
                        .await
                        .unwrap_or_else(|e| panic!("task {i} round {round} {set:?}: {e}"));
                    for n in &set {
                        let was = inside[n].fetch_add(1, Ordering::SeqCst);
                        assert_eq!(was, 0, "two holders of {n} at once (task {i} {set:?})");
                    }
                    tokio::time::sleep(Duration::from_millis(fastrand::u64(0..3))).await;
                    for n in &set {
                        inside[n].fetch_sub(1, Ordering::SeqCst);
                    }
                    lease.release().await.unwrap_or_else(|e| panic!("release {set:?}: {e}"));
                }
            }));
        }
    }
    all_done(tasks).await;
}

/// Readers and writers (some sharing a named owner) on two servers.
#[tokio::test]
async fn stress_readers_and_writers() {
    let redis = RedisServer::start();
    let a = Latchkey::start(&redis.url()).await;
    let b = Latchkey::start(&redis.url()).await;
    let readers = Arc::new(AtomicU32::new(0));
    let writers = Arc::new(AtomicU32::new(0));
    let mut tasks = Vec::new();
    for i in 0..12u32 {
        let client = if i % 2 == 0 { a.client().await } else { b.client().await };
        let kind = if i % 3 == 0 { LockKind::Write } else { LockKind::Read };
        let (readers, writers) = (readers.clone(), writers.clone());
        tasks.push(tokio::spawn(async move {
            for round in 0..20 {
                let lease = client
                    .lock("rw")
                    .kind(kind)
                    .wait(Duration::from_secs(30))
                    .acquire()
                    .await
                    .unwrap_or_else(|e| panic!("task {i} round {round} {kind:?}: {e}"));
                if kind == LockKind::Write {
                    assert_eq!(writers.fetch_add(1, Ordering::SeqCst), 0, "two writers");
                    assert_eq!(readers.load(Ordering::SeqCst), 0, "a writer beside readers");
                } else {
                    readers.fetch_add(1, Ordering::SeqCst);
                    assert_eq!(writers.load(Ordering::SeqCst), 0, "a reader beside a writer");
                }
                tokio::time::sleep(Duration::from_millis(fastrand::u64(0..3))).await;
                if kind == LockKind::Write {
                    writers.fetch_sub(1, Ordering::SeqCst);
                } else {
                    readers.fetch_sub(1, Ordering::SeqCst);
                }
                lease.release().await.unwrap();
            }
        }));
    }
    all_done(tasks).await;
}

/// A builder's random ending: a short wait (or none), the client's cancel while
/// waiting or not, a short hold, then a release or a drop.
async fn take_and_end(builder: latchkey_client::LockBuilder) {
    let builder = if fastrand::u32(0..4) == 0 {
        builder.try_once()
    } else {
        builder.wait(Duration::from_millis(fastrand::u64(1..80)))
    };
    let acquired = if fastrand::bool() {
        let cancel_after = Duration::from_millis(fastrand::u64(0..60));
        match tokio::time::timeout(cancel_after, builder.acquire()).await {
            Ok(r) => r,
            Err(_) => return,
        }
    } else {
        builder.acquire().await
    };
    let Ok(lease) = acquired else { return };
    tokio::time::sleep(Duration::from_millis(fastrand::u64(0..5))).await;
    if fastrand::bool() {
        let _ = lease.release().await;
    } else {
        drop(lease);
    }
}

/// Runs `op` 40 times in each of 16 tasks, half on each of two servers of `redis`, and
/// waits for every task.
async fn on_two_servers<F, Fut>(redis: &RedisServer, op: F)
where
    F: Fn(Client) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let servers = [Latchkey::start(&redis.url()).await, Latchkey::start(&redis.url()).await];
    let mut tasks = Vec::new();
    for i in 0..16 {
        let (client, op) = (servers[i % 2].client().await, op.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..40 {
                op(client.clone()).await;
            }
        }));
    }
    all_done(tasks).await;
}

/// Waits until no key of `redis` that `kept` picks is left (give-backs run in the
/// background), up to 5 s.
async fn nothing_left(redis: &RedisServer, kept: impl Fn(&str) -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let keys = redis.cli(&["KEYS", "*"]);
        let left: Vec<&str> = keys.lines().map(str::trim).filter(|k| kept(k)).collect();
        if left.is_empty() {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "left held: {left:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// After random takes, waits, cancels and releases of every kind end, nothing is left
/// held.
#[tokio::test]
async fn chaos_leaves_nothing_held() {
    let redis = RedisServer::start();
    on_two_servers(&redis, |client: Client| async move {
        let builder = match fastrand::u32(0..5) {
            0 => {
                let set: Vec<&str> = ["m1", "m2", "m3"].into_iter().filter(|_| fastrand::bool()).collect();
                client.lock_all(if set.len() < 2 { vec!["m1", "m3"] } else { set })
            }
            1 => client.lock(["m1", "m2", "m3"][fastrand::usize(0..3)]),
            2 => client.lock("rw").kind(LockKind::Read),
            3 => client.lock("rw").kind(LockKind::Write),
            _ => client
                .lock("sem")
                .kind(LockKind::Semaphore)
                .limit(3)
                .permits(fastrand::u32(1..3)),
        };
        take_and_end(builder).await;
    })
    .await;
    nothing_left(&redis, |k| ["m1", "m2", "m3", "rw", "sem"].contains(&k)).await;
}

/// As `chaos_leaves_nothing_held`, with holds shared by two named owners: their reads,
/// writes (downgrades) and reentrant multi-locks leave nothing held, no timeout key.
#[tokio::test]
async fn chaos_of_named_owners_leaves_nothing_held() {
    let redis = RedisServer::start();
    on_two_servers(&redis, |client: Client| async move {
        let builder = match fastrand::u32(0..4) {
            0 => client.lock_all(["m1", "m2"]),
            1 => client.lock(["m1", "m2"][fastrand::usize(0..2)]),
            2 => client.lock("rw").kind(LockKind::Read),
            _ => client.lock("rw").kind(LockKind::Write),
        };
        take_and_end(builder.owner(["o1", "o2"][fastrand::usize(0..2)])).await;
    })
    .await;
    nothing_left(&redis, |k| {
        ["m1", "m2", "rw"].contains(&k) || k.contains("rwlock_timeout")
    })
    .await;
}

/// Waits for every task, each within 2 minutes: one that does not end is stranded.
async fn all_done(tasks: Vec<tokio::task::JoinHandle<()>>) {
    for task in tasks {
        tokio::time::timeout(Duration::from_secs(120), task)
            .await
            .expect("nobody stranded")
            .expect("task");
    }
}
