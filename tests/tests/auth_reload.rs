//! An auth file reload ends the streams whose rights it takes away
//! (`server/src/auth/standing.rs`, its use in the Acquire and Watch streams, and the
//! watchdog's `revoke_where_refused`), at the edges `security.rs` does not reach. Hot locks whose holder and
//! waiters are all revoked at once, a fair waiter's queue entry, a multi-lock wait
//! partly revoked, a revocation between the stream's start and its `open`, a waiter
//! revoked while its try is in flight, semaphores, RedLock, mTLS subjects, reloads that
//! change nothing, dropped actions, metrics, and a shutdown at the same time.

use latchkey_client::{Client, ConnectOptions, Error, LockKind, LockWatch, LostReason};
use latchkey_proto::v1::lock_service_client::LockServiceClient;
use latchkey_proto::v1::{acquire_request::Action, AcquireRequest, Open};
use latchkey_tests::certs::{CertFiles, Pki};
use latchkey_tests::proxy::Proxy;
use latchkey_tests::server::{cycle, spawn_queued, uncredited, Latchkey};
use latchkey_tests::{bounded, poll_until, scrape_metrics, LatchkeyProcess, RedisServer};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tokio_stream::wrappers::ReceiverStream;
use tonic::Code;

/// How long a test waits for a file change to be picked up (the server polls every
/// second and applies a change once two reads agree).
const RELOAD_WAIT: Duration = Duration::from_secs(10);
/// How long a test waits for one call.
const T: Duration = Duration::from_secs(10);

/// alice and bob share `shared/`; ops is the admin.
const AUTH: &str = r#"
[[identity]]
name = "alice"
tokens = ["alice-token"]
prefixes = ["alice/", "shared/"]

[[identity]]
name = "bob"
tokens = ["bob-token"]
prefixes = ["bob/", "shared/"]

[[identity]]
name = "ops"
tokens = ["ops-token"]
admin = true
"#;

/// AUTH with alice's token revoked.
fn alice_revoked() -> String {
    AUTH.replace(r#"["alice-token"]"#, r#"["alice-token-2"]"#)
}

fn path(p: &Path) -> String {
    p.to_str().expect("UTF-8 path").to_owned()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A directory of its own (removed when dropped) with `auth.toml` holding AUTH, and
/// the file's path.
fn auth_file() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let auth = dir.path().join("auth.toml");
    std::fs::write(&auth, AUTH).unwrap();
    (dir, auth)
}

/// A server process on `redis` under the auth file `auth`, for the tests that read its
/// metrics.
fn process_with_auth(redis: &RedisServer, auth: &Path) -> LatchkeyProcess {
    let args = [
        "--redis-url".to_owned(),
        redis.url(),
        "--auth-file".to_owned(),
        path(auth),
    ];
    LatchkeyProcess::spawn(&args)
}

/// The `open` of a fixed lease of an hour on `name`.
fn hour_lease(name: &str) -> Open {
    Open {
        name: name.to_owned(),
        lease: Some(prost_types::Duration {
            seconds: 3600,
            nanos: 0,
        }),
        ..Default::default()
    }
}

/// A server on `redis_url` with the auth file at `auth` (no TLS, loopback), reached by
/// the harness as ops.
async fn auth_server_on(redis_url: &str, auth: &Path, extra: &[&str]) -> Latchkey {
    let auth = path(auth);
    let mut args = vec!["--auth-file", auth.as_str()];
    args.extend_from_slice(extra);
    Latchkey::start_secure(redis_url, &args, ConnectOptions::new().token("ops-token")).await
}

async fn client(server: &Latchkey, token: &str) -> Client {
    server
        .client_with(&ConnectOptions::new().token(token))
        .await
        .expect("client connects")
}

/// How `watch` ends (its states skipped until then), within RELOAD_WAIT.
async fn watch_end(watch: &mut LockWatch, what: &str) -> (Code, String) {
    code(
        bounded(RELOAD_WAIT, what, async {
            loop {
                match watch.next().await {
                    Ok(Some(_)) => continue,
                    other => return other,
                }
            }
        })
        .await,
    )
}

/// The status code of a failed call, with its message for the assertion text.
fn code(result: Result<impl std::fmt::Debug, Error>) -> (Code, String) {
    let err = result.expect_err("the call must be refused");
    (err.code(), err.to_string())
}

/// Writes `text` to the auth file and waits until a Describe of `name` by `probe`
/// gives `want` (the reload is in force).
async fn reload_until(auth: &Path, text: &str, probe: &Client, name: &str, want: Code) {
    std::fs::write(auth, text).unwrap();
    let deadline = Instant::now() + RELOAD_WAIT;
    loop {
        let got = match probe.describe(name).await {
            Ok(_) => Code::Ok,
            Err(e) => e.code(),
        };
        if got == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the reload never gave {want:?} (last {got:?})"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A lock holder and five waiters of alice, all on one hot lock, and bob's waiter
/// behind them: alice's revocation ends her hold and every wait of hers at once, and
/// the lock goes to bob at once, whatever its kind (the release of alice's hold and the
/// waits that leave meanwhile race over in-memory handoffs). Nothing of alice's stays:
/// bob holds it alone and once he releases it is free.
#[tokio::test]
async fn a_hot_lock_whose_holder_and_waiters_are_all_revoked_goes_to_the_rightful_waiter() {
    let redis = RedisServer::start();
    let (_dir, auth) = auth_file();
    let server = auth_server_on(&redis.url(), &auth, &[]).await;
    let ops = server.client().await;
    let alice = client(&server, "alice-token").await;
    let bob = client(&server, "bob-token").await;

    let kinds = [
        (LockKind::Mutex, None),
        (LockKind::Fair, None),
        (LockKind::Write, None),
        (LockKind::Mutex, Some("shared-owner")),
        (LockKind::Semaphore, None),
    ];
    let mut held = Vec::new();
    let mut alice_waits = Vec::new();
    let mut bob_waits = Vec::new();
    for (i, (kind, owner)) in kinds.iter().enumerate() {
        let name = format!("shared/hot/{i}");
        let build = |c: &Client| {
            let mut b = c.lock(name.clone()).kind(*kind);
            if *kind == LockKind::Semaphore {
                b = b.limit(1);
            }
            b
        };
        let mut first = build(&alice);
        if let Some(owner) = owner {
            first = first.owner(*owner);
        }
        held.push(first.acquire().await.expect("alice takes the hot lock"));
        for _ in 0..5 {
            let mut b = build(&alice).wait(T * 6);
            // Named owners reenter: they are not waiters then.
            if owner.is_some() {
                b = b.owner(format!("other-{}", alice_waits.len()));
            }
            let (w, _) = spawn_queued(b, T).await;
            alice_waits.push(w);
        }
        let (w, _) = spawn_queued(build(&bob).wait(T * 6), T).await;
        bob_waits.push((name, w));
    }

    std::fs::write(&auth, alice_revoked()).unwrap();
    let written = Instant::now();
    for lease in &held {
        let reason = bounded(RELOAD_WAIT, "alice's hold ended", lease.lost()).await;
        assert_eq!(reason, LostReason::Revoked, "{}", lease.name());
    }
    for w in alice_waits {
        let (c, m) = code(bounded(RELOAD_WAIT, "alice's wait ended", w).await.unwrap());
        assert_eq!(c, Code::Unauthenticated, "{m}");
    }
    for (name, w) in bob_waits {
        let lease = bounded(T, "bob's wait", w)
            .await
            .unwrap()
            .unwrap_or_else(|e| panic!("bob is granted {name}: {e}"));
        // The reload lands within about two seconds of the write; bob comes right after,
        // not after a lease or a fair waiter's timeout.
        assert!(
            written.elapsed() < Duration::from_secs(6),
            "{name}: {:?}",
            written.elapsed()
        );
        let state = ops.describe(&name).await.unwrap();
        assert_eq!(state.holders.len(), 1, "{name}: {state:?}");
        assert_eq!(state.holders[0].owner, lease.owner(), "{name}: {state:?}");
        lease.release().await.expect("bob releases");
        let state = ops.describe(&name).await.unwrap();
        assert!(!state.locked, "{name}: {state:?}");
        assert!(state.waiters.is_empty(), "{name}: {state:?}");
    }
    server.stop().await;
}

/// A fair waiter of alice revoked while ops holds the lock leaves the queue (in Redis
/// too): ops' release then goes to bob behind it at once, not after the revoked
/// waiter's queue timeout. With alice's and bob's waiters on two servers, the queue in
/// Redis is all that tells the second server about the first's waiter.
#[tokio::test]
async fn a_revoked_fair_waiter_leaves_the_queue_on_every_server() {
    let redis = RedisServer::start();
    let (_dir, auth) = auth_file();
    let one = auth_server_on(&redis.url(), &auth, &[]).await;
    let two = auth_server_on(&redis.url(), &auth, &[]).await;
    let ops = one.client().await;
    let alice = client(&one, "alice-token").await;
    let bob_one = client(&one, "bob-token").await;
    let bob_two = client(&two, "bob-token").await;

    let busy = ops.lock("shared/fair").kind(LockKind::Fair).acquire().await.unwrap();
    let (alice_waiting, _) = spawn_queued(alice.lock("shared/fair").kind(LockKind::Fair).wait(T * 6), T).await;
    let (bob_here, _) = spawn_queued(bob_one.lock("shared/fair").kind(LockKind::Fair).wait(T * 6), T).await;
    let (bob_there, _) = spawn_queued(bob_two.lock("shared/fair").kind(LockKind::Fair).wait(T * 6), T).await;
    assert_eq!(ops.describe("shared/fair").await.unwrap().waiters.len(), 3);

    reload_until(&auth, &alice_revoked(), &alice, "shared/fair", Code::Unauthenticated).await;
    let (c, m) = code(bounded(RELOAD_WAIT, "alice's wait ended", alice_waiting).await.unwrap());
    assert_eq!(c, Code::Unauthenticated, "{m}");
    let mut state = ops.describe("shared/fair").await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(3);
    while state.waiters.len() != 2 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
        state = ops.describe("shared/fair").await.unwrap();
    }
    assert_eq!(state.waiters.len(), 2, "alice's queue entry is gone: {state:?}");

    let released = Instant::now();
    busy.release().await.unwrap();
    let first = bounded(T, "bob's first wait", bob_here)
        .await
        .unwrap()
        .expect("bob here");
    assert!(released.elapsed() < Duration::from_secs(2), "{:?}", released.elapsed());
    let released = Instant::now();
    first.release().await.unwrap();
    let second = bounded(T, "bob's second wait", bob_there)
        .await
        .unwrap()
        .expect("bob there");
    assert!(released.elapsed() < Duration::from_secs(2), "{:?}", released.elapsed());
    second.release().await.unwrap();
    one.stop().await;
    two.stop().await;
}

/// bob waits for a multi-lock of `bob/a` and `shared/b` (ops holds `shared/b`); a
/// reload drops `shared/` from bob: the wait ends PERMISSION_DENIED naming `shared/b`,
/// and `bob/a`, which a try of the multi-lock may have taken on its way, is free.
#[tokio::test]
async fn a_multi_lock_wait_partly_revoked_ends_and_leaves_nothing_held() {
    let redis = RedisServer::start();
    let (_dir, auth) = auth_file();
    let server = auth_server_on(&redis.url(), &auth, &[]).await;
    let ops = server.client().await;
    let bob = client(&server, "bob-token").await;

    let busy = ops.lock("shared/b").acquire().await.unwrap();
    let (waiting, _) = spawn_queued(bob.lock_all(["bob/a", "shared/b"]).wait(T * 6), T).await;
    let narrowed = AUTH.replace(r#"["bob/", "shared/"]"#, r#"["bob/"]"#);
    reload_until(&auth, &narrowed, &bob, "shared/b", Code::PermissionDenied).await;
    let (c, m) = code(bounded(RELOAD_WAIT, "bob's wait ended", waiting).await.unwrap());
    assert_eq!(c, Code::PermissionDenied, "{m}");
    assert!(m.contains("shared/b"), "{m}");
    assert!(
        poll_until(Duration::from_secs(3), || redis.cli(&["EXISTS", "bob/a"]).trim() == "0").await,
        "bob/a left held"
    );
    // bob may still take bob/a alone.
    bob.lock("bob/a")
        .try_once()
        .acquire()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    busy.release().await.unwrap();
    server.stop().await;
}

/// The raw `Acquire` stream of `token`, its request side, and the call in a task (the
/// server answers with its first event).
type RawCall = tokio::task::JoinHandle<
    Result<tonic::Response<tonic::Streaming<latchkey_proto::v1::AcquireResponse>>, tonic::Status>,
>;

async fn raw_acquire(endpoint: &str, token: &str) -> (tokio::sync::mpsc::Sender<AcquireRequest>, RawCall) {
    let mut raw = LockServiceClient::connect(endpoint.to_owned())
        .await
        .expect("raw client");
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    let mut request = tonic::Request::new(ReceiverStream::new(rx));
    request
        .metadata_mut()
        .insert("authorization", format!("Bearer {token}").parse().unwrap());
    let call = tokio::spawn(async move { raw.acquire(request).await });
    (tx, call)
}

/// A stream authenticated under the old file that sends `open` only after a reload
/// revoked its token: the stream started (its caller checked by the interceptor) before
/// the reload, so the reload is what refuses it, as a new call would be refused: with
/// the status alone, no event first, and nothing done in Redis (no grant, not even one
/// given back: the fencing counter of the free lock is untouched).
#[tokio::test]
async fn a_revocation_between_the_streams_start_and_its_open_is_not_missed() {
    let redis = RedisServer::start();
    let (_dir, auth) = auth_file();
    let server = auth_server_on(&redis.url(), &auth, &[]).await;
    let ops = server.client().await;
    let alice = client(&server, "alice-token").await;
    let busy = ops.lock("shared/busy").acquire().await.unwrap();
    // A waiter of ops' in line on the busy lock (a hot lock: a newcomer joins the line).
    let (ops_waiting, _) = spawn_queued(ops.lock("shared/busy").wait(T * 6), T).await;

    let mut streams = Vec::new();
    for (name, wait) in [
        ("shared/free", None),
        ("shared/free-try", Some(Duration::ZERO)),
        ("shared/busy", Some(T * 3)),
    ] {
        let (tx, call) = raw_acquire(server.endpoint(), "alice-token").await;
        streams.push((name, wait, tx, call));
    }
    // Let the calls reach the server (authenticated now).
    tokio::time::sleep(Duration::from_millis(500)).await;
    reload_until(&auth, &alice_revoked(), &alice, "shared/x", Code::Unauthenticated).await;

    let mut failures = Vec::new();
    for (name, wait, tx, call) in streams {
        let open = Open {
            name: name.to_owned(),
            wait_timeout: wait.map(|w| prost_types::Duration::try_from(w).unwrap()),
            ..Default::default()
        };
        tx.send(AcquireRequest {
            action: Some(Action::Open(open)),
        })
        .await
        .expect("send open");
        let answer = bounded(T, "the late open's answer", call).await.unwrap();
        match answer {
            Err(status) if status.code() == Code::Unauthenticated => {}
            Err(status) => failures.push(format!("{name}: ended {status:?}")),
            Ok(response) => {
                let mut events = response.into_inner();
                let mut seen = Vec::new();
                let end = loop {
                    match bounded(T, "the next event", events.message()).await {
                        Ok(Some(event)) => seen.push(format!("{:?}", event.event)),
                        Ok(None) => break "OK".to_owned(),
                        Err(status) => break format!("{:?} {:?}", status.code(), status.message()),
                    }
                };
                failures.push(format!(
                    "{name}: a revoked stream was told {seen:?} before it ended {end}"
                ));
            }
        }
        drop(tx);
    }
    for name in ["shared/free", "shared/free-try"] {
        assert!(
            poll_until(Duration::from_secs(5), || redis.cli(&["EXISTS", name]).trim() == "0").await,
            "{name} left held by a revoked stream"
        );
        let fence = redis.cli(&["GET", &format!("latchkey_fence:{{{name}}}")]);
        if !fence.trim().is_empty() {
            failures.push(format!(
                "{name}: the revoked stream was granted the lock (fencing counter {})",
                fence.trim()
            ));
        }
    }
    busy.release().await.unwrap();
    let next = bounded(T, "ops' waiter", ops_waiting)
        .await
        .unwrap()
        .expect("ops' turn");
    next.release().await.unwrap();
    server.stop().await;
    assert!(failures.is_empty(), "{failures:#?}");
}

/// alice's try for a free lock is in flight (its command held back on its way to
/// Redis) when a reload revokes her token: the stream ends UNAUTHENTICATED without
/// waiting for the try, and the grant the try then makes in Redis is given back.
#[tokio::test]
async fn a_waiter_revoked_while_its_try_is_in_flight_gives_the_grant_back() {
    let redis = RedisServer::start();
    let proxy = Proxy::to_redis(&redis).await;
    let (_dir, auth) = auth_file();
    let server = auth_server_on(&proxy.redis_url(), &auth, &[]).await;
    let alice = client(&server, "alice-token").await;
    cycle(&alice, "shared/warm").await;

    let hold = Duration::from_secs(8);
    proxy.hold_back_matching(Some((b"shared/inflight", hold)));
    let sent = Instant::now();
    let call = {
        let alice = alice.clone();
        tokio::spawn(async move { alice.lock("shared/inflight").wait(T * 3).acquire().await })
    };
    assert!(
        poll_until(Duration::from_secs(3), || proxy.holding() > 0).await,
        "the try never left"
    );
    proxy.hold_back_matching(None);
    std::fs::write(&auth, alice_revoked()).unwrap();
    let (c, m) = code(bounded(RELOAD_WAIT, "alice's wait ended", call).await.unwrap());
    assert_eq!(c, Code::Unauthenticated, "{m}");
    assert!(
        sent.elapsed() < hold,
        "the wait ended only after its try answered: {:?}",
        sent.elapsed()
    );
    // The try reaches Redis after the hold and grants; that grant is given back.
    assert!(
        poll_until(hold + Duration::from_secs(6), || {
            sent.elapsed() > hold && redis.cli(&["EXISTS", "shared/inflight"]).trim() == "0"
        })
        .await,
        "the in-flight try's grant was kept: {}",
        redis.cli(&["HGETALL", "shared/inflight"])
    );
    server.stop().await;
}

/// Reloads that take no right away end nothing: a comment and blank lines, a file
/// that does not parse (the old one stays), the token written as its SHA-256 instead,
/// the identities in another order with a new one. alice's leases, wait and Watch go
/// on through all of them; then a real revocation ends them.
#[tokio::test]
async fn reloads_that_take_no_right_away_end_nothing() {
    let redis = RedisServer::start();
    let (_dir, auth) = auth_file();
    let server = auth_server_on(&redis.url(), &auth, &[]).await;
    let ops = server.client().await;
    let alice = client(&server, "alice-token").await;

    let leases = latchkey_tests::server::a_lease_of_every_kind(&alice, "alice/every/", 2).await;
    let multi = alice.lock_all(["alice/m1", "shared/m2"]).acquire().await.unwrap();
    let busy = ops.lock("alice/busy").acquire().await.unwrap();
    let (waiting, _) = spawn_queued(alice.lock("alice/busy").wait(Duration::from_secs(120)), T).await;
    let mut watch = alice.watch("shared/w").await.unwrap();
    watch.next().await.expect("alice watches");

    let digest = hex(&Sha256::digest(b"alice-token"));
    let variants = [
        format!("# a comment\n\n{AUTH}\n\n"),
        "[[identity]]\nname = \"x\"\ntokens = [\"y\"".to_owned(),
        AUTH.replace(r#"tokens = ["alice-token"]"#, &format!("token_sha256 = [\"{digest}\"]")),
        format!(
            "[[identity]]\nname = \"carol\"\ntokens = [\"carol-token\"]\nprefixes = [\"carol/\"]\n{}",
            AUTH.replace(
                r#"prefixes = ["alice/", "shared/"]"#,
                r#"prefixes = ["shared/", "alice/", "more/"]"#
            )
        ),
    ];
    for text in &variants {
        std::fs::write(&auth, text).unwrap();
        // Two polls to settle, one to apply, and some margin.
        tokio::time::sleep(Duration::from_secs(4)).await;
        for lease in leases.iter().chain([&multi]) {
            assert!(!lease.is_lost(), "{} ended by a reload of\n{text}", lease.name());
        }
        assert!(!waiting.is_finished(), "the wait ended by a reload of\n{text}");
        alice.describe("alice/x").await.expect("alice still works");
    }
    // The watch is still open: a change reaches it.
    let probe = ops.lock("shared/w").acquire().await.unwrap();
    let state = bounded(T, "the watch sees ops' grant", watch.next())
        .await
        .expect("the watch goes on")
        .expect("a state");
    assert!(state.locked, "{state:?}");
    probe.release().await.unwrap();

    reload_until(&auth, &alice_revoked(), &alice, "alice/x", Code::Unauthenticated).await;
    for lease in leases.iter().chain([&multi]) {
        let reason = bounded(RELOAD_WAIT, "alice's lease ended", lease.lost()).await;
        assert_eq!(reason, LostReason::Revoked, "{}", lease.name());
    }
    let (c, m) = watch_end(&mut watch, "alice's watch ended").await;
    assert_eq!(c, Code::Unauthenticated, "{m}");
    let (c, m) = code(bounded(RELOAD_WAIT, "alice's wait ended", waiting).await.unwrap());
    assert_eq!(c, Code::Unauthenticated, "{m}");
    busy.release().await.unwrap();
    server.stop().await;
}

/// An identity's dropped action ends only the streams of that action: `acquire` taken
/// away ends alice's leases (PERMISSION_DENIED, told `Revoked`) and keeps her Watch;
/// `inspect` taken away then ends the Watch.
#[tokio::test]
async fn a_dropped_action_ends_only_the_streams_of_that_action() {
    let redis = RedisServer::start();
    let (_dir, auth) = auth_file();
    let server = auth_server_on(&redis.url(), &auth, &[]).await;
    let ops = server.client().await;
    let alice = client(&server, "alice-token").await;

    let lease = alice.lock("shared/a").acquire().await.unwrap();
    let mut watch = alice.watch("shared/a").await.unwrap();
    watch.next().await.expect("alice watches");

    let inspect_only = AUTH.replace(
        r#"prefixes = ["alice/", "shared/"]"#,
        "prefixes = [\"alice/\", \"shared/\"]\nactions = [\"inspect\"]",
    );
    std::fs::write(&auth, &inspect_only).unwrap();
    let reason = bounded(RELOAD_WAIT, "alice's lease ended", lease.lost()).await;
    assert_eq!(reason, LostReason::Revoked);
    // The release shows on the watch, which goes on.
    let state = bounded(T, "the watch sees the release", async {
        loop {
            let state = watch.next().await.expect("the watch goes on").expect("a state");
            if !state.locked {
                return state;
            }
        }
    })
    .await;
    assert!(!state.locked);
    let again = ops.lock("shared/a").acquire().await.unwrap();
    let state = bounded(T, "the watch sees ops' grant", watch.next())
        .await
        .unwrap()
        .unwrap();
    assert!(state.locked, "{state:?}");

    let acquire_only = AUTH.replace(
        r#"prefixes = ["alice/", "shared/"]"#,
        "prefixes = [\"alice/\", \"shared/\"]\nactions = [\"acquire\"]",
    );
    std::fs::write(&auth, &acquire_only).unwrap();
    let (c, m) = watch_end(&mut watch, "alice's watch ended").await;
    assert_eq!(c, Code::PermissionDenied, "{m}");
    assert!(m.contains("inspect") && m.contains("shared/a"), "{m}");
    again.release().await.unwrap();
    server.stop().await;
}

/// alice holds 2 permits of a semaphore of 3, and waits for 2 more on another; bob
/// waits for 2 on the first. alice's revocation gives her permits back and bob is
/// granted at once; her waiting stream ends and takes no permit.
#[tokio::test]
async fn a_revoked_semaphore_holder_gives_its_permits_to_the_next() {
    let redis = RedisServer::start();
    let (_dir, auth) = auth_file();
    let server = auth_server_on(&redis.url(), &auth, &[]).await;
    let ops = server.client().await;
    let alice = client(&server, "alice-token").await;
    let bob = client(&server, "bob-token").await;
    let sem = |c: &Client, name: &str, permits| {
        c.lock(name.to_owned())
            .kind(LockKind::Semaphore)
            .limit(3)
            .permits(permits)
    };

    let held = sem(&alice, "shared/sem", 2).acquire().await.unwrap();
    let (bob_waiting, _) = spawn_queued(sem(&bob, "shared/sem", 2).wait(T * 6), T).await;
    let other = sem(&ops, "shared/sem2", 2).acquire().await.unwrap();
    let (alice_waiting, _) = spawn_queued(sem(&alice, "shared/sem2", 2).wait(T * 6), T).await;

    std::fs::write(&auth, alice_revoked()).unwrap();
    assert_eq!(
        bounded(RELOAD_WAIT, "alice's permits", held.lost()).await,
        LostReason::Revoked
    );
    let granted = Instant::now();
    let bobs = bounded(T, "bob's wait", bob_waiting)
        .await
        .unwrap()
        .expect("bob's permits");
    assert!(granted.elapsed() < Duration::from_secs(2), "{:?}", granted.elapsed());
    let (c, m) = code(bounded(RELOAD_WAIT, "alice's wait", alice_waiting).await.unwrap());
    assert_eq!(c, Code::Unauthenticated, "{m}");
    other.release().await.unwrap();
    // All 3 of shared/sem2 are free: alice's wait took nothing.
    sem(&ops, "shared/sem2", 3)
        .try_once()
        .acquire()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    bobs.release().await.unwrap();
    sem(&ops, "shared/sem", 3)
        .try_once()
        .acquire()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    server.stop().await;
}

/// A RedLock lease of a revoked token is released on every node.
#[tokio::test]
async fn a_revoked_redlock_lease_is_released_on_every_node() {
    let nodes: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
    let main = RedisServer::start();
    let (_dir, auth) = auth_file();
    let urls: Vec<String> = nodes.iter().map(RedisServer::url).collect();
    let mut extra: Vec<&str> = Vec::new();
    for url in &urls {
        extra.extend(["--redlock-url", url.as_str()]);
    }
    extra.extend(["--redlock-restart-delay", "0s"]);
    let server = auth_server_on(&main.url(), &auth, &extra).await;
    let ops = server.client().await;
    let alice = client(&server, "alice-token").await;
    let lease = alice.lock("shared/rl").redlock(true).acquire().await.unwrap();
    let holders = || {
        nodes
            .iter()
            .filter(|n| n.cli(&["EXISTS", "shared/rl"]).trim() == "1")
            .count()
    };
    assert_eq!(holders(), 3);
    let waiting = {
        let ops = ops.clone();
        tokio::spawn(async move { ops.lock("shared/rl").redlock(true).wait(T * 3).acquire().await })
    };
    std::fs::write(&auth, alice_revoked()).unwrap();
    assert_eq!(
        bounded(RELOAD_WAIT, "alice's lease", lease.lost()).await,
        LostReason::Revoked
    );
    let next = bounded(T, "ops' wait", waiting).await.unwrap().expect("ops' turn");
    next.release().await.unwrap();
    assert!(
        poll_until(Duration::from_secs(3), || holders() == 0).await,
        "a node kept a hold"
    );
    server.stop().await;
}

fn tls(pki: &Pki) -> ConnectOptions {
    ConnectOptions::new().ca_pem(pki.ca_pem())
}

fn with_cert(pki: &Pki, cert: &CertFiles) -> ConnectOptions {
    tls(pki).identity_pem(cert.cert_pem(), cert.key_pem())
}

/// Under mTLS the streams of a certificate are checked again by its names: a reload
/// that changes nothing of alice's keeps them; the subject given to another identity
/// ends them UNAUTHENTICATED, naming it; the lease is released.
#[tokio::test]
async fn mtls_subject_streams_are_checked_again_by_their_names() {
    const CERT_AUTH: &str = r#"
[[identity]]
name = "alice"
subjects = ["alice"]
prefixes = ["shared/"]

[[identity]]
name = "ops"
tokens = ["ops-token"]
admin = true
"#;
    let redis = RedisServer::start();
    let pki = Pki::new("main");
    let auth = pki.dir().join("auth.toml");
    std::fs::write(&auth, CERT_AUTH).unwrap();
    let server_cert = pki.server("server");
    let args = [
        "--tls-cert".to_owned(),
        path(&server_cert.cert),
        "--tls-key".to_owned(),
        path(&server_cert.key),
        "--auth-file".to_owned(),
        path(&auth),
        "--tls-client-ca".to_owned(),
        path(&pki.ca()),
    ];
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let alice_cert = pki.client("alice", "alice");
    let ops_options = with_cert(&pki, &alice_cert).token("ops-token");
    let server = Latchkey::start_secure(&redis.url(), &args, ops_options).await;
    let ops = server.client().await;
    let alice = server.client_with(&with_cert(&pki, &alice_cert)).await.unwrap();
    let lease = alice.lock("shared/c").acquire().await.expect("alice by certificate");
    let mut watch = alice.watch("shared/c").await.unwrap();
    watch.next().await.expect("alice watches");

    // Nothing of alice's changes.
    std::fs::write(
        &auth,
        CERT_AUTH.replace("prefixes = [\"shared/\"]", "prefixes = [\"shared/\", \"x/\"]"),
    )
    .unwrap();
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert!(!lease.is_lost(), "ended by a reload that kept alice's rights");

    // The subject is carol's now.
    let moved = CERT_AUTH.replace("subjects = [\"alice\"]", "subjects = [\"alice-old\"]")
        + "\n[[identity]]\nname = \"carol\"\nsubjects = [\"alice\"]\nprefixes = [\"shared/\"]\n";
    std::fs::write(&auth, moved).unwrap();
    assert_eq!(
        bounded(RELOAD_WAIT, "alice's lease", lease.lost()).await,
        LostReason::Revoked
    );
    let (c, m) = watch_end(&mut watch, "alice's watch ended").await;
    assert_eq!(c, Code::Unauthenticated, "{m}");
    assert!(m.contains("carol"), "{m}");
    let state = ops.describe("shared/c").await.unwrap();
    assert!(!state.locked, "{state:?}");
    server.stop().await;
}

/// The value of the first metric line that starts with `name` and has every label.
fn labelled(scrape: &str, name: &str, labels: &[&str]) -> f64 {
    scrape
        .lines()
        .filter(|l| l.starts_with(name) && labels.iter().all(|x| l.contains(x)))
        .find_map(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0.0)
}

/// The metrics count each revoked stream once, under its status, and the gauges come
/// back: a held lease and a waiter (Acquire UNAUTHENTICATED), a Watch (Watch
/// UNAUTHENTICATED).
#[tokio::test]
async fn revoked_streams_are_counted_with_their_status_and_the_gauges_come_back() {
    let redis = RedisServer::start();
    let (_dir, auth) = auth_file();
    let server = process_with_auth(&redis, &auth);
    let port = server.metrics_port().expect("metrics");
    let connect = |token: &str| {
        let endpoint = server.endpoint();
        let options = ConnectOptions::new().token(token);
        async move { Client::connect_with(&endpoint, &options).await.expect("connects") }
    };
    let ops = connect("ops-token").await;
    let alice = connect("alice-token").await;
    let busy = ops.lock("shared/busy").acquire().await.unwrap();
    let lease = alice.lock("shared/a").acquire().await.unwrap();
    let (waiting, _) = spawn_queued(alice.lock("shared/busy").wait(T * 6), T).await;
    let mut watch = alice.watch("shared/a").await.unwrap();
    watch.next().await.expect("alice watches");
    let before = scrape_metrics(port);

    std::fs::write(&auth, alice_revoked()).unwrap();
    assert_eq!(
        bounded(RELOAD_WAIT, "alice's lease", lease.lost()).await,
        LostReason::Revoked
    );
    let (c, _) = code(bounded(RELOAD_WAIT, "alice's wait", waiting).await.unwrap());
    assert_eq!(c, Code::Unauthenticated);
    let (c, _) = watch_end(&mut watch, "alice's watch").await;
    assert_eq!(c, Code::Unauthenticated);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = scrape_metrics(port);
    let handled = |s: &str, method: &str, code: &str| {
        labelled(
            s,
            "latchkey_rpc_handled_total",
            &[&format!("method=\"{method}\""), &format!("code=\"{code}\"")],
        )
    };
    assert_eq!(
        handled(&after, "Acquire", "Unauthenticated") - handled(&before, "Acquire", "Unauthenticated"),
        2.0,
        "{after}"
    );
    assert_eq!(
        handled(&after, "Watch", "Unauthenticated") - handled(&before, "Watch", "Unauthenticated"),
        1.0,
        "{after}"
    );
    let gauge = |s: &str, name: &str| labelled(s, name, &[]);
    assert_eq!(gauge(&after, "latchkey_streams_open"), 1.0, "ops' hold only: {after}");
    assert_eq!(gauge(&after, "latchkey_leases_held"), 1.0, "{after}");
    assert_eq!(gauge(&after, "latchkey_waiters"), 0.0, "{after}");
    busy.release().await.unwrap();
}

/// A reload and a graceful shutdown at the same moment: the shutdown ends in time and
/// leaves nothing held in Redis.
#[tokio::test]
async fn a_revocation_during_shutdown_leaves_nothing_behind() {
    let redis = RedisServer::start();
    let (_dir, auth) = auth_file();
    let server = auth_server_on(&redis.url(), &auth, &[]).await;
    let ops = server.client().await;
    let alice = client(&server, "alice-token").await;
    let mut leases = Vec::new();
    for i in 0..40 {
        leases.push(alice.lock(format!("shared/s/{i}")).acquire().await.unwrap());
    }
    let busy = ops.lock("shared/busy").acquire().await.unwrap();
    let mut waits = Vec::new();
    for _ in 0..5 {
        waits.push(spawn_queued(alice.lock("shared/busy").wait(T * 6), T).await.0);
    }
    std::fs::write(&auth, alice_revoked()).unwrap();
    bounded(RELOAD_WAIT, "the first lease ends", leases[0].lost()).await;
    bounded(Duration::from_secs(20), "the shutdown", server.stop()).await;
    for w in waits {
        let _ = bounded(T, "a wait ends", w).await;
    }
    drop(busy);
    let left = redis.cli(&["KEYS", "shared/s/*"]);
    assert!(left.trim().is_empty(), "left held: {left}");
}

/// alice has two tokens; a stream of each holds `shared/r` under the owner `o` (a
/// reentrant hold, count 2). Revoking one token ends its stream only, which gives back
/// one hold: the lock stays alice's (count 1), held by her other stream, and bob cannot
/// take it until that one releases.
#[tokio::test]
async fn revoking_one_token_of_a_reentrant_owner_gives_back_only_its_hold() {
    let two_tokens = AUTH.replace(r#"["alice-token"]"#, r#"["alice-token", "alice-token-b"]"#);
    let redis = RedisServer::start();
    let (_dir, auth) = auth_file();
    std::fs::write(&auth, &two_tokens).unwrap();
    let server = auth_server_on(&redis.url(), &auth, &[]).await;
    let ops = server.client().await;
    let alice_a = client(&server, "alice-token").await;
    let alice_b = client(&server, "alice-token-b").await;
    let bob = client(&server, "bob-token").await;

    let first = alice_a.lock("shared/r").owner("o").acquire().await.unwrap();
    let second = alice_b.lock("shared/r").owner("o").acquire().await.unwrap();
    assert_eq!(second.hold_count(), 2);
    let (bob_waiting, _) = spawn_queued(bob.lock("shared/r").wait(T * 6), T).await;

    let revoked = two_tokens.replace(r#"["alice-token", "alice-token-b"]"#, r#"["alice-token-b"]"#);
    std::fs::write(&auth, revoked).unwrap();
    assert_eq!(
        bounded(RELOAD_WAIT, "the first stream", first.lost()).await,
        LostReason::Revoked
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!second.is_lost(), "the other token's stream keeps its hold");
    assert!(!bob_waiting.is_finished(), "bob must not get a lock alice still holds");
    let state = ops.describe("shared/r").await.unwrap();
    assert_eq!(state.holders.len(), 1, "{state:?}");
    assert_eq!(state.holders[0].owner, "alice/o", "{state:?}");
    assert_eq!(state.holders[0].hold_count, 1, "{state:?}");
    second.release().await.expect("the second stream releases its hold");
    let lease = bounded(T, "bob's wait", bob_waiting)
        .await
        .unwrap()
        .expect("bob's turn");
    lease.release().await.unwrap();
    server.stop().await;
}

/// An identity renamed (same token, new name) ends its streams UNAUTHENTICATED (its
/// owner ids were scoped by the old name), and the holds under the old name are gone.
/// Its Watch of a lock that ops watches too ends, and ops' Watch (the same reader) goes
/// on.
#[tokio::test]
async fn a_renamed_identity_ends_its_streams_and_a_shared_watch_goes_on() {
    let redis = RedisServer::start();
    let (_dir, auth) = auth_file();
    let server = auth_server_on(&redis.url(), &auth, &[]).await;
    let ops = server.client().await;
    let alice = client(&server, "alice-token").await;
    let lease = alice.lock("shared/n").owner("o").acquire().await.unwrap();
    let mut alice_watch = alice.watch("shared/n").await.unwrap();
    alice_watch.next().await.expect("alice watches");
    let mut ops_watch = ops.watch("shared/n").await.unwrap();
    ops_watch.next().await.expect("ops watches");

    std::fs::write(&auth, AUTH.replace(r#"name = "alice""#, r#"name = "alicia""#)).unwrap();
    assert_eq!(
        bounded(RELOAD_WAIT, "alice's lease", lease.lost()).await,
        LostReason::Revoked
    );
    let (c, m) = watch_end(&mut alice_watch, "alice's watch ended").await;
    assert_eq!(c, Code::Unauthenticated, "{m}");
    assert!(m.contains("alicia"), "{m}");
    let state = bounded(T, "ops sees the release", async {
        loop {
            let state = ops_watch.next().await.expect("ops' watch goes on").expect("a state");
            if !state.locked {
                return state;
            }
        }
    })
    .await;
    assert!(state.holders.is_empty(), "{state:?}");
    // The renamed identity takes the lock under its new name.
    let again = alice.lock("shared/n").owner("o").acquire().await.unwrap();
    let state = bounded(T, "ops sees alicia", ops_watch.next()).await.unwrap().unwrap();
    assert_eq!(
        state.holders.first().map(|h| h.owner.as_str()),
        Some("alicia/o"),
        "{state:?}"
    );
    again.release().await.unwrap();
    server.stop().await;
}

/// As `a_revocation_between_the_streams_start_and_its_open_is_not_missed`, for a
/// narrowed identity: bob's stream starts while bob may take `shared/`, a reload drops
/// that prefix, then bob sends `open` for a free `shared/` lock. It must be refused
/// PERMISSION_DENIED as a new call is, before any try: the lock's fencing counter in
/// Redis stays untouched.
#[tokio::test]
async fn a_prefix_dropped_before_open_is_refused_before_any_try() {
    let redis = RedisServer::start();
    let (_dir, auth) = auth_file();
    let server = auth_server_on(&redis.url(), &auth, &[]).await;
    let bob = client(&server, "bob-token").await;
    let (tx, call) = raw_acquire(server.endpoint(), "bob-token").await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let narrowed = AUTH.replace(r#"["bob/", "shared/"]"#, r#"["bob/"]"#);
    reload_until(&auth, &narrowed, &bob, "shared/p", Code::PermissionDenied).await;
    tx.send(AcquireRequest {
        action: Some(Action::Open(Open {
            name: "shared/p".to_owned(),
            ..Default::default()
        })),
    })
    .await
    .expect("send open");
    let answer = bounded(T, "the late open's answer", call).await.unwrap();
    let status = answer.expect_err("a narrowed stream is refused");
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    drop(tx);
    assert!(
        poll_until(Duration::from_secs(5), || redis.cli(&["EXISTS", "shared/p"]).trim()
            == "0")
        .await,
        "shared/p left held"
    );
    let fence = redis.cli(&["GET", "latchkey_fence:{shared/p}"]);
    server.stop().await;
    assert!(
        fence.trim().is_empty(),
        "bob, no longer allowed shared/, was granted shared/p in Redis (fencing counter {})",
        fence.trim()
    );
}

/// alice's multi-lock waits on `shared/h` (held by ops) beside bob's mutex waiter in
/// line on it: while it waits, this server passes `shared/h` to none of its waiters in
/// line. alice's revocation ends her wait; ops' release then goes to bob at once.
#[tokio::test]
async fn a_revoked_multi_lock_beside_a_hot_lock_frees_the_line() {
    let redis = RedisServer::start();
    let (_dir, auth) = auth_file();
    let server = auth_server_on(&redis.url(), &auth, &[]).await;
    let ops = server.client().await;
    let alice = client(&server, "alice-token").await;
    let bob = client(&server, "bob-token").await;
    let busy = ops.lock("shared/h").acquire().await.unwrap();
    let (bob_waiting, _) = spawn_queued(bob.lock("shared/h").wait(T * 6), T).await;
    let (alice_waiting, _) = spawn_queued(alice.lock_all(["shared/h", "shared/k"]).wait(T * 6), T).await;
    std::fs::write(&auth, alice_revoked()).unwrap();
    let (c, m) = code(bounded(RELOAD_WAIT, "alice's wait ended", alice_waiting).await.unwrap());
    assert_eq!(c, Code::Unauthenticated, "{m}");
    let released = Instant::now();
    busy.release().await.unwrap();
    let lease = bounded(T, "bob's wait", bob_waiting)
        .await
        .unwrap()
        .expect("bob's turn");
    assert!(released.elapsed() < Duration::from_secs(1), "{:?}", released.elapsed());
    lease.release().await.unwrap();
    assert_eq!(redis.cli(&["EXISTS", "shared/k"]).trim(), "0");
    server.stop().await;
}

/// A holder that gives the server no flow-control credit (no window for what it may
/// send on its stream, here an initial window of 0; a connection window used up by
/// other streams before the grant does the same) is not polled again by HTTP/2: its
/// `acquired` waits for credit, and the stream's own check of the reload never runs.
/// The watchdog, which follows the reloads too, stops renewing its lease, so Redis
/// lets the lock go within the watchdog timeout (before, it was renewed for as long as
/// the client kept the connection), before the stream's connection is cut 2 s after
/// the reload. Compare alice's ordinary lease, released at once.
#[tokio::test]
async fn a_holder_that_gives_no_flow_control_credit_loses_its_lock_at_revocation() {
    let redis = RedisServer::start();
    let (_dir, auth) = auth_file();
    let server = auth_server_on(&redis.url(), &auth, &["--watchdog-timeout", "1s"]).await;
    let ops = server.client().await;
    let alice = client(&server, "alice-token").await;
    let ordinary = alice.lock("shared/ordinary").acquire().await.unwrap();

    let open = Open {
        name: "shared/stuck".to_owned(),
        ..Default::default()
    };
    let (tx, response) = uncredited(server.endpoint(), open, Some("alice-token")).await;
    assert!(
        poll_until(Duration::from_secs(3), || redis.cli(&["EXISTS", "shared/stuck"]).trim()
            == "1")
        .await,
        "never granted"
    );

    std::fs::write(&auth, alice_revoked()).unwrap();
    assert_eq!(
        bounded(RELOAD_WAIT, "alice's ordinary lease", ordinary.lost()).await,
        LostReason::Revoked
    );
    // Within the watchdog timeout (1 s) of the reload, before the stream's connection
    // is cut (2 s after it).
    let gone = poll_until(Duration::from_millis(1600), || {
        redis.cli(&["EXISTS", "shared/stuck"]).trim() == "0"
    })
    .await;
    let state = ops.describe("shared/stuck").await.unwrap();
    let still = redis.cli(&["HGETALL", "shared/stuck"]);
    drop(response);
    drop(tx);
    server.stop().await;
    assert!(
        gone,
        "the revoked holder still held shared/stuck 1.6 s after the reload (renewed): {state:?} {still}"
    );
}

/// A fixed lease whose client gives no flow-control credit is not renewed, so the
/// watchdog's revocation changes nothing for it, and its stream never hears the reload:
/// it held the lock until its lease ended, here an hour. Now the stream, still there a
/// little after the reload that refuses it, has its connection cut, which gives the
/// lock back: bob takes it.
#[tokio::test]
async fn a_revoked_fixed_lease_its_client_does_not_read_is_given_back() {
    let redis = RedisServer::start();
    let (_dir, auth) = auth_file();
    let server = auth_server_on(&redis.url(), &auth, &[]).await;
    let bob = client(&server, "bob-token").await;
    let open = hour_lease("shared/fixed");
    let (tx, mut response) = uncredited(server.endpoint(), open, Some("alice-token")).await;
    assert!(
        poll_until(Duration::from_secs(3), || redis.cli(&["EXISTS", "shared/fixed"]).trim()
            == "1")
        .await,
        "never granted"
    );

    std::fs::write(&auth, alice_revoked()).unwrap();
    let lease = bounded(
        RELOAD_WAIT + T,
        "bob's grant",
        bob.lock("shared/fixed").wait(RELOAD_WAIT + T).acquire(),
    )
    .await
    .expect("bob takes the lock alice's revoked stream held");
    let ended = bounded(T, "alice's stream ends", response.message()).await;
    assert!(ended.is_err(), "{ended:?}");
    lease.release().await.unwrap();
    drop(tx);
    server.stop().await;
}

/// A fair waiter whose client gives no flow-control credit never hears its revocation:
/// it kept its place in line, ops' release handed it the lock, which nobody renewed,
/// and bob behind it was granted a watchdog timeout later (8 s here). Now its
/// connection is cut a little after the reload: its place goes, and ops' release goes
/// to bob at once.
#[tokio::test]
async fn a_revoked_waiter_its_client_does_not_read_leaves_the_line() {
    let redis = RedisServer::start();
    let (_dir, auth) = auth_file();
    let server = auth_server_on(&redis.url(), &auth, &["--watchdog-timeout", "8s"]).await;
    let ops = server.client().await;
    let bob = client(&server, "bob-token").await;
    let busy = ops.lock("shared/line").kind(LockKind::Fair).acquire().await.unwrap();
    let open = Open {
        name: "shared/line".to_owned(),
        kind: LockKind::Fair as i32,
        ..Default::default()
    };
    let (tx, mut response) = uncredited(server.endpoint(), open, Some("alice-token")).await;
    let (bob_waiting, _) = spawn_queued(bob.lock("shared/line").kind(LockKind::Fair).wait(T * 3), T).await;
    assert_eq!(ops.describe("shared/line").await.unwrap().waiters.len(), 2);

    std::fs::write(&auth, alice_revoked()).unwrap();
    let ended = bounded(RELOAD_WAIT + T, "alice's stream ends", response.message()).await;
    assert!(ended.is_err(), "{ended:?}");
    let left = poll_until(T, || {
        redis.cli(&["LLEN", "redisson_lock_queue:{shared/line}"]).trim() == "1"
    });
    assert!(left.await, "alice's place in line is gone");

    let released = Instant::now();
    busy.release().await.unwrap();
    let lease = bounded(T, "bob's wait", bob_waiting)
        .await
        .unwrap()
        .expect("bob's turn");
    assert!(released.elapsed() < Duration::from_secs(1), "{:?}", released.elapsed());
    lease.release().await.unwrap();
    drop(tx);
    server.stop().await;
}

/// A reload that takes one of alice's names away ends that lease on her connection and
/// no other: her stream heard it, so the connection is not cut, and her lease on a name
/// she keeps is held past the time a stream has to hear a reload (2 s).
#[tokio::test]
async fn a_partly_revoked_connection_is_not_cut() {
    let redis = RedisServer::start();
    let (_dir, auth) = auth_file();
    let server = auth_server_on(&redis.url(), &auth, &[]).await;
    let ops = server.client().await;
    let alice = client(&server, "alice-token").await;
    let kept = alice.lock("alice/kept").acquire().await.unwrap();
    let taken = alice.lock("shared/taken").acquire().await.unwrap();

    let narrowed = AUTH.replace(r#"prefixes = ["alice/", "shared/"]"#, r#"prefixes = ["alice/"]"#);
    std::fs::write(&auth, narrowed).unwrap();
    assert_eq!(
        bounded(RELOAD_WAIT, "the lease on shared/taken", taken.lost()).await,
        LostReason::Revoked
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(!kept.is_lost(), "{:?}", kept.lost_reason());
    assert!(ops.describe("alice/kept").await.unwrap().locked);
    kept.release().await.expect("the kept lease is released");
    server.stop().await;
}

/// A release that Redis holds up (a frozen proxy, a 10 s Redis timeout) is under way
/// when a reload takes its name away (the client gives up waiting for its answer after
/// 5 s, and is then told it is unconfirmed): its stream, ending, has no reload left to hear
/// and is not taken for one that did not hear it, so its connection is not cut and
/// alice's other lease on it is kept.
#[tokio::test]
async fn a_release_held_up_across_a_reload_cuts_no_connection() {
    let redis = RedisServer::start();
    let proxy = Proxy::to_redis(&redis).await;
    let (_dir, auth) = auth_file();
    let server = auth_server_on(&proxy.redis_url(), &auth, &["--redis-timeout", "10s"]).await;
    let alice = client(&server, "alice-token").await;
    let kept = alice.lock("alice/kept").acquire().await.unwrap();
    let taken = alice.lock("shared/taken").acquire().await.unwrap();

    proxy.freeze();
    let releasing = tokio::spawn(taken.release());
    let narrowed = AUTH.replace(r#"prefixes = ["alice/", "shared/"]"#, r#"prefixes = ["alice/"]"#);
    std::fs::write(&auth, narrowed).unwrap();
    // The reload is read within 2 s, and a stream that did not hear it is cut off 2 s
    // after; the release is still held up then (the client waits 5 s for its answer).
    tokio::time::sleep(Duration::from_millis(4500)).await;
    assert!(!releasing.is_finished(), "the release was not held up");
    assert!(!kept.is_lost(), "{:?}", kept.lost_reason());
    let released = bounded(T, "the held-up release", releasing).await.unwrap();
    assert!(
        matches!(released, Ok(()) | Err(Error::ReleaseUnconfirmed { .. })),
        "{released:?}"
    );
    assert!(!kept.is_lost(), "{:?}", kept.lost_reason());
    drop(kept);
    // (The frozen connections lost bytes: closed, so the server's end is not held up.)
    proxy.thaw();
    proxy.cut();
    server.stop().await;
}

/// The streams found deaf to a reload are counted once each
/// (`latchkey_unheard_streams_cut_total`): alice's fixed lease that gives no
/// flow-control credit, not her lease that heard the reload.
#[tokio::test]
async fn a_stream_cut_off_for_not_hearing_a_reload_is_counted() {
    let redis = RedisServer::start();
    let (_dir, auth) = auth_file();
    let server = process_with_auth(&redis, &auth);
    let port = server.metrics_port().expect("metrics");
    let alice = Client::connect_with(&server.endpoint(), &ConnectOptions::new().token("alice-token"))
        .await
        .expect("alice connects");
    let heard = alice.lock("shared/heard").acquire().await.unwrap();
    let open = hour_lease("shared/deaf");
    let (tx, mut response) = uncredited(&server.endpoint(), open, Some("alice-token")).await;
    assert!(
        poll_until(Duration::from_secs(3), || redis.cli(&["EXISTS", "shared/deaf"]).trim()
            == "1")
        .await,
        "never granted"
    );
    let cut = || labelled(&scrape_metrics(port), "latchkey_unheard_streams_cut_total", &[]);
    assert_eq!(cut(), 0.0);

    std::fs::write(&auth, alice_revoked()).unwrap();
    assert_eq!(
        bounded(RELOAD_WAIT, "the lease that heard it", heard.lost()).await,
        LostReason::Revoked
    );
    let ended = bounded(T, "the deaf stream ends", response.message()).await;
    assert!(ended.is_err(), "{ended:?}");
    assert_eq!(cut(), 1.0);
    let freed = poll_until(T, || redis.cli(&["EXISTS", "shared/deaf"]).trim() == "0");
    assert!(freed.await, "the deaf stream's lock is given back");
    drop(tx);
}

/// An auth file whose read hangs (a FIFO put in its place, as a hung network mount or
/// a stuck secrets driver would leave it) holds up no call: the watched files are read
/// off the server's threads. With one worker thread the reload's read stopped the
/// whole server: no call answered, no lease renewed, SIGTERM unheard.
#[tokio::test]
async fn an_auth_file_whose_read_hangs_holds_up_nothing() {
    let redis = RedisServer::start();
    let (dir, auth) = auth_file();
    let args = [
        "--redis-url",
        &redis.url(),
        "--auth-file",
        &path(&auth),
        "--worker-threads",
        "1",
    ];
    let mut server = LatchkeyProcess::spawn(&args.map(str::to_owned));
    let ops = Client::connect_with(&server.endpoint(), &ConnectOptions::new().token("ops-token"))
        .await
        .expect("connects");
    let fifo = dir.path().join("fifo");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
    std::fs::rename(&fifo, &auth).unwrap();
    // The server reads its files every second: by now a read of the FIFO waits for a
    // writer that never comes.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let lease = bounded(T, "a lock past the hanging read", ops.lock("shared/fifo").acquire()).await;
    lease.unwrap().release().await.unwrap();
    server.terminate();
    assert!(server.wait_exit(Duration::from_secs(15)).is_some(), "SIGTERM heard");
}
