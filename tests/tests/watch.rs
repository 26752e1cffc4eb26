//! Watch: one state at once, then one per change (acquired, released, queued, lost),
//! driven by pub/sub, for leader observation.

use latchkey_client::{LockKind, LockState};
use latchkey_tests::redisson::{random_owner, RedissonLock};
use latchkey_tests::server::Latchkey;
use latchkey_tests::{redis_client, RedisServer};
use std::time::{Duration, Instant};

/// The next state, within a second (changes arrive by pub/sub, not by polling).
async fn next(watch: &mut latchkey_client::LockWatch) -> LockState {
    tokio::time::timeout(Duration::from_secs(1), watch.next())
        .await
        .expect("a state within a second")
        .expect("stream ok")
        .expect("stream open")
}

#[tokio::test]
async fn watch_reports_every_change_of_a_lock() {
    let redis = RedisServer::start();
    let a = Latchkey::start(&redis.url()).await;
    let b = Latchkey::start(&redis.url()).await;
    let client = a.client().await;
    let mut watch = b.client().await.watch("leader").await.unwrap();
    assert!(!next(&mut watch).await.locked, "the first state is the current one");

    let lease = client
        .lock("leader")
        .kind(LockKind::Fair)
        .owner("node-1")
        .acquire()
        .await
        .unwrap();
    let state = next(&mut watch).await;
    assert!(state.locked);
    assert_eq!(state.holders[0].owner, "node-1");
    assert_eq!(state.last_fencing_token, lease.fencing_token());

    let waiting = {
        let client = client.clone();
        tokio::spawn(async move {
            client
                .lock("leader")
                .kind(LockKind::Fair)
                .owner("node-2")
                .acquire()
                .await
        })
    };
    let state = next(&mut watch).await;
    assert_eq!(state.waiters.len(), 1, "the queue change is reported");
    assert_eq!(state.waiters[0].owner, "node-2");

    lease.release().await.unwrap();
    // The release and node-2's grant may come as one state or two.
    let mut state = next(&mut watch).await;
    if state.holders.first().map(|h| h.owner.as_str()) != Some("node-2") {
        state = next(&mut watch).await;
    }
    assert_eq!(state.holders[0].owner, "node-2", "the new leader");
    assert!(state.waiters.is_empty());
    waiting.await.unwrap().unwrap().release().await.unwrap();
    assert!(!next(&mut watch).await.locked);
}

#[tokio::test]
async fn watch_sees_an_expiry_and_a_redisson_holder_leaving() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let mut watch = client.watch("w").await.unwrap();
    assert!(!next(&mut watch).await.locked);
    let _lease = client
        .lock("w")
        .lease(Duration::from_millis(400))
        .acquire()
        .await
        .unwrap();
    assert!(next(&mut watch).await.locked);
    let started = Instant::now();
    assert!(!next(&mut watch).await.locked, "the end of the fixed lease");
    assert!(started.elapsed() < Duration::from_secs(1));

    let java = RedissonLock::new(&redis_client(&redis.url()).await, "w", &random_owner());
    assert_eq!(java.try_lock(30_000).await, None);
    // Redisson's grant sends no message: a Watch sees it with the next change.
    java.unlock().await;
    let mut watch = client.watch("w").await.unwrap();
    assert!(!next(&mut watch).await.locked);
    assert_eq!(java.try_lock(30_000).await, None);
    let other = client.lock("w").wait(Duration::from_secs(5));
    let waiting = tokio::spawn(other.acquire());
    java.unlock().await;
    // Redisson's unlock message reaches the watcher; then latchkey's grant follows.
    let mut seen_locked_by_latchkey = false;
    for _ in 0..3 {
        let state = next(&mut watch).await;
        if state.locked && state.holders[0].owner != java.owner() {
            seen_locked_by_latchkey = true;
            break;
        }
    }
    assert!(seen_locked_by_latchkey);
    waiting.await.unwrap().unwrap();
}

/// A Redisson client announces nothing when it takes a free lock: Watch re-reads the
/// lock every second and shows the Java holder.
#[tokio::test]
async fn watch_shows_a_redisson_client_taking_a_free_lock() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let mut watch = server.client().await.watch("watched").await.unwrap();
    assert!(!next(&mut watch).await.locked);
    let conn = redis_client(&redis.url()).await;
    let owner = random_owner();
    let java = RedissonLock::new(&conn, "watched", &owner);
    assert_eq!(java.try_lock(30_000).await, None, "redisson locks");
    let state = tokio::time::timeout(Duration::from_secs(3), watch.next())
        .await
        .expect("a state within the second's re-read")
        .expect("stream ok")
        .expect("stream open");
    assert!(state.locked, "{state:?}");
    assert_eq!(state.holders[0].owner, owner);
}

/// Watch outlasts Redis not answering for a while (a restart, a failover, a pause): it
/// reads the lock again until Redis answers, and then tells what changed. It ended with
/// `UNAVAILABLE` on the first read that failed, at the moments leadership changes.
#[tokio::test]
async fn watch_outlasts_a_redis_pause() {
    let redis = RedisServer::start();
    let server = Latchkey::start_with(&redis.url(), &["--redis-timeout", "300ms"]).await;
    let client = server.client().await;
    let mut watch = client.watch("leader").await.unwrap();
    assert!(!next(&mut watch).await.locked);
    redis.cli(&["CLIENT", "PAUSE", "2000"]);
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let lease = client.lock("leader").acquire().await.unwrap();
    let state = tokio::time::timeout(Duration::from_secs(3), watch.next())
        .await
        .expect("a state in time")
        .expect("the stream is still open")
        .expect("not ended by the pause");
    assert!(state.locked, "{state:?}");
    lease.release().await.unwrap();
}

/// Watches nobody reads hold back no other call on their connection. A client's calls
/// share one HTTP/2 connection, whose window the server's data takes until it is read:
/// three unread watches of a lock whose state is over 2 MiB (each stream's window) took
/// the whole connection window (5 MiB), and a lease acquired on the same client never
/// heard `acquired` (the lock held, its stream renewed), nor a held lease `lost`.
#[tokio::test]
async fn unread_watches_hold_back_no_lease_on_their_connection() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let other = server.client().await;
    let many = "for i = 1, 2500 do redis.call('hset', KEYS[1], string.rep('o', 1000) .. i, 1) end \
        redis.call('pexpire', KEYS[1], 60000)";
    redis.cli(&["EVAL", many, "1", "big"]);
    let held = client.lock("held").acquire().await.unwrap();
    let mut watches = Vec::new();
    for _ in 0..3 {
        watches.push(client.watch("big").await.unwrap());
    }
    let lease = tokio::time::timeout(
        Duration::from_secs(5),
        client.lock("free").wait(Duration::from_secs(1)).acquire(),
    )
    .await
    .expect("acquired heard in time")
    .expect("acquired");
    assert!(other.force_release("held").await.unwrap());
    let reason = tokio::time::timeout(Duration::from_secs(5), held.lost())
        .await
        .expect("lost heard in time");
    assert_eq!(reason, latchkey_client::LostReason::ForceReleased);
    lease.release().await.unwrap();
    // Read at last, each watch has the lock's state.
    for watch in &mut watches {
        let state = watch.next().await.unwrap().expect("a state");
        assert_eq!(state.holders.len(), 2500);
    }
}

/// A bad name is refused with `INVALID_ARGUMENT` naming `name`.
#[tokio::test]
async fn watch_names_a_bad_name() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let long = "x".repeat(1025);
    for name in ["", "a\nb", long.as_str(), "{x}", "a{", "latchkey_semaphore:x"] {
        let answer = match client.watch(name).await {
            Ok(mut watch) => tokio::time::timeout(Duration::from_secs(10), watch.next())
                .await
                .expect("answered")
                .map(|_| ()),
            Err(e) => Err(e),
        };
        let err = answer.expect_err(&format!("{name:?} refused"));
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{name:?}: {err}");
        assert!(err.to_string().contains("name"), "{name:?}: {err}");
    }
}

/// A semaphore's holders show as they come and go, and after Redis restarts empty the
/// semaphore shows free, then its next holder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_follows_a_semaphore_through_a_redis_restart() {
    let mut redis = RedisServer::start();
    let args = ["--watchdog-timeout", "1500ms", "--redis-timeout", "300ms"];
    let server = Latchkey::start_with(&redis.url(), &args).await;
    let client = server.client().await;
    let semaphore = |permits| client.lock("w").kind(LockKind::Semaphore).limit(3).permits(permits);
    let mut watch = client.watch("w").await.unwrap();
    assert!(!next(&mut watch).await.locked);
    let one = semaphore(1).acquire().await.unwrap();
    assert_eq!(next(&mut watch).await.holders.len(), 1);
    let two = semaphore(2).acquire().await.unwrap();
    let state = next(&mut watch).await;
    assert_eq!(state.holders.iter().map(|h| h.hold_count).sum::<u32>(), 3, "{state:?}");
    one.release().await.unwrap();
    assert_eq!(next(&mut watch).await.holders.len(), 1);
    redis.restart();
    // Reads that fail while Redis is away are retried; the first answer after is free.
    let mut free = false;
    for _ in 0..10 {
        let state = tokio::time::timeout(Duration::from_secs(5), watch.next())
            .await
            .expect("a state");
        if !state.expect("stream ok").expect("stream open").locked {
            free = true;
            break;
        }
    }
    assert!(free, "the semaphore shows free after the restart");
    tokio::time::timeout(Duration::from_secs(10), two.lost())
        .await
        .expect("the holder is told lost");
    let three = semaphore(3).acquire().await.unwrap();
    let state = next(&mut watch).await;
    assert!(state.locked && state.holders[0].hold_count == 3, "{state:?}");
    three.release().await.unwrap();
}
