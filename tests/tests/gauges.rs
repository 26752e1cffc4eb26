//! The gauges and the stream and waiter bounds after every way a stream ends: every
//! gauge goes back to its baseline, and every bound gives its places back, on paths
//! the tests in metrics.rs do not take (fair, read/write and semaphore waits, hot
//! locks passed in memory, multi-locks, ForceRelease, RedLock failures, claims across
//! servers, a Redis restart, waiters that leave during their try).

use latchkey_client::LockKind;
use latchkey_tests::{gauges, metric, scrape_metrics, LatchkeyProcess, RedisServer};
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(10);

/// A Redis and a server on it with metrics on: the server, its metrics port and a
/// client.
async fn started() -> (RedisServer, LatchkeyProcess, u16, latchkey_client::Client) {
    let redis = RedisServer::start();
    let server = LatchkeyProcess::start(&redis.url());
    let port = server.metrics_port().unwrap();
    let client = server.serving_client().await;
    (redis, server, port, client)
}

async fn back_to_zero(port: u16, what: &str) {
    let idle = latchkey_tests::poll_until(LIMIT, || gauges(port) == [0.0; 4]).await;
    assert!(
        idle,
        "{what}: (streams, leases, waiters, subscriptions) = {:?}",
        gauges(port)
    );
}

async fn until_waiters(port: u16, n: f64) {
    let ok = latchkey_tests::poll_until(LIMIT, || gauges(port)[2] == n).await;
    assert!(ok, "waiters should reach {n}: {:?}", gauges(port));
}

/// Fair, read/write and semaphore waiters that time out, are cancelled or are granted.
#[tokio::test]
async fn fair_rw_and_semaphore_waits_give_every_gauge_back() {
    let (_redis, _server, port, client) = started().await;
    back_to_zero(port, "after the probe").await;
    for kind in [LockKind::Fair, LockKind::Write, LockKind::Semaphore] {
        let name = format!("k/{kind:?}");
        let lock = |c: &latchkey_client::Client| {
            let l = c.lock(name.clone()).kind(kind);
            if kind == LockKind::Semaphore {
                l.limit(1)
            } else {
                l
            }
        };
        let held = lock(&client).acquire().await.unwrap();
        let timed_out = lock(&client).wait(Duration::from_millis(300)).acquire().await;
        assert!(timed_out.unwrap_err().is_timeout());
        let cancelled = tokio::spawn(lock(&client).acquire());
        let granted = tokio::spawn(lock(&client).wait(LIMIT).acquire());
        let readers: Vec<_> = (0..2)
            .filter(|_| kind == LockKind::Write)
            .map(|_| tokio::spawn(client.lock(name.clone()).kind(LockKind::Read).wait(LIMIT).acquire()))
            .collect();
        until_waiters(port, 2.0 + readers.len() as f64).await;
        cancelled.abort();
        until_waiters(port, 1.0 + readers.len() as f64).await;
        held.release().await.unwrap();
        // Readers may come before the writer: each is released as it is granted.
        let mut all = readers;
        all.push(granted);
        latchkey_tests::server::each_granted(all, LIMIT).await;
        back_to_zero(port, &format!("{kind:?}")).await;
    }
}

/// A hot mutex: the lock passed from waiter to waiter, in memory and by handoffs.
#[tokio::test]
async fn a_hot_mutex_gives_every_gauge_back() {
    let (_redis, _server, port, client) = started().await;
    for kind in [LockKind::Mutex, LockKind::Fair] {
        let name = format!("hot/{kind:?}");
        let held = client.lock(name.clone()).kind(kind).acquire().await.unwrap();
        let waiters: Vec<_> = (0..12)
            .map(|_| tokio::spawn(client.lock(name.clone()).kind(kind).wait(LIMIT).acquire()))
            .collect();
        until_waiters(port, 12.0).await;
        held.release().await.unwrap();
        latchkey_tests::server::each_granted(waiters, LIMIT).await;
        back_to_zero(port, &format!("hot {kind:?}")).await;
    }
}

/// A multi-lock waiting on one name then another, cancelled; one force-released.
#[tokio::test]
async fn multi_locks_and_force_release_give_every_gauge_back() {
    let (_redis, _server, port, client) = started().await;
    let a = client.lock("m/a").acquire().await.unwrap();
    let b = client.lock("m/b").acquire().await.unwrap();
    let multi = tokio::spawn(client.lock_all(["m/a", "m/b"]).wait(LIMIT).acquire());
    until_waiters(port, 1.0).await;
    a.release().await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    multi.abort();
    b.release().await.unwrap();
    back_to_zero(port, "multi-lock cancelled").await;

    let held = client.lock_all(["m/c", "m/d"]).acquire().await.unwrap();
    let waiter = tokio::spawn(client.lock("m/c").wait(LIMIT).acquire());
    until_waiters(port, 1.0).await;
    assert!(client.force_release("m/d").await.unwrap());
    tokio::time::timeout(LIMIT, held.lost()).await.unwrap();
    drop(held);
    let lease = tokio::time::timeout(LIMIT, waiter).await.unwrap().unwrap().unwrap();
    lease.release().await.unwrap();
    back_to_zero(port, "multi-lock force-released").await;
}

/// RedLock: a waiter that is granted, one cancelled, and a grant no majority can make.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_waits_and_failures_give_every_gauge_back() {
    let (redis, nodes) = (RedisServer::start(), [(); 3].map(|_| RedisServer::start()));
    let proxies = [
        latchkey_tests::proxy::Proxy::to_redis(&nodes[1]).await,
        latchkey_tests::proxy::Proxy::to_redis(&nodes[2]).await,
    ];
    let mut args = vec![
        "--redis-url".to_owned(),
        redis.url(),
        "--redlock-restart-delay".to_owned(),
        "0s".to_owned(),
        "--redlock-url".to_owned(),
        nodes[0].url(),
    ];
    for p in &proxies {
        args.extend(["--redlock-url".to_owned(), p.redis_url()]);
    }
    let server = LatchkeyProcess::spawn(&args);
    let port = server.metrics_port().unwrap();
    let client = server.serving_client().await;
    let held = client.lock("r/a").redlock(true).acquire().await.unwrap();
    let granted = tokio::spawn(client.lock("r/a").redlock(true).wait(LIMIT).acquire());
    let cancelled = tokio::spawn(client.lock("r/a").redlock(true).acquire());
    until_waiters(port, 2.0).await;
    cancelled.abort();
    held.release().await.unwrap();
    let lease = tokio::time::timeout(LIMIT, granted).await.unwrap().unwrap().unwrap();
    lease.release().await.unwrap();
    back_to_zero(port, "redlock waits").await;
    for p in &proxies {
        p.freeze();
    }
    let failed = client
        .lock("r/b")
        .redlock(true)
        .wait(Duration::from_secs(2))
        .acquire()
        .await;
    assert!(failed.is_err(), "no majority");
    for p in &proxies {
        p.thaw();
    }
    back_to_zero(port, "redlock failure").await;
}

/// Streams and waiters refused, cancelled, timed out: the bounds take new ones after.
#[tokio::test]
async fn bounds_give_their_places_back() {
    let redis = RedisServer::start();
    let args = [
        "--redis-url",
        &redis.url(),
        "--max-waiters",
        "2",
        "--max-waiters-per-lock",
        "2",
        "--max-streams-per-connection",
        "4",
        "--max-streams",
        "6",
    ]
    .map(str::to_owned);
    let server = LatchkeyProcess::spawn(&args);
    let port = server.metrics_port().unwrap();
    let client = server.serving_client().await;
    for round in 0..3 {
        let held = client.lock("b/x").acquire().await.unwrap();
        let w1 = tokio::spawn(client.lock("b/x").wait(LIMIT).acquire());
        let w2 = tokio::spawn(client.lock("b/x").wait(Duration::from_millis(500)).acquire());
        until_waiters(port, 2.0).await;
        let refused = client.lock("b/x").wait(LIMIT).acquire().await.unwrap_err();
        assert_eq!(
            refused.code(),
            tonic::Code::ResourceExhausted,
            "round {round}: {refused}"
        );
        let refused = client.lock("b/z").try_once().acquire().await;
        assert!(refused.is_ok(), "round {round}: a free lock: {refused:?}");
        refused.unwrap().release().await.unwrap();
        let mut watch = client.watch("b/x").await.unwrap();
        tokio::time::timeout(LIMIT, watch.next()).await.unwrap().unwrap();
        let over = client.lock("b/w").try_once().acquire().await.unwrap_err();
        assert_eq!(over.code(), tonic::Code::ResourceExhausted, "round {round}: {over}");
        drop(watch);
        w1.abort();
        assert!(tokio::time::timeout(LIMIT, w2).await.unwrap().unwrap().is_err());
        held.release().await.unwrap();
        back_to_zero(port, &format!("round {round}")).await;
    }
}

/// A client that leaves while its try is in flight (Redis slow to answer).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_left_during_its_try_gives_every_gauge_back() {
    let redis = RedisServer::start();
    let proxy = latchkey_tests::proxy::Proxy::to_redis(&redis).await;
    let server = LatchkeyProcess::start(&proxy.redis_url());
    let port = server.metrics_port().unwrap();
    let client = server.serving_client().await;
    for kind in [LockKind::Mutex, LockKind::Fair, LockKind::Semaphore] {
        let name = format!("slow/{kind:?}");
        let lock = || {
            let l = client.lock(name.clone()).kind(kind);
            if kind == LockKind::Semaphore {
                l.limit(1)
            } else {
                l
            }
        };
        let held = lock().acquire().await.unwrap();
        let waiter = tokio::spawn(lock().wait(LIMIT).acquire());
        until_waiters(port, 1.0).await;
        proxy.hold_back_matching(Some((name.as_bytes(), Duration::from_millis(800))));
        let release = tokio::spawn(held.release());
        tokio::time::sleep(Duration::from_millis(300)).await;
        waiter.abort();
        let _ = tokio::time::timeout(LIMIT, release).await;
        proxy.hold_back_matching(None);
        back_to_zero(port, &format!("slow {kind:?}")).await;
    }
}

/// Two servers on one Redis: claims granted across servers, waiters that leave while
/// a claim is granted to them, owners shared by streams, a fixed lease that runs out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_across_servers_give_every_gauge_back() {
    let redis = RedisServer::start();
    let (one, two) = (
        LatchkeyProcess::start(&redis.url()),
        LatchkeyProcess::start(&redis.url()),
    );
    let ports = [one.metrics_port().unwrap(), two.metrics_port().unwrap()];
    let (c1, c2) = (one.serving_client().await, two.serving_client().await);
    for round in 0..3 {
        let name = format!("x/{round}");
        let held = c1.lock(name.clone()).acquire().await.unwrap();
        let mut waiting = Vec::new();
        for c in [&c1, &c2, &c2, &c1, &c2] {
            waiting.push(tokio::spawn(c.lock(name.clone()).wait(LIMIT).acquire()));
        }
        let queued = latchkey_tests::poll_until(LIMIT, || gauges(ports[0])[2] + gauges(ports[1])[2] == 5.0).await;
        assert!(queued, "{:?} {:?}", gauges(ports[0]), gauges(ports[1]));
        // One leaves at once, another just as the lock goes round.
        waiting.remove(1).abort();
        held.release().await.unwrap();
        waiting.remove(1).abort();
        latchkey_tests::server::each_granted(waiting, LIMIT).await;
        for port in ports {
            back_to_zero(port, &format!("claims round {round}")).await;
        }
    }
    // A named owner's streams share the lock; a fixed lease runs out under waiters.
    let a = c1.lock("o").owner("svc").acquire().await.unwrap();
    let b = c2.lock("o").owner("svc").acquire().await.unwrap();
    let fixed = c1.lock("f").lease(Duration::from_millis(600)).acquire().await.unwrap();
    let behind = tokio::spawn(c2.lock("f").wait(LIMIT).acquire());
    let other = tokio::spawn(c2.lock("o").owner("other").wait(LIMIT).acquire());
    tokio::time::timeout(LIMIT, fixed.lost()).await.unwrap();
    drop(fixed);
    latchkey_tests::server::each_granted(vec![behind], LIMIT).await;
    a.release().await.unwrap();
    b.release().await.unwrap();
    latchkey_tests::server::each_granted(vec![other], LIMIT).await;
    for port in ports {
        back_to_zero(port, "owners and a fixed lease").await;
    }
}

/// Redis restarts under holders, waiters and a watch.
#[tokio::test]
async fn a_redis_restart_gives_every_gauge_back() {
    let mut redis = RedisServer::start();
    let server = LatchkeyProcess::start(&redis.url());
    let port = server.metrics_port().unwrap();
    let client = server.serving_client().await;
    let held = client.lock("rs/a").acquire().await.unwrap();
    let waiters: Vec<_> = (0..3)
        .map(|_| tokio::spawn(client.lock("rs/a").wait(Duration::from_secs(30)).acquire()))
        .collect();
    let mut watch = client.watch("rs/a").await.unwrap();
    tokio::time::timeout(LIMIT, watch.next()).await.unwrap().unwrap();
    until_waiters(port, 3.0).await;
    redis.restart();
    // The holder hears its lease is gone (or still holds it); the waiters get it in turn.
    let _ = tokio::time::timeout(Duration::from_secs(5), held.lost()).await;
    drop(held);
    // Each lease is released as soon as it is granted, whichever waiter comes first.
    let mut waiters = waiters;
    while !waiters.is_empty() {
        let next = futures::future::select_all(waiters);
        let (granted, _, rest) = tokio::time::timeout(Duration::from_secs(40), next).await.unwrap();
        match granted.unwrap() {
            Ok(lease) => drop(lease),
            Err(e) => eprintln!("waiter: {e}"),
        }
        waiters = rest;
    }
    drop(watch);
    let idle = latchkey_tests::poll_until(Duration::from_secs(20), || gauges(port) == [0.0; 4]).await;
    assert!(idle, "after a restart: {:?}", gauges(port));
}

/// A hot fair lock whose waiters line up in memory, some leaving mid-run: every
/// gauge and the waiter bound come back.
#[tokio::test]
async fn a_hot_fair_lock_left_mid_run_gives_everything_back() {
    let redis = RedisServer::start();
    let args = ["--redis-url", &redis.url(), "--max-waiters", "40"].map(str::to_owned);
    let server = LatchkeyProcess::spawn(&args);
    let port = server.metrics_port().unwrap();
    let client = server.serving_client().await;
    let lock = || client.lock("hotfair").kind(LockKind::Fair).wait(LIMIT);
    for round in 0..3 {
        let held = lock().acquire().await.unwrap();
        let mut waiters: Vec<_> = (0..10).map(|_| tokio::spawn(lock().acquire())).collect();
        tokio::time::sleep(Duration::from_millis(200)).await;
        held.release().await.unwrap();
        // Newcomers line up behind the run, and some leave at once.
        let mut late: Vec<_> = (0..20).map(|_| tokio::spawn(lock().acquire())).collect();
        for w in late.iter().step_by(2) {
            w.abort();
        }
        for w in waiters.iter().skip(5).step_by(2) {
            w.abort();
        }
        waiters.retain(|w| !w.is_finished());
        late.retain(|w| !w.is_finished());
        let mut all = Vec::new();
        for w in waiters.into_iter().chain(late) {
            all.push(tokio::spawn(async move {
                match w.await {
                    Ok(Ok(lease)) => {
                        let _ = lease.release().await;
                    }
                    Ok(Err(e)) => panic!("a waiter failed: {e}"),
                    Err(_) => {}
                }
            }));
        }
        for t in all {
            tokio::time::timeout(Duration::from_secs(30), t).await.unwrap().unwrap();
        }
        back_to_zero(port, &format!("hot fair round {round}")).await;
    }
    let scrape = scrape_metrics(port);
    eprintln!(
        "queued in memory: {:?}, passes: {:?}",
        metric(&scrape, "latchkey_fair_queued_in_memory_total"),
        metric(&scrape, "latchkey_passes_in_memory_total")
    );
    // The bound is whole again: 40 waiters at once.
    let held = lock().acquire().await.unwrap();
    let waiters: Vec<_> = (0..40).map(|_| tokio::spawn(lock().acquire())).collect();
    until_waiters(port, 40.0).await;
    held.release().await.unwrap();
    latchkey_tests::server::each_granted(waiters, LIMIT).await;
    back_to_zero(port, "hot fair after").await;
}

/// A lease told lost leaves `latchkey_leases_held` at once, though its client gives no
/// flow-control credit and its stream has not ended: it counted as held, and was not
/// renewed, until the connection closed.
#[tokio::test]
async fn a_lease_told_lost_leaves_the_held_gauge_while_its_stream_stays() {
    let (redis, server, port, client) = started().await;
    back_to_zero(port, "after the probe").await;
    let open = latchkey_proto::v1::Open {
        name: "g/unread".to_owned(),
        ..Default::default()
    };
    let (tx, response) = latchkey_tests::server::uncredited(&server.endpoint(), open, None).await;
    let held = latchkey_tests::poll_until(LIMIT, || gauges(port)[1] == 1.0).await;
    assert!(held, "granted: {:?}", gauges(port));
    assert_eq!(redis.cli(&["EXISTS", "g/unread"]).trim(), "1");
    assert!(client.force_release("g/unread").await.unwrap());
    let out = latchkey_tests::poll_until(LIMIT, || gauges(port)[1] == 0.0).await;
    assert!(out, "the lease told lost still counts as held: {:?}", gauges(port));
    assert_eq!(gauges(port)[0], 1.0, "its stream is still open");
    drop((tx, response));
    back_to_zero(port, "after the stream closed").await;
}
