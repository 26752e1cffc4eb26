//! Server bounds a misbehaving client cannot push past: waiters per lock and per
//! server, Acquire streams per connection and message size, each answered with
//! RESOURCE_EXHAUSTED, ErrorInfo `LIMIT_REACHED` and a message naming the flag; and
//! connections that say nothing, which are closed.

use latchkey_client::{Client, LockKind};
use latchkey_proto::v1::Open;
use latchkey_tests::server::{open, pd, spawn_queued, Latchkey, RawStream, Waiting};
use latchkey_tests::{bounded, poll_until, scrape_metrics, LatchkeyProcess, RedisServer};
use std::io::Read;
use std::time::{Duration, Instant};
use tonic::Code;
use tonic_types::StatusExt;

const T: Duration = Duration::from_secs(10);

fn assert_limit(status: &tonic::Status, flag: &str) {
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains(flag), "{:?} names {flag}", status.message());
    let info = status.get_details_error_info().expect("ErrorInfo attached");
    assert_eq!(info.reason, "LIMIT_REACHED");
}

/// A waiter on `name` that has been told `queued`.
async fn queued(client: &Client, name: &'static str) -> Waiting {
    spawn_queued(client.lock(name).wait(T), T).await.0
}

#[tokio::test]
async fn waiters_are_bounded_per_lock_and_per_server() {
    let redis = RedisServer::start();
    let server = Latchkey::start_with(&redis.url(), &["--max-waiters-per-lock", "2", "--max-waiters", "3"]).await;
    let client = server.client().await;
    let a = client.lock("a").acquire().await.unwrap();
    let _b = client.lock("b").acquire().await.unwrap();
    let mut first = queued(&client, "a").await;
    let mut second = queued(&client, "a").await;
    let err = client.lock("a").wait(T).acquire().await.unwrap_err();
    assert_limit(err.status().expect("a status"), "--max-waiters-per-lock");
    let _third = queued(&client, "b").await;
    let err = client.lock("b").wait(T).acquire().await.unwrap_err();
    assert_limit(err.status().expect("a status"), "--max-waiters)");
    // A grant gives the place back (the mutex is not fair: either waiter may win).
    a.release().await.unwrap();
    let granted = tokio::select! {
        r = &mut first => r,
        r = &mut second => r,
    };
    granted.unwrap().expect("a waiter acquires");
    let _again = queued(&client, "b").await;
    // Holding is not waiting: free names are still granted.
    client.lock("c").try_once().acquire().await.expect("a free name");
}

/// A multi-lock waiter counts against the lock that blocks it, not its first name:
/// waiters of `[unique, hot]` got past `hot`'s bound, each counted on its own name.
#[tokio::test]
async fn a_multi_lock_waiter_counts_against_the_lock_it_waits_for() {
    let redis = RedisServer::start();
    let server = Latchkey::start_with(&redis.url(), &["--max-waiters-per-lock", "1"]).await;
    let client = server.client().await;
    let _hot = client.lock("hot").acquire().await.unwrap();
    let (_first, _) = spawn_queued(client.lock_all(["a1", "hot"]).wait(T), T).await;
    let err = client.lock_all(["b1", "hot"]).wait(T).acquire().await.unwrap_err();
    assert_limit(err.status().expect("a status"), "--max-waiters-per-lock");
    assert!(err.to_string().contains("hot"), "{err}");
}

/// A multi-lock waiter that moves on to wait for another of its names counts there
/// from then on: counted still on the first, it turned that name's own waiters away
/// though nobody waited for it any more.
#[tokio::test]
async fn a_multi_lock_waiter_that_moves_on_counts_against_the_lock_it_waits_for_now() {
    let redis = RedisServer::start();
    let server = Latchkey::start_with(&redis.url(), &["--max-waiters-per-lock", "1"]).await;
    let client = server.client().await;
    // A multi-lock takes its names in slot order: `first` blocks it first.
    let mut names = ["w1", "w2"];
    names.sort_by_key(|n| fred::util::redis_keyslot(n.as_bytes()));
    let [first, then] = names;
    let first_holder = client.lock(first).acquire().await.unwrap();
    let then_holder = client.lock(then).acquire().await.unwrap();
    let (multi, _) = spawn_queued(client.lock_all(names).wait(T), T).await;
    // It wakes, finds `then` held, and waits for `then`: it listens on its channel.
    first_holder.release().await.unwrap();
    let channel = format!("redisson_lock__channel:{{{then}}}");
    let listens = || redis.subscribers(&channel) == 1;
    assert!(poll_until(T, listens).await, "the multi-lock waits for {then}");
    // `first`'s waiter is queued (and its wait runs out); `then` has its one waiter.
    let again = client.lock(first).try_once().acquire().await.unwrap();
    let queued = client.lock(first).wait(Duration::from_millis(100)).acquire().await;
    assert_eq!(queued.map(|_| ()).map_err(|e| e.code()), Err(Code::DeadlineExceeded));
    let err = client.lock(then).wait(T).acquire().await.unwrap_err();
    assert_limit(err.status().expect("a status"), "--max-waiters-per-lock");
    again.release().await.unwrap();
    then_holder.release().await.unwrap();
    bounded(T, "the multi-lock", multi)
        .await
        .unwrap()
        .expect("granted")
        .release()
        .await
        .unwrap();
}

/// A fair newcomer on a server that holds its maximum of waiters tries as a try-once
/// does: refused on a busy lock, it was queued in Redis by its first try before, and
/// left the queue again in the background (two scripts for a refusal, and a place in
/// line meanwhile). One behind waiters of its lock here is refused without a try. A
/// free fair lock is still granted.
#[tokio::test]
async fn a_fair_newcomer_to_a_full_server_is_refused_without_queueing() {
    let redis = RedisServer::start();
    // (No renewal round nor queue refresh in the test's seconds: its scripts are
    // counted.)
    let args = [
        "--max-waiters",
        "1",
        "--watchdog-timeout",
        "60s",
        "--fair-wait-timeout",
        "60s",
    ];
    let server = Latchkey::start_with(&redis.url(), &args).await;
    let client = server.client().await;
    let fair = |name| client.lock(name).kind(LockKind::Fair);
    let _f = fair("f").acquire().await.unwrap();
    let g = fair("g").acquire().await.unwrap();
    let (_waiting, _) = spawn_queued(fair("f").wait(T), T).await;
    // A waiter joins a fair lock's queue with `RPUSH`.
    let joins = redis.command_calls("rpush");
    let err = fair("g").wait(T).acquire().await.unwrap_err();
    assert_limit(err.status().expect("a status"), "--max-waiters)");
    assert_eq!(
        redis.command_calls("rpush"),
        joins,
        "the refused newcomer joined the queue"
    );
    let scripts = redis.evalsha_calls();
    let err = fair("f").wait(T).acquire().await.unwrap_err();
    assert_limit(err.status().expect("a status"), "--max-waiters)");
    assert_eq!(
        redis.evalsha_calls(),
        scripts,
        "the newcomer behind the waiters here tried"
    );
    g.release().await.unwrap();
    let free = fair("g").wait(T).acquire().await;
    free.expect("a free fair lock is granted whatever the bound");
}

/// A fair newcomer to a lock with no room for another waiter here tries as a try-once
/// does, as one to a full server does: with `--max-waiters-per-lock 0` (a server of
/// tries), or of a client-named owner (which may hold the lock or lead its line, so is
/// not refused at once) past the lock's waiters here. It was queued in Redis by its
/// first try and left the queue again once refused. A free fair lock is still granted.
#[tokio::test]
async fn a_fair_newcomer_to_a_full_lock_is_refused_without_queueing() {
    let redis = RedisServer::start();
    for (bound, named) in [("0", None), ("1", Some("o"))] {
        let args = ["--max-waiters-per-lock", bound, "--fair-wait-timeout", "60s"];
        let server = Latchkey::start_with(&redis.url(), &args).await;
        let client = server.client().await;
        let fair = |name| client.lock(name).kind(LockKind::Fair);
        let held = fair("full").acquire().await.unwrap();
        let _waiting = match bound {
            "0" => None,
            _ => Some(spawn_queued(fair("full").wait(T), T).await),
        };
        // A waiter joins a fair lock's queue with `RPUSH`.
        let joins = redis.command_calls("rpush");
        let newcomer = match named {
            Some(owner) => fair("full").owner(owner),
            None => fair("full"),
        };
        let err = newcomer.wait(T).acquire().await.unwrap_err();
        assert_limit(err.status().expect("a status"), "--max-waiters-per-lock");
        assert_eq!(
            redis.command_calls("rpush"),
            joins,
            "bound {bound}: the refused newcomer joined the queue"
        );
        if bound == "0" {
            held.release().await.unwrap();
            let free = fair("full").wait(T).acquire().await;
            free.expect("a free fair lock is granted whatever the bound")
                .release()
                .await
                .unwrap();
        }
        server.stop().await;
    }
}

#[tokio::test]
async fn streams_are_bounded_per_connection() {
    let redis = RedisServer::start();
    let server = Latchkey::start_with(&redis.url(), &["--max-streams-per-connection", "2"]).await;
    streams_of_a_connection_are_bounded(|| server.client()).await;
}

/// The bound holds on the Unix socket too, where every client's address is the same
/// unnamed one: it was not applied there, and a sidecar's streams past it queued in
/// HTTP/2 without a word.
#[tokio::test]
async fn streams_are_bounded_per_connection_on_a_unix_socket() {
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("latchkey.sock");
    let socket = socket.to_str().unwrap();
    let args = ["--max-streams-per-connection", "2", "--unix-socket", socket];
    let _server = Latchkey::start_with(&redis.url(), &args).await;
    let endpoint = format!("unix://{socket}");
    let connect = || async { Client::connect(&endpoint).await.expect("connects over the socket") };
    streams_of_a_connection_are_bounded(connect).await;
}

/// With `--max-streams-per-connection 2`: a third Acquire or Watch stream on a
/// connection is refused, another connection has its own bound, unary calls are
/// not counted.
async fn streams_of_a_connection_are_bounded<F: std::future::Future<Output = Client>>(connect: impl Fn() -> F) {
    let client = connect().await;
    let _one = client.lock("one").acquire().await.unwrap();
    let _two = client.lock("two").acquire().await.unwrap();
    let err = client.lock("three").acquire().await.unwrap_err();
    assert_limit(err.status().expect("a status"), "--max-streams-per-connection");
    // Watch streams count on their connection too.
    let err = client.watch("one").await.unwrap_err();
    assert_limit(err.status().expect("a status"), "--max-streams-per-connection");
    // Another connection has its own bound, and unary calls are not streams.
    let other = connect().await;
    let mut watch = other.watch("three").await.expect("another connection");
    bounded(T, "the first state", watch.next()).await.unwrap();
    other.lock("three").acquire().await.expect("another connection");
    let err = other.lock("four").acquire().await.unwrap_err();
    assert_limit(err.status().expect("a status"), "--max-streams-per-connection");
    assert!(client.describe("one").await.unwrap().locked);
}

/// `--max-streams` bounds Acquire and Watch streams together; going over names the
/// flag, as every other bound does (it said "maximum number of Acquire streams", no
/// flag, also when Watch streams held every place).
#[tokio::test]
async fn streams_are_bounded_per_server_naming_the_flag() {
    let redis = RedisServer::start();
    let server = Latchkey::start_with(&redis.url(), &["--max-streams", "1"]).await;
    let client = server.client().await;
    let mut watch = client.watch("seen").await.unwrap();
    bounded(T, "the first state", watch.next()).await.unwrap();
    let err = client.lock("one").acquire().await.unwrap_err();
    assert_limit(err.status().expect("a status"), "--max-streams)");
    drop(watch);
    let lease = bounded(T, "a place again", async {
        loop {
            match client.lock("one").acquire().await {
                Ok(lease) => return lease,
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    })
    .await;
    let err = client.watch("seen").await.unwrap_err();
    assert_limit(err.status().expect("a status"), "--max-streams)");
    lease.release().await.unwrap();
}

#[tokio::test]
async fn a_huge_message_is_refused_with_the_limit() {
    let redis = RedisServer::start();
    let server = Latchkey::start_with(&redis.url(), &["--max-message-size", "8192"]).await;
    let mut raw = server.raw().await;
    let open = Open {
        name: "x".repeat(20_000),
        ..Default::default()
    };
    let mut stream = RawStream::open(&mut raw, Some(open)).await;
    let status = stream.next(T).await.expect_err("refused");
    assert_limit(&status, "--max-message-size");
    server
        .client()
        .await
        .lock("fine")
        .try_once()
        .acquire()
        .await
        .expect("still serving");
}

/// A unary call or a Watch whose request is over the limit is refused as an `Acquire`
/// is (tonic's decoder refuses it before the method runs, `OUT_OF_RANGE` with no
/// word of the flag), and is counted in the RPC metrics.
#[tokio::test]
async fn a_huge_unary_request_is_refused_with_the_limit() {
    let redis = RedisServer::start();
    let server =
        LatchkeyProcess::spawn(&["--redis-url", &redis.url(), "--max-message-size", "8192"].map(str::to_owned));
    let client = server.serving_client().await;
    let huge = || "x".repeat(20_000);
    let describe = client.describe(huge()).await.unwrap_err();
    assert_limit(describe.status().expect("a status"), "--max-message-size");
    let Err(watch) = client.watch(huge()).await else {
        panic!("the watch was refused")
    };
    assert_limit(watch.status().expect("a status"), "--max-message-size");
    let release = client.force_release(huge()).await.unwrap_err();
    assert_limit(release.status().expect("a status"), "--max-message-size");
    let list = client.list(huge(), 10, "").await.unwrap_err();
    assert_limit(list.status().expect("a status"), "--max-message-size");
    let scrape = scrape_metrics(server.metrics_port().expect("metrics enabled"));
    for method in ["Describe", "Watch", "ForceRelease", "List"] {
        let handled = format!("latchkey_rpc_handled_total{{method=\"{method}\",code=\"ResourceExhausted\"}}");
        assert!(scrape.contains(&handled), "{handled} in {scrape}");
    }
    client.describe("fine").await.expect("still serving");
}

/// The health service, which needs no token and counts against no stream bound, takes
/// no message over the limit either: a Check with a 20 kB service name was read whole
/// (tonic's default bound is 4 MiB) and answered `NOT_FOUND`.
#[tokio::test]
async fn a_huge_health_check_is_refused_with_the_limit() {
    use tonic_health::pb::{health_client::HealthClient, HealthCheckRequest};
    let redis = RedisServer::start();
    let server = Latchkey::start_with(&redis.url(), &["--max-message-size", "8192"]).await;
    let channel = server.channel().await;
    let mut health = HealthClient::new(channel);
    let huge = HealthCheckRequest {
        service: "x".repeat(20_000),
    };
    let status = health.check(huge).await.expect_err("refused");
    assert_limit(&status, "--max-message-size");
    let fine = HealthCheckRequest { service: String::new() };
    health.check(fine).await.expect("still answering");
}

/// A message over the limit after `open`, from a holder or from a waiter, ends its
/// stream with the limit's status (not an OK with no word), and the holder's lock is
/// released.
#[tokio::test]
async fn a_huge_message_after_open_is_refused_and_the_hold_released() {
    let redis = RedisServer::start();
    let server = Latchkey::start_with(&redis.url(), &["--max-message-size", "8192"]).await;
    let mut raw = server.raw().await;
    let huge = || {
        latchkey_proto::v1::acquire_request::Action::Open(Open {
            name: "x".repeat(20_000),
            ..Default::default()
        })
    };
    let mut holder = RawStream::open(&mut raw, Some(open("big"))).await;
    holder.next(T).await.expect("acquired").expect("an event");
    let mut waiter = RawStream::open(
        &mut raw,
        Some(Open {
            wait_timeout: Some(pd(T)),
            ..open("big")
        }),
    )
    .await;
    waiter.next(T).await.expect("queued").expect("an event");

    waiter.send(huge()).await;
    assert_limit(&waiter.next(T).await.expect_err("refused"), "--max-message-size");
    holder.send(huge()).await;
    assert_limit(&holder.next(T).await.expect_err("refused"), "--max-message-size");
    assert_eq!(redis.cli(&["EXISTS", "big"]).trim(), "0", "the hold was released");
}

/// Seconds of CPU (user + system) process `pid` has used.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the command name (which is in parentheses).
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    let hz: f64 = std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(100.0);
    ticks as f64 / hz
}

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// A client that connects and describes a lock within `limit`.
async fn served(endpoint: &str, limit: Duration) -> Result<(), String> {
    let call = async {
        let c = Client::connect(endpoint).await.map_err(|e| e.to_string())?;
        c.describe("x").await.map(|_| ()).map_err(|e| e.to_string())
    };
    tokio::time::timeout(limit, call)
        .await
        .unwrap_or_else(|_| Err(format!("no answer in {limit:?}")))
}

/// Descriptors the server may open in the silent-connection tests.
const FD_LIMIT: usize = 128;

/// A server whose descriptor limit is [`FD_LIMIT`], and connections to the port
/// `port_of` picks that send nothing, past that limit: the last wait in the listen
/// backlog. Returns once the server had 2 s to take them.
async fn used_up_by_silence(
    server: &LatchkeyProcess,
    port_of: impl Fn(&LatchkeyProcess) -> u16,
) -> Vec<std::net::TcpStream> {
    let pid = server.pid().expect("server pid");
    let status = std::process::Command::new("prlimit")
        .args(["--pid", &pid.to_string(), &format!("--nofile={FD_LIMIT}:{FD_LIMIT}")])
        .status()
        .expect("run prlimit");
    assert!(status.success(), "prlimit failed");
    let base = open_fds(pid);
    let addr = format!("127.0.0.1:{}", port_of(server));
    let silent = (0..(FD_LIMIT - base + 32))
        .map(|_| std::net::TcpStream::connect(&addr).expect("connect"))
        .collect();
    tokio::time::sleep(Duration::from_secs(2)).await;
    silent
}

/// The share of a core the server `pid` used while `during` ran (at least 3 s).
async fn cpu_share(pid: u32, during: impl std::future::Future) -> f64 {
    let cpu0 = cpu_seconds(pid);
    let t0 = Instant::now();
    during.await;
    tokio::time::sleep(Duration::from_secs(3).saturating_sub(t0.elapsed())).await;
    (cpu_seconds(pid) - cpu0) / t0.elapsed().as_secs_f64()
}

/// Asserts that the server closes `silent`, a connection that sent nothing (after
/// 10 s of silence; bounded at 15).
async fn closed_by_the_server(silent: &std::net::TcpStream) {
    let mut silent = silent.try_clone().unwrap();
    silent.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
    let read = tokio::task::spawn_blocking(move || silent.read_to_end(&mut Vec::new()))
        .await
        .unwrap();
    assert!(
        read.is_ok() || matches!(&read, Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset),
        "a silent connection is closed by the server: {read:?}"
    );
}

/// TCP connections that send nothing, enough to use up the server's descriptors, do
/// not spin the accept loop (every accept fails with EMFILE: it pauses between
/// tries), and the server closes them once they have been silent for 10 s, after
/// which other clients are served again.
#[tokio::test]
async fn silent_connections_that_use_up_descriptors_neither_spin_nor_stay() {
    let redis = RedisServer::start();
    let server = LatchkeyProcess::start(&redis.url());
    let _ = server.serving_client().await;
    // No HTTP/2 preface, no credential.
    let silent = used_up_by_silence(&server, LatchkeyProcess::port).await;
    let pid = server.pid().expect("server pid");
    let fds_held = open_fds(pid);
    // A client meanwhile: it waits in the backlog too.
    let mut meanwhile = None;
    let share = cpu_share(pid, async {
        meanwhile = Some(served(&server.endpoint(), Duration::from_secs(3)).await);
    })
    .await;
    assert!(
        share < 0.3,
        "with {fds_held} descriptors held by {} silent connections the server used {:.0}% of a \
         core failing to accept; a client meanwhile: {meanwhile:?}",
        silent.len(),
        share * 100.0
    );
    // The first was accepted at once: the server closes it after 10 s of silence
    // (once it has sent its own HTTP/2 settings).
    closed_by_the_server(&silent[0]).await;
    bounded(
        Duration::from_secs(20),
        "a client once silent connections are closed",
        async {
            while served(&server.endpoint(), Duration::from_secs(3)).await.is_err() {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        },
    )
    .await;
}

/// The metrics listener keeps the gRPC listeners' safeguards: with the descriptors used
/// up by connections that send nothing, its accept loop pauses between failed tries,
/// and it closes each silent connection after 10 s. The exporter's own listener had
/// neither: it tried again at once (a warning a try), and kept silent connections for
/// good, whose descriptors the gRPC listeners then lacked.
#[tokio::test]
async fn the_metrics_listener_pauses_its_accepts_and_closes_silent_connections() {
    let redis = RedisServer::start();
    let server = LatchkeyProcess::start(&redis.url());
    let _ = server.serving_client().await;
    let silent = used_up_by_silence(&server, |s| s.metrics_port().expect("metrics on")).await;
    let share = cpu_share(server.pid().expect("server pid"), async {}).await;
    assert!(
        share < 0.3,
        "{} silent connections to the metrics port: the server used {:.0}% of a core",
        silent.len(),
        share * 100.0
    );
    closed_by_the_server(&silent[0]).await;
}

/// A connection that sends the first byte of the HTTP/2 preface and then nothing is
/// closed as a silent one is: the first byte no longer counts as the preface, until
/// which HTTP/2 keepalive does not run. It was kept for good.
#[tokio::test]
async fn a_connection_stuck_in_its_preface_is_closed() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let addr = server.endpoint().trim_start_matches("http://").to_owned();
    let mut stuck = std::net::TcpStream::connect(&addr).expect("connect");
    std::io::Write::write_all(&mut stuck, b"P").unwrap();
    stuck.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
    let started = Instant::now();
    let read = tokio::task::spawn_blocking(move || stuck.read_to_end(&mut Vec::new()))
        .await
        .unwrap();
    assert!(
        read.is_ok() || matches!(&read, Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset),
        "closed by the server, not by the read timeout: {read:?} after {:?}",
        started.elapsed()
    );
}
