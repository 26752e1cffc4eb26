//! Interoperation with Redisson on a Redis Cluster: on Redis 7, Redisson publishes its
//! unlock messages with sharded pub/sub (`SPUBLISH`, Redisson 3.23 and newer) and waits
//! with `SSUBSCRIBE`, and latchkey does the same, so each side wakes the other's waiters
//! on the lock's shard within moments of a release, not at the holder's TTL. Shown for
//! the mutex (`RLock`), the fair lock (`RFairLock`, each waiter on its own channel), the
//! read/write lock (`RReadWriteLock`), a latchkey handoff with a Redisson waiter
//! listening (it frees the lock instead of passing it over the Java waiter, also on a
//! mutex latchkey's waiters keep busy), ForceRelease with a Redisson waiter at the
//! head of a fair queue, and a Watch hearing both sides' releases. Every test runs on names served by two different masters of a
//! 3-master cluster, and checks that the side that was woken holds alone.

use fred::prelude::{Client as RedisClient, HashesInterface};
use latchkey_client::{Lease, LockKind, LostReason};
use latchkey_tests::redisson::{
    lock_channel, random_owner, PublishCommand, RedissonFairLock, RedissonLock, RedissonReadLock, RedissonWriteLock,
    Subscription,
};
use latchkey_tests::server::{spawn_queued, watch_until, Latchkey, Waiting};
use latchkey_tests::{bounded, poll_until, redis_client, RedisCluster};
use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::task::JoinHandle;
use tonic::Code;

/// Bound on anything that should happen at all (waits, setup steps).
const T: Duration = Duration::from_secs(10);

/// Bound on a wake-up after the other side's release: far below every holder's TTL
/// (30 s), so a waiter that only rechecks at the TTL fails it.
const PROMPT: Duration = Duration::from_secs(2);

/// The lease the Java side takes, Redisson's default `lockWatchdogTimeout`.
const LEASE_MS: i64 = 30_000;

/// Redisson's publish command on a Redis 7 cluster.
const SHARDED: PublishCommand = PublishCommand::Spublish;

/// latchkey's `--fair-wait-timeout`: its fair waiters refresh their place three times
/// per wait, each refresh a try for the lock, so at the default (5 s) a fair waiter that
/// missed a wake-up would still be granted within [`PROMPT`] by its next refresh. At
/// 30 s (a refresh every 10 s) only the wake-up can grant it so soon.
const FAIR_WAIT_TIMEOUT: &str = "30s";

/// A 3-master cluster, one latchkey server on it (in process, fair waiters refreshing
/// every 10 s, see [`FAIR_WAIT_TIMEOUT`]), a test connection, and two names starting
/// with `prefix` whose slots two different masters serve.
async fn setup(prefix: &str) -> (RedisCluster, Latchkey, RedisClient, Vec<String>) {
    let cluster = RedisCluster::start(3, 0);
    assert_eq!(
        PublishCommand::for_url(&cluster.url()),
        SHARDED,
        "Redisson publishes with SPUBLISH on a cluster"
    );
    let names = names_on_masters(&cluster, prefix, 2);
    let server = start_latchkey(&cluster).await;
    let conn = redis_client(&cluster.url()).await;
    (cluster, server, conn, names)
}

/// A latchkey server on `cluster`, with fair waiters refreshing every 10 s.
async fn start_latchkey(cluster: &RedisCluster) -> Latchkey {
    Latchkey::start_with(&cluster.url(), &["--fair-wait-timeout", FAIR_WAIT_TIMEOUT]).await
}

/// `count` names `<prefix>-<i>`, each on a master none of the others is on.
fn names_on_masters(cluster: &RedisCluster, prefix: &str, count: usize) -> Vec<String> {
    let mut masters = BTreeSet::new();
    let names: Vec<String> = (0..64)
        .map(|i| format!("{prefix}-{i}"))
        .filter(|name| masters.insert(cluster.master_for_key(name)))
        .take(count)
        .collect();
    assert_eq!(names.len(), count, "{count} names on different masters: {names:?}");
    names
}

/// Subscribers of the sharded `channel` on the master serving its slot (`PUBSUB
/// SHARDNUMSUB`).
fn shard_subscribers(cluster: &RedisCluster, channel: &str) -> u32 {
    cluster.node(cluster.master_for_key(channel)).shard_subscribers(channel)
}

/// Waits (bounded) until the sharded `channel` has at least `n` subscribers on its
/// master, so a release published from now on reaches them.
async fn listeners_reach(cluster: &RedisCluster, channel: &str, n: u32) {
    let reached = poll_until(T, || shard_subscribers(cluster, channel) >= n).await;
    assert!(
        reached,
        "{n} sharded subscribers of {channel}; there are {}",
        shard_subscribers(cluster, channel)
    );
}

/// A latchkey waiter's lease, granted within `limit` (of now); panics with `what`
/// otherwise.
async fn granted_within(limit: Duration, waiting: Waiting, what: &str) -> Lease {
    tokio::time::timeout(limit, waiting)
        .await
        .unwrap_or_else(|_| panic!("{what}: not granted within {limit:?}"))
        .expect("waiter task")
        .unwrap_or_else(|err| panic!("{what}: {err}"))
}

/// A Java wait running in a task: whether it acquired, and when it returned.
type JavaWait = JoinHandle<(bool, Instant)>;

/// Runs Redisson's `lock.tryLock(T, LEASE_MS)` waiting loop for `java` in a task.
fn spawn_java_lock(java: &Arc<RedissonLock>) -> JavaWait {
    let java = java.clone();
    tokio::spawn(async move { (java.lock(T, LEASE_MS).await, Instant::now()) })
}

/// Runs Redisson's `fairLock.tryLock(T, LEASE_MS)` waiting loop for `java` in a task.
fn spawn_java_fair_lock(java: &Arc<RedissonFairLock>) -> JavaWait {
    let java = java.clone();
    tokio::spawn(async move { (java.lock(T, LEASE_MS).await, Instant::now()) })
}

/// Asserts that a Java wait acquired within `limit` of `since`.
async fn java_granted_within(limit: Duration, since: Instant, waiting: JavaWait, what: &str) {
    let (acquired, at) = bounded(T, what, waiting).await.expect("Java waiter task");
    assert!(acquired, "{what}: acquired");
    let took = at.duration_since(since);
    assert!(
        took < limit,
        "{what}: granted {took:?} after the release, not within {limit:?}"
    );
}

/// The fields of the lock hash `name` (owner → hold count; `mode` for a read/write lock).
async fn lock_fields(conn: &RedisClient, name: &str) -> HashMap<String, String> {
    conn.hgetall(name)
        .await
        .unwrap_or_else(|err| panic!("HGETALL {name}: {err}"))
}

/// A try-once of `kind` on `name` through latchkey is refused: the lock is held.
async fn latchkey_refused(client: &latchkey_client::Client, name: &str, kind: LockKind, what: &str) {
    let err = client.lock(name).kind(kind).try_once().acquire().await.expect_err(what);
    assert_eq!(err.code(), Code::DeadlineExceeded, "{what}: {err}");
}

/// A Watch on a cluster, on names of two masters: a latchkey holder's release is heard
/// on the sharded watch channel, with the Watch no subscriber of the unlock channel
/// (whose subscribers the release scripts count), and while a Redisson client holds
/// the mutex the Watch subscribes the unlock channel on its shard and hears the
/// `SPUBLISH`ed unlock. Each release is seen under the Watch's 1 s re-read.
#[tokio::test]
async fn cluster_watch_hears_latchkey_and_redisson_releases_by_sharded_pub_sub() {
    let (cluster, server, conn, names) = setup("watched").await;
    let client = server.client().await;
    for name in &names {
        let channel = lock_channel(name);
        let mut watch = client.watch(name.as_str()).await.unwrap();
        watch_until(&mut watch, T, |s| !s.locked).await;
        let lease = client.lock(name.as_str()).acquire().await.unwrap();
        watch_until(&mut watch, T, |s| s.locked).await;
        assert_eq!(
            shard_subscribers(&cluster, &channel),
            0,
            "{name}: the Watch is no listener"
        );
        let at = Instant::now();
        lease.release().await.unwrap();
        watch_until(&mut watch, T, |s| !s.locked).await;
        assert!(
            at.elapsed() < Duration::from_millis(950),
            "{name}: seen after {:?}",
            at.elapsed()
        );

        let java = RedissonLock::new(&conn, name, &random_owner()).with_publish(SHARDED);
        assert_eq!(java.try_lock(LEASE_MS).await, None, "{name}: redisson locks");
        watch_until(&mut watch, T, |s| s.locked).await;
        listeners_reach(&cluster, &channel, 1).await;
        let at = Instant::now();
        java.unlock().await;
        watch_until(&mut watch, T, |s| !s.locked).await;
        assert!(
            at.elapsed() < Duration::from_millis(950),
            "{name}: seen after {:?}",
            at.elapsed()
        );
    }
}

/// Redisson holds an `RLock` → a latchkey mutex waiter, queued with Redisson's holder's
/// TTL, hears Redisson's unlock (`SPUBLISH` of "0" on the lock's shard) and takes the lock
/// within a couple of seconds, not at the end of Redisson's 30 s lease; Redisson is then
/// refused while latchkey holds.
#[tokio::test]
async fn a_latchkey_mutex_waiter_hears_a_redisson_unlock() {
    let (cluster, server, conn, names) = setup("rlock-unlock").await;
    let client = server.client().await;
    for name in &names {
        let java = RedissonLock::new(&conn, name, &random_owner()).with_publish(SHARDED);
        assert_eq!(java.try_lock(LEASE_MS).await, None, "{name}: Redisson takes the lock");
        let (waiting, queued) = spawn_queued(client.lock(name.as_str()).wait(T), T).await;
        let told = queued.holder_ttl.expect("the waiter is told the holder's TTL");
        assert!(told.seconds >= 20, "{name}: Redisson's TTL told: {told:?}");
        listeners_reach(&cluster, &java.channel(), 1).await;
        let mut observer = java.subscribe().await;
        let unlocked = Instant::now();
        assert_eq!(java.unlock().await, Some(true), "{name}: Redisson unlocks");
        assert_eq!(
            observer.next_message(PROMPT).await.as_deref(),
            Some("0"),
            "{name}: Redisson's unlock is published on the shard"
        );
        observer.close().await;
        let lease = granted_within(PROMPT, waiting, "the latchkey waiter").await;
        assert!(unlocked.elapsed() < PROMPT, "{name}: woken by the unlock message");
        assert!(
            java.try_lock(LEASE_MS).await.is_some(),
            "{name}: Redisson is refused while latchkey holds"
        );
        assert_eq!(lock_fields(&conn, name).await.len(), 1, "{name}: one holder");
        lease.release().await.unwrap();
    }
}

/// latchkey holds a mutex → Redisson's own waiting loop (`tryLock(wait, lease)`),
/// refused and listening with `SSUBSCRIBE`, is granted within a couple of seconds of the
/// latchkey release; latchkey is then refused while Redisson holds.
#[tokio::test]
async fn a_redisson_lock_loop_is_granted_promptly_after_a_latchkey_release() {
    let (cluster, server, conn, names) = setup("rlock-loop").await;
    let client = server.client().await;
    for name in &names {
        let lease = client.lock(name.as_str()).acquire().await.unwrap();
        let java = Arc::new(RedissonLock::new(&conn, name, &random_owner()).with_publish(SHARDED));
        let ttl = java.try_lock(LEASE_MS).await.expect("Redisson is refused");
        assert!(ttl > 20_000, "{name}: latchkey's holder's TTL: {ttl}");
        let waiting = spawn_java_lock(&java);
        listeners_reach(&cluster, &java.channel(), 1).await;
        // Past the loop's second try, made once it listens.
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(!waiting.is_finished(), "{name}: the Java waiter waits");
        let released = Instant::now();
        lease.release().await.unwrap();
        java_granted_within(PROMPT, released, waiting, "Redisson's lock loop").await;
        assert_eq!(java.hold_count().await, 1, "{name}: Redisson holds");
        latchkey_refused(
            &client,
            name,
            LockKind::Mutex,
            "latchkey is refused while Redisson holds",
        )
        .await;
        assert_eq!(java.unlock().await, Some(true));
    }
}

/// Redisson holds an `RFairLock` → a latchkey fair waiter, queued in Redisson's queue,
/// hears Redisson's unlock on its own channel (`redisson_lock__channel:{name}:<owner>`,
/// sharded) and takes the lock within a couple of seconds; Redisson's fair lock is then
/// refused.
#[tokio::test]
async fn a_latchkey_fair_waiter_hears_a_redisson_fair_unlock() {
    let (cluster, server, conn, names) = setup("fair-unlock").await;
    let client = server.client().await;
    for name in &names {
        let java = RedissonFairLock::new(&conn, name, &random_owner()).with_publish(SHARDED);
        assert_eq!(
            java.try_lock(LEASE_MS).await,
            None,
            "{name}: Redisson takes the fair lock"
        );
        let fair = client.lock(name.as_str()).kind(LockKind::Fair).wait(T);
        let (waiting, queued) = spawn_queued(fair, T).await;
        assert_eq!(queued.position, 1, "{name}: first in line");
        let queue = java.queue().await;
        assert_eq!(
            queue.len(),
            1,
            "{name}: the latchkey waiter in Redisson's queue: {queue:?}"
        );
        let own_channel = format!("{}:{}", lock_channel(name), queue[0]);
        listeners_reach(&cluster, &own_channel, 1).await;
        let mut observer = Subscription::open(&conn, &own_channel, SHARDED).await;
        let unlocked = Instant::now();
        assert_eq!(java.unlock().await, Some(true), "{name}: Redisson unlocks");
        assert_eq!(
            observer.next_message(PROMPT).await.as_deref(),
            Some("0"),
            "{name}: Redisson wakes the head on its own channel"
        );
        observer.close().await;
        let lease = granted_within(PROMPT, waiting, "the latchkey fair waiter").await;
        assert!(unlocked.elapsed() < PROMPT, "{name}: woken by the unlock message");
        assert_eq!(lease.owner(), queue[0], "{name}: the head queued is granted");
        let other = RedissonFairLock::new(&conn, name, &random_owner()).with_publish(SHARDED);
        assert!(
            !other.try_lock_once(LEASE_MS).await,
            "{name}: Redisson is refused while latchkey holds"
        );
        assert_eq!(lock_fields(&conn, name).await.len(), 1, "{name}: one holder");
        lease.release().await.unwrap();
    }
}

/// latchkey holds a fair lock → a Redisson fair waiter queued behind it (its own
/// waiting loop, listening on its own channel with `SSUBSCRIBE`) is woken by latchkey's
/// release on that channel and granted within a couple of seconds; latchkey is then
/// refused.
#[tokio::test]
async fn a_redisson_fair_waiter_is_woken_by_a_latchkey_release() {
    let (cluster, server, conn, names) = setup("fair-release").await;
    let client = server.client().await;
    for name in &names {
        let lease = client.lock(name.as_str()).kind(LockKind::Fair).acquire().await.unwrap();
        let java = Arc::new(RedissonFairLock::new(&conn, name, &random_owner()).with_publish(SHARDED));
        let mut observer = java.subscribe().await;
        let waiting = spawn_java_fair_lock(&java);
        // The observer and the Java waiter's own subscription, opened once it queued.
        listeners_reach(&cluster, &java.owner_channel(), 2).await;
        let owner = java.owner().to_owned();
        assert_eq!(
            java.queue().await,
            std::slice::from_ref(&owner),
            "{name}: the Java waiter is queued"
        );
        // Past the loop's second try, made once it listens.
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(!waiting.is_finished(), "{name}: the Java waiter waits");
        let released = Instant::now();
        lease.release().await.unwrap();
        assert_eq!(
            observer.next_message(PROMPT).await.as_deref(),
            Some("0"),
            "{name}: latchkey wakes the Java head on its own channel"
        );
        observer.close().await;
        java_granted_within(PROMPT, released, waiting, "Redisson's fair waiter").await;
        let fields = lock_fields(&conn, name).await;
        assert_eq!(
            fields.keys().collect::<Vec<_>>(),
            [&owner],
            "{name}: Redisson alone holds"
        );
        latchkey_refused(
            &client,
            name,
            LockKind::Fair,
            "latchkey is refused while Redisson holds",
        )
        .await;
        assert_eq!(java.unlock().await, Some(true));
    }
}

/// A Redisson writer holds → latchkey readers waiting on two servers hear its unlock
/// ("1", `SPUBLISH`ed on `redisson_rwlock:{name}`) and all take the read lock within a
/// couple of seconds, side by side; Redisson's writer is then refused.
#[tokio::test]
async fn latchkey_readers_are_woken_by_a_redisson_write_unlock() {
    let (cluster, a, conn, names) = setup("rw-java-writer").await;
    let b = start_latchkey(&cluster).await;
    let (ca, cb) = (a.client().await, b.client().await);
    for name in &names {
        let java = RedissonWriteLock::new(&conn, name, &random_owner()).with_publish(SHARDED);
        assert_eq!(java.try_lock(LEASE_MS).await, None, "{name}: Redisson writes");
        let mut readers = Vec::new();
        for client in [&ca, &cb, &ca] {
            let read = client.lock(name.as_str()).kind(LockKind::Read).wait(T);
            readers.push(spawn_queued(read, T).await.0);
        }
        // One subscription per server.
        listeners_reach(&cluster, &java.channel(), 2).await;
        let mut observer = java.subscribe().await;
        let unlocked = Instant::now();
        assert_eq!(java.unlock().await, Some(true), "{name}: Redisson's writer unlocks");
        assert_eq!(
            observer.next_message(PROMPT).await.as_deref(),
            Some("1"),
            "{name}: Redisson publishes \"1\" on the shard"
        );
        observer.close().await;
        let mut leases = Vec::new();
        for reader in readers {
            let left = PROMPT.saturating_sub(unlocked.elapsed());
            leases.push(granted_within(left, reader, "a latchkey reader").await);
        }
        let state = ca.describe(name.as_str()).await.unwrap();
        assert_eq!(state.kind(), LockKind::Read, "{name}: {state:?}");
        assert_eq!(state.holders.len(), 3, "{name}: the readers read together: {state:?}");
        assert!(
            java.try_lock(LEASE_MS).await.is_some(),
            "{name}: Redisson's writer is refused while latchkey reads"
        );
        for lease in leases {
            lease.release().await.unwrap();
        }
    }
}

/// A latchkey writer holds → a Redisson reader's waiting loop, refused and listening on
/// `redisson_rwlock:{name}` with `SSUBSCRIBE`, is granted within a couple of seconds of
/// the latchkey release; latchkey's writers are then refused, its readers share.
#[tokio::test]
async fn a_redisson_reader_is_woken_by_a_latchkey_write_release() {
    let (cluster, server, conn, names) = setup("rw-latchkey-writer").await;
    let client = server.client().await;
    for name in &names {
        let writer = client
            .lock(name.as_str())
            .kind(LockKind::Write)
            .acquire()
            .await
            .unwrap();
        let java = Arc::new(RedissonReadLock::new(&conn, name, &random_owner()).with_publish(SHARDED));
        let ttl = java.try_lock(LEASE_MS).await.expect("Redisson's reader is refused");
        assert!(ttl > 20_000, "{name}: the writer's TTL: {ttl}");
        let waiting: JavaWait = {
            let java = java.clone();
            tokio::spawn(async move { (java.lock(T, LEASE_MS).await, Instant::now()) })
        };
        listeners_reach(&cluster, &java.channel(), 1).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(!waiting.is_finished(), "{name}: the Java reader waits");
        let released = Instant::now();
        writer.release().await.unwrap();
        java_granted_within(PROMPT, released, waiting, "Redisson's reader").await;
        let fields = lock_fields(&conn, name).await;
        assert_eq!(
            fields.get("mode").map(String::as_str),
            Some("read"),
            "{name}: {fields:?}"
        );
        latchkey_refused(&client, name, LockKind::Write, "latchkey's writer is refused").await;
        let reader = client
            .lock(name.as_str())
            .kind(LockKind::Read)
            .try_once()
            .acquire()
            .await
            .expect("latchkey's reader shares with Redisson's");
        reader.release().await.unwrap();
        assert_eq!(java.unlock().await, Some(true));
    }
}

/// Counts the holders of one lock across both sides, to catch a double grant: each
/// holder enters once granted and leaves before it lets go.
#[derive(Debug, Default)]
struct Exclusive(AtomicUsize);

impl Exclusive {
    fn enter(&self, who: &str) {
        let before = self.0.fetch_add(1, Ordering::SeqCst);
        assert_eq!(before, 0, "{who} granted while another holds");
    }

    fn leave(&self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A release by a latchkey holder whose server has waiters of its own does not hand the
/// mutex to them while a Redisson waiter listens on the lock's shard (handoff needs the
/// releasing server to be the only subscriber, counted with `PUBSUB SHARDNUMSUB`): the
/// release frees the lock and `SPUBLISH`es "0", so the Redisson waiter (its own loop)
/// has its chance and is granted within a couple of seconds, however the races with the
/// local waiters go; nobody holds beside anybody.
#[tokio::test]
async fn a_handoff_does_not_pass_over_a_listening_redisson_waiter() {
    const HOLD: Duration = Duration::from_millis(200);
    let (cluster, server, conn, names) = setup("handoff").await;
    let client = server.client().await;
    for name in &names {
        let holders = Arc::new(Exclusive::default());
        let holder = client.lock(name.as_str()).acquire().await.unwrap();
        holders.enter("the first latchkey holder");
        let mut local = Vec::new();
        for i in 0..2 {
            let (waiting, _) = spawn_queued(client.lock(name.as_str()).wait(T), T).await;
            let holders = holders.clone();
            local.push(tokio::spawn(async move {
                let lease = waiting.await.expect("waiter task").expect("a local waiter acquires");
                holders.enter(&format!("local waiter {i}"));
                tokio::time::sleep(HOLD).await;
                holders.leave();
                lease.release().await.expect("released");
            }));
        }
        let java = Arc::new(RedissonLock::new(&conn, name, &random_owner()).with_publish(SHARDED));
        let waiting = {
            let (java, holders, name, conn) = (java.clone(), holders.clone(), name.clone(), conn.clone());
            tokio::spawn(async move {
                let acquired = java.lock(T, LEASE_MS).await;
                let at = Instant::now();
                if acquired {
                    holders.enter("the Redisson waiter");
                    let fields = lock_fields(&conn, &name).await;
                    assert_eq!(fields.len(), 1, "Redisson alone holds: {fields:?}");
                    tokio::time::sleep(HOLD).await;
                    holders.leave();
                    assert_eq!(java.unlock().await, Some(true), "Redisson unlocks");
                }
                (acquired, at)
            })
        };
        // The server's subscription for its waiters, and the Java waiter's.
        listeners_reach(&cluster, &java.channel(), 2).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(!waiting.is_finished(), "{name}: the Java waiter waits");
        let mut observer = java.subscribe().await;
        let released = Instant::now();
        holders.leave();
        holder.release().await.unwrap();
        assert_eq!(
            observer.next_message(PROMPT).await.as_deref(),
            Some("0"),
            "{name}: the release freed the lock with the unlock message, not a handoff"
        );
        observer.close().await;
        // Two local holds at most come first, should the Java waiter lose both races.
        java_granted_within(PROMPT, released, waiting, "the listening Redisson waiter").await;
        for task in local {
            bounded(T, "the local waiters", task).await.expect("local waiter");
        }
        assert!(lock_fields(&conn, name).await.is_empty(), "{name}: free at the end");
    }
}

/// A latchkey mutex kept hot by three waiters of one server (taken and let go again and
/// again, which without another listener goes from holder to waiter without ever being
/// free) does not starve a Redisson waiter that arrives and listens on the lock's shard:
/// it is granted within a couple of seconds while the latchkey waiters go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_latchkey_mutex_does_not_starve_a_listening_redisson_waiter() {
    let (_cluster, server, conn, names) = setup("hot").await;
    let client = server.client().await;
    for name in &names {
        let holders = Arc::new(Exclusive::default());
        let stop = Arc::new(AtomicBool::new(false));
        let cycles = Arc::new(AtomicUsize::new(0));
        let busy: Vec<JoinHandle<()>> = (0..3)
            .map(|i| {
                let (client, stop, cycles, holders) = (client.clone(), stop.clone(), cycles.clone(), holders.clone());
                let name = name.clone();
                tokio::spawn(async move {
                    while !stop.load(Ordering::Relaxed) {
                        let acquire = client.lock(name.as_str()).wait(T).acquire();
                        let lease = bounded(T, "a busy waiter", acquire)
                            .await
                            .expect("a busy waiter acquires");
                        holders.enter(&format!("busy waiter {i}"));
                        tokio::time::sleep(Duration::from_millis(5)).await;
                        cycles.fetch_add(1, Ordering::Relaxed);
                        holders.leave();
                        lease.release().await.expect("a busy waiter releases");
                    }
                })
            })
            .collect();
        let busy_now = poll_until(T, || cycles.load(Ordering::Relaxed) >= 50).await;
        assert!(busy_now, "{name}: the busy waiters make progress");
        let java = RedissonLock::new(&conn, name, &random_owner()).with_publish(SHARDED);
        let arrived = Instant::now();
        let acquired = java.lock(T, LEASE_MS).await;
        let took = arrived.elapsed();
        assert!(acquired, "{name}: the Redisson waiter acquires");
        holders.enter("the Redisson waiter");
        let during = cycles.load(Ordering::Relaxed);
        assert!(
            took < PROMPT,
            "{name}: the Redisson waiter took {took:?} against the busy waiters"
        );
        let fields = lock_fields(&conn, name).await;
        assert_eq!(fields.len(), 1, "{name}: Redisson alone holds: {fields:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(cycles.load(Ordering::Relaxed), during, "{name}: no busy hold meanwhile");
        holders.leave();
        assert_eq!(java.unlock().await, Some(true));
        stop.store(true, Ordering::Relaxed);
        for task in busy {
            bounded(T, "the busy waiters stop", task).await.expect("busy waiter");
        }
    }
}

/// ForceRelease of a fair lock whose queue head is a Redisson waiter (its own loop,
/// listening on its own channel with `SSUBSCRIBE`) wakes that head on its channel, on
/// the lock's shard: it is granted within a couple of seconds, a latchkey holder is
/// told `FORCE_RELEASED`, and a latchkey fair waiter queued behind the Java head does
/// not overtake it but is granted once Redisson unlocks. The lock is held by latchkey
/// on one master, by another Redisson client on the other.
#[tokio::test]
async fn force_release_wakes_a_redisson_fair_head() {
    let (cluster, server, conn, names) = setup("force").await;
    let client = server.client().await;
    for (i, name) in names.iter().enumerate() {
        let by_latchkey = i % 2 == 0;
        let holder = if by_latchkey {
            Some(client.lock(name.as_str()).kind(LockKind::Fair).acquire().await.unwrap())
        } else {
            let java = RedissonFairLock::new(&conn, name, &random_owner()).with_publish(SHARDED);
            assert_eq!(java.try_lock(LEASE_MS).await, None, "{name}: a Redisson client holds");
            None
        };
        let head = Arc::new(RedissonFairLock::new(&conn, name, &random_owner()).with_publish(SHARDED));
        let mut observer = head.subscribe().await;
        let waiting = spawn_java_fair_lock(&head);
        listeners_reach(&cluster, &head.owner_channel(), 2).await;
        let head_owner = head.owner().to_owned();
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(!waiting.is_finished(), "{name}: the Java head waits");
        assert_eq!(
            head.queue().await,
            std::slice::from_ref(&head_owner),
            "{name}: the Java waiter heads the queue"
        );
        let behind = client.lock(name.as_str()).kind(LockKind::Fair).wait(T);
        let (behind, at) = spawn_queued(behind, T).await;
        assert_eq!(
            at.position, 2,
            "{name}: the latchkey waiter queues behind the Java head"
        );

        let broken = Instant::now();
        assert!(client.force_release(name.as_str()).await.unwrap(), "{name}: broken");
        assert_eq!(
            observer.next_message(PROMPT).await.as_deref(),
            Some("0"),
            "{name}: the Java head is woken on its own channel"
        );
        observer.close().await;
        java_granted_within(PROMPT, broken, waiting, "the Redisson fair head").await;
        if let Some(holder) = holder {
            let reason = bounded(PROMPT, "the broken holder is told", holder.lost()).await;
            assert_eq!(reason, LostReason::ForceReleased, "{name}");
        }
        let fields = lock_fields(&conn, name).await;
        assert_eq!(
            fields.keys().collect::<Vec<_>>(),
            [&head_owner],
            "{name}: the Java head alone holds"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(!behind.is_finished(), "{name}: the latchkey waiter waits its turn");
        let unlocked = Instant::now();
        assert_eq!(head.unlock().await, Some(true));
        let lease = granted_within(PROMPT, behind, "the latchkey waiter behind").await;
        assert!(unlocked.elapsed() < PROMPT);
        lease.release().await.unwrap();
    }
}
