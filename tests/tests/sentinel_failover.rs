//! Latchkey behind Redis Sentinel through a real failover: a master, a replica (which
//! replicates through a loopback proxy, so a grant can be left unreplicated) and one
//! sentinel (quorum 1, `down-after-milliseconds 1000`). The master is SIGKILLed, or
//! frozen with SIGSTOP (a partition, a VM pause) and woken after the promotion while it
//! still believes it is the master. The server follows the promoted replica with every
//! connection (pool, subscriber, the ForceRelease connection): replicated leases are
//! kept, unreplicated ones are reported lost, fencing tokens keep rising, waiters are
//! woken, and no lock is ever granted twice.

use latchkey_client::{Client, Lease, LostReason};
use latchkey_tests::process::redis_cli;
use latchkey_tests::proxy::Proxy;
use latchkey_tests::redis::info_field;
use latchkey_tests::sentinel::SENTINEL_SERVICE_NAME;
use latchkey_tests::server::{spawn_queued, Grants, Latchkey};
use latchkey_tests::{bounded, poll_until, RedisSentinel, RedisServer};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tonic::Code;
use tonic_health::pb::health_check_response::ServingStatus;

/// The bound of a step that waits on the failover.
const T: Duration = Duration::from_secs(30);

/// A master, a replica of it (replicating through `link`) and one sentinel watching
/// them. Drop stops every process.
struct Failover {
    /// The sentinel, and the master it watched first.
    sentinel: RedisSentinel,
    replica: RedisServer,
    /// The replica's replication link to the master.
    link: Proxy,
}

impl Failover {
    /// Starts the three and waits until the replica is online and the sentinel knows it.
    async fn start() -> Failover {
        let master = RedisServer::start();
        let link = Proxy::to_redis(&master).await;
        let link_port = link.addr().rsplit(':').next().expect("host:port").to_owned();
        let replica = RedisServer::start_with(&["--replicaof", "127.0.0.1", &link_port.to_string()]);
        let online = poll_until(Duration::from_secs(10), || {
            master.cli(&["INFO", "replication"]).contains("state=online")
        })
        .await;
        assert!(online, "the replica never came online:\n{}", replica.log_tail());
        let sentinel = RedisSentinel::watching(master, Duration::from_secs(1), Duration::from_secs(60));
        let replica_port = replica.port().to_string();
        let ready = poll_until(Duration::from_secs(20), || {
            let out = redis_cli(
                sentinel.sentinel_port(),
                None,
                &["SENTINEL", "replicas", SENTINEL_SERVICE_NAME],
            );
            let lines: Vec<&str> = out.lines().map(str::trim).collect();
            lines.contains(&replica_port.as_str()) && lines.contains(&"slave")
        })
        .await;
        assert!(ready, "the sentinel never saw the replica:\n{}", sentinel.log_tail());
        Failover {
            sentinel,
            replica,
            link,
        }
    }

    /// The master the sentinel watched first (the old master after a failover).
    fn master(&mut self) -> &mut RedisServer {
        self.sentinel.master()
    }

    /// `redis-sentinel://127.0.0.1:SPORT?sentinelServiceName=mymaster`.
    fn url(&self) -> String {
        self.sentinel.url()
    }

    /// Waits until everything the master wrote so far is on the replica: its replication
    /// offset reaches the master's. (`WAIT` would not do: it waits for the writes of
    /// its own connection only, none here, and answers at once.)
    async fn replicated(&mut self) {
        let written = offset(self.master(), "master_repl_offset");
        let on_replica = || offset(&self.replica, "slave_repl_offset");
        let caught_up = poll_until(Duration::from_secs(10), || on_replica() >= written).await;
        assert!(
            caught_up,
            "the replica is at offset {} of the master's {written}\n{}",
            on_replica(),
            self.logs()
        );
    }

    /// The replica's and the sentinel's last log lines, for a failure's message.
    fn logs(&self) -> String {
        format!(
            "replica's log:\n{}\nsentinel's log:\n{}",
            self.replica.log_tail(),
            self.sentinel.log_tail()
        )
    }

    /// SIGKILLs the master and waits until the sentinel promoted the replica.
    async fn kill_master_and_fail_over(&mut self) {
        self.master().stop();
        self.promoted().await;
    }

    /// Freezes the master (SIGSTOP) and waits until the sentinel promoted the replica,
    /// then for the connection attempts that asked Sentinel before the promotion to
    /// end (each within the 500 ms Redis timeout): one still waiting on the frozen
    /// master's handshake when it wakes connects to it, a moment the README leaves to
    /// `min-replicas-to-write`. The old master stays frozen until
    /// [`RedisServer::resume`].
    async fn freeze_master_and_fail_over(&mut self) {
        self.master().freeze();
        self.promoted().await;
        tokio::time::sleep(Duration::from_secs(1)).await;
    }

    /// Waits until the sentinel reports the replica as the master and it acts as one.
    async fn promoted(&self) {
        let replica_port = self.replica.port();
        let promoted = poll_until(T, || {
            self.sentinel.master_port() == Some(replica_port)
                && self.replica.cli(&["ROLE"]).lines().next().map(str::trim) == Some("master")
        })
        .await;
        assert!(
            promoted,
            "the sentinel promoted no replica:\n{}",
            self.sentinel.log_tail()
        );
    }
}

/// The replication offset `field` of `redis`'s `INFO replication` (0 when it has none).
fn offset(redis: &RedisServer, field: &str) -> u64 {
    let info = redis.cli(&["INFO", "replication"]);
    info_field(&info, field).and_then(|v| v.parse().ok()).unwrap_or(0)
}

/// Server flags: a 500 ms Redis timeout and a 10 s watchdog lease (renewed every 3.3 s).
fn args<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    let mut a = vec!["--redis-timeout", "500ms", "--watchdog-timeout", "10s"];
    a.extend_from_slice(extra);
    a
}

/// Takes `name` at once and releases it (a connection connected and used).
async fn take_and_release(client: &Client, name: impl Into<String>) {
    let lease = client.lock(name).try_once().acquire().await.expect("granted");
    lease.release().await.expect("released");
}

/// Waits until the server answers a Describe of `name` (its pool reached the new
/// master after a frozen-master failover); panics after [`T`].
async fn pool_moved(client: &Client, name: &str) {
    let moved = Instant::now();
    while client.describe(name).await.is_err() {
        assert!(moved.elapsed() < T, "the server never reached the new master");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Releases `holder` of `name` after a frozen master's failover and return: its hold,
/// replicated, is on the new master before, and gone from there after. A release sent
/// again on a connection made again (the first run's answer lost) finds the hold gone
/// and errs on the safe side: told `lost`, as the README says.
async fn release_after_failover(f: &Failover, holder: Lease, name: &str) {
    let owner = holder.owner().to_owned();
    let on_new = || f.replica.cli(&["HEXISTS", name, &owner]).trim() == "1";
    assert!(
        on_new(),
        "the replicated hold is not on the new master: {:?}\n{}",
        f.replica.cli(&["HGETALL", name]).trim(),
        f.logs()
    );
    let told = match holder.release().await {
        Ok(()) => "released",
        Err(latchkey_client::Error::Lost(LostReason::NotHeld)) => "lost",
        Err(e) => panic!("release of `{name}`: {e}"),
    };
    assert!(
        !on_new(),
        "told {told}, but the hold stays on the new master: {:?}",
        f.replica.cli(&["HGETALL", name]).trim()
    );
}

/// Waits, at most `limit`, until `name` is free; returns whether it became free.
async fn until_free(client: &Client, name: &str, limit: Duration) -> bool {
    let started = Instant::now();
    loop {
        if client.describe(name).await.is_ok_and(|state| !state.locked) {
            return true;
        }
        if started.elapsed() > limit {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A watchdog lease whose grant replicated is kept on the new master after the old one
/// is killed: renewed there, exclusive, released there, and the next grant's fencing
/// token is higher.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicated_lease_is_kept_and_renewed_across_failover() {
    let mut f = Failover::start().await;
    let server = Latchkey::start_with(&f.url(), &args(&[])).await;
    let client = server.client().await;
    let lease = client.lock("kept").acquire().await.unwrap();
    let token = lease.fencing_token();
    f.replicated().await;
    f.kill_master_and_fail_over().await;
    // Two watchdog periods (3.3 s each) on the new master.
    tokio::time::sleep(Duration::from_secs(8)).await;
    assert!(
        !lease.is_lost(),
        "a replicated lease was lost: {:?}",
        lease.lost_reason()
    );
    let pttl: i64 = f.replica.cli(&["PTTL", "kept"]).trim().parse().unwrap();
    assert!(pttl > 5000, "renewed on the new master: pttl {pttl}");
    let other = client.lock("kept").try_once().acquire().await;
    assert!(other.is_err(), "a second holder was granted");
    let state = client.describe("kept").await.unwrap();
    assert_eq!(state.holders.len(), 1, "{state:?}");
    assert_eq!(state.holders[0].owner, lease.owner());
    lease.release().await.expect("release on the new master");
    let next = client.lock("kept").try_once().acquire().await.unwrap();
    assert!(next.fencing_token() > token, "{} then {}", token, next.fencing_token());
}

/// A grant that never reached the replica (its replication link frozen) is gone after
/// the failover: its holder is told `lost{NOT_HELD}` promptly, the lock is granted
/// again, and the new grant's fencing token is above the lost one's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreplicated_grant_is_reported_lost_and_tokens_keep_rising() {
    let mut f = Failover::start().await;
    let server = Latchkey::start_with(&f.url(), &args(&[])).await;
    let client = server.client().await;
    // A replicated grant first, so the new master has a fence to go on from.
    take_and_release(&client, "gone").await;
    f.replicated().await;
    f.link.freeze();
    let first = client.lock("gone").acquire().await.unwrap();
    let token = first.fencing_token();
    f.kill_master_and_fail_over().await;
    assert_eq!(
        f.replica.cli(&["EXISTS", "gone"]).trim(),
        "0",
        "the grant did not replicate"
    );
    let reason = bounded(Duration::from_secs(10), "the lost notice", first.lost()).await;
    assert_eq!(reason, LostReason::NotHeld);
    let second = bounded(T, "the second grant", client.lock("gone").wait(T).acquire())
        .await
        .unwrap();
    assert!(
        second.fencing_token() > token,
        "the fencing token went back: {} then {}",
        token,
        second.fencing_token()
    );
}

/// Four tasks take one lock in turn while the master is killed: no two hold it at once
/// (a shared flag), fencing tokens rise in grant order, and grants resume after the
/// failover.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_under_steady_load_has_no_overlap() {
    let mut f = Failover::start().await;
    let server = Latchkey::start_with(&f.url(), &args(&[])).await;
    let client = server.client().await;
    let busy = Arc::new(AtomicBool::new(false));
    let overlaps = Arc::new(AtomicUsize::new(0));
    let grants = Grants::default();
    let done = Arc::new(AtomicBool::new(false));
    let granted = Arc::new(AtomicUsize::new(0));
    let errors = Arc::new(Mutex::new(Vec::<String>::new()));
    let mut tasks = Vec::new();
    for t in 0..4 {
        let (client, busy, overlaps, grants, done, granted, errors) = (
            client.clone(),
            busy.clone(),
            overlaps.clone(),
            grants.clone(),
            done.clone(),
            granted.clone(),
            errors.clone(),
        );
        tasks.push(tokio::spawn(async move {
            while !done.load(Ordering::SeqCst) {
                match client.lock("hot").wait(Duration::from_secs(20)).acquire().await {
                    Ok(lease) => {
                        if busy.swap(true, Ordering::SeqCst) {
                            overlaps.fetch_add(1, Ordering::SeqCst);
                        }
                        grants.record(lease.fencing_token(), format!("task {t}"));
                        granted.fetch_add(1, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(5)).await;
                        let lost = lease.lost_reason();
                        busy.store(false, Ordering::SeqCst);
                        if let Err(e) = lease.release().await {
                            errors
                                .lock()
                                .unwrap()
                                .push(format!("release: {e} (lost before: {lost:?})"));
                        }
                    }
                    Err(e) => {
                        errors.lock().unwrap().push(format!("acquire: {:?} {e}", e.code()));
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            }
        }));
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before = granted.load(Ordering::SeqCst);
    assert!(before > 10, "the load runs: {before} grants in 2 s");
    f.kill_master_and_fail_over().await;
    let at_failover = granted.load(Ordering::SeqCst);
    let resumed = poll_until(Duration::from_secs(20), || {
        granted.load(Ordering::SeqCst) > at_failover + 20
    })
    .await;
    done.store(true, Ordering::SeqCst);
    for task in tasks {
        bounded(T, "a load task", task).await.unwrap();
    }
    let errors = errors.lock().unwrap().clone();
    assert!(
        resumed,
        "the load did not resume after the failover ({before} grants before it, {} in all); errors: {errors:#?}",
        granted.load(Ordering::SeqCst)
    );
    assert_eq!(
        overlaps.load(Ordering::SeqCst),
        0,
        "two holders at once; errors: {errors:#?}"
    );
    grants.assert_increasing();
}

/// With the master frozen rather than killed, acquires fail promptly with UNAVAILABLE
/// during the outage (health NOT_SERVING), work again within 3 s of the sentinel's
/// promotion, and health says SERVING within 3 s of that. The first lease granted after
/// the promotion is given back even when its release meets a connection still moving
/// (UNAVAILABLE: the server releases in the background).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquires_recover_after_a_frozen_master_failover() {
    let mut f = Failover::start().await;
    let server = Latchkey::start_with(&f.url(), &args(&[])).await;
    let client = server.client().await;
    take_and_release(&client, "before").await;
    let frozen = Instant::now();
    f.master().freeze();
    let replica_port = f.replica.port();
    let mut promoted_at = None;
    let mut timeline = Vec::new();
    let mut not_serving_seen = false;
    let mut first = None;
    let mut i = 0;
    while first.is_none() {
        assert!(
            frozen.elapsed() < Duration::from_secs(40),
            "acquires never came back within 40 s of the freeze; timeline:\n{}\nsentinel:\n{}",
            timeline.join("\n"),
            f.sentinel.log_tail()
        );
        i += 1;
        if promoted_at.is_none() && f.sentinel.master_port() == Some(replica_port) {
            promoted_at = Some(frozen.elapsed());
            timeline.push(format!("{:?}: promoted", frozen.elapsed()));
        }
        let name = format!("during-{i}");
        let started = Instant::now();
        let attempt = tokio::time::timeout(Duration::from_secs(10), client.lock(&name).try_once().acquire()).await;
        let (at, took) = (started - frozen, started.elapsed());
        match attempt {
            Err(_) => panic!(
                "attempt {i} hung 10 s ({at:?} after the freeze); timeline:\n{}",
                timeline.join("\n")
            ),
            Ok(Ok(lease)) => {
                timeline.push(format!("{at:?}: granted in {took:?}"));
                first = Some((name, lease, frozen.elapsed()));
            }
            Ok(Err(e)) => {
                timeline.push(format!("{at:?}: {:?} {e} in {took:?}", e.code()));
                assert_eq!(e.code(), Code::Unavailable, "timeline:\n{}", timeline.join("\n"));
                assert!(
                    took < Duration::from_secs(3),
                    "a failed acquire took {took:?}; timeline:\n{}",
                    timeline.join("\n")
                );
                if !not_serving_seen && server.health().await == Some(ServingStatus::NotServing) {
                    not_serving_seen = true;
                    timeline.push(format!("{:?}: NOT_SERVING", frozen.elapsed()));
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
    let (name, lease, recovered) = first.expect("the loop ends with a grant");
    // The promotion came before the grant, at the latest when the grant was seen.
    if promoted_at.is_none() && f.sentinel.master_port() == Some(replica_port) {
        promoted_at = Some(recovered);
    }
    let serving_again = loop {
        if server.health().await == Some(ServingStatus::Serving) {
            break frozen.elapsed();
        }
        assert!(
            frozen.elapsed() < recovered + Duration::from_secs(10),
            "health not SERVING 10 s after acquires worked again; timeline:\n{}",
            timeline.join("\n")
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    timeline.push(format!("{serving_again:?}: SERVING"));
    match lease.release().await {
        Ok(()) => {}
        // A connection still on its way to the new master: the server gives the hold
        // back in the background.
        Err(e) if e.code() == Code::Unavailable => assert!(
            until_free(&client, &name, Duration::from_secs(10)).await,
            "`{name}` still held 10 s after its release failed ({e}); timeline:\n{}",
            timeline.join("\n")
        ),
        Err(e) => panic!("release of `{name}`: {e}; timeline:\n{}", timeline.join("\n")),
    }
    f.master().resume();
    let timeline = timeline.join("\n");
    let promoted_at = promoted_at.unwrap_or_else(|| panic!("granted before the promotion; timeline:\n{timeline}"));
    assert!(
        not_serving_seen,
        "health never said NOT_SERVING during the outage; timeline:\n{timeline}"
    );
    assert!(
        recovered - promoted_at < Duration::from_secs(3),
        "acquires came back only {:?} after the promotion; timeline:\n{timeline}",
        recovered - promoted_at
    );
    assert!(
        serving_again < recovered + Duration::from_secs(3),
        "acquires work {recovered:?} after the freeze but health says SERVING only {serving_again:?} after it; \
         timeline:\n{timeline}"
    );
}

/// A frozen master's failover, then the old master wakes up still a master (until the
/// sentinel demotes it, some seconds later). Every connection of the server's pool has
/// moved to the new master, idle ones too: one server grants a lock to one stream at
/// most, never once on each master.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_old_master_that_returns_grants_nothing_twice() {
    let mut f = Failover::start().await;
    let server = Latchkey::start_with(&f.url(), &["--redis-timeout", "500ms"]).await;
    let client = server.client().await;
    // Every pool connection is connected and used.
    for i in 0..8 {
        take_and_release(&client, format!("warm-{i}")).await;
    }
    f.replicated().await;
    f.freeze_master_and_fail_over().await;
    pool_moved(&client, "dup").await;
    f.master().resume();
    let mut held = Vec::new();
    let mut outcomes = Vec::new();
    for _ in 0..8 {
        match bounded(Duration::from_secs(5), "a try", client.lock("dup").try_once().acquire()).await {
            Ok(lease) => {
                outcomes.push(format!("granted token {}", lease.fencing_token()));
                held.push(lease);
            }
            Err(e) => outcomes.push(format!("{:?}: {e}", e.code())),
        }
    }
    assert!(
        held.len() <= 1,
        "{} streams granted `dup` at once by one server: {outcomes:#?}; on the old master {:?}, on the new {:?}",
        held.len(),
        f.master().cli(&["HGETALL", "dup"]).trim(),
        f.replica.cli(&["HGETALL", "dup"]).trim()
    );
}

/// A frozen master's failover, then the old master wakes up still holding the lock.
/// An operator's ForceRelease breaks the lock where it lives (the new master) and its
/// holder is told `lost{FORCE_RELEASED}`: the connection ForceRelease runs on, idle
/// during the freeze, has moved to the new master too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn force_release_after_a_frozen_master_failover_reaches_the_new_master() {
    let mut f = Failover::start().await;
    // A 30 s watchdog: the old master still has the lock when it wakes up.
    let server = Latchkey::start_with(&f.url(), &["--redis-timeout", "500ms"]).await;
    let client = server.client().await;
    // ForceRelease's connection is connected and has been used.
    assert!(!client.force_release("nothing").await.unwrap());
    let holder = client.lock("fr").acquire().await.unwrap();
    f.replicated().await;
    f.freeze_master_and_fail_over().await;
    // The server's pool reached the new master: the lock is held there.
    let moved = Instant::now();
    loop {
        if let Ok(state) = client.describe("fr").await {
            assert!(
                state.locked,
                "held on the new master: {state:?}; there {:?}, holder lost: {:?}\n{}",
                f.replica.cli(&["HGETALL", "fr"]),
                holder.lost_reason(),
                f.logs()
            );
            break;
        }
        assert!(moved.elapsed() < T, "the server never reached the new master");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The old master wakes up before the sentinel demotes it.
    f.master().resume();
    assert_eq!(
        f.master().cli(&["EXISTS", "fr"]).trim(),
        "1",
        "the old master still has its copy"
    );
    let released = bounded(Duration::from_secs(5), "ForceRelease", client.force_release("fr")).await;
    let on_old = f.master().cli(&["EXISTS", "fr"]);
    let on_new = f.replica.cli(&["EXISTS", "fr"]);
    // ForceRelease deletes the lock in its own script: once it answers, the lock's home
    // (the new master) has it no more.
    assert!(
        !(released.as_ref().is_ok_and(|r| *r) && on_new.trim() == "1"),
        "ForceRelease answered {released:?} but the new master still has the lock \
         (the old master has it: {})",
        on_old.trim()
    );
    let told = tokio::time::timeout(Duration::from_secs(3), holder.lost()).await;
    let state = client.describe("fr").await.unwrap();
    assert!(
        !state.locked,
        "ForceRelease answered {released:?} but the lock is still held on the new master \
         (the old master has it: {}); holder told: {told:?}",
        on_old.trim()
    );
    assert_eq!(told.ok(), Some(LostReason::ForceReleased));
}

/// A waiter queued before a frozen master's failover is woken promptly by the holder's
/// release on the new master, after the old master woke up: the server's subscriber,
/// idle during the freeze, has moved to the new master and hears the unlock there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiter_is_woken_after_a_frozen_master_failover_and_its_return() {
    let mut f = Failover::start().await;
    // A 30 s watchdog: a waiter that is not woken re-polls only by the holder's TTL.
    let server = Latchkey::start_with(&f.url(), &["--redis-timeout", "500ms"]).await;
    let client = server.client().await;
    let holder = client.lock("s").acquire().await.unwrap();
    let (waiter, _) = spawn_queued(client.lock("s").wait(Duration::from_secs(90)), T).await;
    f.replicated().await;
    f.freeze_master_and_fail_over().await;
    pool_moved(&client, "s").await;
    f.master().resume();
    let old_channels = f.master().cli(&["PUBSUB", "CHANNELS"]);
    listening_on(&f.replica, "s").await;
    let released = Instant::now();
    release_after_failover(&f, holder, "s").await;
    let lease = bounded(Duration::from_secs(40), "the waiter", waiter)
        .await
        .unwrap()
        .expect("granted");
    let waited = released.elapsed();
    assert!(
        waited < Duration::from_secs(2),
        "the waiter was granted {waited:?} after the release on the new master \
         (channels on the old master: {:?})",
        old_channels.trim()
    );
    lease.release().await.unwrap();
}

/// Waits (bounded) until a waiter listens for `name`'s release on `master` (its
/// subscriber moved there), before the test times how promptly it is woken.
async fn listening_on(master: &RedisServer, name: &str) {
    let channel = format!("redisson_lock__channel:{{{name}}}");
    // The subscriber is pinged every second, and moved once it does not answer.
    let listening = poll_until(Duration::from_secs(10), || master.subscribers(&channel) >= 1).await;
    assert!(listening, "no waiter listens on the new master for {channel}");
}

/// Across two servers: after a frozen master's failover and its return, server A's
/// waiter is woken promptly when server B's holder releases on the new master, B's hold
/// is gone from there, and A's grant excludes a holder through B.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_servers_waiter_is_woken_after_a_frozen_master_returns() {
    let mut f = Failover::start().await;
    let a = Latchkey::start_with(&f.url(), &["--redis-timeout", "500ms"]).await;
    let b = Latchkey::start_with(&f.url(), &["--redis-timeout", "500ms"]).await;
    let (ca, cb) = (a.client().await, b.client().await);
    let holder = cb.lock("x").acquire().await.unwrap();
    let (waiter, _) = spawn_queued(ca.lock("x").wait(Duration::from_secs(90)), T).await;
    f.replicated().await;
    f.freeze_master_and_fail_over().await;
    pool_moved(&ca, "x").await;
    pool_moved(&cb, "x").await;
    f.master().resume();
    let old_channels = f.master().cli(&["PUBSUB", "CHANNELS", "*{x}*"]);
    listening_on(&f.replica, "x").await;
    let released = Instant::now();
    release_after_failover(&f, holder, "x").await;
    let lease = bounded(Duration::from_secs(45), "A's waiter", waiter)
        .await
        .unwrap()
        .expect("A's waiter is granted");
    let waited = released.elapsed();
    assert!(
        waited < Duration::from_secs(3),
        "A's waiter woke {waited:?} after B's release (x's channels on the old master: {:?})",
        old_channels.trim()
    );
    // Mutual exclusion on the lock's home (the new master), seen through B.
    let third = cb.lock("x").try_once().acquire().await;
    assert!(
        third.is_err(),
        "B granted `x` while A's waiter holds it ({})",
        lease.owner()
    );
    let state = cb.describe("x").await.expect("Describe through B");
    let owners: Vec<_> = state.holders.iter().map(|h| h.owner.as_str()).collect();
    assert_eq!(owners, [lease.owner()], "holders of `x` on the new master");
    lease.release().await.unwrap();
}

/// Sentinel is re-pointed (`SENTINEL REMOVE` + `SENTINEL MONITOR`, as an operator
/// moving the master does; a failover to a node this server cannot reach ends the
/// same way) at a master the server cannot reach. Every grant then fails, and health
/// says NOT_SERVING within a few rounds. The round's Sentinel check moves the
/// connections with `force_reconnection()`, which fred answers only once the new
/// connection is made: unbounded, the health loop waited there for good, SERVING.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_turns_not_serving_when_sentinel_names_a_master_out_of_reach() {
    let master = RedisServer::start();
    let sentinel = RedisSentinel::watching(master, Duration::from_secs(1), Duration::from_secs(60));
    let server = Latchkey::start_with(&sentinel.url(), &["--redis-timeout", "500ms"]).await;
    let client = server.client().await;
    let lease = client.lock("before").try_once().acquire().await.expect("granted");
    lease.release().await.expect("released");

    let dead = latchkey_tests::free_port();
    repoint(&sentinel, dead);
    let started = Instant::now();
    let mut timeline = Vec::new();
    let mut not_serving = false;
    let mut i = 0;
    while started.elapsed() < Duration::from_secs(12) {
        i += 1;
        let health = server.health().await;
        let attempt = tokio::time::timeout(
            Duration::from_secs(5),
            client.lock(format!("during-{i}")).try_once().acquire(),
        )
        .await;
        let outcome = match attempt {
            Err(_) => "acquire hung 5 s".to_owned(),
            Ok(Ok(_)) => "granted".to_owned(),
            Ok(Err(e)) => format!("{:?}", e.code()),
        };
        timeline.push(format!(
            "{:>6.1?}: health {health:?}, acquire {outcome}",
            started.elapsed()
        ));
        if health == Some(ServingStatus::NotServing) {
            not_serving = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(
        not_serving,
        "health never said NOT_SERVING in 12 s while Sentinel names 127.0.0.1:{dead}, where nothing listens; \
         timeline:\n{}",
        timeline.join("\n")
    );
}

/// A master Sentinel named out of reach for a while, then back, is connected to once
/// per connection: each health round asked every connection still on the old master
/// to move (`force_reconnection`), those already trying to reconnect too, and each ask
/// stayed queued in the Redis client: once the master was back, every connection was
/// made again as many times as rounds had passed, cutting the calls sent on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_out_of_reach_for_a_while_is_connected_to_once_it_is_back() {
    let master = RedisServer::start();
    let port = master.port();
    let mut sentinel = RedisSentinel::watching(master, Duration::from_secs(1), Duration::from_secs(60));
    let server = Latchkey::start_with(&sentinel.url(), &["--redis-timeout", "500ms"]).await;
    server.wait_health(ServingStatus::Serving, T).await;
    repoint(&sentinel, latchkey_tests::free_port());
    server.wait_health(ServingStatus::NotServing, T).await;
    // Health rounds (one a second) while nothing is reachable.
    tokio::time::sleep(Duration::from_secs(10)).await;
    let received = |sentinel: &mut RedisSentinel| -> u64 {
        let info = sentinel.master().cli(&["INFO", "stats"]);
        info_field(&info, "total_connections_received")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    let before = received(&mut sentinel);
    repoint(&sentinel, port);
    server.wait_health(ServingStatus::Serving, T).await;
    // Long enough for any reconnection still queued to be made.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let made = received(&mut sentinel) - before;
    // The pool's 4, the one-shot, the subscriber, the test's own INFO, and a few more
    // made again through the recovery.
    assert!(
        made <= 24,
        "{made} connections made to the master once it was back (9 here, 45 before)"
    );
}

/// Has `sentinel` name the Redis on `port` the master, as an operator moving the
/// service by hand would.
fn repoint(sentinel: &RedisSentinel, port: u16) {
    let sport = sentinel.sentinel_port();
    redis_cli(sport, None, &["SENTINEL", "REMOVE", SENTINEL_SERVICE_NAME]);
    let port_arg = port.to_string();
    let monitor = [
        "SENTINEL",
        "MONITOR",
        SENTINEL_SERVICE_NAME,
        "127.0.0.1",
        &port_arg,
        "1",
    ];
    let answer = redis_cli(sport, None, &monitor);
    assert_eq!(sentinel.master_port(), Some(port), "sentinel re-pointed: {answer}");
}

/// Whether health reads `want` within `limit`.
async fn health_within(server: &Latchkey, want: ServingStatus, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if server.health().await == Some(want) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

/// Sentinels out of reach when the server starts are asked once they answer: the
/// server's connections to them were made once, their first failure ending them for
/// good, and every health round then found no sentinel to ask. The server never
/// followed Sentinel's master again (here: health stayed SERVING on the old master
/// after Sentinel named a dead one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinels_out_of_reach_at_start_are_asked_once_they_answer() {
    let master = RedisServer::start();
    let sentinel = RedisSentinel::watching(master, Duration::from_secs(1), Duration::from_secs(60));
    let gate = Proxy::start(&format!("127.0.0.1:{}", sentinel.sentinel_port())).await;
    gate.freeze();
    let url = format!(
        "redis-sentinel://{}?sentinelServiceName={SENTINEL_SERVICE_NAME}",
        gate.addr()
    );
    let options = latchkey_client::ConnectOptions::new();
    let server = Latchkey::launch(&url, &["--redis-timeout", "500ms"], options).await;
    // Each first connection sends its handshake into the frozen gate and gives up after
    // the Redis timeout: three of them and every first try has failed.
    assert!(
        latchkey_tests::poll_until(Duration::from_secs(5), || gate.dropped() > 0).await,
        "the server never tried the sentinel"
    );
    tokio::time::sleep(Duration::from_millis(1500)).await;
    gate.thaw();
    server.wait_health(ServingStatus::Serving, T).await;
    let client = server.client().await;
    take_and_release(&client, "before").await;

    repoint(&sentinel, latchkey_tests::free_port());
    assert!(
        health_within(&server, ServingStatus::NotServing, Duration::from_secs(12)).await,
        "health stayed SERVING 12 s after Sentinel named a master out of reach: the server asked no sentinel"
    );
}

/// A master that answers but refuses writes (`min-replicas-to-write` with its replica
/// gone, as the README recommends) is left for the one Sentinel names: each health
/// round failed on its refusal before asking Sentinel, so the server stayed on it,
/// NOT_SERVING and refusing every acquire, with the new master in reach.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_refusing_writes_is_left_for_the_one_sentinel_names() {
    let mut f = Failover::start().await;
    f.master().cli(&["CONFIG", "SET", "min-replicas-to-write", "1"]);
    let server = Latchkey::start_with(&f.url(), &["--redis-timeout", "500ms"]).await;
    let client = server.client().await;
    take_and_release(&client, "before").await;

    // The replica leaves: the old master refuses every write from now, and answers.
    f.replica.cli(&["REPLICAOF", "NO", "ONE"]);
    let refused = latchkey_tests::poll_until(Duration::from_secs(5), || {
        f.master().cli(&["SET", "probe", "1"]).contains("NOREPLICAS")
    })
    .await;
    assert!(refused, "the old master kept taking writes without its replica");
    repoint(&f.sentinel, f.replica.port());

    let started = Instant::now();
    let mut outcomes = Vec::new();
    while started.elapsed() < Duration::from_secs(12) {
        let attempt = tokio::time::timeout(Duration::from_secs(5), client.lock("after").try_once().acquire()).await;
        match attempt {
            Ok(Ok(lease)) => {
                let on_new = f.replica.cli(&["EXISTS", "after"]).trim() == "1";
                lease.release().await.expect("released");
                assert!(on_new, "granted, but not on the master Sentinel names");
                return;
            }
            Ok(Err(e)) => outcomes.push(format!("{:>6.1?}: {:?}", started.elapsed(), e.code())),
            Err(_) => outcomes.push(format!("{:>6.1?}: hung 5 s", started.elapsed())),
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    panic!(
        "no acquire granted 12 s after Sentinel named the reachable new master:\n{}",
        outcomes.join("\n")
    );
}

/// A RedLock node behind Sentinel follows its master as the main Redis does: once
/// Sentinel names another master (the old one still up and answering, as one cut off
/// from its sentinels is), RedLock's grants land on the new one. The node's connections
/// stayed on the old master for good: a server counted it as the node while other
/// servers, asking Sentinel, counted the new master, and each could make a majority.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redlock_node_behind_sentinel_follows_its_master() {
    let mut f = Failover::start().await;
    let (main, n2, n3) = (RedisServer::start(), RedisServer::start(), RedisServer::start());
    let node = f.url();
    let flags = [
        "--redlock-url",
        node.as_str(),
        "--redlock-url",
        &n2.url(),
        "--redlock-url",
        &n3.url(),
        "--redlock-restart-delay",
        "0s",
        "--redis-timeout",
        "500ms",
    ];
    let server = Latchkey::start_with(&main.url(), &flags).await;
    let client = server.client().await;
    let lease = client.lock("before").redlock(true).acquire().await.expect("granted");
    assert_eq!(f.master().cli(&["EXISTS", "before"]).trim(), "1", "on the first master");
    lease.release().await.expect("released");

    f.replica.cli(&["REPLICAOF", "NO", "ONE"]);
    repoint(&f.sentinel, f.replica.port());
    let started = Instant::now();
    let mut seen = Vec::new();
    // A name of its own for each try: a try or a release in flight as the connection
    // moves is written again on the new connection, and the key it left on the old
    // master stays there for the lease, which would hide every later grant's place.
    let mut attempt = 0;
    while started.elapsed() < Duration::from_secs(15) {
        attempt += 1;
        let name = format!("after-{attempt}");
        if let Ok(lease) = client.lock(name.as_str()).redlock(true).try_once().acquire().await {
            let on_new = f.replica.cli(&["EXISTS", &name]).trim() == "1";
            let on_old = f.master().cli(&["EXISTS", &name]).trim() == "1";
            lease.release().await.expect("released");
            if on_new && !on_old {
                return;
            }
            seen.push(format!("{:>6.1?}: new {on_new}, old {on_old}", started.elapsed()));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    panic!(
        "RedLock never granted on the master Sentinel names:\n{}",
        seen.join("\n")
    );
}

/// The number of clients connected to the Redis (or sentinel) on `port`.
fn connected_clients(port: u16) -> usize {
    let info = redis_cli(port, None, &["INFO", "clients"]);
    latchkey_tests::redis::info_field(&info, "connected_clients")
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// A stopped server closes its connections to the sentinels too (those the Sentinel
/// check keeps to each), not only those to the master: it kept them, and fred's tasks
/// that reconnect them, for as long as its process ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_server_keeps_no_connection_to_the_sentinels() {
    let master = RedisServer::start();
    let master_port = master.port();
    let sentinel = RedisSentinel::watching(master, Duration::from_secs(1), Duration::from_secs(60));
    let sport = sentinel.sentinel_port();
    // The sentinel's own links to the master and redis-cli's connection.
    let before = (connected_clients(sport), connected_clients(master_port));
    let server = Latchkey::start_with(&sentinel.url(), &["--redis-timeout", "500ms"]).await;
    let during = (connected_clients(sport), connected_clients(master_port));
    server.stop().await;
    let mut after = (connected_clients(sport), connected_clients(master_port));
    let settled = latchkey_tests::poll_until(Duration::from_secs(5), || {
        after = (connected_clients(sport), connected_clients(master_port));
        after == before
    })
    .await;
    assert!(
        settled,
        "(sentinel, master) clients: {before:?} before the server, {during:?} while it ran, still {after:?} \
         5 s after it stopped"
    );
}
