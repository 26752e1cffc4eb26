//! An `Acquire` call at its edges: its gRPC deadline (`grpc-timeout`) bounds the wait,
//! a half-close after the grant releases, a second `open` is refused, a burst of
//! cancelled calls leaves the connection and its other leases alone, a black-holed
//! client gives every gauge back, and a shutdown does not wait on a connection with no
//! send window left.

use latchkey_proto::v1::acquire_request::Action;
use latchkey_proto::v1::acquire_response::Event;
use latchkey_proto::v1::lock_service_client::LockServiceClient;
use latchkey_proto::v1::{AcquireRequest, AcquireResponse};
use latchkey_tests::server::{fill_window, open, pd, small_window_client, Latchkey, RawStream};
use latchkey_tests::{poll_until, RedisServer};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::{Code, Streaming};

const T: Duration = Duration::from_secs(10);

fn exists(redis: &RedisServer, key: &str) -> bool {
    redis.cli(&["EXISTS", key]).trim() == "1"
}

/// An `Acquire` call whose request carries a `grpc-timeout` of `deadline` (set with
/// `tonic::Request::set_timeout`, as any gRPC client sets a deadline), `open` sent
/// first. Returns the request sender and the call.
#[allow(clippy::type_complexity)]
fn call_with_deadline(
    client: &LockServiceClient<Channel>,
    first: Option<latchkey_proto::v1::Open>,
    deadline: Duration,
) -> (
    mpsc::Sender<AcquireRequest>,
    tokio::task::JoinHandle<Result<tonic::Response<Streaming<AcquireResponse>>, tonic::Status>>,
) {
    let (tx, rx) = mpsc::channel(8);
    if let Some(o) = first {
        tx.try_send(AcquireRequest {
            action: Some(Action::Open(o)),
        })
        .unwrap();
    }
    let mut client = client.clone();
    let call = tokio::spawn(async move {
        let mut req = tonic::Request::new(ReceiverStream::new(rx));
        req.set_timeout(deadline);
        client.acquire(req).await
    });
    (tx, call)
}

/// Reads events until the stream ends or `limit` passes: the events and how it ended
/// (`None`: still open at `limit`).
async fn read_until(
    events: &mut Streaming<AcquireResponse>,
    limit: Duration,
) -> (Vec<Event>, Option<Result<(), tonic::Status>>) {
    let until = tokio::time::Instant::now() + limit;
    let mut seen = Vec::new();
    loop {
        match tokio::time::timeout_at(until, events.message()).await {
            Err(_) => return (seen, None),
            Ok(Ok(Some(r))) => seen.push(r.event.expect("an event")),
            Ok(Ok(None)) => return (seen, Some(Ok(()))),
            Ok(Err(s)) => return (seen, Some(Err(s))),
        }
    }
}

/// A waiter whose call carries a gRPC deadline (`grpc-timeout: 1s`, no `wait_timeout`)
/// is told `queued`, and its call ends DEADLINE_EXCEEDED at the deadline. (tonic
/// applies `grpc-timeout` only until the response headers, which leave with `queued`:
/// the wait ran on past the deadline for as long as the holder held, and a client
/// that does not enforce the deadline itself, as tonic's does not once the headers
/// came, waited that long.)
#[tokio::test]
async fn a_grpc_deadline_ends_a_wait_with_deadline_exceeded() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let holder = client.lock("edge/deadline").acquire().await.unwrap();
    let raw = server.raw().await;
    let asked = Instant::now();
    let (_tx, call) = call_with_deadline(&raw, Some(open("edge/deadline")), Duration::from_secs(1));
    let mut events = tokio::time::timeout(T, call)
        .await
        .expect("answered")
        .unwrap()
        .expect("a response")
        .into_inner();
    // Well past the 1 s deadline.
    let (seen, end) = read_until(&mut events, Duration::from_secs(4)).await;
    assert!(matches!(seen.first(), Some(Event::Queued(_))), "{seen:?}");
    let waited = asked.elapsed();
    holder.release().await.unwrap();
    let (late, _) = read_until(&mut events, Duration::from_secs(2)).await;
    assert!(
        matches!(&end, Some(Err(s)) if s.code() == Code::DeadlineExceeded),
        "a call with a 1 s deadline was still open after {waited:?} (ended: {end:?}); \
         after the holder released it was told {late:?}"
    );
}

/// Half-closing the request side after the grant releases the lock, answers
/// `released` and ends OK (README: "Client half-close also releases").
#[tokio::test]
async fn a_half_close_after_the_grant_releases() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let mut raw = server.raw().await;
    let mut s = RawStream::open(&mut raw, Some(open("edge/hc"))).await;
    let first = s.next(T).await.unwrap().unwrap().event.unwrap();
    assert!(matches!(first, Event::Acquired(_)), "{first:?}");
    assert!(exists(&redis, "edge/hc"));
    s.half_close();
    let next = s.next(T).await.unwrap().map(|r| r.event.unwrap());
    assert!(matches!(next, Some(Event::Released(_))), "{next:?}");
    assert!(s.next(T).await.unwrap().is_none(), "ends OK");
    assert!(!exists(&redis, "edge/hc"));
}

/// A second `open` naming another lock while holding is refused (`INVALID_ARGUMENT`
/// naming `open`), the first lock is released and the second never taken.
#[tokio::test]
async fn a_second_open_with_another_name_while_holding_is_refused() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let mut raw = server.raw().await;
    let mut s = RawStream::open(&mut raw, Some(open("edge/one"))).await;
    assert!(matches!(
        s.next(T).await.unwrap().unwrap().event.unwrap(),
        Event::Acquired(_)
    ));
    s.send(Action::Open(open("edge/two"))).await;
    let end = match s.next(T).await {
        Ok(Some(r)) => panic!("unexpected event {r:?}"),
        other => other,
    };
    let status = end.expect_err("refused");
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(status.message().starts_with("open"), "{status:?}");
    assert!(
        poll_until(Duration::from_secs(3), || !exists(&redis, "edge/one")).await,
        "the first lock released"
    );
    assert!(!exists(&redis, "edge/two"), "the second never taken");
}

/// A `wait_timeout` shorter than the gRPC deadline ends the wait: DEADLINE_EXCEEDED
/// naming the lock.
#[tokio::test]
async fn a_wait_timeout_under_a_longer_grpc_deadline_ends_deadline_exceeded() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let _holder = client.lock("edge/wt").acquire().await.unwrap();
    let raw = server.raw().await;
    let o = latchkey_proto::v1::Open {
        wait_timeout: Some(pd(Duration::from_millis(500))),
        ..open("edge/wt")
    };
    let (_tx, call) = call_with_deadline(&raw, Some(o), Duration::from_secs(30));
    let mut events = tokio::time::timeout(T, call)
        .await
        .unwrap()
        .unwrap()
        .unwrap()
        .into_inner();
    let (_, end) = read_until(&mut events, Duration::from_secs(5)).await;
    let status = end.expect("ended").expect_err("timed out");
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    assert!(status.message().contains("edge/wt"), "{status:?}");
}

/// Many `Acquire` calls on one shared connection that the application gives up at
/// once (a batch of tasks cancelled, a `select!` whose other branch won, a timeout
/// that fires for all of them): their HEADERS and RST_STREAMs reach the server in one
/// burst, before it accepted the streams. h2 counts each as a "pending-accept reset"
/// and, past its default of 20, closed the whole connection (GOAWAY
/// ENHANCE_YOUR_CALM, "too_many_resets"): every other lease on it, here a lock held the
/// whole time by another task of the same client, was released and lost. The bound is
/// now the connection's stream bound.
#[tokio::test]
async fn a_burst_of_cancelled_acquires_does_not_kill_other_leases_on_the_connection() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let other = server.client().await;
    let _busy = other.lock("edge/busy").acquire().await.unwrap();
    let client = server.client().await;
    let kept = client.lock("edge/kept").acquire().await.unwrap();
    for round in 0..5u64 {
        let tasks: Vec<_> = (0..200)
            .map(|_| {
                let client = client.clone();
                tokio::spawn(async move { client.lock("edge/busy").acquire().await })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(round)).await;
        for t in &tasks {
            t.abort();
        }
        for t in tasks {
            let _ = t.await;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(
            !kept.is_lost() && exists(&redis, "edge/kept"),
            "round {round}: the lease held on the same connection was lost (lost: {}, in Redis: {})",
            kept.is_lost(),
            exists(&redis, "edge/kept")
        );
    }
    kept.release().await.expect("still held, released");
}

/// (streams, leases, waiters, subscriptions) in one scrape.
fn gauges(port: u16) -> [f64; 4] {
    let scrape = latchkey_tests::scrape_metrics(port);
    let value = |name: &str| latchkey_tests::metric(&scrape, name).unwrap_or(-1.0);
    [
        value("latchkey_streams_open"),
        value("latchkey_leases_held"),
        value("latchkey_waiters"),
        value("latchkey_pubsub_subscriptions"),
    ]
}

/// A client black-holed (sockets open, no bytes) with every kind of stream on its one
/// connection: holders of each kind, waiters of each kind (one half-closed), a stream
/// that never sent `open`, a watch. Keepalive (1 s + 1 s) ends the connection and every
/// gauge goes back to zero, every lock is free again.
#[tokio::test]
async fn a_black_holed_client_gives_every_gauge_back_by_keepalive() {
    use latchkey_proto::v1::{LockKind, Open, WatchRequest};
    let redis = RedisServer::start();
    let server = latchkey_tests::LatchkeyProcess::spawn(&[
        "--redis-url".to_owned(),
        redis.url(),
        "--keepalive-interval".to_owned(),
        "1s".to_owned(),
        "--keepalive-timeout".to_owned(),
        "1s".to_owned(),
    ]);
    let port = server.metrics_port().unwrap();
    let near = server.serving_client().await;
    let kinds = [
        LockKind::Mutex,
        LockKind::Fair,
        LockKind::Read,
        LockKind::Write,
        LockKind::Semaphore,
    ];
    let of = |name: String, kind: LockKind| Open {
        kind: kind as i32,
        limit: if kind == LockKind::Semaphore { 1 } else { 0 },
        ..open(&name)
    };
    // Near holders that the far waiters wait for.
    let mut near_held = Vec::new();
    for kind in kinds {
        let ck = match kind {
            LockKind::Mutex => latchkey_client::LockKind::Mutex,
            LockKind::Fair => latchkey_client::LockKind::Fair,
            LockKind::Read => latchkey_client::LockKind::Write,
            LockKind::Write => latchkey_client::LockKind::Read,
            _ => latchkey_client::LockKind::Semaphore,
        };
        let mut l = near.lock(format!("bh/wait/{kind:?}")).kind(ck);
        if kind == LockKind::Semaphore {
            l = l.limit(1);
        }
        near_held.push(l.acquire().await.unwrap());
    }
    let proxy = latchkey_tests::proxy::Proxy::start(&format!("127.0.0.1:{}", server.port())).await;
    let mut far = LockServiceClient::connect(proxy.endpoint()).await.unwrap();
    let mut streams = Vec::new();
    for (i, kind) in kinds.into_iter().enumerate() {
        let mut h = RawStream::open(&mut far, Some(of(format!("bh/held/{kind:?}"), kind))).await;
        let e = h.next(T).await.unwrap().unwrap().event.unwrap();
        assert!(matches!(e, Event::Acquired(_)), "{kind:?}: {e:?}");
        streams.push(h);
        let mut w = RawStream::open(&mut far, Some(of(format!("bh/wait/{kind:?}"), kind))).await;
        if i == 1 {
            w.half_close();
        }
        let e = w.next(T).await.unwrap().unwrap().event.unwrap();
        assert!(matches!(e, Event::Queued(_)), "{kind:?}: {e:?}");
        streams.push(w);
    }
    let multi = Open {
        names: vec!["bh/multi/a".into(), "bh/multi/b".into()],
        ..Default::default()
    };
    let mut m = RawStream::open(&mut far, Some(multi)).await;
    assert!(matches!(
        m.next(T).await.unwrap().unwrap().event.unwrap(),
        Event::Acquired(_)
    ));
    streams.push(m);
    let silent = RawStream::open(&mut far, None).await;
    let mut watch = far
        .watch(WatchRequest {
            name: "bh/wait/Mutex".into(),
        })
        .await
        .unwrap()
        .into_inner();
    let _ = tokio::time::timeout(T, watch.message()).await;
    let ok = poll_until(T, || {
        let g = gauges(port);
        g[0] >= 12.0 && g[1] >= 11.0 && g[2] >= 5.0
    })
    .await;
    assert!(ok, "all streams counted: {:?}", gauges(port));
    proxy.freeze();
    drop(near_held);
    let idle = poll_until(Duration::from_secs(15), || gauges(port) == [0.0; 4]).await;
    assert!(
        idle,
        "(streams, leases, waiters, subscriptions) = {:?}\n{}",
        gauges(port),
        server.log_tail()
    );
    let left = || -> Vec<String> {
        redis
            .cli(&["KEYS", "*bh/*"])
            .lines()
            .map(str::to_owned)
            .filter(|l| !l.is_empty() && !l.starts_with("latchkey_"))
            .collect()
    };
    let clean = poll_until(Duration::from_secs(5), || left().is_empty()).await;
    let ttls: Vec<(String, String)> = left()
        .into_iter()
        .map(|k| {
            let ttl = redis.cli(&["PTTL", &k]);
            (k, ttl.trim().to_owned())
        })
        .collect();
    assert!(clean, "left in Redis (key, pttl): {ttls:?}");
    drop((streams, silent, watch));
}

/// Holders of every kind whose connection has no HTTP/2 send window left: their
/// client stopped reading a Watch on the same connection, whose states filled the
/// connection window (the client uses the protocol's default windows of 64 KiB). The
/// connection is alive: pings are answered. At graceful shutdown each session pushes
/// `lost{SHUTDOWN}`; hyper takes it, holds it for send capacity and polls the stream
/// no further. Each lock is freed at once and the shutdown is prompt: a lost lease's
/// release runs in the background, which the drain waits for. (It was awaited in the
/// session, which never got past its first poll: the drain waited its whole 10 s.)
#[tokio::test]
async fn shutdown_with_holders_whose_connection_has_no_send_window_is_prompt() {
    use latchkey_proto::v1::{LockKind, Open};
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let mut far = small_window_client(server.endpoint()).await;
    let of = |name: &str, kind: LockKind| Open {
        kind: kind as i32,
        limit: if kind == LockKind::Semaphore { 2 } else { 0 },
        ..open(name)
    };
    let holds = [
        of("edge/shut/mutex", LockKind::Mutex),
        of("edge/shut/fair", LockKind::Fair),
        of("edge/shut/read", LockKind::Read),
        of("edge/shut/write", LockKind::Write),
        of("edge/shut/sem", LockKind::Semaphore),
        Open {
            names: vec!["edge/shut/m1".into(), "edge/shut/m2".into()],
            ..Default::default()
        },
    ];
    let mut streams = Vec::new();
    for o in holds {
        let mut h = RawStream::open(&mut far, Some(o.clone())).await;
        let e = h.next(T).await.unwrap().unwrap().event.unwrap();
        assert!(matches!(e, Event::Acquired(_)), "{o:?}: {e:?}");
        streams.push(h);
    }
    let held = || -> Vec<String> {
        redis
            .cli(&["KEYS", "edge/shut/*"])
            .lines()
            .filter(|l| !l.is_empty() && !l.contains("/w"))
            .map(str::to_owned)
            .collect()
    };
    assert!(held().len() >= 5, "{:?}", held());
    let long = format!("edge/shut/{}", "w".repeat(1000));
    // Another client changes a watched lock until its states fill the window.
    let watch = fill_window(&mut far, &server.client().await, &long).await;
    let stopping = Instant::now();
    let stop = tokio::spawn(server.stop());
    let freed = poll_until(Duration::from_secs(2), || held().is_empty()).await;
    assert!(freed, "holds left in Redis 2 s into the shutdown: {:?}", held());
    tokio::time::timeout(Duration::from_secs(30), stop)
        .await
        .unwrap()
        .unwrap();
    let took = stopping.elapsed();
    assert!(
        took < Duration::from_secs(5),
        "every lock was released within 2 s, yet the shutdown took {took:?}"
    );
    drop((streams, watch));
}

/// A client that gives up a burst of its own calls (waits on a busy lock dropped on a
/// timeout, watches of a page of names closed together: 300 at once, three times) keeps
/// its other leases. Every call of a `Client` shares one HTTP/2 connection, and the
/// server keeps that connection open through the cancels: h2's guard against "rapid
/// reset" (CVE-2023-44487), whose default closes a connection with GOAWAY
/// `ENHANCE_YOUR_CALM` once more than 20 streams were reset before the server accepted
/// them, is bounded by the connection's stream bound, so the held lease stays held and
/// the connection still serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_cancelled_calls_keeps_the_clients_other_leases() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let keep = client.lock("keep").acquire().await.unwrap();
    let busy = client.lock("busy").acquire().await.unwrap();
    for round in 0..3u32 {
        let mut tasks = Vec::new();
        for i in 0..300u32 {
            let client = client.clone();
            tasks.push(tokio::spawn(async move {
                let delay = Duration::from_millis(u64::from((i * 7 + round) % 23));
                if i % 2 == 0 {
                    // A waiter on a busy lock, given up on.
                    let _ = tokio::time::timeout(delay, client.lock("busy").acquire()).await;
                } else {
                    // A watch of a page of names, closed.
                    let _ = tokio::time::timeout(delay, async {
                        let mut w = client.watch(format!("page/{i}")).await?;
                        w.next().await
                    })
                    .await;
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        assert!(
            !keep.is_lost(),
            "round {round}: the held lease was lost: {:?}",
            keep.lost_reason()
        );
    }
    // Still held, and the connection still serves.
    let held = tokio::time::timeout(Duration::from_millis(1500), keep.lost()).await;
    assert!(held.is_err(), "the held lease was lost: {held:?}");
    let state = client.describe("keep").await.expect("the client's connection serves");
    assert!(state.locked, "{state:?}");
    keep.release().await.expect("released, not lost");
    busy.release().await.unwrap();
}

/// One client connection over a long life: 1100 rounds of a refused try-once, a refused
/// semaphore try and a lease taken and released (3300 streams, over 1024 of each kind),
/// while another lease of the client is held. The held lease outlives them all: the
/// connection stays open past h2's bound of 1024 on the streams it resets on its own
/// over a connection's life (GOAWAY "too_many_internal_resets").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_lived_client_connection_survives_thousands_of_calls() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let other = server.client().await;
    let full = |c: &latchkey_client::Client| {
        c.lock("full")
            .kind(latchkey_client::LockKind::Semaphore)
            .limit(1)
            .permits(1)
    };
    let keep = client.lock("keep").acquire().await.unwrap();
    let busy = other.lock("busy").acquire().await.unwrap();
    let all = full(&other).acquire().await.unwrap();
    for i in 0..1100u32 {
        let err = client.lock("busy").try_once().acquire().await.unwrap_err();
        assert_eq!(err.code(), Code::DeadlineExceeded, "{i}: {err}");
        let err = full(&client).try_once().acquire().await.unwrap_err();
        assert_eq!(err.code(), Code::DeadlineExceeded, "{i}: {err}");
        let lease = client.lock(format!("cycle/{}", i % 7)).acquire().await.unwrap();
        lease.release().await.unwrap();
        assert!(!keep.is_lost(), "after {i} rounds: {:?}", keep.lost_reason());
    }
    keep.release().await.expect("released, not lost");
    busy.release().await.unwrap();
    all.release().await.unwrap();
}
