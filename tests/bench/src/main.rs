//! `latchkey-bench`: latchkey and its peers side by side in one run on one machine —
//! the Redisson `RLock` protocol driven directly (the Redis ceiling for these scripts),
//! etcd's v3 lock, the `rslock` Redlock client, and latchkey (mutex and fair, one and
//! two server replicas), beside the gRPC hop alone (`grpc-floor`). Prints a table, then
//! each target with its ratio to the peer it is set against in the same run, and writes
//! JSON lines.

mod floor;
mod peers;
mod scale;
mod scenarios;
mod script_cost;
mod targets;

use clap::Parser;
use floor::Floor;
use latchkey_client::LockKind;
use latchkey_tests::{free_port, LatchkeyProcess, RedisServer};
use peers::{Peer, Redisson};
use scenarios::{Outcome, Shape};
use std::io::Write;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Benchmark flags.
#[derive(Debug, Parser)]
#[command(name = "latchkey-bench")]
struct Args {
    /// Measured time per run.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// Warm-up before measuring.
    #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
    warmup: Duration,
    /// Concurrent tasks (repeat or comma-separate for several runs).
    #[arg(long, value_delimiter = ',', default_value = "16,64")]
    concurrency: Vec<usize>,
    /// Scenarios: uncontended, hot, cross-replica, many-leases, many-names, script-cost.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "uncontended,hot,cross-replica,many-leases,many-names,script-cost"
    )]
    scenarios: Vec<String>,
    /// Peers: latchkey, latchkey-fair, latchkey-2, latchkey-fair-2, grpc-floor, redisson,
    /// etcd, rslock.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "latchkey,latchkey-fair,latchkey-2,latchkey-fair-2,grpc-floor,redisson,etcd,rslock"
    )]
    peers: Vec<String>,
    /// Leases held at once in `many-leases` (repeat or comma-separate).
    #[arg(long, value_delimiter = ',', default_value = "10000")]
    leases: Vec<usize>,
    /// The scale server's watchdog timeout (its default: 30s); `many-leases` holds for
    /// three renewal periods of it.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    scale_watchdog_timeout: Duration,
    /// Names contended at once in `many-names`.
    #[arg(long, default_value_t = 20_000)]
    names: usize,
    /// The servers' `--worker-threads`: on this 2-core machine the server shares the
    /// cores with Redis and the bench's own tasks, and one thread serves more than two
    /// (0: one per core, the server's default).
    #[arg(long, default_value_t = 1)]
    server_worker_threads: usize,
    /// Runs of each row; the row shows the run of median cycles per second, so one
    /// disturbed run does not make the row.
    #[arg(long, default_value_t = 1)]
    repeat: usize,
    /// Where the JSON lines go.
    #[arg(long, default_value = "target/bench/results.jsonl")]
    json: std::path::PathBuf,
    /// Serve the `grpc-floor` peer instead of benchmarking (the bench starts itself so).
    #[arg(long, hide = true)]
    serve_floor: bool,
}

/// The processes a run needs, stopped on drop.
struct Deployment {
    redis: RedisServer,
    servers: Vec<LatchkeyProcess>,
    floor: Option<Floor>,
    etcd: Option<(Child, u16, tempfile_dir::Dir)>,
}

mod tempfile_dir {
    //! A scratch directory removed on drop.
    /// The directory.
    pub struct Dir(pub std::path::PathBuf);
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

impl Deployment {
    /// Every process of the run (the bench, Redis, etcd, the latchkey servers and the
    /// floor), the gRPC servers among them, and the stores.
    fn charged(&self) -> scenarios::Charged {
        let mut store: Vec<u32> = self.redis.pid().into_iter().collect();
        store.extend(self.etcd.as_ref().map(|(child, ..)| child.id()));
        let mut servers: Vec<u32> = self.servers.iter().filter_map(LatchkeyProcess::pid).collect();
        servers.extend(self.floor.as_ref().map(Floor::pid));
        let mut all = vec![std::process::id()];
        all.extend(&servers);
        all.extend(&store);
        scenarios::Charged { all, servers, store }
    }
}

impl Drop for Deployment {
    fn drop(&mut self) {
        if let Some((child, ..)) = &mut self.etcd {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// jemalloc, as the server uses: every peer's client runs in this process, and
/// glibc's allocator spent a fifth of its CPU (arena locks between the two worker threads).
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() {
    let args = Args::parse();
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    // The floor runs as the latchkey servers do.
    if args.serve_floor && args.server_worker_threads > 0 {
        runtime.worker_threads(args.server_worker_threads);
    }
    let runtime = runtime.enable_all().build().expect("a tokio runtime");
    if args.serve_floor {
        if let Err(e) = runtime.block_on(floor::serve()) {
            eprintln!("grpc-floor: {e}");
            std::process::exit(1);
        }
        return;
    }
    if let Some(signal) = runtime.block_on(until_stopped(bench(args))) {
        // Every process the bench started was stopped as the run was dropped.
        eprintln!("latchkey-bench: stopped by {signal}");
        std::process::exit(1);
    }
}

/// Runs `bench` unless SIGINT, SIGTERM or SIGHUP (its terminal closed) comes first,
/// which is then named. Stopped so, the run is dropped, and with it every process it
/// started (Redis, etcd, the servers, the floor): these signals' default action would
/// leave them running for the next run to compete with, uncounted, unless the signal
/// reached them too (a Ctrl-C does; a `kill` of the bench alone does not).
async fn until_stopped(bench: impl std::future::Future<Output = ()>) -> Option<&'static str> {
    use tokio::signal::unix::{signal, SignalKind};
    let (mut int, mut term, mut hup) = (
        signal(SignalKind::interrupt()).expect("a SIGINT handler"),
        signal(SignalKind::terminate()).expect("a SIGTERM handler"),
        signal(SignalKind::hangup()).expect("a SIGHUP handler"),
    );
    tokio::select! {
        () = bench => None,
        _ = int.recv() => Some("SIGINT"),
        _ = term.recv() => Some("SIGTERM"),
        _ = hup.recv() => Some("SIGHUP"),
    }
}

async fn bench(args: Args) {
    let deployment = deploy(&args);
    if let Some(parent) = args.json.parent() {
        let _ = std::fs::create_dir_all(parent);
    }
    let mut json = std::fs::File::create(&args.json).expect("create the JSON lines file");
    println!("{}", header());
    let charged = deployment.charged();
    let mut run = targets::Run::default();
    let row_scenarios = args
        .scenarios
        .iter()
        .filter(|s| !s.starts_with("many-") && *s != "script-cost");
    for scenario in row_scenarios {
        for (i, &c) in args.concurrency.iter().enumerate() {
            // Cross-replica runs two tasks whatever the concurrency: once is enough.
            if scenario == "cross-replica" && i > 0 {
                continue;
            }
            let tasks = if scenario == "cross-replica" { 2 } else { c };
            for (shape, hold) in plan(scenario) {
                let mut connected = Vec::new();
                for label in peers_for(scenario, &args.peers) {
                    match connect(&label, &deployment, c).await {
                        Some(peers) => connected.push((label, peers, Vec::new())),
                        None => eprintln!("{label}: could not connect; its {scenario} rows are left out"),
                    }
                }
                // The peers take turns within each repeat: a machine whose speed drifts
                // over the minutes a row's repeats take moves every peer's runs alike.
                let times = (hold, args.warmup, args.duration);
                for _ in 0..args.repeat.max(1) {
                    for (_, peers, outcomes) in &mut connected {
                        outcomes.push(scenarios::run(peers, tasks, shape, times, &charged).await);
                    }
                }
                for (label, _, outcomes) in connected {
                    let row = |outcome, longest_wait_us| Row {
                        scenario,
                        peer: &label,
                        tasks,
                        hold,
                        outcome,
                        longest_wait_us,
                    };
                    let repeats = (outcomes.iter()).map(|o| row(o, o.longest_wait_us).figures()).collect();
                    // Each repeat's own line too, so a verdict's figures (read repeat by
                    // repeat) and a repeat the shown run outvoted can be found.
                    if outcomes.len() > 1 {
                        for (i, o) in outcomes.iter().enumerate() {
                            write_json(&mut json, &repeat_json(i + 1, &row(o, o.longest_wait_us).json()));
                        }
                    }
                    let (outcome, longest_wait_us) = shown_run(outcomes.clone());
                    let row = row(&outcome, longest_wait_us);
                    println!("{}", row.table());
                    write_json(&mut json, &row.json());
                    run.add_repeated(scenario, &label, tasks, hold.as_millis(), row.figures(), repeats);
                }
            }
        }
    }
    run_scale(&args, &deployment, &mut json, &mut run).await;
    if args.scenarios.iter().any(|s| s == "script-cost") {
        for cost in script_cost::measure(&args.peers).await {
            println!("{}", cost.line());
            write_json(&mut json, &cost.json());
        }
    }
    println!("\nTargets (ratios between peers of this run, taken within each repeat; the median repeat)");
    for verdict in run.verdicts() {
        println!("{}", verdict.line());
        write_json(&mut json, &verdict.json());
    }
    let costs = run.costs();
    if !costs.is_empty() {
        println!("\nCost per cycle (CPU of every process of the deployment; server: the gRPC servers; store: Redis and etcd)");
        costs.iter().for_each(|line| println!("{line}"));
    }
    println!("\nJSON lines: {}", args.json.display());
}

/// Writes one JSON line; a figure that could not be read (NaN) or has no bound (a
/// starved task's fairness) is `null`, which JSON has, where NaN and inf it has not.
fn write_json(out: &mut std::fs::File, line: &str) {
    let line = [":NaN", ":inf", ":-inf"]
        .iter()
        .fold(line.to_owned(), |l, bad| l.replace(bad, ":null"));
    writeln!(out, "{line}").expect("write a JSON line");
}

/// The scale scenarios, each on a server of its own (metrics on, for the watchdog's
/// round times).
async fn run_scale(args: &Args, d: &Deployment, json: &mut std::fs::File, run: &mut targets::Run) {
    let timeout = args.scale_watchdog_timeout;
    let spawn = || {
        LatchkeyProcess::spawn(&[
            "--redis-url".to_owned(),
            d.redis.url(),
            "--worker-threads".to_owned(),
            args.server_worker_threads.to_string(),
            "--watchdog-timeout".to_owned(),
            humantime::format_duration(timeout).to_string(),
            "--max-streams".to_owned(),
            "1000000".to_owned(),
        ])
    };
    if args.scenarios.iter().any(|s| s == "many-leases") {
        for &n in &args.leases {
            let server = spawn();
            let r = scale::many_leases(&d.redis, &server, n, timeout).await;
            run.add_leases(&r);
            println!(
                "many-leases    latchkey  held {:>7}  fill {:>6.1}s  RSS/lease {:>7.0} B (peak {:.0} B)  renewal calls/100 leases/period {:>6.2}  Redis calls/s {:.1} (commands/s {:.0}, CPU {:.1} %)  slowest round ≤ {:.0} ms, longest gap {:.0} ms of a {:.0} ms period  lost {}",
                r.held, r.fill_secs, r.rss_per_lease, r.peak_rss_per_lease, r.calls_per_100_per_period, r.calls_per_sec, r.commands_per_sec, r.redis_cpu_percent, r.slowest_round_ms, r.longest_gap_ms, r.period_ms, r.lost
            );
            let line = format!(
                "{{\"scenario\":\"many-leases\",\"peer\":\"latchkey\",\"held\":{},\"fill_secs\":{:.2},\"rss_per_lease_bytes\":{:.0},\"peak_rss_per_lease_bytes\":{:.0},\"renewal_calls_per_100_leases_per_period\":{:.3},\"renewal_calls_per_sec\":{:.2},\"redis_commands_per_sec\":{:.1},\"redis_cpu_percent\":{:.2},\"slowest_round_ms\":{:.1},\"longest_gap_ms\":{:.1},\"period_ms\":{:.0},\"lost\":{}}}",
                r.held, r.fill_secs, r.rss_per_lease, r.peak_rss_per_lease, r.calls_per_100_per_period, r.calls_per_sec, r.commands_per_sec, r.redis_cpu_percent, r.slowest_round_ms, r.longest_gap_ms, r.period_ms, r.lost
            );
            write_json(json, &line);
        }
    }
    if args.scenarios.iter().any(|s| s == "many-names") {
        let server = spawn();
        let r = scale::many_names(&d.redis, &server, args.names).await;
        run.set_names(&r);
        println!(
            "many-names     latchkey  names {:>7}  failures {}  channels before/waiting/after {}/{}/{}  RSS KiB unconnected/before/after/closed {}/{}/{}/{} peak {} closed after a second burst {}  heap KiB live/resident/metadata unconnected {}/{}/{} closed {}/{}/{}",
            r.names, r.failures, r.channels.0, r.channels.1, r.channels.2, r.rss_kib.0, r.rss_kib.1, r.rss_kib.2, r.rss_kib.3,
            r.peak_kib, r.rss_again_kib, r.heap.0.live, r.heap.0.resident, r.heap.0.metadata, r.heap.1.live, r.heap.1.resident, r.heap.1.metadata
        );
        let line = format!(
            "{{\"scenario\":\"many-names\",\"peer\":\"latchkey\",\"names\":{},\"failures\":{},\"contended\":{},\"channels_before\":{},\"channels_waiting\":{},\"channels_after\":{},\"rss_kib_unconnected\":{},\"rss_kib_before\":{},\"rss_kib_after\":{},\"rss_kib_closed\":{},\"rss_kib_peak\":{},\"rss_kib_closed_again\":{},\"heap_kib_live_unconnected\":{},\"heap_kib_resident_unconnected\":{},\"heap_kib_metadata_unconnected\":{},\"heap_kib_live_closed\":{},\"heap_kib_resident_closed\":{},\"heap_kib_metadata_closed\":{}}}",
            r.names, r.failures, r.contended, r.channels.0, r.channels.1, r.channels.2, r.rss_kib.0, r.rss_kib.1, r.rss_kib.2, r.rss_kib.3,
            r.peak_kib, r.rss_again_kib, r.heap.0.live, r.heap.0.resident, r.heap.0.metadata, r.heap.1.live, r.heap.1.resident, r.heap.1.metadata
        );
        write_json(json, &line);
    }
}

/// Runs of a scenario: its name shape and hold times.
fn plan(scenario: &str) -> Vec<(Shape, Duration)> {
    match scenario {
        "uncontended" => vec![(Shape::Uncontended, Duration::ZERO)],
        "hot" => vec![(Shape::Hot, Duration::ZERO), (Shape::Hot, Duration::from_millis(1))],
        // A hold too: only a hold leaves an overlap time to be seen (see `no_overlap`).
        "cross-replica" => vec![(Shape::Hot, Duration::ZERO), (Shape::Hot, Duration::from_millis(1))],
        other => panic!("unknown scenario {other}"),
    }
}

fn peers_for(scenario: &str, wanted: &[String]) -> Vec<String> {
    if scenario == "cross-replica" {
        return vec!["latchkey-2".to_owned()];
    }
    wanted.to_vec()
}

fn deploy(args: &Args) -> Deployment {
    let redis = RedisServer::start();
    let want = |p: &str| args.peers.iter().any(|x| x == p);
    let replicas =
        if want("latchkey-2") || want("latchkey-fair-2") || args.scenarios.iter().any(|s| s == "cross-replica") {
            2
        } else {
            1
        };
    let servers = (0..replicas)
        .map(|_| {
            LatchkeyProcess::spawn(&[
                "--redis-url".to_owned(),
                redis.url(),
                "--worker-threads".to_owned(),
                args.server_worker_threads.to_string(),
            ])
        })
        .collect();
    let floor = want("grpc-floor")
        .then(|| Floor::spawn(args.server_worker_threads))
        .flatten();
    let etcd = want("etcd").then(start_etcd).flatten();
    Deployment {
        redis,
        servers,
        floor,
        etcd,
    }
}

/// Starts etcd (Debian's etcd-server) on free loopback ports, if it is installed.
fn start_etcd() -> Option<(Child, u16, tempfile_dir::Dir)> {
    let binary = ["/usr/bin/etcd", "/usr/local/bin/etcd"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())?;
    let (client, peer) = (free_port(), free_port());
    let dir = std::env::temp_dir().join(format!("latchkey-bench-etcd-{client}"));
    let child = Command::new(binary)
        .args([
            "--data-dir",
            dir.to_str()?,
            "--listen-client-urls",
            &format!("http://127.0.0.1:{client}"),
        ])
        .args(["--advertise-client-urls", &format!("http://127.0.0.1:{client}")])
        .args(["--listen-peer-urls", &format!("http://127.0.0.1:{peer}")])
        .args(["--initial-advertise-peer-urls", &format!("http://127.0.0.1:{peer}")])
        .args(["--initial-cluster", &format!("default=http://127.0.0.1:{peer}")])
        // Every cycle adds two revisions: compacted as a deployment would be (etcd
        // compacts every five minutes in this mode, to the last 1 000 revisions), so that
        // its history does not grow through the whole run and slow its later rows.
        .args([
            "--auto-compaction-mode",
            "revision",
            "--auto-compaction-retention",
            "1000",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    Some((child, client, tempfile_dir::Dir(dir)))
}

/// Connections for one peer, spread over `c` tasks (a connection per 16 tasks).
async fn connect(label: &str, d: &Deployment, c: usize) -> Option<Vec<Peer>> {
    let conns = c.div_ceil(16).max(1);
    let mut peers = Vec::with_capacity(conns);
    for i in 0..conns {
        let peer = match label {
            "latchkey" | "latchkey-fair" | "latchkey-2" | "latchkey-fair-2" => {
                let server = if two_servers(label) {
                    &d.servers[i % d.servers.len()]
                } else {
                    &d.servers[0]
                };
                let kind = kind_of(label);
                Peer::Latchkey {
                    client: latchkey_client::Client::connect(&server.endpoint()).await.ok()?,
                    kind,
                }
            }
            "grpc-floor" => Peer::Latchkey {
                client: latchkey_client::Client::connect(&d.floor.as_ref()?.endpoint())
                    .await
                    .ok()?,
                kind: LockKind::Mutex,
            },
            "redisson" => Peer::Redisson(Redisson::connect(&d.redis.url()).await.ok()?),
            "etcd" => {
                let (_, port, _) = d.etcd.as_ref()?;
                Peer::Etcd(Box::new(etcd_connect(*port).await?), Default::default())
            }
            "rslock" => {
                let mut lm = rslock::LockManager::new(vec![d.redis.url()]);
                lm.set_retry(u32::MAX, Duration::from_millis(10));
                Peer::Rslock(std::sync::Arc::new(lm))
            }
            other => panic!("unknown peer {other}"),
        };
        peers.push(peer);
    }
    // The two-server peers alternate tasks between the replicas: task i uses peers[i % n].
    if two_servers(label) && peers.len() < 2 {
        let server = &d.servers[1 % d.servers.len()];
        let client = latchkey_client::Client::connect(&server.endpoint()).await.ok()?;
        peers.push(Peer::Latchkey {
            client,
            kind: kind_of(label),
        });
    }
    Some(peers)
}

/// A repeat's JSON object: the row's, marked with the repeat's number (from 1); the
/// row's shown run has no mark.
fn repeat_json(repeat: usize, row: &str) -> String {
    format!("{{\"repeat\":{repeat},{}", row.strip_prefix('{').unwrap_or(row))
}

/// The run a row shows (its median), with what must read zero or stay short counted
/// over every run: overlaps and errors summed, and the longest wait of any run (µs).
fn shown_run(outcomes: Vec<scenarios::Outcome>) -> (scenarios::Outcome, u64) {
    let longest_wait = outcomes.iter().map(|o| o.longest_wait_us).max().unwrap_or(0);
    let overlaps = outcomes.iter().map(|o| o.overlaps).sum();
    let errors = outcomes.iter().map(|o| o.errors).sum();
    let mut shown = median_run(outcomes);
    (shown.overlaps, shown.errors) = (overlaps, errors);
    (shown, longest_wait)
}

/// The run of median cycles per second (the upper median of an even count).
fn median_run(mut outcomes: Vec<scenarios::Outcome>) -> scenarios::Outcome {
    outcomes.sort_by(|a, b| a.cycles_per_sec.total_cmp(&b.cycles_per_sec));
    let middle = outcomes.len() / 2;
    outcomes.swap_remove(middle)
}

/// Whether a latchkey peer spreads its tasks over two servers (`latchkey-2`,
/// `latchkey-fair-2`).
fn two_servers(label: &str) -> bool {
    label.ends_with("-2")
}

/// The lock kind a latchkey peer takes.
fn kind_of(label: &str) -> LockKind {
    if label.starts_with("latchkey-fair") {
        LockKind::Fair
    } else {
        LockKind::Mutex
    }
}

async fn etcd_connect(port: u16) -> Option<etcd_client::Client> {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        if let Ok(mut c) = etcd_client::Client::connect([format!("http://127.0.0.1:{port}")], None).await {
            if c.status().await.is_ok() {
                return Some(c);
            }
        }
        if Instant::now() > deadline {
            eprintln!("etcd did not come up; skipping it");
            return None;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

struct Row<'a> {
    scenario: &'a str,
    peer: &'a str,
    tasks: usize,
    hold: Duration,
    outcome: &'a Outcome,
    /// The longest wait of any run of the row (µs), which the shown run may not hold.
    longest_wait_us: u64,
}

fn header() -> String {
    format!(
        "{:<14} {:<15} {:>4} {:>5} {:>10} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>7} {:>5} {:>5} {:>8} {:>7} {:>7}",
        "scenario",
        "peer",
        "C",
        "hold",
        "cycles/s",
        "acq p50",
        "acq p90",
        "acq p99",
        "acq max",
        "rel p50",
        "rel p90",
        "rel p99",
        "hand p50",
        "hand p99",
        "fair",
        "ovl",
        "err",
        "cpu/cyc",
        "server",
        "store"
    )
}

impl Row<'_> {
    /// Max/min grants per task; infinite when a task got none (starved).
    fn fairness(&self) -> f64 {
        let max = self.outcome.grants.iter().copied().max().unwrap_or(0) as f64;
        let min = self.outcome.grants.iter().copied().min().unwrap_or(0) as f64;
        max / min
    }

    fn figures(&self) -> targets::Figures {
        let o = self.outcome;
        targets::Figures {
            cycles_per_sec: o.cycles_per_sec,
            acquires: o.acquire.len(),
            acquire_p50_us: o.acquire.value_at_quantile(0.5),
            acquire_p99_us: o.acquire.value_at_quantile(0.99),
            acquire_max_us: self.longest_wait_us,
            handoff_p50_us: o.handoff.value_at_quantile(0.5),
            handoff_p99_us: o.handoff.value_at_quantile(0.99),
            handoffs: o.handoff.len(),
            fairness: self.fairness(),
            overlaps: o.overlaps,
            errors: o.errors,
            cpu_us_per_cycle: o.cpu_us_per_cycle,
            server_us_per_cycle: o.server_us_per_cycle,
            store_us_per_cycle: o.store_us_per_cycle,
        }
    }

    fn table(&self) -> String {
        let o = self.outcome;
        let ms = |us: u64| format!("{:.2}ms", us as f64 / 1000.0);
        format!(
            "{:<14} {:<15} {:>4} {:>5} {:>10.0} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>7.2} {:>5} {:>5} {:>6.0}µs {:>5.0}µs {:>5.0}µs",
            self.scenario,
            self.peer,
            self.tasks,
            format!("{}ms", self.hold.as_millis()),
            o.cycles_per_sec,
            ms(o.acquire.value_at_quantile(0.5)),
            ms(o.acquire.value_at_quantile(0.9)),
            ms(o.acquire.value_at_quantile(0.99)),
            ms(o.acquire.max()),
            ms(o.release.value_at_quantile(0.5)),
            ms(o.release.value_at_quantile(0.9)),
            ms(o.release.value_at_quantile(0.99)),
            ms(o.handoff.value_at_quantile(0.5)),
            ms(o.handoff.value_at_quantile(0.99)),
            self.fairness(),
            o.overlaps,
            o.errors,
            o.cpu_us_per_cycle,
            o.server_us_per_cycle,
            o.store_us_per_cycle
        )
    }

    fn json(&self) -> String {
        let o = self.outcome;
        let q = |h: &hdrhistogram::Histogram<u64>, p: f64| h.value_at_quantile(p);
        format!(
            concat!(
                "{{\"scenario\":\"{}\",\"peer\":\"{}\",\"tasks\":{},\"hold_ms\":{},\"cycles_per_sec\":{:.1},",
                "\"acquire_us\":{{\"p50\":{},\"p90\":{},\"p99\":{},\"max\":{}}},",
                "\"release_us\":{{\"p50\":{},\"p90\":{},\"p99\":{},\"max\":{}}},\"handoff_us\":{{\"p50\":{},\"p99\":{}}},",
                "\"fairness_max_over_min\":{:.3},\"overlaps\":{},\"errors\":{},\"cpu_us_per_cycle\":{:.1},\"server_us_per_cycle\":{:.1},\"store_us_per_cycle\":{:.1}}}"
            ),
            self.scenario,
            self.peer,
            self.tasks,
            self.hold.as_millis(),
            o.cycles_per_sec,
            q(&o.acquire, 0.5),
            q(&o.acquire, 0.9),
            q(&o.acquire, 0.99),
            o.acquire.max(),
            q(&o.release, 0.5),
            q(&o.release, 0.9),
            q(&o.release, 0.99),
            o.release.max(),
            q(&o.handoff, 0.5),
            q(&o.handoff, 0.99),
            self.fairness(),
            o.overlaps,
            o.errors,
            o.cpu_us_per_cycle,
            o.server_us_per_cycle,
            o.store_us_per_cycle
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outcome(cycles_per_sec: f64) -> scenarios::Outcome {
        scenarios::Outcome {
            cycles_per_sec,
            ..Default::default()
        }
    }

    #[test]
    fn a_repeated_row_shows_its_median_run() {
        let runs = |rates: &[f64]| median_run(rates.iter().map(|&r| outcome(r)).collect()).cycles_per_sec;
        assert_eq!(runs(&[1537.0, 2246.0, 2074.0]), 2074.0);
        assert_eq!(runs(&[10.0]), 10.0);
        assert_eq!(runs(&[3.0, 1.0]), 3.0);
    }

    #[test]
    fn a_repeated_row_counts_overlaps_errors_and_its_longest_wait_over_every_run() {
        let mut runs: Vec<_> = [(1.0, 2, 0, 900), (2.0, 0, 3, 1_200_000), (3.0, 1, 0, 50)]
            .into_iter()
            .map(|(rate, overlaps, errors, wait)| {
                let mut o = outcome(rate);
                (o.overlaps, o.errors, o.longest_wait_us) = (overlaps, errors, wait);
                o
            })
            .collect();
        runs.rotate_left(1);
        let (shown, longest) = shown_run(runs);
        assert_eq!(shown.cycles_per_sec, 2.0);
        assert_eq!((shown.overlaps, shown.errors), (3, 3));
        assert_eq!(longest, 1_200_000, "the longest wait of any run");
    }
}
