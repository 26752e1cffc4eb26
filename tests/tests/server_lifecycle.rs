//! The server's lifecycle and its resource accounting: shutdown drains (streams that
//! cannot send among them), health during the drain, second signals, and the bounds,
//! gauges, subscriptions and memory after abnormal stream ends.

use latchkey_proto::v1::acquire_response::Event;
use latchkey_proto::v1::lock_service_client::LockServiceClient;
use latchkey_proto::v1::{LockKind as ProtoKind, Open};
use latchkey_tests::proxy::Proxy;
use latchkey_tests::server::{fill_window, health_watch, open, small_window_client, spawn_queued, RawStream};
use latchkey_tests::{bounded, gauges, metric, poll_until, scrape_metrics, LatchkeyProcess, RedisServer};
use std::time::{Duration, Instant};
use tonic::Code;

const T: Duration = Duration::from_secs(10);

fn exists(redis: &RedisServer, key: &str) -> bool {
    redis.cli(&["EXISTS", key]).trim() == "1"
}

fn spawn(redis_url: &str, extra: &[&str]) -> LatchkeyProcess {
    let mut args = vec!["--redis-url".to_owned(), redis_url.to_owned()];
    args.extend(extra.iter().map(|a| a.to_string()));
    LatchkeyProcess::spawn(&args)
}

/// A stream granted while its connection has no HTTP/2 send window left (its client
/// stopped reading a Watch on the same connection): its `acquired` event waits in
/// hyper for window, and hyper polls the stream no further, so it never hears of the
/// shutdown. SIGTERM still leaves nothing for a TTL to clean up: the drain cuts the
/// connections of the streams that did not end, which drops them and gives their lock
/// back, and the exit is prompt (it used to wait the whole 10 s drain and leave the
/// lock held till its TTL).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_releases_a_hold_whose_acquired_event_waits_for_window() {
    let redis = RedisServer::start();
    let mut server = spawn(&redis.url(), &["--no-metrics"]);
    let near = server.serving_client().await;
    let watched = format!("lc/win/{}", "w".repeat(1000));
    let mut far = small_window_client(&server.endpoint()).await;
    let watch = fill_window(&mut far, &near, &watched).await;
    // Granted at once; its `acquired` cannot be sent.
    let stuck = RawStream::open(&mut far, Some(open("lc/win/held"))).await;
    let held = poll_until(T, || exists(&redis, "lc/win/held")).await;
    assert!(held, "the stream was granted");
    let asked = Instant::now();
    server.terminate();
    let status = server.wait_exit(Duration::from_secs(20)).expect("exits");
    let took = asked.elapsed();
    let left = exists(&redis, "lc/win/held");
    let pttl = redis.cli(&["PTTL", "lc/win/held"]);
    let log = server.log_tail();
    drop((stuck, watch));
    assert!(status.success(), "{status}\n{log}");
    assert!(
        !left,
        "the lock is left in Redis for a TTL after the shutdown (pttl {}) which took {took:?}:\n{log}",
        pttl.trim()
    );
    // The cut comes 3 s in (CUT_AFTER); a connection slow to close adds 2 s, the exit 1 s:
    // still clear of the 10 s drain this guards against.
    assert!(took < Duration::from_secs(8), "the shutdown took {took:?}:\n{log}");
}

/// The same with a waiter: a fair waiter queued in Redis whose stream is not polled
/// leaves its place in Redisson's queue when the server stops (README: "No lock or
/// hold is left"), and the shutdown is prompt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_with_a_fair_waiter_behind_a_full_window_leaves_no_queue_entry() {
    let redis = RedisServer::start();
    let mut server = spawn(&redis.url(), &["--no-metrics", "--fair-wait-timeout", "60s"]);
    let near = server.serving_client().await;
    let holder = near
        .lock("lc/winf/fair")
        .kind(latchkey_client::LockKind::Fair)
        .acquire()
        .await
        .unwrap();
    let watched = format!("lc/winf/{}", "w".repeat(1000));
    let mut far = small_window_client(&server.endpoint()).await;
    let watch = fill_window(&mut far, &near, &watched).await;
    let waiting = RawStream::open(
        &mut far,
        Some(Open {
            kind: ProtoKind::Fair as i32,
            ..open("lc/winf/fair")
        }),
    )
    .await;
    let queue = || redis.cli(&["LLEN", "redisson_lock_queue:{lc/winf/fair}"]);
    let queued = poll_until(T, || queue().trim() == "1").await;
    assert!(queued, "the waiter is queued: {}", queue());
    let asked = Instant::now();
    server.terminate();
    let lost = bounded(T, "the holder's notice", holder.lost()).await;
    assert_eq!(lost, latchkey_client::LostReason::Shutdown);
    let status = server.wait_exit(Duration::from_secs(20)).expect("exits");
    let took = asked.elapsed();
    let left = queue();
    let log = server.log_tail();
    drop((waiting, watch));
    assert!(status.success(), "{status}\n{log}");
    assert_eq!(
        left.trim(),
        "0",
        "queue entries left after the shutdown ({took:?}):\n{log}"
    );
    // The cut comes 3 s in (CUT_AFTER); a connection slow to close adds 2 s, the exit 1 s:
    // still clear of the 10 s drain this guards against.
    assert!(took < Duration::from_secs(8), "the shutdown took {took:?}:\n{log}");
}

/// A second SIGTERM and a SIGINT during a drain that waits on Redis neither cut the
/// drain short (a lock left for a TTL) nor hold up the exit past its bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_signal_during_the_drain_is_harmless() {
    let redis = RedisServer::start();
    let mut server = spawn(&redis.url(), &["--no-metrics"]);
    let client = server.serving_client().await;
    let lease = client.lock("lc/twice").acquire().await.unwrap();
    redis.freeze();
    let asked = Instant::now();
    server.terminate();
    tokio::time::sleep(Duration::from_millis(300)).await;
    server.terminate();
    tokio::time::sleep(Duration::from_millis(300)).await;
    server.interrupt();
    let lost = bounded(T, "the notice", lease.lost()).await;
    assert_eq!(lost, latchkey_client::LostReason::Shutdown);
    tokio::time::sleep(Duration::from_millis(2500)).await;
    redis.resume();
    let status = server.wait_exit(Duration::from_secs(20)).expect("exits");
    let took = asked.elapsed();
    assert!(status.success(), "{status}\n{}", server.log_tail());
    assert!(took < Duration::from_secs(15), "{took:?}");
    assert!(
        !exists(&redis, "lc/twice"),
        "released after Redis came back:\n{}",
        server.log_tail()
    );
}

/// A health Watch opened before SIGTERM reads NOT_SERVING as soon as the drain begins,
/// while the drain still waits on a slow release. (Multi-threaded: `wait_exit` blocks
/// its thread, and the proxy's tasks must run meanwhile.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_is_not_serving_during_the_drain() {
    use tonic_health::pb::health_check_response::ServingStatus;
    let redis = RedisServer::start();
    let proxy = Proxy::to_redis(&redis).await;
    let mut server = spawn(&proxy.redis_url(), &["--no-metrics"]);
    let client = server.serving_client().await;
    let _lease = client.lock("lc/health/held").acquire().await.unwrap();
    let mut watch = health_watch(&server.endpoint()).await;
    bounded(T, "SERVING", async {
        while watch.message().await.unwrap().unwrap().status != ServingStatus::Serving as i32 {}
    })
    .await;
    // The release (a script naming the lock) is held back: the drain lasts seconds.
    proxy.hold_back_matching(Some((b"lc/health/held", Duration::from_secs(4))));
    let asked = Instant::now();
    server.terminate();
    let next = bounded(T, "a status after SIGTERM", watch.message()).await;
    let seen = asked.elapsed();
    let still_running = server.wait_exit(Duration::ZERO).is_none();
    let next = next.expect("a status").expect("one");
    assert_eq!(next.status, ServingStatus::NotServing as i32, "{next:?}");
    assert!(seen < Duration::from_secs(1), "NOT_SERVING came {seen:?} after SIGTERM");
    assert!(still_running, "the drain was already over");
    proxy.hold_back_matching(None);
    let status = server.wait_exit(Duration::from_secs(20)).expect("exits");
    let took = asked.elapsed();
    assert!(status.success(), "{status}");
    assert!(
        !exists(&redis, "lc/health/held"),
        "left after a shutdown of {took:?} (pttl {}):\n{}",
        redis.cli(&["PTTL", "lc/health/held"]).trim(),
        server.log_tail()
    );
}

/// Watches, a waiter and a stream that never sent `open`, on a connection that is cut
/// (TCP closed, no reset of any stream), round after round at the stream bounds: every
/// gauge goes back to zero, Redis keeps no subscription of theirs, and the bounds take
/// as many new streams as before.
#[tokio::test]
async fn cut_connections_give_back_bounds_gauges_and_subscriptions() {
    let redis = RedisServer::start();
    let server = spawn(
        &redis.url(),
        &["--max-streams", "6", "--max-streams-per-connection", "10"],
    );
    let port = server.metrics_port().unwrap();
    let direct = server.serving_client().await;
    let proxy = Proxy::start(&format!("127.0.0.1:{}", server.port())).await;
    for round in 0..3 {
        let holder = direct.lock(format!("lc/cut/held{round}")).acquire().await.unwrap();
        let far = latchkey_client::Client::connect(&proxy.endpoint()).await.unwrap();
        let mut watches = Vec::new();
        for i in 0..3 {
            let mut w = far.watch(format!("lc/cut/w{round}/{i}")).await.unwrap();
            bounded(T, "a first state", w.next()).await.unwrap().unwrap();
            watches.push(w);
        }
        let (waiter, _) = spawn_queued(far.lock(format!("lc/cut/held{round}")).wait(T * 6), T).await;
        let mut raw = LockServiceClient::connect(proxy.endpoint()).await.unwrap();
        let never = RawStream::open(&mut raw, None).await;
        // At the bound (the holder, three watches, the waiter, the silent stream): a
        // seventh stream is refused.
        let ok = poll_until(T, || gauges(port)[0] == 3.0).await;
        assert!(ok, "round {round}: {:?}", gauges(port));
        let over = direct.lock("lc/cut/over").try_once().acquire().await.unwrap_err();
        assert_eq!(over.code(), Code::ResourceExhausted, "round {round}: {over}");
        proxy.cut();
        let ended = bounded(T, "the waiter's end", waiter).await.unwrap();
        assert!(
            ended.is_err(),
            "round {round}: the waiter on a cut connection was granted"
        );
        drop((watches, never, far, raw));
        holder.release().await.unwrap();
        let idle = poll_until(T, || gauges(port) == [0.0; 4]).await;
        assert!(
            idle,
            "round {round}: (streams, leases, waiters, subs) = {:?}",
            gauges(port)
        );
        let channels = || redis.cli(&["PUBSUB", "CHANNELS", "*lc/cut*"]);
        let unsubscribed = poll_until(T, || channels().trim().is_empty()).await;
        assert!(unsubscribed, "round {round}: still subscribed: {}", channels());
        // Every place is back: six new streams are taken.
        let mut again = Vec::new();
        for i in 0..6 {
            let w = direct.watch(format!("lc/cut/again{round}/{i}")).await;
            assert!(w.is_ok(), "round {round}, stream {i}: {:?}", w.err());
            again.push(w.unwrap());
        }
        drop(again);
        let idle = poll_until(T, || gauges(port) == [0.0; 4]).await;
        assert!(idle, "round {round} after: {:?}", gauges(port));
    }
}

/// Many rounds of abnormal ends (waits cancelled during their try, streams cut before
/// `open`, Watches reset, second `open`s, wait deadlines) on names of their own: the
/// allocator's live bytes come back near where they were, and so does the RSS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeated_abnormal_ends_leak_no_memory() {
    let redis = RedisServer::start();
    let server = spawn(&redis.url(), &[]);
    let port = server.metrics_port().unwrap();
    let client = server.serving_client().await;
    let allocated = || metric(&scrape_metrics(port), "latchkey_heap_allocated_bytes").unwrap_or(-1.0);
    let round = |r: usize| {
        let client = client.clone();
        let endpoint = server.endpoint();
        async move {
            let name = format!("lc/mem/{r}");
            let held = client.lock(name.clone()).acquire().await.unwrap();
            let w1 = tokio::spawn(client.lock(name.clone()).wait(T).acquire());
            let w2 = tokio::spawn(client.lock(name.clone()).wait(Duration::from_millis(30)).acquire());
            let mut watch = client.watch(name.clone()).await.unwrap();
            let _ = tokio::time::timeout(T, watch.next()).await;
            let mut raw = LockServiceClient::connect(endpoint).await.unwrap();
            let mut twice = RawStream::open(&mut raw, Some(open(&format!("{name}/b")))).await;
            let _ = twice.next(T).await;
            twice
                .send(latchkey_proto::v1::acquire_request::Action::Open(open("x")))
                .await;
            let _ = twice.next(T).await;
            let never = RawStream::open(&mut raw, None).await;
            tokio::time::sleep(Duration::from_millis(20)).await;
            w1.abort();
            let _ = w2.await;
            drop((watch, never, raw));
            held.release().await.unwrap();
        }
    };
    for r in 0..50 {
        round(r).await;
    }
    let settle = |what: &'static str| async move {
        let idle = poll_until(T, || gauges(port) == [0.0; 4]).await;
        assert!(idle, "{what}: {:?}", gauges(port));
        tokio::time::sleep(Duration::from_secs(5)).await;
    };
    settle("warm-up").await;
    // Up to two runs of 500 rounds, the second only when the first kept live bytes: a
    // leak keeps bytes in each, where the threads' allocator caches, which count as
    // live, move the figure by a few hundred KiB either way (one run of 500 read
    // +275 KiB once, others -239 to +88 KiB).
    let mut kept: Vec<f64> = Vec::new();
    let mut before = allocated();
    for run in 1..=2 {
        if kept.iter().any(|k| *k < 256.0) {
            break;
        }
        let rss_before = server.rss_kib();
        for r in 50 + 500 * (run - 1)..50 + 500 * run {
            round(r).await;
        }
        settle("after").await;
        let (after, rss_after) = (allocated(), server.rss_kib());
        eprintln!("run {run}: allocated {before} -> {after}, rss {rss_before} KiB -> {rss_after} KiB");
        assert!(before > 0.0 && after > 0.0);
        kept.push((after - before) / 1024.0);
        before = after;
    }
    assert!(
        kept.iter().any(|k| *k < 256.0),
        "each run of 500 rounds kept live bytes: {kept:?} KiB"
    );
}

/// A stream refused by `--max-streams-per-connection`, round after round, leaves no
/// place behind: the connection's bound takes two new holders each round.
#[tokio::test]
async fn refused_streams_leave_no_place_behind() {
    let redis = RedisServer::start();
    let server = spawn(&redis.url(), &["--max-streams-per-connection", "2"]);
    let port = server.metrics_port().unwrap();
    let _ = server.serving_client().await;
    let mut raw = LockServiceClient::connect(server.endpoint()).await.unwrap();
    for round in 0..20 {
        let mut a = RawStream::open(&mut raw, Some(open(&format!("lc/ref/{round}/a")))).await;
        let mut b = RawStream::open(&mut raw, Some(open(&format!("lc/ref/{round}/b")))).await;
        for s in [&mut a, &mut b] {
            let e = s.next(T).await.unwrap().unwrap().event.unwrap();
            assert!(matches!(e, Event::Acquired(_)), "{e:?}");
        }
        let mut c = RawStream::open(&mut raw, Some(open(&format!("lc/ref/{round}/c")))).await;
        let err = c.next(T).await.unwrap_err();
        assert_eq!(err.code(), Code::ResourceExhausted, "round {round}: {err}");
        drop((a, b, c));
        let idle = poll_until(T, || gauges(port)[..3] == [0.0; 3]).await;
        assert!(idle, "round {round}: {:?}", gauges(port));
    }
}

/// SIGTERM while a multi-lock is half taken (its first slot's names granted, the
/// second slot's script held back on its way to Redis) and while a single lock's first
/// try is in flight: both streams end `UNAVAILABLE`, nothing is left held once the
/// process has exited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_during_a_half_taken_multi_lock_and_a_try_in_flight_leaves_nothing() {
    let redis = RedisServer::start();
    let proxy = Proxy::to_redis(&redis).await;
    let mut server = spawn(&proxy.redis_url(), &["--no-metrics"]);
    let _ = server.serving_client().await;
    let (a, b) = ("lc/mh/alpha", "lc/mh/beta");
    let (first, second) = if fred::util::redis_keyslot(a.as_bytes()) < fred::util::redis_keyslot(b.as_bytes()) {
        (a, b)
    } else {
        (b, a)
    };
    assert_ne!(
        fred::util::redis_keyslot(a.as_bytes()),
        fred::util::redis_keyslot(b.as_bytes())
    );
    let mut raw = LockServiceClient::connect(server.endpoint()).await.unwrap();
    // The second slot's script, and the single lock's try, wait 1.5 s at the proxy.
    proxy.hold_back_matching(Some((b"lc/mh/", Duration::from_millis(1500))));
    let mut multi = RawStream::open(
        &mut raw,
        Some(Open {
            names: vec![a.to_owned(), b.to_owned()],
            ..Default::default()
        }),
    )
    .await;
    let mut single = RawStream::open(&mut raw, Some(open("lc/mh/single"))).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    proxy.hold_back_matching(None);
    let asked = Instant::now();
    server.terminate();
    for (what, s) in [("multi", &mut multi), ("single", &mut single)] {
        let ended = loop {
            match s.next(T).await {
                Ok(Some(e)) => {
                    let e = e.event.unwrap();
                    assert!(!matches!(e, Event::Acquired(_)), "{what}: granted at shutdown: {e:?}");
                }
                other => break other,
            }
        };
        let code = ended.as_ref().err().map(tonic::Status::code);
        assert_eq!(code, Some(Code::Unavailable), "{what}: {ended:?}");
    }
    let status = server.wait_exit(Duration::from_secs(20)).expect("exits");
    assert!(status.success(), "{status}\n{}", server.log_tail());
    assert!(asked.elapsed() < Duration::from_secs(15), "{:?}", asked.elapsed());
    for key in [first, second, "lc/mh/single"] {
        assert!(!exists(&redis, key), "{key} left held:\n{}", server.log_tail());
    }
}

/// SIGTERM in the middle of a hot fair lock passed in memory among many waiters of
/// one server (some lined up in memory, queued in Redis by the recordings): once the
/// process has exited, Redis keeps no lock, no queue entry and no timeout of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_in_a_hot_fair_run_leaves_no_queue() {
    use latchkey_client::LockKind;
    for round in 0..3 {
        let redis = RedisServer::start();
        let mut server = spawn(&redis.url(), &["--no-metrics", "--fair-wait-timeout", "60s"]);
        let client = server.serving_client().await;
        let name = format!("lc/hotfair/{round}");
        let mut tasks = Vec::new();
        for _ in 0..24 {
            let (client, name) = (client.clone(), name.clone());
            tasks.push(tokio::spawn(async move {
                loop {
                    match client.lock(name.clone()).kind(LockKind::Fair).wait(T).acquire().await {
                        Ok(lease) => {
                            tokio::time::sleep(Duration::from_millis(2)).await;
                            if lease.release().await.is_err() {
                                return;
                            }
                        }
                        Err(_) => return,
                    }
                }
            }));
        }
        tokio::time::sleep(Duration::from_millis(800 + 300 * round as u64)).await;
        server.terminate();
        let status = server.wait_exit(Duration::from_secs(20)).expect("exits");
        assert!(status.success(), "{status}\n{}", server.log_tail());
        for t in tasks {
            let _ = bounded(T, "a client task", t).await;
        }
        let queue = format!("redisson_lock_queue:{{{name}}}");
        let timeouts = format!("redisson_lock_timeout:{{{name}}}");
        let left: Vec<(String, String)> = [name.clone(), queue, timeouts]
            .into_iter()
            .map(|k| (redis.cli(&["TYPE", &k]).trim().to_owned(), k))
            .filter(|(t, _)| t != "none")
            .map(|(t, k)| (k, t))
            .collect();
        assert!(
            left.is_empty(),
            "round {round}: left in Redis: {left:?}\n{}",
            server.log_tail()
        );
    }
}

/// In process, where the connections' tasks outlive `Server::stop` (tonic runs each in
/// a task of its own): a stream granted behind a full window is given back by the
/// stop, not kept with its connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_in_process_stop_gives_back_a_hold_behind_a_full_window() {
    let redis = RedisServer::start();
    let server = latchkey_tests::server::Latchkey::start(&redis.url()).await;
    let near = server.client().await;
    let watched = format!("lc/inproc/{}", "w".repeat(1000));
    let mut far = small_window_client(server.endpoint()).await;
    let watch = fill_window(&mut far, &near, &watched).await;
    let stuck = RawStream::open(&mut far, Some(open("lc/inproc/held"))).await;
    assert!(poll_until(T, || exists(&redis, "lc/inproc/held")).await, "granted");
    drop(near);
    let asked = Instant::now();
    bounded(Duration::from_secs(30), "the stop", server.stop()).await;
    let took = asked.elapsed();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let left = exists(&redis, "lc/inproc/held");
    drop((stuck, watch, far));
    assert!(!left, "held in Redis 2 s after a stop that took {took:?}");
}
