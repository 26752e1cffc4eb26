//! A client that vanishes without closing TCP (a partition, a frozen host) is noticed
//! by HTTP/2 keepalive and its lock released, long before the lease would run out.

use latchkey_tests::proxy::Proxy;
use latchkey_tests::server::Latchkey;
use latchkey_tests::RedisServer;
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
    waiter.await.unwrap().expect("released after the keepalive timeout");
    // The lease (30 s) is far away: keepalive found the dead peer.
    assert!(frozen.elapsed() < Duration::from_secs(8), "{:?}", frozen.elapsed());
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
