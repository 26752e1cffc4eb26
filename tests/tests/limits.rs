//! Server bounds a misbehaving client cannot push past: waiters per lock and per
//! server, Acquire streams per connection and message size, each answered with
//! RESOURCE_EXHAUSTED, ErrorInfo `LIMIT_REACHED` and a message naming the flag.

use latchkey_client::Client;
use latchkey_proto::v1::Open;
use latchkey_tests::server::{spawn_queued, Latchkey, RawStream, Waiting};
use latchkey_tests::RedisServer;
use std::time::Duration;
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

#[tokio::test]
async fn acquire_streams_are_bounded_per_connection() {
    let redis = RedisServer::start();
    let server = Latchkey::start_with(&redis.url(), &["--max-streams-per-connection", "2"]).await;
    let client = server.client().await;
    let _one = client.lock("one").acquire().await.unwrap();
    let _two = client.lock("two").acquire().await.unwrap();
    let err = client.lock("three").acquire().await.unwrap_err();
    assert_limit(err.status().expect("a status"), "--max-streams-per-connection");
    // Another connection has its own bound, and unary calls are not Acquire streams.
    let other = server.client().await;
    other.lock("three").acquire().await.expect("another connection");
    assert!(client.describe("one").await.unwrap().locked);
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
