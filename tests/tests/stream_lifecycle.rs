//! An Acquire stream's life at its edges, spoken in raw gRPC: messages out of order
//! (a second `open`, an empty one, a `release` first or before the first try answered,
//! messages after `release`), a connection that dies or freezes with many streams on
//! it, a shutdown with every kind of stream open. Each leaves no hold and no place in Redis.

use latchkey_proto::v1::acquire_request::Action;
use latchkey_proto::v1::acquire_response::Event;
use latchkey_proto::v1::lock_service_client::LockServiceClient;
use latchkey_proto::v1::{AcquireRequest, LockKind, Open, WatchRequest};
use latchkey_tests::proxy::Proxy;
use latchkey_tests::server::{open, pd, Latchkey, RawStream};
use latchkey_tests::{bounded, poll_until, LatchkeyProcess, RedisServer};
use std::time::{Duration, Instant};
use tonic::Code;

const T: Duration = Duration::from_secs(10);

fn kind(name: &str, kind: LockKind) -> Open {
    Open {
        kind: kind as i32,
        ..open(name)
    }
}

fn waiting(o: Open) -> Open {
    Open {
        wait_timeout: Some(pd(Duration::from_secs(60))),
        ..o
    }
}

/// Reads events until the stream ends; the events and how it ended.
async fn drain(s: &mut RawStream, limit: Duration) -> (Vec<Event>, Result<(), tonic::Status>) {
    let deadline = Instant::now() + limit;
    let mut events = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(
            !left.is_zero(),
            "stream did not end within {limit:?}; events so far {events:?}"
        );
        match s.next(left).await {
            Ok(Some(r)) => events.push(r.event.expect("an event")),
            Ok(None) => return (events, Ok(())),
            Err(status) => return (events, Err(status)),
        }
    }
}

/// Asserts that a stream ended `INVALID_ARGUMENT` naming `field`, after `events`.
fn assert_refused(events: &[Event], end: Result<(), tonic::Status>, field: &str) {
    let status = end.expect_err("refused");
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?} after {events:?}");
    assert!(status.message().starts_with(field), "{status:?}");
}

async fn first_event(s: &mut RawStream) -> Event {
    s.next(T)
        .await
        .expect("an event")
        .expect("not ended")
        .event
        .expect("event")
}

/// Waits until `check` holds, for at most `limit`.
async fn eventually(limit: Duration, what: &str, check: impl FnMut() -> bool) {
    assert!(poll_until(limit, check).await, "{what}: not within {limit:?}");
}

fn queue_len(redis: &RedisServer, lock: &str) -> (i64, i64) {
    let q = redis.cli(&["LLEN", &format!("redisson_lock_queue:{{{lock}}}")]);
    let t = redis.cli(&["ZCARD", &format!("redisson_lock_timeout:{{{lock}}}")]);
    (q.trim().parse().unwrap_or(-1), t.trim().parse().unwrap_or(-1))
}

/// Waits until `lock`'s fair queue holds no place, for at most `limit`.
async fn queue_left(redis: &RedisServer, lock: &str, limit: Duration) {
    let what = format!("{lock}'s queue places left");
    eventually(limit, &what, || queue_len(redis, lock) == (0, 0)).await;
}

fn exists(redis: &RedisServer, key: &str) -> bool {
    redis.cli(&["EXISTS", key]).trim() == "1"
}

/// A second `open` while queued on a fair lock names `open`, and the stream's place in
/// Redisson's queue goes with it.
#[tokio::test]
async fn a_second_open_while_queued_names_open_and_leaves_the_queue() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let lease = client
        .lock("rs/fair2")
        .kind(latchkey_client::LockKind::Fair)
        .acquire()
        .await
        .unwrap();
    let mut raw = server.raw().await;
    let mut s = RawStream::open(&mut raw, Some(waiting(kind("rs/fair2", LockKind::Fair)))).await;
    assert!(matches!(first_event(&mut s).await, Event::Queued(_)));
    assert_eq!(queue_len(&redis, "rs/fair2").0, 1);
    s.send(Action::Open(kind("rs/fair2", LockKind::Fair))).await;
    let (events, end) = drain(&mut s, T).await;
    assert_refused(&events, end, "open");
    queue_left(&redis, "rs/fair2", Duration::from_secs(3)).await;
    lease.release().await.unwrap();
}

/// An empty message (no action) names `action`, while waiting and while holding; the
/// hold is released.
#[tokio::test]
async fn an_empty_message_names_action_while_waiting_and_holding() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let lease = client.lock("rs/empty").acquire().await.unwrap();
    let mut raw = server.raw().await;
    // Waiting.
    let mut s = RawStream::open(&mut raw, Some(waiting(open("rs/empty")))).await;
    assert!(matches!(first_event(&mut s).await, Event::Queued(_)));
    s.tx.as_ref()
        .unwrap()
        .send(AcquireRequest { action: None })
        .await
        .unwrap();
    let (events, end) = drain(&mut s, T).await;
    assert_refused(&events, end, "action");
    lease.release().await.unwrap();
    // Holding.
    let mut s = RawStream::open(&mut raw, Some(open("rs/empty"))).await;
    assert!(matches!(first_event(&mut s).await, Event::Acquired(_)));
    s.tx.as_ref()
        .unwrap()
        .send(AcquireRequest { action: None })
        .await
        .unwrap();
    let (events, end) = drain(&mut s, T).await;
    assert_refused(&events, end, "action");
    eventually(Duration::from_secs(3), "released", || !exists(&redis, "rs/empty")).await;
}

/// Messages after `release` are not read: the stream answers `released` and ends OK.
/// A `release` before `open` names `open`.
#[tokio::test]
async fn messages_after_release_are_ignored_and_release_first_names_open() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let mut raw = server.raw().await;
    let mut s = RawStream::open(&mut raw, Some(open("rs/after"))).await;
    assert!(matches!(first_event(&mut s).await, Event::Acquired(_)));
    s.release().await;
    s.send(Action::Open(open("rs/after"))).await;
    s.release().await;
    let (events, end) = drain(&mut s, T).await;
    assert!(matches!(events.as_slice(), [Event::Released(_)]), "{events:?}");
    end.expect("ends OK");
    assert!(!exists(&redis, "rs/after"));
    let mut s = RawStream::open(&mut raw, None).await;
    s.release().await;
    let (events, end) = drain(&mut s, T).await;
    assert_refused(&events, end, "open");
}

/// `release` sent right behind `open` while the first try is on its way to a slow
/// Redis: a free lock is answered `acquired` then `released`; a busy one `queued` then
/// `released`; nothing is left in Redis either way.
#[tokio::test]
async fn a_release_sent_during_a_slow_first_try_is_answered_and_leaves_nothing() {
    let redis = RedisServer::start();
    let proxy = Proxy::to_redis(&redis).await;
    let server = Latchkey::start_with(&proxy.redis_url(), &["--redis-timeout", "3s"]).await;
    let client = server.client().await;
    let held = client
        .lock("rs/slow-busy")
        .kind(latchkey_client::LockKind::Fair)
        .acquire()
        .await
        .unwrap();
    proxy.set_delay(Duration::from_millis(150));
    let mut raw = server.raw().await;
    let mut s = RawStream::open(&mut raw, Some(open("rs/slow-free"))).await;
    s.release().await;
    let (events, end) = drain(&mut s, T).await;
    end.expect("ends OK");
    assert!(
        matches!(events.as_slice(), [Event::Acquired(_), Event::Released(_)]),
        "{events:?}"
    );
    let mut s = RawStream::open(&mut raw, Some(waiting(kind("rs/slow-busy", LockKind::Fair)))).await;
    s.release().await;
    let (events, end) = drain(&mut s, T).await;
    end.expect("ends OK");
    assert!(
        matches!(events.as_slice(), [Event::Queued(_), Event::Released(_)]),
        "{events:?}"
    );
    proxy.set_delay(Duration::ZERO);
    eventually(Duration::from_secs(5), "the slow-free lock released", || {
        !exists(&redis, "rs/slow-free")
    })
    .await;
    queue_left(&redis, "rs/slow-busy", Duration::from_secs(5)).await;
    held.release().await.unwrap();
}

/// One HTTP/2 connection carrying many holders and waiters (some half-closed) is cut:
/// every hold is released and every fair queue place is left, promptly.
#[tokio::test]
async fn a_cut_connection_with_many_streams_releases_every_hold_and_place() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let near = server.client().await;
    let fair = near
        .lock("rs/cut/fair")
        .kind(latchkey_client::LockKind::Fair)
        .acquire()
        .await
        .unwrap();
    let mutex = near.lock("rs/cut/mutex").acquire().await.unwrap();
    let proxy = Proxy::start(server.endpoint().trim_start_matches("http://")).await;
    let mut far = LockServiceClient::connect(proxy.endpoint()).await.unwrap();
    let mut streams = Vec::new();
    for i in 0..40 {
        let mut s = RawStream::open(&mut far, Some(open(&format!("rs/cut/h{i}")))).await;
        assert!(matches!(first_event(&mut s).await, Event::Acquired(_)));
        streams.push(s);
    }
    for i in 0..15 {
        let mut s = RawStream::open(&mut far, Some(waiting(kind("rs/cut/fair", LockKind::Fair)))).await;
        if i % 3 == 0 {
            s.half_close();
        }
        assert!(matches!(first_event(&mut s).await, Event::Queued(_)));
        streams.push(s);
    }
    for _ in 0..10 {
        let mut s = RawStream::open(&mut far, Some(waiting(open("rs/cut/mutex")))).await;
        assert!(matches!(first_event(&mut s).await, Event::Queued(_)));
        streams.push(s);
    }
    assert_eq!(queue_len(&redis, "rs/cut/fair").0, 15);
    let cut = Instant::now();
    proxy.cut();
    // Well within the 30 s a lock would stay held if its stream were forgotten: the
    // test's thread also serves the server, and each look at Redis blocks it a moment.
    let holds: Vec<String> = (0..40).map(|i| format!("rs/cut/h{i}")).collect();
    let mut exists_holds = vec!["EXISTS"];
    exists_holds.extend(holds.iter().map(String::as_str));
    eventually(Duration::from_secs(10), "every hold released", || {
        redis.cli(&exists_holds).trim() == "0"
    })
    .await;
    queue_left(&redis, "rs/cut/fair", Duration::from_secs(10)).await;
    eprintln!("cleaned up {:?} after the cut", cut.elapsed());
    drop(streams);
    fair.release().await.unwrap();
    mutex.release().await.unwrap();
    // The next acquire of each is at once: no dead waiter stands in front.
    for name in ["rs/cut/fair", "rs/cut/mutex"] {
        let k = if name.ends_with("fair") {
            latchkey_client::LockKind::Fair
        } else {
            latchkey_client::LockKind::Mutex
        };
        let lease = near
            .lock(name)
            .kind(k)
            .wait(Duration::from_secs(1))
            .acquire()
            .await
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        lease.release().await.unwrap();
    }
    let claims = redis.cli(&["KEYS", "latchkey_claims*"]);
    assert!(claims.trim().is_empty(), "claims left: {claims}");
}

/// SIGTERM with every kind of stream open on the stopping server: waiters of each kind
/// (one half-closed), a stream that never sent `open`, a holder and a Watch. Each ends
/// (UNAVAILABLE; the holder after `lost`), the process exits within its bound, and
/// Redis keeps no place or hold of it.
#[tokio::test]
async fn sigterm_ends_every_kind_of_stream_and_leaves_no_place() {
    let redis = RedisServer::start();
    let other = Latchkey::start(&redis.url()).await;
    let oc = other.client().await;
    use latchkey_client::LockKind as K;
    let h_fair = oc.lock("rs/term/fair").kind(K::Fair).acquire().await.unwrap();
    let h_mutex = oc.lock("rs/term/mutex").acquire().await.unwrap();
    let h_write = oc.lock("rs/term/rw").kind(K::Write).acquire().await.unwrap();
    let h_sem = oc
        .lock("rs/term/sem")
        .kind(K::Semaphore)
        .limit(1)
        .acquire()
        .await
        .unwrap();
    let mut stopping = LatchkeyProcess::spawn(&["--redis-url".to_owned(), redis.url(), "--no-metrics".to_owned()]);
    let _ = stopping.serving_client().await;
    let mut raw = LockServiceClient::connect(stopping.endpoint()).await.unwrap();
    let mut waiters = Vec::new();
    for (i, o) in [
        kind("rs/term/fair", LockKind::Fair),
        kind("rs/term/fair", LockKind::Fair),
        open("rs/term/mutex"),
        kind("rs/term/rw", LockKind::Read),
        Open {
            limit: 1,
            ..kind("rs/term/sem", LockKind::Semaphore)
        },
    ]
    .into_iter()
    .enumerate()
    {
        let mut s = RawStream::open(&mut raw, Some(waiting(o))).await;
        if i == 1 {
            s.half_close();
        }
        assert!(matches!(first_event(&mut s).await, Event::Queued(_)), "waiter {i}");
        waiters.push(s);
    }
    assert_eq!(queue_len(&redis, "rs/term/fair").0, 2);
    let mut holder = RawStream::open(&mut raw, Some(open("rs/term/held"))).await;
    assert!(matches!(first_event(&mut holder).await, Event::Acquired(_)));
    let mut silent = RawStream::open(&mut raw, None).await;
    let mut watch = raw
        .watch(WatchRequest {
            name: "rs/term/mutex".into(),
        })
        .await
        .unwrap()
        .into_inner();
    let _first = tokio::time::timeout(T, watch.message()).await.unwrap().unwrap();
    let signalled = Instant::now();
    stopping.terminate();
    for (i, s) in waiters.iter_mut().enumerate() {
        let (events, end) = drain(s, Duration::from_secs(12)).await;
        let status = end.expect_err("ends with a status");
        assert_eq!(
            status.code(),
            Code::Unavailable,
            "waiter {i}: {status:?} after {events:?}"
        );
    }
    let (events, end) = drain(&mut holder, Duration::from_secs(12)).await;
    assert!(matches!(events.as_slice(), [Event::Lost(_)]), "{events:?}");
    assert_eq!(end.expect_err("status").code(), Code::Unavailable);
    let (_, end) = drain(&mut silent, Duration::from_secs(12)).await;
    assert_eq!(end.expect_err("status").code(), Code::Unavailable);
    let end = tokio::time::timeout(Duration::from_secs(12), async {
        loop {
            match watch.message().await {
                Ok(Some(_)) => continue,
                other => return other,
            }
        }
    })
    .await
    .expect("the watch ends");
    assert_eq!(end.expect_err("status").code(), Code::Unavailable);
    let status = stopping.wait_exit(Duration::from_secs(16)).expect("exits");
    assert!(status.success(), "{status}\n{}", stopping.log_tail());
    eprintln!("exited {:?} after SIGTERM", signalled.elapsed());
    assert!(signalled.elapsed() < Duration::from_secs(15));
    assert_eq!(queue_len(&redis, "rs/term/fair"), (0, 0), "fair places left");
    assert!(!exists(&redis, "rs/term/held"));
    for lease in [h_fair, h_mutex, h_write, h_sem] {
        lease.release().await.unwrap();
    }
    for (name, k) in [
        ("rs/term/fair", K::Fair),
        ("rs/term/mutex", K::Mutex),
        ("rs/term/rw", K::Write),
    ] {
        let lease = oc
            .lock(name)
            .kind(k)
            .wait(Duration::from_secs(1))
            .acquire()
            .await
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        lease.release().await.unwrap();
    }
}

/// A frozen client (sockets open, no bytes) with fair waiters, one half-closed, and a
/// holder: keepalive (1 s + 1 s) ends the connection, the hold is released and the
/// queue places are left within a few seconds.
#[tokio::test]
async fn a_frozen_clients_waiters_leave_the_queue_by_keepalive() {
    let redis = RedisServer::start();
    let server = Latchkey::start_with(
        &redis.url(),
        &["--keepalive-interval", "1s", "--keepalive-timeout", "1s"],
    )
    .await;
    let near = server.client().await;
    let fair = near
        .lock("rs/ka/fair")
        .kind(latchkey_client::LockKind::Fair)
        .acquire()
        .await
        .unwrap();
    let proxy = Proxy::start(server.endpoint().trim_start_matches("http://")).await;
    let mut far = LockServiceClient::connect(proxy.endpoint()).await.unwrap();
    let mut streams = Vec::new();
    for i in 0..3 {
        let mut s = RawStream::open(&mut far, Some(waiting(kind("rs/ka/fair", LockKind::Fair)))).await;
        if i == 0 {
            s.half_close();
        }
        assert!(matches!(first_event(&mut s).await, Event::Queued(_)));
        streams.push(s);
    }
    let mut h = RawStream::open(&mut far, Some(open("rs/ka/held"))).await;
    assert!(matches!(first_event(&mut h).await, Event::Acquired(_)));
    streams.push(h);
    proxy.freeze();
    let frozen = Instant::now();
    eventually(Duration::from_secs(8), "hold released and places left", || {
        !exists(&redis, "rs/ka/held") && queue_len(&redis, "rs/ka/fair") == (0, 0)
    })
    .await;
    eprintln!("cleaned {:?} after the freeze", frozen.elapsed());
    fair.release().await.unwrap();
    let lease = near
        .lock("rs/ka/fair")
        .kind(latchkey_client::LockKind::Fair)
        .wait(Duration::from_secs(1))
        .acquire()
        .await
        .expect("no dead place in front");
    lease.release().await.unwrap();
    drop(streams);
}

/// A lease's lost signal, awaited in a task of its own, neither keeps the lease nor
/// misses its loss: with the lease dropped, its lock is free and the signal says
/// `None`, as after a release; broken by ForceRelease while nobody else reads the lease,
/// the signal says so. (A task waiting in `lost()` on a lease shared through an `Arc`
/// kept the lease, and its lock, for good.)
#[tokio::test]
async fn a_lost_signal_in_a_task_of_its_own_neither_keeps_nor_misses_the_lease() {
    use latchkey_client::LostReason;
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;

    let lease = client.lock("sig/dropped").acquire().await.unwrap();
    let signal = tokio::spawn(lease.lost_signal());
    drop(lease);
    assert_eq!(bounded(T, "the signal", signal).await.unwrap(), None);
    let again = client.lock("sig/dropped").wait(T).acquire();
    bounded(T, "the lock free", again)
        .await
        .expect("granted")
        .release()
        .await
        .unwrap();

    let lease = client.lock("sig/released").acquire().await.unwrap();
    let signal = lease.lost_signal();
    lease.release().await.unwrap();
    assert_eq!(bounded(T, "the signal", signal).await, None);

    let lease = client.lock("sig/broken").acquire().await.unwrap();
    let signal = tokio::spawn(lease.lost_signal());
    assert!(client.force_release("sig/broken").await.unwrap());
    let told = bounded(T, "the signal", signal).await.unwrap();
    assert_eq!(told, Some(LostReason::ForceReleased));
    assert_eq!(lease.lost_reason(), Some(LostReason::ForceReleased));
    assert_eq!(
        lease.lost_signal().await,
        Some(LostReason::ForceReleased),
        "asked after"
    );
    drop(lease);

    // Lost, then let go by its holder before the signal is first polled: the signal
    // still tells the loss, the lease's stream gone by then.
    let lease = client.lock("sig/lost-then-let-go").acquire().await.unwrap();
    let signal = lease.lost_signal();
    assert!(client.force_release("sig/lost-then-let-go").await.unwrap());
    bounded(T, "the loss", lease.lost()).await;
    let released = lease.release().await;
    assert!(matches!(released, Err(latchkey_client::Error::Lost(_))), "{released:?}");
    let told = bounded(T, "the signal", signal).await;
    assert_eq!(told, Some(LostReason::ForceReleased));

    // A fixed lease's end, told by the client's clock as `lost()` tells it.
    let fixed = client.lock("sig/fixed").lease(Duration::from_millis(300));
    let fixed = fixed.acquire().await.unwrap();
    let told = bounded(T, "the signal", tokio::spawn(fixed.lost_signal()))
        .await
        .unwrap();
    assert_eq!(told, Some(LostReason::LeaseExpired));
}
