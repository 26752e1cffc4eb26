//! Request validation fuzzed: random `Open` messages (names and owners with unicode,
//! braces, control characters, empty and huge; random kinds, permits, durations and
//! name lists) never panic, and every rejection is INVALID_ARGUMENT naming an `open.*`
//! field. A sample goes through a real server too, which keeps serving.

use latchkey_proto::v1::{acquire_response::Event, Open};
use latchkey_server::error::Error;
use latchkey_server::keys::Keys;
use latchkey_server::service::validate;
use latchkey_tests::server::{Latchkey, RawStream};
use latchkey_tests::RedisServer;
use std::time::Duration;
use tonic::Code;

/// Cases checked against the validator directly, and over gRPC.
const CASES: usize = 50_000;
const SERVED_CASES: usize = 300;

/// Pieces names are built from: the awkward ones are over-represented.
const PIECES: &[&str] = &[
    "{",
    "}",
    "{}",
    "{tag}",
    "a",
    "é",
    "ß",
    "日本",
    "🔒",
    "\u{200b}",
    "\u{feff}",
    "\0",
    "\n",
    "\u{7f}",
    "\u{85}",
    " ",
    ":",
    "*",
    "\\",
    "%",
    "redisson_lock__channel",
    ":write",
    "mode",
    "/",
    "..",
];

fn name(rng: &mut fastrand::Rng) -> String {
    match rng.u8(..10) {
        0 => String::new(),
        1 => "x".repeat(rng.usize(1000..1100)),
        2 => "日".repeat(rng.usize(300..400)),
        _ => (0..rng.usize(1..12))
            .map(|_| PIECES[rng.usize(..PIECES.len())])
            .collect(),
    }
}

fn duration(rng: &mut fastrand::Rng) -> Option<prost_types::Duration> {
    match rng.u8(..6) {
        0..=2 => None,
        3 => Some(prost_types::Duration {
            seconds: rng.i64(..),
            nanos: rng.i32(..),
        }),
        _ => Some(prost_types::Duration {
            seconds: rng.i64(-2..100),
            nanos: rng.i32(-1..1_000_000_001),
        }),
    }
}

fn open(rng: &mut fastrand::Rng) -> Open {
    let names = match rng.u8(..4) {
        0 => (0..rng.usize(0..70)).map(|_| name(rng)).collect(),
        _ => Vec::new(),
    };
    Open {
        name: name(rng),
        kind: rng.i32(-1..7),
        wait_timeout: duration(rng),
        lease: duration(rng),
        owner: if rng.u8(..4) > 0 { String::new() } else { name(rng) },
        permits: if rng.u8(..4) > 0 { 0 } else { rng.u32(..4) },
        limit: if rng.u8(..4) > 0 { 0 } else { rng.u32(..) },
        names,
        redlock: rng.u8(..8) == 0,
    }
}

/// The field a rejection names, checked to be one of `open`'s.
fn check_rejection(e: &Error, open: &Open) {
    let Error::InvalidArgument { field, reason, .. } = e else {
        panic!("{open:?} rejected with {e:?}, not an invalid argument");
    };
    assert!(field.starts_with("open"), "{open:?}: field {field}");
    assert!(!reason.is_empty());
}

#[test]
fn random_opens_never_panic_and_name_the_field() {
    let mut rng = fastrand::Rng::with_seed(7);
    let keys = Keys::new("");
    let (mut accepted, mut rejected) = (0, 0);
    for _ in 0..CASES {
        let open = open(&mut rng);
        match validate::open(
            open.clone(),
            &keys,
            Some(std::time::Duration::from_secs(30)),
            "id:1".into(),
        ) {
            Ok(req) => {
                accepted += 1;
                for k in req.all_keys() {
                    assert!(
                        !k.name().is_empty() && k.name().len() <= validate::MAX_NAME_LEN,
                        "{open:?}"
                    );
                    assert!(!k.name().chars().any(char::is_control), "{open:?}");
                }
            }
            Err(e) => {
                rejected += 1;
                check_rejection(&e, &open);
            }
        }
    }
    println!("{accepted} accepted, {rejected} rejected");
    assert!(accepted > 1000 && rejected > 2000, "both outcomes are exercised");
}

#[tokio::test]
async fn random_opens_over_grpc_get_a_clear_answer() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let mut raw = server.raw().await;
    let mut rng = fastrand::Rng::with_seed(11);
    for _ in 0..SERVED_CASES {
        let mut open = open(&mut rng);
        // Try once, with a short lease, so accepted ones finish at once.
        open.wait_timeout = Some(prost_types::Duration::default());
        open.redlock = false;
        let mut stream = RawStream::open(&mut raw, Some(open.clone())).await;
        match stream.next(Duration::from_secs(10)).await {
            Ok(Some(resp)) => assert!(matches!(resp.event, Some(Event::Acquired(_))), "{open:?}: {resp:?}"),
            Ok(None) => panic!("{open:?}: ended without an answer"),
            Err(status) => {
                let clear = match status.code() {
                    Code::InvalidArgument => status.message().starts_with("open"),
                    Code::DeadlineExceeded | Code::FailedPrecondition => true,
                    _ => false,
                };
                assert!(clear, "{open:?}: {status:?}");
            }
        }
    }
    let lease = server.client().await.lock("after").try_once().acquire().await;
    lease.expect("still serving").release().await.expect("release");
}
