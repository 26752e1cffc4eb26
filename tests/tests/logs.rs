//! What the server writes to its log for an operator: plain lines in a file, a
//! `RUST_LOG` that does not parse refused at start, one line for an outage's lost
//! leases and failed releases rather than one per lease, a quiet shutdown, a RedLock
//! node that stops answering named, and a refused TLS client's address.

use latchkey_client::LostReason;
use latchkey_tests::latchkey::server_binary;
use latchkey_tests::{bounded, poll_until, LatchkeyProcess, RedisServer};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(10);

/// At the default level whatever the tests' own `RUST_LOG`: what is looked for is what
/// an operator sees.
const AT_INFO: (&str, &str) = ("RUST_LOG", "info");

fn spawn(redis_url: &str, extra: &[&str]) -> LatchkeyProcess {
    let mut args = vec![
        "--redis-url".to_owned(),
        redis_url.to_owned(),
        "--no-metrics".to_owned(),
    ];
    args.extend(extra.iter().map(|a| a.to_string()));
    LatchkeyProcess::spawn_with_env(&args, &[AT_INFO])
}

/// A server started straight from its binary (no `NO_COLOR`), its stderr to a file:
/// the file and the child, to stop.
fn start_bare(env: &[(&str, &str)]) -> (tempfile::TempDir, std::path::PathBuf, std::process::Child) {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("server.log");
    let child = Command::new(server_binary())
        .args([
            "--listen",
            "127.0.0.1:0",
            "--no-metrics",
            "--redis-url",
            "redis://127.0.0.1:1",
        ])
        .env_remove("NO_COLOR")
        .env_remove("RUST_LOG")
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .expect("run latchkey-server");
    (dir, log, child)
}

/// A log written to a file carries no terminal colour codes, so `grep 'lock="a"'`
/// finds its lines (they were on whenever `NO_COLOR` was unset).
#[test]
fn a_log_to_a_file_has_no_colour_codes() {
    let (_dir, log, mut child) = start_bare(&[]);
    let deadline = Instant::now() + T;
    let mut text = String::new();
    while Instant::now() < deadline && !text.contains("latchkey serving") {
        std::thread::sleep(Duration::from_millis(50));
        text = std::fs::read_to_string(&log).unwrap_or_default();
    }
    let _ = child.kill();
    let _ = child.wait();
    assert!(text.contains("latchkey serving"), "{text}");
    assert!(!text.contains('\u{1b}'), "colour codes in a log file:\n{text}");
}

/// A `RUST_LOG` that does not parse stops the start, naming it; it used to run at
/// `info` unsaid, without the trail asked for. So does a misspelt level alone, which
/// reads as a target and would turn every line off.
#[test]
fn a_rust_log_that_does_not_parse_stops_the_start() {
    for (filter, named) in [("warn,latchkey::lease=debgu", "debgu"), ("inof", "inof")] {
        stops_the_start(filter, named);
    }
}

fn stops_the_start(filter: &str, named: &str) {
    let (_dir, log, mut child) = start_bare(&[("RUST_LOG", filter)]);
    let deadline = Instant::now() + T;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break Some(status);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(status.is_some_and(|s| !s.success()), "ran on: {status:?}\n{text}");
    assert!(text.contains("RUST_LOG") && text.contains(named), "{text}");
}

/// Redis gone under held leases: each lease's own line says `NOT_HELD`, as a lock gone
/// from Redis does, and one warning says the cause is the renewals Redis did not
/// confirm. Releases that fail meanwhile write one warning, not one each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_is_one_warning_for_its_leases_and_one_for_its_releases() {
    let mut redis = RedisServer::start();
    let server = spawn(
        &redis.url(),
        &["--watchdog-timeout", "900ms", "--redis-timeout", "300ms"],
    );
    let client = server.serving_client().await;
    let mut leases = Vec::new();
    for i in 0..3 {
        leases.push(client.lock(format!("logs/lost/{i}")).acquire().await.expect("acquired"));
    }
    let released = {
        let mut fixed = Vec::new();
        for i in 0..3 {
            let lock = client.lock(format!("logs/rel/{i}")).lease(Duration::from_secs(3600));
            fixed.push(lock.acquire().await.expect("acquired"));
        }
        fixed
    };
    redis.stop();
    for lease in &leases {
        let reason = bounded(T, "told lost", lease.lost()).await;
        assert_eq!(reason, LostReason::NotHeld);
    }
    for lease in released {
        let _ = bounded(T, "a release answered", lease.release()).await;
    }
    let said = poll_until(T, || {
        server
            .log()
            .contains("leases told lost: Redis has not confirmed their renewals")
    })
    .await;
    let log = server.log();
    assert!(said, "no warning names the cause:\n{log}");
    let failed = log.matches("release failed; retrying in the background").count();
    assert_eq!(failed, 1, "one line per failed release:\n{log}");
}

/// A shutdown tells every lease `SHUTDOWN` and says so once, not once per lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_writes_no_line_per_lease() {
    let redis = RedisServer::start();
    let mut server = spawn(&redis.url(), &[]);
    let client = server.serving_client().await;
    let mut leases = Vec::new();
    for i in 0..3 {
        leases.push(client.lock(format!("logs/down/{i}")).acquire().await.expect("acquired"));
    }
    server.terminate();
    for lease in &leases {
        let reason = bounded(T, "told lost", lease.lost()).await;
        assert_eq!(reason, LostReason::Shutdown);
    }
    assert!(server.wait_exit(T).is_some_and(|s| s.success()), "exits");
    let log = server.log();
    assert!(log.contains("shutting down: releasing every lease"), "{log}");
    assert!(!log.contains("lease lost"), "a line per lease:\n{log}");
}

/// A RedLock node that stops answering is named in a warning, and again when it is
/// back: RedLock holds on a majority, so nothing else told of a node lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redlock_node_down_and_back_is_said() {
    let redis = RedisServer::start();
    let mut nodes: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
    let urls: Vec<String> = nodes.iter().map(RedisServer::url).collect();
    let mut extra: Vec<&str> = urls.iter().flat_map(|url| ["--redlock-url", url]).collect();
    // Nodes met at the start are asked at once (no wait for a restart to settle).
    extra.extend(["--redlock-restart-delay", "0s"]);
    let server = spawn(&redis.url(), &extra);
    // Every node up, and heard: a lease on all three.
    let client = server.serving_client().await;
    let lease = client
        .lock("logs/rl")
        .redlock(true)
        .acquire()
        .await
        .expect("a RedLock lease");
    bounded(T, "released", lease.release()).await.expect("released");
    let said = |what: &str| {
        (server.log().lines())
            .filter(|l| l.contains(what) && l.contains("#3"))
            .count()
    };
    assert_eq!(
        said("a RedLock node"),
        0,
        "a node up was said down or back:\n{}",
        server.log()
    );
    nodes[2].stop();
    let down = poll_until(T, || said("a RedLock node does not answer") > 0).await;
    assert!(down, "no warning names the node:\n{}", server.log());
    nodes[2].restart();
    let back = poll_until(T, || said("a RedLock node answers again") > 0).await;
    assert!(back, "not said when back:\n{}", server.log());
    let warned = said("a RedLock node does not answer");
    assert_eq!(warned, 1, "one line per change, not per probe:\n{}", server.log());
}

/// A handshake refused for a client certificate of another CA is logged with the
/// client's address, so the client can be found; it named none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_handshake_names_its_client() {
    use latchkey_client::{Client, ConnectOptions};
    use latchkey_tests::certs::Pki;
    let redis = RedisServer::start();
    let (pki, foreign) = (Pki::new("logs"), Pki::new("logs-foreign"));
    let cert = pki.server("server");
    let ca = pki.ca();
    fn path(p: &std::path::Path) -> &str {
        p.to_str().expect("UTF-8 path")
    }
    let extra = [
        "--tls-cert",
        path(&cert.cert),
        "--tls-key",
        path(&cert.key),
        "--tls-client-ca",
        path(&ca),
    ];
    let server = spawn(&redis.url(), &extra);
    let stranger = foreign.client("stranger", "stranger");
    let options = ConnectOptions::new()
        .ca_pem(pki.ca_pem())
        .identity_pem(stranger.cert_pem(), stranger.key_pem());
    let target = format!("https://127.0.0.1:{}", server.port());
    if let Ok(client) = Client::connect_with(&target, &options).await {
        // Refused, or unanswered: the handshake's refusal is logged either way.
        let _ = tokio::time::timeout(T, client.describe("a")).await;
    }
    let said = poll_until(T, || {
        let log = server.log();
        log.lines()
            .any(|l| l.contains("tls handshake failed") && l.contains("peer=127.0.0.1:"))
    })
    .await;
    assert!(said, "no line names the client:\n{}", server.log());
}
