//! The Lua catalogue against a real Redis: every SHA equals what `SCRIPT LOAD`
//! returns, scripts reload after `SCRIPT FLUSH`, and mutating scripts are safe to
//! retry (a replayed acquire or release never counts a hold twice).

use fred::prelude::*;
use latchkey_server::keys::Keys;
use latchkey_server::scripts::{Script, Scripts};
use latchkey_tests::server::Latchkey;
use latchkey_tests::{redis_client, RedisServer};

async fn run(client: &Client, script: &Script, keys: Vec<String>, args: Vec<Value>) -> Value {
    let keys = keys.into_iter().map(Key::from).collect();
    script.eval(client, keys, args).await.expect("script runs")
}

#[tokio::test]
async fn every_sha_matches_script_load() {
    let redis = RedisServer::start();
    let client = redis_client(&redis.url()).await;
    for cluster in [false, true] {
        for script in Scripts::new(cluster).all() {
            let sha: String = client.script_load(script.lua()).await.expect("loads");
            assert_eq!(sha, script.sha(), "{}", script.name());
        }
    }
}

#[tokio::test]
async fn scripts_reload_after_a_flush() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    client.lock("a").acquire().await.unwrap().release().await.unwrap();
    redis.cli(&["SCRIPT", "FLUSH"]);
    client
        .lock("a")
        .acquire()
        .await
        .expect("NOSCRIPT is answered by a reload")
        .release()
        .await
        .unwrap();
}

#[tokio::test]
async fn a_replayed_acquire_or_release_counts_once() {
    let redis = RedisServer::start();
    let client = redis_client(&redis.url()).await;
    let scripts = Scripts::new(false);
    let k = Keys::default().lock("replay");
    let acquire = |hold: &str| {
        (
            vec![k.lock.clone(), k.fence(), k.hold(hold), k.queue()],
            vec![Value::from(30_000), Value::from("owner"), Value::from(5_000)],
        )
    };
    let release = |hold: &str| {
        (
            vec![k.lock.clone(), k.channel(), k.hold(hold), k.queue(), k.timeouts()],
            vec![Value::from("owner"), Value::from("publish")],
        )
    };
    let (keys, args) = acquire("h1");
    let first = run(&client, &scripts.mutex_acquire, keys.clone(), args.clone()).await;
    let again = run(&client, &scripts.mutex_acquire, keys, args).await;
    assert_eq!(first, again, "a replayed grant returns the same token and count");
    assert_eq!(redis.cli(&["HGET", "replay", "owner"]).trim(), "1");

    // A second stream of the same owner is a real reentrant hold.
    let (keys, args) = acquire("h2");
    run(&client, &scripts.mutex_acquire, keys, args).await;
    assert_eq!(redis.cli(&["HGET", "replay", "owner"]).trim(), "2");

    let (keys, args) = release("h1");
    assert_eq!(
        run(&client, &scripts.release, keys.clone(), args.clone()).await,
        Value::Integer(1)
    );
    assert_eq!(
        run(&client, &scripts.release, keys, args).await,
        Value::Integer(0),
        "a replayed release gives back nothing"
    );
    assert_eq!(redis.cli(&["HGET", "replay", "owner"]).trim(), "1", "one hold left");
    let (keys, args) = release("h2");
    assert_eq!(run(&client, &scripts.release, keys, args).await, Value::Integer(1));
    assert_eq!(redis.cli(&["EXISTS", "replay"]).trim(), "0");
}

#[tokio::test]
async fn a_replayed_acquire_after_the_lease_ran_out_is_not_a_grant() {
    let redis = RedisServer::start();
    let client = redis_client(&redis.url()).await;
    let scripts = Scripts::new(false);
    let k = Keys::default().lock("late");
    let keys = vec![k.lock.clone(), k.fence(), k.hold("h"), k.queue()];
    let args = vec![Value::from(30_000), Value::from("owner"), Value::from(5_000)];
    run(&client, &scripts.mutex_acquire, keys.clone(), args.clone()).await;
    // The lock expired and another owner took it; the stale hold record must not count.
    redis.cli(&["DEL", "late"]);
    redis.cli(&["HSET", "late", "someone", "1"]);
    let reply = run(&client, &scripts.mutex_acquire, keys, args).await;
    let reply: Vec<i64> = reply.convert().unwrap();
    assert_eq!(reply[0], 0, "busy, not granted: {reply:?}");
    assert_eq!(redis.cli(&["EXISTS", "latchkey_hold:{late}:h"]).trim(), "0");
}
