//! A client that vanishes without closing TCP (a partition, a frozen host) is noticed
//! by HTTP/2 keepalive and its lock released, long before the lease would run out.

use latchkey_tests::proxy::Proxy;
use latchkey_tests::server::Latchkey;
use latchkey_tests::{bounded, RedisServer};
use std::time::{Duration, Instant};

#[tokio::test]
async fn a_partitioned_client_is_released_by_keepalive() {
    let redis = RedisServer::start();
    let server = Latchkey::start_with(
        &redis.url(),
        &["--keepalive-interval", "1s", "--keepalive-timeout", "1s"],
    )
    .await;
    let proxy = Proxy::start(server.endpoint().trim_start_matches("http://")).await;
    let far = latchkey_client::Client::connect(&proxy.endpoint()).await.unwrap();
    let _lease = far.lock("partitioned").acquire().await.unwrap();
    let near = server.client().await;
    let waiter = tokio::spawn(async move { near.lock("partitioned").wait(Duration::from_secs(20)).acquire().await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    proxy.freeze();
    let frozen = Instant::now();
    bounded(Duration::from_secs(20), "the waiter", waiter)
        .await
        .unwrap()
        .expect("released after the keepalive timeout");
    // The lease (30 s) is far away: keepalive found the dead peer.
    assert!(frozen.elapsed() < Duration::from_secs(8), "{:?}", frozen.elapsed());
}

/// A holder on a watchdog lease behind a silent partition, with every keepalive at its
/// default, is told `lost` before the server gives its lock to the next client: the
/// client's keepalive ends the connection before the server's does. Both used to ping
/// every 10 s with 10 s to answer, so the holder could learn up to ~10 s after the
/// next one had the lock.
#[tokio::test]
async fn a_partitioned_holder_is_told_before_its_lock_is_given_to_another() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let proxy = Proxy::start(server.endpoint().trim_start_matches("http://")).await;
    let far = latchkey_client::Client::connect(&proxy.endpoint()).await.unwrap();
    let lease = far.lock("partitioned-held").acquire().await.unwrap();
    let near = server.client().await;
    let waiter = tokio::spawn(async move {
        let taken = near
            .lock("partitioned-held")
            .wait(Duration::from_secs(40))
            .acquire()
            .await;
        (taken, Instant::now())
    });
    proxy.freeze();
    let reason = tokio::time::timeout(Duration::from_secs(40), lease.lost())
        .await
        .expect("told by keepalive");
    let told = Instant::now();
    assert_eq!(reason, latchkey_client::LostReason::Disconnected);
    let (taken, granted) = tokio::time::timeout(Duration::from_secs(40), waiter)
        .await
        .unwrap()
        .unwrap();
    taken.expect("the server released the lock after its own keepalive");
    assert!(
        told < granted,
        "told {:?} after the next holder's grant",
        told - granted
    );
}

/// A zero keepalive duration is refused at start, naming the flag. The server took
/// them: `--keepalive-timeout 0s` dropped every connection at its first keepalive
/// ping, so every lease was lost one interval after it was granted, and
/// `--keepalive-interval 0s` pinged every connection without pause.
#[test]
fn zero_keepalive_durations_are_refused_at_start() {
    let redis = RedisServer::start();
    for flag in ["--keepalive-interval", "--keepalive-timeout"] {
        let mut server = std::process::Command::new(latchkey_tests::latchkey::server_binary());
        server
            .args(["--listen", "127.0.0.1:0", "--no-metrics", "--redis-url", &redis.url()])
            .args([flag, "0s"]);
        let out = latchkey_tests::process::output_within(&mut server, Duration::from_secs(10));
        let said = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && said.contains(flag), "{flag} 0s: {said}");
    }
}

/// A fixed lease behind a silent partition: the server gives the lock back at the
/// lease's end and another client takes it, while the server's `lost{LEASE_EXPIRED}`
/// cannot reach the partitioned holder. Its `Lease` reports the loss by then all the
/// same (it knows when the lease it was granted ends), not at the keepalive timeout
/// (~20 s): never does it read held while another client holds.
#[tokio::test]
async fn a_partitioned_fixed_lease_is_reported_lost_at_its_end() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let proxy = Proxy::start(server.endpoint().trim_start_matches("http://")).await;
    let far = latchkey_client::Client::connect(&proxy.endpoint()).await.unwrap();
    let asked = Instant::now();
    let lease = far
        .lock("fixed-partitioned")
        .lease(Duration::from_millis(1500))
        .acquire()
        .await
        .unwrap();
    let granted = lease.lease().expect("a fixed lease");
    proxy.freeze();
    let near = server.client().await;
    let taken = near
        .lock("fixed-partitioned")
        .wait(Duration::from_secs(5))
        .acquire()
        .await
        .expect("the server gives the lock back and another client takes it");
    assert!(lease.is_lost(), "the partitioned holder reads held while another holds");
    let reason = tokio::time::timeout(Duration::from_secs(1), lease.lost())
        .await
        .expect("the partitioned holder is told by the lease's end, not by keepalive");
    assert_eq!(reason, latchkey_client::LostReason::LeaseExpired);
    assert!(asked.elapsed() >= granted, "not before the lease it was granted ends");
    let err = lease.release().await.expect_err("a lost lease is not released");
    assert!(matches!(err, latchkey_client::Error::Lost(_)), "{err}");
    taken.release().await.unwrap();
}

/// TCP keepalive counts whole seconds: a sub-second `--keepalive-interval` (HTTP/2's,
/// which finds dead clients) was also given to TCP as 0, which Linux refuses, and each
/// connection accepted logged a warning.
#[tokio::test]
async fn a_sub_second_keepalive_interval_warns_of_nothing() {
    keepalive_interval_warns_of_nothing("500ms").await;
}

/// Nor does one over 32 767 s, the longest TCP keepalive Linux takes: it warned on
/// every connection, its TCP keepalive left at the system's default.
#[tokio::test]
async fn a_keepalive_interval_of_hours_warns_of_nothing() {
    keepalive_interval_warns_of_nothing("10h").await;
}

/// Three connections to a server started with `--keepalive-interval <interval>`: no
/// warning of a TCP keepalive refused.
async fn keepalive_interval_warns_of_nothing(interval: &str) {
    let redis = RedisServer::start();
    let args: Vec<String> = [
        "--redis-url",
        &redis.url(),
        "--no-metrics",
        "--keepalive-interval",
        interval,
    ]
    .iter()
    .map(|a| a.to_string())
    .collect();
    let server = latchkey_tests::LatchkeyProcess::spawn(&args);
    for _ in 0..3 {
        let client = latchkey_client::Client::connect(&server.endpoint()).await.unwrap();
        client.describe("kept").await.expect("answered");
    }
    assert!(!server.log().contains("TCP_KEEPALIVE"), "{}", server.log_tail());
}

/// A `--keepalive-timeout` under the clients' own keepalive verdict (10 s) lets the
/// server drop a silent holder's connection, and give its lock to another, before the
/// holder learns it is cut off: the server says so at start, as it does of a short
/// `--watchdog-timeout`. At the default it says nothing.
#[tokio::test]
async fn a_keepalive_timeout_under_the_clients_verdict_is_warned_of() {
    let redis = RedisServer::start();
    for (timeout, warned) in [("1s", true), ("10s", false)] {
        let args = [
            "--redis-url",
            &redis.url(),
            "--no-metrics",
            "--keepalive-timeout",
            timeout,
        ];
        let server = latchkey_tests::LatchkeyProcess::spawn(&args.map(String::from));
        let client = latchkey_client::Client::connect(&server.endpoint()).await.unwrap();
        client.describe("kept").await.expect("answered");
        let said = server.log().contains("before its client's keepalive tells it");
        assert_eq!(said, warned, "--keepalive-timeout {timeout}: {}", server.log_tail());
    }
}
