//! The relay (passes in memory, handoffs, claims, the fair queue) under random
//! workloads on one hot mutex or fair lock shared by three `latchkey-server` processes
//! on one Redis, mixing plain waits, try-once acquires, short waits, cancels mid-wait,
//! `release` while waiting, dropped leases, named owners (reentrant holds across
//! streams), fixed leases and, in two of them, Redisson clients on the same name.
//! Checked: no two owners hold at once, tokens grow in grant order, no waiter is
//! stranded, and nothing is left in Redis afterwards; and,
//! under a fault halfway (ForceRelease, a server killed, Redis frozen), that no
//! survivor's waiter runs out its wait and only holds told `lost` overlap.

use latchkey_client::{Client, LockKind};
use latchkey_proto::v1::{acquire_response::Event, LockKind as ProtoKind};
use latchkey_tests::redisson::{random_owner, RedissonFairLock, RedissonLock};
use latchkey_tests::server::{open, pd, RawStream};
use latchkey_tests::{bounded, poll_until, redis_client, LatchkeyProcess, RedisServer};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Bound on anything that should happen promptly.
const T: Duration = Duration::from_secs(20);
/// A plain waiter's wait: far past any wait a hot lock with ~1 ms holds should cause.
const LONG_WAIT: Duration = Duration::from_secs(8);

fn server_args(redis: &RedisServer) -> Vec<String> {
    [
        "--redis-url",
        &redis.url(),
        "--watchdog-timeout",
        "1500ms",
        "--redis-timeout",
        "500ms",
        "--fair-wait-timeout",
        "1s",
        "--no-metrics",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// Who holds the lock now, as the clients see it: owner -> streams inside.
#[derive(Default)]
struct Board {
    inside: HashMap<String, u32>,
    /// The last token of a grant that entered an empty board, and who.
    last: Option<(u64, String)>,
    violations: Vec<String>,
    grants: u64,
    /// Under faults: (earlier holder, later holder, what) overlaps and tokens that went
    /// down, judged at the end by whether both holds were confirmed released.
    suspects: Vec<(u64, u64, String)>,
    /// Holds inside now: (id, owner).
    ids: Vec<(u64, String)>,
    /// The id of the grant that set `last`.
    last_id: u64,
    /// Holds whose release was confirmed (`released`, not `lost`).
    confirmed: std::collections::HashSet<u64>,
}

#[derive(Clone, Default)]
struct Shared {
    board: Arc<Mutex<Board>>,
    stop: Arc<AtomicBool>,
    seq: Arc<AtomicU64>,
    /// Counts of outcomes by kind of action, for the report.
    outcomes: Arc<Mutex<HashMap<String, u64>>>,
    /// When set, holders told `lost` may overlap (faults in force).
    faults: Arc<AtomicBool>,
    /// The endpoints of servers killed: their workers stop, and what they saw after
    /// the kill is not judged.
    dead: Arc<Mutex<Vec<String>>>,
    /// A connection to the lock's Redis for the Redisson clients' actions.
    java: Option<fred::clients::Client>,
}

impl Shared {
    fn count(&self, what: impl Into<String>) {
        *self.outcomes.lock().unwrap().entry(what.into()).or_default() += 1;
    }

    /// Enters `owner`'s hold: `token` is None for a Redisson client's, which has none.
    fn enter(&self, owner: &str, token: Option<u64>, what: &str) -> u64 {
        let id = self.seq.fetch_add(1, Ordering::SeqCst) + 1_000_000;
        let mut b = self.board.lock().unwrap();
        b.grants += 1;
        if self.faults.load(Ordering::SeqCst) {
            let earlier: Vec<u64> = b.ids.iter().filter(|(_, o)| o != owner).map(|(i, _)| *i).collect();
            for e in earlier {
                b.suspects
                    .push((e, id, format!("{what} {owner} token {token:?} overlapped hold {e}")));
            }
        }
        let others: Vec<String> = b
            .inside
            .iter()
            .filter(|(o, n)| o.as_str() != owner && **n > 0)
            .map(|(o, _)| o.clone())
            .collect();
        if !others.is_empty() && !self.faults.load(Ordering::SeqCst) {
            b.violations.push(format!(
                "{what} owner {owner} token {token:?} granted while {others:?} hold"
            ));
        }
        let empty = b.inside.values().all(|n| *n == 0);
        if let (true, Some(token)) = (empty, token) {
            // Streams of one named owner may hold together and enter in any order: only
            // a grant to another owner must carry a larger token than every one before.
            let mut top = token;
            if let Some((last, who)) = b.last.clone() {
                if who.ends_with(&format!("/{owner}")) {
                    top = top.max(last);
                } else if token <= last {
                    let v = format!("{what} owner {owner} token {token} after {who}'s {last}");
                    if self.faults.load(Ordering::SeqCst) {
                        let last_id = b.last_id;
                        b.suspects.push((last_id, id, v));
                    } else {
                        b.violations.push(v);
                    }
                }
            }
            b.last = Some((top, format!("{what}/{owner}")));
            b.last_id = id;
        }
        *b.inside.entry(owner.to_owned()).or_default() += 1;
        b.ids.push((id, owner.to_owned()));
        id
    }

    fn confirm(&self, id: u64) {
        self.board.lock().unwrap().confirmed.insert(id);
    }

    fn leave(&self, owner: &str) {
        let mut b = self.board.lock().unwrap();
        if let Some(i) = b.ids.iter().rposition(|(_, o)| o == owner) {
            b.ids.remove(i);
        }
        let n = b.inside.get_mut(owner).expect("entered");
        *n -= 1;
        if *n == 0 {
            b.inside.remove(owner);
        }
    }

    fn is_dead(&self, endpoint: &str) -> bool {
        self.dead.lock().unwrap().iter().any(|e| e == endpoint)
    }

    /// A failure a client of `endpoint` saw: under faults only a wait that ran out
    /// counts (a server killed or Redis away fails requests as it should), and nothing
    /// a client of a killed server saw.
    fn violate(&self, endpoint: &str, v: String) {
        if self.faults.load(Ordering::SeqCst) && !v.contains("DeadlineExceeded") && !v.contains("not acquired") {
            return;
        }
        if self.is_dead(endpoint) {
            return;
        }
        self.board.lock().unwrap().violations.push(v);
    }
}

/// One client task's loop of random actions on `name` until `stop`.
async fn worker(client: Client, endpoint: String, name: String, kind: LockKind, id: usize, s: Shared, mix: Mix) {
    let mut raw = latchkey_proto::v1::lock_service_client::LockServiceClient::connect(endpoint.clone())
        .await
        .expect("raw client");
    while !s.stop.load(Ordering::SeqCst) && !s.is_dead(&endpoint) {
        let n = s.seq.fetch_add(1, Ordering::SeqCst);
        let roll = fastrand::u32(0..100);
        let hold = Duration::from_micros(fastrand::u64(0..2000));
        let base = client.lock(name.clone()).kind(kind);
        if roll < mix.plain {
            let lease = match base.wait(LONG_WAIT).acquire().await {
                Ok(l) => l,
                Err(e) => {
                    s.violate(&endpoint, format!("worker {id} plain #{n}: {e}"));
                    s.count("plain-error");
                    continue;
                }
            };
            let owner = lease.owner().to_owned();
            let id = s.enter(&owner, Some(lease.fencing_token()), "plain");
            tokio::time::sleep(hold).await;
            s.leave(&owner);
            let lost = lease.is_lost();
            match lease.release().await {
                Ok(()) => {
                    s.confirm(id);
                    s.count("plain-released")
                }
                Err(e) => {
                    s.count("plain-lost");
                    if !s.faults.load(Ordering::SeqCst) {
                        s.violate(
                            &endpoint,
                            format!("worker {id} plain #{n} release: {e} (lost before {lost})"),
                        );
                    }
                }
            }
        } else if roll < mix.plain + mix.try_once {
            match base.try_once().acquire().await {
                Ok(lease) => {
                    let owner = lease.owner().to_owned();
                    s.enter(&owner, Some(lease.fencing_token()), "try-once");
                    tokio::time::sleep(hold).await;
                    s.leave(&owner);
                    let _ = lease.release().await;
                    s.count("try-granted");
                }
                Err(e) if e.is_timeout() => s.count("try-busy"),
                Err(e) => {
                    s.count("try-error");
                    s.violate(&endpoint, format!("worker {id} try-once #{n}: {e}"))
                }
            }
        } else if roll < mix.plain + mix.try_once + mix.short {
            let wait = Duration::from_millis(fastrand::u64(1..30));
            match base.wait(wait).acquire().await {
                Ok(lease) => {
                    let owner = lease.owner().to_owned();
                    s.enter(&owner, Some(lease.fencing_token()), "short");
                    tokio::time::sleep(hold).await;
                    s.leave(&owner);
                    let _ = lease.release().await;
                    s.count("short-granted");
                }
                Err(e) if e.is_timeout() => s.count("short-timeout"),
                Err(e) => {
                    s.count("short-error");
                    s.violate(&endpoint, format!("worker {id} short #{n}: {e}"))
                }
            }
        } else if roll < mix.plain + mix.try_once + mix.short + mix.cancel {
            // Dropped mid-wait (or just after the grant, unseen): the server gives back.
            let cut = Duration::from_micros(fastrand::u64(0..5000));
            match tokio::time::timeout(cut, base.wait(LONG_WAIT).acquire()).await {
                Ok(Ok(lease)) => {
                    let owner = lease.owner().to_owned();
                    s.enter(&owner, Some(lease.fencing_token()), "cancel-granted");
                    s.leave(&owner);
                    drop(lease);
                    s.count("cancel-granted");
                }
                Ok(Err(e)) => s.violate(&endpoint, format!("worker {id} cancel #{n}: {e}")),
                Err(_) => s.count("cancelled"),
            }
        } else if roll < mix.plain + mix.try_once + mix.short + mix.cancel + mix.raw_release {
            // `release` while waiting, at a random moment; not on the board (its grant, if
            // any, is told after the server read the release's bytes, perhaps).
            let mut o = open(&name);
            o.kind = match kind {
                LockKind::Fair => ProtoKind::Fair as i32,
                _ => ProtoKind::Mutex as i32,
            };
            o.wait_timeout = Some(pd(LONG_WAIT));
            let mut stream = RawStream::open(&mut raw, Some(o)).await;
            tokio::time::sleep(Duration::from_micros(fastrand::u64(0..4000))).await;
            if let Some(tx) = &stream.tx {
                // A stream its server ended (killed) takes no more.
                let release = latchkey_proto::v1::AcquireRequest {
                    action: Some(latchkey_proto::v1::acquire_request::Action::Release(
                        latchkey_proto::v1::Release {},
                    )),
                };
                let _ = tx.send(release).await;
            }
            let mut ended = false;
            for _ in 0..6 {
                match stream.next(T).await {
                    Ok(Some(ev)) => match ev.event {
                        Some(Event::Released(_)) => {}
                        Some(Event::Lost(l)) => s.violate(&endpoint, format!("worker {id} raw #{n}: lost {l:?}")),
                        _ => {}
                    },
                    Ok(None) => {
                        ended = true;
                        break;
                    }
                    Err(st) if st.code() == tonic::Code::Cancelled || st.code() == tonic::Code::Ok => {
                        ended = true;
                        break;
                    }
                    Err(st) => {
                        s.violate(&endpoint, format!("worker {id} raw #{n}: {st}"));
                        ended = true;
                        break;
                    }
                }
            }
            if !ended {
                s.violate(&endpoint, format!("worker {id} raw #{n}: the stream did not end"));
            }
            s.count("raw-release");
        } else if roll < mix.plain + mix.try_once + mix.short + mix.cancel + mix.raw_release + mix.drop_lease {
            match base.wait(LONG_WAIT).acquire().await {
                Ok(lease) => {
                    let owner = lease.owner().to_owned();
                    s.enter(&owner, Some(lease.fencing_token()), "dropped");
                    tokio::time::sleep(hold).await;
                    s.leave(&owner);
                    drop(lease);
                    s.count("dropped");
                }
                Err(e) => s.violate(&endpoint, format!("worker {id} drop #{n}: {e}")),
            }
        } else if roll
            < mix.plain + mix.try_once + mix.short + mix.cancel + mix.raw_release + mix.drop_lease + mix.named
        {
            let owner = format!("named-{}", fastrand::u32(0..2));
            match base.owner(owner.clone()).wait(LONG_WAIT).acquire().await {
                Ok(lease) => {
                    let o = lease.owner().to_owned();
                    let id = s.enter(&o, Some(lease.fencing_token()), "named");
                    tokio::time::sleep(hold).await;
                    s.leave(&o);
                    match lease.release().await {
                        Ok(()) => {
                            s.confirm(id);
                            s.count("named-released")
                        }
                        Err(e) => {
                            s.count("named-lost");
                            if !s.faults.load(Ordering::SeqCst) {
                                s.violate(&endpoint, format!("worker {id} named #{n} release: {e}"));
                            }
                        }
                    }
                }
                Err(e) => s.violate(&endpoint, format!("worker {id} named #{n}: {e}")),
            }
        } else if roll
            < mix.plain
                + mix.try_once
                + mix.short
                + mix.cancel
                + mix.raw_release
                + mix.drop_lease
                + mix.named
                + mix.redisson
        {
            let java = s.java.as_ref().expect("a Redis connection for Redisson's clients");
            redisson_action(java, &name, kind, hold, &s).await;
        } else {
            match base.lease(Duration::from_secs(3)).wait(LONG_WAIT).acquire().await {
                Ok(lease) => {
                    let o = lease.owner().to_owned();
                    let id = s.enter(&o, Some(lease.fencing_token()), "fixed");
                    tokio::time::sleep(hold).await;
                    s.leave(&o);
                    match lease.release().await {
                        Ok(()) => {
                            s.confirm(id);
                            s.count("fixed-released")
                        }
                        Err(e) => {
                            s.count("fixed-lost");
                            if !s.faults.load(Ordering::SeqCst) {
                                s.violate(&endpoint, format!("worker {id} fixed #{n} release: {e}"));
                            }
                        }
                    }
                }
                Err(e) => s.violate(&endpoint, format!("worker {id} fixed #{n}: {e}")),
            }
        }
    }
}

/// A Redisson client (a thread of its own) takes `name` as Java's `lock(wait, lease)`
/// does, holds it for `hold`, and unlocks it. Its hold carries no fencing token.
async fn redisson_action(java: &fred::clients::Client, name: &str, kind: LockKind, hold: Duration, s: &Shared) {
    let owner = random_owner();
    let lease_ms = 3_000;
    let (fair, plain);
    let acquired = if kind == LockKind::Fair {
        fair = RedissonFairLock::new(java, name, &owner);
        fair.lock(LONG_WAIT, lease_ms).await
    } else {
        plain = RedissonLock::new(java, name, &owner);
        plain.lock(LONG_WAIT, lease_ms).await
    };
    if !acquired {
        s.count("redisson-timeout");
        s.violate(
            "",
            format!("Redisson client {owner}: not acquired within {LONG_WAIT:?}"),
        );
        return;
    }
    let id = s.enter(&owner, None, "redisson");
    tokio::time::sleep(hold).await;
    s.leave(&owner);
    let unlocked = if kind == LockKind::Fair {
        RedissonFairLock::new(java, name, &owner).unlock().await
    } else {
        RedissonLock::new(java, name, &owner).unlock().await
    };
    if unlocked == Some(true) {
        s.confirm(id);
        s.count("redisson-unlocked");
    } else {
        s.count("redisson-lost");
        if !s.faults.load(Ordering::SeqCst) {
            s.violate("", format!("Redisson client {owner}: unlock answered {unlocked:?}"));
        }
    }
}

/// Percentages of each action (the rest: fixed leases).
#[derive(Clone, Copy)]
struct Mix {
    plain: u32,
    try_once: u32,
    short: u32,
    cancel: u32,
    raw_release: u32,
    drop_lease: u32,
    named: u32,
    /// A Redisson client's `lock(wait, lease)` and `unlock` on the same name (the fair
    /// lock's `RFairLock`, the mutex's `RLock`), through Redis directly.
    redisson: u32,
}

const MIX: Mix = Mix {
    plain: 40,
    try_once: 10,
    short: 12,
    cancel: 12,
    raw_release: 8,
    drop_lease: 8,
    named: 5,
    redisson: 0,
};

/// The mix with Redisson clients taking a tenth of the actions.
const WITH_REDISSON: Mix = Mix {
    plain: 30,
    redisson: 10,
    ..MIX
};

/// Keys left in Redis other than the markers that expire (fencing counters, passing
/// markers, break floors), and keys without a TTL.
fn leftovers(redis: &RedisServer) -> Vec<String> {
    let keys = redis.cli(&["KEYS", "*"]);
    let mut left = Vec::new();
    for key in keys.lines().map(str::trim).filter(|k| !k.is_empty()) {
        let ttl: i64 = redis.cli(&["PTTL", key]).trim().parse().unwrap_or(-3);
        if ttl == -2 {
            continue;
        }
        let marker = key.starts_with("latchkey_fence")
            || key.starts_with("latchkey_passing")
            || key.starts_with("latchkey_turn")
            || key.starts_with("latchkey_broken")
            || (key.starts_with("latchkey_hold:") && redis.cli(&["GET", key]).trim() == "revoked");
        if !marker || ttl < 0 {
            left.push(format!("{key} (pttl {ttl})"));
        }
    }
    left
}

/// Channels subscribed other than the force-release channel.
fn channels(redis: &RedisServer) -> Vec<String> {
    redis
        .cli(&["PUBSUB", "CHANNELS", "*"])
        .lines()
        .map(|l| l.trim().to_owned())
        .filter(|l| !l.is_empty() && !l.contains("force_release"))
        .collect()
}

/// What happens to the deployment halfway through a workload.
#[derive(Clone, Copy, PartialEq)]
enum Fault {
    None,
    /// ForceRelease every 100 ms for 2 s, through the second server.
    ForceReleases,
    /// SIGKILL of the first server, holders and waiters inside; its workers stop.
    KillFirstServer,
    /// Redis frozen (SIGSTOP) twice for 700 ms, longer than `--redis-timeout`.
    RedisPauses,
}

async fn run_workload(kind: LockKind, name: &str, per_server: usize, run_for: Duration, mix: Mix, fault: Fault) {
    let redis = RedisServer::start();
    let mut servers: Vec<LatchkeyProcess> = (0..3).map(|_| LatchkeyProcess::spawn(&server_args(&redis))).collect();
    let mut s = Shared::default();
    if mix.redisson > 0 {
        s.java = Some(redis_client(&redis.url()).await);
    }
    let mut tasks = Vec::new();
    for (i, server) in servers.iter().enumerate() {
        let client = server.serving_client().await;
        // A killed server's named owners would stay queued as a dead Redisson waiter
        // does, five minutes past the one ahead: only the other servers name owners.
        let mix = match (fault, i) {
            (Fault::KillFirstServer, 0) => Mix {
                plain: mix.plain + mix.named,
                named: 0,
                ..mix
            },
            _ => mix,
        };
        for j in 0..per_server {
            tasks.push(tokio::spawn(worker(
                client.clone(),
                server.endpoint(),
                name.to_owned(),
                kind,
                i * 100 + j,
                s.clone(),
                mix,
            )));
        }
    }
    let started = Instant::now();
    tokio::time::sleep(run_for / 2).await;
    inflict(fault, name, &mut servers, &redis, &s).await;
    while started.elapsed() < run_for {
        tokio::time::sleep(Duration::from_millis(500)).await;
        if kind == LockKind::Fair {
            let q = redis.cli(&["LRANGE", &format!("redisson_lock_queue:{{{name}}}"), "0", "-1"]);
            let d = redis.cli(&[
                "ZRANGE",
                &format!("redisson_lock_timeout:{{{name}}}"),
                "0",
                "-1",
                "WITHSCORES",
            ]);
            let h = redis.cli(&["HGETALL", name]);
            eprintln!(
                "t={:?} now={} lock={:?} queue={:?} deadlines={:?}",
                started.elapsed(),
                redis.now_ms(),
                h.replace('\n', " "),
                q.replace('\n', " "),
                d.replace('\n', " ")
            );
        }
    }
    s.stop.store(true, Ordering::SeqCst);
    for task in tasks {
        bounded(T, "a worker ends", task).await.expect("worker task");
    }
    // Everyone is gone: nothing but expiring markers in Redis, no lock channel.
    let clean = poll_until(Duration::from_secs(5), || {
        leftovers(&redis).is_empty() && channels(&redis).is_empty()
    })
    .await;
    let mut board = s.board.lock().unwrap();
    // Under faults: overlaps and tokens that went down between two holds that were both
    // confirmed `released` (neither told `lost`).
    let judged: Vec<String> = board
        .suspects
        .iter()
        .filter(|(a, b, _)| board.confirmed.contains(a) && board.confirmed.contains(b))
        .map(|(_, _, what)| what.clone())
        .collect();
    eprintln!(
        "{} suspects under faults, {} between confirmed holds",
        board.suspects.len(),
        judged.len()
    );
    board.violations.extend(judged);
    let outcomes = s.outcomes.lock().unwrap().clone();
    eprintln!("{kind:?} grants {} outcomes {outcomes:?}", board.grants);
    assert!(board.grants > 100, "the workload ran: {} grants", board.grants);
    assert!(
        board.violations.is_empty(),
        "{} violations, first: {:#?}",
        board.violations.len(),
        &board.violations[..board.violations.len().min(10)]
    );
    assert!(
        clean,
        "left in Redis: {:?}; channels: {:?}",
        leftovers(&redis),
        channels(&redis)
    );
}

/// The workload for 10 s on `name`, four workers a server, `fault` halfway.
async fn faulted(kind: LockKind, name: &str, fault: Fault) {
    run_workload(kind, name, 4, Duration::from_secs(10), MIX, fault).await;
}

/// Brings `fault` on, flagging faults in force first.
async fn inflict(fault: Fault, name: &str, servers: &mut [LatchkeyProcess], redis: &RedisServer, s: &Shared) {
    if fault != Fault::None {
        s.faults.store(true, Ordering::SeqCst);
    }
    match fault {
        Fault::None => {}
        Fault::ForceReleases => {
            let client = Client::connect(&servers[1].endpoint()).await.expect("client");
            let name = name.to_owned();
            tokio::spawn(async move {
                for _ in 0..20 {
                    let _ = client.force_release(&name).await;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            });
        }
        Fault::KillFirstServer => {
            s.dead.lock().unwrap().push(servers[0].endpoint());
            servers[0].kill();
        }
        Fault::RedisPauses => {
            for _ in 0..2 {
                redis.freeze();
                tokio::time::sleep(Duration::from_millis(700)).await;
                redis.resume();
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
}

/// A hot mutex across three servers with every way of taking and leaving mixed in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mixed_workload_on_a_hot_mutex_across_three_servers_stays_exclusive_and_clean() {
    run_workload(
        LockKind::Mutex,
        "relay/mutex",
        4,
        Duration::from_secs(8),
        MIX,
        Fault::None,
    )
    .await;
}

/// The same on a hot fair lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mixed_workload_on_a_hot_fair_lock_across_three_servers_stays_exclusive_and_clean() {
    run_workload(
        LockKind::Fair,
        "relay/fair",
        4,
        Duration::from_secs(8),
        MIX,
        Fault::None,
    )
    .await;
}

/// The hot fair lock with Redisson fair clients among the workers, on the same queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mixed_workload_on_a_hot_fair_lock_with_redisson_clients_stays_exclusive_and_clean() {
    run_workload(
        LockKind::Fair,
        "relay/fair-java",
        4,
        Duration::from_secs(8),
        WITH_REDISSON,
        Fault::None,
    )
    .await;
}

/// The hot mutex with Redisson clients among the workers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mixed_workload_on_a_hot_mutex_with_redisson_clients_stays_exclusive_and_clean() {
    run_workload(
        LockKind::Mutex,
        "relay/mutex-java",
        4,
        Duration::from_secs(8),
        WITH_REDISSON,
        Fault::None,
    )
    .await;
}

/// ForceRelease every 100 ms for 2 s while the mutex is passed in memory: holders
/// broken are told so, and the checks above hold between the holds confirmed released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_mutex_survives_force_releases() {
    let name = "relay/force-mutex";
    faulted(LockKind::Mutex, name, Fault::ForceReleases).await;
}

/// A server killed while it passes a hot mutex in memory, its waiters' claims
/// standing: the survivors' waiters are granted within their waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_mutex_survives_a_server_killed() {
    let name = "relay/kill-mutex";
    faulted(LockKind::Mutex, name, Fault::KillFirstServer).await;
}

/// Redis frozen twice past a Redis timeout under a hot mutex.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_mutex_survives_redis_pauses() {
    let name = "relay/pause-mutex";
    faulted(LockKind::Mutex, name, Fault::RedisPauses).await;
}

/// The same on a hot fair lock: a break leaves the queue in place, and its waiters
/// carry on in turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_fair_lock_survives_force_releases() {
    let name = "relay/force-fair";
    faulted(LockKind::Fair, name, Fault::ForceReleases).await;
}

/// A server killed while its waiters stand in a hot fair queue, named owners passing
/// through: the survivors' waiters are granted within their waits (the killed server's
/// entries block the queue for a wait timeout at most), and nothing is left in Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_fair_lock_survives_a_server_killed_with_waiters_queued() {
    let name = "relay/kill-fair";
    faulted(LockKind::Fair, name, Fault::KillFirstServer).await;
}

/// Redis frozen twice, each time longer than a Redis timeout, under a hot fair lock:
/// waiters are not stranded and the queue ends empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_fair_lock_survives_redis_pauses() {
    let name = "relay/pause-fair";
    faulted(LockKind::Fair, name, Fault::RedisPauses).await;
}

/// Fairness across servers: while one server passes a hot fair lock between its own
/// waiters in memory, a waiter of another server that queued is granted after no more
/// than the waiters queued ahead of it and one recording window's passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_servers_fair_waiter_is_not_overtaken_by_a_hot_run() {
    let redis = RedisServer::start();
    let a = LatchkeyProcess::spawn(&server_args(&redis));
    let b = LatchkeyProcess::spawn(&server_args(&redis));
    let (ca, cb) = (a.serving_client().await, b.serving_client().await);
    let name = "relay/fairness";
    let stop = Arc::new(AtomicBool::new(false));
    let a_grants = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let (c, stop, n) = (ca.clone(), stop.clone(), a_grants.clone());
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                let lease = c
                    .lock(name)
                    .kind(LockKind::Fair)
                    .wait(LONG_WAIT)
                    .acquire()
                    .await
                    .expect("A granted");
                n.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_micros(200)).await;
                lease.release().await.expect("A released");
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut overtaken = Vec::new();
    for _ in 0..20 {
        let at_queue = Arc::new(AtomicU64::new(u64::MAX));
        let (q, n) = (at_queue.clone(), a_grants.clone());
        let asked = Instant::now();
        let lease = bounded(
            T,
            "B's waiter",
            cb.lock(name)
                .kind(LockKind::Fair)
                .wait(LONG_WAIT)
                .on_queued(move |_| q.store(n.load(Ordering::SeqCst), Ordering::SeqCst))
                .acquire(),
        )
        .await
        .expect("B granted");
        let after = a_grants.load(Ordering::SeqCst);
        let queued_at = at_queue.load(Ordering::SeqCst);
        if queued_at != u64::MAX {
            overtaken.push((after - queued_at, asked.elapsed()));
        }
        lease.release().await.expect("B released");
        tokio::time::sleep(Duration::from_millis(fastrand::u64(5..30))).await;
    }
    stop.store(true, Ordering::SeqCst);
    for t in tasks {
        bounded(T, "A ends", t).await.expect("A task");
    }
    eprintln!("A grants while B waited (count, wait): {overtaken:?}");
    let worst = overtaken.iter().map(|(n, _)| *n).max().unwrap_or(0);
    assert!(
        worst <= 16,
        "B's waiter was overtaken by {worst} grants of A: {overtaken:?}"
    );
}
