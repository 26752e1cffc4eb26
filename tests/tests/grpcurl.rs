//! The README's grpcurl examples, run as written (on the test server's port) with
//! grpcurl 1.8.6 against an in-process server on a real `redis-server`. Each example
//! is also looked up in README.md, so the README cannot drift from what is tested.

use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::time::Duration;

use latchkey_client::{Client, LostReason};
use latchkey_tests::server::Latchkey;
use latchkey_tests::RedisServer;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, Command};

/// Bound on anything a test waits for.
const TIMEOUT: Duration = Duration::from_secs(10);

/// The address the README's examples use; replaced by the test server's address.
const README_ADDR: &str = "127.0.0.1:50051";

/// The message the README's `Acquire` examples send.
const OPEN_ORDERS: &str = r#"{"open":{"name":"orders"}}"#;

/// The grpcurl binary: `LATCHKEY_GRPCURL`, else `grpcurl` on `PATH`, else the one
/// `tests/run` installs under `target/tools/venv`. Panics when there is none, since a
/// skipped test would prove nothing.
fn grpcurl_binary() -> PathBuf {
    if let Some(path) = std::env::var_os("LATCHKEY_GRPCURL").filter(|p| !p.is_empty()) {
        return PathBuf::from(path);
    }
    let on_path = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|paths| std::env::split_paths(&paths).collect::<Vec<_>>())
        .map(|dir| dir.join("grpcurl"))
        .find(|p| p.is_file());
    if let Some(path) = on_path {
        return path;
    }
    let venv = workspace_root().join("target/tools/venv/bin/grpcurl");
    assert!(
        venv.is_file(),
        "grpcurl not found (LATCHKEY_GRPCURL, PATH, {}); run tests/run, which installs it",
        venv.display()
    );
    venv
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ lives in the workspace")
        .to_path_buf()
}

fn readme() -> String {
    let path = workspace_root().join("README.md");
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

/// Shell-quotes one argument the way the README writes it.
fn quoted(arg: &str) -> String {
    let plain = arg.chars().all(|c| c.is_ascii_alphanumeric() || "_-./:@=".contains(c));
    if plain {
        arg.to_owned()
    } else {
        format!("'{arg}'")
    }
}

/// `grpcurl ARGS…` as a shell line; panics unless README.md shows exactly that line
/// followed by `suffix` (after an optional `$ ` prompt).
fn assert_in_readme(args: &[&str], suffix: &str) {
    let mut line = String::from("grpcurl");
    for arg in args {
        line.push(' ');
        line.push_str(&quoted(arg));
    }
    line.push_str(suffix);
    assert!(
        readme().lines().any(|l| l.trim().trim_start_matches("$ ") == line),
        "README.md does not show the tested example:\n{line}"
    );
}

/// A real Redis, an in-process server and a client library handle on it.
struct Setup {
    _redis: RedisServer,
    server: Latchkey,
    client: Client,
}

impl Setup {
    async fn start() -> Setup {
        let redis = RedisServer::start();
        let server = Latchkey::start(&redis.url()).await;
        let client = server.client().await;
        Setup {
            _redis: redis,
            server,
            client,
        }
    }

    /// `127.0.0.1:PORT`, the address grpcurl takes.
    fn addr(&self) -> &str {
        self.server
            .endpoint()
            .strip_prefix("http://")
            .expect("endpoint is http://")
    }

    /// grpcurl with the README's `args`, pointed at this server, stdio piped.
    fn grpcurl(&self, args: &[&str]) -> Command {
        let mut command = Command::new(grpcurl_binary());
        command
            .args(args.iter().map(|a| if *a == README_ADDR { self.addr() } else { a }))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        command
    }

    /// Runs a README example with `input` on stdin (then closed); waits for its exit.
    async fn run(&self, args: &[&str], input: &str) -> Output {
        let mut child = self.grpcurl(args).spawn().expect("grpcurl starts");
        let mut stdin = child.stdin.take().expect("stdin is piped");
        stdin.write_all(input.as_bytes()).await.expect("write grpcurl's stdin");
        drop(stdin);
        tokio::time::timeout(TIMEOUT, child.wait_with_output())
            .await
            .expect("grpcurl finished in time")
            .expect("grpcurl ran")
    }

    /// Runs a README example that must succeed; returns its stdout.
    async fn ok(&self, args: &[&str]) -> String {
        assert_in_readme(args, "");
        let output = self.run(args, "").await;
        success(&output)
    }

    /// Holds `name` through the client library.
    async fn hold(&self, name: &str) -> latchkey_client::Lease {
        tokio::time::timeout(TIMEOUT, self.client.lock(name).acquire())
            .await
            .expect("acquired in time")
            .expect("acquired")
    }

    /// Panics unless `name` is held by someone: a try-once acquire must time out.
    async fn assert_held(&self, name: &str) {
        let err = self
            .client
            .lock(name)
            .try_once()
            .acquire()
            .await
            .expect_err("the lock is held, so try-once fails");
        assert_eq!(err.code(), tonic::Code::DeadlineExceeded, "{err}");
    }

    async fn assert_free(&self, name: &str) {
        let state = self.client.describe(name).await.expect("describe");
        assert!(!state.locked, "{name} is still locked: {state:?}");
    }
}

/// Stdout of a successful run; panics with both streams otherwise.
fn success(output: &Output) -> String {
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "grpcurl failed ({}):\nstdout:\n{stdout}\nstderr:\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

/// JSON with every whitespace removed, so checks do not depend on indentation.
fn compact(json: &str) -> String {
    json.split_whitespace().collect()
}

/// Reads grpcurl's stdout up to the end of the first message holding `"acquired"`.
async fn read_acquired(stdout: &mut BufReader<tokio::process::ChildStdout>) -> String {
    let mut text = String::new();
    let read = async {
        loop {
            let mut line = String::new();
            let n = stdout.read_line(&mut line).await.expect("read grpcurl");
            assert!(n > 0, "grpcurl ended before acquiring:\n{text}");
            text.push_str(&line);
            // grpcurl pretty-prints each message and closes it with "}" in column 0.
            if text.contains("\"acquired\"") && line.trim_end() == "}" {
                return;
            }
        }
    };
    tokio::time::timeout(TIMEOUT, read)
        .await
        .expect("grpcurl printed acquired in time");
    text
}

/// The value of `"fencingToken"` in grpcurl's output (uint64 is a JSON string).
fn fencing_token(json: &str) -> u64 {
    let compact = compact(json);
    let start = compact
        .find("\"fencingToken\":\"")
        .unwrap_or_else(|| panic!("no fencingToken in {json}"))
        + "\"fencingToken\":\"".len();
    let digits: String = compact[start..].chars().take_while(char::is_ascii_digit).collect();
    digits.parse().expect("fencingToken is a number")
}

async fn wait_exit(child: &mut Child) -> std::process::ExitStatus {
    tokio::time::timeout(TIMEOUT, child.wait())
        .await
        .expect("grpcurl exited in time")
        .expect("wait for grpcurl")
}

#[tokio::test]
async fn list_and_describe_show_the_services() {
    let setup = Setup::start().await;
    let list = setup.ok(&["-plaintext", README_ADDR, "list"]).await;
    let services: Vec<&str> = list.lines().collect();
    assert!(services.contains(&"latchkey.v1.LockService"), "{list}");
    assert!(services.contains(&"grpc.health.v1.Health"), "{list}");

    let describe = setup
        .ok(&["-plaintext", README_ADDR, "describe", "latchkey.v1.LockService"])
        .await;
    assert!(describe.contains("latchkey.v1.LockService is a service"), "{describe}");
    for rpc in [
        "rpc Acquire ( stream .latchkey.v1.AcquireRequest ) returns ( stream .latchkey.v1.AcquireResponse )",
        "rpc Describe ( .latchkey.v1.DescribeRequest ) returns ( .latchkey.v1.LockState )",
        "rpc List ( .latchkey.v1.ListRequest ) returns ( .latchkey.v1.ListResponse )",
        "rpc ForceRelease ( .latchkey.v1.ForceReleaseRequest ) returns ( .latchkey.v1.ForceReleaseResponse )",
    ] {
        assert!(describe.contains(rpc), "missing {rpc:?} in:\n{describe}");
    }
}

#[tokio::test]
async fn health_check_says_serving() {
    let setup = Setup::start().await;
    let out = setup
        .ok(&["-plaintext", README_ADDR, "grpc.health.v1.Health/Check"])
        .await;
    assert_eq!(compact(&out), r#"{"status":"SERVING"}"#);
}

#[tokio::test]
async fn describe_and_list_show_a_lock_held_by_the_rust_client() {
    let setup = Setup::start().await;
    let describe = [
        "-plaintext",
        "-d",
        r#"{"name":"orders"}"#,
        README_ADDR,
        "latchkey.v1.LockService/Describe",
    ];
    assert_eq!(compact(&setup.ok(&describe).await), r#"{"name":"orders"}"#);

    let lease = setup.hold("orders").await;
    let out = compact(&setup.ok(&describe).await);
    assert!(out.contains(r#""locked":true"#), "{out}");
    assert!(out.contains(r#""kind":"LOCK_KIND_MUTEX""#), "{out}");
    let holder = format!(r#""owner":"{}","holdCount":1"#, lease.owner());
    assert!(out.contains(&holder), "{holder} not in {out}");
    let token = format!(r#""lastFencingToken":"{}""#, lease.fencing_token());
    assert!(out.contains(&token), "{token} not in {out}");

    let list = [
        "-plaintext",
        "-d",
        r#"{"prefix":"ord"}"#,
        README_ADDR,
        "latchkey.v1.LockService/List",
    ];
    let out = compact(&setup.ok(&list).await);
    assert!(
        out.starts_with(r#"{"locks":[{"name":"orders","kind":"LOCK_KIND_MUTEX","locked":true"#),
        "{out}"
    );
    assert!(out.contains(&holder), "{holder} not in {out}");
    lease.release().await.expect("release");
}

const ACQUIRE: [&str; 5] = ["-plaintext", "-d", "@", README_ADDR, "latchkey.v1.LockService/Acquire"];

#[tokio::test]
async fn here_string_acquire_releases_at_once() {
    let setup = Setup::start().await;
    assert_in_readme(&ACQUIRE, &format!(" <<< '{OPEN_ORDERS}'"));
    // A here-string is the message, a newline, then end of input.
    let output = setup.run(&ACQUIRE, &format!("{OPEN_ORDERS}\n")).await;
    let out = compact(&success(&output));
    assert!(out.starts_with(r#"{"acquired":{"fencingToken":""#), "{out}");
    assert!(out.contains(r#""holdCount":1"#), "{out}");
    assert!(out.contains(r#""lease":"30s""#), "{out}");
    assert!(out.ends_with(r#"{"released":{}}"#), "{out}");
    setup.assert_free("orders").await;
}

#[tokio::test]
async fn interactive_acquire_holds_until_stdin_closes() {
    let setup = Setup::start().await;
    assert_in_readme(&ACQUIRE, "");
    assert!(
        readme().lines().any(|l| l.trim() == OPEN_ORDERS),
        "README.md does not show the typed line {OPEN_ORDERS}"
    );
    let mut child = setup.grpcurl(&ACQUIRE).spawn().expect("grpcurl starts");
    let mut stdin = child.stdin.take().expect("stdin is piped");
    let mut stdout = BufReader::new(child.stdout.take().expect("stdout is piped"));
    stdin
        .write_all(format!("{OPEN_ORDERS}\n").as_bytes())
        .await
        .expect("type the open message");
    stdin.flush().await.expect("flush stdin");

    let acquired = read_acquired(&mut stdout).await;
    let token = fencing_token(&acquired);
    setup.assert_held("orders").await;
    let state = setup.client.describe("orders").await.expect("describe");
    assert!(state.locked, "{state:?}");
    assert_eq!(state.last_fencing_token, token);

    // Ctrl-D: end of input half-closes the stream, which releases the lock.
    drop(stdin);
    let mut rest = String::new();
    tokio::time::timeout(TIMEOUT, stdout.read_to_string(&mut rest))
        .await
        .expect("grpcurl finished its output in time")
        .expect("read grpcurl");
    assert_eq!(compact(&rest), r#"{"released":{}}"#);
    let status = wait_exit(&mut child).await;
    assert!(status.success(), "grpcurl exited with {status}");
    setup.assert_free("orders").await;
    // The name is free for the next holder, with a larger token.
    let next = setup.hold("orders").await;
    assert!(next.fencing_token() > token);
}

#[tokio::test]
async fn try_once_on_a_held_lock_is_deadline_exceeded() {
    let setup = Setup::start().await;
    let input = r#"{"open":{"name":"orders","waitTimeout":"0s"}}"#;
    assert_in_readme(&ACQUIRE, &format!(" <<< '{input}'"));
    let _lease = setup.hold("orders").await;
    let output = setup.run(&ACQUIRE, &format!("{input}\n")).await;
    assert!(!output.status.success(), "try-once on a held lock succeeded");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("Code: DeadlineExceeded"), "{stderr}");
    assert!(stderr.contains("\"orders\""), "{stderr}");
}

#[tokio::test]
async fn force_release_breaks_a_lock() {
    let setup = Setup::start().await;
    let lease = setup.hold("orders").await;
    let out = setup
        .ok(&[
            "-plaintext",
            "-d",
            r#"{"name":"orders"}"#,
            README_ADDR,
            "latchkey.v1.LockService/ForceRelease",
        ])
        .await;
    assert_eq!(compact(&out), r#"{"released":true}"#);
    let reason = tokio::time::timeout(TIMEOUT, lease.lost())
        .await
        .expect("the holder learns in time");
    assert_eq!(reason, LostReason::ForceReleased);
    setup.assert_free("orders").await;
}

#[tokio::test]
async fn watch_prints_the_state_then_each_change() {
    let setup = Setup::start().await;
    let args = [
        "-plaintext",
        "-d",
        r#"{"name":"orders"}"#,
        README_ADDR,
        "latchkey.v1.LockService/Watch",
    ];
    assert_in_readme(&args, "");
    let mut child = setup.grpcurl(&args).spawn().expect("grpcurl starts");
    let mut stdout = BufReader::new(child.stdout.take().expect("stdout is piped"));
    let mut seen = String::new();
    let mut read_until = async |needle: &str, seen: &mut String| {
        let deadline = tokio::time::Instant::now() + TIMEOUT;
        while !seen.contains(needle) {
            let mut line = String::new();
            let n = tokio::time::timeout_at(deadline, stdout.read_line(&mut line))
                .await
                .unwrap_or_else(|_| panic!("no {needle} in grpcurl's output:\n{seen}"))
                .expect("read grpcurl's stdout");
            assert!(n > 0, "grpcurl ended early:\n{seen}");
            seen.push_str(&line);
        }
    };
    read_until("\"name\": \"orders\"", &mut seen).await;
    let lease = setup.hold("orders").await;
    read_until("\"locked\": true", &mut seen).await;
    read_until(lease.owner(), &mut seen).await;
    child.kill().await.expect("stop watching");
}

/// The "Securing latchkey" grpcurl example: grpcurl (Go's TLS stack, ALPN h2) reaches
/// an mTLS server with a client certificate and a bearer token; a denial shows its
/// ErrorInfo, and the health check needs no token.
#[tokio::test]
async fn grpcurl_speaks_mtls_and_tokens() {
    use latchkey_client::ConnectOptions;
    use latchkey_tests::certs::Pki;
    let redis = RedisServer::start();
    let pki = Pki::new("grpcurl");
    let server_cert = pki.server("server");
    let billing = pki.client("billing", "billing");
    let auth = pki.dir().join("auth.toml");
    std::fs::write(
        &auth,
        "[[identity]]\nname = \"billing\"\ntokens = [\"billing-token-change-me\"]\nsubjects = [\"billing\"]\nprefixes = [\"billing/\"]\n",
    )
    .unwrap();
    let s = |p: &Path| p.to_str().expect("UTF-8 path").to_owned();
    let args = [
        "--tls-cert".to_owned(),
        s(&server_cert.cert),
        "--tls-key".to_owned(),
        s(&server_cert.key),
        "--tls-client-ca".to_owned(),
        s(&pki.ca()),
        "--auth-file".to_owned(),
        s(&auth),
    ];
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let options = ConnectOptions::new()
        .ca_pem(pki.ca_pem())
        .identity_pem(billing.cert_pem(), billing.key_pem());
    let server = Latchkey::start_secure(&redis.url(), &args, options).await;
    let addr = server.endpoint().trim_start_matches("https://").to_owned();
    let (ca, cert, key) = (s(&pki.ca()), s(&billing.cert), s(&billing.key));
    let tls = ["-cacert", &ca, "-cert", &cert, "-key", &key];
    let grpcurl = |extra: &[&str]| {
        let mut command = Command::new(grpcurl_binary());
        command.args(tls).args(extra).stdin(Stdio::null()).kill_on_drop(true);
        command
    };
    let run = |mut command: Command| async move {
        tokio::time::timeout(TIMEOUT, command.output())
            .await
            .expect("grpcurl finished in time")
            .expect("grpcurl ran")
    };
    let describe = [
        "-H",
        "authorization: Bearer billing-token-change-me",
        "-d",
        r#"{"name":"billing/nightly"}"#,
        &addr,
        "latchkey.v1.LockService/Describe",
    ];
    let out = success(&run(grpcurl(&describe)).await);
    assert!(out.contains("\"billing/nightly\""), "{out}");
    let denied = run(grpcurl(&[
        "-d",
        r#"{"name":"orders"}"#,
        &addr,
        "latchkey.v1.LockService/Describe",
    ]))
    .await;
    let stderr = String::from_utf8_lossy(&denied.stderr);
    assert!(!denied.status.success());
    assert!(
        stderr.contains("PermissionDenied") && stderr.contains("PERMISSION_DENIED"),
        "{stderr}"
    );
    let health = success(&run(grpcurl(&[&addr, "grpc.health.v1.Health/Check"])).await);
    assert!(health.contains("SERVING"), "{health}");
    server.stop().await;
}

/// The README's socket path; replaced by the test server's socket.
const README_SOCKET: &str = "/var/run/latchkey/latchkey.sock";

/// Runs grpcurl with `args`, the README's socket path replaced by `socket`.
async fn grpcurl_on(socket: &str, args: &[&str]) -> Output {
    let args = args.iter().map(|a| if *a == README_SOCKET { socket } else { a });
    let child = Command::new(grpcurl_binary())
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("grpcurl starts");
    tokio::time::timeout(TIMEOUT, child.wait_with_output())
        .await
        .expect("grpcurl finished in time")
        .expect("grpcurl ran")
}

/// The README's example over the server's Unix socket (as a sidecar serves it): with
/// `-unix -authority localhost` it answers; without `-authority` grpcurl sends the
/// socket's path as the `:authority`, which the server's HTTP/2 stack refuses.
#[tokio::test]
async fn health_check_over_the_unix_socket_needs_the_authority() {
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().expect("a temporary directory");
    let socket = dir.path().join("latchkey.sock");
    let socket = socket.to_str().expect("a UTF-8 path");
    let _server = Latchkey::start_with(&redis.url(), &["--unix-socket", socket]).await;
    let example = [
        "-plaintext",
        "-unix",
        "-authority",
        "localhost",
        README_SOCKET,
        "grpc.health.v1.Health/Check",
    ];
    assert_in_readme(&example, "");
    let out = success(&grpcurl_on(socket, &example).await);
    assert_eq!(compact(&out), r#"{"status":"SERVING"}"#);
    let without = ["-plaintext", "-unix", README_SOCKET, "grpc.health.v1.Health/Check"];
    assert!(
        !grpcurl_on(socket, &without).await.status.success(),
        "without -authority the call fails"
    );
}
