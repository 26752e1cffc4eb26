//! Watch: one state at once, then one per change (acquired, released, queued, lost),
//! driven by pub/sub, for leader observation.

use fred::prelude::PubsubInterface;
use latchkey_client::{Client, LockKind, LockState};
use latchkey_proto::v1::WatchRequest;
use latchkey_tests::proxy::Proxy;
use latchkey_tests::redisson::{random_owner, RedissonLock};
use latchkey_tests::server::{next_state, semaphore, spawn_queued, watch_until, Latchkey};
use latchkey_tests::{bounded, poll_until, redis_client, LatchkeyProcess, RedisServer};
use std::time::{Duration, Instant};

/// Bound on anything that should happen promptly but is not timed by the test.
const T: Duration = Duration::from_secs(10);

/// The next state, within a second (changes arrive by pub/sub, not by polling).
async fn next(watch: &mut latchkey_client::LockWatch) -> LockState {
    next_state(watch, Duration::from_secs(1)).await
}

#[tokio::test]
async fn watch_reports_every_change_of_a_lock() {
    let redis = RedisServer::start();
    let a = Latchkey::start(&redis.url()).await;
    let b = Latchkey::start(&redis.url()).await;
    let client = a.client().await;
    let mut watch = b.client().await.watch("leader").await.unwrap();
    assert!(!next(&mut watch).await.locked, "the first state is the current one");

    let lease = client
        .lock("leader")
        .kind(LockKind::Fair)
        .owner("node-1")
        .acquire()
        .await
        .unwrap();
    let state = next(&mut watch).await;
    assert!(state.locked);
    assert_eq!(state.holders[0].owner, "node-1");
    assert_eq!(state.last_fencing_token, lease.fencing_token());

    let waiting = {
        let client = client.clone();
        tokio::spawn(async move {
            client
                .lock("leader")
                .kind(LockKind::Fair)
                .owner("node-2")
                .acquire()
                .await
        })
    };
    let state = next(&mut watch).await;
    assert_eq!(state.waiters.len(), 1, "the queue change is reported");
    assert_eq!(state.waiters[0].owner, "node-2");

    lease.release().await.unwrap();
    // The release and node-2's grant may come as one state or two.
    let mut state = next(&mut watch).await;
    if state.holders.first().map(|h| h.owner.as_str()) != Some("node-2") {
        state = next(&mut watch).await;
    }
    assert_eq!(state.holders[0].owner, "node-2", "the new leader");
    assert!(state.waiters.is_empty());
    waiting.await.unwrap().unwrap().release().await.unwrap();
    assert!(!next(&mut watch).await.locked);
}

#[tokio::test]
async fn watch_sees_an_expiry_and_a_redisson_holder_leaving() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let mut watch = client.watch("w").await.unwrap();
    assert!(!next(&mut watch).await.locked);
    let _lease = client
        .lock("w")
        .lease(Duration::from_millis(400))
        .acquire()
        .await
        .unwrap();
    assert!(next(&mut watch).await.locked);
    let started = Instant::now();
    assert!(!next(&mut watch).await.locked, "the end of the fixed lease");
    assert!(started.elapsed() < Duration::from_secs(1));

    let java = RedissonLock::new(&redis_client(&redis.url()).await, "w", &random_owner());
    assert_eq!(java.try_lock(30_000).await, None);
    // Redisson's grant sends no message: a Watch sees it with the next change.
    java.unlock().await;
    let mut watch = client.watch("w").await.unwrap();
    assert!(!next(&mut watch).await.locked);
    assert_eq!(java.try_lock(30_000).await, None);
    let other = client.lock("w").wait(Duration::from_secs(5));
    let waiting = tokio::spawn(other.acquire());
    java.unlock().await;
    // The watcher hears latchkey's grant (Redisson's unlock message too, should its
    // re-read have shown the Redisson holder first).
    let mut seen_locked_by_latchkey = false;
    for _ in 0..3 {
        let state = next(&mut watch).await;
        if state.locked && state.holders[0].owner != java.owner() {
            seen_locked_by_latchkey = true;
            break;
        }
    }
    assert!(seen_locked_by_latchkey);
    waiting.await.unwrap().unwrap();
}

/// A Watch listens on a mutex's unlock channel only while a Redisson client holds it,
/// whose release is announced there alone: each release is seen at once (under the 1 s
/// re-read), a latchkey holder's on the watch channel. The release
/// scripts count the unlock channel's listeners, and a Watch there, a listener with no
/// waiter, kept a hot mutex from being passed in memory or granted to claims.
#[tokio::test]
async fn watch_listens_on_the_unlock_channel_only_while_a_redisson_client_holds() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let listeners = || redis.subscribers("redisson_lock__channel:{w}");
    let mut watch = client.watch("w").await.unwrap();
    assert!(!next(&mut watch).await.locked);
    let java = RedissonLock::new(&redis_client(&redis.url()).await, "w", &random_owner());
    for _ in 0..3 {
        let lease = client.lock("w").acquire().await.unwrap();
        watch_until(&mut watch, T, |s| s.locked).await;
        assert_eq!(listeners(), 0, "a latchkey holder: the Watch is no listener");
        let at = Instant::now();
        lease.release().await.unwrap();
        watch_until(&mut watch, T, |s| !s.locked).await;
        assert!(
            at.elapsed() < Duration::from_millis(950),
            "seen after {:?}",
            at.elapsed()
        );

        assert_eq!(java.try_lock(30_000).await, None, "redisson locks");
        watch_until(&mut watch, Duration::from_secs(3), |s| s.locked).await;
        let listening = latchkey_tests::poll_until(T, || listeners() == 1).await;
        assert!(listening, "a Redisson holder: the Watch listens for its release");
        let at = Instant::now();
        java.unlock().await;
        watch_until(&mut watch, T, |s| !s.locked).await;
        assert!(
            at.elapsed() < Duration::from_millis(950),
            "seen after {:?}",
            at.elapsed()
        );
        let left = latchkey_tests::poll_until(T, || listeners() == 0).await;
        assert!(left, "the Redisson holder gone, the Watch stops listening");
    }
}

/// A Redisson client announces nothing when it takes a free lock: Watch re-reads the
/// lock every second and shows the Java holder.
#[tokio::test]
async fn watch_shows_a_redisson_client_taking_a_free_lock() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let mut watch = server.client().await.watch("watched").await.unwrap();
    assert!(!next(&mut watch).await.locked);
    let conn = redis_client(&redis.url()).await;
    let owner = random_owner();
    let java = RedissonLock::new(&conn, "watched", &owner);
    assert_eq!(java.try_lock(30_000).await, None, "redisson locks");
    let state = tokio::time::timeout(Duration::from_secs(3), watch.next())
        .await
        .expect("a state within the second's re-read")
        .expect("stream ok")
        .expect("stream open");
    assert!(state.locked, "{state:?}");
    assert_eq!(state.holders[0].owner, owner);
}

/// Watch outlasts Redis not answering for a while (a restart, a failover, a pause): it
/// reads the lock again until Redis answers, and then tells what changed. It ended with
/// `UNAVAILABLE` on the first read that failed, at the moments leadership changes.
#[tokio::test]
async fn watch_outlasts_a_redis_pause() {
    let redis = RedisServer::start();
    let server = Latchkey::start_with(&redis.url(), &["--redis-timeout", "300ms"]).await;
    let client = server.client().await;
    let mut watch = client.watch("leader").await.unwrap();
    assert!(!next(&mut watch).await.locked);
    redis.cli(&["CLIENT", "PAUSE", "2000"]);
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let lease = client.lock("leader").acquire().await.unwrap();
    let state = tokio::time::timeout(Duration::from_secs(3), watch.next())
        .await
        .expect("a state in time")
        .expect("the stream is still open")
        .expect("not ended by the pause");
    assert!(state.locked, "{state:?}");
    lease.release().await.unwrap();
}

/// A Watch that joins another of the same lock while Redis does not answer ends with
/// `UNAVAILABLE`, as the lock's first Watch does when its first read fails; the Watch
/// that had a state outlasts the pause. The joiner waited, its stream open and silent,
/// until Redis answered again.
#[tokio::test]
async fn a_watch_joining_during_a_redis_pause_ends_unavailable() {
    let redis = RedisServer::start();
    let server = Latchkey::start_with(&redis.url(), &["--redis-timeout", "300ms"]).await;
    let client = server.client().await;
    let mut first = client.watch("paused").await.unwrap();
    assert!(!next(&mut first).await.locked);
    redis.cli(&["CLIENT", "PAUSE", "3000"]);
    let paused = Instant::now();
    let mut joiner = client.watch("paused").await.unwrap();
    let ended = tokio::time::timeout(Duration::from_secs(5), joiner.next())
        .await
        .expect("the joiner hears within the bound");
    let err = ended.expect_err("no state while Redis is paused");
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");
    assert!(
        paused.elapsed() < Duration::from_millis(2500),
        "told before the pause ended"
    );
    // Answered once the pause is over.
    redis.cli(&["PING"]);
    let lease = bounded(T, "a grant after the pause", client.lock("paused").acquire())
        .await
        .unwrap();
    let state = tokio::time::timeout(Duration::from_secs(3), first.next())
        .await
        .expect("a state in time")
        .expect("the first Watch is still open")
        .expect("not ended by the pause");
    assert!(state.locked, "{state:?}");
    lease.release().await.unwrap();
}

/// Watches nobody reads hold back no other call on their connection. A client's calls
/// share one HTTP/2 connection, whose window the server's data takes until it is read:
/// three unread watches of a lock whose state is over 2 MiB (each stream's window) took
/// the whole connection window (5 MiB), and a lease acquired on the same client never
/// heard `acquired` (the lock held, its stream renewed), nor a held lease `lost`.
#[tokio::test]
async fn unread_watches_hold_back_no_lease_on_their_connection() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let other = server.client().await;
    let many = "for i = 1, 2500 do redis.call('hset', KEYS[1], string.rep('o', 1000) .. i, 1) end \
        redis.call('pexpire', KEYS[1], 60000)";
    redis.cli(&["EVAL", many, "1", "big"]);
    let held = client.lock("held").acquire().await.unwrap();
    let mut watches = Vec::new();
    for _ in 0..3 {
        watches.push(client.watch("big").await.unwrap());
    }
    let lease = tokio::time::timeout(
        Duration::from_secs(5),
        client.lock("free").wait(Duration::from_secs(1)).acquire(),
    )
    .await
    .expect("acquired heard in time")
    .expect("acquired");
    assert!(other.force_release("held").await.unwrap());
    let reason = tokio::time::timeout(Duration::from_secs(5), held.lost())
        .await
        .expect("lost heard in time");
    assert_eq!(reason, latchkey_client::LostReason::ForceReleased);
    lease.release().await.unwrap();
    // Read at last, each watch has the lock's state.
    for watch in &mut watches {
        let state = watch.next().await.unwrap().expect("a state");
        assert_eq!(state.holders.len(), 2500);
    }
}

/// A bad name (empty, too long, a control character, a stray or whole-name hash tag, a
/// lock's record, a read lock's timeout key) is refused with `INVALID_ARGUMENT` naming
/// `name`.
#[tokio::test]
async fn watch_names_a_bad_name() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let long = "x".repeat(1025);
    let names = [
        "",
        "a\nb",
        long.as_str(),
        "{x}",
        "{}",
        "a{",
        "x}",
        "latchkey_semaphore:x",
        "latchkey_semaphore:{x}",
        "latchkey_hold:x",
        "a:rwlock_timeout:1",
    ];
    for name in names {
        let answer = match client.watch(name).await {
            Ok(mut watch) => tokio::time::timeout(Duration::from_secs(10), watch.next())
                .await
                .expect("answered")
                .map(|_| ()),
            Err(e) => Err(e),
        };
        let err = answer.expect_err(&format!("{name:?} refused"));
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{name:?}: {err}");
        assert!(err.to_string().contains("name"), "{name:?}: {err}");
    }
}

/// A semaphore's holders show as they come and go, and after Redis restarts empty the
/// semaphore shows free, then its next holder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_follows_a_semaphore_through_a_redis_restart() {
    let mut redis = RedisServer::start();
    let args = ["--watchdog-timeout", "1500ms", "--redis-timeout", "300ms"];
    let server = Latchkey::start_with(&redis.url(), &args).await;
    let client = server.client().await;
    let semaphore = |permits| client.lock("w").kind(LockKind::Semaphore).limit(3).permits(permits);
    let mut watch = client.watch("w").await.unwrap();
    assert!(!next(&mut watch).await.locked);
    let one = semaphore(1).acquire().await.unwrap();
    assert_eq!(next(&mut watch).await.holders.len(), 1);
    let two = semaphore(2).acquire().await.unwrap();
    let state = next(&mut watch).await;
    assert_eq!(state.holders.iter().map(|h| h.hold_count).sum::<u32>(), 3, "{state:?}");
    one.release().await.unwrap();
    assert_eq!(next(&mut watch).await.holders.len(), 1);
    redis.restart();
    // Reads that fail while Redis is away are retried; the first answer after is free.
    let mut free = false;
    for _ in 0..10 {
        let state = tokio::time::timeout(Duration::from_secs(5), watch.next())
            .await
            .expect("a state");
        if !state.expect("stream ok").expect("stream open").locked {
            free = true;
            break;
        }
    }
    assert!(free, "the semaphore shows free after the restart");
    tokio::time::timeout(Duration::from_secs(10), two.lost())
        .await
        .expect("the holder is told lost");
    let three = semaphore(3).acquire().await.unwrap();
    let state = next(&mut watch).await;
    assert!(state.locked && state.holders[0].hold_count == 3, "{state:?}");
    three.release().await.unwrap();
}

/// A Watch of a name that never existed shows one free state, of no kind and with no
/// token, and nothing more while nothing happens (its re-reads every second tell
/// nothing new).
#[tokio::test]
async fn watch_of_a_name_that_never_existed() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let mut watch = client.watch("never/existed").await.unwrap();
    let state = next(&mut watch).await;
    assert!(!state.locked);
    assert_eq!(state.kind, LockKind::Unspecified as i32);
    assert_eq!(state.last_fencing_token, 0);
    let more = tokio::time::timeout(Duration::from_millis(2500), watch.next()).await;
    assert!(more.is_err(), "a state with no change: {more:?}");
}

/// A semaphore hold of a server that crashed runs out with no message: a Watch from
/// another server shows the semaphore free within the hold's lease (1.5 s) and the
/// Watch's re-read every second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_sees_a_crashed_servers_semaphore_hold_run_out() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let mut process = LatchkeyProcess::spawn(&[
        "--redis-url".to_owned(),
        redis.url(),
        "--no-metrics".to_owned(),
        "--watchdog-timeout".to_owned(),
        "1500ms".to_owned(),
    ]);
    let remote = Client::connect(&process.endpoint())
        .await
        .expect("connect to the process");
    let mut watch = client.watch("crashw").await.unwrap();
    assert!(!next(&mut watch).await.locked);
    let held = semaphore(&remote, "crashw", 2, 1).acquire().await.unwrap();
    watch_until(&mut watch, T, |s| s.locked).await;
    process.kill();
    let killed = Instant::now();
    watch_until(&mut watch, Duration::from_secs(5), |s| !s.locked).await;
    assert!(killed.elapsed() < Duration::from_secs(4), "took {:?}", killed.elapsed());
    drop(held);
}

/// Many watchers of one name, on two servers, all end on the final state (free, the
/// last grant's token) after a burst of mutex and semaphore grants and releases.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_watchers_all_see_the_final_release() {
    let redis = RedisServer::start();
    let a = Latchkey::start(&redis.url()).await;
    let b = Latchkey::start(&redis.url()).await;
    let (ca, cb) = (a.client().await, b.client().await);
    let mut watches = Vec::new();
    for i in 0..40 {
        let c = if i % 2 == 0 { &ca } else { &cb };
        let mut w = c.watch("many").await.unwrap();
        assert!(!next(&mut w).await.locked);
        watches.push(w);
    }
    let mut last = 0;
    for i in 0..30u32 {
        let c = if i % 2 == 0 { &ca } else { &cb };
        let lease = if i % 3 == 0 {
            semaphore(c, "many", 2, 1 + i % 2).acquire().await.unwrap()
        } else {
            c.lock("many").acquire().await.unwrap()
        };
        last = lease.fencing_token();
        lease.release().await.unwrap();
    }
    for w in &mut watches {
        watch_until(w, Duration::from_secs(5), |s| !s.locked && s.last_fencing_token == last).await;
    }
}

/// A watcher that does not read while a lock changes 200 times, then reads, reaches
/// the final state (free, the last token): its stream stays open and the states it was
/// not ready for do not hide the last one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raw_watcher_that_stops_reading_reaches_the_final_state() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let mut raw = server.raw().await;
    let mut states = raw
        .watch(WatchRequest { name: "slow".into() })
        .await
        .unwrap()
        .into_inner();
    let first = bounded(T, "the first state", states.message()).await.unwrap().unwrap();
    assert!(!first.locked);
    let mut last = 0;
    for i in 0..200u32 {
        let lease = if i % 2 == 0 {
            semaphore(&client, "slow", 3, 1).acquire().await.unwrap()
        } else {
            client.lock("slow").acquire().await.unwrap()
        };
        last = lease.fencing_token();
        lease.release().await.unwrap();
    }
    // The final state comes, after at most the buffered older ones.
    let deadline = Instant::now() + T;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let state = tokio::time::timeout(left, states.message())
            .await
            .expect("the final state in time")
            .expect("stream ok")
            .expect("stream open");
        if !state.locked && state.last_fencing_token == last {
            break;
        }
    }
}

/// A hot mutex whose waiters all wait on one server (passed in memory between them,
/// recorded behind), watched from that server: every token a state shows was some
/// stream's grant (never a reserved top or a ForceRelease floor), and the last state
/// is free with the last grant's token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_never_shows_a_token_nobody_was_granted() {
    use std::collections::HashSet;
    use std::sync::{Arc, Mutex};
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let mut watch = client.watch("hot").await.unwrap();
    assert!(!next(&mut watch).await.locked);
    // Each state's (locked, last fencing token).
    let seen = Arc::new(Mutex::new(Vec::<(bool, u64)>::new()));
    let reader = {
        let seen = seen.clone();
        tokio::spawn(async move {
            while let Ok(Some(state)) = watch.next().await {
                let mut seen = seen.lock().unwrap();
                seen.push((state.locked, state.last_fencing_token));
                if seen.len() > 100_000 {
                    break;
                }
            }
        })
    };
    let granted = Arc::new(Mutex::new(HashSet::<u64>::new()));
    let last = Arc::new(Mutex::new(0u64));
    let mut tasks = Vec::new();
    for _ in 0..6 {
        let (client, granted, last) = (client.clone(), granted.clone(), last.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..60 {
                let lease = client.lock("hot").wait(T).acquire().await.expect("granted");
                granted.lock().unwrap().insert(lease.fencing_token());
                *last.lock().unwrap() = lease.fencing_token();
                tokio::time::sleep(Duration::from_millis(1)).await;
                lease.release().await.expect("released");
            }
        }));
    }
    for t in tasks {
        bounded(Duration::from_secs(60), "the hot loop", t).await.unwrap();
    }
    let final_token = *last.lock().unwrap();
    // Free, with the last grant's token.
    let reached = || seen.lock().unwrap().last() == Some(&(false, final_token));
    assert!(poll_until(T, reached).await, "the watch reaches the final state");
    reader.abort();
    let seen = seen.lock().unwrap().clone();
    let granted = granted.lock().unwrap().clone();
    let strange: Vec<u64> = seen
        .iter()
        .map(|(_, t)| *t)
        .filter(|t| *t != 0 && !granted.contains(t))
        .collect();
    assert!(
        strange.is_empty(),
        "tokens shown that no stream was granted: {strange:?} (of {} states)",
        seen.len()
    );
    let state = client.describe("hot").await.unwrap();
    assert!(!state.locked);
    assert_eq!(state.last_fencing_token, final_token, "{state:?}");
}

/// Watches opened on many names and cancelled at random moments (before, during or
/// after their first state) leave no subscription behind in Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_watches_leave_no_subscription() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let raw = server.raw().await;
    let mut tasks = Vec::new();
    for i in 0..300u32 {
        let mut raw = raw.clone();
        tasks.push(tokio::spawn(async move {
            let name = format!("gone/{i}");
            let delay = Duration::from_millis(u64::from(i % 31));
            let call = async {
                let states = raw.watch(WatchRequest { name }).await.expect("the watch is answered");
                let _ = states.into_inner().message().await;
                tokio::time::sleep(Duration::from_millis(5)).await;
            };
            let _ = tokio::time::timeout(delay, call).await;
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let mut last = String::new();
    let clean = latchkey_tests::poll_until(Duration::from_secs(12), || {
        last = redis.cli(&["PUBSUB", "CHANNELS", "*"]);
        last.lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .all(|l| l.ends_with("latchkey:force_release"))
    })
    .await;
    assert!(clean, "subscriptions left: {last}");
}

/// Under a key prefix, with a hash tag (`{app}:`) or without (`app:`), Watch and
/// semaphore waiters hear changes by pub/sub (well under the 1 s re-read): the channels
/// the scripts publish on are the ones the server subscribes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tagged_key_prefix_keeps_watch_and_semaphore_wakeups_prompt() {
    for prefix in ["{app}:", "app:"] {
        let redis = RedisServer::start();
        let a = Latchkey::start_with(&redis.url(), &["--key-prefix", prefix]).await;
        let b = Latchkey::start_with(&redis.url(), &["--key-prefix", prefix]).await;
        let (ca, cb) = (a.client().await, b.client().await);
        for name in ["x", "y{t}z"] {
            let mut watch = cb.watch(name).await.unwrap();
            assert!(!next(&mut watch).await.locked);
            for _ in 0..5 {
                let at = Instant::now();
                let held = semaphore(&ca, name, 2, 2).acquire().await.unwrap();
                watch_until(&mut watch, T, |s| s.locked).await;
                assert!(
                    at.elapsed() < Duration::from_millis(950),
                    "{prefix}{name}: grant seen after {:?}",
                    at.elapsed()
                );
                let (waiter, _) = spawn_queued(semaphore(&cb, name, 2, 1).wait(T), T).await;
                let at = Instant::now();
                held.release().await.unwrap();
                let w = bounded(T, "the waiter", waiter).await.unwrap().expect("granted");
                assert!(
                    at.elapsed() < Duration::from_millis(950),
                    "{prefix}{name}: waiter woken after {:?}",
                    at.elapsed()
                );
                w.release().await.unwrap();
                watch_until(&mut watch, T, |s| !s.locked).await;
            }
        }
    }
}

/// The `describe.lua` reads the server whose metrics listen on `port` made so far.
fn describe_reads(port: u16) -> f64 {
    let scrape = latchkey_tests::scrape_metrics(port);
    scrape
        .lines()
        .find_map(|l| l.strip_prefix("latchkey_redis_command_seconds_count{script=\"describe\"} "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .unwrap_or(0.0)
}

/// Watchers of one name on one server share one reader: each change costs the server
/// one `describe.lua` read however many watch it (and so does each re-read at rest),
/// not one per watcher. 50 watchers of 100 grant/release cycles (200 changes) cost at
/// most 1000 reads. The counts go to the output (run with --no-capture).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watchers_of_one_name_share_one_read_per_change() {
    let redis = RedisServer::start();
    let process = LatchkeyProcess::start(&redis.url());
    let port = process.metrics_port().expect("metrics");
    let describes = || describe_reads(port);
    let client = process.serving_client().await;
    let alone = Instant::now();
    for _ in 0..100 {
        client.lock("shared").acquire().await.unwrap().release().await.unwrap();
    }
    println!("no watcher: 100 grant/release cycles in {:?}", alone.elapsed());
    let mut watches = Vec::new();
    for _ in 0..50 {
        let mut w = client.watch("shared").await.unwrap();
        next_state(&mut w, T).await;
        watches.push(w);
    }
    let before = describes();
    let started = Instant::now();
    for _ in 0..100 {
        client.lock("shared").acquire().await.unwrap().release().await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let during = describes() - before;
    let took = started.elapsed();
    let rest_before = describes();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let at_rest = describes() - rest_before;
    println!(
        "50 watchers, 100 grant/release cycles in {took:?}: {during} describe calls; at rest: {} per second",
        at_rest / 3.0
    );
    drop(watches);
    // 200 changes: a read per change (and a few for timers) is about 200; a read per
    // watcher would be 50 times that.
    assert!(
        during <= 1000.0,
        "{during} describe calls for 200 changes watched 50 times on one server (the loop took {took:?})"
    );
}

/// A watcher that joins a lock others already watch on its server gets as its first
/// state one read after it asked, not the shared reader's last: a client that took
/// the lock just before asking to watch sees itself holding it, and its token.
#[tokio::test]
async fn a_watcher_joining_a_watched_lock_starts_from_a_fresh_state() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let mut first = client.watch("joined").await.unwrap();
    assert!(!next(&mut first).await.locked);
    for round in 0..20 {
        let lease = client.lock("joined").acquire().await.unwrap();
        let mut joining = client.watch("joined").await.unwrap();
        let state = next(&mut joining).await;
        assert!(state.locked, "round {round}: the first state is from before the grant");
        assert_eq!(state.last_fencing_token, lease.fencing_token(), "round {round}");
        lease.release().await.unwrap();
        drop(joining);
    }
}

/// A watcher joining while the lock's reader has a read out starts from a read made
/// after it joined: the read out may have been answered before what the client did
/// just before it asked to watch (here, the release of the hold that read shows). The
/// proxy answers the reads that show the hold late, so one is out when the release
/// lands and the joiner comes.
#[tokio::test]
async fn a_watcher_joining_during_a_read_starts_from_one_made_after() {
    let redis = RedisServer::start();
    let proxy = Proxy::to_redis(&redis).await;
    let server = Latchkey::start(&proxy.redis_url()).await;
    let client = server.client().await;
    let mut first = client.watch("joined").await.unwrap();
    assert!(!next(&mut first).await.locked);
    proxy.hold_back_replies_matching(Some((b"slow-read-holder", Duration::from_millis(1500))));
    let lease = client.lock("joined").owner("slow-read-holder").acquire().await.unwrap();
    assert!(
        poll_until(T, || proxy.holding() > 0).await,
        "the read that shows the hold is out"
    );
    let release = tokio::spawn(lease.release());
    assert!(
        poll_until(T, || redis.cli(&["EXISTS", "joined"]).trim() == "0").await,
        "released in Redis"
    );
    let mut joining = client.watch("joined").await.unwrap();
    let state = next_state(&mut joining, Duration::from_secs(5)).await;
    assert!(
        !state.locked,
        "the first state shows a hold released before the joiner came: {state:?}"
    );
    bounded(T, "the release's answer", release).await.unwrap().unwrap();
}

/// A reader rests after each read four times as long as the read took: a lock that
/// changes all the time (a fair lock of thousands of waiters changes at every join,
/// leave and grant, and each read of its queue costs Redis a millisecond and more) is
/// not read back to back. Redis reached through a proxy that holds each chunk 40 ms
/// makes a read take 80 ms and more: changes announced every 10 ms for 3 s, read back
/// to back, made about 35 reads; resting, about 8. The watch still follows: a grant
/// after them shows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_of_a_lock_that_changes_all_the_time_rests_between_reads() {
    let redis = RedisServer::start();
    let proxy = Proxy::to_redis(&redis).await;
    let process = LatchkeyProcess::start(&proxy.redis_url());
    let port = process.metrics_port().expect("metrics");
    let describes = || describe_reads(port);
    let client = process.serving_client().await;
    let mut watch = client.watch("busy").await.unwrap();
    assert!(!next_state(&mut watch, T).await.locked);
    proxy.set_delay(Duration::from_millis(40));
    let publisher = redis_client(&redis.url()).await;
    let channel = latchkey_server::keys::Keys::default().lock("busy").watch();
    let before = describes();
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(3) {
        let _: i64 = publisher.publish(&channel, "1").await.unwrap();
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let reads = describes() - before;
    println!("changes every 10 ms for 3 s, reads 80 ms and more: {reads} reads");
    assert!(
        (2.0..=15.0).contains(&reads),
        "{reads} reads in 3 s of reads taking 80 ms and more"
    );
    proxy.set_delay(Duration::ZERO);
    let _held = client.lock("busy").acquire().await.unwrap();
    watch_until(&mut watch, T, |s| s.locked).await;
}

/// A Watch's reader whose read waits on a Redis that does not answer ends when its last
/// follower leaves, and its subscriptions with it: it kept them, waiting, until the
/// Redis timeout, and every Watch of the name opened and dropped meanwhile started
/// one more reader.
#[tokio::test]
async fn a_reader_waiting_on_a_silent_redis_leaves_with_its_last_follower() {
    let redis = RedisServer::start();
    let proxy = Proxy::to_redis(&redis).await;
    let server = Latchkey::start_with(&proxy.redis_url(), &["--redis-timeout", "30s"]).await;
    let client = server.client().await;
    let mut watch = client.watch("silent").await.unwrap();
    assert!(!next(&mut watch).await.locked);
    let describe = latchkey_server::scripts::Scripts::new(false).describe;
    proxy.hold_back_matching(Some((describe.sha().as_bytes(), Duration::from_secs(20))));
    // The reader reads again within a second (its quiet re-read), and that read waits.
    assert!(poll_until(T, || proxy.holding() > 0).await, "a read held back");
    drop(watch);
    let mut channels = String::new();
    let left = poll_until(Duration::from_secs(5), || {
        channels = redis.cli(&["PUBSUB", "CHANNELS", "*silent*"]);
        channels.trim().is_empty()
    })
    .await;
    proxy.hold_back_matching(None);
    assert!(left, "the reader's subscriptions stayed: {channels}");
}
