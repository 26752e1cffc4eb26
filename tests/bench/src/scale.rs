//! The scale scenarios of one latchkey server: `many-leases` (N streams held at once:
//! server memory per lease, Redis calls the watchdog spends, no lease lost) and
//! `many-names` (N distinct names contended at once: failures, and subscriptions and
//! memory back to their baseline afterwards).

use fred::prelude::*;
use latchkey_client::{Client, Lease};
use latchkey_tests::{LatchkeyProcess, RedisServer};
use std::time::{Duration, Instant};

/// Streams per client connection (the server's default bound is 10 000).
const STREAMS_PER_CONNECTION: usize = 5_000;
/// Acquires in flight at once while filling up.
const IN_FLIGHT: usize = 256;

/// What `many_leases` measured.
#[derive(Debug)]
pub struct Leases {
    /// Leases asked for.
    pub asked: usize,
    /// Leases held.
    pub held: usize,
    /// Server RSS growth per held lease, in bytes, once every lease is held.
    pub rss_per_lease: f64,
    /// Server RSS growth per held lease at its height, in bytes: the server's
    /// high-water mark over the fill and the hold, its renewal rounds' own copies of
    /// the leases' keys included (the server is fresh, so its mark is the run's).
    pub peak_rss_per_lease: f64,
    /// Renewal script calls per renewal period, per 100 leases.
    pub calls_per_100_per_period: f64,
    /// Renewal script calls per second while the leases were held.
    pub calls_per_sec: f64,
    /// Redis commands per second while the leases were held: the scripts and every
    /// command they ran (Redis counts both).
    pub commands_per_sec: f64,
    /// The share of one core Redis spent while the leases were held, in percent.
    pub redis_cpu_percent: f64,
    /// Leases reported lost while held (must be 0).
    pub lost: usize,
    /// Seconds to take all the leases.
    pub fill_secs: f64,
    /// Upper bound of the slowest renewal round (its histogram bucket), in ms.
    pub slowest_round_ms: f64,
    /// The longest any lease went without a confirmation by Redis, in ms (the server's
    /// `latchkey_watchdog_renewal_gap_max_seconds`): the period and how late its
    /// renewal came (the watchdog's lag).
    pub longest_gap_ms: f64,
    /// The renewal period, in ms.
    pub period_ms: f64,
}

/// Holds `n` leases on one server whose watchdog timeout is `timeout`, for three
/// renewal periods.
pub async fn many_leases(redis: &RedisServer, server: &LatchkeyProcess, n: usize, timeout: Duration) -> Leases {
    let clients = clients(server, n).await;
    let before = rss(server);
    let started = Instant::now();
    // Names of this size's own: a release of the size before that failed leaves its
    // names held for a lease yet, which would be blamed on this size.
    let leases = take_all(&clients, n, |i| format!("lease:{n}:{i}")).await;
    let fill_secs = started.elapsed().as_secs_f64();
    let after = rss(server);
    let redis_client = latchkey_tests::redis_client(&redis.url()).await;
    let redis_pid: Vec<u32> = redis.pid().into_iter().collect();
    let (calls_before, commands_before) = command_calls(&redis_client).await;
    let redis_cpu_before = crate::scenarios::cpu_micros(&redis_pid);
    let periods = 3;
    let window = Instant::now();
    tokio::time::sleep(timeout / 3 * periods).await;
    let (calls_after, commands_after) = command_calls(&redis_client).await;
    let peak = server.peak_rss_kib() * 1024;
    let redis_cpu = crate::scenarios::cpu_micros(&redis_pid) - redis_cpu_before;
    let window = window.elapsed().as_secs_f64();
    let calls = calls_after - calls_before;
    let lost = leases.iter().filter(|l| l.is_lost()).count();
    let held = leases.len();
    let slowest_round_ms = server.metrics_port().map_or(f64::NAN, slowest_round) * 1000.0;
    let gap = |port| latchkey_tests::metric(&latchkey_tests::scrape_metrics(port), GAP_GAUGE);
    let longest_gap_ms = server.metrics_port().and_then(gap).unwrap_or(f64::NAN) * 1000.0;
    if lost > 0 || held < n {
        eprintln!("many-leases: server log tail:\n{}", server.log_tail());
    }
    release_all(leases).await;
    Leases {
        asked: n,
        held,
        rss_per_lease: (after.saturating_sub(before)) as f64 / held.max(1) as f64,
        peak_rss_per_lease: (peak.saturating_sub(before)) as f64 / held.max(1) as f64,
        calls_per_100_per_period: calls as f64 / f64::from(periods) / (held.max(1) as f64 / 100.0),
        calls_per_sec: calls as f64 / window,
        commands_per_sec: (commands_after - commands_before) as f64 / window,
        redis_cpu_percent: redis_cpu as f64 / 1e6 / window * 100.0,
        lost,
        fill_secs,
        slowest_round_ms,
        longest_gap_ms,
        period_ms: (timeout / 3).as_secs_f64() * 1000.0,
    }
}

/// The server's gauge of the longest time a lease went without a confirmation.
const GAP_GAUGE: &str = "latchkey_watchdog_renewal_gap_max_seconds";

/// The upper bound, in seconds, of the smallest `latchkey_watchdog_round_seconds`
/// bucket that holds every round so far.
fn slowest_round(metrics_port: u16) -> f64 {
    let text = latchkey_tests::scrape_metrics(metrics_port);
    let buckets: Vec<(f64, u64)> = text
        .lines()
        .filter_map(|l| l.strip_prefix("latchkey_watchdog_round_seconds_bucket{le=\""))
        .filter_map(|l| {
            let (le, count) = l.split_once("\"} ")?;
            Some((le.parse().ok()?, count.trim().parse().ok()?))
        })
        .collect();
    let total = buckets.iter().map(|b| b.1).max().unwrap_or(0);
    buckets.iter().find(|b| b.1 == total).map_or(f64::NAN, |b| b.0)
}

/// What `many_names` measured.
#[derive(Debug, Clone, Copy)]
pub struct Names {
    /// Names contended.
    pub names: usize,
    /// Acquires that failed, in both bursts.
    pub failures: usize,
    /// Whether every waiter of both bursts listened before the holders let go: only then
    /// was every name contended, and the failures count means what it says.
    pub contended: bool,
    /// Redis pub/sub channels with a subscriber: before, while waiting, and after (the
    /// more of the two bursts' counts).
    pub channels: (usize, usize, usize),
    /// Server RSS in KiB: before the bench's connections opened, before the run, after
    /// it (the connections still open), and after they closed.
    pub rss_kib: (u64, u64, u64, u64),
    /// The server's peak RSS in KiB through the first burst (the server is fresh, so its
    /// high-water mark is the burst's): what a burst needs, where the figures above are
    /// what it leaves.
    pub peak_kib: u64,
    /// Server RSS in KiB after a second burst like the first closed its connections:
    /// what a burst leaves once the server has seen one (the first burst's residue
    /// counts the code it ran first and the allocator's metadata for its peak).
    pub rss_again_kib: u64,
    /// The server's heap before the bench's connections opened and after they closed:
    /// what of the RSS left is live data, and what the allocator keeps.
    pub heap: (Heap, Heap),
}

/// The server's heap in KiB, from its metrics.
#[derive(Debug, Clone, Copy)]
pub struct Heap {
    /// In live allocations.
    pub live: u64,
    /// Resident: the live allocations, the allocator's metadata, pages not yet returned.
    pub resident: u64,
    /// The allocator's metadata, which grows with the most memory the heap spanned.
    pub metadata: u64,
}

/// Contends `n` names at once (a holder and a waiter each, then hand-off), twice.
pub async fn many_names(redis: &RedisServer, server: &LatchkeyProcess, n: usize) -> Names {
    // The heap first: its scrape is the metrics endpoint's first, whose code and
    // buffers the baseline counts, not the burst's residue.
    let heap_unconnected = heap(server).await;
    let rss_unconnected = rss(server);
    let first = burst(redis, server, n, rss_unconnected).await;
    let peak_kib = server.peak_rss_kib();
    let heap_closed = heap(server).await;
    let second = burst(redis, server, n, rss_unconnected).await;
    Names {
        names: n,
        failures: first.failures + second.failures,
        contended: first.contended && second.contended,
        channels: (
            first.channels.0,
            first.channels.1,
            first.channels.2.max(second.channels.2),
        ),
        rss_kib: (
            rss_unconnected / 1024,
            first.rss_before / 1024,
            first.rss_after / 1024,
            first.rss_closed / 1024,
        ),
        peak_kib,
        rss_again_kib: second.rss_closed / 1024,
        heap: (heap_unconnected, heap_closed),
    }
}

/// What one burst of `many_names` measured (RSS in bytes).
struct Burst {
    failures: usize,
    contended: bool,
    channels: (usize, usize, usize),
    rss_before: u64,
    rss_after: u64,
    rss_closed: u64,
}

/// One burst on connections of its own, closed at its end; RSS settles towards
/// `rss_unconnected` once they are.
async fn burst(redis: &RedisServer, server: &LatchkeyProcess, n: usize, rss_unconnected: u64) -> Burst {
    let clients = clients(server, 2 * n).await;
    let redis_client = latchkey_tests::redis_client(&redis.url()).await;
    let channels_before = channel_count(&redis_client).await;
    let rss_before = rss(server);
    let holders = take_all(&clients, n, |i| format!("name:{i}")).await;
    let waiters: Vec<_> = (0..n)
        .map(|i| {
            let client = clients[(n + i) % clients.len()].clone();
            tokio::spawn(async move {
                client
                    .lock(format!("name:{i}"))
                    .wait(Duration::from_secs(120))
                    .acquire()
                    .await
            })
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut waiting = 0;
    while Instant::now() < deadline {
        waiting = channel_count(&redis_client).await;
        if all_waiting(waiting, channels_before, n) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let contended = all_waiting(waiting, channels_before, n);
    if !contended {
        eprintln!("many-names: {waiting} channels after 60 s, {channels_before} before: not every waiter listens");
    }
    let mut failures = n - holders.len();
    if failures > 0 {
        eprintln!("many-names: {failures} holders were not granted");
    }
    release_all(holders).await;
    let mut granted = Vec::with_capacity(n);
    for w in waiters {
        match w.await {
            Ok(Ok(lease)) => granted.push(lease),
            Ok(Err(e)) => {
                if failures == 0 {
                    eprintln!("many-names: a waiter failed: {e}");
                }
                failures += 1;
            }
            Err(_) => failures += 1,
        }
    }
    release_all(granted).await;
    // Unsubscribing is asynchronous: give the hub a moment to catch up.
    let mut after = usize::MAX;
    for _ in 0..50 {
        after = channel_count(&redis_client).await;
        if after <= channels_before {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    if failures > 0 {
        eprintln!("many-names: server log tail:\n{}", server.log_tail());
    }
    let rss_after = settled_rss(server, rss_before).await;
    drop(clients);
    let rss_closed = settled_rss(server, rss_unconnected).await;
    Burst {
        failures,
        contended,
        channels: (channels_before, waiting, after),
        rss_before,
        rss_after,
        rss_closed,
    }
}

/// Channels a waiter of this scenario subscribes: its lock's unlock channel, and its
/// server's presence channel of the lock (each waiter may claim: a mutex, its stream's
/// lease).
const CHANNELS_PER_WAITER: usize = 2;

/// Whether `count` channels (`before` of them there already) are every one of `n`
/// waiters' subscriptions: only then is every name contended when the holders go.
fn all_waiting(count: usize, before: usize, n: usize) -> bool {
    count >= before + CHANNELS_PER_WAITER * n
}

async fn clients(server: &LatchkeyProcess, streams: usize) -> Vec<Client> {
    let mut out = Vec::new();
    for _ in 0..streams.div_ceil(STREAMS_PER_CONNECTION).max(1) {
        out.push(Client::connect(&server.endpoint()).await.expect("connect to latchkey"));
    }
    out
}

async fn take_all(clients: &[Client], n: usize, name: impl Fn(usize) -> String) -> Vec<Lease> {
    let mut leases = Vec::with_capacity(n);
    let mut i = 0;
    let mut failed = false;
    while i < n {
        let batch: Vec<_> = (i..(i + IN_FLIGHT).min(n))
            .map(|j| clients[j % clients.len()].lock(name(j)).try_once().acquire())
            .collect();
        i += batch.len();
        for result in futures::future::join_all(batch).await {
            match result {
                Ok(lease) => leases.push(lease),
                // The first failure, which says why the others failed too.
                Err(e) if !failed => {
                    eprintln!("acquire failed: {e}");
                    failed = true;
                }
                Err(_) => {}
            }
        }
    }
    leases
}

/// Releases every lease, saying how many releases failed (their names stay held for a
/// lease yet).
async fn release_all(leases: Vec<Lease>) {
    let mut failed = 0;
    let mut it = leases.into_iter().peekable();
    while it.peek().is_some() {
        let batch: Vec<_> = it.by_ref().take(IN_FLIGHT).map(Lease::release).collect();
        failed += futures::future::join_all(batch)
            .await
            .iter()
            .filter(|r| r.is_err())
            .count();
    }
    if failed > 0 {
        eprintln!("{failed} releases failed");
    }
}

/// The server's RSS once freed memory has gone back to the system (the allocator
/// returns it in the background, over its 10 s decay): sampled until within 4 MiB of
/// `baseline`, or no lower for 5 s, for at most 60 s.
async fn settled_rss(server: &LatchkeyProcess, baseline: u64) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(60);
    let (mut lowest, mut since) = (u64::MAX, Instant::now());
    loop {
        let now = rss(server);
        if now < lowest {
            (lowest, since) = (now, Instant::now());
        }
        if now <= baseline + (4 << 20) || since.elapsed() >= Duration::from_secs(5) || Instant::now() >= deadline {
            return now;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The server's resident memory in bytes.
fn rss(server: &LatchkeyProcess) -> u64 {
    server.rss_kib() * 1024
}

/// The server's heap from its metrics, sampled every 2 s.
async fn heap(server: &LatchkeyProcess) -> Heap {
    // Past one sampling period, so the figures are from after what came before.
    tokio::time::sleep(Duration::from_millis(2100)).await;
    let text = server
        .metrics_port()
        .map(latchkey_tests::scrape_metrics)
        .unwrap_or_default();
    let gauge = |name| latchkey_tests::metric(&text, name).map_or(0, |bytes| bytes as u64 / 1024);
    Heap {
        live: gauge("latchkey_heap_allocated_bytes"),
        resident: gauge("latchkey_heap_resident_bytes"),
        metadata: gauge("latchkey_heap_metadata_bytes"),
    }
}

/// EVALSHA calls Redis has served so far, and commands of every kind but INFO (those
/// scripts ran counted too).
async fn command_calls(client: &fred::prelude::Client) -> (u64, u64) {
    let info: String = client
        .info(Some(fred::types::InfoKind::CommandStats))
        .await
        .unwrap_or_default();
    let calls = |line: &str| -> Option<(String, u64)> {
        let (name, stats) = line.strip_prefix("cmdstat_")?.split_once(":calls=")?;
        Some((name.to_owned(), stats.split(',').next()?.parse().ok()?))
    };
    let counted: Vec<(String, u64)> = info.lines().filter_map(calls).collect();
    let evalsha = counted.iter().find(|(name, _)| name == "evalsha").map_or(0, |c| c.1);
    // The bench's own INFO calls are not the watchdog's.
    let all = counted.iter().filter(|(name, _)| name != "info").map(|c| c.1).sum();
    (evalsha, all)
}

/// Pub/sub channels with at least one subscriber.
async fn channel_count(client: &fred::prelude::Client) -> usize {
    let channels: Vec<String> = client.pubsub_channels("*").await.unwrap_or_default();
    channels.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each waiter subscribes two channels: half the count is half the waiters.
    #[test]
    fn every_waiter_listens_only_with_both_its_channels() {
        assert!(!all_waiting(20_013, 13, 20_000));
        assert!(!all_waiting(25_285, 13, 20_000));
        assert!(all_waiting(40_013, 13, 20_000));
    }
}
