//! Redis going away: requests fail promptly with UNAVAILABLE, health turns
//! NOT_SERVING, holders whose lease could not be renewed are told `lost`, and the
//! server recovers by itself when Redis returns.

use latchkey_client::{ConnectOptions, LockKind, LostReason};
use latchkey_server::keys::Keys;
use latchkey_tests::proxy::Proxy;
use latchkey_tests::server::{a_lease_of_every_kind, spawn_queued, Latchkey};
use latchkey_tests::{bounded, poll_until, LatchkeyProcess, RedisServer};
use std::time::{Duration, Instant};
use tonic::Code;
use tonic_health::pb::health_check_response::ServingStatus;

const T: Duration = Duration::from_secs(15);

#[tokio::test]
async fn redis_down_answers_unavailable_then_recovers() {
    let mut redis = RedisServer::start();
    let server = Latchkey::start_with(&redis.url(), &["--redis-timeout", "500ms"]).await;
    let client = server.client().await;
    client
        .lock("before")
        .try_once()
        .acquire()
        .await
        .expect("works while redis is up");

    redis.stop();
    let started = Instant::now();
    let err = client.lock("during").try_once().acquire().await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "prompt: {:?}",
        started.elapsed()
    );
    let err = client.describe("during").await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable);
    // List too: its scan of the keys is no call that times out by itself.
    let listed = tokio::time::timeout(Duration::from_secs(5), client.list("", 0, "")).await;
    assert_eq!(
        listed.expect("List answers").map(|_| ()).map_err(|e| e.code()),
        Err(Code::Unavailable)
    );
    server.wait_health(ServingStatus::NotServing, T).await;

    redis.restart();
    server.wait_health(ServingStatus::Serving, T).await;
    let lease = client.lock("after").try_once().acquire().await.expect("recovered");
    lease.release().await.expect("release after recovery");
}

/// A server that starts while Redis is away is not ready: a readiness probe fails
/// until Redis answers (and the scripts are loaded), then passes.
#[tokio::test]
async fn health_is_not_serving_until_redis_first_answers() {
    let mut redis = RedisServer::start();
    redis.stop();
    // A long command timeout: the first check of Redis is still pending when asked.
    let flags = ["--redis-timeout", "5s"];
    let server = Latchkey::launch(&redis.url(), &flags, ConnectOptions::new()).await;
    assert_eq!(server.health().await, Some(ServingStatus::NotServing));
    redis.restart();
    server.wait_health(ServingStatus::Serving, T).await;
    let client = server.client().await;
    let lease = client.lock("ready").try_once().acquire().await.expect("serving");
    lease.release().await.expect("release");
}

/// A Redis that answers PING but refuses writes (too few replicas, out of memory) can
/// grant no lock: the server is not ready while it does, and ready again after. It
/// used to say SERVING throughout, so a readiness probe kept sending clients to it.
#[tokio::test]
async fn health_is_not_serving_while_redis_refuses_writes() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    server.wait_health(ServingStatus::Serving, T).await;
    let refusals = [["min-replicas-to-write", "1", "0"], ["maxmemory", "1", "0"]];
    for [setting, refuse, accept] in refusals {
        redis.cli(&["CONFIG", "SET", setting, refuse]);
        server.wait_health(ServingStatus::NotServing, T).await;
        redis.cli(&["CONFIG", "SET", setting, accept]);
        server.wait_health(ServingStatus::Serving, T).await;
    }
    let client = server.client().await;
    client.lock("writable").try_once().acquire().await.expect("serving");
}

/// Redis refusing writes for a while (too few replicas for `min-replicas-to-write`, its
/// memory limit) is an outage a fair waiter in line outlasts: its refreshes refused
/// meanwhile, it keeps its place and is granted once writes come back. A waiter that
/// left meanwhile has its leave tried again until Redis takes it (at the memory limit,
/// which lets deletions through, at once): its entry goes before its deadline. Both used to be taken for the command's own failures: the waiter's
/// stream ended at the first refusal, and the leave was dropped.
#[tokio::test]
async fn fair_waiters_outlast_redis_refusing_writes() {
    let refusals = [["min-replicas-to-write", "1", "0"], ["maxmemory", "1", "0"]];
    for [setting, refuse, accept] in refusals {
        let redis = RedisServer::start();
        redis.cli(&["CONFIG", "SET", "maxmemory-policy", "noeviction"]);
        let args = ["--fair-wait-timeout", "6s", "--redis-timeout", "500ms"];
        let server = Latchkey::start_with(&redis.url(), &args).await;
        let client = server.client().await;
        let name = "refusing";
        let holder = client.lock(name).kind(LockKind::Fair).acquire().await.unwrap();
        let (waiter, _) = spawn_queued(client.lock(name).kind(LockKind::Fair).wait(T), T).await;
        let (leaver, _) = spawn_queued(client.lock(name).kind(LockKind::Fair).wait(T), T).await;
        let keys = Keys::default().lock(name);
        let line = redis.list(&keys.queue());
        assert_eq!(line.len(), 2, "{line:?}");
        let deadline = redis.score(&keys.timeouts(), &line[1]);
        redis.cli(&["CONFIG", "SET", setting, refuse]);
        leaver.abort();
        // Past a refresh of the waiter's place (every 2 s, a third of its wait timeout).
        tokio::time::sleep(Duration::from_millis(2500)).await;
        redis.cli(&["CONFIG", "SET", setting, accept]);
        let left = poll_until(T, || !redis.list(&keys.queue()).contains(&line[1])).await;
        assert!(left, "{setting}: the leaver's entry stays");
        let early = deadline - redis.now_ms();
        assert!(
            early > 0,
            "{setting}: the leaver's entry went at its deadline, not by its leave"
        );
        holder.release().await.unwrap();
        let lease = bounded(T, "the waiter", waiter).await.unwrap();
        lease
            .expect("granted once Redis takes writes again")
            .release()
            .await
            .unwrap();
    }
}

#[tokio::test]
async fn a_holder_is_told_lost_when_its_lease_could_not_be_renewed() {
    let mut redis = RedisServer::start();
    let server = Latchkey::start_with(
        &redis.url(),
        &["--watchdog-timeout", "900ms", "--redis-timeout", "300ms"],
    )
    .await;
    let client = server.client().await;
    let lease = client.lock("kept").acquire().await.unwrap();
    // A restart empties Redis: the lock is gone, the watchdog must notice.
    redis.stop();
    redis.restart();
    let reason = tokio::time::timeout(T, lease.lost()).await.expect("told in time");
    assert_eq!(reason, LostReason::NotHeld);
    client.lock("kept").try_once().acquire().await.expect("free again");
}

#[tokio::test]
async fn a_holder_is_told_lost_when_redis_stays_away_past_the_lease() {
    let mut redis = RedisServer::start();
    let server = Latchkey::start_with(
        &redis.url(),
        &["--watchdog-timeout", "900ms", "--redis-timeout", "300ms"],
    )
    .await;
    let lease = server.client().await.lock("orphan").acquire().await.unwrap();
    redis.stop();
    let stopped = Instant::now();
    let reason = tokio::time::timeout(T, lease.lost()).await.expect("told in time");
    assert_eq!(reason, LostReason::NotHeld);
    assert!(
        stopped.elapsed() < Duration::from_secs(3),
        "told {:?} after redis left",
        stopped.elapsed()
    );
}

/// A Redis restarted empty tells every holder, of every kind, fixed leases too,
/// `NOT_HELD` within seconds of Redis being back, with the default watchdog (a renewal
/// every 10 s): the reconnection says notices may have been missed, so the server
/// checks its leases at once rather than at their next renewal, or a fixed lease's end.
#[tokio::test]
async fn a_redis_restarted_empty_tells_every_holder_within_seconds() {
    use latchkey_client::LockKind;
    let mut redis = RedisServer::start();
    let server = Latchkey::start_with(&redis.url(), &["--redis-timeout", "500ms"]).await;
    let client = server.client().await;
    let mut leases = a_lease_of_every_kind(&client, "restart/", 1).await;
    for kind in [
        LockKind::Mutex,
        LockKind::Fair,
        LockKind::Read,
        LockKind::Write,
        LockKind::Semaphore,
    ] {
        let mut fixed = client
            .lock(format!("restart-fixed/{kind:?}"))
            .kind(kind)
            .lease(Duration::from_secs(120));
        if kind == LockKind::Semaphore {
            fixed = fixed.limit(3);
        }
        leases.push(fixed.acquire().await.expect("granted"));
    }
    redis.stop();
    redis.restart();
    for lease in &leases {
        let reason = tokio::time::timeout(Duration::from_secs(5), lease.lost())
            .await
            .unwrap_or_else(|_| panic!("{} not told within 5 s of the restart", lease.name()));
        assert_eq!(reason, LostReason::NotHeld, "{}", lease.name());
    }
}

#[tokio::test]
async fn a_waiter_survives_a_redis_restart() {
    let mut redis = RedisServer::start();
    let server = Latchkey::start_with(
        &redis.url(),
        &["--watchdog-timeout", "900ms", "--redis-timeout", "300ms"],
    )
    .await;
    let client = server.client().await;
    let holder = client.lock("w").acquire().await.unwrap();
    let c2 = client.clone();
    let waiter = tokio::spawn(async move { c2.lock("w").wait(T).acquire().await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    redis.stop();
    server.wait_health(ServingStatus::NotServing, T).await;
    // Longer than the waiter's recheck (the holder's TTL, under a second): its try fails.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    redis.restart();
    // A waiter in line keeps its place while Redis is away, trying again, and acquires
    // once the emptied lock is free.
    let lease = tokio::time::timeout(T, waiter)
        .await
        .expect("not stranded")
        .unwrap()
        .expect("acquires after the restart");
    assert!(lease.fencing_token() > 0);
    let reason = tokio::time::timeout(T, holder.lost())
        .await
        .expect("the holder is told");
    assert_eq!(reason, LostReason::NotHeld);
}

/// A release that fails while Redis is away is given back once Redis returns, not left
/// to the lease (an hour here). Redis keeps its data across the restart (append-only
/// file), as a real deployment's would. The caller is told UNAVAILABLE, the server's
/// status; the client used to call it a lease lost to a broken connection.
#[tokio::test]
async fn a_release_that_failed_is_retried_once_redis_returns() {
    let mut redis = RedisServer::start_with(&["--appendonly", "yes", "--appendfsync", "always"]);
    let server = Latchkey::start_with(&redis.url(), &["--redis-timeout", "300ms"]).await;
    let client = server.client().await;
    let lease = client
        .lock("kept-long")
        .lease(Duration::from_secs(3600))
        .acquire()
        .await
        .expect("acquired");
    redis.stop();
    let err = lease.release().await.expect_err("redis is away");
    // The server's UNAVAILABLE, not a lease lost to a broken connection.
    assert!(err.is_unavailable(), "{err:?}");
    redis.restart();
    let given_back = poll_until(T, || redis.cli(&["EXISTS", "kept-long"]).trim() == "0").await;
    assert!(
        given_back,
        "the lock is still held: {}",
        redis.cli(&["PTTL", "kept-long"])
    );
    client.lock("kept-long").try_once().acquire().await.expect("free again");
}

/// A holder whose server can no longer reach Redis (frozen here) is told `lost` before
/// its lock expires there, when other servers may grant it: the watchdog reports it
/// a margin ahead of the expiry. It used to be told only after the release that
/// follows, which waited out the Redis timeout on the unreachable Redis: after the
/// expiry, so another client could hold the lock while this one still thought it did.
#[tokio::test]
async fn a_holder_cut_off_from_redis_is_told_before_its_lock_expires() {
    use nix::sys::signal::{kill, Signal};
    let redis = RedisServer::start();
    let server = Latchkey::start_with(&redis.url(), &["--watchdog-timeout", "3s", "--redis-timeout", "800ms"]).await;
    let lease = server.client().await.lock("cut-off").acquire().await.unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let pttl: u64 = redis.cli(&["PTTL", "cut-off"]).trim().parse().expect("a TTL");
    let expiry = Instant::now() + Duration::from_millis(pttl);
    let redis_pid = nix::unistd::Pid::from_raw(redis.pid().expect("running") as i32);
    kill(redis_pid, Signal::SIGSTOP).expect("freeze redis");
    let reason = tokio::time::timeout(T, lease.lost()).await;
    let told = Instant::now();
    kill(redis_pid, Signal::SIGCONT).expect("thaw redis");
    assert_eq!(reason.expect("told in time"), LostReason::NotHeld);
    let ahead = expiry.checked_duration_since(told);
    assert!(
        ahead.is_some_and(|d| d >= Duration::from_millis(300)),
        "told {ahead:?} before the lock expired in Redis (None: after)"
    );
}

/// A lease counts from before its grant was asked, not from when the answer came: a
/// reply held up on its way back (700 ms each way here) must not leave the server
/// believing in a lease that Redis lets expire first. Cut off from Redis right after
/// the grant, the holder is told `lost` well before the lock is gone from Redis. It
/// used to be told after: the server counted the lease from the late reply.
#[tokio::test]
async fn a_grant_whose_reply_came_late_is_told_lost_before_its_lock_expires() {
    let redis = RedisServer::start();
    let proxy = Proxy::to_redis(&redis).await;
    let flags = ["--watchdog-timeout", "3s", "--redis-timeout", "5s"];
    let server = Latchkey::start_with(&proxy.redis_url(), &flags).await;
    let client = server.client().await;
    proxy.set_delay(Duration::from_millis(700));
    let lease = client.lock("late-reply").acquire().await.expect("granted late");
    proxy.freeze();
    let reason = tokio::time::timeout(T, lease.lost()).await;
    let told = Instant::now();
    assert_eq!(reason.expect("told in time"), LostReason::NotHeld);
    let gone = poll_until(T, || redis.cli(&["EXISTS", "late-reply"]).trim() == "0").await;
    assert!(gone, "the lock expires in Redis");
    let ahead = told.elapsed();
    assert!(
        ahead >= Duration::from_millis(500),
        "told only {ahead:?} before the lock expired in Redis"
    );
}

/// A grant whose reply comes back later than its lease could last in Redis (a reply
/// slower than `--watchdog-timeout` allows) is given back, and the client is told to
/// try again: it was told `acquired` for a lock Redis may have let go, and another
/// client taken, until the next check found the lease lapsed.
#[tokio::test]
async fn a_grant_heard_after_its_lease_could_have_run_out_is_given_back() {
    let redis = RedisServer::start();
    let proxy = Proxy::to_redis(&redis).await;
    let flags = ["--watchdog-timeout", "1s", "--redis-timeout", "5s"];
    let server = Latchkey::start_with(&proxy.redis_url(), &flags).await;
    let client = server.client().await;
    // 1.8 s for a round trip: the lease told as lost 0.67 s after the try was asked.
    proxy.set_delay(Duration::from_millis(900));
    redis.cli(&["CONFIG", "RESETSTAT"]);
    let acquiring = tokio::spawn(async move { client.lock("late").try_once().acquire().await });
    let answer = bounded(T, "the acquire", acquiring).await.unwrap();
    proxy.set_delay(Duration::ZERO);
    let err = answer.expect_err("a grant heard after its lease could have run out is not told");
    assert_eq!(err.code(), Code::Unavailable, "{err}");
    assert!(err.to_string().contains("try again"), "{err}");
    // The grant, then its give-back (the lock expires by itself meanwhile too).
    let given_back = poll_until(T, || redis.evalsha_calls() >= 2).await;
    assert!(
        given_back,
        "the grant was given back: {} scripts",
        redis.evalsha_calls()
    );
    let gone = poll_until(T, || redis.cli(&["EXISTS", "late"]).trim() == "0").await;
    assert!(gone, "the lock is not left held");
}

/// A handoff's grant heard too late is given back through Redis, passed on to nobody in
/// memory: the run of passes the handoff started counted from its reply, and its
/// give-back passed the lock to the next waiter here, told `acquired` for a lock Redis
/// may have let expire (and another client taken) before a recording failed.
#[tokio::test]
async fn a_late_handoff_is_passed_on_to_nobody_in_memory() {
    let redis = RedisServer::start();
    let proxy = Proxy::to_redis(&redis).await;
    let flags = ["--watchdog-timeout", "1s", "--redis-timeout", "5s"];
    let server = Latchkey::start_with(&proxy.redis_url(), &flags).await;
    let client = server.client().await;
    // A fixed lease, which the slow renewals to come cannot lose.
    let holder = client
        .lock("late-pass")
        .lease(Duration::from_secs(60))
        .acquire()
        .await
        .expect("holder");
    let (first, _) = spawn_queued(client.lock("late-pass").wait(T), T).await;
    let (second, _) = spawn_queued(client.lock("late-pass").wait(T), T).await;
    // After `queued` the first waiter subscribes and tries once more: let that finish,
    // so the release hands the lock to it.
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Every grant from now on is heard 1.8 s after it was asked, past its 1 s lease.
    proxy.set_delay(Duration::from_millis(900));
    let _release = tokio::spawn(holder.release());
    let first = bounded(T, "the first waiter", first).await.unwrap();
    let err = first.expect_err("the handoff's grant came too late");
    assert_eq!(err.code(), Code::Unavailable, "{err}");
    let second = bounded(T, "the second waiter", second).await.unwrap();
    proxy.set_delay(Duration::ZERO);
    let err = second.expect_err("no grant heard too late is told, nor passed on from one");
    assert_eq!(err.code(), Code::Unavailable, "{err}");
}

/// A ForceRelease whose connection to Redis is cut after Redis ran it, before its reply
/// came back: the break woke the waiter, which took the lock, and the Redis client then
/// sent the call again on its new connection, which broke the waiter's new grant as
/// well (`lost{FORCE_RELEASED}` for a hold taken after the break). One ForceRelease
/// breaks the holds of its moment, once.
#[tokio::test]
async fn a_force_release_cut_off_before_its_reply_breaks_no_later_grant() {
    let redis = RedisServer::start();
    let proxy = Proxy::to_redis(&redis).await;
    let admin = Latchkey::start_with(&proxy.redis_url(), &["--redis-timeout", "5s"]).await;
    let other = Latchkey::start(&redis.url()).await;
    let client = other.client().await;
    let holder = client.lock("broken").acquire().await.expect("granted");
    let (waiting, _) = latchkey_tests::server::spawn_queued(client.lock("broken").wait(T), T).await;
    let admin_client = admin.client().await;
    // The reply takes 500 ms to come back: time to cut the connection once Redis ran it.
    proxy.set_delay(Duration::from_millis(500));
    let forced = tokio::spawn(async move { admin_client.force_release("broken").await });
    let reason = tokio::time::timeout(T, holder.lost())
        .await
        .expect("the holder is told");
    assert_eq!(reason, LostReason::ForceReleased);
    proxy.cut();
    proxy.set_delay(Duration::ZERO);
    let lease = tokio::time::timeout(T, waiting)
        .await
        .expect("the waiter is woken")
        .expect("task")
        .expect("granted after the break");
    let _ = tokio::time::timeout(T, forced).await.expect("ForceRelease answers");
    // Long enough for a call sent again to have run.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!lease.is_lost(), "a grant after the break was broken too");
    let state = client.describe("broken").await.expect("describe");
    assert!(state.locked, "the waiter holds the lock");
    lease.release().await.expect("released");
}

/// Stops Redis, asks `calls` ForceReleases meanwhile (each fails: Redis is away), then
/// starts Redis again, empty (its scripts gone), and waits until the server serves and
/// its connections had time to reconnect. Returns the codes the ForceReleases got.
async fn outage_with_force_releases(
    redis: &mut RedisServer,
    server: &Latchkey,
    client: &latchkey_client::Client,
    calls: usize,
) -> Vec<Code> {
    redis.stop();
    let mut codes = Vec::new();
    let mut asked = 0;
    while asked < calls {
        let chunk = (calls - asked).min(250);
        let tries = (0..chunk).map(|i| {
            let client = client.clone();
            async move {
                let name = format!("outage/{}", asked + i);
                match tokio::time::timeout(T, client.force_release(name.as_str())).await {
                    Ok(Ok(_)) => Code::Ok,
                    Ok(Err(e)) => e.code(),
                    Err(_) => Code::DeadlineExceeded,
                }
            }
        });
        codes.extend(futures::future::join_all(tries).await);
        asked += chunk;
    }
    redis.restart();
    server.wait_health(ServingStatus::Serving, T).await;
    // Every connection's reconnection backs off 1 s at most.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    codes
}

/// ForceRelease works after an outage during which more ForceReleases were asked than
/// its connection queues (`COMMAND_QUEUE_MAX`, 1 024). fred refuses those beyond its
/// bound with `Backpressure` but keeps counting each as queued, and from then on
/// flushes only commands that flush by themselves (EVALSHA does, `SCRIPT LOAD` does
/// not): the server refuses a script call itself before fred's bound, so that once
/// Redis is back, empty, the reload a `NOSCRIPT` asks for is sent, and not left in the
/// connection's write buffer with every ForceRelease failing while Redis is up.
#[tokio::test]
async fn force_release_works_after_an_outage_that_filled_its_command_queue() {
    let mut redis = RedisServer::start();
    let server = Latchkey::start_with(&redis.url(), &["--redis-timeout", "500ms"]).await;
    let client = server.client().await;

    // Control: a short outage with a few ForceReleases; afterwards ForceRelease works.
    let codes = outage_with_force_releases(&mut redis, &server, &client, 20).await;
    assert!(codes.iter().all(|c| *c == Code::Unavailable), "{codes:?}");
    let _lease = client
        .lock("fr/control")
        .acquire()
        .await
        .expect("granted after the restart");
    assert!(
        client
            .force_release("fr/control")
            .await
            .expect("control: ForceRelease after a restart"),
        "control: the lock was broken"
    );

    // An outage during which more ForceReleases were asked than the connection queues.
    let codes = outage_with_force_releases(&mut redis, &server, &client, 1500).await;
    assert!(codes.iter().all(|c| *c == Code::Unavailable), "{codes:?}");
    let mut results = Vec::new();
    for i in 0..3 {
        let name = format!("fr/after/{i}");
        let _lease = client
            .lock(name.as_str())
            .acquire()
            .await
            .expect("granted after the restart");
        let result = client.force_release(name.as_str()).await;
        results.push(result.map_err(|e| format!("{:?} {e}", e.code())));
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert!(
        results.iter().all(|r| *r == Ok(true)),
        "ForceRelease on a Redis that is up, after an outage that filled its command queue: {results:?}"
    );
}

/// A try the server refused before sending it (its connection's command queue full
/// while Redis is away) ran nothing: its stream's end gives nothing back. It put the
/// stream in doubt, and the end queued a revoking give-back for each: clients retrying
/// hard through a long outage queued one per stream, and Redis got them all once back.
/// Streams whose try was sent and went unanswered still give back (the control).
#[tokio::test]
async fn a_try_refused_before_it_was_sent_gives_nothing_back() {
    let mut redis = RedisServer::start();
    let server = Latchkey::start_with(&redis.url(), &["--redis-timeout", "500ms"]).await;
    let client = server.client().await;
    redis.stop();
    // Waiters whose first try is queued (so in doubt), ended once the queues are full.
    let waiting: Vec<_> = (0..5)
        .map(|i| {
            tokio::spawn(
                client
                    .lock(format!("doubted/{i}"))
                    .wait(Duration::from_secs(60))
                    .acquire(),
            )
        })
        .collect();
    // Tries one at a time (each its own call, where tries at once share one) fill the
    // connections' queues: 4 of 768.
    let refused = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut tries = Vec::new();
    while refused.lock().unwrap().len() < 100 {
        assert!(tries.len() < 10_000, "the command queues never filled");
        let (client, refused) = (client.clone(), refused.clone());
        let name = format!("try/{}", tries.len());
        tries.push(tokio::spawn(async move {
            match bounded(
                T,
                "a try while Redis is away",
                client.lock(name.as_str()).try_once().acquire(),
            )
            .await
            {
                Err(e) if e.to_string().contains("command queue is full") => refused.lock().unwrap().push(name),
                Err(e) => assert_eq!(e.code(), Code::Unavailable, "{e}"),
                Ok(_) => panic!("{name} granted while Redis is away"),
            }
        }));
        tokio::time::sleep(Duration::from_micros(500)).await;
    }
    for t in tries {
        t.await.expect("a try's task");
    }
    let refused = std::mem::take(&mut *refused.lock().unwrap());
    waiting.iter().for_each(|w| w.abort());
    redis.restart();
    server.wait_health(ServingStatus::Serving, T).await;
    let records = |pattern: &str| redis.cli(&["--scan", "--pattern", pattern]).lines().count();
    assert!(
        poll_until(T, || records("latchkey_hold:*doubted/*") == 5).await,
        "the doubted waiters' give-backs: {} records",
        records("latchkey_hold:*doubted/*")
    );
    // Settled once no give-back came for longer than a round of calls made again.
    let (mut last, mut since) = (usize::MAX, Instant::now());
    let settled = poll_until(T, || {
        let now = records("latchkey_hold:*try/*");
        if std::mem::replace(&mut last, now) != now {
            since = Instant::now();
        }
        since.elapsed() > Duration::from_millis(1500)
    });
    assert!(settled.await, "the give-backs settle");
    // One scan: a record's key names its lock between braces.
    let recorded: std::collections::HashSet<String> = redis
        .cli(&["--scan", "--pattern", "latchkey_hold:*try/*"])
        .lines()
        .filter_map(|key| Some(key.split_once('{')?.1.split_once('}')?.0.to_owned()))
        .collect();
    let given_back = refused.iter().filter(|name| recorded.contains(*name));
    assert_eq!(
        given_back.count(),
        0,
        "of {} tries refused before they were sent",
        refused.len()
    );
}

/// A waiter listens once Redis has its subscription, not once the command is written:
/// the Redis client answers a plain SUBSCRIBE as soon as it is sent. With the
/// subscriber's connection slow (its SUBSCRIBE held back), the waiter took the written
/// command for a subscription, tried again, and slept through a release published
/// before the SUBSCRIBE arrived, until its recheck, the holder's whole lease.
#[tokio::test]
async fn a_waiter_listens_once_redis_has_its_subscription() {
    let redis = RedisServer::start();
    let proxy = latchkey_tests::proxy::Proxy::to_redis(&redis).await;
    let a = Latchkey::start(&proxy.redis_url()).await;
    let b = Latchkey::start(&redis.url()).await;
    let holder = b.client().await.lock("slow-sub").acquire().await.unwrap();
    proxy.hold_back_matching(Some((b"SUBSCRIBE", Duration::from_millis(600))));
    let (waiting, _) = spawn_queued(a.client().await.lock("slow-sub").wait(T), T).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let released = Instant::now();
    holder.release().await.unwrap();
    let lease = tokio::time::timeout(T, waiting)
        .await
        .expect("answered")
        .unwrap()
        .expect("granted");
    let took = released.elapsed();
    assert!(took < Duration::from_secs(2), "granted {took:?} after the release");
    proxy.hold_back_matching(None);
    drop(lease);
}

/// A waiter whose subscription is confirmed while a try of it is on its way: the try ran
/// before the subscription, and a release between them published to nobody here. Read
/// after the try, the subscription said the waiter listened, and it slept until the
/// holder's TTL on a free lock; read before the try, it looks again within a second.
#[tokio::test]
async fn a_subscription_confirmed_during_a_try_leaves_no_waiter_asleep() {
    let redis = RedisServer::start();
    let proxy = latchkey_tests::proxy::Proxy::to_redis(&redis).await;
    let a = Latchkey::start(&proxy.redis_url()).await;
    let b = Latchkey::start(&redis.url()).await;
    let holder = b.client().await.lock("flip").acquire().await.unwrap();
    proxy.hold_back_matching(Some((b"SUBSCRIBE", Duration::from_millis(1500))));
    // A busy answer of the mutex script ({0, ttl, 0, 1}) comes 700 ms after it ran.
    proxy.hold_back_replies_matching(Some((b"*4\r\n:0\r\n:", Duration::from_millis(700))));
    let (waiting, _) = spawn_queued(a.client().await.lock("flip").wait(T), T).await;
    // The SUBSCRIBE and the second try's answer are both held: the try ran, the
    // SUBSCRIBE did not.
    assert!(
        latchkey_tests::poll_until(T, || proxy.holding() >= 2).await,
        "both held back"
    );
    let released = Instant::now();
    holder.release().await.unwrap();
    let lease = latchkey_tests::bounded(T, "the waiter", waiting)
        .await
        .unwrap()
        .expect("granted");
    let took = released.elapsed();
    assert!(took < Duration::from_secs(3), "granted {took:?} after the release");
    proxy.hold_back_matching(None);
    proxy.hold_back_replies_matching(None);
    drop(lease);
}

/// A wake spent on a try that Redis refused (busy running another script) is handed on
/// when its waiter leaves: the next waiter of the server tries once Redis serves again,
/// instead of sleeping until the old holder's TTL while the lock is free.
#[tokio::test]
async fn a_wake_spent_on_a_refused_try_is_handed_on_when_its_waiter_leaves() {
    let redis = RedisServer::start();
    redis.cli(&["CONFIG", "SET", "busy-reply-threshold", "100"]);
    let server = Latchkey::start_with(&redis.url(), &["--redis-timeout", "300ms"]).await;
    let client = server.client().await;
    let conn = latchkey_tests::redis_client(&redis.url()).await;
    let java = latchkey_tests::redisson::RedissonLock::new(&conn, "x", &latchkey_tests::redisson::random_owner());
    assert!(java.try_lock(60_000).await.is_none(), "the Java holder takes the lock");
    let (first, _) = spawn_queued(client.lock("x").wait(Duration::from_millis(1500)), T).await;
    let (second, _) = spawn_queued(client.lock("x").wait(Duration::from_secs(30)), T).await;
    // The holder goes (as its unlock would), and another application's script keeps
    // Redis busy for 3 s: the wake's try is refused.
    let busy = "redis.call('del', KEYS[1]) redis.call('publish', KEYS[2], '0') \
        local s = redis.call('time')[1] while redis.call('time')[1] - s < 3 do end";
    let started = Instant::now();
    let script = {
        let port = redis.port().to_string();
        tokio::task::spawn_blocking(move || {
            std::process::Command::new("redis-cli")
                .args(["-p", &port, "EVAL", busy, "2", "x", "redisson_lock__channel:{x}"])
                .output()
        })
    };
    let err = latchkey_tests::bounded(T, "the first waiter", first)
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(err.code(), Code::DeadlineExceeded, "{err}");
    latchkey_tests::bounded(T, "the script", script)
        .await
        .unwrap()
        .expect("redis-cli ran");
    let lease = latchkey_tests::bounded(T, "the second waiter", second)
        .await
        .unwrap()
        .expect("granted");
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "granted {:?} after the holder went",
        started.elapsed()
    );
    lease.release().await.unwrap();
}

/// While Redis loads its data after a restart (answering `LOADING`), the server keeps
/// the connections it made: a `LOADING` reply dropped the connection it came on, and
/// each reconnection of the subscriber woke every waiter, whose tries met `LOADING`
/// again, a storm of reconnections and tries for as long as the load lasted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loading_redis_keeps_the_servers_connections() {
    let mut redis = RedisServer::start_with(&["--enable-debug-command", "yes"]);
    redis.cli(&["DEBUG", "POPULATE", "3000000", "k", "64"]);
    redis.cli(&["SAVE"]);
    // The default Redis timeout: a connection unanswered for longer is made again, by
    // design, and a load on a busy machine (tests beside it) leaves Redis deaf for half
    // a second at times.
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let holder = client
        .lock("loaded")
        .lease(Duration::from_secs(120))
        .acquire()
        .await
        .unwrap();
    let mut waiters = Vec::new();
    for _ in 0..5 {
        waiters.push(
            spawn_queued(client.lock("loaded").wait(Duration::from_secs(120)), T)
                .await
                .0,
        );
    }
    let started = Instant::now();
    // Returns once the data is loaded; the server runs on meanwhile.
    tokio::task::block_in_place(|| redis.restart());
    let took = started.elapsed();
    let stats = redis.cli(&["INFO", "stats"]);
    let made: u64 = latchkey_tests::redis::info_field(&stats, "total_connections_received")
        .and_then(|n| n.parse().ok())
        .expect("INFO stats");
    assert!(made <= 12, "{made} connections made while Redis loaded for {took:?}");
    drop(holder);
    latchkey_tests::server::each_granted(waiters, T).await;
}

/// After Redis restarts, the server's check that pub/sub delivers to it waits for its
/// publishing connection to come back: a `PUBLISH` that met a connection still
/// reconnecting (with a Redis timeout shorter than the reconnection's backoff) was
/// reported at error as pub/sub not delivering, blaming the Redis user's permissions.
#[tokio::test]
async fn a_redis_restart_is_not_reported_as_pub_sub_not_delivering() {
    let mut redis = RedisServer::start();
    let args = ["--redis-url", &redis.url(), "--redis-timeout", "300ms"].map(str::to_owned);
    let server = LatchkeyProcess::spawn(&args);
    server.serving_client().await;
    for _ in 0..3 {
        redis.stop();
        tokio::time::sleep(Duration::from_millis(1500)).await;
        redis.restart();
        server.serving_client().await;
    }
    // Past the check's wait for its own message.
    tokio::time::sleep(Duration::from_secs(6)).await;
    let said = "pub/sub does not deliver to this server";
    assert!(!server.log().contains(said), "{}", server.log_tail());
}

/// At its memory limit (`noeviction`) Redis refuses a command that may take memory
/// (ZADD, SET, HINCRBY) when it comes before a script's first write, and allows PEXPIRE.
/// A renewal only lengthens what exists: every lease stays held through two whole
/// rounds, semaphores among them (a semaphore's ZADD follows its PEXPIREs), while a new
/// grant is refused in Redis's own words.
#[tokio::test]
async fn leases_stay_held_while_redis_is_at_its_memory_limit() {
    let redis = RedisServer::start();
    let server = LatchkeyProcess::spawn(&["--redis-url", &redis.url(), "--watchdog-timeout", "3s"].map(str::to_owned));
    let client = server.serving_client().await;
    let leases = a_lease_of_every_kind(&client, "oom/", 12).await;
    redis.cli(&["CONFIG", "SET", "maxmemory-policy", "noeviction"]);
    redis.cli(&["CONFIG", "SET", "maxmemory", "1"]);
    // Two whole rounds at the limit (a round a second).
    server.renewals_reach(2 * leases.len(), T).await;
    let lost: Vec<&str> = leases.iter().filter(|l| l.is_lost()).map(|l| l.name()).collect();
    assert!(lost.is_empty(), "told lost at the memory limit: {lost:?}");
    let err = client.lock("oom/new").try_once().acquire().await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err}");
    assert!(err.to_string().contains("OOM"), "Redis's words: {err}");
    redis.cli(&["CONFIG", "SET", "maxmemory", "0"]);
    for lease in leases {
        lease.release().await.expect("released");
    }
}

/// At the memory limit a semaphore whose keys outlive its stream's lease (here a longer
/// fixed lease beside it, which a renewal checks and leaves alone) stays held too, and a
/// try of it, full, answers busy. The renewal's PEXPIREs ran only to lengthen: with the
/// keys' lifetime long enough they ran none, so its ZADD came first in the script,
/// Redis refused it each round and the stream was told lost. The busy try's first write
/// was the bookkeeping of when waiters look again, refused: the try failed
/// `UNAVAILABLE`.
#[tokio::test]
async fn a_semaphore_whose_keys_outlive_its_lease_stays_held_at_the_memory_limit() {
    let redis = RedisServer::start();
    let server = LatchkeyProcess::spawn(&["--redis-url", &redis.url(), "--watchdog-timeout", "3s"].map(str::to_owned));
    let client = server.serving_client().await;
    let semaphore = || client.lock("oom/outlived").kind(LockKind::Semaphore).limit(2);
    let longer = semaphore().lease(Duration::from_secs(60)).acquire().await.unwrap();
    let stream = semaphore().acquire().await.unwrap();
    redis.cli(&["CONFIG", "SET", "maxmemory-policy", "noeviction"]);
    redis.cli(&["CONFIG", "SET", "maxmemory", "1"]);
    let busy = semaphore().try_once().acquire().await.unwrap_err();
    // Three rounds at the limit (a round a second, the fixed lease's check counted).
    server.renewals_reach(3, T).await;
    let failures = server.metric("latchkey_watchdog_renewal_failures_total");
    redis.cli(&["CONFIG", "SET", "maxmemory", "0"]);
    assert_eq!(busy.code(), Code::DeadlineExceeded, "a full semaphore: {busy}");
    assert_eq!(failures, 0.0, "renewals Redis refused");
    assert!(!stream.is_lost(), "told lost at the memory limit");
    stream.release().await.expect("released");
    longer.release().await.expect("released");
}

/// A lease whose renewal Redis refuses (here an ACL that takes ZADD away from the
/// server's user once a semaphore is held) costs only that lease: it is tried again
/// each second and told lost once unconfirmed for too long, the log saying what Redis
/// answered, while the mutex lease renewed in the same batch stays held.
#[tokio::test]
async fn a_refused_renewal_costs_only_its_own_lease() {
    use latchkey_client::LockKind;
    let redis = RedisServer::start_with(&[
        "--user", "default", "off", "--user", "alice", "on", ">pw", "~*", "&*", "+@all",
    ]);
    let url = format!("redis://alice:pw@127.0.0.1:{}", redis.port());
    let server = LatchkeyProcess::spawn(&["--redis-url", &url, "--watchdog-timeout", "3s"].map(str::to_owned));
    let client = server.serving_client().await;
    let semaphore = client
        .lock("refused/s")
        .kind(LockKind::Semaphore)
        .limit(1)
        .acquire()
        .await
        .unwrap();
    let mutex = client.lock("refused/m").acquire().await.unwrap();
    // redis-cli as the server's user (the default user is off).
    let as_alice =
        |args: &[&str]| redis.cli(&[&["--user", "alice", "--pass", "pw", "--no-auth-warning"], args].concat());
    as_alice(&["ACL", "SETUSER", "alice", "-zadd"]);
    let reason = bounded(T, "the semaphore lease told lost", semaphore.lost()).await;
    assert_eq!(reason, LostReason::NotHeld);
    assert!(!mutex.is_lost(), "the mutex lease stays held");
    let ttl: i64 = as_alice(&["PTTL", "refused/m"]).trim().parse().unwrap();
    assert!(ttl > 0, "the mutex is held in Redis: PTTL {ttl}");
    let log = server.log();
    assert!(
        log.contains("redis refused lease renewals error="),
        "the log names the refusal:\n{}",
        server.log_tail()
    );
    mutex.release().await.expect("released");
}

/// A wait ends by its `wait_timeout` (and a moment's grace) while Redis is slow to
/// answer. Its try in flight at the deadline used to wait for its answer first, up
/// to `--redis-timeout` (granted here after 2.9 s; 6 s with Redis frozen). Whatever
/// the late calls grant the waiter once they reach Redis (the holder's release handing
/// the lock on, the try cut off) is given back: the lock is not left held for nobody.
#[tokio::test]
async fn a_wait_ends_by_its_deadline_while_redis_is_slow_to_answer() {
    let redis = RedisServer::start();
    let proxy = Proxy::to_redis(&redis).await;
    let server = Latchkey::start_with(&proxy.redis_url(), &["--redis-timeout", "8s"]).await;
    let client = server.client().await;
    let lease = Duration::from_secs(60);
    let holder = client.lock("slow-wait").lease(lease).acquire().await.expect("holder");
    let wait = Duration::from_millis(1500);
    let started = Instant::now();
    let (waiting, _) = spawn_queued(client.lock("slow-wait").wait(wait), T).await;
    // Every script call from now on reaches Redis 2.5 s late, one after another on
    // its connection: the release, and the waiter's try (which may come after it).
    proxy.hold_back_matching(Some((b"EVALSHA", Duration::from_millis(2500))));
    let releasing = tokio::spawn(holder.release());
    let answer = bounded(T, "the wait", waiting).await.expect("the waiting task");
    let took = started.elapsed();
    let err = answer.expect_err("nothing is granted before the deadline");
    assert_eq!(err.code(), Code::DeadlineExceeded, "{err}");
    assert!(
        took < wait + Duration::from_millis(700),
        "a {wait:?} wait ended after {took:?}"
    );
    proxy.hold_back_matching(None);
    bounded(T, "the release", releasing)
        .await
        .expect("the releasing task")
        .expect("released");
    // The try cut off may reach Redis after the release, take the lock and give it back:
    // free once nothing is held back and nothing holds the lock.
    let free = poll_until(T, || {
        proxy.holding() == 0 && redis.cli(&["EXISTS", "slow-wait"]).trim() == "0"
    })
    .await;
    assert!(free, "the lock is held still: {}", redis.cli(&["HGETALL", "slow-wait"]));
    client.lock("slow-wait").try_once().acquire().await.expect("free again");
}

/// A primary demoted behind an address that moved to the promoted replica (DNS or a
/// Service switched over, the old primary's connections left open): the server's
/// calls meet `READONLY` there, and it connects again, through the address, to the new
/// primary: new locks are granted, and a lease held through the switch is renewed
/// there. On Redis 6.2 (`tests/run` runs this file on it too) a script's error is the
/// script's own (`ERR Error running script … -READONLY …`), on which the Redis client
/// does not connect again: every call failed, and every lease was told lost, until the
/// server was restarted.
#[tokio::test]
async fn a_server_leaves_a_primary_demoted_behind_a_moved_address() {
    let (old, new) = RedisServer::with_replica().await;
    let proxy = Proxy::to_redis(&old).await;
    // Renewals every 2 s, the holder told lost past about 4 s without one: a round that
    // fails on the old primary, and one that meets it loading (a full resync), are
    // outlasted.
    let args = ["--watchdog-timeout", "6s", "--redis-timeout", "500ms"];
    let server = Latchkey::start_with(&proxy.redis_url(), &args).await;
    let client = server.client().await;
    let held = client.lock("held-through").acquire().await.unwrap();
    let replicated = poll_until(T, || new.cli(&["EXISTS", "held-through"]).trim() == "1").await;
    assert!(replicated, "the hold replicated");
    // When the lease ends on the new primary, by its clock.
    let ends = || -> i64 { new.now_ms() + new.cli(&["PTTL", "held-through"]).trim().parse::<i64>().unwrap() };
    new.cli(&["REPLICAOF", "NO", "ONE"]);
    let at_switch = ends();
    old.cli(&["REPLICAOF", "127.0.0.1", &new.port().to_string()]);
    proxy.lead_to(&new);
    let granted = bounded(T, "a grant on the new primary", async {
        loop {
            match client.lock("after").try_once().acquire().await {
                Ok(lease) => break lease,
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    })
    .await;
    assert_eq!(new.cli(&["EXISTS", "after"]).trim(), "1", "granted on the new primary");
    granted.release().await.unwrap();
    // A renewal moves the end on by a third of the lease (2 s); the two reads of `ends`
    // lie a few milliseconds apart.
    let renewed = poll_until(T, || ends() > at_switch + 1_000).await;
    assert!(renewed, "renewed on the new primary");
    assert_eq!(held.lost_reason(), None, "the lease held through the switch");
    held.release().await.expect("released on the new primary");
}
