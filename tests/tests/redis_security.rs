//! The Redis side of securing latchkey: a password (`requirepass`) from a file, an
//! ACL user from the URL or from flags, TLS to Redis with a private CA (standalone,
//! a 3-master cluster with `tls-cluster yes`, and behind a TLS sentinel with a
//! password), and secrets that never reach logs or metrics; and the explicit choice
//! to run without auth.

use latchkey_client::ConnectOptions;
use latchkey_tests::certs::Pki;
use latchkey_tests::latchkey::server_binary;
use latchkey_tests::server::Latchkey;
use latchkey_tests::{free_port, poll_until, process, LatchkeyProcess, RedisCluster, RedisSentinel, RedisServer};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

async fn assert_locks_work(server: &Latchkey, name: &str) {
    let client = server.client().await;
    let lease = client.lock(name).try_once().acquire().await.expect("lock granted");
    assert_eq!(client.describe(name).await.unwrap().holders.len(), 1);
    lease.release().await.unwrap();
}

#[tokio::test]
async fn requirepass_password_comes_from_a_file() {
    let redis = RedisServer::start_with(&["--requirepass", "file-secret"]);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("redis-password");
    std::fs::write(&file, "file-secret\n").unwrap();
    let file = file.to_str().unwrap();
    let server = Latchkey::start_with(&redis.url(), &["--redis-password-file", file]).await;
    assert_locks_work(&server, "with-password-file").await;
    server.stop().await;
    // The same password in the URL works too.
    let server = Latchkey::start(&redis.url_with_password()).await;
    assert_locks_work(&server, "with-url-password").await;
    server.stop().await;
}

#[tokio::test]
async fn acl_user_from_the_url_or_from_flags() {
    // The default user is off: only alice gets in.
    let redis = RedisServer::start_with(&[
        "--user",
        "default",
        "off",
        "--user",
        "alice",
        "on",
        ">acl-secret",
        "~*",
        "&*",
        "+@all",
    ]);
    let url = format!("redis://alice:acl-secret@127.0.0.1:{}", redis.port());
    let server = Latchkey::start(&url).await;
    assert_locks_work(&server, "acl-url").await;
    server.stop().await;

    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("redis-password");
    std::fs::write(&file, "acl-secret").unwrap();
    let args = [
        "--redis-username",
        "alice",
        "--redis-password-file",
        file.to_str().unwrap(),
    ];
    let server = Latchkey::start_with(&redis.url(), &args).await;
    assert_locks_work(&server, "acl-flags").await;
    server.stop().await;
}

/// A Redis user that may not SUBSCRIBE: Redis refuses every subscription, yet the
/// Redis client reports them made, and waiters would silently wait for the holder's
/// TTL. The server's delivery check says so in its log, at start and after a
/// reconnect; a user with pub/sub says nothing.
#[tokio::test]
async fn a_user_that_may_not_subscribe_is_reported() {
    let users = "--user alice on >alice-secret ~* &* +@all \
                 --user bob on >bob-secret ~* &* +@all -subscribe -ssubscribe -psubscribe";
    let redis = RedisServer::start_with(&users.split_whitespace().collect::<Vec<_>>());
    let url = |user: &str| format!("redis://{user}:{user}-secret@127.0.0.1:{}", redis.port());
    let (bob, alice) = (
        LatchkeyProcess::start(&url("bob")),
        LatchkeyProcess::start(&url("alice")),
    );
    let said = "pub/sub does not deliver to this server";
    let reported = poll_until(Duration::from_secs(20), || bob.log().contains(said)).await;
    assert!(reported, "bob's server says so:\n{}", bob.log_tail());
    // Both checks began together; alice's message came back long ago.
    assert!(
        !alice.log().contains(said),
        "alice's server hears its own:\n{}",
        alice.log_tail()
    );
    alice.serving_client().await;
    // Alice loses pub/sub while her server runs: it checks again after its reconnect.
    redis.cli(&["ACL", "SETUSER", "alice", "-subscribe", "-ssubscribe", "-psubscribe"]);
    redis.cli(&["CLIENT", "KILL", "USER", "alice"]);
    let reported = poll_until(Duration::from_secs(20), || alice.log().contains(said)).await;
    assert!(
        reported,
        "alice's server says so after reconnecting:\n{}",
        alice.log_tail()
    );
}

#[tokio::test]
async fn tls_to_redis_with_a_private_ca() {
    let pki = Pki::new("redis");
    let cert = pki.server("redis");
    let tls_port = free_port().to_string();
    let redis = RedisServer::start_with(&[
        "--tls-port",
        &tls_port,
        "--tls-cert-file",
        cert.cert.to_str().unwrap(),
        "--tls-key-file",
        cert.key.to_str().unwrap(),
        "--tls-ca-cert-file",
        pki.ca().to_str().unwrap(),
        "--tls-auth-clients",
        "no",
        "--requirepass",
        "tls-secret",
    ]);
    let url = format!("rediss://:tls-secret@127.0.0.1:{tls_port}");
    let server = Latchkey::start_with(&url, &["--redis-tls-ca", pki.ca().to_str().unwrap()]).await;
    assert_locks_work(&server, "over-tls").await;
    // The lock really went over the TLS port to this Redis.
    let client = server.client().await;
    let lease = client.lock("over-tls-2").acquire().await.unwrap();
    assert_eq!(redis.cli(&["EXISTS", "over-tls-2"]).trim(), "1");
    lease.release().await.unwrap();
    server.stop().await;
}

#[tokio::test]
async fn tls_and_password_behind_sentinel() {
    let pki = Pki::new("redis");
    let tls = pki.redis_tls();
    let sentinel = RedisSentinel::start_secure(Some(&tls), Some("sentinel-secret"));
    let url = sentinel.tls_url(Some("sentinel-secret")).expect("TLS sentinel");
    let server = Latchkey::start_with(&url, &["--redis-tls-ca", pki.ca().to_str().unwrap()]).await;
    assert_locks_work(&server, "via-tls-sentinel").await;
    server.stop().await;
}

#[tokio::test]
async fn tls_to_a_cluster() {
    let pki = Pki::new("redis");
    let tls = pki.redis_tls();
    let cluster = RedisCluster::start_tls(3, &tls);
    let url = cluster.tls_url().expect("TLS cluster");
    let server = Latchkey::start_with(&url, &["--redis-tls-ca", pki.ca().to_str().unwrap()]).await;
    for name in ["tls-a", "tls-b", "tls-c", "tls-d"] {
        assert_locks_work(&server, name).await;
    }
    server.stop().await;
}

#[tokio::test]
async fn secrets_stay_out_of_logs_and_metrics() {
    let redis = RedisServer::start_with(&["--requirepass", "right-password"]);
    let dir = tempfile::tempdir().unwrap();
    let auth = dir.path().join("auth.toml");
    std::fs::write(
        &auth,
        "[[identity]]\nname = \"app\"\ntokens = [\"app-token-value\"]\nprefixes = [\"\"]\n",
    )
    .unwrap();
    // A wrong Redis password in the URL: the server keeps retrying and says so.
    let url = format!("redis://:wrong-password-value@127.0.0.1:{}", redis.port());
    let server = LatchkeyProcess::spawn(&[
        "--redis-url".to_owned(),
        url,
        "--auth-file".to_owned(),
        auth.to_str().unwrap().to_owned(),
    ]);
    // Said at error level, naming the flag (fred said it at debug only).
    let logged = |line: &'static str| {
        let server = &server;
        latchkey_tests::poll_until(Duration::from_secs(10), move || server.log().contains(line))
    };
    let refused = logged("--redis-url: Redis refused the connection").await;
    assert!(
        refused,
        "the refused password was never reported:\n{}",
        server.log_tail()
    );
    let options = ConnectOptions::new().token("guessed-token-value");
    let client = latchkey_client::Client::connect_with(&server.endpoint(), &options)
        .await
        .unwrap();
    let err = client.describe("x").await.expect_err("a bad token is refused");
    assert_eq!(err.code(), tonic::Code::Unauthenticated);
    // A broken auth file is reported without its contents.
    std::fs::write(&auth, "[[identity]]\nname = \"app\"\ntokens = \"new-token-value\"\n").unwrap();
    let reported = logged("auth file not reloaded").await;
    assert!(reported, "the broken file was never reported:\n{}", server.log_tail());
    tokio::time::sleep(Duration::from_secs(2)).await;
    let metrics = latchkey_tests::scrape_metrics(server.metrics_port().expect("metrics on"));
    assert!(
        metrics.contains("latchkey_streams_open"),
        "no metrics scraped: {metrics:?}"
    );
    for secret in [
        "wrong-password-value",
        "right-password",
        "app-token-value",
        "guessed-token-value",
        "new-token-value",
    ] {
        assert!(!server.log().contains(secret), "{secret} in the log:\n{}", server.log());
        assert!(!metrics.contains(secret), "{secret} in the metrics");
    }
}

#[test]
fn auth_off_beyond_loopback_must_be_asked_for() {
    let mut command = Command::new(server_binary());
    command
        .args([
            "--listen",
            "0.0.0.0:0",
            "--no-metrics",
            "--redis-url",
            "redis://127.0.0.1:1",
        ])
        .env_remove("LATCHKEY_NO_AUTH")
        .env_remove("LATCHKEY_AUTH_FILE");
    let output = process::output_within(&mut command, process::COMMAND_TIMEOUT);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("--no-auth") && stderr.contains("--auth-file"),
        "{stderr}"
    );
}

#[test]
fn no_auth_beyond_loopback_is_said_loudly() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("server.log");
    let mut child = Command::new(server_binary())
        .args([
            "--listen",
            "0.0.0.0:0",
            "--no-auth",
            "--no-metrics",
            "--redis-url",
            "redis://127.0.0.1:1",
        ])
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .expect("run latchkey-server");
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut said = false;
    while Instant::now() < deadline && !said {
        said = std::fs::read_to_string(&log).unwrap_or_default().contains("AUTH OFF");
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = child.kill();
    let _ = child.wait();
    assert!(said, "{}", std::fs::read_to_string(&log).unwrap_or_default());
}

/// A Redis without `GETDEL` (older than 6.2, or the command renamed away) is refused at
/// start, naming why: its grants worked and every release failed, each lock held for a
/// whole lease, while health said SERVING.
#[tokio::test]
async fn a_redis_without_getdel_is_refused_at_start() {
    let redis = RedisServer::start_with(&["--rename-command", "getdel", ""]);
    let url = redis.url();
    let args = ["--listen", "127.0.0.1:0", "--no-metrics", "--redis-url", &url];
    let config = latchkey_server::config::Config::from_args(args).expect("flags parse");
    let err = match latchkey_server::Server::start(config).await {
        Ok(server) => {
            let _ = server.stop().await;
            panic!("a server started on a Redis without GETDEL");
        }
        Err(e) => e.to_string(),
    };
    assert!(err.contains("GETDEL") && err.contains("6.2"), "{err}");
}

/// A Redis ACL that keeps latchkey's user from the keys it needs refuses every script:
/// the client hears what Redis said (`FAILED_PRECONDITION`, `REDIS_REFUSED`, `NOPERM`),
/// not an outage to retry, and the README names the patterns such an ACL must allow.
/// Health reads NOT_SERVING meanwhile: its probes without keys pass such an ACL, and
/// readiness used to pass while every grant was refused; so does a user that may only
/// read keys.
#[tokio::test]
async fn a_redis_acl_refusal_is_told_as_such() {
    let redis = RedisServer::start_with(&[
        "--user", "default", "off", "--user", "app1", "on", ">pw", "~app1:*", "&*", "+@all", "--user", "reader", "on",
        ">pw", "%R~*", "&*", "+@all",
    ]);
    let url = format!("redis://app1:pw@127.0.0.1:{}", redis.port());
    let server = Latchkey::launch(&url, &["--key-prefix", "app1:"], ConnectOptions::new()).await;
    server
        .never_serving(Duration::from_secs(3), "every grant is refused")
        .await;
    let client = server.client().await;
    let err = client.lock("orders").try_once().acquire().await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err}");
    assert_eq!(err.reason().as_deref(), Some("REDIS_REFUSED"), "{err}");
    assert!(err.to_string().contains("NOPERM"), "{err}");
    server.stop().await;
    let url = format!("redis://reader:pw@127.0.0.1:{}", redis.port());
    let server = Latchkey::launch(&url, &[], ConnectOptions::new()).await;
    server
        .never_serving(Duration::from_secs(3), "every grant is refused")
        .await;
    server.stop().await;
    // With the patterns the README gives, the same user takes locks.
    let redis = RedisServer::start_with(&[
        "--user", "default", "off", "--user", "app1", "on", ">pw", "~*app1:*", "&*app1:*", "+@all",
    ]);
    let url = format!("redis://app1:pw@127.0.0.1:{}", redis.port());
    let server = Latchkey::start_with(&url, &["--key-prefix", "app1:"]).await;
    assert_locks_work(&server, "orders").await;
    server.stop().await;
}

/// An ACL user that may not run scripts (no `+@scripting`), or a port that runs no
/// scripts (a Sentinel's given as `redis://`), answers `PING`: health stays NOT_SERVING,
/// as every grant would be refused, rather than SERVING on the answer to `PING`.
#[tokio::test]
async fn a_redis_that_refuses_scripts_is_not_served() {
    let redis = RedisServer::start_with(&[
        "--user",
        "default",
        "off",
        "--user",
        "app",
        "on",
        ">app-secret",
        "~*",
        "&*",
        "+@all",
        "-@scripting",
    ]);
    let url = format!("redis://app:app-secret@127.0.0.1:{}", redis.port());
    let server = Latchkey::launch(&url, &[], ConnectOptions::new()).await;
    server
        .never_serving(Duration::from_secs(3), "every grant is refused")
        .await;
}
