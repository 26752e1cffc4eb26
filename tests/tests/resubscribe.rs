//! A waiter that leaves while Redis is down leaves no subscription behind once Redis
//! is back: the server's unsubscribe failed, and the subscriber would otherwise
//! subscribe the channel again when it reconnects, with no waiter to ever drop it.

use latchkey_tests::server::{spawn_queued, Latchkey};
use latchkey_tests::RedisServer;
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
    // The subscriber reconnects (and resubscribes what it still tracks); the server
    // must end up with no lock channel subscribed.
    let deadline = Instant::now() + T;
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let left = lock_channels(&redis);
        if left.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "subscriptions left: {left:?}");
    }
}
