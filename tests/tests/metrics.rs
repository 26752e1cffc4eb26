//! Observability of a real server process: Prometheus metrics on `--metrics-listen`,
//! and one JSON log line per lease event with the lock name, owner and fencing token.

use latchkey_server::config::Config;
use latchkey_tests::server::{spawn_queued, Latchkey};
use latchkey_tests::{free_port, http_get, metric, poll_until, scrape_metrics, LatchkeyProcess, RedisServer};
use std::time::Duration;

#[tokio::test]
async fn metrics_and_json_logs_describe_what_happened() {
    let redis = RedisServer::start();
    // Grants and releases log at debug under their own target.
    let server = LatchkeyProcess::spawn_with_env(
        &[
            "--redis-url".to_owned(),
            redis.url(),
            "--log-format".to_owned(),
            "json".to_owned(),
        ],
        &[("RUST_LOG", "info,latchkey::lease=debug")],
    );
    let client = server.serving_client().await;
    let lease = client.lock("observed").owner("svc:7").acquire().await.unwrap();
    let token = lease.fencing_token();
    // Granted after a wake-up (the handoff histogram's event): queued and subscribed
    // before the release.
    let (waiter, _) = spawn_queued(
        client.lock("observed").wait(Duration::from_secs(5)),
        Duration::from_secs(5),
    )
    .await;
    let port = server.metrics_port().expect("metrics enabled");
    let subscribed = || metric(&scrape_metrics(port), "latchkey_pubsub_subscriptions").unwrap_or(0.0) >= 1.0;
    assert!(
        poll_until(Duration::from_secs(5), subscribed).await,
        "the waiter subscribes"
    );
    lease.release().await.unwrap();
    latchkey_tests::server::each_granted(vec![waiter], Duration::from_secs(10)).await;

    let metrics = scrape_metrics(server.metrics_port().expect("metrics enabled"));
    for name in [
        "latchkey_acquisitions_total{kind=\"mutex\",outcome=\"acquired\"}",
        "latchkey_acquire_wait_seconds_bucket",
        "latchkey_handoff_seconds_bucket",
        "latchkey_streams_open",
        "latchkey_leases_held",
        "latchkey_waiters",
        "latchkey_pubsub_subscriptions",
        "latchkey_redis_command_seconds_bucket{script=\"mutex_acquire\"",
        "latchkey_rpc_handled_total{method=\"Acquire\",code=\"Ok\"}",
    ] {
        assert!(metrics.contains(name), "{name} missing from:\n{metrics}");
    }
    // The allocator's figures: live bytes, the resident memory that holds them, and the
    // allocator's own metadata within it.
    let gauge = |name: &str| metric(&metrics, name).unwrap_or_else(|| panic!("{name} missing from:\n{metrics}"));
    let (live, resident, metadata) = (
        gauge("latchkey_heap_allocated_bytes"),
        gauge("latchkey_heap_resident_bytes"),
        gauge("latchkey_heap_metadata_bytes"),
    );
    assert!(live > 0.0 && resident >= live, "heap: {live} live, {resident} resident");
    assert!(
        metadata > 0.0 && metadata < resident,
        "heap: {metadata} metadata, {resident} resident"
    );

    let log = server.log();
    let acquired = log
        .lines()
        .find(|l| l.contains("\"acquired\"") && l.contains("svc:7"))
        .unwrap_or_else(|| panic!("no JSON line for the grant:\n{log}"));
    assert!(acquired.starts_with('{') && acquired.ends_with('}'), "{acquired}");
    assert!(acquired.contains("\"lock\":\"observed\""), "{acquired}");
    assert!(acquired.contains(&format!("\"token\":{token}")), "{acquired}");
    assert!(log.contains("\"released\""), "no JSON line for the release:\n{log}");
}

/// At the default level a server logs no line per grant or release: two lines per lock
/// cycle would cost a busy server a tenth of its throughput.
#[tokio::test]
async fn lease_events_stay_out_of_the_default_log() {
    let redis = RedisServer::start();
    let server = LatchkeyProcess::spawn_with_env(&["--redis-url".to_owned(), redis.url()], &[("RUST_LOG", "info")]);
    let client = server.serving_client().await;
    let lease = client.lock("quiet").acquire().await.unwrap();
    lease.release().await.unwrap();
    let log = server.log();
    assert!(log.contains("latchkey serving"), "{log}");
    assert!(!log.contains("quiet"), "a lease event at the default level:\n{log}");
}

/// A server that has served no call yet exports its counters and gauges at zero: an
/// idle replica shows in the dashboard's job and instance pickers (which query
/// `latchkey_streams_open`), its panels read 0 rather than "No data", and an alert on a
/// counter's rate has a series before the first event.
#[tokio::test]
async fn a_fresh_server_exports_its_counters_and_gauges_at_zero() {
    let redis = RedisServer::start();
    // Started without `serving_client`, whose probe lock would be an Acquire stream.
    let server = LatchkeyProcess::start(&redis.url());
    let scrape = scrape_metrics(server.metrics_port().expect("metrics enabled"));
    for name in [
        "latchkey_streams_open",
        "latchkey_leases_held",
        "latchkey_waiters",
        "latchkey_pubsub_subscriptions",
        "latchkey_watchdog_renewals_total",
        "latchkey_watchdog_renewal_failures_total",
        "latchkey_handoffs_total",
        "latchkey_passes_in_memory_total",
        "latchkey_fair_queued_in_memory_total",
        "latchkey_acquisitions_total{kind=\"mutex\",outcome=\"acquired\"}",
        "latchkey_acquisitions_total{kind=\"semaphore\",outcome=\"timeout\"}",
        "latchkey_leases_lost_total{reason=\"NOT_HELD\"}",
        "latchkey_leases_lost_total{reason=\"SHUTDOWN\"}",
        "latchkey_rpc_started_total{method=\"Acquire\"}",
        "latchkey_rpc_started_total{method=\"Watch\"}",
        "latchkey_redis_errors_total{script=\"mutex_acquire\"}",
        "latchkey_redis_errors_total{script=\"renew\"}",
    ] {
        assert_eq!(metric(&scrape, name), Some(0.0), "{name} in:\n{scrape}");
    }
}

/// Readiness is told on the metrics listener as on gRPC health: `/ready` answers 503
/// `NOT_SERVING` before Redis first answers and while it is away, 200 `SERVING` while it
/// answers (an `httpGet` probe, for a gRPC listener the kubelet's plaintext gRPC probe
/// cannot reach: TLS, client certificates), and `latchkey_serving` reads 0 or 1 (for
/// alerts). `/health` answers 200 throughout: a Redis outage restarts nothing.
#[tokio::test]
async fn readiness_is_told_on_ready_and_by_the_serving_gauge() {
    let mut redis = RedisServer::start();
    redis.stop();
    let args = ["--redis-url", &redis.url(), "--redis-timeout", "500ms"].map(String::from);
    let server = LatchkeyProcess::spawn(&args);
    let port = server.metrics_port().expect("metrics enabled");
    let told = || {
        let ready = http_get(port, "/ready");
        let gauge = metric(&scrape_metrics(port), "latchkey_serving");
        let healthy = http_get(port, "/health").starts_with("HTTP/1.1 200");
        (
            ready.lines().next().unwrap_or("").to_owned(),
            ready.lines().last().map(str::to_owned),
            gauge,
            healthy,
        )
    };
    let not_ready = (
        "HTTP/1.1 503 Service Unavailable".to_owned(),
        Some("NOT_SERVING".to_owned()),
        Some(0.0),
        true,
    );
    let ready = (
        "HTTP/1.1 200 OK".to_owned(),
        Some("SERVING".to_owned()),
        Some(1.0),
        true,
    );
    assert_eq!(told(), not_ready);
    redis.restart();
    let within = Duration::from_secs(10);
    assert!(poll_until(within, || told() == ready).await, "{:?}", told());
    redis.stop();
    assert!(poll_until(within, || told() == not_ready).await, "{:?}", told());
}

/// The gauges' current values in one scrape: open streams, held leases, waiters.
fn gauges(port: u16) -> (f64, f64, f64) {
    let scrape = scrape_metrics(port);
    let value = |name: &str| metric(&scrape, name).unwrap_or(0.0);
    (
        value("latchkey_streams_open"),
        value("latchkey_leases_held"),
        value("latchkey_waiters"),
    )
}

/// `latchkey_waiters` counts Acquire streams waiting for a lock: an operator watching a
/// lock (Watch, `latchkey watch`) waits for nothing and is no waiter.
#[tokio::test]
async fn a_watch_is_not_counted_as_a_waiter() {
    let redis = RedisServer::start();
    let server = LatchkeyProcess::start(&redis.url());
    let port = server.metrics_port().expect("metrics enabled");
    let client = server.serving_client().await;
    let lease = client.lock("watched").acquire().await.unwrap();
    let mut watch = client.watch("watched").await.unwrap();
    let first = tokio::time::timeout(Duration::from_secs(5), watch.next()).await;
    assert!(first.expect("first state in time").unwrap().unwrap().locked);
    let waiter = {
        let client = client.clone();
        tokio::spawn(async move { client.lock("watched").wait(Duration::from_secs(20)).acquire().await })
    };
    let one_waiter = poll_until(Duration::from_secs(5), || gauges(port) == (2.0, 1.0, 1.0)).await;
    assert!(
        one_waiter,
        "one holder, one waiter and a watch: (streams, leases, waiters) = {:?}",
        gauges(port)
    );
    lease.release().await.unwrap();
    let granted = tokio::time::timeout(Duration::from_secs(5), waiter).await;
    granted
        .expect("granted in time")
        .unwrap()
        .unwrap()
        .release()
        .await
        .unwrap();
    drop(watch);
    let idle = poll_until(Duration::from_secs(5), || gauges(port) == (0.0, 0.0, 0.0)).await;
    assert!(idle, "every stream ended: {:?}", gauges(port));
}

/// Every way a stream ends gives back its gauges: open streams, held leases, waiters.
#[tokio::test]
async fn gauges_return_to_zero_however_streams_end() {
    use latchkey_client::LockKind;
    let redis = RedisServer::start();
    let server = LatchkeyProcess::spawn(&[
        "--redis-url".to_owned(),
        redis.url(),
        "--max-waiters-per-lock".to_owned(),
        "2".to_owned(),
    ]);
    let port = server.metrics_port().expect("metrics enabled");
    let client = server.serving_client().await;
    let held = client.lock("g").acquire().await.unwrap();
    // A wait that times out, one cancelled, one refused by the per-lock bound.
    let timed_out = client.lock("g").wait(Duration::from_millis(300)).acquire().await;
    assert!(timed_out.unwrap_err().is_timeout());
    let (cancelled, _) = spawn_queued(client.lock("g"), Duration::from_secs(10)).await;
    let (waiting, _) = spawn_queued(client.lock("g").wait(Duration::from_secs(20)), Duration::from_secs(10)).await;
    let refused = client.lock("g").wait(Duration::from_secs(5)).acquire().await;
    assert_eq!(refused.unwrap_err().code(), tonic::Code::ResourceExhausted);
    cancelled.abort();
    // Bad input, a fixed lease that runs out, a force-released semaphore, a multi-lock.
    assert!(client.lock("").acquire().await.is_err());
    let fixed = client
        .lock("f")
        .lease(Duration::from_millis(500))
        .acquire()
        .await
        .unwrap();
    let sem = client
        .lock("s")
        .kind(LockKind::Semaphore)
        .limit(2)
        .acquire()
        .await
        .unwrap();
    let multi = client.lock_all(["m1", "m2"]).acquire().await.unwrap();
    assert!(client.force_release("s").await.unwrap());
    tokio::time::timeout(Duration::from_secs(5), fixed.lost())
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(5), sem.lost()).await.unwrap();
    drop(multi);
    drop(held);
    let granted = tokio::time::timeout(Duration::from_secs(5), waiting).await;
    drop(granted.expect("granted in time").unwrap().unwrap());
    drop((fixed, sem));
    let idle = poll_until(Duration::from_secs(5), || gauges(port) == (0.0, 0.0, 0.0)).await;
    assert!(
        idle,
        "every stream ended: (streams, leases, waiters) = {:?}",
        gauges(port)
    );
}

/// `latchkey_rpc_started_total` and `latchkey_rpc_handled_total` of each method: how
/// many started, and how many ended with each code.
fn rpc_counts(port: u16) -> std::collections::BTreeMap<String, (f64, Vec<(String, f64)>)> {
    let mut counts = std::collections::BTreeMap::<String, (f64, Vec<(String, f64)>)>::new();
    for line in scrape_metrics(port).lines() {
        let label = |l: &str, name: &str| {
            let start = l.find(&format!("{name}=\""))? + name.len() + 2;
            Some(l[start..].split('"').next()?.to_owned())
        };
        let value = || {
            line.rsplit(' ')
                .next()
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or(0.0)
        };
        if line.starts_with("latchkey_rpc_started_total{") {
            counts.entry(label(line, "method").unwrap()).or_default().0 += value();
        } else if line.starts_with("latchkey_rpc_handled_total{") {
            let (method, code) = (label(line, "method").unwrap(), label(line, "code").unwrap());
            counts.entry(method).or_default().1.push((code, value()));
        }
    }
    counts
}

/// Every RPC that started is counted as handled, with its code, once it ended: the
/// Acquire refused by `--max-streams` (what an operator alerts on) and every Watch
/// were started and never handled.
#[tokio::test]
async fn every_started_rpc_is_counted_as_handled_with_its_code() {
    let redis = RedisServer::start();
    let server = LatchkeyProcess::spawn(&[
        "--redis-url".to_owned(),
        redis.url(),
        "--max-streams".to_owned(),
        "1".to_owned(),
    ]);
    let port = server.metrics_port().expect("metrics enabled");
    let client = server.serving_client().await;
    let lease = client.lock("bounded").acquire().await.unwrap();
    let refused = client.lock("other").try_once().acquire().await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::ResourceExhausted, "{refused}");
    let refused = client.watch("other").await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::ResourceExhausted, "{refused}");
    lease.release().await.unwrap();
    let mut watch = client.watch("bounded").await.unwrap();
    tokio::time::timeout(Duration::from_secs(5), watch.next())
        .await
        .unwrap()
        .unwrap();
    drop(watch);
    let settled = poll_until(Duration::from_secs(5), || {
        rpc_counts(port)
            .values()
            .all(|(started, handled)| *started == handled.iter().map(|(_, n)| n).sum::<f64>())
    })
    .await;
    let counts = rpc_counts(port);
    assert!(settled, "started against handled by code: {counts:#?}");
    for method in ["Acquire", "Watch"] {
        let handled = &counts[method].1;
        assert!(
            handled.iter().any(|(code, n)| code == "ResourceExhausted" && *n == 1.0),
            "{method}: {handled:?}"
        );
    }
}

/// A wait the client gives up (cancels its call) is an acquisition that ended
/// `cancelled`, with its wait in the histogram.
#[tokio::test]
async fn a_wait_the_client_cancels_counts_as_cancelled() {
    let redis = RedisServer::start();
    let server = LatchkeyProcess::start(&redis.url());
    let port = server.metrics_port().expect("metrics enabled");
    let client = server.serving_client().await;
    let lease = client.lock("given-up").acquire().await.unwrap();
    let waiting = client.lock("given-up").acquire();
    assert!(tokio::time::timeout(Duration::from_millis(500), waiting).await.is_err());
    let cancelled = "latchkey_acquisitions_total{kind=\"mutex\",outcome=\"cancelled\"}";
    let counted = poll_until(Duration::from_secs(5), || {
        metric(&scrape_metrics(port), cancelled) == Some(1.0)
    })
    .await;
    assert!(counted, "{cancelled} in:\n{}", scrape_metrics(port));
    lease.release().await.unwrap();
}

/// A wait the client withdraws with `release` (answered `released`, the stream ending
/// OK) is given up as a cancelled call is: an acquisition that ended `cancelled`, not
/// an `error`.
#[tokio::test]
async fn a_wait_withdrawn_with_release_counts_as_cancelled() {
    use latchkey_proto::v1::acquire_response::Event;
    use latchkey_proto::v1::lock_service_client::LockServiceClient;
    use latchkey_tests::server::{open, RawStream};
    let redis = RedisServer::start();
    let server = LatchkeyProcess::start(&redis.url());
    let port = server.metrics_port().expect("metrics enabled");
    let client = server.serving_client().await;
    let lease = client.lock("withdrawn").acquire().await.unwrap();
    let mut raw = LockServiceClient::connect(server.endpoint()).await.unwrap();
    let mut waiting = RawStream::open(&mut raw, Some(open("withdrawn"))).await;
    let limit = Duration::from_secs(5);
    let queued = waiting.next(limit).await.unwrap().and_then(|r| r.event);
    assert!(matches!(queued, Some(Event::Queued(_))), "{queued:?}");
    waiting.release().await;
    let released = waiting.next(limit).await.unwrap().and_then(|r| r.event);
    assert!(matches!(released, Some(Event::Released(_))), "{released:?}");
    assert!(waiting.next(limit).await.unwrap().is_none(), "the stream ends OK");
    let outcome = |o: &str| format!("latchkey_acquisitions_total{{kind=\"mutex\",outcome=\"{o}\"}}");
    let counted = poll_until(limit, || {
        metric(&scrape_metrics(port), &outcome("cancelled")) == Some(1.0)
    })
    .await;
    let scrape = scrape_metrics(port);
    assert!(counted, "{} in:\n{scrape}", outcome("cancelled"));
    assert_eq!(metric(&scrape, &outcome("error")), Some(0.0), "{scrape}");
    lease.release().await.unwrap();
}

/// `latchkey_pubsub_subscriptions` counts the lock channels of both hubs of a server
/// with RedLock deployments: each hub used to set the gauge to its own count, so the
/// RedLock hub's idle rounds (every 5 s) put the main hub's channels at zero.
#[tokio::test]
async fn subscriptions_count_every_hub_of_a_redlock_server() {
    let (redis, nodes) = (RedisServer::start(), [(); 3].map(|_| RedisServer::start()));
    // The nodes were started just now: they count at once.
    let mut args = ["--redis-url", &redis.url(), "--redlock-restart-delay", "0s"]
        .map(str::to_owned)
        .to_vec();
    for node in &nodes {
        args.extend(["--redlock-url".to_owned(), node.url()]);
    }
    let server = LatchkeyProcess::spawn(&args);
    let port = server.metrics_port().expect("metrics enabled");
    let client = server.serving_client().await;
    let mut held = Vec::new();
    let mut waiters = Vec::new();
    for name in ["sub/a", "sub/b", "sub/c"] {
        held.push(client.lock(name).acquire().await.unwrap());
        let client = client.clone();
        waiters.push(tokio::spawn(async move { client.lock(name).acquire().await }));
    }
    let subscriptions = || metric(&scrape_metrics(port), "latchkey_pubsub_subscriptions").unwrap_or(0.0);
    let counted = poll_until(Duration::from_secs(5), || subscriptions() >= 3.0).await;
    assert!(counted, "three waited-on channels: {}", subscriptions());
    // Past the RedLock hub's next idle round.
    let deadline = std::time::Instant::now() + Duration::from_secs(6);
    while std::time::Instant::now() < deadline {
        let now = subscriptions();
        assert!(now >= 3.0, "three channels still waited on, the gauge says {now}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for waiter in &waiters {
        waiter.abort();
    }
    drop(held);
}

/// A stream whose connection is cut before its client sent `open` is counted
/// `Cancelled`, not `Ok`: the client never saw it end.
#[tokio::test]
async fn a_stream_cut_off_before_open_counts_as_cancelled() {
    use latchkey_tests::proxy::Proxy;
    let redis = RedisServer::start();
    let server = LatchkeyProcess::start(&redis.url());
    let port = server.metrics_port().expect("metrics enabled");
    let proxy = Proxy::start(server.endpoint().trim_start_matches("http://")).await;
    let mut raw = latchkey_proto::v1::lock_service_client::LockServiceClient::connect(proxy.endpoint())
        .await
        .unwrap();
    let _stream = latchkey_tests::server::RawStream::open(&mut raw, None).await;
    let opened = poll_until(Duration::from_secs(5), || {
        metric(&scrape_metrics(port), "latchkey_streams_open") == Some(1.0)
    })
    .await;
    assert!(opened, "the stream reached the server");
    proxy.cut();
    counted_cancelled_not_ok(port).await;
}

/// A holder whose connection is cut (no reset of its stream, no release) ended a call
/// the client never saw end: it is counted `Cancelled`, as a reset stream is, not `Ok`
/// as a release is.
#[tokio::test]
async fn a_stream_whose_connection_is_cut_counts_as_cancelled() {
    use latchkey_tests::proxy::Proxy;
    let redis = RedisServer::start();
    let server = LatchkeyProcess::start(&redis.url());
    let port = server.metrics_port().expect("metrics enabled");
    let proxy = Proxy::start(server.endpoint().trim_start_matches("http://")).await;
    let far = latchkey_client::Client::connect(&proxy.endpoint()).await.unwrap();
    let _lease = far.lock("cut").acquire().await.unwrap();
    proxy.cut();
    counted_cancelled_not_ok(port).await;
}

/// `latchkey_watchdog_renewal_gap_max_seconds` tells the longest a lease went without a
/// confirmation by Redis: under the timeout once renewals come, and a renewal that
/// comes late (the server frozen past its round) shows in it.
#[tokio::test]
async fn the_longest_renewal_gap_shows_a_late_renewal() {
    let redis = RedisServer::start();
    let args = ["--redis-url", &redis.url(), "--watchdog-timeout", "6s"].map(str::to_owned);
    let mut server = LatchkeyProcess::spawn(&args);
    let port = server.metrics_port().expect("metrics enabled");
    let client = server.serving_client().await;
    let gap = || metric(&scrape_metrics(port), "latchkey_watchdog_renewal_gap_max_seconds");
    let lease = client.lock("renewed").acquire().await.unwrap();
    assert!(
        poll_until(Duration::from_secs(5), || gap().is_some()).await,
        "set at the first renewal"
    );
    let first = gap().unwrap();
    assert!(first > 0.0 && first < 6.0, "{first} s: within the timeout");
    // Frozen for 2.5 s, past the 2 s period (and well within the notice's limit): the
    // renewal due meanwhile comes late.
    server.freeze();
    tokio::time::sleep(Duration::from_millis(2500)).await;
    server.resume();
    let late = poll_until(Duration::from_secs(8), || gap().is_some_and(|g| g >= 2.5)).await;
    assert!(late, "the late renewal shows: {:?} s", gap());
    drop(lease);
}

/// `latchkey_watchdog_renewals_total` counts leases renewed: a fixed lease, which the
/// rounds only check, is none, while a stream-scoped one counts once per round.
#[tokio::test]
async fn renewals_count_leases_renewed_not_fixed_ones_checked() {
    let redis = RedisServer::start();
    let args = ["--redis-url", &redis.url(), "--watchdog-timeout", "900ms"].map(str::to_owned);
    let server = LatchkeyProcess::spawn(&args);
    let port = server.metrics_port().expect("metrics enabled");
    let client = server.serving_client().await;
    let renewals = || metric(&scrape_metrics(port), "latchkey_watchdog_renewals_total").unwrap_or(0.0);
    let fixed = client
        .lock("checked")
        .lease(Duration::from_secs(5))
        .acquire()
        .await
        .unwrap();
    let before = renewals();
    // Four rounds (one every 300 ms).
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert_eq!(renewals(), before, "a fixed lease is checked, not renewed");
    let renewed = client.lock("renewed").acquire().await.unwrap();
    let counted = poll_until(Duration::from_secs(5), || renewals() >= before + 2.0).await;
    assert!(counted, "the stream-scoped lease's renewals are counted");
    renewed.release().await.unwrap();
    fixed.release().await.unwrap();
    // A multi-lock is one lease: its three names were counted three times a round.
    let multi = client.lock_all(["m1", "m2", "m3"]).acquire().await.unwrap();
    // Renewals and rounds, read in one scrape.
    let counts = || {
        let scrape = scrape_metrics(port);
        let count = |name| metric(&scrape, name).unwrap_or(0.0);
        (
            count("latchkey_watchdog_renewals_total"),
            count("latchkey_watchdog_round_seconds_count"),
        )
    };
    let before = counts();
    let mut after = before;
    let counted = poll_until(Duration::from_secs(5), || {
        after = counts();
        after.0 > before.0
    })
    .await;
    assert!(counted, "the multi-lock's renewals are counted");
    // One a round, however many rounds passed between the scrapes; its three names
    // were counted three at once.
    let (renewed, rounds) = (after.0 - before.0, after.1 - before.1);
    assert!(
        renewed <= rounds,
        "one lease, one renewal a round: {renewed} in {rounds} rounds"
    );
    multi.release().await.unwrap();
}

/// The server on metrics `port` counts one Acquire handled as `Cancelled`, none as `Ok`.
async fn counted_cancelled_not_ok(port: u16) {
    let cancelled = "latchkey_rpc_handled_total{method=\"Acquire\",code=\"Cancelled\"}";
    let counted = poll_until(Duration::from_secs(5), || {
        metric(&scrape_metrics(port), cancelled) == Some(1.0)
    })
    .await;
    let scrape = scrape_metrics(port);
    assert!(counted, "{cancelled} in:\n{scrape}");
    let ok = "latchkey_rpc_handled_total{method=\"Acquire\",code=\"Ok\"}";
    assert_eq!(metric(&scrape, ok), None, "{scrape}");
}

/// Calls refused for their credentials are counted like every other RPC: started, and
/// handled `Unauthenticated` under their method (the interceptor refused them before any
/// handler ran, and they went uncounted, while `PERMISSION_DENIED` was counted). They
/// are logged sparingly: one line, then how many were left out, at most every ten
/// seconds (anyone who reaches the port could write a line per call).
#[tokio::test]
async fn calls_refused_for_their_credentials_are_counted_not_logged_one_by_one() {
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let auth = dir.path().join("auth.toml");
    std::fs::write(
        &auth,
        "[[identity]]\nname = \"app\"\ntokens = [\"app-token\"]\nprefixes = [\"\"]\n",
    )
    .unwrap();
    let args = ["--redis-url", &redis.url(), "--auth-file", auth.to_str().unwrap()].map(str::to_owned);
    let server = LatchkeyProcess::spawn(&args);
    let port = server.metrics_port().expect("metrics enabled");
    let client = latchkey_client::Client::connect(&server.endpoint()).await.unwrap();
    let err = client.describe("x").await.expect_err("no token");
    assert_eq!(err.code(), tonic::Code::Unauthenticated);
    let err = client.lock("x").try_once().acquire().await.expect_err("no token");
    assert_eq!(err.code(), tonic::Code::Unauthenticated);
    let counts = rpc_counts(port);
    for method in ["Describe", "Acquire"] {
        let (started, handled) = counts.get(method).cloned().unwrap_or_default();
        assert_eq!(started, 1.0, "{method}: {counts:?}");
        assert_eq!(handled, [("Unauthenticated".to_owned(), 1.0)], "{method}: {counts:?}");
    }
    for _ in 0..200 {
        let err = client.describe("x").await.expect_err("no token");
        assert_eq!(err.code(), tonic::Code::Unauthenticated);
    }
    let counts = rpc_counts(port);
    assert_eq!(
        counts["Describe"].1,
        [("Unauthenticated".to_owned(), 201.0)],
        "{counts:?}"
    );
    let lines = server.log().matches("unauthenticated call refused").count();
    assert!((1..=2).contains(&lines), "{lines} lines for 202 refusals");
}

/// A RedLock node that stops answering shows in the metrics: each call to it that its
/// per-node limit cuts off is a failed call of its script. They were dropped before
/// they were counted, and a frozen node showed nowhere while the deployment rode on
/// its last majority.
// Two threads: the proxy answers while the server starts (its start waits for it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_redlock_node_counts_as_failed_calls() {
    let (redis, nodes) = (RedisServer::start(), [(); 3].map(|_| RedisServer::start()));
    let frozen = latchkey_tests::proxy::Proxy::to_redis(&nodes[2]).await;
    let urls = [nodes[0].url(), nodes[1].url(), frozen.redis_url()];
    // A long Redis timeout: the frozen node's connection is not given up for
    // unresponsive (and the node left out of the majority) while the test runs.
    let mut args = vec![
        "--redis-url".to_owned(),
        redis.url(),
        "--redis-timeout".to_owned(),
        "30s".to_owned(),
        "--redlock-restart-delay".to_owned(),
        "0s".to_owned(),
    ];
    for url in urls {
        args.extend(["--redlock-url".to_owned(), url]);
    }
    let server = LatchkeyProcess::spawn(&args);
    let port = server.metrics_port().expect("metrics enabled");
    let client = server.serving_client().await;
    let cycle = |name: &'static str| {
        let client = client.clone();
        async move {
            let lease = client
                .lock(name)
                .redlock(true)
                .acquire()
                .await
                .expect("a majority grants");
            lease.release().await.expect("released");
        }
    };
    cycle("frozen/warm").await;
    let errors = || {
        let scrape = scrape_metrics(port);
        ["mutex_acquire", "fence_raise", "release"]
            .map(|s| metric(&scrape, &format!("latchkey_redis_errors_total{{script=\"{s}\"}}")).unwrap_or(0.0))
    };
    assert_eq!(errors(), [0.0; 3], "every node answers");
    frozen.freeze();
    for name in ["frozen/a", "frozen/b"] {
        cycle(name).await;
    }
    let [tries, raises, _] = errors();
    assert!(tries >= 2.0 && raises >= 2.0, "the frozen node's calls: {:?}", errors());
    frozen.thaw();
}

/// The handoff histogram times grants that followed an unlock message. A waiter woken
/// by one whose try found the lock still held, then granted when the holder's lease
/// ran out (its recheck), was counted as a handoff as long as that lease.
#[tokio::test]
async fn a_grant_at_the_holders_expiry_after_a_vain_wake_is_no_handoff() {
    let redis = RedisServer::start();
    let server = LatchkeyProcess::start(&redis.url());
    let client = server.serving_client().await;
    let name = "vain-wake";
    let channel = format!("redisson_lock__channel:{{{name}}}");
    // A Redisson client's hold, for 1.5 s.
    redis.cli(&["HSET", name, "java:1", "1"]);
    redis.cli(&["PEXPIRE", name, "1500"]);
    let waiter = tokio::spawn(async move { client.lock(name).wait(Duration::from_secs(10)).acquire().await });
    let limit = Duration::from_secs(10);
    let subscribed = poll_until(limit, || redis.subscribers(&channel) == 1).await;
    assert!(subscribed, "the waiter listens");
    redis.cli(&["PUBLISH", &channel, "0"]);
    let lease = latchkey_tests::bounded(limit, "the waiter", waiter)
        .await
        .unwrap()
        .expect("granted once the hold ran out");
    let scrape = scrape_metrics(server.metrics_port().expect("metrics on"));
    let handoffs = metric(&scrape, "latchkey_handoff_seconds_count").unwrap_or(0.0);
    assert_eq!(handoffs, 0.0, "no grant followed an unlock message");
    lease.release().await.unwrap();
}

/// A unary call the client gives up on (its deadline, a cancel) is dropped before its
/// handler returns: it was counted started and never handled. It counts `Cancelled`
/// now. A ForceRelease given up on after its script was written breaks the lock all the
/// same, and is logged with who broke it, as any break is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_unary_call_given_up_is_counted_and_a_force_release_given_up_is_logged() {
    use latchkey_client::LostReason;
    use latchkey_tests::proxy::Proxy;
    let redis = RedisServer::start();
    let proxy = Proxy::to_redis(&redis).await;
    let server = LatchkeyProcess::start(&proxy.redis_url());
    let port = server.metrics_port().expect("metrics enabled");
    let client = server.serving_client().await;
    let lease = client.lock("audited").acquire().await.unwrap();
    let slow = Duration::from_secs(1);
    proxy.hold_back_matching(Some((b"slow-describe", slow)));
    let given_up = tokio::time::timeout(Duration::from_millis(300), client.describe("slow-describe")).await;
    assert!(given_up.is_err(), "the describe was slowed: {given_up:?}");
    proxy.hold_back_matching(Some((b"audited", slow)));
    let given_up = tokio::time::timeout(Duration::from_millis(300), client.force_release("audited")).await;
    assert!(given_up.is_err(), "the force release was slowed: {given_up:?}");
    proxy.hold_back_matching(None);
    let reason = tokio::time::timeout(Duration::from_secs(5), lease.lost()).await;
    assert_eq!(reason.ok(), Some(LostReason::ForceReleased), "the break happened");
    let counted = poll_until(Duration::from_secs(5), || {
        let counts = rpc_counts(port);
        ["Describe", "ForceRelease"].iter().all(|m| {
            counts.get(*m).is_some_and(|(started, handled)| {
                *started == 1.0 && handled.iter().any(|(code, n)| code == "Cancelled" && *n == 1.0)
            })
        })
    })
    .await;
    assert!(counted, "{:#?}", rpc_counts(port));
    let logged = poll_until(Duration::from_secs(5), || server.log().contains("lock force-released")).await;
    assert!(logged, "{}", server.log_tail());
}

/// A ForceRelease under way when the server is told to stop runs to its end before the
/// Redis connections close: it is answered, and its break is logged with who broke it.
/// Its task was left out of those shutdown waits for, so the connections' close could
/// cut it, its caller answered with a transport error, a break perhaps made unlogged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_force_release_under_way_at_shutdown_is_answered_and_logged() {
    use latchkey_tests::proxy::Proxy;
    let redis = RedisServer::start();
    let proxy = Proxy::to_redis(&redis).await;
    let mut server = LatchkeyProcess::spawn(&[
        "--redis-url".to_owned(),
        proxy.redis_url(),
        "--redis-timeout".to_owned(),
        "8s".to_owned(),
    ]);
    let client = server.serving_client().await;
    // A Java holder: no stream of this server to drain first.
    redis.cli(&["HSET", "audited-at-stop", "java:1", "1"]);
    redis.cli(&["PEXPIRE", "audited-at-stop", "60000"]);
    proxy.hold_back_matching(Some((b"audited-at-stop", Duration::from_millis(5_000))));
    let call = tokio::spawn(async move { client.force_release("audited-at-stop").await });
    assert!(
        poll_until(Duration::from_secs(5), || proxy.holding() >= 1).await,
        "the script is on its way"
    );
    server.terminate();
    let answer = latchkey_tests::bounded(Duration::from_secs(15), "the force release", call)
        .await
        .unwrap();
    assert_eq!(
        answer.as_ref().ok(),
        Some(&true),
        "answered: the lock was broken: {answer:?}"
    );
    assert_eq!(redis.cli(&["EXISTS", "audited-at-stop"]).trim(), "0");
    assert!(server.wait_exit(Duration::from_secs(15)).is_some(), "the server stops");
    assert!(server.log().contains("lock force-released"), "{}", server.log_tail());
}

/// `latchkey_serving` is one process-wide gauge, while readiness is each server's: with
/// two servers in one process (the harness's in-process servers, an embedder), each
/// scrape reads the gauge of the listener's own server. The server that stopped set it
/// to 0 while the other, whose `/ready` still answered 200 SERVING, served on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_serving_gauge_follows_its_own_servers_readiness() {
    let redis = RedisServer::start();
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let argv = [
        "--listen",
        "127.0.0.1:0",
        "--metrics-listen",
        &listen,
        "--redis-url",
        &redis.url(),
    ];
    let config = Config::from_args(argv).expect("flags parse");
    let with_metrics = latchkey_server::Server::start(config).await.expect("server starts");
    let told = move || {
        let ready = http_get(port, "/ready");
        let gauge = metric(&scrape_metrics(port), "latchkey_serving");
        (ready.lines().next().unwrap_or("").to_owned(), gauge)
    };
    let serving = ("HTTP/1.1 200 OK".to_owned(), Some(1.0));
    assert!(
        poll_until(Duration::from_secs(10), || told() == serving).await,
        "{:?}",
        told()
    );
    let other = Latchkey::start(&redis.url()).await;
    other.stop().await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = told();
    with_metrics.stop().await.expect("graceful stop");
    assert_eq!(after, serving, "/ready and the gauge of the server still serving");
}
