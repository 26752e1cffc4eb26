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
