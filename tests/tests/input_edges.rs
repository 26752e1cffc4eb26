//! Bad input and resource limits at the gRPC edge: every refusal is a clear status
//! naming its field or flag, and leaves nothing in Redis, no gauge raised, and the
//! server serving.

use latchkey_client::LockKind;
use latchkey_proto::v1::acquire_request::Action;
use latchkey_proto::v1::acquire_response::Event;
use latchkey_proto::v1::{AcquireRequest, ListRequest, Open, Release, WatchRequest};
use latchkey_tests::server::{open, pd, spawn_queued, Latchkey, RawStream};
use latchkey_tests::{bounded, gauges, poll_until, LatchkeyProcess, RedisServer};
use std::time::Duration;
use tonic::Code;
use tonic_types::StatusExt;

const T: Duration = Duration::from_secs(10);

/// `status` refuses the element `index` of the repeated field `field`: its message
/// starts `field[index]:`, its ErrorInfo names both.
fn assert_element(status: &tonic::Status, field: &str, index: usize) {
    assert_field(status, field);
    assert!(
        status.message().starts_with(&format!("{field}[{index}]: ")),
        "{status:?}"
    );
    let info = status.get_details_error_info().expect("ErrorInfo attached");
    assert_eq!(info.metadata.get("index"), Some(&index.to_string()), "{status:?}");
}

fn assert_field(status: &tonic::Status, field: &str) {
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(
        status.message().starts_with(field),
        "message {:?} names {field}",
        status.message()
    );
    let info = status.get_details_error_info().expect("ErrorInfo attached");
    assert_eq!(
        info.metadata.get("field").map(String::as_str),
        Some(field),
        "{status:?}"
    );
}

fn assert_limit(status: &tonic::Status, flag: &str) {
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains(flag), "{:?} names {flag}", status.message());
    let info = status.get_details_error_info().expect("ErrorInfo attached");
    assert_eq!(info.reason, "LIMIT_REACHED");
}

/// The first event or the status of a raw stream opened with `o`.
async fn first(server: &Latchkey, o: Open) -> (RawStream, Result<Event, tonic::Status>) {
    let mut raw = server.raw().await;
    let mut s = RawStream::open(&mut raw, Some(o)).await;
    let r = s.next(T).await.map(|m| m.and_then(|m| m.event).expect("an event"));
    (s, r)
}

async fn refused(server: &Latchkey, o: Open) -> tonic::Status {
    let (_s, r) = first(server, o).await;
    r.expect_err("refused")
}

/// Keys left in Redis that never expire (markers, tombstones and fencing counters
/// expire on their own), and fair queues that still hold an entry.
fn leftover_keys(redis: &RedisServer) -> Vec<String> {
    redis
        .cli(&["KEYS", "*"])
        .lines()
        .filter(|k| !k.is_empty())
        .filter_map(|k| {
            let ttl = redis.cli(&["PTTL", k]).trim().to_owned();
            let queue = k.starts_with("redisson_lock_queue:") || k.starts_with("redisson_lock_timeout:");
            (ttl == "-1" || queue).then(|| format!("{k} (pttl {ttl})"))
        })
        .collect()
}

async fn no_leftover_keys(redis: &RedisServer, what: &str) {
    let clean = poll_until(T, || leftover_keys(redis).is_empty()).await;
    assert!(clean, "{what}: left in Redis: {:?}", leftover_keys(redis));
}

async fn gauges_back_to_zero(port: u16, what: &str) {
    let idle = poll_until(T, || gauges(port) == [0.0; 4]).await;
    assert!(
        idle,
        "{what}: (streams, leases, waiters, subscriptions) = {:?}",
        gauges(port)
    );
}

fn semaphore(limit: u32, permits: u32, name: &str) -> Open {
    Open {
        kind: LockKind::Semaphore as i32,
        limit,
        permits,
        ..open(name)
    }
}

/// Waiters of every kind refused by `--max-waiters-per-lock` after their first try
/// (which, for a fair lock, queued them in Redis) leave nothing behind: no queue entry
/// ahead of later requests, no gauge raised, and the waiter before them still granted.
#[tokio::test]
async fn refused_waiters_of_every_kind_leave_nothing_behind() {
    let redis = RedisServer::start();
    let args = [
        "--redis-url",
        &redis.url(),
        "--max-waiters-per-lock",
        "1",
        "--max-waiters",
        "50",
    ]
    .map(str::to_owned);
    let server = LatchkeyProcess::spawn(&args);
    let port = server.metrics_port().unwrap();
    let client = server.serving_client().await;
    gauges_back_to_zero(port, "start").await;
    // (kind of holder, kind of waiters, named owner of the waiters)
    let cases = [
        (LockKind::Fair, LockKind::Fair, None),
        (LockKind::Mutex, LockKind::Mutex, None),
        (LockKind::Mutex, LockKind::Mutex, Some("app:1")),
        (LockKind::Read, LockKind::Write, None),
        (LockKind::Write, LockKind::Read, None),
        (LockKind::Semaphore, LockKind::Semaphore, None),
    ];
    for (i, (held_kind, kind, owner)) in cases.into_iter().enumerate() {
        let name = format!("refused/{i}");
        let lock = |k: LockKind| {
            let l = client.lock(name.clone()).kind(k);
            if k == LockKind::Semaphore {
                l.limit(1)
            } else {
                l
            }
        };
        let with_owner = |l: latchkey_client::LockBuilder| match owner {
            Some(o) => l.owner(o),
            None => l,
        };
        let held = lock(held_kind).acquire().await.unwrap();
        let (w1, _) = spawn_queued(with_owner(lock(kind)).wait(T), T).await;
        let err = with_owner(lock(kind)).wait(T).acquire().await.unwrap_err();
        assert_limit(err.status().expect("a status"), "--max-waiters-per-lock");
        // A different owner's waiter too (a named owner's fellow streams share holds).
        let err = lock(kind).wait(T).acquire().await.unwrap_err();
        assert_limit(err.status().expect("a status"), "--max-waiters-per-lock");
        let state = client.describe(name.clone()).await.unwrap();
        assert!(state.waiters.len() <= 1, "case {i}: {:?}", state.waiters);
        held.release().await.unwrap();
        let lease = bounded(T, "the first waiter", w1).await.unwrap().expect("granted");
        lease.release().await.unwrap();
        // Nothing of the refused ones is in the way: a try-once is granted at once.
        let again = lock(kind).try_once().acquire().await;
        assert!(again.is_ok(), "case {i}: {again:?}");
        again.unwrap().release().await.unwrap();
        gauges_back_to_zero(port, &format!("case {i}")).await;
    }
    no_leftover_keys(&redis, "after every case").await;
}

/// A fair newcomer refused by `--max-waiters-per-lock` is refused before its first try:
/// this server's waiters stand ahead of it in the lock's queue, so the try could not be
/// granted; it used to queue the newcomer in Redis (`RPUSH`) for a leave to take it out
/// (`LREM`), two scripts per refusal. A fair wait on a free lock is still granted under
/// the bound, as a bound of 0 shows.
#[tokio::test]
async fn a_fair_newcomer_over_the_bound_is_refused_without_a_try() {
    let redis = RedisServer::start();
    let args = ["--max-waiters-per-lock", "1"];
    let server = Latchkey::start_with(&redis.url(), &args).await;
    let client = server.client().await;
    let fair = || client.lock("bounded-fair").kind(LockKind::Fair);
    let held = fair().acquire().await.unwrap();
    let (waiter, _) = spawn_queued(fair().wait(T), T).await;
    let queue_writes = || redis.command_calls("rpush") + redis.command_calls("lrem");
    let before = queue_writes();
    for _ in 0..3 {
        let err = fair().wait(T).acquire().await.unwrap_err();
        assert_limit(err.status().expect("a status"), "--max-waiters-per-lock");
    }
    assert_eq!(queue_writes(), before, "the refused newcomers wrote to the queue");
    held.release().await.unwrap();
    let lease = bounded(T, "the waiter", waiter).await.unwrap().expect("granted");
    lease.release().await.unwrap();
    // A client-named owner's stream is still tried: its owner holds the lock, so it is
    // granted ahead of the line.
    let owned = || client.lock("bounded-owned").kind(LockKind::Fair);
    let held = owned().owner("app-x").acquire().await.unwrap();
    let (other, _) = spawn_queued(owned().owner("app-y").wait(T), T).await;
    let again = owned().owner("app-x").wait(T).acquire().await;
    assert_eq!(again.expect("reentered").hold_count(), 2);
    drop(held);
    other.abort();
    server.stop().await;
    let server = Latchkey::start_with(&redis.url(), &["--max-waiters-per-lock", "0"]).await;
    let client = server.client().await;
    let lease = client.lock("bounded-fair").kind(LockKind::Fair).wait(T).acquire().await;
    lease
        .expect("a free lock is granted under a bound of 0")
        .release()
        .await
        .unwrap();
}

/// Semaphore limits and permits at their edges: 0, 1, u32::MAX, permits over the
/// limit, a differing limit.
#[tokio::test]
async fn semaphore_permits_and_limits_at_their_edges() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    assert_field(&refused(&server, semaphore(0, 0, "s/zero")).await, "open.limit");
    assert_field(&refused(&server, semaphore(0, 1, "s/zero")).await, "open.limit");
    assert_field(&refused(&server, semaphore(1, 2, "s/over")).await, "open.permits");
    assert_field(
        &refused(&server, semaphore(u32::MAX - 1, u32::MAX, "s/over")).await,
        "open.permits",
    );
    // permits 0 means 1.
    let (mut one, ev) = first(&server, semaphore(1, 0, "s/one")).await;
    match ev {
        Ok(Event::Acquired(a)) => assert_eq!(a.hold_count, 1),
        other => panic!("{other:?}"),
    }
    one.release().await;
    assert!(matches!(
        one.next(T).await.unwrap().and_then(|m| m.event),
        Some(Event::Released(_))
    ));
    // The whole of the largest semaphore, then one more permit waits for it.
    let (mut all, ev) = first(&server, semaphore(u32::MAX, u32::MAX, "s/max")).await;
    match ev {
        Ok(Event::Acquired(a)) => assert_eq!(a.hold_count, u32::MAX),
        other => panic!("{other:?}"),
    }
    let (mut more, ev) = first(
        &server,
        Open {
            wait_timeout: Some(pd(T)),
            ..semaphore(u32::MAX, 1, "s/max")
        },
    )
    .await;
    assert!(matches!(ev, Ok(Event::Queued(_))), "{ev:?}");
    let mismatch = refused(&server, semaphore(u32::MAX - 1, 1, "s/max")).await;
    assert_eq!(mismatch.code(), Code::FailedPrecondition, "{mismatch:?}");
    assert_eq!(mismatch.get_details_error_info().unwrap().reason, "LIMIT_MISMATCH");
    let described = server.client().await.describe("s/max").await.unwrap();
    assert_eq!(described.holders.iter().map(|h| h.hold_count).sum::<u32>(), u32::MAX);
    all.release().await;
    assert!(matches!(
        all.next(T).await.unwrap().and_then(|m| m.event),
        Some(Event::Released(_))
    ));
    match more.next(T).await.unwrap().and_then(|m| m.event) {
        Some(Event::Acquired(a)) => assert_eq!(a.hold_count, 1),
        other => panic!("{other:?}"),
    }
    more.release().await;
    assert!(matches!(
        more.next(T).await.unwrap().and_then(|m| m.event),
        Some(Event::Released(_))
    ));
    no_leftover_keys(&redis, "semaphores").await;
}

/// Durations at their edges: nanos out of range, signs that disagree, values beyond
/// any clock, the shortest waits on a busy lock (fair: no queue entry left).
#[tokio::test]
async fn durations_at_their_edges() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let d = |seconds, nanos| Some(prost_types::Duration { seconds, nanos });
    let cases = [
        (d(0, 1_000_000_000), None, "open.wait_timeout"),
        (d(0, i32::MAX), None, "open.wait_timeout"),
        (d(1, -1), None, "open.wait_timeout"),
        (d(-1, 1), None, "open.wait_timeout"),
        (d(i64::MIN, 0), None, "open.wait_timeout"),
        (None, d(0, 1_000_000_000), "open.lease"),
        (None, d(1, -1), "open.lease"),
        (None, d(0, 999_999), "open.lease"),
        (None, d(i64::MAX, 999_999_999), "open.lease"),
        (None, d(365 * 86_400 + 1, 0), "open.lease"),
    ];
    for (wait, lease, field) in cases {
        let o = Open {
            wait_timeout: wait,
            lease,
            ..open("d/bad")
        };
        assert_field(&refused(&server, o).await, field);
    }
    // The longest lease is granted, and told.
    let (mut long, ev) = first(
        &server,
        Open {
            lease: d(365 * 86_400, 0),
            ..open("d/long")
        },
    )
    .await;
    assert!(matches!(ev, Ok(Event::Acquired(_))), "{ev:?}");
    // A wait of the largest i64 seconds with the largest nanos waits, then is granted.
    let (mut forever, ev) = first(
        &server,
        Open {
            wait_timeout: d(i64::MAX, 999_999_999),
            ..open("d/long")
        },
    )
    .await;
    assert!(matches!(ev, Ok(Event::Queued(_))), "{ev:?}");
    long.release().await;
    assert!(matches!(
        long.next(T).await.unwrap().and_then(|m| m.event),
        Some(Event::Released(_))
    ));
    assert!(matches!(
        forever.next(T).await.unwrap().and_then(|m| m.event),
        Some(Event::Acquired(_))
    ));
    forever.release().await;
    let _ = forever.next(T).await;
    // The shortest positive waits on a busy fair lock time out and leave no entry.
    let (mut holder, _) = first(
        &server,
        Open {
            kind: LockKind::Fair as i32,
            ..open("d/fair")
        },
    )
    .await;
    for wait in [d(0, 1), d(0, 1_000_000), d(0, 0)] {
        let o = Open {
            kind: LockKind::Fair as i32,
            wait_timeout: wait,
            ..open("d/fair")
        };
        let (mut s, mut ev) = first(&server, o).await;
        while let Ok(Event::Queued(_)) = ev {
            ev = s.next(T).await.map(|m| m.and_then(|m| m.event).expect("an event"));
        }
        let status = ev.expect_err("timed out");
        assert_eq!(status.code(), Code::DeadlineExceeded, "{wait:?}: {status:?}");
    }
    let queue = || redis.cli(&["LLEN", "redisson_lock_queue:{d/fair}"]).trim().to_owned();
    assert!(poll_until(T, || queue() == "0").await, "queue left: {}", queue());
    holder.release().await;
    let _ = holder.next(T).await;
    no_leftover_keys(&redis, "durations").await;
}

/// A multi-lock at its bounds: 64 names of 1024 bytes are taken and given back whole;
/// 65 names, a bad name among them, or a repeated one are refused naming `open.names`
/// (and the bad or repeated name's index in it).
#[tokio::test]
async fn a_multi_lock_at_its_bounds() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let name = |i: usize| format!("{i:04}{}", "m".repeat(1020));
    let names: Vec<String> = (0..64).map(name).collect();
    let multi = |names: Vec<String>| Open { names, ..open("") };
    let (mut all, ev) = first(&server, multi(names.clone())).await;
    match ev {
        Ok(Event::Acquired(a)) => assert_eq!(a.fencing_tokens.len(), 64),
        other => panic!("{other:?}"),
    }
    let mut over = names.clone();
    over.push(name(64));
    assert_field(&refused(&server, multi(over)).await, "open.names");
    let mut bad = names[..3].to_vec();
    bad.push("x\u{0}y".into());
    assert_element(&refused(&server, multi(bad)).await, "open.names", 3);
    let mut long = names[..3].to_vec();
    long.insert(1, "l".repeat(1025));
    assert_element(&refused(&server, multi(long)).await, "open.names", 1);
    let repeated = vec![names[0].clone(), names[1].clone(), names[0].clone()];
    let s = refused(&server, multi(repeated)).await;
    assert_element(&s, "open.names", 2);
    assert!(s.message().contains("repeats the name at index 0"), "{s:?}");
    let tag = vec!["tagged".to_owned(), "{tagged}".to_owned()];
    assert_field(&refused(&server, multi(tag)).await, "open.names");
    // Options that do not go with a multi-lock.
    let o = Open {
        redlock: true,
        ..multi(names[..2].to_vec())
    };
    let s = refused(&server, o).await;
    assert!(
        matches!(s.code(), Code::InvalidArgument | Code::FailedPrecondition),
        "{s:?}"
    );
    let o = Open {
        kind: LockKind::Semaphore as i32,
        limit: 2,
        ..multi(names[..2].to_vec())
    };
    assert_field(&refused(&server, o).await, "open.kind");
    all.release().await;
    assert!(matches!(
        all.next(T).await.unwrap().and_then(|m| m.event),
        Some(Event::Released(_))
    ));
    no_leftover_keys(&redis, "multi-lock").await;
}

/// Owners at their edges.
#[tokio::test]
async fn owners_at_their_edges() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let owned = |owner: &str, name: &str| Open {
        owner: owner.to_owned(),
        ..open(name)
    };
    for bad in [
        "x".repeat(1025),
        "a\u{0}b".into(),
        "a\u{7f}".into(),
        "latchkey-x:1".into(),
        "mode".into(),
        "w:write".into(),
    ] {
        assert_field(&refused(&server, owned(&bad, "o/bad")).await, "open.owner");
        let o = Open {
            kind: LockKind::Read as i32,
            ..owned(&bad, "o/bad")
        };
        assert_field(&refused(&server, o).await, "open.owner");
    }
    let longest = "o".repeat(1024);
    let (mut a, ev) = first(&server, owned(&longest, "o/ok")).await;
    match ev {
        Ok(Event::Acquired(acq)) => assert_eq!(acq.owner, longest),
        other => panic!("{other:?}"),
    }
    let (mut b, ev) = first(&server, owned(&longest, "o/ok")).await;
    match ev {
        Ok(Event::Acquired(acq)) => assert_eq!(acq.hold_count, 2),
        other => panic!("{other:?}"),
    }
    a.release().await;
    b.release().await;
    let _ = (a.next(T).await, b.next(T).await);
    no_leftover_keys(&redis, "owners").await;
}

/// Messages out of order and unknown enum values on a stream.
#[tokio::test]
async fn messages_out_of_order_and_unknown_kinds() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    for kind in [6, -1, i32::MAX, i32::MIN] {
        let o = Open { kind, ..open("k") };
        assert_field(&refused(&server, o).await, "open.kind");
    }
    // An empty action first; a release first.
    let mut raw = server.raw().await;
    let mut s = RawStream::open(&mut raw, None).await;
    s.tx.as_ref()
        .unwrap()
        .send(AcquireRequest { action: None })
        .await
        .unwrap();
    assert_field(&s.next(T).await.unwrap_err(), "open");
    let mut s = RawStream::open(&mut raw, None).await;
    s.send(Action::Release(Release {})).await;
    s.send(Action::Open(open("k"))).await;
    assert_field(&s.next(T).await.unwrap_err(), "open");
    // A waiter that sends an empty action leaves its place and the lock to the next.
    let (mut holder, _) = first(&server, open("k")).await;
    let (mut waiter, ev) = first(
        &server,
        Open {
            wait_timeout: Some(pd(T)),
            kind: LockKind::Mutex as i32,
            ..open("k")
        },
    )
    .await;
    assert!(matches!(ev, Ok(Event::Queued(_))), "{ev:?}");
    waiter
        .tx
        .as_ref()
        .unwrap()
        .send(AcquireRequest { action: None })
        .await
        .unwrap();
    assert_field(&waiter.next(T).await.unwrap_err(), "action");
    holder.release().await;
    let _ = holder.next(T).await;
    no_leftover_keys(&redis, "out of order").await;
    let (_again, ev) = first(
        &server,
        Open {
            wait_timeout: Some(pd(Duration::ZERO)),
            ..open("k")
        },
    )
    .await;
    assert!(matches!(ev, Ok(Event::Acquired(_))), "{ev:?}");
}

/// Refused streams (a bad open, a bad Watch name) give their per-connection places
/// back: on a connection allowed one stream, the next good stream is served. A Watch's
/// bad name is refused as such on a connection with no place left.
#[tokio::test]
async fn refused_streams_give_their_connection_places_back() {
    let redis = RedisServer::start();
    let server = Latchkey::start_with(
        &redis.url(),
        &["--max-streams-per-connection", "1", "--max-streams", "2"],
    )
    .await;
    let mut raw = server.raw().await;
    for _ in 0..5 {
        let mut s = RawStream::open(&mut raw, Some(open(""))).await;
        assert_field(&s.next(T).await.unwrap_err(), "open.name");
        for bad in [String::new(), "w".repeat(1025), "{w}".into(), "a\nb".into()] {
            let err = raw.watch(WatchRequest { name: bad }).await.unwrap_err();
            assert_field(&err, "name");
        }
    }
    // One stream on the connection; a second is refused naming the flag.
    let mut held = RawStream::open(&mut raw, Some(open("conn"))).await;
    assert!(matches!(
        held.next(T).await.unwrap().and_then(|m| m.event),
        Some(Event::Acquired(_))
    ));
    let err = raw.watch(WatchRequest { name: "conn".into() }).await.unwrap_err();
    assert_limit(&err, "--max-streams-per-connection");
    // A bad name is named first, whatever room is left.
    let err = raw.watch(WatchRequest { name: String::new() }).await.unwrap_err();
    assert_field(&err, "name");
    let mut s = RawStream::open(&mut raw, Some(open("conn2"))).await;
    assert_limit(&s.next(T).await.unwrap_err(), "--max-streams-per-connection");
    // Unary calls still go through, the server bound takes another connection's.
    assert!(
        raw.describe(latchkey_proto::v1::DescribeRequest { name: "conn".into() })
            .await
            .unwrap()
            .into_inner()
            .locked
    );
    let mut other = server.raw().await;
    let mut w = other
        .watch(WatchRequest { name: "conn".into() })
        .await
        .unwrap()
        .into_inner();
    assert!(bounded(T, "a state", w.message()).await.unwrap().is_some());
    let mut third = server.raw().await;
    let mut s = RawStream::open(&mut third, Some(open("conn3"))).await;
    assert_limit(&s.next(T).await.unwrap_err(), "--max-streams)");
    drop(w);
    held.release().await;
    let _ = held.next(T).await;
    // All places back: the first connection takes a stream again.
    let ev = bounded(T, "served", async {
        loop {
            let mut s2 = RawStream::open(&mut raw, Some(open("conn4"))).await;
            match s2.next(T).await {
                Ok(Some(m)) => return m.event,
                _ => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    })
    .await;
    assert!(matches!(ev, Some(Event::Acquired(_))), "{ev:?}");
}

/// List at its edges: page sizes, forged and foreign page tokens (another listing's is
/// refused), long prefixes, glob characters.
#[tokio::test]
async fn list_at_its_edges() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let mut leases = Vec::new();
    for n in ["l/a", "l/b", "l/c", "l*x", "m/a"] {
        leases.push(client.lock(n).acquire().await.unwrap());
    }
    let mut raw = server.raw().await;
    let list = |prefix: &str, page_size: u32, page_token: &str| ListRequest {
        prefix: prefix.into(),
        page_size,
        page_token: page_token.into(),
    };
    let page = raw.list(list("l/", 0, "")).await.unwrap().into_inner();
    assert_eq!(page.locks.len(), 3);
    assert!(page.next_page_token.is_empty());
    assert_field(&raw.list(list("l/", 1001, "")).await.unwrap_err(), "page_size");
    assert_field(&raw.list(list("l/", u32::MAX, "")).await.unwrap_err(), "page_size");
    assert_field(&raw.list(list(&"p".repeat(1025), 0, "")).await.unwrap_err(), "prefix");
    // A token cannot start with a prefix that long: the prefix is named, not the token.
    assert_field(&raw.list(list(&"p".repeat(1025), 0, "p")).await.unwrap_err(), "prefix");
    assert_field(
        &raw.list(list("", 0, &"t".repeat(1025))).await.unwrap_err(),
        "page_token",
    );
    // Paging one by one.
    let mut token = String::new();
    let mut seen = Vec::new();
    loop {
        let page = raw.list(list("l/", 1, &token)).await.unwrap().into_inner();
        seen.extend(page.locks.iter().map(|l| l.name.clone()));
        if page.next_page_token.is_empty() {
            break;
        }
        assert!(seen.len() < 10, "pages forever: {seen:?}");
        token = page.next_page_token;
    }
    assert_eq!(seen, ["l/a", "l/b", "l/c"]);
    // A glob character in the prefix matches itself only.
    let page = raw.list(list("l*", 0, "")).await.unwrap().into_inner();
    assert_eq!(page.locks.iter().map(|l| l.name.as_str()).collect::<Vec<_>>(), ["l*x"]);
    // Another listing's token (it does not start with the prefix) is refused: it would
    // skip names or end the listing. A forged one under the prefix is a lower bound.
    let m_page = raw.list(list("m/", 0, "")).await.unwrap().into_inner();
    assert_eq!(m_page.locks.len(), 1);
    for foreign in ["m/a", "\u{10ffff}", "\u{0}", "zzz"] {
        assert_field(&raw.list(list("l/", 0, foreign)).await.unwrap_err(), "page_token");
    }
    let page = raw.list(list("l/", 0, "l/a")).await.unwrap().into_inner();
    assert_eq!(
        page.locks.iter().map(|l| l.name.as_str()).collect::<Vec<_>>(),
        ["l/b", "l/c"]
    );
    for forged in ["l/\u{10ffff}", "l/zzz"] {
        let page = raw.list(list("l/", 0, forged)).await.unwrap().into_inner();
        assert!(page.locks.is_empty(), "{forged:?}");
    }
    // Control characters in a prefix match nothing and fail nothing.
    let page = raw.list(list("\u{0}\n", 0, "")).await.unwrap().into_inner();
    assert!(page.locks.is_empty());
    for l in leases {
        l.release().await.unwrap();
    }
    no_leftover_keys(&redis, "list").await;
}

/// RedLock on a server without deployments, and with options it does not take.
#[tokio::test]
async fn redlock_options_on_a_server_without_deployments() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    for o in [
        Open {
            redlock: true,
            ..open("r")
        },
        Open {
            redlock: true,
            kind: LockKind::Fair as i32,
            ..open("r")
        },
    ] {
        let s = refused(&server, o).await;
        assert_eq!(s.code(), Code::FailedPrecondition, "{s:?}");
        assert_eq!(s.get_details_error_info().unwrap().reason, "REDLOCK_NOT_CONFIGURED");
    }
    no_leftover_keys(&redis, "redlock").await;
}

/// Waiters beyond `--max-waiters` across names, refused while many raw streams wait;
/// every place comes back.
#[tokio::test]
async fn waiters_beyond_the_server_bound_across_names() {
    let redis = RedisServer::start();
    let args = ["--redis-url", &redis.url(), "--max-waiters", "3"].map(str::to_owned);
    let server = LatchkeyProcess::spawn(&args);
    let port = server.metrics_port().unwrap();
    let client = server.serving_client().await;
    gauges_back_to_zero(port, "start").await;
    let kinds = [LockKind::Fair, LockKind::Mutex, LockKind::Write];
    let mut held = Vec::new();
    let mut waiting = Vec::new();
    for (i, kind) in kinds.into_iter().enumerate() {
        held.push(client.lock(format!("t/{i}")).kind(kind).acquire().await.unwrap());
        waiting.push(
            spawn_queued(client.lock(format!("t/{i}")).kind(kind).wait(T), T)
                .await
                .0,
        );
    }
    for (i, kind) in kinds.into_iter().enumerate() {
        let err = client
            .lock(format!("t/{i}"))
            .kind(kind)
            .wait(T)
            .acquire()
            .await
            .unwrap_err();
        assert_limit(err.status().expect("a status"), "--max-waiters)");
        if kind == LockKind::Mutex {
            let err = client
                .lock_all([format!("t/{i}"), "t/free".to_owned()])
                .wait(T)
                .acquire()
                .await;
            let err = err.map(|_| ()).unwrap_err();
            assert_limit(err.status().expect("a status"), "--max-waiters)");
        }
    }
    for h in held {
        h.release().await.unwrap();
    }
    for w in waiting {
        bounded(T, "a waiter", w)
            .await
            .unwrap()
            .expect("granted")
            .release()
            .await
            .unwrap();
    }
    gauges_back_to_zero(port, "after").await;
    no_leftover_keys(&redis, "after").await;
}

/// Many streams refused on one connection (a bad `open`, a bound reached), each left
/// open on the client's side as a client that does not half-close leaves it, do not
/// cost the connection: a lease held on it lives on and is released on request.
#[tokio::test]
async fn many_refused_streams_on_a_connection_keep_its_lease() {
    let redis = RedisServer::start();
    let server = Latchkey::start_with(&redis.url(), &["--max-streams-per-connection", "2"]).await;
    let mut raw = server.raw().await;
    let mut held = RawStream::open(&mut raw, Some(open("kept"))).await;
    assert!(matches!(
        held.next(T).await.unwrap().and_then(|m| m.event),
        Some(Event::Acquired(_))
    ));
    let mut watch = raw
        .watch(WatchRequest { name: "kept".into() })
        .await
        .unwrap()
        .into_inner();
    assert!(bounded(T, "a state", watch.message()).await.unwrap().is_some());
    for i in 0..1500 {
        let bad = if i % 2 == 0 { open("") } else { open("fine") };
        let mut s = RawStream::open(&mut raw, Some(bad)).await;
        let status = s.next(T).await.expect_err("refused");
        assert!(
            matches!(status.code(), Code::InvalidArgument | Code::ResourceExhausted),
            "stream {i}: {status:?}"
        );
        if status.code() == Code::ResourceExhausted {
            assert_limit(&status, "--max-streams-per-connection");
        }
    }
    // The lease and the watch on the connection live on.
    let state = raw
        .describe(latchkey_proto::v1::DescribeRequest { name: "kept".into() })
        .await
        .expect("the connection still serves")
        .into_inner();
    assert!(state.locked);
    held.release().await;
    match held.next(T).await {
        Ok(Some(m)) => assert!(matches!(m.event, Some(Event::Released(_))), "{m:?}"),
        other => panic!("the held stream: {other:?}"),
    }
    let next = bounded(T, "the watch sees the release", async {
        loop {
            match watch.message().await {
                Ok(Some(s)) if !s.locked => return Ok(()),
                Ok(Some(_)) => continue,
                other => return Err(format!("{other:?}")),
            }
        }
    })
    .await;
    assert!(next.is_ok(), "the watch: {next:?}");
}

/// Fair newcomers refused by `--max-waiters-per-lock` while the lock is passed in memory
/// among this server's waiters (a newcomer joins that run before its first answer)
/// leave no queue entry: every accepted waiter is granted in turn, and the lock is free
/// for a try-once at the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fair_newcomers_refused_during_a_run_in_memory_leave_no_entry() {
    let redis = RedisServer::start();
    let args = ["--redis-url", &redis.url(), "--max-waiters-per-lock", "3"].map(str::to_owned);
    let server = LatchkeyProcess::spawn(&args);
    let port = server.metrics_port().unwrap();
    let client = server.serving_client().await;
    let fair = || client.lock("hotfair").kind(LockKind::Fair);
    for round in 0..5 {
        let held = fair().acquire().await.unwrap();
        let mut waiting = Vec::new();
        for _ in 0..3 {
            waiting.push(spawn_queued(fair().wait(T), T).await.0);
        }
        // Each granted lease is released at once, so the line moves on its own.
        let take_and_give = |w: latchkey_tests::server::Waiting| {
            tokio::spawn(async move {
                match w.await.expect("task") {
                    Ok(lease) => lease.release().await.map_err(|e| e.to_string()),
                    Err(e) => Err(format!("{:?}", e.status().map(|s| (s.code(), s.message().to_owned())))),
                }
            })
        };
        let accepted: Vec<_> = waiting.into_iter().map(take_and_give).collect();
        let newcomers: Vec<_> = (0..6)
            .map(|_| take_and_give(tokio::spawn(fair().wait(T).acquire())))
            .collect();
        held.release().await.unwrap();
        let mut granted = 0;
        for r in newcomers {
            match bounded(T, "a newcomer", r).await.unwrap() {
                Ok(()) => granted += 1,
                Err(e) => assert!(
                    e.contains("ResourceExhausted") && e.contains("--max-waiters-per-lock"),
                    "round {round}: {e}"
                ),
            }
        }
        for w in accepted {
            let r = bounded(T, "an accepted waiter", w).await.unwrap();
            assert!(r.is_ok(), "round {round}: {r:?}");
        }
        let again = bounded(T, "a try-once", fair().try_once().acquire()).await;
        assert!(again.is_ok(), "round {round} ({granted} newcomers granted): {again:?}");
        again.unwrap().release().await.unwrap();
        let queue = || redis.cli(&["LLEN", "redisson_lock_queue:{hotfair}"]).trim().to_owned();
        assert!(
            poll_until(T, || queue() == "0").await,
            "round {round}: queue {}",
            queue()
        );
        gauges_back_to_zero(port, &format!("round {round}")).await;
    }
}

/// A multi-lock one of whose names is held as another kind is refused at once (not
/// left waiting), naming that name, and gives back the names it took; 64 long names of
/// one hash tag (taken in one script) wait for an overlapping multi-lock and get it.
#[tokio::test]
async fn a_multi_lock_over_another_kind_and_one_long_tag() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let reader = client.lock("mk/b").kind(LockKind::Read).acquire().await.unwrap();
    let sem = client
        .lock("mk/s")
        .kind(LockKind::Semaphore)
        .limit(2)
        .acquire()
        .await
        .unwrap();
    for other in ["mk/b", "mk/s"] {
        let o = Open {
            names: vec!["mk/a".into(), other.into(), "mk/z".into()],
            ..open("")
        };
        let status = refused(&server, o).await;
        assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
        let info = status.get_details_error_info().unwrap();
        assert_eq!(
            info.metadata.get("lockName").map(String::as_str),
            Some(other),
            "{status:?}"
        );
        for free in ["mk/a", "mk/z"] {
            let l = client.lock(free).try_once().acquire().await;
            assert!(l.is_ok(), "{free} after a multi-lock over {other}: {l:?}");
            l.unwrap().release().await.unwrap();
        }
    }
    reader.release().await.unwrap();
    sem.release().await.unwrap();
    // One hash tag, 64 names of 1024 bytes.
    let name = |i: usize| format!("{{tag}}{i:04}{}", "n".repeat(1024 - 9));
    let names: Vec<String> = (0..64).map(name).collect();
    assert_eq!(names[0].len(), 1024);
    let multi = |names: Vec<String>, wait: Option<Duration>| Open {
        names,
        wait_timeout: wait.map(pd),
        ..open("")
    };
    let (mut first_all, ev) = first(&server, multi(names.clone(), None)).await;
    assert!(matches!(ev, Ok(Event::Acquired(_))), "{ev:?}");
    let mut overlap: Vec<String> = names[32..].to_vec();
    overlap.push("{tag}other".into());
    let (mut second, ev) = first(&server, multi(overlap, Some(T))).await;
    assert!(matches!(ev, Ok(Event::Queued(_))), "{ev:?}");
    first_all.release().await;
    assert!(matches!(
        first_all.next(T).await.unwrap().and_then(|m| m.event),
        Some(Event::Released(_))
    ));
    match second.next(T).await.unwrap().and_then(|m| m.event) {
        Some(Event::Acquired(a)) => assert_eq!(a.fencing_tokens.len(), 33),
        other => panic!("{other:?}"),
    }
    second.release().await;
    assert!(matches!(
        second.next(T).await.unwrap().and_then(|m| m.event),
        Some(Event::Released(_))
    ));
    no_leftover_keys(&redis, "multi-locks").await;
}

/// `Open` with every field as raw bytes, to send what no generated client would.
#[derive(Clone, PartialEq, prost::Message)]
struct RawOpen {
    #[prost(bytes = "vec", optional, tag = "1")]
    name: Option<Vec<u8>>,
    #[prost(bytes = "vec", optional, tag = "2")]
    kind: Option<Vec<u8>>,
    #[prost(bytes = "vec", optional, tag = "3")]
    wait_timeout: Option<Vec<u8>>,
    #[prost(bytes = "vec", optional, tag = "5")]
    owner: Option<Vec<u8>>,
    #[prost(bytes = "vec", repeated, tag = "8")]
    names: Vec<Vec<u8>>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct RawAcquire {
    #[prost(message, optional, tag = "1")]
    open: Option<RawOpen>,
}

/// A request of the unary calls and Watch: field 1 (`name`, `prefix`) and field 3
/// (`page_token`) as raw bytes.
#[derive(Clone, PartialEq, prost::Message)]
struct RawNamed {
    #[prost(bytes = "vec", optional, tag = "1")]
    first: Option<Vec<u8>>,
    #[prost(bytes = "vec", optional, tag = "3")]
    third: Option<Vec<u8>>,
}

/// Fields that do not decode, in every request: INVALID_ARGUMENT naming the field as
/// the API names it, nothing left in Redis, the server serving.
#[tokio::test]
async fn undecodable_fields_of_every_request_are_named() {
    use latchkey_proto::codec::LeanCodec;
    use latchkey_proto::v1::{AcquireResponse, ForceReleaseResponse, ListResponse, LockState};
    use tonic::codegen::http::uri::PathAndQuery;
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let channel = server.channel().await;
    let mut grpc = tonic::client::Grpc::new(channel);
    let not_utf8 = || Some(vec![b'a', 0xff, 0xfe]);
    let base = || RawOpen {
        name: Some(b"u".to_vec()),
        ..Default::default()
    };
    let cases = [
        (
            RawOpen {
                owner: not_utf8(),
                ..base()
            },
            "open.owner",
        ),
        (
            RawOpen {
                name: None,
                names: vec![b"ok".to_vec(), vec![0xc3]],
                ..Default::default()
            },
            "open.names",
        ),
        (
            RawOpen {
                kind: Some(b"x".to_vec()),
                ..base()
            },
            "open.kind",
        ),
        (
            RawOpen {
                wait_timeout: Some(vec![0x08, 0xff]),
                ..base()
            },
            "open.wait_timeout",
        ),
    ];
    for (raw, field) in cases {
        grpc.ready().await.unwrap();
        let path = PathAndQuery::from_static("/latchkey.v1.LockService/Acquire");
        let codec = LeanCodec::<RawAcquire, AcquireResponse>::default();
        let req = tonic::Request::new(tokio_stream::iter([RawAcquire { open: Some(raw) }]));
        let status = match grpc.streaming(req, path, codec).await {
            Err(status) => status,
            Ok(stream) => bounded(T, "the answer", stream.into_inner().message())
                .await
                .expect_err("refused"),
        };
        assert_field(&status, field);
    }
    let unary = [
        ("/latchkey.v1.LockService/List", not_utf8(), None, "prefix"),
        ("/latchkey.v1.LockService/List", None, not_utf8(), "page_token"),
        ("/latchkey.v1.LockService/Describe", not_utf8(), None, "name"),
        ("/latchkey.v1.LockService/ForceRelease", not_utf8(), None, "name"),
    ];
    for (path, first, third, field) in unary {
        grpc.ready().await.unwrap();
        let req = tonic::Request::new(RawNamed { first, third });
        let path = PathAndQuery::from_static(path);
        let status = match field {
            "prefix" | "page_token" => grpc
                .unary(req, path, LeanCodec::<RawNamed, ListResponse>::default())
                .await
                .map(|_| ())
                .unwrap_err(),
            _ if path.as_str().ends_with("ForceRelease") => grpc
                .unary(req, path, LeanCodec::<RawNamed, ForceReleaseResponse>::default())
                .await
                .map(|_| ())
                .unwrap_err(),
            _ => grpc
                .unary(req, path, LeanCodec::<RawNamed, LockState>::default())
                .await
                .map(|_| ())
                .unwrap_err(),
        };
        assert_field(&status, field);
    }
    grpc.ready().await.unwrap();
    let req = tonic::Request::new(RawNamed {
        first: not_utf8(),
        third: None,
    });
    let path = PathAndQuery::from_static("/latchkey.v1.LockService/Watch");
    let status = match grpc
        .server_streaming(req, path, LeanCodec::<RawNamed, LockState>::default())
        .await
    {
        Err(status) => status,
        Ok(stream) => bounded(T, "the answer", stream.into_inner().message())
            .await
            .expect_err("refused"),
    };
    assert_field(&status, "name");
    no_leftover_keys(&redis, "undecodable").await;
    let lease = server.client().await.lock("u").try_once().acquire().await;
    assert!(lease.is_ok(), "still serving: {lease:?}");
}

/// A waiter bound of 0 serves tries only: every wait is refused naming its flag, a
/// try-once on a free lock is still granted. (A stream bound of 0 is refused at start:
/// `config.rs`.)
#[tokio::test]
async fn bounds_of_zero_refuse_cleanly() {
    let redis = RedisServer::start();
    let server = Latchkey::start_with(&redis.url(), &["--max-waiters-per-lock", "0"]).await;
    let client = server.client().await;
    let held = client.lock("z").acquire().await.unwrap();
    for kind in [LockKind::Mutex, LockKind::Fair] {
        let err = client.lock("z").kind(kind).wait(T).acquire().await.unwrap_err();
        assert!(
            matches!(err.code(), Code::ResourceExhausted | Code::FailedPrecondition),
            "{kind:?}: {err}"
        );
        if err.code() == Code::ResourceExhausted {
            assert_limit(err.status().unwrap(), "--max-waiters-per-lock");
        }
    }
    held.release().await.unwrap();
    client
        .lock("z")
        .try_once()
        .acquire()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    no_leftover_keys(&redis, "waiters 0").await;
}

/// A burst of waiters far beyond `--max-waiters-per-lock` at once, on a mutex, a fair
/// lock and a semaphore: at most the bound wait, the rest are refused naming the flag,
/// every accepted one is granted in turn (none stranded by a refused one), and every
/// gauge comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_beyond_the_waiter_bound_strands_nobody() {
    let redis = RedisServer::start();
    let args = ["--redis-url", &redis.url(), "--max-waiters-per-lock", "4"].map(str::to_owned);
    let server = LatchkeyProcess::spawn(&args);
    let port = server.metrics_port().unwrap();
    let client = server.serving_client().await;
    for kind in [LockKind::Mutex, LockKind::Fair, LockKind::Semaphore] {
        let name = format!("burst/{kind:?}");
        let lock = || {
            let l = client.lock(name.clone()).kind(kind);
            if kind == LockKind::Semaphore {
                l.limit(1)
            } else {
                l
            }
        };
        for round in 0..3 {
            let held = lock().acquire().await.unwrap();
            let burst: Vec<_> = (0..40)
                .map(|_| {
                    let l = lock().wait(T);
                    tokio::spawn(async move {
                        match l.acquire().await {
                            Ok(lease) => {
                                tokio::time::sleep(Duration::from_millis(5)).await;
                                lease.release().await.map(|_| true).map_err(|e| e.to_string())
                            }
                            Err(e) if e.code() == Code::ResourceExhausted => {
                                assert!(e.to_string().contains("--max-waiters-per-lock"), "{e}");
                                Ok(false)
                            }
                            Err(e) => Err(e.to_string()),
                        }
                    })
                })
                .collect();
            // Give the burst time to arrive, then let the line move.
            let queued = poll_until(T, || gauges(port)[2] >= 4.0).await;
            assert!(queued, "{kind:?} round {round}: {:?}", gauges(port));
            tokio::time::sleep(Duration::from_millis(200)).await;
            held.release().await.unwrap();
            let mut granted = 0;
            for b in burst {
                match bounded(T, "a burst stream", b).await.unwrap() {
                    Ok(true) => granted += 1,
                    Ok(false) => {}
                    Err(e) => panic!("{kind:?} round {round}: {e}"),
                }
            }
            assert!(granted >= 4, "{kind:?} round {round}: {granted} granted");
            let again = lock().try_once().acquire().await;
            assert!(again.is_ok(), "{kind:?} round {round}: {again:?}");
            again.unwrap().release().await.unwrap();
            gauges_back_to_zero(port, &format!("{kind:?} round {round}")).await;
        }
    }
    no_leftover_keys(&redis, "bursts").await;
}
