//! Securing latchkey: TLS and mTLS with throwaway certificates, bearer tokens and
//! certificate subjects mapped to identities, per-prefix authorization, owner ids
//! scoped by identity, reloads of the auth file and the certificate, and the
//! explicit choice to run without auth. Each refusal is checked with its status
//! while the rightful client keeps working.

use latchkey_client::{Client, ConnectOptions, Error, LockKind, LostReason};
use latchkey_server::config::Config;
use latchkey_server::keys::Keys;
use latchkey_tests::certs::{CertFiles, Pki};
use latchkey_tests::proxy::Proxy;
use latchkey_tests::server::{a_lease_of_every_kind, spawn_queued, Latchkey};
use latchkey_tests::{bounded, free_port, metric, scrape_metrics, LatchkeyProcess, RedisServer};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tonic::Code;

/// How long a test waits for a file change to be picked up (the server polls every second).
const RELOAD_WAIT: Duration = Duration::from_secs(10);
/// How long a test waits for one call.
const T: Duration = Duration::from_secs(10);

/// alice and bob each own a prefix and share `shared/`; ops is the admin (by hash).
fn auth_file(dir: &Path) -> PathBuf {
    let ops = hex(&Sha256::digest(b"ops-token"));
    let text = format!(
        r#"
[[identity]]
name = "alice"
tokens = ["alice-token"]
subjects = ["alice"]
prefixes = ["alice/", "shared/"]

[[identity]]
name = "bob"
tokens = ["bob-token"]
subjects = ["bob"]
prefixes = ["bob/", "shared/"]
actions = ["acquire", "inspect"]

[[identity]]
name = "ops"
token_sha256 = ["{ops}"]
admin = true
"#
    );
    let path = dir.join("auth.toml");
    std::fs::write(&path, text).expect("write auth file");
    path
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn tls(pki: &Pki) -> ConnectOptions {
    ConnectOptions::new().ca_pem(pki.ca_pem())
}

fn with_cert(pki: &Pki, cert: &CertFiles) -> ConnectOptions {
    tls(pki).identity_pem(cert.cert_pem(), cert.key_pem())
}

/// A TLS server (mTLS when `client_ca`) with the auth file, reached as `options`.
async fn secure_server(
    redis: &RedisServer,
    pki: &Pki,
    auth: &Path,
    client_ca: bool,
    options: ConnectOptions,
) -> Latchkey {
    let server = pki.server("server");
    let mut args = vec![
        "--tls-cert".to_owned(),
        path(&server.cert),
        "--tls-key".to_owned(),
        path(&server.key),
        "--auth-file".to_owned(),
        path(auth),
    ];
    if client_ca {
        args.extend(["--tls-client-ca".to_owned(), path(&pki.ca())]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Latchkey::start_secure(&redis.url(), &args, options).await
}

fn path(p: &Path) -> String {
    p.to_str().expect("UTF-8 path").to_owned()
}

/// A TLS server on its own Redis with the test auth file; its default client is
/// alice's (by token).
struct TokenServer {
    redis: RedisServer,
    pki: Pki,
    auth: PathBuf,
    server: Latchkey,
}

async fn token_server() -> TokenServer {
    let redis = RedisServer::start();
    let pki = Pki::new("main");
    let auth = auth_file(pki.dir());
    let server = secure_server(&redis, &pki, &auth, false, tls(&pki).token("alice-token")).await;
    TokenServer {
        redis,
        pki,
        auth,
        server,
    }
}

async fn client(server: &Latchkey, options: ConnectOptions) -> Client {
    server.client_with(&options).await.expect("client connects")
}

/// The status code of a failed call, with its message for the assertion text.
fn code(result: Result<impl std::fmt::Debug, Error>) -> (Code, String) {
    let err = result.expect_err("the call must be refused");
    (err.code(), err.to_string())
}

/// The call is refused before it reaches latchkey: the TLS handshake fails, so the
/// connect fails (this client refused the server) or the first call does (the server
/// refused this client once the client took the handshake for done), either as TLS's
/// refusal, `FAILED_PRECONDITION`. The second read `UNAVAILABLE`, "trying again may
/// work", and a wrapper that retried on it retried an expired certificate for good.
async fn assert_tls_refused(server: &Latchkey, options: ConnectOptions, what: &str) {
    let outcome = tokio::time::timeout(Duration::from_secs(10), async {
        match server.client_with(&options).await {
            Err(e) => Err(e),
            Ok(client) => client.describe("alice/x").await.map(|_| ()),
        }
    })
    .await
    .expect("a refused handshake fails in time");
    let err = outcome.expect_err(what);
    // Not an outage to try again: no retry mends a certificate.
    assert_eq!(err.code(), Code::FailedPrecondition, "{what}: {err}");
    assert!(!err.is_unavailable(), "{what}: {err}");
}

#[tokio::test]
async fn tokens_authenticate_and_prefixes_authorize_over_tls() {
    let TokenServer {
        redis,
        pki,
        auth: _,
        server,
    } = token_server().await;
    let alice = server.client().await;
    let lease = alice.lock("alice/a").acquire().await.expect("alice takes her own lock");

    // No token, a wrong token, a malformed header: UNAUTHENTICATED.
    let anonymous = client(&server, tls(&pki)).await;
    let (c, m) = code(anonymous.describe("alice/a").await);
    assert_eq!(c, Code::Unauthenticated, "{m}");
    let (c, m) = code(anonymous.lock("alice/b").try_once().acquire().await);
    assert_eq!(c, Code::Unauthenticated, "{m}");
    let forged = client(&server, tls(&pki).token("alice-token-guess")).await;
    let (c, m) = code(forged.list("alice/", 0, "").await);
    assert_eq!(c, Code::Unauthenticated, "{m}");
    assert!(!m.contains("alice-token-guess"), "the token is never echoed: {m}");

    // Outside her prefixes, and actions she was not granted: PERMISSION_DENIED naming both.
    let (c, m) = code(alice.lock("bob/a").try_once().acquire().await);
    assert_eq!(c, Code::PermissionDenied, "{m}");
    assert!(m.contains("acquire") && m.contains("bob/a"), "{m}");
    let (c, m) = code(alice.lock_all(["alice/m", "bob/m"]).try_once().acquire().await);
    assert_eq!(c, Code::PermissionDenied, "every name of a multi-lock is checked: {m}");
    let (c, m) = code(alice.describe("bob/a").await);
    assert_eq!(c, Code::PermissionDenied, "{m}");
    assert!(m.contains("inspect"), "{m}");
    let mut watch = alice.watch("bob/a").await;
    if let Ok(w) = &mut watch {
        // A server stream may report its status on the first read.
        let (c, m) = code(w.next().await);
        assert_eq!(c, Code::PermissionDenied, "{m}");
    } else {
        let (c, m) = code(watch);
        assert_eq!(c, Code::PermissionDenied, "{m}");
    }
    let (c, m) = code(alice.force_release("alice/a").await);
    assert_eq!(c, Code::PermissionDenied, "force_release is admin-only by default: {m}");
    assert!(m.contains("force_release"), "{m}");
    let (c, m) = code(alice.list("", 0, "").await);
    assert_eq!(c, Code::PermissionDenied, "listing every name is admin-only: {m}");
    // A name that is no name is named as such before any permission is looked at.
    for (c, m) in [code(alice.describe("").await), code(alice.force_release("").await)] {
        assert_eq!(c, Code::InvalidArgument, "{m}");
        assert!(m.contains("name"), "{m}");
    }
    let (c, m) = match alice.watch("").await {
        Ok(mut w) => code(w.next().await),
        Err(e) => code(Err::<(), _>(e)),
    };
    assert_eq!(c, Code::InvalidArgument, "{m}");
    // So is a List's bad argument, whatever its prefix.
    let long_token = "x".repeat(100_000);
    for (page_size, token) in [(5000, ""), (0, long_token.as_str())] {
        let (c, m) = code(alice.list("bob/", page_size, token).await);
        assert_eq!(c, Code::InvalidArgument, "{m}");
        assert!(
            m.contains(if token.is_empty() { "page_size" } else { "page_token" }),
            "{m}"
        );
    }
    assert_eq!(alice.list_all("alice/").await.expect("alice lists her prefix").len(), 1);

    // The admin lists everything and breaks the lock; alice's lease ends with it.
    let ops = client(&server, tls(&pki).token("ops-token")).await;
    assert_eq!(ops.list_all("").await.expect("admin lists all").len(), 1);
    assert!(ops.force_release("alice/a").await.expect("admin force-releases"));
    tokio::time::timeout(Duration::from_secs(10), lease.lost())
        .await
        .expect("alice hears of the force release");

    // Plaintext to a TLS port, or trusting another CA: refused at the handshake.
    let plain = Latchkey::start_with(&redis.url(), &[]).await;
    let plaintext_target = server.endpoint().replace("https://", "http://");
    let plain_client = Client::connect_with(&plaintext_target, &ConnectOptions::new().token("alice-token")).await;
    if let Ok(c) = plain_client {
        assert!(
            c.describe("alice/a").await.is_err(),
            "plaintext to a TLS port must fail"
        );
    }
    plain.stop().await;
    assert_tls_refused(
        &server,
        ConnectOptions::new()
            .ca_pem(Pki::new("other").ca_pem())
            .token("alice-token"),
        "wrong server CA",
    )
    .await;

    // A channel built by the caller carries the token too.
    let options = tls(&pki).token("alice-token");
    let channel = options.endpoint(server.endpoint()).unwrap().connect().await.unwrap();
    let own = Client::from_channel_with(channel, &options).unwrap();
    own.describe("alice/a").await.expect("the token went with the call");

    // The rightful client kept working throughout.
    let again = alice
        .lock("alice/a")
        .try_once()
        .acquire()
        .await
        .expect("alice still works");
    again.release().await.unwrap();
    server.stop().await;
}

/// Behind the auth interceptor, a request over `--max-message-size` from a known caller
/// is refused with the limit, as without auth; one with no credential is refused as
/// unauthenticated first (the interceptor reads no message).
#[tokio::test]
async fn a_huge_request_behind_auth_is_refused_with_the_limit() {
    let s = token_server().await;
    let huge = format!("alice/{}", "x".repeat(300_000));
    let (refused, message) = code(s.server.client().await.describe(huge.as_str()).await);
    assert_eq!(refused, Code::ResourceExhausted, "{message}");
    assert!(message.contains("--max-message-size"), "{message}");
    let anonymous = client(&s.server, tls(&s.pki)).await;
    let (refused, message) = code(anonymous.describe(huge.as_str()).await);
    assert_eq!(refused, Code::Unauthenticated, "{message}");
}

#[tokio::test]
async fn owner_ids_are_scoped_by_identity() {
    let TokenServer {
        redis,
        pki,
        auth: _,
        server,
    } = token_server().await;
    let alice = server.client().await;
    let bob = client(&server, tls(&pki).token("bob-token")).await;

    let first = alice.lock("shared/x").owner("worker-1").acquire().await.unwrap();
    assert_eq!(first.owner(), "worker-1", "the owner is reported as the client gave it");
    let second = alice
        .lock("shared/x")
        .owner("worker-1")
        .try_once()
        .acquire()
        .await
        .unwrap();
    assert_eq!(second.hold_count(), 2, "alice reenters her own hold");

    // bob presents alice's owner id: it is his own id, so he cannot reenter hers.
    let (c, m) = code(bob.lock("shared/x").owner("worker-1").try_once().acquire().await);
    assert_eq!(c, Code::DeadlineExceeded, "{m}");
    let state = bob.describe("shared/x").await.unwrap();
    assert_eq!(state.holders.len(), 1);
    assert_eq!(state.holders[0].owner, "alice/worker-1");
    assert_eq!(state.holders[0].hold_count, 2);

    second.release().await.unwrap();
    first.release().await.unwrap();
    let bobs = bob
        .lock("shared/x")
        .owner("worker-1")
        .try_once()
        .acquire()
        .await
        .unwrap();
    assert_eq!(bobs.hold_count(), 1);
    assert_eq!(redis.cli(&["HGET", "shared/x", "bob/worker-1"]).trim(), "1");

    // A stream's own owner id (none given) is the server's, which no client may present:
    // it is written as it is, so the server knows its own streams' fair queue entries
    // (a crashed server's then lapse on their own; its fair waiters are passed the lock
    // in memory). Scoped, they read as Redisson's.
    let (waiting, _) = spawn_queued(alice.lock("shared/x").kind(LockKind::Fair).wait(T), T).await;
    let queue = Keys::default().lock("shared/x").queue();
    let entries = redis.cli(&["LRANGE", &queue, "0", "-1"]);
    assert!(entries.trim().starts_with("latchkey-"), "{entries:?}");
    bobs.release().await.unwrap();
    let own = waiting.await.unwrap().expect("granted");
    assert!(own.owner().starts_with("latchkey-"), "{}", own.owner());
    own.release().await.unwrap();
    server.stop().await;
}

/// alice and a read-only reader scoped to `alice/`, and ops the admin, for a server
/// without TLS (see `auth_server`).
const AUTH: &str = r#"
[[identity]]
name = "alice"
tokens = ["alice-token"]
prefixes = ["alice/"]

[[identity]]
name = "reader"
tokens = ["reader-token"]
prefixes = ["alice/"]
actions = ["inspect"]

[[identity]]
name = "ops"
tokens = ["ops-token"]
admin = true
"#;

/// A server with the auth file `auth` on loopback, without TLS (tokens in the clear are
/// allowed there); its default client is ops'.
async fn auth_server(redis: &RedisServer, auth: &Path) -> Latchkey {
    let auth = path(auth);
    let args = ["--auth-file", auth.as_str()];
    Latchkey::start_secure(&redis.url(), &args, ConnectOptions::new().token("ops-token")).await
}

/// A client scoped to `alice/` cannot touch, inspect, watch, list or break names
/// outside it, whatever the name's braces, colons or characters; its own names that
/// spell another name inside a hash tag (`alice/{ops/x}`) are locks of their own; a
/// multi-lock naming one name outside the scope takes none; a read-only identity
/// acquires nothing.
#[tokio::test]
async fn a_scoped_identity_reaches_no_name_outside_its_prefix() {
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let auth = dir.path().join("auth.toml");
    std::fs::write(&auth, AUTH).unwrap();
    let server = auth_server(&redis, &auth).await;
    let ops = client(&server, ConnectOptions::new().token("ops-token")).await;
    let alice = client(&server, ConnectOptions::new().token("alice-token")).await;
    let reader = client(&server, ConnectOptions::new().token("reader-token")).await;

    let held = ops.lock("ops/x").acquire().await.expect("ops holds ops/x");
    let token = held.fencing_token();
    for name in ["alice", "alicé/x", "Alice/x", "ops/x", "{alice/}x", "x:alice/"] {
        let what = format!("alice on {name:?}");
        let (c, m) = code(alice.lock(name).try_once().acquire().await);
        assert_eq!(c, Code::PermissionDenied, "{what}: {m}");
        let (c, m) = code(alice.describe(name).await);
        assert_eq!(c, Code::PermissionDenied, "{what}: {m}");
        let (c, m) = code(alice.force_release(name).await);
        assert_eq!(c, Code::PermissionDenied, "{what}: {m}");
        let watched = match alice.watch(name).await {
            Ok(mut w) => w.next().await.map(|_| ()),
            Err(e) => Err(e),
        };
        let (c, m) = code(watched);
        assert_eq!(c, Code::PermissionDenied, "{what}: {m}");
    }
    for prefix in ["", "alice", "ali", "ops/"] {
        let (c, m) = code(alice.list(prefix, 0, "").await);
        assert_eq!(c, Code::PermissionDenied, "list {prefix:?}: {m}");
    }
    // A multi-lock mixing names: refused whole, nothing taken.
    let (c, m) = code(alice.lock_all(["alice/m", "zz/m"]).try_once().acquire().await);
    assert_eq!(c, Code::PermissionDenied, "{m}");
    assert_eq!(
        redis.cli(&["EXISTS", "alice/m"]).trim(),
        "0",
        "no name of a refused multi-lock taken"
    );
    // Names of her own that spell another lock inside a hash tag, with colons, unicode.
    let own = ["alice/{ops/x}", "alice/{ops/x}:1", "alice/ünï:{ops/x}", "alice/:ops/x"];
    let mut leases = Vec::new();
    for (name, kind) in own
        .iter()
        .zip([LockKind::Write, LockKind::Read, LockKind::Fair, LockKind::Mutex])
    {
        leases.push(
            alice
                .lock(*name)
                .kind(kind)
                .try_once()
                .acquire()
                .await
                .unwrap_or_else(|e| panic!("alice takes {name}: {e}")),
        );
    }
    assert!(alice.lock_all(own).try_once().acquire().await.is_err(), "held already");
    let state = ops.describe("ops/x").await.unwrap();
    assert_eq!(state.holders.len(), 1, "{state:?}");
    assert_eq!(state.last_fencing_token, token, "{state:?}");
    let listed: Vec<String> = alice
        .list_all("alice/")
        .await
        .unwrap()
        .into_iter()
        .map(|l| l.name)
        .collect();
    let mut want: Vec<String> = own.iter().map(|s| s.to_string()).collect();
    want.sort();
    assert_eq!(listed, want);
    // Read-only: inspects, acquires nothing, breaks nothing.
    reader.describe("alice/{ops/x}").await.expect("reader inspects");
    let (c, m) = code(reader.lock("alice/r").try_once().acquire().await);
    assert_eq!(c, Code::PermissionDenied, "{m}");
    let (c, m) = code(reader.force_release("alice/{ops/x}").await);
    assert_eq!(c, Code::PermissionDenied, "{m}");
    assert!(!held.is_lost(), "ops' lock untouched");
    for lease in leases {
        lease.release().await.unwrap();
    }
    held.release().await.unwrap();
    server.stop().await;
}

/// A reload of the auth file ends the streams whose rights it takes away, with the
/// status a new call would get, and releases their holds: every lease, the waiter and
/// the Watch of a revoked token (UNAUTHENTICATED; the client tells the leases
/// `Revoked`), and of an identity whose prefix was dropped the lease, multi-lock and
/// Watch under that prefix (PERMISSION_DENIED), while its other lease, the admin's
/// lock the revoked waiter queued for, and a waiter that keeps its rights carry on.
#[tokio::test]
async fn a_reload_ends_the_streams_whose_rights_it_takes_away() {
    const BEFORE: &str = r#"
[[identity]]
name = "alice"
tokens = ["alice-token"]
prefixes = ["alice/"]

[[identity]]
name = "bob"
tokens = ["bob-token"]
prefixes = ["bob/", "shared/"]

[[identity]]
name = "ops"
tokens = ["ops-token"]
admin = true
"#;
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let auth = dir.path().join("auth.toml");
    std::fs::write(&auth, BEFORE).unwrap();
    let server = auth_server(&redis, &auth).await;
    let ops = client(&server, ConnectOptions::new().token("ops-token")).await;
    let alice = client(&server, ConnectOptions::new().token("alice-token")).await;
    let bob = client(&server, ConnectOptions::new().token("bob-token")).await;

    let alice_leases = a_lease_of_every_kind(&alice, "alice/every/", 1).await;
    let busy = ops.lock("alice/busy").kind(LockKind::Fair).acquire().await.unwrap();
    let (alice_waiting, _) = spawn_queued(alice.lock("alice/busy").kind(LockKind::Fair).wait(T * 6), T).await;
    let bob_busy = ops.lock("bob/busy").acquire().await.unwrap();
    let (bob_waiting, _) = spawn_queued(bob.lock("bob/busy").wait(T * 6), T).await;
    let mut alice_watch = alice.watch("alice/busy").await.unwrap();
    alice_watch.next().await.expect("alice watches");
    let bob_own = bob.lock("bob/x").acquire().await.unwrap();
    let bob_shared = bob.lock("shared/x").kind(LockKind::Write).acquire().await.unwrap();
    let bob_multi = bob.lock_all(["bob/m", "shared/m"]).acquire().await.unwrap();
    let mut bob_watch = bob.watch("shared/x").await.unwrap();
    bob_watch.next().await.expect("bob watches");

    // alice's token revoked, bob's `shared/` dropped.
    let after = BEFORE
        .replace(r#"["alice-token"]"#, r#"["alice-token-2"]"#)
        .replace(r#", "shared/""#, "");
    std::fs::write(&auth, after).unwrap();

    for lease in &alice_leases {
        let reason = bounded(RELOAD_WAIT, "alice's lease ended", lease.lost()).await;
        assert_eq!(reason, LostReason::Revoked, "{}", lease.name());
    }
    let (c, m) = code(bounded(RELOAD_WAIT, "alice's wait ended", alice_waiting).await.unwrap());
    assert_eq!(c, Code::Unauthenticated, "{m}");
    assert!(m.contains("revoked"), "{m}");
    let (c, m) = code(bounded(RELOAD_WAIT, "alice's watch ended", alice_watch.next()).await);
    assert_eq!(c, Code::Unauthenticated, "{m}");
    for lease in [&bob_shared, &bob_multi] {
        let reason = bounded(RELOAD_WAIT, "bob's shared lease ended", lease.lost()).await;
        assert_eq!(reason, LostReason::Revoked, "{}", lease.name());
    }
    let (c, m) = code(bounded(RELOAD_WAIT, "bob's watch ended", bob_watch.next()).await);
    assert_eq!(c, Code::PermissionDenied, "{m}");
    assert!(m.contains("shared/x"), "{m}");

    // Their holds and place in line are gone; the rest carries on.
    for lease in &alice_leases {
        let state = ops.describe(lease.name()).await.unwrap();
        assert!(!state.locked, "{state:?}");
    }
    for name in ["shared/x", "shared/m", "bob/m"] {
        let state = ops.describe(name).await.unwrap();
        assert!(!state.locked, "{state:?}");
    }
    let state = ops.describe("alice/busy").await.unwrap();
    assert!(state.waiters.is_empty(), "{state:?}");
    assert!(!busy.is_lost() && !bob_own.is_lost());
    bob_own.release().await.expect("bob keeps bob/x");
    bob_busy.release().await.unwrap();
    let bobs_turn = bounded(T, "bob's wait", bob_waiting).await.unwrap();
    bobs_turn
        .expect("bob's waiter keeps its rights")
        .release()
        .await
        .unwrap();
    busy.release().await.unwrap();
    server.stop().await;
}

#[tokio::test]
async fn mtls_subjects_identify_clients() {
    let redis = RedisServer::start();
    let pki = Pki::new("main");
    let auth = auth_file(pki.dir());
    let alice_cert = pki.client("alice", "alice");
    let server = secure_server(&redis, &pki, &auth, true, with_cert(&pki, &alice_cert)).await;
    let alice = server.client().await;
    let lease = alice
        .lock("alice/a")
        .acquire()
        .await
        .expect("the certificate is alice's identity");

    let bob = client(&server, with_cert(&pki, &pki.client("bob", "bob"))).await;
    let (c, m) = code(bob.lock("alice/a").try_once().acquire().await);
    assert_eq!(c, Code::PermissionDenied, "{m}");
    assert!(m.contains("\"bob\""), "{m}");
    let (c, m) = code(bob.force_release("bob/a").await);
    assert_eq!(c, Code::PermissionDenied, "{m}");

    // A valid certificate whose subject the auth file does not know.
    let mallory = client(&server, with_cert(&pki, &pki.client("mallory", "mallory"))).await;
    let (c, m) = code(mallory.describe("alice/a").await);
    assert_eq!(c, Code::Unauthenticated, "{m}");

    // Beside alternative names a common name identifies nobody: a CA's name constraints
    // bind only the alternative names, so a sub-CA could write any common name. A
    // certificate was alice's by its common name whatever its alternative names said.
    let named = pki.client_with_names("cn-and-san", "alice", &["svc.team-a.example"]);
    let (c, m) = describe_as(&server, &pki, &named).await;
    assert_eq!(c, Code::Unauthenticated, "{m}");
    let by_san = pki.client_with_names("san", "mallory", &["alice"]);
    let alice_by_san = client(&server, with_cert(&pki, &by_san)).await;
    alice_by_san
        .describe("alice/a")
        .await
        .expect("the alternative name is alice's");

    // A token still wins over the certificate (ops' token on alice's certificate).
    let ops = client(&server, with_cert(&pki, &alice_cert).token("ops-token")).await;
    assert_eq!(ops.list_all("").await.expect("the token's identity").len(), 1);

    // No certificate, one from another CA, an expired one: refused at the handshake.
    assert_tls_refused(&server, tls(&pki).token("alice-token"), "no client certificate").await;
    let other = Pki::new("other");
    let foreign = other.client("foreign", "alice");
    assert_tls_refused(&server, with_cert(&pki, &foreign), "client certificate from another CA").await;
    let expired = pki.expired_client("expired", "alice");
    assert_tls_refused(&server, with_cert(&pki, &expired), "expired client certificate").await;

    assert_eq!(
        alice
            .describe("alice/a")
            .await
            .expect("alice still works")
            .holders
            .len(),
        1
    );
    lease.release().await.unwrap();
    server.stop().await;
}

/// A server of `pki`'s certificate that trusts client certificates of the CAs in the
/// file `client_ca` only, started with `ready` as its readiness check's caller.
async fn trusting(redis: &RedisServer, pki: &Pki, auth: &Path, client_ca: &Path, ready: &CertFiles) -> Latchkey {
    let server_cert = pki.server("server");
    let args = [
        "--tls-cert".to_owned(),
        path(&server_cert.cert),
        "--tls-key".to_owned(),
        path(&server_cert.key),
        "--auth-file".to_owned(),
        path(auth),
        "--tls-client-ca".to_owned(),
        path(client_ca),
    ];
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Latchkey::start_secure(&redis.url(), &args, with_cert(pki, ready)).await
}

/// The refusal of alice's Describe called with `cert`: its code and message.
async fn describe_as(server: &Latchkey, pki: &Pki, cert: &CertFiles) -> (Code, String) {
    code(client(server, with_cert(pki, cert)).await.describe("alice/a").await)
}

/// A CA's name constraints bind no common name: a CA limited to its own domain can
/// still write any common name in a certificate with no alternative name.
/// Such a certificate identifies nobody when a CA with name constraints stands in its
/// chain, presented by the client or trusted by the server; it was alice's.
#[tokio::test]
async fn a_common_name_under_name_constraints_identifies_nobody() {
    let redis = RedisServer::start();
    let pki = Pki::new("main");
    let auth = auth_file(pki.dir());
    let alice_cert = pki.client("alice", "alice");
    let server = secure_server(&redis, &pki, &auth, true, with_cert(&pki, &alice_cert)).await;
    let minted = pki.client_of_constrained_sub_ca("minted", "alice", &[], "team-a.example");
    let (c, m) = describe_as(&server, &pki, &minted).await;
    assert_eq!(c, Code::Unauthenticated, "a sub-CA's common name: {m}");
    drop(server);

    // The client CA the server trusts is constrained itself.
    let team = Pki::constrained("team", "team-a.example");
    let team_alice = team.client("team-alice", "alice");
    let server = trusting(&redis, &pki, &auth, &team.ca(), &team_alice).await;
    let (c, m) = code(server.client().await.describe("alice/a").await);
    assert_eq!(c, Code::Unauthenticated, "a constrained CA's common name: {m}");
    let named = team.client_with_names("team-named", "mallory", &["alice.team-a.example"]);
    let (c, m) = describe_as(&server, &pki, &named).await;
    assert_eq!(c, Code::Unauthenticated, "an alternative name alice does not have: {m}");
}

/// The TLS library checks a CA's name constraints against names of the kinds they
/// list only: a sub-CA limited to DNS names under its domain (or a trusted client CA so
/// limited) can write any URI or e-mail name. Those name nobody under such a CA, where
/// the same names from a CA without constraints do.
#[tokio::test]
async fn a_uri_or_e_mail_name_under_dns_name_constraints_identifies_nobody() {
    let redis = RedisServer::start();
    let pki = Pki::new("main");
    let auth = auth_file(pki.dir());
    let alice_uri = pki.client_with_names("alice-uri", "x", &["uri:alice"]);
    let server = secure_server(&redis, &pki, &auth, true, with_cert(&pki, &alice_uri)).await;
    server
        .client()
        .await
        .describe("alice/a")
        .await
        .expect("alice's URI name from the CA");
    for (stem, name) in [("minted-uri", "uri:alice"), ("minted-email", "email:alice")] {
        let minted = pki.client_of_constrained_sub_ca(stem, "x", &[name], "team-a.example");
        let (c, m) = describe_as(&server, &pki, &minted).await;
        assert_eq!(c, Code::Unauthenticated, "a DNS-limited sub-CA's {name}: {m}");
    }
    drop(server);

    let team = Pki::constrained("team", "team-a.example");
    let team_uri = team.client_with_names("team-uri", "x", &["uri:alice", "email:alice"]);
    let server = trusting(&redis, &pki, &auth, &team.ca(), &team_uri).await;
    let (c, m) = code(server.client().await.describe("alice/a").await);
    assert_eq!(
        c,
        Code::Unauthenticated,
        "a DNS-limited client CA's URI and e-mail names: {m}"
    );
}

/// A client's names are bound by the CA its chain was verified against, not by the
/// strictest CA of the client CA file: with a CA limited to DNS names beside the
/// company's CA in one file, alice's certificate of the company CA, known by its common
/// name, identified nobody.
#[tokio::test]
async fn a_constrained_ca_in_the_client_ca_file_binds_only_its_own_clients() {
    let redis = RedisServer::start();
    let pki = Pki::new("main");
    let auth = auth_file(pki.dir());
    let team = Pki::constrained("team", "team-a.example");
    let bundle = pki.dir().join("client-cas.pem");
    std::fs::write(&bundle, [pki.ca_pem(), team.ca_pem()].concat()).unwrap();
    let alice = pki.client("alice", "alice");
    let server = trusting(&redis, &pki, &auth, &bundle, &alice).await;
    server
        .client()
        .await
        .describe("alice/a")
        .await
        .expect("alice by the common name the company CA wrote");
    let team_alice = team.client("team-alice", "alice");
    let (c, m) = describe_as(&server, &pki, &team_alice).await;
    assert_eq!(c, Code::Unauthenticated, "the constrained CA's common name: {m}");
}

/// The client CA moves from a CA limited to DNS names to one without constraints: its
/// clients' common names identify them once the file is reloaded. The strictest
/// binding of any CA loaded since start applied to every client until a restart.
#[tokio::test]
async fn a_client_ca_moved_off_name_constraints_reads_common_names_after_the_reload() {
    let redis = RedisServer::start();
    let pki = Pki::new("main");
    let auth = auth_file(pki.dir());
    let team = Pki::constrained("team", "team-a.example");
    let client_ca = pki.dir().join("client-ca.pem");
    std::fs::write(&client_ca, team.ca_pem()).unwrap();
    let ready = team.client_with_names("team-ready", "x", &["ready.team-a.example"]);
    let server = trusting(&redis, &pki, &auth, &client_ca, &ready).await;
    let company = Pki::new("company");
    let alice = company.client("alice", "alice");
    let alice_options = tls(&pki).identity_pem(alice.cert_pem(), alice.key_pem());
    std::fs::write(&client_ca, company.ca_pem()).unwrap();
    wait_for("the new CA's alice to be alice", || async {
        match server.client_with(&alice_options).await {
            Ok(c) => c.describe("alice/a").await.is_ok(),
            Err(_) => false,
        }
    })
    .await;
    server.stop().await;
}

#[tokio::test]
async fn auth_file_and_certificate_reload_without_restart() {
    let TokenServer {
        redis: _redis,
        pki,
        auth,
        server,
    } = token_server().await;
    let alice = server.client().await;
    let carol = client(&server, tls(&pki).token("carol-token")).await;
    assert_eq!(code(carol.describe("carol/x").await).0, Code::Unauthenticated);

    // A new identity appears once the file changes.
    let mut text = std::fs::read_to_string(&auth).unwrap();
    text.push_str("\n[[identity]]\nname = \"carol\"\ntokens = [\"carol-token\"]\nprefixes = [\"carol/\"]\n");
    std::fs::write(&auth, &text).unwrap();
    wait_for("carol's token to be accepted", || async {
        carol.describe("carol/x").await.is_ok()
    })
    .await;

    // A broken file, or one with no identity (caught half-written, an empty secret),
    // is refused and the previous one stays in force.
    for broken in ["[[identity]]\nname = \"x\"\ntokens = [\"y\"", ""] {
        std::fs::write(&auth, broken).unwrap();
        tokio::time::sleep(Duration::from_secs(3)).await;
        carol
            .describe("carol/x")
            .await
            .expect("the previous file stays in force");
        alice.describe("alice/x").await.expect("alice still works");
    }

    // A certificate from another CA replaces the server's: new connections use it.
    let next = Pki::new("next");
    let renewed = next.server("renewed");
    // The paths the server was started with (see `secure_server`).
    std::fs::copy(&renewed.key, pki.dir().join("server-key.pem")).unwrap();
    std::fs::copy(&renewed.cert, pki.dir().join("server.pem")).unwrap();
    wait_for("the renewed certificate to be served", || async {
        let options = ConnectOptions::new().ca_pem(next.ca_pem()).token("alice-token");
        match server.client_with(&options).await {
            Ok(c) => c.describe("alice/x").await.is_ok(),
            Err(_) => false,
        }
    })
    .await;
    assert_tls_refused(
        &server,
        tls(&pki).token("alice-token"),
        "the old CA no longer verifies the server",
    )
    .await;
    server.stop().await;
}

/// An auth file that names client certificates (`subjects`) on a server that asks for
/// none (no `--tls-client-ca`) is warned of, naming the identities: they can use their
/// tokens alone, and a client that presents its certificate is refused as if it sent
/// nothing. The server started without a word of it.
#[tokio::test]
async fn subjects_without_a_client_ca_are_warned_of() {
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let auth = auth_file(dir.path());
    let args: Vec<String> = ["--redis-url", &redis.url(), "--auth-file", &path(&auth)]
        .into_iter()
        .map(str::to_owned)
        .collect();
    let server = LatchkeyProcess::spawn(&args);
    let warned = |log: &str| log.contains("--tls-client-ca") && log.contains("alice") && log.contains("bob");
    assert!(warned(&server.log()), "{}", server.log_tail());
}

/// A certificate that expired loads (clients refuse it at the handshake), so the
/// server warns of it at start and when a reload brings one, and its metrics tell when
/// the certificate and the client CA run out, for an alert ahead of that.
#[tokio::test]
async fn certificates_outside_their_validity_are_warned_of() {
    let redis = RedisServer::start();
    let pki = Pki::new("validity");
    let (expired, valid) = (pki.expired_server("expired"), pki.server("valid"));
    let (cert, key) = (pki.dir().join("server.pem"), pki.dir().join("server-key.pem"));
    std::fs::copy(&expired.cert, &cert).unwrap();
    std::fs::copy(&expired.key, &key).unwrap();
    let flags = [
        ["--redis-url", &redis.url()],
        ["--tls-cert", &path(&cert)],
        ["--tls-key", &path(&key)],
        ["--tls-client-ca", &path(&pki.ca())],
    ];
    let args: Vec<String> = flags.concat().into_iter().map(str::to_owned).collect();
    let server = LatchkeyProcess::spawn(&args);
    let warning = "--tls-cert: the certificate of CN=latchkey server expired on Jan  1 00:00:00 2021 +00:00; peers will refuse it";
    assert!(server.log().contains(warning), "{}", server.log_tail());
    assert!(!server.log().contains("--tls-client-ca:"), "the CA is valid");
    let expiry = |file: &str| {
        let scrape = scrape_metrics(server.metrics_port().unwrap());
        metric(
            &scrape,
            &format!("latchkey_tls_certificate_expiry_timestamp_seconds{{file=\"{file}\"}}"),
        )
    };
    assert_eq!(expiry("cert"), Some(1_609_459_200.0), "2021-01-01");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    assert!(expiry("client-ca").is_some_and(|end| end > now.as_secs_f64()));

    // A renewed certificate is reloaded: the gauge follows it, and no warning comes.
    std::fs::copy(&valid.key, &key).unwrap();
    std::fs::copy(&valid.cert, &cert).unwrap();
    wait_for("the renewed certificate's end in the metrics", || async {
        expiry("cert").is_some_and(|end| end > now.as_secs_f64())
    })
    .await;
    assert_eq!(
        server.log().matches("peers will refuse it").count(),
        1,
        "{}",
        server.log_tail()
    );

    // An expired one brought by a reload is warned of too.
    std::fs::copy(&expired.key, &key).unwrap();
    std::fs::copy(&expired.cert, &cert).unwrap();
    wait_for("the warning on reload", || async {
        server.log().matches(warning).count() == 2
    })
    .await;
}

async fn wait_for<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + RELOAD_WAIT;
    while !check().await {
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test]
async fn client_ca_reloads_without_restart() {
    let redis = RedisServer::start();
    let pki = Pki::new("main");
    let auth = auth_file(pki.dir());
    let alice = pki.client("alice", "alice");
    let server = secure_server(&redis, &pki, &auth, true, with_cert(&pki, &alice)).await;
    server
        .client()
        .await
        .describe("alice/x")
        .await
        .expect("alice by her certificate");

    // Clients move to certificates of a new CA: refused until the server trusts it.
    let next = Pki::new("next");
    let moved = next.client("alice-next", "alice");
    let moved_options = tls(&pki).identity_pem(moved.cert_pem(), moved.key_pem());
    assert_tls_refused(&server, moved_options.clone(), "a CA the server does not trust yet").await;
    std::fs::copy(next.ca(), pki.ca()).unwrap();
    wait_for("the new client CA to be trusted", || async {
        match server.client_with(&moved_options).await {
            Ok(c) => c.describe("alice/x").await.is_ok(),
            Err(_) => false,
        }
    })
    .await;
    server.stop().await;
}

/// Once the client CA is replaced, a certificate of the old CA is refused on every
/// new connection, a reconnecting channel's included. rustls takes a resumed
/// session's client certificate from the session, without asking the (swapped)
/// verifier, so under mTLS sessions are not resumed.
#[tokio::test]
async fn a_replaced_client_ca_is_not_bypassed_by_session_resumption() {
    let redis = RedisServer::start();
    let pki = Pki::new("main");
    let auth = auth_file(pki.dir());
    let alice_cert = pki.client("alice", "alice");
    // Read now: the CA file is replaced below.
    let alice = with_cert(&pki, &alice_cert);
    let server = secure_server(&redis, &pki, &auth, true, alice.clone()).await;
    let upstream = server.endpoint().trim_start_matches("https://").to_owned();
    let proxy = Proxy::start(&upstream).await;

    // alice connects through the proxy (a full handshake; her client keeps the session).
    let through_proxy = Client::connect_with(&format!("https://{}", proxy.addr()), &alice)
        .await
        .expect("alice connects");
    through_proxy
        .describe("alice/x")
        .await
        .expect("alice by her certificate");
    // A fresh client (no session to resume) with alice's certificate.
    let fresh_ok = || async {
        tokio::time::timeout(Duration::from_secs(5), async {
            match server.client_with(&alice).await {
                Ok(c) => c.describe("alice/x").await.is_ok(),
                Err(_) => false,
            }
        })
        .await
        .unwrap_or(false)
    };

    // The operator moves to another CA, revoking every certificate of the old one.
    std::fs::copy(Pki::new("next").ca(), pki.ca()).unwrap();
    wait_for("the old CA to be refused to a fresh client", || async {
        !fresh_ok().await
    })
    .await;

    // alice's connection breaks; her channel connects again on its own, and is refused.
    let before = proxy.accepted();
    proxy.cut();
    let deadline = Instant::now() + Duration::from_secs(8);
    while Instant::now() < deadline {
        let outcome = tokio::time::timeout(Duration::from_secs(3), through_proxy.describe("alice/x")).await;
        assert!(
            !matches!(outcome, Ok(Ok(_))),
            "a certificate of the replaced client CA was accepted on a new connection ({} through \
             the proxy): the session was resumed without the reloaded verifier",
            proxy.accepted() - before
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(proxy.accepted() > before, "alice's channel tried to connect again");
    server.stop().await;
}

/// The reload watcher compares the auth file with the bytes parsed at start, not with
/// a read of its own once the server is up: a token revoked while the server was
/// starting (here waiting for RedLock deployments nobody listens on) is revoked.
#[tokio::test]
async fn an_auth_file_change_while_the_server_starts_is_applied() {
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let auth = dir.path().join("auth.toml");
    let file =
        |token: &str| format!("[[identity]]\nname = \"alice\"\ntokens = [\"{token}\"]\nprefixes = [\"alice/\"]\n");
    std::fs::write(&auth, file("old-token")).unwrap();
    // The start waits --redis-timeout for the RedLock deployments.
    let mut args = vec![
        "--auth-file".to_owned(),
        path(&auth),
        "--redis-timeout".to_owned(),
        "4s".to_owned(),
    ];
    for _ in 0..3 {
        args.extend(["--redlock-url".to_owned(), format!("redis://127.0.0.1:{}", free_port())]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let started = Instant::now();
    let mut changed_at = None;
    let url = redis.url();
    let (server, ()) = tokio::join!(Latchkey::launch(&url, &args, ConnectOptions::new()), async {
        tokio::time::sleep(Duration::from_secs(1)).await;
        // The operator revokes the old token (written whole, by rename).
        let tmp = dir.path().join("auth.toml.tmp");
        std::fs::write(&tmp, file("new-token")).unwrap();
        std::fs::rename(&tmp, &auth).unwrap();
        changed_at = Some(started.elapsed());
    });
    let launched = started.elapsed();
    let changed_at = changed_at.unwrap();
    assert!(
        launched > changed_at,
        "precondition: the file changed ({changed_at:?}) before the server was up ({launched:?})"
    );
    let old = client(&server, ConnectOptions::new().token("old-token")).await;
    let new = client(&server, ConnectOptions::new().token("new-token")).await;
    wait_for("the new token to be accepted", || async {
        bounded(T, "describe", new.describe("alice/x")).await.is_ok()
    })
    .await;
    let (c, m) = code(bounded(T, "describe", old.describe("alice/x")).await);
    assert_eq!(c, Code::Unauthenticated, "the revoked token: {m}");
    // No graceful stop: it quits each RedLock node's two clients in turn, each
    // waiting --redis-timeout for a node nobody listens on (24 s).
    drop(server);
}

/// The auth file replaced by a rename (as an atomic writer does) is applied; removed,
/// the policy in force stays; put back, it is applied again. A revoked token is refused
/// for new calls at once.
#[tokio::test]
async fn an_auth_file_replaced_by_rename_or_removed_reloads_whole() {
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let auth = dir.path().join("auth.toml");
    std::fs::write(&auth, AUTH).unwrap();
    let server = auth_server(&redis, &auth).await;
    let alice = client(&server, ConnectOptions::new().token("alice-token")).await;
    let carol = client(&server, ConnectOptions::new().token("carol-token")).await;
    alice.describe("alice/x").await.expect("alice");

    // Replaced by rename: alice gone, carol in.
    let next = AUTH.replace(
        "name = \"alice\"\ntokens = [\"alice-token\"]",
        "name = \"carol\"\ntokens = [\"carol-token\"]",
    );
    let staged = dir.path().join(".auth.toml.new");
    std::fs::write(&staged, &next).unwrap();
    std::fs::rename(&staged, &auth).unwrap();
    wait_for("the renamed file to be applied", || async {
        carol.describe("alice/x").await.is_ok()
    })
    .await;
    let (c, m) = code(alice.describe("alice/x").await);
    assert_eq!(c, Code::Unauthenticated, "alice revoked: {m}");

    // Removed: what is in force stays.
    std::fs::remove_file(&auth).unwrap();
    // Nothing is to change: two polls of the file at least.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    carol
        .describe("alice/x")
        .await
        .expect("carol stays while the file is away");
    let (c, m) = code(alice.describe("alice/x").await);
    assert_eq!(c, Code::Unauthenticated, "{m}");

    // Put back as it was at start: applied again.
    std::fs::write(&auth, AUTH).unwrap();
    wait_for("the file put back to be applied", || async {
        alice.describe("alice/x").await.is_ok()
    })
    .await;
    let (c, m) = code(carol.describe("alice/x").await);
    assert_eq!(c, Code::Unauthenticated, "{m}");
    server.stop().await;
}

/// Errors name the line and the key, never a value or a key of the file: either may
/// be a token (a mistyped key, a value left unquoted, a token pasted where a list was
/// wanted).
#[test]
fn auth_file_errors_quote_no_value_or_key_of_the_file() {
    let mut quoted = Vec::new();
    for text in [
        "[[identity]]\nname = \"a\"\ntokens = [hunter2]\nprefixes = [\"\"]\n",
        "[[identity]]\nname = \"a\"\ntokens = [\"hunter2\\q\"]\nprefixes = [\"\"]\n",
        "[[identity]]\nname = \"a\"\ntoken = [\"hunter2\"]\nprefixes = [\"\"]\n",
        "[[identity]]\nname = \"a\"\ntokens = [\"hunter2\"]\ntokens = [\"hunter2\"]\nprefixes = [\"\"]\n",
        "[[identity]]\nname = \"a\"\ntokens = [\"x\"]\nadmin = \"hunter2\"\n",
        "[[identity]]\nname = \"a\"\ntokens = [\"x\"]\nprefixes = [\"\"]\nactions = [\"hunter2\"]\n",
        "[[identity]]\nname = \"a\"\ntokens = [\"x\"]\nprefixes = [\"\"]\nactions = [{hunter2 = 1}]\n",
        "[[identity]]\nname = \"a\"\ntokens = [\"x\"]\nprefixes = [\"\"]\nsubjects = \"hunter2\"\n",
        "[[identity]]\nname = \"a\"\ntoken_sha256 = [\"hunter2\"]\nprefixes = [\"\"]\n",
        "[[identity]]\nname = \"a\"\ntokens = [\"x\"]\nprefixes = \"hunter2\"\n",
        "[[identity]]\nname = \"a\"\ntokens = [\"hunter2\"] x\nprefixes = [\"\"]\n",
        "[[identity]]\nname = \"a\"\ntokens = [\"x\"]\n\"hunter2\" = 1\nprefixes = [\"\"]\n",
        "[[identity]]\nname = \"a\"\ntokens = [\"x\"]\nhunter2\nprefixes = [\"\"]\n",
        "[[identity]]\nname = \"a\"\ntokens = [\"x\"]\nprefixes = [\"\"]\n[identity.hunter2]\n",
        "hunter2 = 1\n",
        "identity = \"hunter2\"\n",
    ] {
        let e = latchkey_server::auth::parse(text).expect_err("a broken file");
        if e.contains("hunter2") {
            quoted.push(format!("{text:?} -> {e}"));
        }
    }
    assert!(quoted.is_empty(), "errors that quote the file:\n{}", quoted.join("\n"));
}

/// A read hold's timeout keys, `{<lock>}:<owner>:rwlock_timeout:<n>` in Redisson's
/// layout, are no lock names: were they, identity s reading its lock `orders` would
/// overwrite (SET) the lock `{orders}:s/r:rwlock_timeout:1` of identity t, whose
/// prefix is `{orders}`.
#[tokio::test]
async fn a_read_holds_timeout_key_is_no_lock_name() {
    let redis = RedisServer::start();
    let pki = Pki::new("main");
    let auth = pki.dir().join("orders-auth.toml");
    std::fs::write(
        &auth,
        "[[identity]]\nname = \"s\"\ntokens = [\"s-token\"]\nprefixes = [\"orders\"]\n\
         [[identity]]\nname = \"t\"\ntokens = [\"t-token\"]\nprefixes = [\"{orders}\"]\n",
    )
    .unwrap();
    let server = secure_server(&redis, &pki, &auth, false, tls(&pki).token("t-token")).await;
    let t = server.client().await;
    let s = client(&server, tls(&pki).token("s-token")).await;
    let _read = s
        .lock("orders")
        .kind(LockKind::Read)
        .owner("r")
        .acquire()
        .await
        .expect("s reads its own lock");
    let key = "{orders}:s/r:rwlock_timeout:1";
    assert_eq!(redis.cli(&["EXISTS", key]).trim(), "1", "the read hold's timeout key");

    // t may take names under "{orders}", but not this one: INVALID_ARGUMENT naming the field.
    let (c, m) = code(t.lock(key).try_once().acquire().await);
    assert_eq!(c, Code::InvalidArgument, "{m}");
    assert!(m.contains("open.name") && m.contains(":rwlock_timeout:"), "{m}");
    let (c, m) = code(t.describe(key).await);
    assert_eq!(c, Code::InvalidArgument, "{m}");
    let other = t
        .lock("{orders}:audit")
        .try_once()
        .acquire()
        .await
        .expect("t takes its other names");
    other.release().await.unwrap();
    assert_eq!(redis.cli(&["EXISTS", key]).trim(), "1", "s's read hold is intact");
    server.stop().await;
}

/// The error `Server::start` gives for `args` (on a Redis nobody listens on: the TLS
/// files are read before Redis is asked anything).
async fn start_error(args: &[&str]) -> String {
    let mut argv = vec![
        "--listen",
        "127.0.0.1:0",
        "--no-metrics",
        "--redis-url",
        "redis://127.0.0.1:1",
    ];
    argv.extend_from_slice(args);
    let config = Config::from_args(argv).expect("flags parse");
    match latchkey_server::Server::start(config).await {
        Ok(server) => {
            let _ = server.stop().await;
            panic!("{args:?}: the server started");
        }
        Err(e) => e.to_string(),
    }
}

/// A bad TLS file stops the start with a message that names its flag, as every other
/// file flag's does (`--auth-file`, `--redis-tls-ca`, `--redis-password-file`,
/// `--unix-socket`): a path alone, or a key file with no key reported under the
/// certificate's path, leaves the operator to guess which flag is wrong.
#[tokio::test]
async fn a_bad_tls_file_is_refused_naming_its_flag() {
    let pki = Pki::new("flags");
    let server = pki.server("server");
    let empty = pki.dir().join("empty.pem");
    std::fs::write(&empty, "").unwrap();
    let (empty, missing) = (path(&empty), path(&pki.dir().join("missing.pem")));
    let (cert, key) = (path(&server.cert), path(&server.key));
    let cases: [(&str, Vec<&str>); 3] = [
        // The certificate given as the key: no key in it.
        ("--tls-key", vec!["--tls-cert", &cert, "--tls-key", &cert]),
        ("--tls-cert", vec!["--tls-cert", &missing, "--tls-key", &key]),
        (
            "--tls-client-ca",
            vec!["--tls-cert", &cert, "--tls-key", &key, "--tls-client-ca", &empty],
        ),
    ];
    let mut unnamed = Vec::new();
    for (flag, args) in cases {
        let error = start_error(&args).await;
        if !error.contains(flag) {
            unnamed.push(format!("{flag}: {error:?}"));
        }
    }
    assert!(
        unnamed.is_empty(),
        "start-up errors that do not name their flag:\n{}",
        unnamed.join("\n")
    );
}

/// Handshakes refused for their certificate are counted, and logged at most once in
/// ten seconds with how many were left out: a client without a certificate retries on
/// every backoff, and each refusal wrote a line.
#[tokio::test]
async fn refused_handshakes_are_counted_not_logged_one_by_one() {
    let redis = RedisServer::start();
    let pki = Pki::new("refused");
    let server_cert = pki.server("server");
    let flags = [
        ["--redis-url", &redis.url()],
        ["--tls-cert", &path(&server_cert.cert)],
        ["--tls-key", &path(&server_cert.key)],
        ["--tls-client-ca", &path(&pki.ca())],
    ];
    let args: Vec<String> = flags.concat().into_iter().map(str::to_owned).collect();
    let server = LatchkeyProcess::spawn(&args);
    let failures = || {
        metric(
            &scrape_metrics(server.metrics_port().unwrap()),
            "latchkey_tls_handshake_failures_total",
        )
    };
    assert_eq!(failures(), Some(0.0), "exported from the start");
    let endpoint = server.endpoint().replace("http://", "https://");
    const TRIES: usize = 20;
    for _ in 0..TRIES {
        let outcome = bounded(Duration::from_secs(10), "a refused handshake", async {
            match Client::connect_with(&endpoint, &tls(&pki)).await {
                Err(e) => Err(e),
                Ok(client) => client.describe("x").await.map(|_| ()),
            }
        })
        .await;
        outcome.expect_err("no client certificate");
    }
    let counted =
        latchkey_tests::poll_until(Duration::from_secs(5), || failures().is_some_and(|n| n >= TRIES as f64)).await;
    assert!(counted, "{:?} refusals counted for {TRIES}", failures());
    let lines = server.log().matches("tls handshake failed").count();
    assert!((1..=2).contains(&lines), "{lines} lines for {TRIES} refusals");
}
