//! Bad input gets INVALID_ARGUMENT naming the field, never a panic, a leaked lock or
//! a hung stream; the server keeps serving afterwards.

use latchkey_proto::v1::acquire_request::Action;
use latchkey_proto::v1::acquire_response::Event;
use latchkey_proto::v1::{DescribeRequest, ForceReleaseRequest, ListRequest, Open, Release};
use latchkey_tests::server::{open, pd, Latchkey, RawStream};
use latchkey_tests::RedisServer;
use std::time::Duration;
use tonic::Code;
use tonic_types::StatusExt;

const T: Duration = Duration::from_secs(10);

async fn rejected(server: &Latchkey, first: Option<Action>) -> tonic::Status {
    let mut raw = server.raw().await;
    let mut s = RawStream::open(&mut raw, None).await;
    if let Some(action) = first {
        s.send(action).await;
    }
    s.next(T).await.expect_err("rejected")
}

fn assert_field(status: &tonic::Status, field: &str) {
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(
        status.message().starts_with(field),
        "message {:?} names {field}",
        status.message()
    );
    let info = status.get_details_error_info().expect("ErrorInfo attached");
    assert_eq!(info.domain, "latchkey");
    assert_eq!(info.metadata.get("field").map(String::as_str), Some(field));
}

#[tokio::test]
async fn every_bad_open_field_is_named() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let neg = Some(prost_types::Duration { seconds: -1, nanos: 0 });
    let cases: Vec<(Open, &str)> = vec![
        (open(""), "open.name"),
        (open(&"n".repeat(1025)), "open.name"),
        (open("bad\u{0}name"), "open.name"),
        (open("tab\tname"), "open.name"),
        (open("{}"), "open.name"),
        (Open { kind: 42, ..open("k") }, "open.kind"),
        (
            Open {
                wait_timeout: neg,
                ..open("w")
            },
            "open.wait_timeout",
        ),
        (
            Open {
                lease: neg,
                ..open("l")
            },
            "open.lease",
        ),
        (
            Open {
                lease: Some(pd(Duration::ZERO)),
                ..open("l")
            },
            "open.lease",
        ),
        (
            Open {
                lease: Some(prost_types::Duration {
                    seconds: 10_000_000_000_000_000,
                    nanos: 0,
                }),
                ..open("l")
            },
            "open.lease",
        ),
        (
            Open {
                owner: "x".repeat(2000),
                ..open("o")
            },
            "open.owner",
        ),
        (
            Open {
                owner: "mode".into(),
                ..open("o")
            },
            "open.owner",
        ),
        (
            Open {
                permits: 3,
                ..open("p")
            },
            "open.permits",
        ),
        (Open { limit: 3, ..open("p") }, "open.limit"),
    ];
    for (bad, field) in cases {
        let status = rejected(&server, Some(Action::Open(bad))).await;
        assert_field(&status, field);
    }
    // Nothing was left behind, and the server still grants.
    assert_eq!(redis.cli(&["DBSIZE"]).trim(), "0");
    server
        .client()
        .await
        .lock("ok")
        .try_once()
        .acquire()
        .await
        .expect("still serving");
}

#[tokio::test]
async fn the_first_message_must_be_open() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let status = rejected(&server, Some(Action::Release(Release {}))).await;
    assert_field(&status, "open");
}

/// A client that closes its side before sending anything hears why the stream ended,
/// rather than an OK with no event.
#[tokio::test]
async fn a_stream_closed_before_open_is_told_so() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let mut raw = server.raw().await;
    let mut s = RawStream::open(&mut raw, None).await;
    s.half_close();
    let status = s.next(T).await.expect_err("refused");
    assert_field(&status, "open");
    assert!(status.message().contains("closed before open"), "{status:?}");
}

#[tokio::test]
async fn a_second_open_is_refused_and_the_hold_released() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let mut raw = server.raw().await;
    let mut s = RawStream::open(&mut raw, Some(open("twice"))).await;
    assert!(matches!(
        s.next(T).await.unwrap().unwrap().event,
        Some(Event::Acquired(_))
    ));
    s.send(Action::Open(open("twice"))).await;
    assert_field(&s.next(T).await.unwrap_err(), "open");
    assert_eq!(redis.cli(&["EXISTS", "twice"]).trim(), "0", "the hold was released");
}

#[tokio::test]
async fn bad_multi_lock_names_are_named() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let names = |n: &[&str]| n.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let cases: Vec<(Open, &str)> = vec![
        (
            Open {
                names: names(&["only"]),
                ..open("")
            },
            "open.names",
        ),
        (
            Open {
                names: names(&["a", "a"]),
                ..open("")
            },
            "open.names",
        ),
        (
            Open {
                names: names(&["a", ""]),
                ..open("")
            },
            "open.names",
        ),
        (
            Open {
                names: names(&["a", "b"]),
                ..open("c")
            },
            "open.name",
        ),
        (
            Open {
                names: names(&["a", "b"]),
                kind: 3,
                ..open("")
            },
            "open.kind",
        ),
    ];
    for (bad, field) in cases {
        let status = rejected(&server, Some(Action::Open(bad))).await;
        assert_field(&status, field);
    }
    assert_eq!(redis.cli(&["DBSIZE"]).trim(), "0");
}

#[tokio::test]
async fn admin_calls_name_their_bad_fields() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let mut raw = server.raw().await;
    let s = raw.describe(DescribeRequest { name: String::new() }).await.unwrap_err();
    assert_field(&s, "name");
    let s = raw
        .force_release(ForceReleaseRequest { name: "a\nb".into() })
        .await
        .unwrap_err();
    assert_field(&s, "name");
    let s = raw
        .list(ListRequest {
            page_size: 100_000,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_field(&s, "page_size");
    let s = raw
        .list(ListRequest {
            page_token: "t".repeat(5000),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_field(&s, "page_token");
}

#[tokio::test]
async fn a_stream_that_never_opens_does_not_block_others() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let mut raw = server.raw().await;
    let _silent = RawStream::open(&mut raw, None).await;
    server
        .client()
        .await
        .lock("x")
        .try_once()
        .acquire()
        .await
        .expect("others are served");
}

#[tokio::test]
async fn a_wait_too_long_to_represent_means_wait_forever() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let held = server.client().await.lock("w").acquire().await.unwrap();
    let mut raw = server.raw().await;
    let huge = prost_types::Duration {
        seconds: i64::MAX,
        nanos: 0,
    };
    let mut s = RawStream::open(
        &mut raw,
        Some(Open {
            wait_timeout: Some(huge),
            ..open("w")
        }),
    )
    .await;
    assert!(matches!(
        s.next(T).await.unwrap().unwrap().event,
        Some(Event::Queued(_))
    ));
    held.release().await.unwrap();
    assert!(matches!(
        s.next(T).await.unwrap().unwrap().event,
        Some(Event::Acquired(_))
    ));
}

/// The keys a lock keeps beside its hash (its fencing counter, its hold records, the
/// fair queue, …) are no lock names: taking `latchkey_fence:{orders}` as a lock would
/// make a hash of the fencing counter of `orders`, and every later grant of `orders`
/// would fail on the key's type.
#[tokio::test]
async fn a_locks_records_are_no_lock_names() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let records = [
        "latchkey_fence:{orders}",
        "latchkey_hold:{orders}:h1",
        "redisson_lock_queue:{orders}",
        "redisson_lock_timeout:{orders}",
    ];
    for name in records {
        let s = rejected(&server, Some(Action::Open(open(name)))).await;
        assert_field(&s, "open.name");
        assert!(s.message().contains("records"), "{s:?}");
        let s = server
            .raw()
            .await
            .describe(DescribeRequest { name: name.into() })
            .await
            .unwrap_err();
        assert_field(&s, "name");
    }
    let client = server.client().await;
    let lease = client
        .lock("orders")
        .try_once()
        .acquire()
        .await
        .expect("orders is granted");
    lease.release().await.unwrap();
    let lease = client
        .lock("latchkey_orders:1")
        .try_once()
        .acquire()
        .await
        .expect("a name that only looks like a record is granted");
    lease.release().await.unwrap();
    assert_eq!(redis.cli(&["TYPE", "latchkey_fence:{orders}"]).trim(), "string");
}

/// A stray `}` makes a twin too: `job26625}` (no `{`, so its derived keys brace the
/// whole name) and `{job26625}}` (its own tag `job26625`) had every key but the lock
/// itself in common, and both were accepted (their slots happened to agree). Braces
/// must pair up into tags: both are refused, by every RPC.
#[tokio::test]
async fn a_name_with_a_stray_brace_is_refused() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let mut raw = server.raw().await;
    for name in ["job26625}", "{job26625}}", "a{b"] {
        let err = client.lock(name).try_once().acquire().await.expect_err(name);
        assert_field(err.status().expect("a status"), "open.name");
        let described = raw.describe(DescribeRequest { name: name.into() }).await;
        assert_field(&described.expect_err(name), "name");
        let forced = raw.force_release(ForceReleaseRequest { name: name.into() }).await;
        assert_field(&forced.expect_err(name), "name");
    }
}

/// `orders` and `{orders}` name every key and channel of a lock alike (Redisson's rule
/// builds `prefix:{orders}` for the first and `prefix:{orders}` for the second): the
/// unlock channel, the claims, the fencing counter, the break floor. A release of
/// `orders` granted a waiter's claim on `{orders}` while another stream held it: two
/// holders. A name that is one whole hash tag is refused, by every RPC.
#[tokio::test]
async fn a_name_that_is_one_whole_hash_tag_never_shares_a_lock() {
    let redis = RedisServer::start();
    let a = Latchkey::start(&redis.url()).await;
    let b = Latchkey::start(&redis.url()).await;
    let (ca, cb) = (a.client().await, b.client().await);
    let plain = ca.lock("orders").acquire().await.unwrap();
    match ca.lock("{orders}").acquire().await {
        Ok(twin) => {
            // The waiter of `{orders}` leaves a claim in the keys `orders` shares.
            let waiter = cb.lock("{orders}").wait(T);
            let (waiting, _) = latchkey_tests::server::spawn_queued(waiter, T).await;
            tokio::time::sleep(Duration::from_millis(300)).await;
            plain.release().await.unwrap();
            let granted = tokio::time::timeout(Duration::from_secs(2), waiting).await;
            assert!(
                granted.is_err() || twin.is_lost(),
                "{{orders}} granted to a waiter while its holder still holds it: {granted:?}"
            );
        }
        Err(e) => assert_field(e.status().expect("a status"), "open.name"),
    }
    let mut raw = a.raw().await;
    let name = || "{orders}".to_owned();
    assert_field(
        &raw.describe(DescribeRequest { name: name() }).await.unwrap_err(),
        "name",
    );
    let s = raw
        .force_release(ForceReleaseRequest { name: name() })
        .await
        .unwrap_err();
    assert_field(&s, "name");
    // Names with a tag and more, or a tag that is not the whole name, are fine.
    for name in ["{orders}:1", "x{orders}", "{a}{b}"] {
        ca.lock(name)
            .try_once()
            .acquire()
            .await
            .unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}

/// `Open` with `name` as raw bytes, to send a name that is not UTF-8.
#[derive(Clone, PartialEq, prost::Message)]
struct BytesOpen {
    #[prost(bytes = "vec", tag = "1")]
    name: Vec<u8>,
}

/// `AcquireRequest` carrying a [`BytesOpen`].
#[derive(Clone, PartialEq, prost::Message)]
struct BytesAcquire {
    #[prost(message, optional, tag = "1")]
    open: Option<BytesOpen>,
}

/// A message that does not decode (a string field that is not UTF-8, as a C++ client
/// may send) is a bad field like any other: INVALID_ARGUMENT naming it. An Acquire
/// stream took it for a client gone and ended with OK and no event; the unary calls
/// answered INTERNAL.
#[tokio::test]
async fn a_message_that_does_not_decode_is_invalid_naming_the_field() {
    use latchkey_proto::codec::LeanCodec;
    use latchkey_proto::v1::{AcquireResponse, LockState};
    use tonic::codegen::http::uri::PathAndQuery;
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let channel = server.channel().await;
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    let describe = PathAndQuery::from_static("/latchkey.v1.LockService/Describe");
    let request = tonic::Request::new(BytesOpen { name: vec![b'a', 0xff] });
    let codec = LeanCodec::<BytesOpen, LockState>::default();
    let status = grpc.unary(request, describe, codec).await.unwrap_err();
    assert_field(&status, "name");

    grpc.ready().await.unwrap();
    let acquire = PathAndQuery::from_static("/latchkey.v1.LockService/Acquire");
    let open = BytesAcquire {
        open: Some(BytesOpen { name: vec![b'a', 0xc3] }),
    };
    let codec = LeanCodec::<BytesAcquire, AcquireResponse>::default();
    let answer = grpc
        .streaming(tonic::Request::new(tokio_stream::iter([open])), acquire, codec)
        .await;
    let status = match answer {
        Err(status) => status,
        Ok(stream) => {
            let first = tokio::time::timeout(T, stream.into_inner().message()).await;
            first.expect("answered in time").expect_err("refused")
        }
    };
    assert_field(&status, "open.name");
    assert_eq!(redis.cli(&["DBSIZE"]).trim(), "0");
}

/// A request body fed frame by frame, for bytes no gRPC client would send.
struct RawBody(tokio::sync::mpsc::UnboundedReceiver<tonic::codegen::Bytes>);

impl http_body::Body for RawBody {
    type Data = tonic::codegen::Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        self.0
            .poll_recv(cx)
            .map(|data| data.map(|d| Ok(http_body::Frame::data(d))))
    }
}

/// A holder whose client ends its side in the middle of a message (the 5-byte header
/// says 10 bytes, one comes) broke the protocol while still listening: it hears a
/// status, not an OK with no event while its lock is released.
#[tokio::test]
async fn a_holder_that_ends_mid_message_is_told_so() {
    use latchkey_proto::codec::LeanCodec;
    use latchkey_proto::v1::{AcquireRequest, AcquireResponse};
    use prost::Message;
    use tonic::codec::{Codec, Streaming};
    use tonic::codegen::{http, Bytes, Service};
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let mut channel = server.channel().await;
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let open = AcquireRequest {
        action: Some(Action::Open(open("cut-short"))),
    }
    .encode_to_vec();
    let mut frame = vec![0u8];
    frame.extend_from_slice(&u32::try_from(open.len()).unwrap().to_be_bytes());
    frame.extend_from_slice(&open);
    tx.send(Bytes::from(frame)).unwrap();
    let request = http::Request::builder()
        .method("POST")
        .uri(format!("{}/latchkey.v1.LockService/Acquire", server.endpoint()))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(tonic::body::Body::new(RawBody(rx)))
        .unwrap();
    std::future::poll_fn(|cx| Service::<http::Request<tonic::body::Body>>::poll_ready(&mut channel, cx))
        .await
        .unwrap();
    let response = tokio::time::timeout(T, channel.call(request)).await.unwrap().unwrap();
    let (parts, body) = response.into_parts();
    let decoder = LeanCodec::<AcquireRequest, AcquireResponse>::default().decoder();
    let mut events = Streaming::new_response(decoder, body, parts.status, None, None);
    let first = tokio::time::timeout(T, events.message()).await.unwrap().unwrap();
    assert!(matches!(first.and_then(|r| r.event), Some(Event::Acquired(_))));
    tx.send(Bytes::from_static(&[0, 0, 0, 0, 10, 0x12])).unwrap();
    drop(tx);
    let end = tokio::time::timeout(T, events.message())
        .await
        .expect("answered in time");
    let status = end.expect_err("a status, not an OK with no event");
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert_eq!(redis.cli(&["EXISTS", "cut-short"]).trim(), "0", "the hold was released");
}
