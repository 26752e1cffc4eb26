//! The ways latchkey is deployed and reached: Redis behind Sentinel, a key prefix on
//! a shared Redis, grants that wait for replica acknowledgement, a Unix socket.

use latchkey_tests::redisson::{random_owner, RedissonFairLock};
use latchkey_tests::server::Latchkey;
use latchkey_tests::{bounded, poll_until, redis_client, scrape_metrics, LatchkeyProcess, RedisSentinel, RedisServer};
use std::time::Duration;
use tonic::Code;
use tonic_health::pb::health_check_response::ServingStatus;

/// The bound on a wait that the code under test should end far sooner.
const T: Duration = Duration::from_secs(20);

/// A server whose grants wait up to 10 s for one replica (time to act on a grant held
/// back so), with a watchdog timeout long enough for its renewal rounds to wait as long.
const LONG_SYNC_WAIT: [&str; 6] = [
    "--sync-replicas",
    "1",
    "--sync-timeout",
    "10s",
    "--watchdog-timeout",
    "60s",
];

/// Behind Sentinel, the Redis client learns which node each connection reaches from
/// `CLIENT ID` alone: a user that may not run it (`-client`) left every connection
/// unknown, none ever moved off a deposed master after a failover, while health read
/// SERVING. Health now reads NOT_SERVING, naming the command.
#[tokio::test]
async fn a_user_that_may_not_ask_its_connection_id_is_not_served_behind_sentinel() {
    let mut sentinel = RedisSentinel::start();
    let acl = ["ACL", "SETUSER", "lk", "on", ">pw", "~*", "&*", "+@all", "-client"];
    assert_eq!(sentinel.master().cli(&acl).trim(), "OK");
    let url = sentinel.url().replace("redis-sentinel://", "redis-sentinel://lk:pw@");
    let server = Latchkey::launch(&url, &[], latchkey_client::ConnectOptions::new()).await;
    server
        .never_serving(Duration::from_secs(3), "CLIENT ID is refused")
        .await;
    // The same user with `client|id` is served.
    let acl = ["ACL", "SETUSER", "lk", "+client|id"];
    assert_eq!(sentinel.master().cli(&acl).trim(), "OK");
    server.wait_health(ServingStatus::Serving, T).await;
}

#[tokio::test]
async fn sentinel_url_serves_locks() {
    let sentinel = RedisSentinel::start();
    let server = Latchkey::start(&sentinel.url()).await;
    let client = server.client().await;
    let lease = client
        .lock("via-sentinel")
        .acquire()
        .await
        .expect("granted through sentinel");
    assert_eq!(client.describe("via-sentinel").await.unwrap().holders.len(), 1);
    lease.release().await.unwrap();
}

#[tokio::test]
async fn key_prefix_namespaces_every_key_and_channel() {
    let redis = RedisServer::start();
    let app = Latchkey::start_with(&redis.url(), &["--key-prefix", "app1:"]).await;
    let other = Latchkey::start_with(&redis.url(), &["--key-prefix", "app2:"]).await;
    let lease = app.client().await.lock("orders").acquire().await.unwrap();
    assert_eq!(redis.cli(&["HGET", "app1:orders", lease.owner()]).trim(), "1");
    assert_eq!(redis.cli(&["EXISTS", "orders"]).trim(), "0");
    // Another namespace has its own "orders".
    other
        .client()
        .await
        .lock("orders")
        .try_once()
        .acquire()
        .await
        .expect("separate namespace");
    // Names come back without the prefix.
    let listed = app.client().await.list_all("").await.unwrap();
    assert_eq!(listed.iter().map(|l| l.name.as_str()).collect::<Vec<_>>(), ["orders"]);
    // Waiters wake on the prefixed channel.
    let client = app.client().await;
    let waiter = tokio::spawn(async move { client.lock("orders").wait(Duration::from_secs(5)).acquire().await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let released = std::time::Instant::now();
    lease.release().await.unwrap();
    bounded(Duration::from_secs(10), "the waiter", waiter)
        .await
        .unwrap()
        .expect("woken");
    assert!(released.elapsed() < Duration::from_secs(1));
}

/// Every replicated grant ends in `WAIT`: a Redis user that may not run it (`-wait`)
/// is granted nothing with `--sync-replicas`, which health tells (NOT_SERVING) as it
/// does a Redis without the replicas; it read SERVING while every acquire was refused.
#[tokio::test]
async fn a_user_that_may_not_wait_is_not_served_replicated_grants() {
    let (primary, _replica) = RedisServer::with_replica().await;
    primary.cli(&["ACL", "SETUSER", "lk", "on", ">pw", "~*", "&*", "+@all", "-wait"]);
    let url = format!("redis://lk:pw@127.0.0.1:{}", primary.port());
    let args = ["--sync-replicas", "1", "--sync-timeout", "1s"];
    let server = Latchkey::launch(&url, &args, latchkey_client::ConnectOptions::new()).await;
    server.never_serving(Duration::from_secs(3), "WAIT is refused").await;
    let err = server
        .client()
        .await
        .lock("unwaited")
        .try_once()
        .acquire()
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err}");
}

#[tokio::test]
async fn sync_replicas_waits_for_a_replica_and_refuses_without_one() {
    let (primary, replica) = RedisServer::with_replica().await;
    let synced = Latchkey::start_with(&primary.url(), &["--sync-replicas", "1", "--sync-timeout", "2s"]).await;
    let lease = synced
        .client()
        .await
        .lock("replicated")
        .acquire()
        .await
        .expect("one replica acknowledges");
    assert_eq!(
        replica.cli(&["HGET", "replicated", lease.owner()]).trim(),
        "1",
        "the replica has the grant"
    );
    lease.release().await.unwrap();

    // Two replicas asked for, one exists: the grant is given back, never sent, and
    // health says the server cannot serve.
    let strict = Latchkey::launch(
        &primary.url(),
        &["--sync-replicas", "2", "--sync-timeout", "300ms"],
        latchkey_client::ConnectOptions::new(),
    )
    .await;
    let err = strict.client().await.lock("strict").acquire().await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err}");
    assert_eq!(primary.cli(&["EXISTS", "strict"]).trim(), "0", "nothing left behind");
    assert_eq!(strict.health().await, Some(ServingStatus::NotServing));

    // A replica that stops acknowledging (frozen, still connected) takes health down too.
    synced.wait_health(ServingStatus::Serving, Duration::from_secs(5)).await;
    replica.freeze();
    synced
        .wait_health(ServingStatus::NotServing, Duration::from_secs(10))
        .await;
    replica.resume();
    synced
        .wait_health(ServingStatus::Serving, Duration::from_secs(10))
        .await;
}

/// With `--sync-replicas`, a renewal counts once the replicas acknowledged it, as a
/// grant does: one only the primary had would not outlive a failover, the promoted
/// replica letting the lock expire a renewal period or more before its holder was
/// told. While no replica acknowledges, a held lease is told `NOT_HELD` when its last
/// acknowledged renewal runs out; it was renewed on and on, the replica frozen. Once
/// the replica acknowledges again, leases are renewed as before.
#[tokio::test]
async fn a_renewal_no_replica_acknowledges_does_not_keep_a_lease() {
    let (primary, replica) = RedisServer::with_replica().await;
    let args = latchkey_tests::server::SYNCED_RENEWALS;
    let server = Latchkey::start_with(&primary.url(), &args).await;
    let client = server.client().await;
    let (client, replica) = (&client, &replica);
    let renewed_on = |name: &'static str| async move {
        let lease = client.lock(name).acquire().await.expect("a replicated grant");
        // Two renewal rounds (one every 4 s): unrenewed, the replica's copy would have
        // 3 s left at most.
        tokio::time::sleep(Duration::from_secs(9)).await;
        assert!(!lease.is_lost(), "{name}: renewed while the replica acknowledges");
        let left: i64 = replica.cli(&["PTTL", name]).trim().parse().unwrap();
        assert!(left > 4_000, "{name}: the replica has the renewals ({left} ms left)");
        lease
    };
    let kept = renewed_on("kept").await;
    replica.freeze();
    let reason = bounded(T, "the unacknowledged lease's notice", kept.lost()).await;
    assert_eq!(reason, latchkey_client::LostReason::NotHeld);
    replica.resume();
    renewed_on("again").await.release().await.unwrap();
}

#[tokio::test]
async fn unix_socket_serves_the_same_api() {
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("latchkey.sock");
    let socket_arg = socket.to_str().unwrap();
    let flags = ["--unix-socket", socket_arg, "--unix-socket-mode", "660"];
    let server = Latchkey::start_with(&redis.url(), &flags).await;
    let mode = std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&socket).unwrap().permissions());
    assert_eq!(mode & 0o777, 0o660, "--unix-socket-mode, whatever the umask");
    let over_unix = latchkey_client::Client::connect(&format!("unix://{socket_arg}"))
        .await
        .expect("connects");
    let lease = over_unix
        .lock("sidecar")
        .acquire()
        .await
        .expect("granted over the socket");
    let err = server
        .client()
        .await
        .lock("sidecar")
        .try_once()
        .acquire()
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::DeadlineExceeded, "the same lock over TCP");
    lease.release().await.unwrap();

    // A second server given the same path does not take the socket from a live one
    // (it removed it and bound its own: the first's clients reached the second).
    // `argv(path)`: a server's flags with `--unix-socket path`.
    let argv = |path: &str| {
        let flags = [
            "--redis-url",
            &redis.url(),
            "--listen",
            "127.0.0.1:0",
            "--no-metrics",
            "--unix-socket",
            path,
        ];
        latchkey_server::config::Config::from_args(flags).unwrap()
    };
    let Err(err) = latchkey_server::Server::start(argv(socket_arg)).await else {
        panic!("a second server took a live socket");
    };
    assert!(err.to_string().contains("another process listens"), "{err}");
    over_unix
        .describe("sidecar")
        .await
        .expect("the first server still answers there");
    server.stop().await;
    assert!(!socket.exists(), "the socket is removed on shutdown");

    // A server removes on shutdown only the socket it made, not one at its path since.
    let server = Latchkey::start_with(&redis.url(), &["--unix-socket", socket_arg]).await;
    std::fs::remove_file(&socket).unwrap();
    let since = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    server.stop().await;
    assert!(socket.exists(), "another socket at the path was removed");
    drop(since);
    std::fs::remove_file(&socket).unwrap();

    // A socket left by a run that did not stop cleanly is replaced; a file that is no
    // socket (the flag given a wrong path) is left alone, and the server says why.
    let stale = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    drop(stale);
    let server = Latchkey::start_with(&redis.url(), &["--unix-socket", socket_arg]).await;
    server.stop().await;
    let config = dir.path().join("config.yaml");
    std::fs::write(&config, b"keep me").unwrap();
    let Err(err) = latchkey_server::Server::start(argv(config.to_str().unwrap())).await else {
        panic!("a path that is no socket is refused");
    };
    assert!(err.to_string().contains("--unix-socket"), "{err}");
    assert_eq!(std::fs::read(&config).unwrap(), b"keep me", "the file is intact");
}

/// A deployment's environment says `LATCHKEY_NO_AUTH=false` (a kustomize overlay can
/// only set the base's `LATCHKEY_NO_AUTH=true` to false, not remove it) beside an
/// auth file: auth is on, and the server starts with it. `true` beside an auth file
/// is still refused.
#[tokio::test]
async fn no_auth_false_in_the_environment_goes_with_an_auth_file() {
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let auth = dir.path().join("auth.toml");
    let identity = "[[identity]]\nname = \"app\"\ntokens = [\"app-token\"]\nprefixes = [\"\"]\n";
    std::fs::write(&auth, identity).unwrap();
    let args = [
        "--redis-url".to_owned(),
        redis.url(),
        "--auth-file".to_owned(),
        auth.display().to_string(),
    ];
    let server = latchkey_tests::LatchkeyProcess::spawn_with_env(&args, &[("LATCHKEY_NO_AUTH", "false")]);
    let anonymous = latchkey_client::Client::connect(&server.endpoint()).await.unwrap();
    let err = anonymous.lock("x").try_once().acquire().await.unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated, "{err}");
    let options = latchkey_client::ConnectOptions::new().token("app-token");
    let app = latchkey_client::Client::connect_with(&server.endpoint(), &options)
        .await
        .unwrap();
    app.lock("x")
        .try_once()
        .acquire()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();

    let both = latchkey_tests::process::output_within(
        std::process::Command::new(latchkey_tests::latchkey::server_binary())
            .args(["--listen", "127.0.0.1:0", "--no-metrics"])
            .args(&args)
            .env("LATCHKEY_NO_AUTH", "true"),
        Duration::from_secs(10),
    );
    assert!(!both.status.success(), "--no-auth and --auth-file together start");
    let said = String::from_utf8_lossy(&both.stderr);
    assert!(said.contains("--no-auth") && said.contains("--auth-file"), "{said}");
}

/// The sidecar overlay starts the application once the server's metrics `/health`
/// answers (the kubelet cannot reach a loopback gRPC listener): by then the gRPC
/// listeners must be there. `/health` answered from the very start, while the server
/// went on to connect its RedLock deployments (up to `--redis-timeout` for one that
/// does not answer) before it made its Unix socket: the application's first calls
/// found no socket.
#[tokio::test]
async fn metrics_health_answers_only_once_the_grpc_listeners_are_there() {
    let redis = RedisServer::start();
    // RedLock deployments that accept connections and never answer.
    let silent: Vec<std::net::TcpListener> = (0..3)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("latchkey.sock");
    let (port, metrics) = (latchkey_tests::free_port(), latchkey_tests::free_port());
    let mut command = std::process::Command::new(latchkey_tests::latchkey::server_binary());
    command
        .args(["--redis-url", &redis.url(), "--redis-timeout", "2s"])
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .args(["--metrics-listen", &format!("127.0.0.1:{metrics}")])
        .arg("--unix-socket")
        .arg(&socket)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    for node in &silent {
        command.args(["--redlock-url", &format!("redis://{}", node.local_addr().unwrap())]);
    }
    let mut server = command.spawn().unwrap();
    let healthy = || latchkey_tests::http_get(metrics, "/health").starts_with("HTTP/1.1 200");
    let up = latchkey_tests::poll_until(Duration::from_secs(15), healthy).await;
    let socket_there = socket.exists();
    let tcp_there = latchkey_tests::process::tcp_accepts(port);
    let _ = server.kill();
    let _ = server.wait();
    assert!(up, "metrics /health never answered");
    assert!(
        socket_there && tcp_there,
        "/health answered before the listeners: socket {socket_there}, TCP {tcp_there}"
    );
}

/// A grant broken by ForceRelease before its reply reached the server (here held back
/// by `WAIT` while the replica is frozen) is told `FORCE_RELEASED` as soon as it is
/// registered: the notice, heard before there was a lease to end, is kept for it. It
/// was dropped, and the holder was told `acquired` for a broken lock and heard of the
/// break only at its next renewal, 10 s later, while another client held the lock.
#[tokio::test]
async fn a_grant_broken_before_its_reply_came_is_told_force_released_at_once() {
    let (primary, replica) = RedisServer::with_replica().await;
    let args = LONG_SYNC_WAIT;
    let server = Latchkey::start_with(&primary.url(), &args).await;
    let client = server.client().await;
    replica.freeze();
    let acquiring = {
        let client = client.clone();
        tokio::spawn(async move { client.lock("late").wait(T).acquire().await })
    };
    let granted = latchkey_tests::poll_until(Duration::from_secs(10), || {
        primary.cli(&["EXISTS", "late"]).trim() == "1"
    })
    .await;
    assert!(granted, "granted in Redis");
    assert!(
        client.force_release("late").await.unwrap(),
        "broken while WAIT holds the grant back"
    );
    replica.resume();
    let lease = bounded(T, "the acknowledged grant", acquiring)
        .await
        .unwrap()
        .expect("acquired once the replica acknowledged");
    let reason = tokio::time::timeout(Duration::from_secs(2), lease.lost()).await;
    assert_eq!(
        reason.expect("told at once, not at the next renewal"),
        latchkey_client::LostReason::ForceReleased
    );
}

/// A grant whose reply was still on its way (held back by `WAIT`) while the server's
/// pub/sub connection went, and with it the notice of a break of that very lock, is
/// checked as soon as it is registered: the round that checked the leases once the loss
/// was noticed ran before it was there. It was checked at the next round only (20 s
/// here), its holder told `acquired` on a broken lock meanwhile.
#[tokio::test]
async fn a_grant_registered_after_missed_notices_were_checked_is_checked_at_once() {
    let (primary, replica) = RedisServer::with_replica().await;
    let flags = LONG_SYNC_WAIT;
    let server = Latchkey::start_with(&primary.url(), &flags).await;
    let client = server.client().await;
    replica.freeze();
    let acquiring = {
        let client = client.clone();
        tokio::spawn(async move { client.lock("missed").wait(T).acquire().await })
    };
    let granted = poll_until(Duration::from_secs(10), || {
        primary.cli(&["EXISTS", "missed"]).trim() == "1"
    })
    .await;
    assert!(granted, "granted in Redis");
    // ForceRelease's writes, with the server's pub/sub connection gone at that moment.
    let keys = latchkey_server::keys::Keys::default().lock("missed");
    let token = primary.cli(&["GET", &keys.fence()]).trim().to_owned();
    let broken = format!(
        "MULTI\r\nCLIENT KILL TYPE pubsub\r\nSET {} {token} PX 60000\r\nDEL missed\r\nEXEC",
        keys.broken()
    );
    assert_eq!(
        latchkey_tests::process::raw_command(primary.port(), &broken).as_deref(),
        Some("+OK")
    );
    // The server subscribes again and checks the leases it has: none yet.
    tokio::time::sleep(Duration::from_secs(1)).await;
    replica.resume();
    let lease = bounded(T, "the acknowledged grant", acquiring)
        .await
        .unwrap()
        .expect("acquired once the replica acknowledged");
    let reason = tokio::time::timeout(Duration::from_secs(3), lease.lost()).await;
    assert_eq!(
        reason.expect("told at once, not at the next round"),
        latchkey_client::LostReason::ForceReleased
    );
}

/// With `--sync-replicas`, a try waits for one of the connections kept for grants no
/// longer than the Redis timeout: while a replica does not acknowledge, each grant holds
/// its connection for the whole `--sync-timeout`, and the tries behind them waited their
/// turn without bound, a try-once for many seconds (and deaf to its client's release
/// meanwhile).
#[tokio::test]
async fn a_try_waits_for_a_synced_connection_no_longer_than_the_redis_timeout() {
    let (primary, replica) = RedisServer::with_replica().await;
    let args = ["--sync-replicas", "1", "--sync-timeout", "1s", "--redis-timeout", "2s"];
    let server = Latchkey::start_with(&primary.url(), &args).await;
    let client = server.client().await;
    replica.freeze();
    let started = std::time::Instant::now();
    let tries: Vec<_> = (0..32)
        .map(|i| {
            let client = client.clone();
            tokio::spawn(async move {
                let _ = client.lock(format!("synced/{i}")).try_once().acquire().await;
                started.elapsed()
            })
        })
        .collect();
    let mut slowest = Duration::ZERO;
    for t in tries {
        slowest = slowest.max(bounded(Duration::from_secs(8), "a try", t).await.unwrap());
    }
    replica.resume();
    assert!(
        slowest < Duration::from_secs(6),
        "the slowest try answered after {slowest:?}"
    );
}

/// A grant's WAIT counts only the writes of its own connection: cut off while it
/// waited (here by `CLIENT KILL` while the replica is frozen) and written again on the
/// new connection, which has written nothing, it answered at once that the replica had
/// acknowledged, and the grant was confirmed although no replica had it. The script
/// and its WAIT now go together, written once: a connection lost between them leaves
/// the grant in doubt, given back, never confirmed.
#[tokio::test]
async fn a_wait_cut_off_never_confirms_a_grant_on_a_new_connection() {
    let (primary, replica) = RedisServer::with_replica().await;
    let args = ["--sync-replicas", "1", "--sync-timeout", "5s"];
    let server = Latchkey::start_with(&primary.url(), &args).await;
    let client = server.client().await;
    replica.freeze();
    let acquire = tokio::spawn({
        let client = client.clone();
        async move { client.lock("cut-off").try_once().acquire().await }
    });
    let blocked = poll_until(Duration::from_secs(5), || {
        primary.cli(&["INFO", "clients"]).contains("blocked_clients:1")
    })
    .await;
    assert!(blocked, "the grant's WAIT blocks on the frozen replica");
    primary.cli(&["CLIENT", "KILL", "TYPE", "normal"]);
    // The replica stays frozen until the answer: no grant can be acknowledged before,
    // however long the answer takes (a try written again waits out --sync-timeout).
    let outcome = tokio::time::timeout(Duration::from_secs(15), acquire).await;
    replica.resume();
    let lease = outcome.expect("the cut-off try is answered").unwrap();
    assert!(lease.is_err(), "granted with no replica's acknowledgement");
}

/// With `--sync-replicas`, a grant that no replica acknowledged is given back and its
/// waiter stays in line; a hold record broken by a ForceRelease while the grant waited
/// for them (or a fixed lease that ran out meanwhile) was left revoked, and each later
/// try of the waiter answered busy on a free lock for a minute. Given back as a try its
/// stream tries again after, it is granted once a replica acknowledges.
#[tokio::test]
async fn a_synced_waiter_whose_grant_was_broken_in_the_wait_is_granted_once_a_replica_acks() {
    let (primary, replica) = RedisServer::with_replica().await;
    // A grant waits 3 s for its replicas: time to see it and break it on a busy machine.
    let flags = [
        "--sync-replicas",
        "1",
        "--sync-timeout",
        "3s",
        "--redis-timeout",
        "500ms",
    ];
    let server = Latchkey::start_with(&primary.url(), &flags).await;
    let client = server.client().await;
    for kind in [latchkey_client::LockKind::Mutex, latchkey_client::LockKind::Write] {
        let name = format!("broken-{kind:?}");
        let holder = client.lock(name.as_str()).kind(kind).acquire().await.unwrap();
        let lock = client.lock(name.as_str()).kind(kind).wait(Duration::from_secs(30));
        let (waiter, _) = latchkey_tests::server::spawn_queued(lock, Duration::from_secs(10)).await;
        replica.freeze();
        // The waiter's grant waits for an acknowledgement that does not come; an
        // operator breaks it meanwhile.
        holder.release().await.unwrap();
        let granted = || primary.cli(&["EXISTS", name.as_str()]).trim() == "1";
        assert!(
            poll_until(Duration::from_secs(10), granted).await,
            "the waiter's grant waits"
        );
        assert!(
            client.force_release(name.as_str()).await.unwrap(),
            "the waiter's grant is broken"
        );
        // Its give-back comes once the wait is over.
        tokio::time::sleep(Duration::from_millis(3300)).await;
        replica.resume();
        let lease = bounded(Duration::from_secs(10), "the waiter", waiter).await.unwrap();
        lease.expect("granted once the replica acknowledges, not a minute later");
    }
}

/// With `--sync-replicas`, a fair waiter whose grant no replica acknowledged goes back to
/// the head of the queue: while the replica does not answer, its grants are given back
/// and it takes the lock again, and once a replica acknowledges it is granted before
/// the waiter behind it. Its grant had taken it out of the queue, and the give-back
/// handed the turn to the next waiter, the two taking turns behind every give-back.
#[tokio::test]
async fn a_synced_fair_waiter_whose_grant_was_given_back_keeps_its_turn() {
    let (primary, replica) = RedisServer::with_replica().await;
    let (_server, client) = synced_server(&primary.url()).await;
    let name = "synced-fair";
    let fair = || fair_waiter(&client, name);
    let holder = fair().acquire().await.unwrap();
    let spawn = |lock| latchkey_tests::server::spawn_queued(lock, Duration::from_secs(10));
    let (first, _) = spawn(fair()).await;
    let (second, _) = spawn(fair()).await;
    let queue = latchkey_server::keys::Keys::default().lock(name).queue();
    let queue = primary.cli(&["LRANGE", &queue, "0", "-1"]);
    let second_owner = queue.split_whitespace().nth(1).expect("two queued").to_owned();
    replica.freeze();
    holder.release().await.unwrap();
    // The first's grants wait for acknowledgements that do not come, and are given back
    // each `--sync-timeout` (1 s): past two of them, the second never held the lock.
    let second_holds = || primary.cli(&["HEXISTS", name, &second_owner]).trim() == "1";
    let passed_over = poll_until(Duration::from_millis(2_500), second_holds).await;
    assert!(
        !passed_over,
        "the second took the lock at a give-back of the first's grant"
    );
    replica.resume();
    let lease = bounded(Duration::from_secs(10), "the first", first).await.unwrap();
    let lease = lease.expect("the first granted once a replica acknowledges");
    assert!(!second.is_finished(), "the second waits its turn");
    let token = lease.fencing_token();
    lease.release().await.unwrap();
    let lease = bounded(Duration::from_secs(10), "the second", second).await.unwrap();
    assert!(lease.expect("the second granted next").fencing_token() > token);
}

/// With `--sync-replicas`, a fair waiter whose grant no replica acknowledged does not
/// keep a Java waiter behind it out: Redisson needs no replica's word, so the give-back
/// wakes the Java waiter, now first in line, and puts the latchkey waiter second. The
/// latchkey waiter went back to the head at each give-back, and the Java waiter waited
/// for as long as the replica stayed away.
#[tokio::test]
async fn a_synced_fair_waiters_given_back_grant_lets_a_java_waiter_behind_it_in() {
    let (primary, replica) = RedisServer::with_replica().await;
    let (_server, client) = synced_server(&primary.url()).await;
    let name = "synced-java";
    let fair = || fair_waiter(&client, name);
    let holder = fair().acquire().await.unwrap();
    let (first, _) = latchkey_tests::server::spawn_queued(fair(), Duration::from_secs(10)).await;
    let java = RedissonFairLock::new(&redis_client(&primary.url()).await, name, &random_owner());
    let queue = java.queue_name();
    let java = tokio::spawn(async move {
        let took = java.lock(Duration::from_secs(8), 30_000).await;
        (java, took)
    });
    let both_queued = || primary.cli(&["LLEN", &queue]).trim() == "2";
    assert!(
        poll_until(Duration::from_secs(10), both_queued).await,
        "the Java waiter queues"
    );
    replica.freeze();
    holder.release().await.unwrap();
    let (java, took) = bounded(Duration::from_secs(12), "the Java waiter", java).await.unwrap();
    assert!(took, "the Java waiter takes the lock while the replica is away");
    replica.resume();
    assert!(!first.is_finished(), "the latchkey waiter waits behind it");
    assert_eq!(java.unlock().await, Some(true));
    let lease = bounded(Duration::from_secs(10), "the latchkey waiter", first)
        .await
        .unwrap();
    lease.expect("granted next").release().await.unwrap();
}

/// A fair waiter of `name` that waits up to 30 s.
fn fair_waiter(client: &latchkey_client::Client, name: &str) -> latchkey_client::LockBuilder {
    (client.lock(name))
        .kind(latchkey_client::LockKind::Fair)
        .wait(Duration::from_secs(30))
}

/// A primary and a replica of it, once the replica is online.
/// A server on the primary at `url` whose grants wait for one replica (a second at
/// most), and its client.
async fn synced_server(url: &str) -> (Latchkey, latchkey_client::Client) {
    let flags = [
        "--sync-replicas",
        "1",
        "--sync-timeout",
        "1s",
        "--redis-timeout",
        "500ms",
    ];
    let server = Latchkey::start_with(url, &flags).await;
    let client = server.client().await;
    (server, client)
}

/// With `--sync-replicas`, grants go through connections of their own, and their
/// script calls are counted in the Redis metrics as every other call is (they were
/// not: the dashboards showed no acquire at all, and no failed one through an outage).
#[tokio::test]
async fn replicated_grants_are_counted_in_the_redis_metrics() {
    let (primary, _replica) = RedisServer::with_replica().await;
    let args = ["--redis-url", &primary.url(), "--sync-replicas", "1"].map(str::to_owned);
    let server = LatchkeyProcess::spawn(&args);
    let client = server.serving_client().await;
    client.lock("counted").acquire().await.unwrap().release().await.unwrap();
    let scrape = scrape_metrics(server.metrics_port().expect("metrics enabled"));
    let count = scrape
        .lines()
        .find(|l| l.starts_with("latchkey_redis_command_seconds_count{script=\"mutex_acquire\"}"));
    let count: f64 = count
        .and_then(|l| l.split_whitespace().last()?.parse().ok())
        .unwrap_or(0.0);
    assert!(count >= 1.0, "the grant's call counted: {scrape}");
}

/// With `--sync-replicas`, waiters already in line outlast a Redis outage: a try that
/// waited its turn for one of the connections of replicated grants longer than the
/// Redis timeout is refused for now, as any try Redis did not answer, not as a grant
/// the replicas did not acknowledge. Those ended their waiters (`UNAVAILABLE`,
/// `NOT_REPLICATED`) though no grant was made.
#[tokio::test]
async fn synced_waiters_in_line_outlast_a_redis_outage() {
    let (mut primary, _replica) = RedisServer::with_replica().await;
    let (_server, client) = synced_server(&primary.url()).await;
    let _holder = client.lock("q").lease(Duration::from_secs(2)).acquire().await.unwrap();
    let mut waiters = Vec::new();
    for _ in 0..12 {
        let lock = client.lock("q").wait(Duration::from_secs(60));
        waiters.push(
            latchkey_tests::server::spawn_queued(lock, Duration::from_secs(10))
                .await
                .0,
        );
    }
    primary.stop();
    tokio::time::sleep(Duration::from_secs(5)).await;
    if let Some(waiter) = waiters.iter_mut().find(|w| w.is_finished()) {
        let ended = waiter.await.unwrap().map(|_| ()).unwrap_err();
        panic!("a waiter in line ended during the outage: {ended}");
    }
    primary.restart();
    latchkey_tests::server::each_granted(waiters, Duration::from_secs(30)).await;
}

/// With `--sync-replicas`, a waiter already in line whose grant the replica has not
/// acknowledged yet (Redis back from a restart, its replica still syncing) keeps its
/// place and tries again, as after any try Redis did not answer: the grant was given
/// back. It ended `UNAVAILABLE` (`NOT_REPLICATED`).
#[tokio::test]
async fn a_synced_waiter_in_line_outlasts_a_replica_still_syncing() {
    let (mut primary, _replica) = RedisServer::with_replica().await;
    let (_server, client) = synced_server(&primary.url()).await;
    let _holder = client.lock("r").acquire().await.unwrap();
    let lock = client.lock("r").wait(Duration::from_secs(60));
    let (waiter, _) = latchkey_tests::server::spawn_queued(lock, Duration::from_secs(10)).await;
    primary.stop();
    tokio::time::sleep(Duration::from_millis(300)).await;
    primary.restart();
    let lease = bounded(Duration::from_secs(40), "the waiter", waiter).await.unwrap();
    lease
        .expect("granted once the replica acknowledges")
        .release()
        .await
        .unwrap();
}

/// With `--sync-replicas`, a connection of replicated grants whose Redis goes silent in
/// a grant's `WAIT` is made again: fred checks no connection with a `WAIT` in flight
/// for silence, and every later grant on it timed out until TCP gave up, while health
/// said SERVING.
#[tokio::test]
async fn synced_grants_outlast_a_connection_silent_in_its_wait() {
    let (primary, _replica) = RedisServer::with_replica().await;
    let proxy = latchkey_tests::proxy::Proxy::to_redis(&primary).await;
    let (_server, client) = synced_server(&proxy.redis_url()).await;
    client
        .lock("warm")
        .try_once()
        .acquire()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    // Each connection that sends a WAIT goes silent: it and every later byte of it
    // are held for a minute.
    proxy.hold_back_matching(Some((b"\r\nWAIT\r\n", Duration::from_secs(60))));
    let pool = latchkey_server::redis::SYNC_POOL_SIZE;
    let tries: Vec<_> = (0..pool)
        .map(|i| {
            let client = client.clone();
            tokio::spawn(async move { client.lock(format!("silent-{i}")).try_once().acquire().await })
        })
        .collect();
    for t in tries {
        let outcome = bounded(Duration::from_secs(10), "a try on a silent connection", t).await;
        assert!(outcome.unwrap().is_err(), "granted with no replica's acknowledgement");
    }
    proxy.hold_back_matching(None);
    let granted = async {
        loop {
            if let Ok(lease) = client.lock("after").try_once().acquire().await {
                return lease;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    };
    let lease = bounded(
        Duration::from_secs(10),
        "a replicated grant on a connection made again",
        granted,
    )
    .await;
    lease.release().await.unwrap();
}

/// `deploy/run-local` given a Redis of the server's own (`--redis-url`, or
/// `LATCHKEY_REDIS_URL`) starts no local one: it had started a Redis on 6379 that
/// nobody used, and on a host packaging Redis 6.0 stopped at its version. `cargo` is a
/// script here that records how it was called: the script's choices are under test,
/// not a release build of minutes.
#[test]
fn run_local_starts_no_redis_when_told_of_one() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let dir = tempfile::tempdir().unwrap();
    let calls = dir.path().join("cargo-calls");
    let cargo = dir.path().join("cargo");
    std::fs::write(&cargo, format!("#!/bin/sh\necho \"$*\" >> '{}'\n", calls.display())).unwrap();
    std::fs::set_permissions(&cargo, std::fs::Permissions::from_mode(0o755)).unwrap();
    let path = format!("{}:{}", dir.path().display(), std::env::var("PATH").unwrap());
    // A Redis the script started would write its pid here: stopped on the way out.
    let pid_file = dir
        .path()
        .join(format!("latchkey-redis-{}", dir.path().metadata().unwrap().uid()))
        .join("redis.pid");
    let _stop = StopByPidFile(pid_file.clone());
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/run-local");
    let url = "redis://127.0.0.1:1";
    let run = |args: &[&str], env_url: Option<&str>| {
        let mut command = std::process::Command::new(script);
        command
            .args(args)
            .env("PATH", &path)
            .env("TMPDIR", dir.path())
            .env_remove("LATCHKEY_REDIS_URL");
        if let Some(url) = env_url {
            command.env("LATCHKEY_REDIS_URL", url);
        }
        let out = command.output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
        stdout
    };
    for (args, env_url) in [
        (vec!["--redis-url", url], None),
        (vec![&*format!("--redis-url={url}")], None),
        (vec!["--watchdog-timeout", "10s"], Some(url)),
    ] {
        let stdout = run(&args, env_url);
        assert!(stdout.contains("none is started here"), "{args:?}: {stdout}");
        assert!(!pid_file.exists(), "{args:?}: a local Redis was started");
        let called = std::fs::read_to_string(&calls).unwrap();
        let last = called.lines().last().unwrap();
        assert_eq!(last, format!("run --release -p latchkey-server -- {}", args.join(" ")));
    }
}

/// Stops the Redis whose pid file this names, if there is one, when dropped.
struct StopByPidFile(std::path::PathBuf);

impl Drop for StopByPidFile {
    fn drop(&mut self) {
        let pid = std::fs::read_to_string(&self.0)
            .ok()
            .and_then(|pid| pid.trim().parse().ok());
        if let Some(pid) = pid {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGTERM);
        }
    }
}
