//! Subscriptions a server lets go of. A waiter that leaves while Redis is down leaves
//! no subscription behind once Redis is back: the server's unsubscribe failed, and the
//! subscriber would otherwise subscribe the channel again when it reconnects, with no
//! waiter to ever drop it. Channels whose waiters left one after another go in a few
//! UNSUBSCRIBE commands, not one each. A release published while the subscriber
//! reconnects still wakes its waiter, and waiters coming and going across reconnections
//! leave no subscription.

use latchkey_client::LockKind;
use latchkey_server::keys::Keys;
use latchkey_tests::proxy::Proxy;
use latchkey_tests::redisson::{random_owner, RedissonLock};
use latchkey_tests::server::{spawn_queued, Latchkey};
use latchkey_tests::{bounded, poll_until, redis_client, RedisServer};
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(10);

fn lock_channels(redis: &RedisServer) -> Vec<String> {
    redis
        .cli(&["PUBSUB", "CHANNELS"])
        .lines()
        .filter(|c| c.starts_with("redisson_lock__channel"))
        .map(str::to_owned)
        .collect()
}

#[tokio::test]
async fn a_waiter_gone_while_redis_was_down_leaves_no_subscription() {
    let mut redis = RedisServer::start();
    let server = Latchkey::start_with(&redis.url(), &["--redis-timeout", "300ms"]).await;
    let client = server.client().await;
    let _holder = client.lock("left").acquire().await.unwrap();
    let (waiting, _) = spawn_queued(client.lock("left").wait(T), T).await;
    let deadline = Instant::now() + T;
    while lock_channels(&redis).is_empty() {
        assert!(Instant::now() < deadline, "the waiter never subscribed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    redis.stop();
    // The waiter gives up while its unsubscribe cannot reach Redis.
    waiting.abort();
    tokio::time::sleep(Duration::from_secs(1)).await;
    redis.restart();
    // The subscriber reconnects (and resubscribes what it still tracks): the restarted
    // Redis has no subscription at all until then, so a look before proves nothing.
    let deadline = Instant::now() + T;
    while !redis.cli(&["PUBSUB", "CHANNELS"]).contains("latchkey:force_release") {
        assert!(Instant::now() < deadline, "the server's subscriber never came back");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The server must then end up with no lock channel subscribed.
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let left = lock_channels(&redis);
        if left.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "subscriptions left: {left:?}");
    }
}

/// Every fair waiter has a channel of its own (Redisson's fair unlock publishes to the
/// first waiter's), so a hot fair lock drops one channel per grant. Dropped channels
/// are unsubscribed together, a few times a second, rather than one command each.
#[tokio::test]
async fn channels_left_one_after_another_are_unsubscribed_together() {
    const WAITERS: usize = 20;
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let _holder = client.lock("fair").kind(LockKind::Fair).acquire().await.unwrap();
    let mut waiting = Vec::new();
    for _ in 0..WAITERS {
        let (task, _) = spawn_queued(client.lock("fair").kind(LockKind::Fair).wait(T), T).await;
        waiting.push(task);
    }
    let deadline = Instant::now() + T;
    while lock_channels(&redis).len() < WAITERS {
        assert!(Instant::now() < deadline, "the waiters never subscribed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let before = redis.command_calls("unsubscribe");
    // The waiters give up one after another, over about a tenth of a second (longer on
    // a busy machine: the bound below counts the hub's ticks in it).
    let giving_up = Instant::now();
    for task in waiting {
        task.abort();
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let ticks = giving_up.elapsed().as_millis() / 50;
    let deadline = Instant::now() + T;
    loop {
        let left = lock_channels(&redis);
        if left.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "subscriptions left: {left:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let unsubscribes = redis.command_calls("unsubscribe") - before;
    // One command per 50 ms tick of the hub, and one for the channels left after it.
    let together = (ticks as usize + 2).max(WAITERS / 4);
    assert!(
        unsubscribes <= together && unsubscribes < WAITERS,
        "{unsubscribes} UNSUBSCRIBE commands for {WAITERS} channels left one after another \
         over {ticks} ticks"
    );
}

/// A release published while the waiter's server's subscriber is reconnecting (its
/// connection cut) reaches nobody there; the hub must wake the waiter once the channel
/// is subscribed again, well before the holder's TTL (30 s) recheck.
#[tokio::test]
async fn a_release_during_a_subscriber_reconnect_wakes_the_waiter() {
    let redis = RedisServer::start();
    let proxy = Proxy::to_redis(&redis).await;
    let a = Latchkey::start(&redis.url()).await;
    let b = Latchkey::start(&proxy.redis_url()).await;
    let ca = a.client().await;
    let cb = b.client().await;
    for round in 0..8 {
        let name = format!("cut-{round}");
        let holder = bounded(T, "holder", ca.lock(name.as_str()).acquire()).await.unwrap();
        let (waiting, _) = spawn_queued(cb.lock(name.as_str()).wait(Duration::from_secs(60)), T).await;
        // Let the waiter's subscription settle.
        let channel = latchkey_tests::redisson::lock_channel(&name);
        assert!(poll_until(T, || redis.subscribers(&channel) == 1).await, "subscribed");
        proxy.cut();
        // Vary where the release lands in the reconnect.
        tokio::time::sleep(Duration::from_millis(round * 15)).await;
        bounded(T, "release", holder.release()).await.expect("released");
        let started = Instant::now();
        let granted = tokio::time::timeout(Duration::from_secs(6), waiting)
            .await
            .unwrap_or_else(|_| panic!("round {round}: waiter not granted within 6 s of the release"));
        let lease = granted.expect("task").expect("granted");
        eprintln!("round {round}: granted after {:?}", started.elapsed());
        bounded(T, "release 2", lease.release()).await.expect("released");
    }
}

/// Waiters come and go on many names while the server's Redis connections are cut
/// again and again: once every waiter has left, the server holds no lock channel
/// subscription.
#[tokio::test]
async fn churn_across_reconnects_leaves_no_subscription() {
    let redis = RedisServer::start();
    let proxy = Proxy::to_redis(&redis).await;
    let a = Latchkey::start(&redis.url()).await;
    let b = Latchkey::start_with(&proxy.redis_url(), &["--redis-timeout", "500ms"]).await;
    let ca = a.client().await;
    let cb = b.client().await;
    let mut holders = Vec::new();
    for i in 0..20 {
        holders.push(
            bounded(T, "holder", ca.lock(format!("churn-{i}")).acquire())
                .await
                .unwrap(),
        );
    }
    let mut tasks = Vec::new();
    for round in 0..10u64 {
        for i in 0..20 {
            let lock = cb.lock(format!("churn-{i}")).wait(Duration::from_secs(60));
            tasks.push(tokio::spawn(lock.acquire()));
        }
        tokio::time::sleep(Duration::from_millis(20 + round * 7)).await;
        if round % 2 == 0 {
            proxy.cut();
        }
        tokio::time::sleep(Duration::from_millis(round * 11)).await;
        // Half the waiters give up.
        let keep = tasks.split_off(tasks.len() / 2);
        for t in tasks.drain(..) {
            t.abort();
        }
        tasks = keep;
    }
    for t in tasks.drain(..) {
        t.abort();
    }
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let left = lock_channels(&redis);
        // Server A subscribes nothing but the force channel (its holders don't wait).
        if left.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "subscriptions left: {left:?}");
    }
    drop(holders);
}

/// One channel Redis refuses to subscribe (an ACL without it) holds back no other on a
/// standalone Redis either. Redis refuses a whole SUBSCRIBE for one channel it refuses,
/// and the refused channel, tried again with every channel added meanwhile, kept every
/// later one from being subscribed as long as its waiter waited: no waiter that came
/// meanwhile was told it listened, and each looked again in Redis every second.
#[tokio::test]
async fn a_refused_channel_holds_back_no_other_waiters_subscription() {
    let redis = RedisServer::start();
    // Every channel of latchkey's own, and the unlock channels of the names `ok*`.
    let acl = [
        "ACL",
        "SETUSER",
        "default",
        "resetchannels",
        "&latchkey*",
        "&redisson_lock__channel:{ok*",
    ];
    assert_eq!(redis.cli(&acl).trim(), "OK");
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    // Held elsewhere (a Redisson client), so that the waiters listen.
    let conn = redis_client(&redis.url()).await;
    let ok = RedissonLock::new(&conn, "ok0", &random_owner());
    assert_eq!(ok.try_lock(60_000).await, None, "redisson locks ok0");
    let refused_holder = RedissonLock::new(&conn, "refused", &random_owner());
    assert_eq!(refused_holder.try_lock(60_000).await, None, "redisson locks refused");
    let (refused, _) = spawn_queued(client.lock("refused").wait(Duration::from_secs(60)), T).await;
    let (waiting, _) = spawn_queued(client.lock("ok0").wait(Duration::from_secs(60)), T).await;
    let channel = Keys::default().lock("ok0").channel();
    assert!(
        poll_until(T, || redis.subscribers(&channel) == 1).await,
        "the other waiter listens while the refused one waits"
    );
    assert_eq!(ok.unlock().await, Some(true), "redisson unlocks ok0");
    let lease = tokio::time::timeout(T, waiting)
        .await
        .expect("granted")
        .unwrap()
        .expect("granted");
    lease.release().await.unwrap();
    refused.abort();
}
