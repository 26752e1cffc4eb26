//! Ending a server: SIGTERM, SIGINT and SIGHUP release every lease at once and tell streams
//! `lost{SHUTDOWN}`; a crashed server's leases end within the watchdog timeout; a
//! SIGTERM while the server starts stops it, as a container's PID 1 too.

use latchkey_client::{LockKind, LostReason};
use latchkey_tests::server::{claims_reach, health_watch, spawn_queued, Latchkey};
use latchkey_tests::{bounded, LatchkeyProcess, RedisServer};
use latchkey_tests::{free_port, metric, poll_until, scrape_metrics};
use std::net::TcpListener;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use tonic::Code;

const T: Duration = Duration::from_secs(10);

/// The give-back of an unclaimed grant logs at `debug` (routine when waiters leave),
/// which the tests below look for.
const GIVE_BACKS_LOGGED: (&str, &str) = ("RUST_LOG", "info,latchkey_server::lock::handoff=debug");

fn spawn(redis: &RedisServer, extra: &[&str]) -> LatchkeyProcess {
    let mut args = vec!["--redis-url".to_owned(), redis.url(), "--no-metrics".to_owned()];
    args.extend(extra.iter().map(|a| a.to_string()));
    LatchkeyProcess::spawn_with_env(&args, &[GIVE_BACKS_LOGGED])
}

#[tokio::test]
async fn sigterm_releases_every_lease_and_says_shutdown() {
    let redis = RedisServer::start();
    // One worker thread (--worker-threads): the shutdown release needs no second one.
    let mut server = spawn(&redis, &["--worker-threads", "1"]);
    let client = server.serving_client().await;
    assert!(
        server.log().contains("workers=1"),
        "--worker-threads 1 runs one worker:\n{}",
        server.log_tail()
    );
    let mut leases = Vec::new();
    for i in 0..5 {
        leases.push(client.lock(format!("held/{i}")).acquire().await.unwrap());
    }
    let waiter = {
        let client = client.clone();
        tokio::spawn(async move { client.lock("held/0").wait(T).acquire().await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    server.terminate();
    for lease in &leases {
        let reason = tokio::time::timeout(T, lease.lost()).await.expect("told");
        assert_eq!(reason, LostReason::Shutdown);
    }
    let err = bounded(T, "the waiter", waiter).await.unwrap().unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err}");
    let status = server.wait_exit(T).expect("exits");
    assert!(status.success(), "exit status {status}\n{}", server.log_tail());
    // Nothing left for a TTL to clean up.
    for i in 0..5 {
        assert_eq!(redis.cli(&["EXISTS", &format!("held/{i}")]).trim(), "0");
    }
}

/// SIGTERM with a hold of every kind (a multi-lock too), waiters of three kinds (a fair
/// waiter in Redisson's queue) and a Watch: every holder is told `lost{SHUTDOWN}`,
/// every waiter and the watch end `UNAVAILABLE`, the process exits 0 within the
/// documented 15 s, and Redis keeps no lock, queue entry, semaphore or read timeout
/// key, only fencing counters (and hold records' tombstones, which expire). The
/// mutex's release passes over its waiter here, which is ending: nothing is granted
/// and given back, and no passing marker stays.
#[tokio::test]
async fn sigterm_ends_holders_waiters_and_watches_of_every_kind_and_leaves_no_lock() {
    let redis = RedisServer::start();
    let mut server = spawn(&redis, &[]);
    let client = server.serving_client().await;
    let mut leases = Vec::new();
    for (name, kind) in [
        ("sd/mutex", LockKind::Mutex),
        ("sd/fair", LockKind::Fair),
        ("sd/read", LockKind::Read),
        ("sd/write", LockKind::Write),
    ] {
        leases.push(client.lock(name).kind(kind).acquire().await.expect("granted"));
    }
    leases.push(
        client
            .lock("sd/sem")
            .kind(LockKind::Semaphore)
            .limit(2)
            .acquire()
            .await
            .expect("granted"),
    );
    leases.push(client.lock_all(["sd/m1", "sd/{t}m2"]).acquire().await.expect("granted"));
    let other = server.serving_client().await;
    let (fair, _) = spawn_queued(other.lock("sd/fair").kind(LockKind::Fair), T).await;
    let (mutex, _) = spawn_queued(other.lock("sd/mutex"), T).await;
    let (sem, _) = spawn_queued(other.lock("sd/sem").kind(LockKind::Semaphore).limit(2).permits(2), T).await;
    let mut watch = other.watch("sd/mutex").await.expect("watch");
    assert!(watch.next().await.expect("a state").expect("one").locked);
    let queue = redis.cli(&["LRANGE", "redisson_lock_queue:{sd/fair}", "0", "-1"]);
    assert!(!queue.trim().is_empty(), "the fair waiter is in the queue");

    let asked = Instant::now();
    server.terminate();
    for lease in &leases {
        let reason = bounded(T, "a holder's notice", lease.lost()).await;
        assert_eq!(reason, LostReason::Shutdown, "{}", lease.name());
    }
    for (what, waiter) in [("fair", fair), ("mutex", mutex), ("semaphore", sem)] {
        let err = bounded(T, what, waiter)
            .await
            .unwrap()
            .expect_err("no grant at shutdown");
        assert_eq!(err.code(), Code::Unavailable, "{what}: {err}");
    }
    let watched = bounded(T, "the watch's end", async {
        loop {
            match watch.next().await {
                Ok(Some(_)) => continue,
                other => return other,
            }
        }
    })
    .await;
    let err = watched.expect_err("the watch ends refused");
    assert_eq!(err.code(), Code::Unavailable, "{err}");
    let status = server.wait_exit(Duration::from_secs(20)).expect("exits");
    assert!(status.success(), "{status}\n{}", server.log_tail());
    assert!(asked.elapsed() < Duration::from_secs(15), "{:?}", asked.elapsed());
    assert!(
        !server.log().contains("gave back an unclaimed grant"),
        "a release at shutdown granted this server's own waiter:\n{}",
        server.log_tail()
    );

    let keys = redis.cli(&["KEYS", "*"]);
    // A semaphore's record may stay with only when its waiters were told to look
    // again (`told`), expiring then: it holds no permit.
    let told_only = |k: &str| {
        k.starts_with("latchkey_semaphore:")
            && redis.cli(&["HKEYS", k]).trim() == "told"
            && redis.cli(&["PTTL", k]).trim().parse::<i64>().unwrap_or(-3) > 0
    };
    // Markers that expire: hold records' tombstones. (A mutex's passing marker would
    // say that the release at shutdown granted the claim of this server's waiter, given
    // back at once.)
    let expiring = |k: &str| k.starts_with("latchkey_hold");
    let left: Vec<&str> = keys
        .lines()
        .map(str::trim)
        .filter(|k| !k.is_empty())
        .filter(|k| !k.starts_with("latchkey_fence") && !expiring(k) && !told_only(k))
        .collect();
    assert!(left.is_empty(), "left behind for a TTL: {left:?}");
    for marker in keys.lines().map(str::trim).filter(|k| expiring(k)) {
        let ttl: i64 = redis.cli(&["PTTL", marker]).trim().parse().unwrap_or(-3);
        assert!(ttl > 0, "{marker} would stay for good ({ttl})");
    }
}

/// A release at shutdown passes over the claim of the server's own waiter, which is
/// ending too: the lock is left free with Redisson's unlock message, not granted to
/// that waiter and given back, and no passing marker stays.
#[tokio::test]
async fn a_release_at_shutdown_grants_no_claim_of_the_servers_own_waiter() {
    let redis = RedisServer::start();
    let mut server = spawn(&redis, &[]);
    let client = server.serving_client().await;
    let lease = client.lock("sd/own").acquire().await.expect("granted");
    let (waiter, _) = spawn_queued(client.lock("sd/own"), T).await;
    claims_reach(&redis, "sd/own", 1).await;
    server.terminate();
    assert_eq!(
        bounded(T, "the holder's notice", lease.lost()).await,
        LostReason::Shutdown
    );
    let err = bounded(T, "the waiter", waiter)
        .await
        .unwrap()
        .expect_err("no grant at shutdown");
    assert_eq!(err.code(), Code::Unavailable, "{err}");
    assert!(server.wait_exit(T).expect("exits").success(), "{}", server.log_tail());
    assert!(
        !server.log().contains("gave back an unclaimed grant"),
        "the release granted this server's own waiter:\n{}",
        server.log_tail()
    );
    assert_eq!(
        redis.cli(&["EXISTS", "sd/own", "latchkey_passing:{sd/own}"]).trim(),
        "0"
    );
}

/// A waiter whose first try was out when the shutdown began ends `UNAVAILABLE` once
/// that try answers: no subscription (the hub no longer subscribes: it waited its whole
/// second) and no second try after it.
#[tokio::test]
async fn a_waiter_whose_try_was_out_at_shutdown_ends_at_its_answer() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    redis.cli(&["HSET", "sd/out", "elsewhere:1", "1"]);
    redis.cli(&["PEXPIRE", "sd/out", "60000"]);
    redis.freeze();
    let waiter = tokio::spawn(async move { client.lock("sd/out").wait(T).acquire().await });
    // The try goes out and waits on the frozen Redis.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let stopping = tokio::spawn(server.stop());
    tokio::time::sleep(Duration::from_millis(100)).await;
    redis.resume();
    let resumed = Instant::now();
    let err = bounded(T, "the waiter", waiter).await.unwrap().expect_err("busy");
    let took = resumed.elapsed();
    assert_eq!(err.code(), Code::Unavailable, "{err}");
    assert!(
        took < Duration::from_millis(800),
        "ended {took:?} after the try's answer"
    );
    bounded(T, "the stop", stopping).await.unwrap();
}

/// A stream that reaches a full server as its shutdown begins is told the server is
/// going away (`UNAVAILABLE` `SHUTTING_DOWN`), as a Watch is. It was told
/// `RESOURCE_EXHAUSTED` (`--max-streams`), which a client that tries another replica on
/// `UNAVAILABLE` took for a failure of its own. Streams still reach the server until
/// their client acknowledges the shutdown's PING (held back here), and a waiter whose
/// try is out on a frozen Redis keeps its place meanwhile.
#[tokio::test]
async fn a_stream_that_reaches_a_full_server_at_shutdown_is_told_it_is_going_away() {
    let redis = RedisServer::start();
    let server = Latchkey::start_with(&redis.url(), &["--max-streams", "1"]).await;
    let client = server.client().await;
    let proxy = latchkey_tests::proxy::Proxy::start(server.endpoint().trim_start_matches("http://")).await;
    let far = latchkey_client::Client::connect(&proxy.endpoint()).await.unwrap();
    far.describe("sd/full").await.expect("connected");
    redis.cli(&["HSET", "sd/full", "elsewhere:1", "1"]);
    redis.cli(&["PEXPIRE", "sd/full", "60000"]);
    redis.freeze();
    let waiter = tokio::spawn(async move { client.lock("sd/full").wait(T).acquire().await });
    // The try goes out and waits on the frozen Redis.
    tokio::time::sleep(Duration::from_millis(300)).await;
    // h2's shutdown PING (its payload), and what follows it, reach `far` late.
    let ping = [0x0b, 0x7b, 0xa2, 0xf0, 0x8b, 0x9b, 0xfe, 0x54];
    proxy.hold_back_replies_matching(Some((&ping, Duration::from_secs(3))));
    let stopping = tokio::spawn(server.stop());
    assert!(poll_until(T, || proxy.holding() > 0).await, "the PING held back");
    let err = far.lock("sd/other").try_once().acquire().await.unwrap_err();
    redis.resume();
    assert_eq!(err.code(), Code::Unavailable, "{err}");
    assert_eq!(err.reason().as_deref(), Some("SHUTTING_DOWN"), "{err}");
    bounded(T, "the waiter", waiter).await.unwrap().expect_err("ended");
    bounded(T, "the stop", stopping).await.unwrap();
}

/// The cut of a shutdown whose streams did not end in time spares the connections
/// that carry none: a ForceRelease under way on another connection (Redis frozen past
/// the cut) is answered once Redis is back. Every connection was cut: the call failed
/// while the server broke the lock.
#[tokio::test]
async fn the_shutdown_cut_spares_connections_without_streams() {
    let redis = RedisServer::start();
    let args = ["--redis-url", &redis.url(), "--redis-timeout", "8s"].map(String::from);
    let mut server = LatchkeyProcess::spawn(&args);
    let (streams, admin) = (server.serving_client().await, server.serving_client().await);
    redis.cli(&["HSET", "sd/cut", "elsewhere:1", "1"]);
    redis.cli(&["PEXPIRE", "sd/cut", "60000"]);
    redis.freeze();
    let waiter = tokio::spawn(async move { streams.lock("sd/cut").wait(T).acquire().await });
    let breaking = tokio::spawn(async move { admin.force_release("sd/cut").await });
    // Both calls reach the server, and wait on the frozen Redis, before the shutdown.
    let port = server.metrics_port().expect("metrics");
    let arrived = poll_until(T, || {
        let scrape = scrape_metrics(port);
        metric(&scrape, r#"latchkey_rpc_started_total{method="ForceRelease"}"#) == Some(1.0)
            && metric(&scrape, "latchkey_streams_open") == Some(1.0)
    })
    .await;
    assert!(arrived, "both calls reach the server");
    server.terminate();
    let cut = poll_until(T, || server.log().contains("cutting their connections")).await;
    redis.resume();
    assert!(
        cut,
        "the waiter's stream did not end: its connection is cut\n{}",
        server.log_tail()
    );
    let released = bounded(T, "the ForceRelease", breaking).await.unwrap();
    assert_eq!(released.map_err(|e| e.to_string()), Ok(true), "{}", server.log_tail());
    let err = bounded(T, "the waiter", waiter).await.unwrap().expect_err("cut");
    assert_eq!(err.code(), Code::Unavailable, "{err}");
    assert!(server.wait_exit(T).expect("exits").success(), "{}", server.log_tail());
}

/// SIGINT and SIGHUP stop the server as SIGTERM does. SIGHUP (a closed terminal)
/// killed it without a release: its locks were held until their leases ran out.
#[tokio::test]
async fn sigint_and_sighup_are_graceful_too() {
    let redis = RedisServer::start();
    for (name, send) in [
        ("int", LatchkeyProcess::interrupt as fn(&mut LatchkeyProcess)),
        ("hup", LatchkeyProcess::hang_up),
    ] {
        if name == "hup" && sighup_ignored_here() {
            eprintln!("SIGHUP skipped: these tests run with it ignored (nohup), as the server then leaves it");
            continue;
        }
        let mut server = spawn(&redis, &[]);
        let client = server.serving_client().await;
        let lease = client.lock(name).acquire().await.unwrap();
        send(&mut server);
        assert_eq!(
            tokio::time::timeout(T, lease.lost()).await.unwrap(),
            LostReason::Shutdown,
            "{name}"
        );
        let exit = server.wait_exit(T).expect("exits");
        assert!(exit.success(), "{name}: {exit:?}\n{}", server.log_tail());
        assert_eq!(redis.cli(&["EXISTS", name]).trim(), "0", "{name}");
    }
}

#[tokio::test]
async fn in_process_stop_refuses_new_streams_and_releases() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let lease = client.lock("stop").acquire().await.unwrap();
    server.stop().await;
    assert_eq!(
        tokio::time::timeout(T, lease.lost()).await.unwrap(),
        LostReason::Shutdown
    );
    assert_eq!(redis.cli(&["EXISTS", "stop"]).trim(), "0");
}

/// A holder's release at shutdown grants no waiter of the same server: that waiter's
/// stream ends with the server's, so its grant would only be told `lost{SHUTDOWN}`. It
/// ends `UNAVAILABLE` as every waiter does, mutex and fair alike (passed in memory or
/// handed off in Redis, the race was lost about one shutdown in ten).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_grants_no_waiter_of_its_own() {
    let redis = RedisServer::start();
    for round in 0..12 {
        let kind = if round % 2 == 0 {
            LockKind::Mutex
        } else {
            LockKind::Fair
        };
        let server = Latchkey::start(&redis.url()).await;
        let client = server.client().await;
        let name = format!("shutdown-handoff/{round}");
        let _lease = client.lock(name.as_str()).kind(kind).acquire().await.unwrap();
        let (waiter, _) = spawn_queued(client.lock(name.as_str()).kind(kind), T).await;
        server.stop().await;
        match bounded(T, "the waiter's end", waiter).await.unwrap() {
            Ok(lease) => panic!(
                "round {round} ({kind:?}): granted token {} at shutdown",
                lease.fencing_token()
            ),
            Err(e) => assert_eq!(e.code(), Code::Unavailable, "round {round}: {e}"),
        }
        assert_eq!(redis.cli(&["EXISTS", &name]).trim(), "0", "round {round}");
    }
}

#[tokio::test]
async fn a_crashed_servers_leases_end_within_the_watchdog_timeout() {
    let redis = RedisServer::start();
    let mut crashing = spawn(&redis, &["--watchdog-timeout", "1500ms"]);
    let survivor = Latchkey::start(&redis.url()).await;
    let lease = crashing.serving_client().await.lock("crash").acquire().await.unwrap();
    let other = survivor.client().await;
    let waiter = tokio::spawn(async move { other.lock("crash").wait(T).acquire().await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    crashing.kill();
    let killed = Instant::now();
    bounded(T, "the waiter", waiter)
        .await
        .unwrap()
        .expect("the survivor's waiter acquires");
    assert!(
        killed.elapsed() < Duration::from_millis(1500 + 1000),
        "{:?}",
        killed.elapsed()
    );
    drop(lease);
}

/// With Redis frozen, the releases of a shutdown cannot finish: the server still exits
/// within its bounds (10 s for streams and background releases together, 2 s for
/// connections, 2 s for its Redis connections), not one bound after the other.
#[tokio::test]
async fn a_shutdown_with_redis_frozen_exits_within_its_bounds() {
    use nix::sys::signal::{kill, Signal};
    let redis = RedisServer::start();
    // Each release waits out the Redis timeout before it goes to the background.
    let mut server = spawn(&redis, &["--redis-timeout", "8s"]);
    let client = server.serving_client().await;
    let mut leases = Vec::new();
    for i in 0..3 {
        leases.push(client.lock(format!("frozen/{i}")).acquire().await.unwrap());
    }
    let redis_pid = nix::unistd::Pid::from_raw(redis.pid().expect("running") as i32);
    kill(redis_pid, Signal::SIGSTOP).expect("freeze redis");
    let asked = Instant::now();
    server.terminate();
    let exited = server.wait_exit(Duration::from_secs(30));
    let took = asked.elapsed();
    kill(redis_pid, Signal::SIGCONT).expect("thaw redis");
    assert!(exited.is_some(), "exits\n{}", server.log_tail());
    assert!(took < Duration::from_secs(16), "took {took:?}\n{}", server.log_tail());
}

/// A Watch client that stopped reading fills its stream: shutdown does not wait on it
/// (it waited the whole 10 s drain for the stream's next state to find room).
#[tokio::test]
async fn a_watch_that_stopped_reading_does_not_hold_up_shutdown() {
    use latchkey_proto::v1::lock_service_client::LockServiceClient;
    use latchkey_proto::v1::WatchRequest;
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    // A small HTTP/2 window, so a few states fill what the client takes unread.
    let channel = tonic::transport::Endpoint::from_shared(server.endpoint().to_owned())
        .unwrap()
        .initial_stream_window_size(Some(1024))
        .connect()
        .await
        .unwrap();
    let watch = LockServiceClient::new(channel)
        .watch(WatchRequest { name: "busy".into() })
        .await
        .expect("watching");
    let client = server.client().await;
    // Each cycle is a change or two of the watched lock; none of them is read.
    for _ in 0..200 {
        client.lock("busy").acquire().await.unwrap().release().await.unwrap();
    }
    let asked = Instant::now();
    tokio::time::timeout(T, server.stop()).await.expect("stopped");
    assert!(asked.elapsed() < Duration::from_secs(5), "{:?}", asked.elapsed());
    // The states it had queued, then UNAVAILABLE: never a clean end, which would tell
    // the client the watch is over for good (it ended OK).
    let mut states = watch.into_inner();
    let ended = tokio::time::timeout(T, async {
        loop {
            match states.message().await {
                Ok(Some(_)) => continue,
                other => return other,
            }
        }
    })
    .await
    .expect("the stream ends");
    let code = ended.as_ref().err().map(tonic::Status::code);
    assert_eq!(code, Some(tonic::Code::Unavailable), "{ended:?}");
}

/// An open reflection stream (grpcui and Evans keep one for their session: it ends only
/// when its client half-closes) ends `UNAVAILABLE` as shutdown begins. It held every
/// shutdown for the close timeout (2 s), which logged that connections did not close in
/// time.
#[tokio::test]
async fn an_open_reflection_stream_does_not_hold_up_shutdown() {
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let channel = server.channel().await;
    let mut reflection = ServerReflectionClient::new(channel);
    let (asking, asked) = tokio::sync::mpsc::channel(1);
    let list = MessageRequest::ListServices(String::new());
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(list),
    };
    asking.send(request).await.unwrap();
    let stream = tokio_stream::wrappers::ReceiverStream::new(asked);
    let mut answers = reflection.server_reflection_info(stream).await.unwrap().into_inner();
    bounded(T, "the services", answers.message())
        .await
        .unwrap()
        .expect("listed");
    let stopping = Instant::now();
    tokio::time::timeout(T, server.stop()).await.expect("stopped");
    let took = stopping.elapsed();
    assert!(took < Duration::from_millis(1900), "stopped in {took:?}");
    let ended = bounded(T, "the stream's end", answers.message()).await;
    let code = ended.as_ref().err().map(tonic::Status::code);
    assert_eq!(code, Some(Code::Unavailable), "{ended:?}");
    drop(asking);
}

/// A health Watch (gRPC clients that check health client-side keep one per connection)
/// lasts as long as its status: shutdown ends it after NOT_SERVING. It used to hold its
/// connection open, so every shutdown waited out the 2 s close timeout and left the
/// Unix socket behind.
#[tokio::test]
async fn a_health_watch_neither_holds_up_shutdown_nor_leaves_the_socket() {
    use tonic_health::pb::health_check_response::ServingStatus;
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("latchkey.sock");
    let server = Latchkey::start_with(&redis.url(), &["--unix-socket", socket.to_str().unwrap()]).await;
    server.wait_health(ServingStatus::Serving, T).await;
    let mut watch = health_watch(server.endpoint()).await;
    let first = bounded(T, "the first status", watch.message()).await.unwrap().unwrap();
    assert_eq!(first.status, ServingStatus::Serving as i32);
    let asked = Instant::now();
    tokio::time::timeout(T, server.stop()).await.expect("stopped");
    assert!(asked.elapsed() < Duration::from_secs(2), "{:?}", asked.elapsed());
    assert!(!socket.exists(), "the socket is removed on shutdown");
    let mut statuses = Vec::new();
    while let Ok(Some(reply)) = bounded(T, "the watch's end", watch.message()).await {
        statuses.push(reply.status);
    }
    assert_eq!(
        statuses.last(),
        Some(&(ServingStatus::NotServing as i32)),
        "{statuses:?}"
    );
}

/// The Unix socket goes as shutdown begins, not once the drain is over: a server
/// started on the path meanwhile replaces the file, and the filesystem may give its
/// socket the old one's inode, which the old server then took for its own and removed.
#[tokio::test]
async fn the_socket_is_removed_as_shutdown_begins() {
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("latchkey.sock");
    let server = Latchkey::start_with(&redis.url(), &["--unix-socket", socket.to_str().unwrap()]).await;
    let _lease = server.client().await.lock("draining").acquire().await.unwrap();
    // Its release waits on a frozen Redis: the drain takes seconds.
    redis.freeze();
    let asked = Instant::now();
    let stopping = tokio::spawn(server.stop());
    let gone = latchkey_tests::poll_until(Duration::from_secs(1), || !socket.exists()).await;
    let draining = !stopping.is_finished();
    redis.resume();
    bounded(Duration::from_secs(20), "the stop", stopping).await.unwrap();
    assert!(draining, "the drain was over after {:?}", asked.elapsed());
    assert!(gone, "the socket is removed as shutdown begins");
}

/// A "Redis" that accepts connections (into the backlog) and never answers.
fn silent_redis() -> TcpListener {
    TcpListener::bind("127.0.0.1:0").unwrap()
}

fn server_args(silent: &TcpListener, port: u16) -> Vec<String> {
    [
        "--redis-url",
        &format!("redis://{}", silent.local_addr().unwrap()),
        "--redis-timeout",
        "5s",
        "--listen",
        &format!("127.0.0.1:{port}"),
        "--no-metrics",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// The caught-signals mask of process `pid` (SigCgt in /proc/PID/status).
fn caught_signals(pid: u32) -> u64 {
    signal_mask(pid, "SigCgt:")
}

/// The mask `field` (SigCgt:, SigIgn:) of process `pid`'s /proc/PID/status.
fn signal_mask(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with(field)).unwrap();
    u64::from_str_radix(line.trim_start_matches(field).trim(), 16).unwrap()
}

const SIGTERM_BIT: u64 = 1 << (15 - 1);
const SIGHUP_BIT: u64 = 1;

/// Whether this test process ignores SIGHUP (run under `nohup`): the servers it starts
/// inherit that, and keep it.
fn sighup_ignored_here() -> bool {
    signal_mask(std::process::id(), "SigIgn:") & SIGHUP_BIT != 0
}

/// At `RUST_LOG=warn` the server serves, and stops at a SIGTERM: the signal future was
/// awaited inside a log macro, which skips its arguments at a level that is off, so the
/// server stopped, with status 0, as it started.
#[tokio::test]
async fn a_server_logging_warnings_only_serves_until_its_signal() {
    let redis = RedisServer::start();
    let port = free_port();
    let mut server = Command::new(latchkey_tests::latchkey::server_binary())
        .args([
            "--redis-url",
            &redis.url(),
            "--no-metrics",
            "--listen",
            &format!("127.0.0.1:{port}"),
        ])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let endpoint = format!("http://127.0.0.1:{port}");
    let answered = tokio::time::timeout(T, async {
        loop {
            if let Ok(client) = latchkey_client::Client::connect(&endpoint).await {
                if client.describe("warn-only").await.is_ok() {
                    return true;
                }
            }
            if server.try_wait().unwrap().is_some() {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .unwrap_or(false);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(server.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let exited = poll_until(T, || server.try_wait().unwrap().is_some()).await;
    let status = server.wait().unwrap();
    assert!(answered, "the server exited before it served: {status:?}");
    assert!(exited && status.success(), "stopped at the signal: {status:?}");
}

/// A server started with SIGHUP ignored (`nohup`) leaves it ignored, and one started
/// without catches it: listening replaces the ignoring, and a `nohup`-ed server would
/// stop at its user's logout.
#[tokio::test]
async fn a_sighup_ignored_at_start_stays_ignored() {
    let silent = silent_redis();
    for ignored in [true, false] {
        if !ignored && sighup_ignored_here() {
            eprintln!("the server's own SIGHUP skipped: these tests run with it ignored (nohup), which it inherits");
            continue;
        }
        let port = free_port();
        let trap = if ignored { "trap '' HUP; " } else { "" };
        let mut server = Command::new("sh")
            .arg("-c")
            .arg(format!("{trap}exec \"$0\" \"$@\""))
            .arg(latchkey_tests::latchkey::server_binary())
            .args(server_args(&silent, port))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        // The port is bound once the handlers are in place.
        let bound = poll_until(Duration::from_secs(10), || latchkey_tests::process::tcp_accepts(port)).await;
        let (caught, ignoring) = (caught_signals(server.id()), signal_mask(server.id(), "SigIgn:"));
        let _ = server.kill();
        let _ = server.wait();
        assert!(bound, "the gRPC port never accepted");
        assert!(caught & SIGTERM_BIT != 0, "SIGTERM caught (SigCgt {caught:#x})");
        assert_eq!(
            caught & SIGHUP_BIT == 0,
            ignored,
            "SIGHUP caught unless ignored (SigCgt {caught:#x})"
        );
        assert_eq!(
            ignoring & SIGHUP_BIT != 0,
            ignored,
            "SIGHUP ignored as at start (SigIgn {ignoring:#x})"
        );
    }
}

/// While the server starts (its gRPC port bound, Redis not yet answered) it has its
/// SIGTERM handler: as a container's PID 1 (the image has no init) a SIGTERM to a
/// process without one is dropped by the kernel, and it was installed only once start
/// was over, which a Redis that does not answer makes take two `--redis-timeout`s.
#[tokio::test]
async fn sigterm_is_caught_while_the_server_starts() {
    let silent = silent_redis();
    let port = free_port();
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("server.log");
    let mut server = Command::new(latchkey_tests::latchkey::server_binary())
        .args(server_args(&silent, port))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    // The listeners are bound before Redis is asked: the port accepting means start is
    // under way.
    let bound = poll_until(Duration::from_secs(10), || latchkey_tests::process::tcp_accepts(port)).await;
    let caught = caught_signals(server.id());
    let started = std::fs::read_to_string(&log).unwrap_or_default();
    let _ = server.kill();
    let _ = server.wait();
    assert!(bound, "the gRPC port never accepted");
    assert!(
        !started.contains("latchkey serving"),
        "start finished too early: {started}"
    );
    assert!(
        caught & SIGTERM_BIT != 0,
        "no SIGTERM handler while starting (SigCgt {caught:#x}): as PID 1 in a container a SIGTERM now is lost"
    );
}

/// The same as a container runs it: the server as PID 1 of a PID namespace, SIGTERM
/// sent from outside while it starts. It stops there; it served on until the grace
/// period's SIGKILL. (Needs `unshare --pid`, root: skipped where it cannot run.)
#[tokio::test]
async fn a_sigterm_to_pid_1_while_starting_stops_the_server() {
    let probe = Command::new("unshare")
        .args(["--pid", "--fork", "true"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    if !probe.is_ok_and(|s| s.success()) {
        eprintln!("skipped: `unshare --pid --fork` is not available here (needs root)");
        return;
    }
    let silent = silent_redis();
    let port = free_port();
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("server.log");
    let mut unshare = Command::new("unshare")
        .args(["--pid", "--fork", "--kill-child"])
        .arg(latchkey_tests::latchkey::server_binary())
        .args(server_args(&silent, port))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let children = format!("/proc/{0}/task/{0}/children", unshare.id());
    let mut pid = None;
    poll_until(Duration::from_secs(10), || {
        pid = std::fs::read_to_string(&children)
            .ok()
            .and_then(|c| c.split_whitespace().next()?.parse::<u32>().ok());
        pid.is_some() && latchkey_tests::process::tcp_accepts(port)
    })
    .await;
    let Some(pid) = pid else {
        let _ = unshare.kill();
        let _ = unshare.wait();
        panic!("the server did not start under unshare");
    };
    let ns_pid = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find(|l| l.starts_with("NSpid:"))
        .map(|l| l.split_whitespace().last().unwrap().to_owned());
    assert_eq!(ns_pid.as_deref(), Some("1"), "the server is its namespace's PID 1");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    // Start takes up to two --redis-timeouts (10 s) here, a shutdown with Redis away ~4 s.
    let gone = poll_until(Duration::from_secs(25), || !Path::new(&format!("/proc/{pid}")).exists()).await;
    let serving = latchkey_tests::process::tcp_accepts(port);
    // SIGKILL reaches a namespace's init from outside; unshare then exits and is reaped.
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    );
    let _ = poll_until(Duration::from_secs(5), || matches!(unshare.try_wait(), Ok(Some(_)))).await;
    let _ = unshare.kill();
    let _ = unshare.wait();
    let said = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        gone,
        "PID 1 still running 25 s after SIGTERM (gRPC port accepting: {serving}); the kubelet would SIGKILL it at the end of the grace period. Log:\n{said}"
    );
}

/// A Watch whose read waits on a Redis that stopped answering holds up no shutdown:
/// the read gives way to it. The drain waited for the read's whole Redis timeout.
#[tokio::test]
async fn a_watch_read_waiting_on_a_silent_redis_does_not_hold_up_shutdown() {
    let redis = RedisServer::start();
    let proxy = latchkey_tests::proxy::Proxy::to_redis(&redis).await;
    let server = Latchkey::start_with(&proxy.redis_url(), &["--redis-timeout", "8s"]).await;
    let client = server.client().await;
    let mut watch = client.watch("silent").await.unwrap();
    bounded(T, "the first state", watch.next()).await.unwrap();
    proxy.freeze();
    // The reader looks again at least every second: by now it waits on Redis.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let asked = Instant::now();
    bounded(Duration::from_secs(20), "the shutdown", server.stop()).await;
    // Saying goodbye to the silent Redis takes its 2 s bound; the read, nothing more.
    assert!(
        asked.elapsed() < Duration::from_secs(4),
        "the shutdown took {:?}",
        asked.elapsed()
    );
    proxy.thaw();
}
