//! The fair queue's deadlines over time, with Redisson's fair-lock scripts at their
//! default 5 min wait and named owners shaped like Redisson's ids (`uuid:threadId`):
//! a latchkey waiter takes its own wait plus one Redisson wait for each entry ahead that
//! Redisson may have queued, each such entry granted or giving up takes that wait off
//! those behind it (as Redisson's scripts do), so deadlines stay level in a queue that
//! never empties, and a crashed server's waiter blocks a free lock no longer than its
//! wait timeout once nothing of Redisson's stands ahead of it.

use latchkey_client::LockKind;
use latchkey_server::keys::Keys;
use latchkey_tests::redisson::{random_owner, RedissonFairLock};
use latchkey_tests::server::{holding_fair_waiter, Latchkey};
use latchkey_tests::{poll_until, redis_client, LatchkeyProcess, RedisServer};
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Bound on anything that should happen promptly.
const T: Duration = Duration::from_secs(10);
/// Redisson's default `fairLockWaitTimeout`.
const REDISSON_WAIT_MS: i64 = 300_000;
/// The servers' `--fair-wait-timeout`.
const ARGS: [&str; 2] = ["--fair-wait-timeout", "2s"];

/// Tries as a Redisson client polling its fair lock until it is granted (bounded).
async fn redisson_takes(java: &RedissonFairLock) {
    let deadline = Instant::now() + T;
    while java.try_lock(30_000).await.is_some() {
        assert!(
            Instant::now() < deadline,
            "the Redisson waiter {} is granted",
            java.owner()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The queue and deadline keys of `name`.
fn queue_keys(name: &str) -> (String, String) {
    let keys = Keys::default().lock(name);
    (keys.queue(), keys.timeouts())
}

/// After the test's waiters left: nothing of the queue is left.
async fn assert_queue_gone(redis: &RedisServer, name: &str) {
    let (queue, timeouts) = queue_keys(name);
    let gone = poll_until(T, || redis.cli(&["EXISTS", &queue, &timeouts, name]).trim() == "0").await;
    assert!(gone, "queue keys left: {:?}", redis.cli(&["KEYS", "*"]));
}

/// Redisson and latchkey waiters alternating in a fair queue that never empties (a hot
/// lock shared by a Java service and latchkey clients). A latchkey grant gave nothing
/// back, so each round left the newest Redisson waiter five minutes further out than
/// the one before (1 229 s, 1 529 s, …), and a Java client dying while queued blocked
/// the free lock that long.
#[tokio::test]
async fn redisson_and_latchkey_waiters_alternating_keep_deadlines_level() {
    let redis = RedisServer::start();
    let server = Latchkey::start_with(&redis.url(), &ARGS).await;
    let client = server.client().await;
    let conn = redis_client(&redis.url()).await;
    let name = "alternate";
    let (queue, timeouts) = queue_keys(name);
    let java = || RedissonFairLock::new(&conn, name, &random_owner()).with_thread_wait(REDISSON_WAIT_MS);
    let mut holder = client
        .lock(name)
        .kind(LockKind::Fair)
        .try_once()
        .acquire()
        .await
        .unwrap();
    // Queue: R1 L1 R2 L2 behind the latchkey holder.
    let (mut javas, mut ours, mut arrival) = (VecDeque::new(), VecDeque::new(), Vec::new());
    for _ in 0..2 {
        let r = java();
        assert!(r.try_lock(30_000).await.is_some(), "a Redisson waiter queues");
        arrival.push(r.owner().to_owned());
        javas.push_back(r);
        ours.push_back(holding_fair_waiter(&client, name, None).await);
        arrival.push(redis.list(&queue).last().unwrap().clone());
    }
    let (mut granted, mut offsets) = (Vec::new(), Vec::new());
    for _round in 0..5 {
        // The latchkey holder releases: the Redisson waiter at the head is granted.
        holder.release().await.unwrap();
        let r = javas.pop_front().unwrap();
        redisson_takes(&r).await;
        granted.push(r.owner().to_owned());
        // A Redisson waiter and a latchkey waiter join at the end.
        let newest = java();
        assert!(newest.try_lock(30_000).await.is_some(), "a Redisson waiter queues");
        arrival.push(newest.owner().to_owned());
        offsets.push((redis.score(&timeouts, newest.owner()) - redis.now_ms()) / 1000);
        javas.push_back(newest);
        ours.push_back(holding_fair_waiter(&client, name, None).await);
        arrival.push(redis.list(&queue).last().unwrap().clone());
        // The Redisson holder unlocks: the latchkey waiter next in line is granted.
        assert_eq!(r.unlock().await, Some(true));
        let next = ours.pop_front().unwrap();
        holder = tokio::time::timeout(T, next).await.expect("granted in turn").unwrap();
        granted.push(holder.owner().to_owned());
    }
    assert_eq!(granted, arrival[..granted.len()], "granted in arrival order");
    for task in ours {
        task.abort();
        let _ = task.await;
    }
    for r in &javas {
        r.acquire_failed(REDISSON_WAIT_MS).await;
    }
    holder.release().await.unwrap();
    assert_queue_gone(&redis, name).await;
    assert!(
        offsets.last().unwrap() - offsets[0] < 120,
        "the newest Redisson waiter's deadline, round by round (s from now): {offsets:?}"
    );
}

/// latchkey alone, named owners shaped like Redisson's ids (which may be Redisson
/// waiters) alternating with streams' own waiters in a queue that never empties: each
/// named owner joining was five minutes further out than the one before, as no latchkey
/// grant took the wait it had added off.
#[tokio::test]
async fn redisson_shaped_owners_alternating_keep_deadlines_level() {
    let redis = RedisServer::start();
    let server = Latchkey::start_with(&redis.url(), &ARGS).await;
    let client = server.client().await;
    let name = "named-alternate";
    let (queue, timeouts) = queue_keys(name);
    let mut holder = client
        .lock(name)
        .kind(LockKind::Fair)
        .try_once()
        .acquire()
        .await
        .unwrap();
    let mut line = VecDeque::new();
    for _ in 0..2 {
        line.push_back(holding_fair_waiter(&client, name, Some(&random_owner())).await);
        line.push_back(holding_fair_waiter(&client, name, None).await);
    }
    let mut offsets = Vec::new();
    for _round in 0..5 {
        // Two grants: a named owner's, then a stream-owned waiter's.
        for _ in 0..2 {
            holder.release().await.unwrap();
            let next = line.pop_front().unwrap();
            holder = tokio::time::timeout(T, next).await.expect("granted in turn").unwrap();
        }
        let named = random_owner();
        line.push_back(holding_fair_waiter(&client, name, Some(&named)).await);
        offsets.push((redis.score(&timeouts, &named) - redis.now_ms()) / 1000);
        line.push_back(holding_fair_waiter(&client, name, None).await);
    }
    let now = redis.now_ms();
    let left: Vec<i64> = redis
        .list(&queue)
        .iter()
        .map(|o| (redis.score(&timeouts, o) - now) / 1000)
        .collect();
    for task in line {
        task.abort();
        let _ = task.await;
    }
    holder.release().await.unwrap();
    assert_queue_gone(&redis, name).await;
    assert!(
        offsets.last().unwrap() - offsets[0] < 120,
        "each named owner joining, s from now: {offsets:?}; the queue at the end (s left): {left:?}"
    );
}

/// A hot queue of named owners shaped like Redisson's ids, latchkey alone: newcomers'
/// deadlines climbed five minutes a grant, and the waiter at the head kept the deadline
/// it joined with (such an entry was never lowered) though nobody was ahead of it.
#[tokio::test]
async fn a_hot_queue_of_redisson_shaped_owners_keeps_deadlines_level() {
    let redis = RedisServer::start();
    let server = Latchkey::start_with(&redis.url(), &ARGS).await;
    let client = server.client().await;
    let name = "named-hot";
    let (queue, timeouts) = queue_keys(name);
    let mut holder = client
        .lock(name)
        .kind(LockKind::Fair)
        .owner(random_owner())
        .try_once()
        .acquire()
        .await
        .unwrap();
    let mut line = VecDeque::new();
    for _ in 0..2 {
        line.push_back(holding_fair_waiter(&client, name, Some(&random_owner())).await);
    }
    let mut offsets = Vec::new();
    for _round in 0..6 {
        holder.release().await.unwrap();
        let next = line.pop_front().unwrap();
        holder = tokio::time::timeout(T, next).await.expect("granted in turn").unwrap();
        let named = random_owner();
        line.push_back(holding_fair_waiter(&client, name, Some(&named)).await);
        offsets.push((redis.score(&timeouts, &named) - redis.now_ms()) / 1000);
    }
    // The head, nobody ahead of it, comes back to its own wait at its next refresh.
    let head = redis.list(&queue)[0].clone();
    let back = poll_until(T, || redis.score(&timeouts, &head) - redis.now_ms() <= 2_500).await;
    let head_left = redis.score(&timeouts, &head) - redis.now_ms();
    for task in line {
        task.abort();
        let _ = task.await;
    }
    holder.release().await.unwrap();
    assert_queue_gone(&redis, name).await;
    assert!(back, "the head keeps {head_left} ms with nobody ahead");
    assert!(
        offsets.last().unwrap() - offsets[0] < 120,
        "each named owner joining, s from now: {offsets:?}"
    );
}

/// A server dies with its waiter first in line, a named owner shaped like Redisson's ids
/// that had nobody ahead at its last refreshes: the waiter behind it is granted within
/// the wait timeout (2 s). It had joined five minutes past another such owner and kept
/// that at the head, and the waiter behind it waited five minutes.
#[tokio::test]
async fn a_crashed_servers_redisson_shaped_owner_at_the_head_blocks_only_its_wait_timeout() {
    let redis = RedisServer::start();
    let mut argv = vec!["--redis-url".to_owned(), redis.url(), "--no-metrics".to_owned()];
    argv.extend(ARGS.iter().map(|a| a.to_string()));
    let mut process = LatchkeyProcess::spawn(&argv);
    let server = Latchkey::start_with(&redis.url(), &ARGS).await;
    let client = server.client().await;
    let remote = latchkey_client::Client::connect(&process.endpoint()).await.unwrap();
    let name = "crash-named";
    let (queue, timeouts) = queue_keys(name);
    let holder = client.lock(name).kind(LockKind::Fair).acquire().await.unwrap();
    let first = holding_fair_waiter(&client, name, Some(&random_owner())).await;
    let doomed_owner = random_owner();
    let doomed = holding_fair_waiter(&remote, name, Some(&doomed_owner)).await;
    holder.release().await.unwrap();
    let first = tokio::time::timeout(T, first).await.expect("granted").unwrap();
    let survivor = holding_fair_waiter(&client, name, None).await;
    // The doomed owner is first in line, nobody ahead: its next refresh brings it back.
    assert_eq!(redis.list(&queue)[0], doomed_owner);
    let back = poll_until(T, || redis.score(&timeouts, &doomed_owner) - redis.now_ms() <= 2_500).await;
    assert!(
        back,
        "{} ms out",
        redis.score(&timeouts, &doomed_owner) - redis.now_ms()
    );
    process.kill();
    let killed = Instant::now();
    first.release().await.unwrap();
    let lease = tokio::time::timeout(Duration::from_secs(5), survivor)
        .await
        .expect("the waiter behind the crashed server's owner is granted within its wait timeout")
        .unwrap();
    assert!(killed.elapsed() < Duration::from_millis(3500), "{:?}", killed.elapsed());
    lease.release().await.unwrap();
    doomed.abort();
    let _ = doomed.await;
    assert_queue_gone(&redis, name).await;
}

/// Latchkey waiters of two servers behind a named owner shaped like Redisson's ids and
/// between Redisson waiters: the named owner gives up and the waiter behind it comes
/// back to its own wait while the Redisson waiter behind that keeps its deadline; each
/// Redisson grant (5 min off every deadline) leaves every waiter queued; all are granted
/// in arrival order across both servers, and nothing is left in Redis.
#[tokio::test]
async fn latchkey_waiters_between_redisson_waiters_keep_their_turn() {
    let redis = RedisServer::start();
    let a = Latchkey::start_with(&redis.url(), &ARGS).await;
    let b = Latchkey::start_with(&redis.url(), &ARGS).await;
    let (ca, cb) = (a.client().await, b.client().await);
    let conn = redis_client(&redis.url()).await;
    let name = "between";
    let (queue, timeouts) = queue_keys(name);
    let java = || RedissonFairLock::new(&conn, name, &random_owner()).with_thread_wait(REDISSON_WAIT_MS);
    let holder = java();
    assert_eq!(holder.try_lock(30_000).await, None, "a Redisson client holds");
    let named = holding_fair_waiter(&ca, name, Some(&random_owner())).await;
    let l1 = holding_fair_waiter(&cb, name, None).await;
    let r1 = java();
    assert!(r1.try_lock(30_000).await.is_some());
    let l2 = holding_fair_waiter(&ca, name, None).await;
    let r2 = java();
    assert!(r2.try_lock(30_000).await.is_some());
    let l3 = holding_fair_waiter(&cb, name, None).await;
    let line = redis.list(&queue);
    assert_eq!(line.len(), 6, "{line:?}");
    let d = |o: &str| redis.score(&timeouts, o);
    let now = redis.now_ms();
    // Each latchkey waiter counts a Redisson wait for each such entry ahead of it.
    for (at, ahead) in [(1, 1), (3, 2), (5, 3)] {
        let left = d(&line[at]) - now;
        let counted = REDISSON_WAIT_MS * ahead;
        assert!(
            (counted..counted + 2_500).contains(&left),
            "{}: {left} ms left, {ahead} ahead",
            line[at]
        );
    }
    let r1_before = d(r1.owner());

    // The named owner gives up: those behind it get its wait back; R1 keeps its place.
    named.abort();
    let _ = named.await;
    let lowered = poll_until(T, || d(&line[1]) - redis.now_ms() <= 2_500).await;
    assert!(lowered, "L1 lowered: {} ms out", d(&line[1]) - redis.now_ms());
    assert!(d(r1.owner()) > redis.now_ms() + 60_000, "R1 keeps minutes");
    assert!(
        d(r1.owner()) >= r1_before - REDISSON_WAIT_MS,
        "R1 got one wait back at most"
    );

    let mut granted = Vec::new();
    assert_eq!(holder.unlock().await, Some(true));
    let lease = tokio::time::timeout(T, l1).await.expect("L1 granted").unwrap();
    granted.push(lease.owner().to_owned());
    lease.release().await.unwrap();
    for (r, next) in [(r1, l2), (r2, l3)] {
        redisson_takes(&r).await;
        granted.push(r.owner().to_owned());
        let now = redis.now_ms();
        for owner in redis.list(&queue) {
            let left = d(&owner) - now;
            assert!(
                left > 1_000,
                "{owner} keeps its place after a Redisson grant: {left} ms left"
            );
        }
        // Past a refresh: the latchkey waiter at the head is still in place.
        tokio::time::sleep(Duration::from_millis(800)).await;
        assert_eq!(r.unlock().await, Some(true));
        let lease = tokio::time::timeout(T, next).await.expect("granted in turn").unwrap();
        granted.push(lease.owner().to_owned());
        lease.release().await.unwrap();
    }
    assert_eq!(granted, line[1..], "granted in arrival order");
    assert_queue_gone(&redis, name).await;
}
