//! Many distinct names contended at once across two replicas: every name gets a
//! holder on one replica and a waiter on the other, the holders let go, the waiters
//! take over and let go. No request may fail for lack of resources, and afterwards
//! the servers' subscriptions, file descriptors and memory return to their baseline.

use super::rig::LockRedis;
use crate::latchkey::LatchkeyProcess;
use crate::process::{redis_cli, subscribed_channels};
use crate::{RedisCluster, RedisServer};
use futures::stream::{self, StreamExt};
use latchkey_client::{Client, Lease};
use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Options of the `names` command.
#[derive(Debug, Clone, clap::Args)]
pub struct NamesArgs {
    /// Distinct names, each with a holder and a waiter.
    #[arg(long, default_value_t = 20_000)]
    pub count: usize,
    /// A 3-master cluster instead of a standalone Redis.
    #[arg(long)]
    pub cluster: bool,
    /// Connections per replica (each carries at most 10,000 Acquire streams).
    #[arg(long, default_value_t = 8)]
    pub connections: usize,
    /// Rounds of contention: memory the allocator keeps after the first round must
    /// be reused by the next ones, not grow.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
}

/// Acquires in flight at once while filling up.
const IN_FLIGHT: usize = 1000;
/// How long the servers may take to drop subscriptions and descriptors afterwards.
const SETTLE: Duration = Duration::from_secs(60);

/// What one server process uses.
#[derive(Debug, Clone, Copy, Default)]
struct Usage {
    fds: usize,
    rss_kib: u64,
}

fn usage(server: &LatchkeyProcess) -> Usage {
    let pid = server.pid().expect("server running");
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count());
    Usage {
        fds,
        rss_kib: server.rss_kib(),
    }
}

/// How far above its baseline a server's RSS may stay once a round is over: the
/// allocator returns freed memory in the background, not all of it.
const RSS_SLACK_KIB: u64 = 64 * 1024;
/// How long a server gets to give memory back after a round.
const MEMORY_SETTLE: Duration = Duration::from_secs(30);

/// The servers' usage once every RSS is within [`RSS_SLACK_KIB`] of its baseline, or
/// after [`MEMORY_SETTLE`]; and how long that took.
async fn settle(servers: &[LatchkeyProcess; 2], base: &[Usage; 2]) -> ([Usage; 2], Duration) {
    let started = Instant::now();
    loop {
        let now = servers.each_ref().map(usage);
        let settled = now
            .iter()
            .zip(base)
            .all(|(n, b)| n.rss_kib <= b.rss_kib + RSS_SLACK_KIB);
        if settled || started.elapsed() >= MEMORY_SETTLE {
            return (now, started.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The channel every server keeps subscribed, waiters or not.
const FORCE_RELEASE_CHANNEL: &str = "latchkey:force_release";

/// Lock-channel subscriptions on every node (regular and sharded).
fn subscriptions(redis: &LockRedis) -> usize {
    redis
        .live_ports()
        .iter()
        .map(|port| {
            subscribed_channels(*port)
                .iter()
                .filter(|c| *c != FORCE_RELEASE_CHANNEL)
                .count()
        })
        .sum()
}

fn keys(redis: &LockRedis) -> usize {
    redis
        .master_ports()
        .iter()
        .map(|p| redis_cli(*p, None, &["DBSIZE"]).trim().parse::<usize>().unwrap_or(0))
        .sum()
}

/// Runs the scenario and prints what it measured; fails on any failed request, a
/// resource that did not come back, or lock state left in Redis (keys other than the
/// expiring markers, subscriptions other than the force-release channel).
pub async fn run(args: &NamesArgs) -> ExitCode {
    let redis = if args.cluster {
        LockRedis::Cluster(RedisCluster::start(3, 0))
    } else {
        LockRedis::Standalone(RedisServer::start())
    };
    let server_args = vec!["--redis-url".to_owned(), redis.url(), "--no-metrics".to_owned()];
    let servers = [
        LatchkeyProcess::spawn(&server_args),
        LatchkeyProcess::spawn(&server_args),
    ];
    let clients: Vec<Vec<Client>> = servers
        .iter()
        .map(|s| {
            (0..args.connections)
                .map(|_| super::workload::connect(&s.endpoint(), Duration::from_secs(10)))
                .collect()
        })
        .collect();
    // Warm the connections so their descriptors count in the baseline.
    for c in clients.iter().flatten() {
        c.describe("warm-up").await.expect("a replica answers");
    }
    let base = servers.each_ref().map(usage);
    let base_subs = subscriptions(&redis);
    println!(
        "baseline: servers {base:?}, subscriptions {base_subs}, keys {}",
        keys(&redis)
    );
    let mut ok = true;
    for round in 1..=args.rounds {
        println!("round {round}");
        ok &= contend(args, &redis, &servers, &clients, base_subs).await;
        let (after, settled_in) = settle(&servers, &base).await;
        for (b, a) in base.iter().zip(&after) {
            println!(
                "server: descriptors {} (baseline {}), RSS {} MiB {:.1} s after the round (baseline {} MiB)",
                a.fds,
                b.fds,
                a.rss_kib / 1024,
                settled_in.as_secs_f64(),
                b.rss_kib / 1024,
            );
            ok &= a.fds <= b.fds + 4 && a.rss_kib <= b.rss_kib + RSS_SLACK_KIB;
        }
    }
    println!("keys {} (fencing counters expire on their own)", keys(&redis));
    let left = super::leftovers::wait_clean(&redis, SETTLE).await;
    for line in &left {
        println!("left: {line}");
    }
    ok &= left.is_empty();
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// One round: holders, waiters, handover; true when nothing failed and the
/// subscriptions came back to `base_subs`.
async fn contend(
    args: &NamesArgs,
    redis: &LockRedis,
    servers: &[LatchkeyProcess; 2],
    clients: &[Vec<Client>],
    base_subs: usize,
) -> bool {
    let started = Instant::now();
    let names: Vec<String> = (0..args.count).map(|i| format!("many/{i}")).collect();
    let client_for = |replica: usize, i: usize| clients[replica][i % args.connections].clone();
    let holder_clients: Vec<Client> = (0..names.len()).map(|i| client_for(i % 2, i)).collect();
    let holders = take_all(names.clone(), holder_clients, None).await;
    let peak_holders = servers.each_ref().map(usage);
    let queued = Arc::new(AtomicUsize::new(0));
    let waiters = {
        let names = names.clone();
        let queued = queued.clone();
        let client_for = |i: usize| client_for((i + 1) % 2, i);
        let clients: Vec<Client> = (0..names.len()).map(client_for).collect();
        tokio::spawn(async move { take_all(names, clients, Some(queued)).await })
    };
    let all_queued = wait_for(Duration::from_secs(120), || {
        queued.load(Ordering::Relaxed) >= args.count
    })
    .await;
    let peak = servers.each_ref().map(usage);
    let peak_subs = subscriptions(redis);
    println!(
        "{} holders and {} queued waiters after {:?}: servers {peak:?} (holders only {peak_holders:?}), \
         subscriptions {peak_subs}",
        holders.iter().filter(|h| h.is_ok()).count(),
        queued.load(Ordering::Relaxed),
        started.elapsed()
    );
    let released = release_all(holders).await;
    let waiters = waiters.await.expect("waiters task");
    let granted = waiters.iter().filter(|w| w.is_ok()).count();
    let failures = release_all(waiters).await + released;
    println!("handed over {granted} of {} after {:?}", args.count, started.elapsed());
    let settled = wait_for(SETTLE, || subscriptions(redis) <= base_subs).await;
    println!("failures {failures}, all queued {all_queued}, subscriptions back {settled}");
    all_queued && failures == 0 && granted == args.count && settled
}

type Outcome = Result<Lease, latchkey_client::Error>;

/// Acquires every name (waiting up to two minutes), at most `IN_FLIGHT` requests at a
/// time that are neither granted nor queued yet; counts the queued ones.
async fn take_all(names: Vec<String>, clients: Vec<Client>, queued: Option<Arc<AtomicUsize>>) -> Vec<Outcome> {
    let gate = Arc::new(tokio::sync::Semaphore::new(IN_FLIGHT));
    let mut tasks = Vec::with_capacity(names.len());
    for (name, client) in names.into_iter().zip(clients) {
        let permit = gate.clone().acquire_owned().await.expect("the gate stays open");
        let queued = queued.clone();
        tasks.push(tokio::spawn(async move {
            // Given back once queued, or with the builder once granted.
            let mut permit = Some(permit);
            client
                .lock(name)
                .wait(Duration::from_secs(120))
                .on_queued(move |_| {
                    if let Some(q) = &queued {
                        q.fetch_add(1, Ordering::Relaxed);
                    }
                    permit.take();
                })
                .acquire()
                .await
        }));
    }
    let mut out = Vec::with_capacity(tasks.len());
    for task in tasks {
        out.push(
            task.await
                .unwrap_or_else(|e| Err(latchkey_client::Error::Protocol(e.to_string()))),
        );
    }
    out
}

/// Releases every lease; returns how many requests had failed or failed to release.
async fn release_all(leases: Vec<Outcome>) -> usize {
    let results = stream::iter(leases.into_iter().map(|l| async move {
        match l {
            Ok(lease) => lease.release().await.is_err(),
            Err(e) => {
                eprintln!("failed: {e}");
                true
            }
        }
    }))
    .buffer_unordered(IN_FLIGHT)
    .collect::<Vec<bool>>()
    .await;
    results.into_iter().filter(|failed| *failed).count()
}

async fn wait_for(limit: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    while !done() {
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    true
}
