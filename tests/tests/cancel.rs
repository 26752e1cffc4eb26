//! Giving up at any moment of an acquire never leaves a hold behind: the name is
//! either held by the stream that was told `acquired`, or free within a round trip.
//! Thousands of runs race a cancel against the grant, the holder's release and the
//! queueing, some over a Redis link slowed by a proxy. And a script whose reply timed
//! out never counts a hold twice.

use latchkey_client::{Client, Lease};
use latchkey_tests::checker::{leftovers, LockRedis};
use latchkey_tests::proxy::Proxy;
use latchkey_tests::server::{cycle, Latchkey};
use latchkey_tests::RedisServer;
use std::time::{Duration, Instant};
use tonic::Code;

/// Runs over a direct Redis link, then over a slowed one.
const RUNS: usize = 1500;
const SLOW_RUNS: usize = 500;
/// Names the runs spread over.
const NAMES: usize = 8;
/// How long a cancelled acquire may leave its name taken.
const FREE_WITHIN: Duration = Duration::from_secs(3);

/// What the runs saw.
#[derive(Debug, Default)]
struct Tally {
    granted: usize,
    cancelled: usize,
    /// Cancelled, yet the name was still taken at the first look: the grant raced the
    /// cancel and the server released it afterwards.
    freed_after: usize,
    slowest_free: Duration,
}

/// One run: maybe a holder, an acquire cancelled after a random moment, the holder's
/// release at another random moment; then the name is held by the granted stream or
/// free soon. The moments are drawn from `window` (µs).
async fn run_once(client: &Client, name: &str, window: u64, tally: &mut Tally) {
    let holder = if fastrand::bool() {
        Some(client.lock(name).acquire().await.expect("the holder acquires"))
    } else {
        None
    };
    let release_after = Duration::from_micros(fastrand::u64(0..window));
    let releasing = tokio::spawn(async move {
        tokio::time::sleep(release_after).await;
        if let Some(h) = holder {
            h.release().await.expect("the holder releases");
        }
    });
    let give_up = Duration::from_micros(fastrand::u64(0..window));
    let outcome = tokio::time::timeout(give_up, client.lock(name).acquire()).await;
    releasing.await.expect("release task");
    match outcome {
        Ok(Ok(lease)) => {
            tally.granted += 1;
            check_held_by(client, name, &lease).await;
            lease.release().await.expect("release");
        }
        Ok(Err(e)) => panic!("acquire failed: {e}"),
        Err(_) => {
            tally.cancelled += 1;
            let (waited, was_taken) = wait_free(client, name).await;
            tally.freed_after += usize::from(was_taken);
            tally.slowest_free = tally.slowest_free.max(waited);
        }
    }
}

async fn check_held_by(client: &Client, name: &str, lease: &Lease) {
    let state = client.describe(name).await.expect("describe");
    let owners: Vec<&str> = state.holders.iter().map(|h| h.owner.as_str()).collect();
    assert_eq!(owners, [lease.owner()], "{name} is held by the granted stream only");
}

/// Polls until `name` is free; returns how long it took and whether it was taken at
/// the first look. Panics past [`FREE_WITHIN`].
async fn wait_free(client: &Client, name: &str) -> (Duration, bool) {
    let started = Instant::now();
    let mut first = true;
    let mut was_taken = false;
    loop {
        let state = client.describe(name).await.expect("describe");
        if !state.locked && state.waiters.is_empty() {
            return (started.elapsed(), was_taken);
        }
        was_taken |= first;
        first = false;
        assert!(
            started.elapsed() < FREE_WITHIN,
            "{name} still taken after a cancel: {state:?}"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// The window (µs) a run draws its moments from: twice an uncontended acquire's median
/// here and now, at least 4 ms, so that a loaded machine's slower round trips still see
/// both outcomes.
async fn moments(client: &Client) -> u64 {
    let mut took = Vec::new();
    for _ in 0..21 {
        let asked = Instant::now();
        let lease = client.lock("cancel/timing").acquire().await.expect("acquires");
        took.push(asked.elapsed());
        lease.release().await.expect("releases");
    }
    took.sort();
    let median = u64::try_from(took[took.len() / 2].as_micros()).unwrap_or(u64::MAX);
    median.saturating_mul(2).max(4_000)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_at_any_moment_leaves_no_hold() {
    let redis = RedisServer::start();
    let proxy = Proxy::to_redis(&redis).await;
    let server = Latchkey::start_with(&proxy.redis_url(), &["--watchdog-timeout", "30s"]).await;
    let client = server.client().await;
    let mut tally = Tally::default();
    let mut window = moments(&client).await;
    for i in 0..RUNS + SLOW_RUNS {
        if i == RUNS {
            proxy.set_delay(Duration::from_millis(1));
            window = moments(&client).await;
        }
        run_once(&client, &format!("cancel/{}", i % NAMES), window, &mut tally).await;
    }
    println!("{tally:?}");
    assert!(
        tally.granted > 100 && tally.cancelled > 100,
        "both outcomes happen: {tally:?}"
    );
    assert!(tally.freed_after > 0, "some cancels raced a grant: {tally:?}");
    let redis = LockRedis::Standalone(redis);
    let left = leftovers::wait_clean(&redis, Duration::from_secs(5)).await;
    assert!(left.is_empty(), "{left:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_that_timed_out_never_counts_a_hold_twice() {
    let redis = RedisServer::start();
    let proxy = Proxy::to_redis(&redis).await;
    let server = Latchkey::start_with(&proxy.redis_url(), &["--redis-timeout", "200ms"]).await;
    let client = server.client().await;
    let first = client.lock("twice").owner("o").acquire().await.expect("first hold");
    assert_eq!(first.hold_count(), 1);
    // Every reply now arrives after the server gave up on it; the scripts still run.
    proxy.set_delay(Duration::from_millis(300));
    for _ in 0..3 {
        let err = client.lock("twice").owner("o").acquire().await.unwrap_err();
        assert_eq!(err.code(), Code::Unavailable, "{err}");
    }
    proxy.set_delay(Duration::ZERO);
    // The late grants were given back: the owner holds once, and the next hold is its
    // second. (A connection the timeouts closed may still be reconnecting: a describe
    // on it answers UNAVAILABLE meanwhile.)
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let state = client.describe("twice").await;
        let counts: Option<Vec<u32>> = state
            .as_ref()
            .ok()
            .map(|s| s.holders.iter().map(|h| h.hold_count).collect());
        if counts.as_deref() == Some(&[1]) {
            break;
        }
        assert!(Instant::now() < deadline, "holds left: {state:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let second = client.lock("twice").owner("o").acquire().await.expect("second hold");
    assert_eq!(second.hold_count(), 2);
    second.release().await.expect("release");
    first.release().await.expect("release");
    assert!(!client.describe("twice").await.expect("describe").locked);
}

/// An acquire given up while its try waits in Redis: the try grants once its stream is
/// gone, and the server gives that grant back. When that give-back fails (the server's
/// Redis user may not run `GETDEL` for a moment), it is tried again, as every other
/// give-back is: the lock is free soon after, not held by nobody for a whole lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_give_back_of_a_try_whose_stream_went_that_fails_is_tried_again() {
    use latchkey_tests::{metric, poll_until, scrape_metrics};
    let (redis, server) = server_as_b("3s", &["--watchdog-timeout", "60s"]);
    let client = server.serving_client().await;
    let metrics = server.metrics_port().expect("metrics enabled");
    let open = || metric(&scrape_metrics(metrics), "latchkey_streams_open").unwrap_or(0.0);
    // The try's script waits in Redis (the health check's own script, an `EVAL`, may
    // wait beside it: a count of blocked clients could read 2 for good); or, sent on a
    // connection whose health check's script waits, behind it, in that client's query
    // buffer (the health check pings every connection of the pool, which tries share).
    let blocked = || {
        let clients = redis.cli(&["CLIENT", "LIST"]);
        clients.lines().any(|l| {
            let queued_behind = l.contains(" cmd=eval ") && !l.contains(" qbuf=0 ");
            l.contains(" flags=b ") && (l.contains(" cmd=evalsha ") || queued_behind)
        })
    };
    // The try waits in Redis: writes are paused.
    redis.cli(&["CLIENT", "PAUSE", "20000", "WRITE"]);
    let acquiring = {
        let client = client.clone();
        tokio::spawn(async move { client.lock("given-up").acquire().await })
    };
    assert!(poll_until(T, blocked).await, "the try waits in Redis");
    redis.cli(&["ACL", "SETUSER", "b", "-getdel"]);
    acquiring.abort();
    assert!(poll_until(T, || open() == 0.0).await, "the stream is gone");
    // The try grants; its give-back is refused once, then allowed.
    redis.cli(&["CLIENT", "UNPAUSE"]);
    let refused = poll_until(T, || redis.cli(&["ACL", "LOG"]).contains("getdel")).await;
    assert!(refused, "the first give-back was refused");
    redis.cli(&["ACL", "SETUSER", "b", "+getdel"]);
    let (waited, _) = wait_free_within(&client, "given-up", T).await;
    println!("free {waited:?} after the give-back was allowed");
}

/// Give-backs Redis keeps refusing (the server's user may not run `GETDEL` for a while)
/// are retried less and less often by one task, not each by a task of its own calling
/// Redis every Redis timeout for a lease (twenty refused give-backs made some 200 calls
/// in two seconds). Once Redis takes them, every one goes; and one refused while the
/// server stops is still made once Redis takes it, within the shutdown's drain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn give_backs_redis_refuses_are_retried_together() {
    use latchkey_tests::poll_until;
    let (redis, mut server) = server_as_b("200ms", &[]);
    let client = server.serving_client().await;
    let metrics = server.metrics_port().expect("metrics enabled");
    let refused = || refused_releases(metrics);
    let names: Vec<String> = (0..20).map(|i| format!("refused-{i}")).collect();
    let mut leases = Vec::new();
    for name in &names {
        leases.push(client.lock(name).acquire().await.expect("granted"));
    }
    redis.cli(&["ACL", "SETUSER", "b", "-getdel"]);
    drop(leases);
    assert!(
        poll_until(T, || refused() >= 20.0).await,
        "every give-back was refused once"
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before = refused();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let calls = refused() - before;
    assert!(
        calls <= 60.0,
        "{calls} refused give-backs in 2 s (a Redis timeout of 200 ms)"
    );
    redis.cli(&["ACL", "SETUSER", "b", "+getdel"]);
    for name in &names {
        wait_free_within(&client, name, T).await;
    }
    // Refused as the server stops, allowed half a second later: made all the same.
    let lease = client.lock("at-shutdown").acquire().await.expect("granted");
    redis.cli(&["ACL", "SETUSER", "b", "-getdel"]);
    let before = refused();
    drop(lease);
    assert!(poll_until(T, || refused() > before).await, "the give-back was refused");
    server.terminate();
    tokio::time::sleep(Duration::from_millis(500)).await;
    redis.cli(&["ACL", "SETUSER", "b", "+getdel"]);
    let stopped = server.wait_exit(T);
    assert!(
        stopped.is_some_and(|s| s.success()),
        "stopped within the drain: {stopped:?}"
    );
    assert_eq!(
        redis.cli(&["EXISTS", "at-shutdown"]).trim(),
        "0",
        "given back before the exit"
    );
}

/// A give-back refused just before the server stops is made again at once when it
/// stops, and often through the drain: the rounds came a Redis timeout apart (here
/// 12 s, past the 10 s drain), so the server exited with the lock still held, to run
/// out on its lease, although Redis took the call half a second after the stop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_give_back_refused_at_shutdown_is_made_within_the_drain_whatever_the_redis_timeout() {
    use latchkey_tests::poll_until;
    let (redis, mut server) = server_as_b("12s", &[]);
    let client = server.serving_client().await;
    let metrics = server.metrics_port().expect("metrics enabled");
    let lease = client.lock("slow-round").acquire().await.expect("granted");
    redis.cli(&["ACL", "SETUSER", "b", "-getdel"]);
    let before = refused_releases(metrics);
    drop(lease);
    assert!(
        poll_until(T, || refused_releases(metrics) > before).await,
        "the give-back was refused"
    );
    let asked = Instant::now();
    server.terminate();
    tokio::time::sleep(Duration::from_millis(500)).await;
    redis.cli(&["ACL", "SETUSER", "b", "+getdel"]);
    let stopped = server.wait_exit(Duration::from_secs(20));
    let took = asked.elapsed();
    assert!(stopped.is_some_and(|s| s.success()), "stopped: {stopped:?}");
    assert_eq!(
        redis.cli(&["EXISTS", "slow-round"]).trim(),
        "0",
        "given back before the exit ({took:?} after the stop)\n{}",
        server.log_tail()
    );
    assert!(
        took < Duration::from_secs(5),
        "the drain did not wait for a round: {took:?}"
    );
}

/// Give-backs Redis refuses for good (an ACL that keeps latchkey's user from some
/// names' keys) hold back no other: a release that failed for a moment on a name the
/// ACL allows goes at the next round, however many refused ones wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_give_backs_hold_no_other_back() {
    use latchkey_tests::{poll_until, LatchkeyProcess};
    let acl = [
        "--user",
        "u",
        "on",
        ">pw",
        "~*ok-*",
        "~*probe*",
        "~*latchkey-health*",
        "&*",
        "+@all",
    ];
    let redis = RedisServer::start_with(&acl);
    let url = format!("redis://u:pw@127.0.0.1:{}", redis.port());
    let args = ["--redis-url", &url, "--redis-timeout", "200ms"];
    let server = LatchkeyProcess::spawn(&args.map(str::to_owned));
    let client = server.serving_client().await;
    let metrics = server.metrics_port().expect("metrics enabled");
    let refused = || refused_releases(metrics);
    for i in 0..30 {
        let err = client.lock(format!("bad-{i}")).try_once().acquire().await.unwrap_err();
        assert_eq!(err.code(), Code::FailedPrecondition, "{err}");
    }
    let lease = client.lock("ok-1").acquire().await.expect("granted");
    redis.cli(&["ACL", "SETUSER", "u", "-getdel"]);
    let before = refused();
    drop(lease);
    assert!(poll_until(T, || refused() > before).await, "the give-back was refused");
    redis.cli(&["ACL", "SETUSER", "u", "+getdel"]);
    let (waited, _) = wait_free_within(&client, "ok-1", Duration::from_secs(3)).await;
    println!("ok-1 free {waited:?} after the give-back was allowed");
}

/// A Redis with the user `b`, who may do everything (until a test takes a command
/// away), and a server that reaches it as `b` with `--redis-timeout timeout` and
/// `extra` flags.
fn server_as_b(timeout: &str, extra: &[&str]) -> (RedisServer, latchkey_tests::LatchkeyProcess) {
    let redis = RedisServer::start_with(&["--user", "b", "on", ">b-secret", "~*", "&*", "+@all"]);
    let url = format!("redis://b:b-secret@127.0.0.1:{}", redis.port());
    let mut args = vec![
        "--redis-url".to_owned(),
        url,
        "--redis-timeout".to_owned(),
        timeout.to_owned(),
    ];
    args.extend(extra.iter().map(|a| a.to_string()));
    let server = latchkey_tests::LatchkeyProcess::spawn(&args);
    (redis, server)
}

/// Releases Redis failed or refused so far, by the server's metrics on `port`.
fn refused_releases(port: u16) -> f64 {
    use latchkey_tests::{metric, scrape_metrics};
    metric(&scrape_metrics(port), "latchkey_redis_errors_total{script=\"release\"}").unwrap_or(0.0)
}

/// How long to wait for an event of a test.
const T: Duration = Duration::from_secs(10);

/// Polls until `name` is free, for at most `limit`; as [`wait_free`].
async fn wait_free_within(client: &Client, name: &str, limit: Duration) -> (Duration, bool) {
    let started = Instant::now();
    loop {
        let state = client.describe(name).await.expect("describe");
        if !state.locked && state.waiters.is_empty() {
            return (started.elapsed(), false);
        }
        assert!(started.elapsed() < limit, "{name} still taken: {state:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A try held up on its way to Redis long past its stream's end (written to a
/// connection the server then gave up: the kernel goes on sending what was written
/// for a minute or two, and a partition that heals delivers it) grants nothing when
/// it comes: the stream's revoking give-back left a revoked record that outlives it.
/// The record lived a minute, and a try 65 s late took the lock for its whole fixed
/// lease (an hour here), held by nobody.
#[tokio::test]
async fn a_try_that_reaches_redis_long_after_its_stream_ended_grants_nothing() {
    let redis = RedisServer::start();
    let proxy = Proxy::to_redis(&redis).await;
    let server = Latchkey::start_with(&proxy.redis_url(), &["--redis-timeout", "1s"]).await;
    let client = server.client().await;
    let try_once = client.lock("late/try").lease(Duration::from_secs(3600)).try_once();
    // Only the try is held up: the give-back goes on time.
    let late = Duration::from_secs(65);
    late_try_takes_nothing(&redis, &proxy, &client, ("late/try", try_once), late, async {}).await;
}

/// A revoking give-back that Redis refuses for longer than the stream's lease is made
/// again for as long as a try of the stream may still come: it stopped after the
/// lease, its revoked record never written, and a try held up on its way took the lock
/// for a whole lease, held by nobody.
#[tokio::test]
async fn a_revoking_give_back_refused_past_the_lease_still_stands_against_a_late_try() {
    let redis = RedisServer::start();
    let proxy = Proxy::to_redis(&redis).await;
    let flags = ["--redis-timeout", "1s", "--watchdog-timeout", "3s"];
    let server = Latchkey::start_with(&proxy.redis_url(), &flags).await;
    let client = server.client().await;
    // Redis refuses the server's every write (keys read-only to its user), the
    // give-back's among them, for longer than the lease.
    let refusing = async {
        redis.cli(&["ACL", "SETUSER", "default", "resetkeys", "%R~*"]);
        tokio::time::sleep(Duration::from_secs(5)).await;
        redis.cli(&["ACL", "SETUSER", "default", "resetkeys", "~*"]);
    };
    let try_once = client.lock("late/lease").try_once();
    // Refused, the give-back is tried again after 1, 2, 4 Redis timeouts: the try due
    // about 8 s in finds the keys writable, well before the held-up try comes.
    let late = Duration::from_secs(24);
    late_try_takes_nothing(&redis, &proxy, &client, ("late/lease", try_once), late, refusing).await;
}

/// Sends `try_once` of lock `name`, which the proxy holds up on its way to Redis for
/// `late` (its reply times out), runs `meanwhile` as soon as it left, and checks that
/// the try, reaching Redis at last, took nothing.
async fn late_try_takes_nothing(
    redis: &RedisServer,
    proxy: &Proxy,
    client: &Client,
    (name, try_once): (&str, latchkey_client::LockBuilder),
    late: Duration,
    meanwhile: impl std::future::Future<Output = ()>,
) {
    // Warm up: scripts loaded, connections made.
    for _ in 0..8 {
        cycle(client, "late/warm").await;
    }
    proxy.hold_back_matching(Some((name.as_bytes(), late)));
    let sent = Instant::now();
    let call = tokio::spawn(try_once.acquire());
    assert!(
        latchkey_tests::poll_until(Duration::from_secs(3), || proxy.holding() > 0).await,
        "the try never left"
    );
    proxy.hold_back_matching(None);
    meanwhile.await;
    let err = call.await.unwrap().expect_err("the try's reply timed out");
    assert_eq!(err.code(), Code::Unavailable, "{err}");
    let arrived = latchkey_tests::poll_until(late + Duration::from_secs(10), || proxy.holding() == 0).await;
    assert!(arrived && sent.elapsed() >= late, "the try reached Redis late");
    // A moment for Redis to run it.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        redis.cli(&["EXISTS", name]).trim(),
        "0",
        "the late try took the lock: {}",
        redis.cli(&["HGETALL", name])
    );
}
