//! Interoperation with Java services using Redisson on the same Redis: the Redisson
//! lock scripts and pub/sub are driven here exactly as the Java client sends them.
//! Both sides exclude each other and wake each other, on a standalone Redis and on a
//! 3-master cluster (sharded pub/sub).

use latchkey_client::LockKind;
use latchkey_tests::redisson::{random_owner, PublishCommand, RedissonFairLock, RedissonLock};
use latchkey_tests::server::Latchkey;
use latchkey_tests::{bounded, poll_until, redis_client, RedisCluster, RedisServer};
use std::time::{Duration, Instant};
use tonic::Code;

const T: Duration = Duration::from_secs(10);

/// Redisson holds → latchkey is refused, then waits and is woken by Redisson's unlock
/// message well before Redisson's 30 s lease would have run out.
async fn latchkey_waits_for_redisson(url: &str) {
    let server = Latchkey::start(url).await;
    let redis = redis_client(url).await;
    let java = RedissonLock::new(&redis, "orders", &random_owner()).with_publish(PublishCommand::for_url(url));
    assert_eq!(java.try_lock(30_000).await, None, "redisson takes the lock");
    let client = server.client().await;
    let err = client.lock("orders").try_once().acquire().await.unwrap_err();
    assert_eq!(err.code(), Code::DeadlineExceeded);
    let state = client.describe("orders").await.unwrap();
    assert_eq!(state.holders[0].owner, java.owner(), "Describe shows the Java holder");
    let waiter = tokio::spawn(async move { client.lock("orders").wait(T).acquire().await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let unlocked_at = Instant::now();
    assert_eq!(java.unlock().await, Some(true));
    let lease = bounded(T, "the waiter", waiter)
        .await
        .unwrap()
        .expect("latchkey acquires after redisson unlocks");
    assert!(
        unlocked_at.elapsed() < Duration::from_secs(1),
        "woken by the unlock message"
    );
    assert!(
        java.try_lock(30_000).await.is_some(),
        "redisson is refused while latchkey holds"
    );
    lease.release().await.unwrap();
}

/// latchkey holds → Redisson is refused with the holder's TTL, subscribes, and hears
/// latchkey's unlock message "0" on `redisson_lock__channel:{name}`.
async fn redisson_waits_for_latchkey(url: &str) {
    let server = Latchkey::start(url).await;
    let redis = redis_client(url).await;
    let java = RedissonLock::new(&redis, "invoices", &random_owner()).with_publish(PublishCommand::for_url(url));
    let lease = server.client().await.lock("invoices").acquire().await.unwrap();
    let ttl = java.try_lock(30_000).await.expect("redisson is refused");
    assert!(ttl > 20_000 && ttl <= 30_000, "the holder's ttl: {ttl}");
    let mut sub = java.subscribe().await;
    lease.release().await.unwrap();
    assert_eq!(
        sub.next_message(T).await.as_deref(),
        Some("0"),
        "redisson hears the unlock message"
    );
    sub.close().await;
    assert_eq!(java.try_lock(30_000).await, None, "redisson takes the lock");
    // Redisson's own waiting loop, against a latchkey holder released meanwhile.
    java.unlock().await;
    let lease = server.client().await.lock("invoices").acquire().await.unwrap();
    let released = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        lease.release().await
    });
    let started = Instant::now();
    assert!(java.lock(T, 30_000).await, "redisson's lock() acquires");
    assert!(started.elapsed() < Duration::from_secs(2));
    released.await.unwrap().unwrap();
}

#[tokio::test]
async fn standalone_latchkey_waits_for_redisson() {
    let redis = RedisServer::start();
    latchkey_waits_for_redisson(&redis.url()).await;
}

#[tokio::test]
async fn standalone_redisson_waits_for_latchkey() {
    let redis = RedisServer::start();
    redisson_waits_for_latchkey(&redis.url()).await;
}

#[tokio::test]
async fn cluster_interoperates_over_sharded_pubsub() {
    let cluster = RedisCluster::start(3, 0);
    latchkey_waits_for_redisson(&cluster.url()).await;
    redisson_waits_for_latchkey(&cluster.url()).await;
}

#[tokio::test]
async fn a_reentrant_redisson_hold_is_shown_with_its_count() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = redis_client(&redis.url()).await;
    let java = RedissonLock::new(&client, "twice", &random_owner());
    assert_eq!(java.try_lock(30_000).await, None);
    assert_eq!(java.try_lock(30_000).await, None);
    let state = server.client().await.describe("twice").await.unwrap();
    assert_eq!(state.holders[0].hold_count, 2);
    assert!(state.locked);
}

/// A Java thread sharing a latchkey stream's owner that reenters a fixed-lease mutex or
/// fair lock, and unlocks, sets the lock's TTL to its own lease (Redisson's scripts
/// set it outright): the lock expired under the stream, which was told it held until
/// its next check found it gone. The check restores what is left of the fixed lease.
#[tokio::test]
async fn a_java_reentry_by_the_owner_does_not_cut_a_fixed_lease() {
    let redis = RedisServer::start();
    // A check of every fixed lease each second.
    let server = Latchkey::start_with(&redis.url(), &["--watchdog-timeout", "3s"]).await;
    let client = server.client().await;
    let conn = redis_client(&redis.url()).await;
    let pttl = |name: &str| redis.cli(&["PTTL", name]).trim().parse::<i64>().unwrap();
    for kind in [LockKind::Mutex, LockKind::Fair] {
        let name = format!("cut-{kind:?}");
        let owner = random_owner();
        let lease = client
            .lock(name.as_str())
            .kind(kind)
            .owner(owner.as_str())
            .lease(Duration::from_secs(60))
            .try_once()
            .acquire()
            .await
            .unwrap();
        // The owner's Java thread reenters for 2 s and unlocks: one hold is left.
        match kind {
            LockKind::Fair => {
                let java = RedissonFairLock::new(&conn, &name, &owner);
                assert_eq!(java.try_lock(2_000).await, None, "reentered");
                assert_eq!(java.unlock().await, Some(false), "latchkey's hold is left");
            }
            _ => {
                let java = RedissonLock::new(&conn, &name, &owner);
                assert_eq!(java.try_lock(2_000).await, None, "reentered");
                assert_eq!(java.unlock().await, Some(false), "latchkey's hold is left");
            }
        }
        assert!(pttl(&name) <= 2_000, "Redisson set the TTL to its lease");
        let restored = poll_until(Duration::from_secs(5), || pttl(&name) > 50_000).await;
        assert!(restored, "{kind:?}: the check restores the fixed lease");
        assert!(!lease.is_lost(), "{kind:?}: still held");
        let other = RedissonLock::new(&conn, &name, &random_owner());
        assert!(other.try_lock(30_000).await.is_some(), "{kind:?}: nobody else gets in");
        lease.release().await.unwrap();
    }
}
