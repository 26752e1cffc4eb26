//! Tests of the harness itself against real processes: standalone, replica, sentinel and
//! cluster Redis, and the Redisson driver's lock protocol.

use fred::prelude::*;
use latchkey_tests::process::{self, raw_command, redis_answers, WaitError};
use latchkey_tests::redisson::{
    random_owner, PublishCommand, RedissonFairLock, RedissonLock, RedissonReadLock, RedissonWriteLock,
    READ_UNLOCK_MESSAGE, UNLOCK_MESSAGE,
};
use latchkey_tests::{redis_client, LatchkeyProcess, RedisCluster, RedisSentinel, RedisServer};
use std::process::Command;
use std::time::{Duration, Instant};

/// Lease used by the Redisson tests: long enough never to expire during a test.
const LEASE_MS: i64 = 30_000;
/// Bound on waiting for one pub/sub message.
const MESSAGE_TIMEOUT: Duration = Duration::from_secs(5);

fn pid_alive(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| stat.contains(") Z "))
}

#[tokio::test]
async fn standalone_starts_stops_and_restarts_empty_on_the_same_port() {
    let mut redis = RedisServer::start();
    let port = redis.port();
    assert_eq!(redis.url(), format!("redis://127.0.0.1:{port}"));
    let client = redis_client(&redis.url()).await;
    let _: () = client.set("k", "v", None, None, false).await.unwrap();
    let value: Option<String> = client.get("k").await.unwrap();
    assert_eq!(value.as_deref(), Some("v"));
    client.quit().await.unwrap();

    let pid = redis.pid().expect("running");
    redis.stop();
    assert!(redis.pid().is_none());
    assert!(!pid_alive(pid), "redis-server {pid} still alive after stop()");
    assert!(!redis_answers(port));

    redis.restart();
    assert_eq!(redis.port(), port);
    assert_ne!(redis.pid(), Some(pid));
    let client = redis_client(&redis.url()).await;
    let value: Option<String> = client.get("k").await.unwrap();
    assert_eq!(value, None, "nothing is persisted across a restart");
}

#[test]
fn drop_kills_the_process() {
    let redis = RedisServer::start();
    let pid = redis.pid().expect("running");
    let port = redis.port();
    drop(redis);
    assert!(!pid_alive(pid), "redis-server {pid} survived Drop");
    assert!(!redis_answers(port));
}

/// Two tests may be handed one free port; the server that loses it must not take the
/// winner, which answers there, for itself.
#[test]
fn a_redis_that_lost_its_port_is_not_taken_for_the_one_answering_there() {
    let winner = RedisServer::start();
    let loser = RedisServer::try_start_on(winner.port(), &[]);
    assert_eq!(loser.err(), Some(WaitError::Exited));
    assert_eq!(winner.cli(&["PING"]).trim(), "PONG");
}

/// A port of its own other than the main one (here a cluster bus port) that another
/// process took is picked again on the next attempt, not given again.
#[test]
fn a_taken_port_among_a_servers_arguments_is_picked_again() {
    let holder = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a port");
    let taken = holder.local_addr().expect("its address").port().to_string();
    let mut attempts = 0;
    let redis = RedisServer::start_with_fresh(|| {
        attempts += 1;
        let bus = if attempts == 1 {
            taken.clone()
        } else {
            process::free_port().to_string()
        };
        ["--cluster-enabled", "yes", "--cluster-port", &bus]
            .map(str::to_owned)
            .to_vec()
    });
    assert_eq!(attempts, 2, "one attempt on the taken port, one on a fresh one");
    assert_ne!(redis.arg("--cluster-port"), Some(taken.as_str()));
    assert_eq!(redis.cli(&["PING"]).trim(), "PONG");
}

/// Nor is a latchkey server that lost its port taken for what answers there.
#[test]
fn a_latchkey_server_that_lost_its_port_is_not_taken_for_what_answers_there() {
    let redis = RedisServer::start();
    let args = ["--no-metrics".to_owned(), "--redis-url".to_owned(), redis.url()];
    let loser = LatchkeyProcess::try_spawn_on(redis.port(), &args);
    assert_eq!(loser.err(), Some(WaitError::Exited));
}

/// A command the harness runs that does not end is killed at its bound, and the test
/// fails naming it, instead of hanging.
#[test]
fn a_command_past_its_bound_is_killed_and_named() {
    let started = Instant::now();
    let run = std::panic::catch_unwind(|| {
        process::output_within(Command::new("sleep").arg("30"), Duration::from_millis(300))
    });
    let message = run
        .expect_err("the bound ends it")
        .downcast::<String>()
        .expect("a message");
    assert!(message.contains("sleep") && message.contains("still ran"), "{message}");
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[tokio::test]
async fn start_with_passes_extra_config() {
    let redis = RedisServer::start_with(&["--requirepass", "s3cret"]);
    assert_eq!(redis.password(), Some("s3cret"));
    let reply = raw_command(redis.port(), "PING").expect("an answer");
    assert!(reply.starts_with("-NOAUTH"), "PING without AUTH answered {reply}");
    let client = redis_client(&redis.url_with_password()).await;
    let pong: String = client.ping(None).await.unwrap();
    assert_eq!(pong, "PONG");

    let master = RedisServer::start();
    let replica = RedisServer::start_with(&["--replicaof", "127.0.0.1", &master.port().to_string()]);
    let writer = redis_client(&master.url()).await;
    let _: () = writer.set("replicated", "yes", None, None, false).await.unwrap();
    let reader = redis_client(&replica.url()).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let value: Option<String> = reader.get("replicated").await.unwrap();
        if value.as_deref() == Some("yes") {
            break;
        }
        assert!(Instant::now() < deadline, "the replica never received the write");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn sentinel_serves_the_master() {
    let sentinel = RedisSentinel::start();
    assert!(sentinel.url().ends_with("?sentinelServiceName=mymaster"));
    let client = redis_client(&sentinel.url()).await;
    let _: () = client.set("via-sentinel", "1", None, None, false).await.unwrap();
    let value: Option<String> = client.get("via-sentinel").await.unwrap();
    assert_eq!(value.as_deref(), Some("1"));
}

#[tokio::test]
async fn cluster_of_three_masters_forms_and_routes_sharded_unlocks() {
    let cluster = RedisCluster::start(3, 0);
    assert_eq!(cluster.master_ports().len(), 3);
    assert!(cluster.replica_ports().is_empty());
    assert!(cluster.url().starts_with("redis-cluster://127.0.0.1:"));

    let client = redis_client(&cluster.url()).await;
    for i in 0..30 {
        let _: () = client.set(format!("key-{i}"), i, None, None, false).await.unwrap();
    }
    let mut owners: Vec<u16> = (0..30).map(|i| cluster.master_for_key(&format!("key-{i}"))).collect();
    owners.sort_unstable();
    owners.dedup();
    assert_eq!(owners.len(), 3, "30 keys should spread over all 3 masters");

    // Redisson on a Redis 7 cluster publishes unlocks with SPUBLISH.
    let publish = PublishCommand::for_url(&cluster.url());
    assert_eq!(publish, PublishCommand::Spublish);
    let lock = RedissonLock::new(&client, "orders", &random_owner()).with_publish(publish);
    let mut sub = lock.subscribe().await;
    assert_eq!(lock.try_lock(LEASE_MS).await, None);
    assert_eq!(lock.unlock().await, Some(true));
    assert_eq!(sub.next_message(MESSAGE_TIMEOUT).await.as_deref(), Some(UNLOCK_MESSAGE));
    sub.close().await;
}

#[tokio::test]
async fn cluster_with_replicas_forms_and_fails_over() {
    let mut cluster = RedisCluster::start(3, 1);
    assert_eq!(cluster.master_ports().len(), 3);
    assert_eq!(cluster.replica_ports().len(), 3);

    let client = redis_client(&cluster.url()).await;
    let _: () = client.set("failover-key", "before", None, None, false).await.unwrap();
    let old_master = cluster.master_for_key("failover-key");
    let replica = cluster.replicas_of(old_master)[0];
    // WAIT so the write is on the replica before it takes over.
    let acked: i64 = client
        .custom(
            fred::types::CustomCommand::new_static(
                "WAIT",
                fred::types::ClusterHash::Custom(fred::util::redis_keyslot(b"failover-key")),
                false,
            ),
            vec!["1", "2000"],
        )
        .await
        .unwrap();
    assert_eq!(acked, 1);

    cluster.failover(replica);
    assert_eq!(cluster.master_for_key("failover-key"), replica);
    assert!(cluster.replicas_of(replica).contains(&old_master));
    let value: Option<String> = client.get("failover-key").await.unwrap();
    assert_eq!(value.as_deref(), Some("before"));

    // Killing the new master makes the cluster promote the old one back on its own.
    cluster.kill_node(replica);
    cluster.wait_settled("promote a replica after a kill");
    assert_eq!(cluster.master_for_key("failover-key"), old_master);
    assert!(!cluster.master_ports().contains(&replica));
}

#[tokio::test]
async fn redisson_owners_exclude_each_other_and_reenter() {
    let redis = RedisServer::start();
    let client = redis_client(&redis.url()).await;
    let a = RedissonLock::new(&client, "orders", &random_owner());
    let b = RedissonLock::new(&client, "orders", &random_owner());

    assert_eq!(a.try_lock(LEASE_MS).await, None);
    let ttl = b.try_lock(LEASE_MS).await.expect("b is refused while a holds");
    assert!(ttl > 0 && ttl <= LEASE_MS, "pttl {ttl}");
    assert_eq!(b.unlock().await, None, "b holds nothing");

    assert_eq!(a.try_lock(LEASE_MS).await, None, "a re-enters");
    assert_eq!(a.hold_count().await, 2);
    let fields: std::collections::HashMap<String, i64> = client.hgetall("orders").await.unwrap();
    assert_eq!(
        fields.get(a.owner()),
        Some(&2),
        "Redisson's hash layout: owner -> holds"
    );
    assert_eq!(a.unlock().await, Some(false));
    assert!(b.try_lock(LEASE_MS).await.is_some(), "one hold left");
    assert_eq!(a.unlock().await, Some(true));
    assert_eq!(b.try_lock(LEASE_MS).await, None);

    assert!(b.renew(LEASE_MS).await);
    assert!(!a.renew(LEASE_MS).await);
    assert!(a.force_unlock().await);
    assert!(!b.renew(LEASE_MS).await, "force_unlock removed b's lock");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redisson_unlock_publishes_zero_and_wakes_a_waiter() {
    let redis = RedisServer::start();
    let client = redis_client(&redis.url()).await;
    let a = RedissonLock::new(&client, "jobs", &random_owner());
    assert_eq!(a.channel(), "redisson_lock__channel:{jobs}");
    let mut sub = a.subscribe().await;
    assert_eq!(a.try_lock(LEASE_MS).await, None);

    let b = RedissonLock::new(&client, "jobs", &random_owner());
    let started = Instant::now();
    let waiter = tokio::spawn(async move { b.lock(Duration::from_secs(10), LEASE_MS).await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(a.unlock().await, Some(true));
    assert_eq!(sub.next_message(MESSAGE_TIMEOUT).await.as_deref(), Some(UNLOCK_MESSAGE));
    assert!(waiter.await.unwrap(), "the waiter took the lock");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "woken by the message, not the lease"
    );

    let c = RedissonLock::new(&client, "{tagged}:jobs", &random_owner());
    assert_eq!(c.channel(), "redisson_lock__channel:{tagged}:jobs");
    sub.close().await;
}

#[tokio::test]
async fn redisson_fair_lock_queues_and_wakes_the_head() {
    let redis = RedisServer::start();
    let client = redis_client(&redis.url()).await;
    let a = RedissonFairLock::new(&client, "fair", &random_owner());
    let b = RedissonFairLock::new(&client, "fair", &random_owner());
    assert_eq!(b.queue_name(), "redisson_lock_queue:{fair}");
    assert_eq!(b.timeout_set_name(), "redisson_lock_timeout:{fair}");

    assert_eq!(a.try_lock(LEASE_MS).await, None);
    assert!(
        !b.try_lock_once(LEASE_MS).await,
        "tryLock() is refused and does not queue"
    );
    assert!(b.queue().await.is_empty());
    assert!(b.try_lock(LEASE_MS).await.is_some());
    assert_eq!(b.queue().await, vec![b.owner().to_owned()]);

    let mut sub = b.subscribe().await;
    assert_eq!(a.unlock().await, Some(true));
    assert_eq!(sub.next_message(MESSAGE_TIMEOUT).await.as_deref(), Some(UNLOCK_MESSAGE));
    assert_eq!(b.try_lock(LEASE_MS).await, None);
    assert!(b.queue().await.is_empty());
    sub.close().await;
}

#[tokio::test]
async fn redisson_read_write_lock_shares_reads_and_excludes_writes() {
    let redis = RedisServer::start();
    let client = redis_client(&redis.url()).await;
    let (r1_owner, r2_owner) = (random_owner(), random_owner());
    let r1 = RedissonReadLock::new(&client, "doc", &r1_owner);
    let r2 = RedissonReadLock::new(&client, "doc", &r2_owner);
    let w = RedissonWriteLock::new(&client, "doc", &random_owner());
    assert_eq!(r1.timeout_prefix(), format!("{{doc}}:{r1_owner}:rwlock_timeout"));

    assert_eq!(r1.try_lock(LEASE_MS).await, None);
    assert_eq!(r2.try_lock(LEASE_MS).await, None);
    let mode: Option<String> = client.hget("doc", "mode").await.unwrap();
    assert_eq!(mode.as_deref(), Some("read"));
    let timeout_key: i64 = client.exists(format!("{}:1", r1.timeout_prefix())).await.unwrap();
    assert_eq!(timeout_key, 1);
    assert!(w.try_lock(LEASE_MS).await.is_some(), "readers exclude the writer");
    assert!(r1.renew(LEASE_MS).await);

    let mut sub = w.subscribe().await;
    assert_eq!(r1.unlock().await, Some(false), "r2 still reads");
    assert_eq!(r2.unlock().await, Some(true));
    assert_eq!(sub.next_message(MESSAGE_TIMEOUT).await.as_deref(), Some(UNLOCK_MESSAGE));

    assert_eq!(w.try_lock(LEASE_MS).await, None);
    let field: Option<i64> = client.hget("doc", w.field()).await.unwrap();
    assert_eq!(field, Some(1));
    assert!(r1.try_lock(LEASE_MS).await.is_some(), "the writer excludes readers");
    assert_eq!(w.unlock().await, Some(true));
    assert_eq!(
        sub.next_message(MESSAGE_TIMEOUT).await.as_deref(),
        Some(READ_UNLOCK_MESSAGE)
    );
    sub.close().await;
}
