//! The Rust client library and the `latchkey` CLI against a real `latchkey-server`
//! on a real `redis-server`: environment and exit codes of `latchkey run`, lost
//! leases stopping the command, release on drop, inspection output, TLS over a Unix
//! socket.

use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::time::Duration;
use tokio::io::AsyncBufReadExt;

use latchkey_client::{Client, ConnectOptions, LockKind, LostReason};
use latchkey_tests::certs::Pki;
use latchkey_tests::proxy::Proxy;
use latchkey_tests::server::Latchkey;
use latchkey_tests::{LatchkeyProcess, RedisServer};
use nix::sys::signal::Signal;
use nix::unistd::Pid;
use tokio::process::Command;

/// Bound on anything a test waits for.
const TIMEOUT: Duration = Duration::from_secs(10);

/// `target/<profile>/latchkey`, built with `cargo build -p latchkey-client`.
fn cli_binary() -> PathBuf {
    let exe = std::env::current_exe().expect("path of the test executable");
    let binary = exe
        .parent()
        .and_then(Path::parent)
        .expect("test executable lives in target/<profile>/deps")
        .join("latchkey");
    assert!(
        binary.is_file(),
        "{} not found; build it first with `cargo build -p latchkey-client`",
        binary.display()
    );
    binary
}

fn cli(server: &LatchkeyProcess, args: &[&str]) -> Command {
    cli_at(&server.endpoint(), args)
}

/// `cli` for the server at `endpoint` (a proxy in front of it).
fn cli_at(endpoint: &str, args: &[&str]) -> Command {
    with_cli_args(Command::new(cli_binary()), endpoint, args)
}

/// `cli`, started with SIGCHLD ignored, which it inherits: by Perl (Debian's
/// `perl-base` is always there), as a Perl program that ignores it and calls `system`
/// starts it. (dash's `trap '' CHLD` leaves the signal's disposition as it was.)
fn cli_ignoring_sigchld(server: &LatchkeyProcess, args: &[&str]) -> Command {
    let mut perl = Command::new("perl");
    perl.args(["-e", "$SIG{CHLD} = 'IGNORE'; exec @ARGV or die \"exec: $!\""])
        .arg(cli_binary());
    with_cli_args(perl, &server.endpoint(), args)
}

/// `command` with the CLI's server and `args`, its output piped.
fn with_cli_args(mut command: Command, endpoint: &str, args: &[&str]) -> Command {
    command
        .env_remove("LATCHKEY_SERVER")
        .arg("--server")
        .arg(endpoint)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    command
}

async fn output(mut command: Command) -> Output {
    let run = command.output();
    tokio::time::timeout(TIMEOUT, run)
        .await
        .expect("latchkey finished in time")
        .expect("latchkey runs")
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

async fn start() -> (RedisServer, LatchkeyProcess, Client) {
    let redis = RedisServer::start();
    let server = LatchkeyProcess::start(&redis.url());
    let client = Client::connect(&server.endpoint()).await.expect("connect");
    (redis, server, client)
}

/// Starts `latchkey run <name> --grace 1s` on a command that says it started, and
/// waits for that: the lease is granted and the command runs.
async fn run_started(server: &LatchkeyProcess, name: &str) -> tokio::process::Child {
    let args = [
        "run",
        name,
        "--grace",
        "1s",
        "--",
        "sh",
        "-c",
        "echo started; exec sleep 60",
    ];
    let mut running = cli(server, &args).spawn().expect("spawn latchkey");
    let mut lines = tokio::io::BufReader::new(running.stdout.take().expect("stdout")).lines();
    let first = tokio::time::timeout(TIMEOUT, lines.next_line())
        .await
        .expect("the command started in time")
        .expect("read the command's output");
    assert_eq!(first.as_deref(), Some("started"));
    running
}

#[tokio::test]
async fn run_passes_the_lease_to_the_command_and_its_exit_code_back() {
    let (_redis, server, client) = start().await;
    let script = "echo $LATCHKEY_LOCK_NAME $LATCHKEY_FENCING_TOKEN $LATCHKEY_OWNER; exit 4";
    let out = output(cli(&server, &["run", "job", "--owner", "me", "--", "sh", "-c", script])).await;
    assert_eq!(out.status.code(), Some(4), "{out:?}");
    let line = stdout(&out);
    let fields: Vec<&str> = line.split_whitespace().collect();
    assert_eq!((fields[0], fields[2]), ("job", "me"), "{line}");
    let token: u64 = fields[1].parse().expect("a numeric fencing token");
    assert!(token > 0);
    let state = client.describe("job").await.expect("describe");
    assert!(!state.locked, "released after the command exited");
    assert_eq!(state.last_fencing_token, token);
}

/// `run` gives the command's exit code back for each lock kind, and releases.
#[tokio::test]
async fn run_passes_exit_codes_for_every_kind() {
    let (_redis, server, client) = start().await;
    let kinds: [&[&str]; 5] = [
        &[],
        &["--kind", "fair"],
        &["--kind", "read"],
        &["--kind", "write"],
        &["--kind", "semaphore", "--limit", "2"],
    ];
    for extra in kinds {
        let name = format!("codes{}", extra.join(""));
        let mut args = vec!["run", name.as_str()];
        args.extend_from_slice(extra);
        args.extend_from_slice(&["--", "sh", "-c", "exit 42"]);
        let out = output(cli(&server, &args)).await;
        assert_eq!(out.status.code(), Some(42), "{extra:?}: {out:?}");
        assert!(
            !client.describe(name.as_str()).await.unwrap().locked,
            "{extra:?}: released"
        );
    }
}

/// A grace too long for the clock is refused as a usage error naming `--grace`, before
/// anything runs: added to the clock when the lease is lost, it panicked there, before
/// the command was signalled, which left the command's jobs running without the lock.
/// `run` passes the command arguments that are not UTF-8 as they are (a Latin-1 file
/// name); they were refused as a usage error (exit 2).
#[tokio::test]
async fn run_passes_arguments_that_are_not_utf8() {
    use std::os::unix::ffi::OsStrExt;
    let (_redis, server, _client) = start().await;
    let mut command = cli(&server, &["run", "bytes", "--", "printf", "%s"]);
    command.arg(std::ffi::OsStr::from_bytes(b"caf\xe9"));
    let out = output(command).await;
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    assert_eq!(out.stdout, b"caf\xe9");
}

/// A server address whose port is no port is refused as one (exit 1): the URI parser
/// read it as none, and the CLI dialled port 80 (exit 69, "trying again may work").
#[tokio::test]
async fn a_server_address_with_a_bad_port_is_refused() {
    for bad in ["http://127.0.0.1:99999", "http://127.0.0.1:5005l"] {
        let out = Command::new(cli_binary())
            .args(["--server", bad, "describe", "x"])
            .output()
            .await
            .expect("the CLI runs");
        assert_eq!(out.status.code(), Some(1), "{bad}: {out:?}");
        assert!(String::from_utf8_lossy(&out.stderr).contains("port"), "{out:?}");
    }
}

#[tokio::test]
async fn run_refuses_a_grace_too_long_for_the_clock() {
    let (_redis, server, client) = start().await;
    let out = output(cli(
        &server,
        &["run", "graceful", "--grace", "10000000000000000000s", "--", "true"],
    ))
    .await;
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("--grace"), "{out:?}");
    assert_eq!(
        client.describe("graceful").await.expect("describe").last_fencing_token,
        0
    );
}

/// A command killed by a signal ends latchkey by that signal, once the lock is
/// released, as coreutils `timeout` does: systemd, a shell loop on Ctrl-C and xargs
/// ask how their child ended (a shell's `$?` still reads 128+N).
#[tokio::test]
async fn a_command_killed_by_a_signal_ends_latchkey_by_that_signal() {
    use std::os::unix::process::ExitStatusExt;
    let (_redis, server, client) = start().await;
    let out = output(cli(&server, &["run", "killed", "--", "sh", "-c", "kill -TERM $$"])).await;
    assert_eq!(out.status.signal(), Some(15), "{out:?}");
    assert!(
        !client.describe("killed").await.expect("describe").locked,
        "released first"
    );
    // A real-time signal too (SIGRTMIN is 34 under glibc): it ended latchkey normally,
    // exit 162.
    let out = output(cli(&server, &["run", "killed-rt", "--", "sh", "-c", "kill -34 $$"])).await;
    assert_eq!(out.status.signal(), Some(34), "{out:?}");
    let script = format!(
        "{} --server {} run killed2 -- sh -c 'kill -TERM $$'; echo $?",
        cli_binary().display(),
        server.endpoint()
    );
    let mut shell = Command::new("sh");
    shell.args(["-c", &script]).stdout(Stdio::piped()).kill_on_drop(true);
    let shell = output(shell).await;
    assert_eq!(String::from_utf8_lossy(&shell.stdout).trim(), "143", "{shell:?}");
}

#[tokio::test]
async fn a_held_lock_makes_run_exit_3() {
    let (_redis, server, client) = start().await;
    let lease = client.lock("busy").acquire().await.expect("acquired");
    let tried = output(cli(&server, &["run", "busy", "--wait", "0s", "--", "true"])).await;
    assert_eq!(tried.status.code(), Some(3), "{tried:?}");
    let waited = output(cli(&server, &["run", "busy", "--wait", "300ms", "--", "true"])).await;
    assert_eq!(waited.status.code(), Some(3), "{waited:?}");
    lease.release().await.expect("released");
    let free = output(cli(&server, &["run", "busy", "--wait", "0s", "--", "true"])).await;
    assert_eq!(free.status.code(), Some(0), "{free:?}");
}

#[tokio::test]
async fn force_release_stops_the_command_with_75() {
    let (_redis, server, client) = start().await;
    let running = run_started(&server, "victim").await;
    assert!(client.force_release("victim").await.expect("force release"));
    let out = tokio::time::timeout(TIMEOUT, running.wait_with_output())
        .await
        .expect("stopped in time")
        .expect("latchkey output");
    assert_eq!(out.status.code(), Some(75), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("force-released"));
}

/// A lock that vanished while the command ran (a failover that lost it, a flush), found
/// only by the release after the command exited, is reported as lost (75): another
/// client may have held it meanwhile. The release's `lost` was printed as a warning
/// and `run` exited with the command's own 0.
#[tokio::test]
async fn a_lock_that_vanished_while_the_command_ran_exits_75() {
    let (redis, server, _client) = start().await;
    let dir = tempfile::tempdir().unwrap();
    let done = dir.path().join("done");
    let script = format!("echo started; while [ ! -e {} ]; do sleep 0.05; done", done.display());
    let mut running = cli(&server, &["run", "vanish", "--", "sh", "-c", &script])
        .spawn()
        .expect("spawn latchkey");
    let mut lines = tokio::io::BufReader::new(running.stdout.take().expect("stdout")).lines();
    let first = tokio::time::timeout(TIMEOUT, lines.next_line())
        .await
        .expect("started in time");
    assert_eq!(first.expect("read").as_deref(), Some("started"));
    // No renewal for 10 s: only the release can tell.
    redis.cli(&["DEL", "vanish"]);
    std::fs::write(&done, b"").unwrap();
    let out = tokio::time::timeout(TIMEOUT, running.wait_with_output())
        .await
        .expect("ended in time")
        .expect("latchkey output");
    assert_eq!(out.status.code(), Some(75), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("lost lock"), "{out:?}");
}

#[tokio::test]
async fn an_expired_fixed_lease_stops_the_command() {
    let (_redis, server, _client) = start().await;
    let args = ["run", "short", "--lease", "1s", "--grace", "1s", "--", "sleep", "60"];
    let out = output(cli(&server, &args)).await;
    assert_eq!(out.status.code(), Some(75), "{out:?}");
}

#[tokio::test]
async fn a_dead_server_stops_the_command() {
    let (_redis, mut server, _client) = start().await;
    let running = run_started(&server, "orphan").await;
    server.kill();
    let out = tokio::time::timeout(TIMEOUT, running.wait_with_output())
        .await
        .expect("stopped in time")
        .expect("latchkey output");
    assert_eq!(out.status.code(), Some(75), "{out:?}");
}

#[tokio::test]
async fn dropping_a_lease_releases_and_tokens_increase() {
    let (_redis, _server, client) = start().await;
    let first = client.lock("drop").acquire().await.expect("acquired");
    let first_token = first.fencing_token();
    drop(first);
    let second = tokio::time::timeout(TIMEOUT, client.lock("drop").acquire())
        .await
        .expect("released on drop")
        .expect("acquired again");
    assert!(second.fencing_token() > first_token);
    second.release().await.expect("released");
}

#[tokio::test]
async fn a_lease_sees_force_release() {
    let (_redis, _server, client) = start().await;
    let lease = client.lock("watched").acquire().await.expect("acquired");
    assert!(client.force_release("watched").await.expect("force release"));
    let reason = tokio::time::timeout(TIMEOUT, lease.lost()).await.expect("lost in time");
    assert_eq!(reason, LostReason::ForceReleased);
}

/// No task reads a lease's stream: `is_lost` reads what the server has sent so far.
#[tokio::test]
async fn a_lease_nobody_awaits_still_tells_it_is_lost() {
    let (_redis, _server, client) = start().await;
    let lease = client.lock("polled").acquire().await.expect("acquired");
    assert!(!lease.is_lost());
    assert!(client.force_release("polled").await.expect("force release"));
    let deadline = tokio::time::Instant::now() + TIMEOUT;
    while !lease.is_lost() {
        assert!(tokio::time::Instant::now() < deadline, "never told it is lost");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(lease.lost_reason(), Some(LostReason::ForceReleased));
    let released = lease.release().await;
    assert!(
        matches!(released, Err(latchkey_client::Error::Lost(LostReason::ForceReleased))),
        "{released:?}"
    );
}

#[tokio::test]
async fn describe_and_list_print_the_lock() {
    let (_redis, server, client) = start().await;
    let lease = client.lock("shown").owner("owner-1").acquire().await.expect("acquired");
    let described = output(cli(&server, &["describe", "shown"])).await;
    assert!(described.status.success(), "{described:?}");
    let text = stdout(&described);
    assert!(
        text.contains("state:         locked") && text.contains("owner-1"),
        "{text}"
    );
    let listed = output(cli(&server, &["list", "sh"])).await;
    assert!(stdout(&listed).lines().any(|l| l.starts_with("shown ")), "{listed:?}");
    lease.release().await.expect("released");
}

#[tokio::test]
async fn watch_prints_a_line_per_change() {
    let (_redis, server, client) = start().await;
    let mut child = cli(&server, &["watch", "leader"])
        .spawn()
        .expect("latchkey watch starts");
    let mut lines = tokio::io::BufReader::new(child.stdout.take().expect("stdout")).lines();
    let mut next = async || {
        tokio::time::timeout(TIMEOUT, lines.next_line())
            .await
            .expect("a line in time")
            .expect("read")
            .expect("still watching")
    };
    let first = next().await;
    let lease = client.lock("leader").owner("node-1").acquire().await.unwrap();
    let second = next().await;
    assert!(second.contains("node-1"), "{first}\n{second}");
    drop(lease);
    let third = next().await;
    assert!(!third.contains("node-1"), "{third}");
    child.kill().await.unwrap();
}

/// `latchkey watch NAME | head -1`: once the reader of its output is gone, the next
/// state ends the watch quietly, as it ends other Unix tools. It panicked ("failed
/// printing to stdout: Broken pipe") and exited 101 with a backtrace hint.
#[tokio::test]
async fn watch_whose_reader_went_away_ends_quietly() {
    let (_redis, server, client) = start().await;
    let mut child = cli(&server, &["watch", "piped"])
        .spawn()
        .expect("latchkey watch starts");
    let mut lines = tokio::io::BufReader::new(child.stdout.take().expect("stdout")).lines();
    let first = tokio::time::timeout(TIMEOUT, lines.next_line())
        .await
        .expect("a line in time");
    assert!(first.expect("read").is_some_and(|l| l.contains("free")));
    drop(lines);
    let _lease = client.lock("piped").acquire().await.expect("acquired");
    let status = tokio::time::timeout(TIMEOUT, child.wait())
        .await
        .expect("the watch ends once its output has no reader")
        .expect("waited");
    let mut stderr = String::new();
    tokio::io::AsyncReadExt::read_to_string(&mut child.stderr.take().expect("stderr"), &mut stderr)
        .await
        .expect("stderr");
    assert!(status.success() && stderr.is_empty(), "{status:?}: {stderr}");
}

/// A server with TLS serves TLS on its Unix socket too; the client and the CLI reach it
/// there with the CA (the server name is `localhost` unless `domain_name` /
/// `--tls-domain` says otherwise). They used to fail: tonic refuses TLS settings for a
/// `unix://` endpoint ("cannot apply TLS config for unix domain socket").
#[tokio::test]
async fn tls_works_over_a_unix_socket_for_the_client_and_the_cli() {
    let redis = RedisServer::start();
    let pki = Pki::new("unix-tls");
    let cert = pki.server("server");
    let sock_dir = tempfile::tempdir().expect("temp dir");
    let sock = sock_dir.path().join("latchkey.sock");
    let (cert_path, key_path, sock_path) = (utf8(&cert.cert), utf8(&cert.key), utf8(&sock));
    let args = [
        "--tls-cert",
        &cert_path,
        "--tls-key",
        &key_path,
        "--unix-socket",
        &sock_path,
    ];
    let tls = ConnectOptions::new().ca_pem(pki.ca_pem());
    let server = Latchkey::start_secure(&redis.url(), &args, tls.clone()).await;
    let target = format!("unix://{sock_path}");

    for options in [tls.clone(), tls.clone().domain_name("localhost")] {
        let described = tokio::time::timeout(TIMEOUT, async {
            let client = Client::connect_with(&target, &options).await?;
            let lease = client.lock("unix-tls").acquire().await?;
            let state = client.describe("unix-tls").await?;
            lease.release().await?;
            Ok::<_, latchkey_client::Error>(state)
        })
        .await
        .expect("bounded");
        match described {
            Ok(state) => assert!(state.locked, "{state:?}"),
            Err(err) => panic!("TLS over {target} with {options:?}: {err} ({:?})", err.code()),
        }
    }
    // Without the CA the client speaks plaintext to a TLS socket: refused.
    let plaintext = tokio::time::timeout(TIMEOUT, async {
        Client::connect(&target).await?.describe("unix-tls").await
    })
    .await
    .expect("bounded");
    assert!(plaintext.is_err(), "plaintext over a TLS socket: {plaintext:?}");

    let mut command = Command::new(cli_binary());
    command
        .env_remove("LATCHKEY_SERVER")
        .args(["--server", &target, "--ca", &utf8(&pki.ca()), "describe", "unix-tls"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let described = output(command).await;
    assert!(described.status.success(), "{described:?}");
    assert!(stdout(&described).contains("unix-tls"), "{described:?}");
    server.stop().await;
}

/// Runs `latchkey run <name> --grace 1s [extra] -- sh -c <script>` and returns it with
/// the first line the script printed.
async fn run_printing(endpoint: &str, name: &str, extra: &[&str], script: &str) -> (tokio::process::Child, String) {
    printing(cli_at(endpoint, &run_args(name, extra, script))).await
}

/// `run <name> --grace 1s <extra> -- sh -c <script>`.
fn run_args<'a>(name: &'a str, extra: &[&'a str], script: &'a str) -> Vec<&'a str> {
    let mut args = vec!["run", name, "--grace", "1s"];
    args.extend_from_slice(extra);
    args.extend_from_slice(&["--", "sh", "-c", script]);
    args
}

/// Starts `command`, once it printed its first line.
async fn printing(mut command: Command) -> (tokio::process::Child, String) {
    let mut running = command.spawn().expect("spawn latchkey");
    let mut lines = tokio::io::BufReader::new(running.stdout.take().expect("stdout")).lines();
    let first = tokio::time::timeout(TIMEOUT, lines.next_line())
        .await
        .expect("the command started in time")
        .expect("read the command's output")
        .expect("a line");
    (running, first)
}

/// A lost lease stops what the command started, not only the command's own process:
/// `sh -c 'job & wait'`, or `make` and its jobs, must not run on without the lock,
/// also when they ignore SIGTERM (SIGKILL after `--grace`). Only the shell was
/// signalled: its background job ran on.
#[tokio::test]
async fn a_lost_lease_stops_what_the_command_started() {
    let (_redis, server, client) = start().await;
    for script in ["sleep 60 & echo $!; wait", "trap '' TERM; sleep 60 & echo $!; wait"] {
        let running = run_printing(&server.endpoint(), "family", &[], script).await;
        let (out, stopped) = broken_under(&client, "family", running).await;
        assert_eq!(out.status.code(), Some(75), "{script}: {out:?}");
        assert!(
            stopped,
            "{script}: the command's background job runs on without the lock"
        );
    }
}

/// `latchkey run` started with SIGCHLD ignored (a Perl `$SIG{CHLD} = 'IGNORE'` before
/// `system`, some supervisors) still learns how its command ended, and a lost lease
/// still stops the command's whole group. The kernel reaped the command itself: the
/// wait failed, latchkey exited 1, and after a lost lease it skipped the group's
/// SIGKILL, leaving a job that ignored SIGTERM running without the lock.
#[tokio::test]
async fn a_run_started_with_sigchld_ignored_still_reaps_and_stops_its_command() {
    let (_redis, server, client) = start().await;
    let exits = cli_ignoring_sigchld(&server, &["run", "reaped", "--", "sh", "-c", "exit 4"]);
    let out = output(exits).await;
    assert_eq!(out.status.code(), Some(4), "{out:?}");
    let script = "trap '' TERM; sleep 60 & echo $!; wait";
    let family = cli_ignoring_sigchld(&server, &run_args("reaped", &[], script));
    let (out, stopped) = broken_under(&client, "reaped", printing(family).await).await;
    assert_eq!(out.status.code(), Some(75), "{out:?}");
    assert!(stopped, "the command's background job runs on without the lock");
}

/// SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2 and the other signals that end a process
/// by default (SIGALRM, SIGXCPU, the real-time signals, ...) sent to `latchkey run`
/// reach the command (in a group of its own, out of the terminal's reach), which ends
/// as it chooses; latchkey then exits with its code. SIGINT was dropped (the command
/// never heard of it), and SIGHUP and SIGQUIT ended latchkey at once, as SIGUSR1 and
/// SIGUSR2 did, and SIGALRM, SIGXCPU, SIGABRT and the real-time signals until later (the lock
/// released under a running command, which the parent-death signal then killed without
/// a grace, the rest of its group not at all). With `--foreground`, those no terminal
/// sends are passed on too, and SIGINT and SIGQUIT when latchkey is not in its
/// terminal's foreground (here, in a process group of its own): they came to it alone,
/// and were dropped. (By number, sent with kill(1): nix's `Signal` knows no real-time
/// signal.)
#[tokio::test]
async fn signals_to_latchkey_reach_the_command() {
    let (_redis, server, client) = start().await;
    let (first_real_time, last_passed) = (nix::libc::SIGRTMIN(), nix::libc::SIGRTMAX() - 1);
    // Nothing of the group may outlive the shell: it would hold the output pipe open.
    let script = format!(
        "trap 'exit 7' INT HUP QUIT USR1 USR2 ALRM XCPU ABRT {first_real_time} {last_passed}; \
         echo started; while :; do sleep 0.05; done"
    );
    let cases: [(i32, &[&str]); 14] = [
        (Signal::SIGALRM as i32, &[]),
        (Signal::SIGABRT as i32, &[]),
        (Signal::SIGXCPU as i32, &["--foreground"]),
        (first_real_time, &[]),
        (last_passed, &["--foreground"]),
        (Signal::SIGINT as i32, &[]),
        (Signal::SIGHUP as i32, &[]),
        (Signal::SIGQUIT as i32, &[]),
        (Signal::SIGUSR1 as i32, &[]),
        (Signal::SIGUSR2 as i32, &[]),
        (Signal::SIGUSR1 as i32, &["--foreground"]),
        (Signal::SIGUSR2 as i32, &["--foreground"]),
        (Signal::SIGINT as i32, &["--foreground"]),
        (Signal::SIGQUIT as i32, &["--foreground"]),
    ];
    for (signal, extra) in cases {
        // Out of any terminal's foreground, should the tests run in one.
        let mut command = cli_at(&server.endpoint(), &run_args("signalled", extra, &script));
        command.process_group(0);
        let (running, first) = printing(command).await;
        assert_eq!(first, "started");
        let latchkey = running.id().expect("latchkey runs").to_string();
        let sent = std::process::Command::new("kill")
            .args([format!("-{signal}"), latchkey])
            .status()
            .expect("run kill");
        assert!(sent.success(), "signal {signal} sent to latchkey");
        let out = tokio::time::timeout(TIMEOUT, running.wait_with_output())
            .await
            .expect("ended in time")
            .expect("latchkey output");
        assert_eq!(out.status.code(), Some(7), "signal {signal}: {out:?}");
        let state = client.describe("signalled").await.expect("describe");
        assert!(!state.locked, "signal {signal}: released after the command exited");
    }
}

/// A window's resize (SIGWINCH) reaches a command in a group of its own: the terminal
/// sends it to its foreground group, latchkey's, where the command is not, and a
/// full-screen program under `latchkey run` kept drawing at its old size.
#[tokio::test]
async fn a_resize_reaches_a_command_in_a_group_of_its_own() {
    let (_redis, server, _client) = start().await;
    let script = "trap 'exit 7' WINCH; echo started; while :; do sleep 0.05; done";
    let mut command = cli_at(&server.endpoint(), &run_args("resized", &[], script));
    command.process_group(0);
    let (running, first) = printing(command).await;
    assert_eq!(first, "started");
    let latchkey = running.id().expect("latchkey runs");
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(latchkey as i32), Signal::SIGWINCH).expect("SIGWINCH sent");
    let out = tokio::time::timeout(TIMEOUT, running.wait_with_output())
        .await
        .expect("ended in time")
        .expect("latchkey output");
    assert_eq!(out.status.code(), Some(7), "{out:?}");
}

/// A resize leaves a command group that was stopped on purpose (`kill -STOP`) stopped:
/// it asks nothing to end, and the SIGCONT that follows a signal passed on (so that a
/// group the terminal stopped hears a SIGTERM) resumed a paused job at a terminal's
/// resize or a tmux reattach.
#[tokio::test]
async fn a_resize_leaves_a_stopped_command_stopped() {
    let (_redis, server, _client) = start().await;
    // A process that handles resizes keeps one sent while it is stopped pending; one
    // process, forking nothing (a shell stopped while it forks never reads as stopped).
    let script = "exec perl -e '$| = 1; $SIG{WINCH} = sub {}; print \"$$\\n\"; sleep 30 while 1'";
    let mut command = cli_at(&server.endpoint(), &run_args("paused", &[], script));
    command.process_group(0);
    let (running, first) = printing(command).await;
    let command: i32 = first.parse().expect("the command's pid");
    let _group = KillGroup(command);
    nix::sys::signal::killpg(nix::unistd::Pid::from_raw(command), Signal::SIGSTOP).expect("SIGSTOP");
    wait_state(command, "stopped", |s| s == Some('T')).await;
    let latchkey = nix::unistd::Pid::from_raw(running.id().expect("latchkey runs") as i32);
    nix::sys::signal::kill(latchkey, Signal::SIGWINCH).expect("SIGWINCH sent");
    // Passed on (pending), or the group resumed.
    let heard = || pending(command, Signal::SIGWINCH) || state(command) != Some('T');
    assert!(
        latchkey_tests::poll_until(TIMEOUT, heard).await,
        "the resize never reached the command"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(state(command), Some('T'), "the resize resumed the stopped command");
    nix::sys::signal::kill(latchkey, Signal::SIGTERM).expect("SIGTERM to latchkey");
    tokio::time::timeout(TIMEOUT, running.wait_with_output())
        .await
        .expect("ended in time")
        .expect("latchkey output");
}

/// Whether `signal` is pending for process `pid` (sent to it or to its group).
fn pending(pid: i32, signal: Signal) -> bool {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let bit = 1u64 << (signal as i32 - 1);
    status
        .lines()
        .filter_map(|l| l.strip_prefix("ShdPnd:").or_else(|| l.strip_prefix("SigPnd:")))
        .any(|mask| u64::from_str_radix(mask.trim(), 16).is_ok_and(|m| m & bit != 0))
}

/// A signal passed on that ends the command's own process (a wrapper shell running a
/// service without `exec`) while the rest of its group runs on has that rest stopped
/// (SIGTERM, then the grace) before the release. The lock was released at once, the
/// service running on without it while another could take it.
#[tokio::test]
async fn a_signal_that_ends_a_wrapper_stops_the_rest_of_its_group_first() {
    use std::os::unix::process::ExitStatusExt;
    let (_redis, server, client) = start().await;
    // The service takes 0.3 s to shut down on SIGTERM.
    let service = "trap 'sleep 0.3; exit 0' TERM";
    let (ended, group) = wrapper_signalled(&server, "wrapped", service, "5s").await;
    assert_eq!(ended.signal(), Some(Signal::SIGUSR1 as i32));
    let running_on = group_states(group.0).into_iter().filter(|s| *s != 'Z').count();
    assert_eq!(running_on, 0, "the service outlived latchkey's release");
    let state = client.describe("wrapped").await.expect("describe");
    assert!(!state.locked, "released once the group ended");
}

/// As above with no grace (`--grace 0s`): the rest of the group is killed at once
/// before the release. The exit counted as the signal's only within the grace, none
/// here, and the lock was released under the service.
#[tokio::test]
async fn a_signal_that_ends_a_wrapper_without_a_grace_kills_the_rest_of_its_group_first() {
    let (_redis, server, client) = start().await;
    let (_, group) = wrapper_signalled(&server, "no-grace", "trap 'sleep 30' TERM", "0s").await;
    let running_on = group_states(group.0).into_iter().filter(|s| *s != 'Z').count();
    assert_eq!(running_on, 0, "the service outlived latchkey's release");
    let state = client.describe("no-grace").await.expect("describe");
    assert!(!state.locked, "released once the group ended");
}

/// A stop ends once every process of the command's group has ended, zombies aside: a
/// process whose parent does not reap it (latchkey as a container's PID 1 adopts the
/// group's orphans; here the test, made their subreaper) held the stop, and the
/// release, for the whole grace.
#[tokio::test]
async fn a_stop_does_not_wait_for_the_groups_zombies() {
    let (_redis, server, client) = start().await;
    // The wrapper's orphan, the service, comes to this test, which reaps nothing.
    nix::sys::prctl::set_child_subreaper(true).expect("made a subreaper");
    let (_, group) = wrapper_signalled(&server, "zombie", "trap 'exit 0' TERM", "5s").await;
    assert_eq!(group_states(group.0), vec!['Z'], "the service ended, unreaped");
    let state = client.describe("zombie").await.expect("describe");
    assert!(!state.locked, "released");
}

/// Runs `latchkey run <name> --grace <grace>` on a wrapper shell that starts a service (a
/// shell that ignores SIGUSR1 and sets the trap `on_term`) without `exec`, sends
/// latchkey SIGUSR1, which the wrapper dies of, and waits for latchkey's end, which
/// must come well within the grace (the service was told to stop, not left to it):
/// latchkey's status and the service's group.
async fn wrapper_signalled(
    server: &LatchkeyProcess,
    name: &str,
    on_term: &str,
    grace: &str,
) -> (std::process::ExitStatus, KillGroup) {
    let service = format!("trap '' USR1; {on_term}; echo $$; while :; do sleep 0.05; done");
    let script = format!("sh -c \"{service}\"; echo never");
    let args = ["run", name, "--grace", grace, "--", "sh", "-c", &script];
    let (mut running, pid) = printing(cli(server, &args)).await;
    let service = nix::unistd::Pid::from_raw(pid.parse().expect("the service's pid"));
    let group = KillGroup(
        nix::unistd::getpgid(Some(service))
            .expect("the service's group")
            .as_raw(),
    );
    let latchkey = nix::unistd::Pid::from_raw(running.id().expect("latchkey runs") as i32);
    let signalled = std::time::Instant::now();
    nix::sys::signal::kill(latchkey, Signal::SIGUSR1).expect("SIGUSR1 to latchkey");
    let ended = tokio::time::timeout(TIMEOUT, running.wait())
        .await
        .expect("ended in time");
    let within = signalled.elapsed() < Duration::from_secs(4);
    assert!(
        within,
        "latchkey ended after {:?}, not within the grace",
        signalled.elapsed()
    );
    (ended.expect("latchkey's status"), group)
}

/// What a command leaves running when it exits on its own, past a grace after the
/// last signal passed on (a reload's SIGUSR1), and past a second, is left alone.
#[tokio::test]
async fn a_command_exiting_long_after_a_signal_leaves_its_group_alone() {
    let (_redis, server, _client) = start().await;
    let script = "trap '' USR1; echo started; sleep 2.5; sleep 30 & echo $!; exit 0";
    let args = ["run", "reloaded", "--grace", "500ms", "--", "sh", "-c", script];
    let mut latchkey = cli(&server, &args).spawn().expect("spawn latchkey");
    let mut lines = tokio::io::BufReader::new(latchkey.stdout.take().expect("stdout")).lines();
    let next = tokio::time::timeout(TIMEOUT, lines.next_line())
        .await
        .expect("a line in time");
    assert_eq!(next.expect("read").as_deref(), Some("started"));
    let pid = nix::unistd::Pid::from_raw(latchkey.id().expect("latchkey runs") as i32);
    nix::sys::signal::kill(pid, Signal::SIGUSR1).expect("SIGUSR1 to latchkey");
    let next = tokio::time::timeout(TIMEOUT, lines.next_line())
        .await
        .expect("a line in time");
    let left: i32 = next
        .expect("read")
        .expect("a line")
        .parse()
        .expect("the pid left running");
    let _left = KillGroup(left);
    let ended = tokio::time::timeout(TIMEOUT, latchkey.wait())
        .await
        .expect("ended in time");
    assert_eq!(ended.expect("latchkey's status").code(), Some(0));
    assert_eq!(state(left), Some('S'), "the process left running is left alone");
}

/// `run`'s options come before its command: a mistyped one is a usage error (2) before
/// anything is asked of the server. It was taken for the command's first word: the
/// lock waited for (with no bound), taken, and the command "not found" (127).
#[tokio::test]
async fn an_unknown_option_of_run_is_a_usage_error() {
    let (_redis, server, client) = start().await;
    let out = cli(&server, &["run", "typo", "--wiat", "1s", "--", "true"])
        .output()
        .await
        .expect("latchkey ran");
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("--wiat"), "{out:?}");
    let state = client.describe("typo").await.expect("describe");
    assert_eq!(state.last_fencing_token, 0, "the lock was never taken");
    // A command's own options still reach it, after `--` or not.
    for args in [
        &["run", "ls", "--", "ls", "-d", "/"][..],
        &["run", "ls", "ls", "-d", "/"],
    ] {
        let out = cli(&server, args).output().await.expect("latchkey ran");
        assert_eq!(out.status.code(), Some(0), "{args:?}: {out:?}");
    }
}

/// Options read as their documentation says: a grace of `1y` is at most a year, and an
/// environment variable set but empty counts as unset (`LATCHKEY_CA=` refused every
/// command, as a CA file given with no name).
#[tokio::test]
async fn a_year_of_grace_and_empty_variables_are_taken() {
    let (_redis, server, _client) = start().await;
    let out = cli(&server, &["run", "graceful", "--grace", "1y", "--", "true"])
        .output()
        .await
        .expect("latchkey ran");
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let mut describe = cli(&server, &["describe", "graceful"]);
    for var in [
        "LATCHKEY_CA",
        "LATCHKEY_CERT",
        "LATCHKEY_KEY",
        "LATCHKEY_TOKEN",
        "LATCHKEY_TOKEN_FILE",
    ] {
        describe.env(var, "");
    }
    let out = describe.output().await.expect("latchkey ran");
    assert_eq!(out.status.code(), Some(0), "{out:?}");
}

/// A command of `latchkey run` that the terminal stopped (SIGTTIN: it read from the
/// terminal while in its background process group, the default without
/// `--foreground`) still hears the SIGTERM (or Ctrl-C) that `latchkey` passes on: the
/// command ends, `latchkey` with it, and the lock is released. The signal passed on is
/// followed by SIGCONT (as coreutils `timeout` does); alone it would stay pending in
/// the stopped group, and `latchkey` would wait for a command that never runs again,
/// holding the lock for good whatever is sent to it short of SIGKILL.
#[tokio::test]
async fn a_signal_passed_on_reaches_a_command_the_terminal_stopped() {
    let (_redis, server, client) = start().await;
    // One process, forking nothing: a shell stopped while it forks (its child stopped
    // before exec) waits uninterruptibly and never reads as stopped.
    let script = "echo $$; exec sleep 30";
    let args = ["run", "stopped/job", "--", "sh", "-c", script];
    let mut latchkey = cli(&server, &args).spawn().expect("spawn latchkey");
    let mut lines = tokio::io::BufReader::new(latchkey.stdout.take().expect("stdout")).lines();
    let command: i32 = tokio::time::timeout(TIMEOUT, lines.next_line())
        .await
        .expect("the command started in time")
        .expect("read")
        .expect("a line")
        .parse()
        .expect("the command's pid");
    let _group = KillGroup(command);
    // What the terminal does to a background group that reads from it.
    nix::sys::signal::killpg(nix::unistd::Pid::from_raw(command), Signal::SIGTTIN).expect("SIGTTIN");
    wait_state(command, "stopped", |s| s == Some('T')).await;
    let pid = nix::unistd::Pid::from_raw(latchkey.id().expect("latchkey runs") as i32);
    nix::sys::signal::kill(pid, Signal::SIGTERM).expect("SIGTERM to latchkey");
    let ended = tokio::time::timeout(Duration::from_secs(5), latchkey.wait()).await;
    let still = client.describe("stopped/job").await.expect("describe");
    assert!(
        ended.is_ok(),
        "latchkey passed SIGTERM on to a stopped command that never got it: it still waits \
         (command state {:?}), holding the lock (locked: {})",
        state(command),
        still.locked
    );
    assert!(!still.locked, "the lock is released once the command ended");
}

/// A signal ignored when latchkey started (`nohup` leaves SIGHUP so, a script its
/// background jobs' SIGINT) stays ignored: latchkey neither ends on it nor passes it on,
/// as the command alone would not. It was listened for and passed on: a `nohup`-ed
/// `latchkey run` had its command killed at logout.
#[tokio::test]
async fn a_signal_ignored_at_start_stays_ignored() {
    let (_redis, server, client) = start().await;
    let latchkey = format!(
        "trap '' HUP; exec {} --server {} run nohup -- sh -c 'echo $$; exec sleep 30'",
        cli_binary().display(),
        server.endpoint()
    );
    let mut shell = Command::new("sh");
    shell
        .env_remove("LATCHKEY_SERVER")
        .args(["-c", &latchkey])
        .stdout(Stdio::piped())
        .kill_on_drop(true);
    let mut child = shell.spawn().expect("spawn latchkey");
    let mut lines = tokio::io::BufReader::new(child.stdout.take().expect("stdout")).lines();
    let command: i32 = tokio::time::timeout(TIMEOUT, lines.next_line())
        .await
        .expect("started in time")
        .expect("read")
        .expect("a line")
        .parse()
        .expect("the command's pid");
    let _group = KillGroup(command);
    let pid = nix::unistd::Pid::from_raw(child.id().expect("latchkey runs") as i32);
    nix::sys::signal::kill(pid, Signal::SIGHUP).expect("SIGHUP");
    // Nothing is to happen: the time a passed-on signal took to end both, and more.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(child.try_wait().expect("latchkey's status").is_none(), "latchkey ended");
    assert!(running(command), "the command was signalled");
    assert!(client.describe("nohup").await.expect("describe").locked, "still held");
    nix::sys::signal::kill(pid, Signal::SIGTERM).expect("SIGTERM");
    tokio::time::timeout(TIMEOUT, child.wait())
        .await
        .expect("ended in time")
        .expect("latchkey's status");
    assert!(!client.describe("nohup").await.expect("describe").locked, "released");
}

/// While a lost lease's command is stopped (SIGTERM, then `--grace`), a SIGINT sent to
/// `latchkey` reaches the command as it did before the lease was lost, and a second one
/// ends the grace: SIGKILL to the group, `latchkey` exits 75 at once. Both were taken
/// and dropped: a command that survived SIGTERM heard nothing more and ran on for the
/// whole grace, whatever the user pressed.
#[tokio::test]
async fn a_second_ctrl_c_during_the_grace_kills_the_command() {
    let (_redis, server, client) = start().await;
    // Survives SIGTERM and SIGINT, saying so; its `sleep` ends on each.
    let script = "trap 'echo terminated' TERM; trap 'echo interrupted' INT; echo $$; \
                  while :; do sleep 0.05; done";
    let args = ["run", "stubborn", "--grace", "60s", "--", "sh", "-c", script];
    let (mut latchkey, group) = Reading::spawn(&server, &args).await;
    let pid = latchkey.pid();
    // Whatever fails, nothing of the command outlives the test.
    let _group = KillGroup(group);
    assert!(client.force_release("stubborn").await.expect("force release"));
    assert_eq!(
        latchkey.next().await.as_deref(),
        Some("terminated"),
        "the lost lease's SIGTERM"
    );
    nix::sys::signal::kill(pid, Signal::SIGINT).expect("SIGINT");
    assert_eq!(
        latchkey.next().await.as_deref(),
        Some("interrupted"),
        "a SIGINT during the grace reaches the command"
    );
    nix::sys::signal::kill(pid, Signal::SIGINT).expect("SIGINT");
    let status = tokio::time::timeout(Duration::from_secs(5), latchkey.child.wait())
        .await
        .expect("a second SIGINT ends the grace at once")
        .expect("waited");
    assert_eq!(status.code(), Some(75), "{status:?}");
    let gone = latchkey_tests::poll_until(Duration::from_secs(3), || group_states(group).is_empty()).await;
    assert!(gone, "the command's group runs on: {:?}", group_states(group));
}

/// A SIGTERM passed on that ends a wrapper shell starts a stop of the rest of its
/// group, and it counts as the stop's first: the next SIGTERM (or SIGINT) ends the grace
/// at once. It took two more, the one that brought the stop not counted.
#[tokio::test]
async fn a_second_sigterm_ends_the_grace_of_a_wrapper_the_first_ended() {
    let (_redis, server, client) = start().await;
    let service = "trap 'echo terminated' TERM; echo $$; while :; do sleep 0.05; done";
    let script = format!("sh -c \"{service}\"; echo never");
    let args = ["run", "wrapped-twice", "--grace", "60s", "--", "sh", "-c", &script];
    // The wrapper's pid (its shell expands `$$`), which leads the service's group.
    let (mut latchkey, wrapper) = Reading::spawn(&server, &args).await;
    let _group = KillGroup(wrapper);
    let pid = latchkey.pid();
    nix::sys::signal::kill(pid, Signal::SIGTERM).expect("SIGTERM");
    assert_eq!(
        latchkey.next().await.as_deref(),
        Some("terminated"),
        "the SIGTERM passed on"
    );
    // Reaped by latchkey, which then stops the rest of the group. (The stop's SIGTERM
    // may reach the service before it ran its trap for the first: one line for both.)
    let reaped = latchkey_tests::poll_until(TIMEOUT, || !Path::new(&format!("/proc/{wrapper}")).exists()).await;
    assert!(reaped, "the wrapper ended");
    nix::sys::signal::kill(pid, Signal::SIGTERM).expect("SIGTERM");
    let ended = tokio::time::timeout(Duration::from_secs(5), latchkey.child.wait()).await;
    assert!(ended.is_ok(), "a second SIGTERM ends the grace at once");
    assert!(
        !client.describe("wrapped-twice").await.expect("describe").locked,
        "released"
    );
}

/// A `latchkey` process whose output is read line by line.
struct Reading {
    child: tokio::process::Child,
    lines: tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
}

impl Reading {
    /// `latchkey <args>` started, and the first line its command printed: a pid.
    async fn spawn(server: &LatchkeyProcess, args: &[&str]) -> (Self, i32) {
        let mut child = cli(server, args).spawn().expect("spawn latchkey");
        let stdout = child.stdout.take().expect("stdout");
        let mut reading = Self {
            child,
            lines: tokio::io::BufReader::new(stdout).lines(),
        };
        let first = reading.next().await.expect("started in time");
        (reading, first.parse().expect("the command's pid"))
    }

    /// The next line of the command's output, waited for up to `TIMEOUT`.
    async fn next(&mut self) -> Option<String> {
        tokio::time::timeout(TIMEOUT, self.lines.next_line())
            .await
            .ok()
            .and_then(|line| line.expect("read the command's output"))
    }

    fn pid(&self) -> Pid {
        Pid::from_raw(self.child.id().expect("latchkey runs") as i32)
    }
}

/// Kills the process group it names when dropped.
struct KillGroup(i32);

impl Drop for KillGroup {
    fn drop(&mut self) {
        let _ = nix::sys::signal::killpg(nix::unistd::Pid::from_raw(self.0), Signal::SIGKILL);
    }
}

/// The command leads a process group of its own; with `--foreground` it stays in
/// latchkey's, where it may read from the terminal.
#[tokio::test]
async fn the_command_has_a_process_group_of_its_own_unless_foreground() {
    let (_redis, server, _client) = start().await;
    let script = "echo $$ $(cut -d' ' -f5 /proc/$$/stat); sleep 60";
    let (mut own, first) = run_printing(&server.endpoint(), "grouped", &[], script).await;
    let ids: Vec<&str> = first.split_whitespace().collect();
    assert_eq!(ids[0], ids[1], "the command leads its group: {first}");
    own.start_kill().expect("SIGKILL latchkey");
    let (mut shared, first) = run_printing(&server.endpoint(), "foreground", &["--foreground"], script).await;
    let ids: Vec<&str> = first.split_whitespace().collect();
    let latchkey = shared.id().expect("latchkey runs");
    let stat = std::fs::read_to_string(format!("/proc/{latchkey}/stat")).expect("latchkey's stat");
    let latchkey_group = stat
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().nth(2));
    assert_eq!(Some(ids[1]), latchkey_group, "in latchkey's group: {first}");
    assert_ne!(ids[0], ids[1], "{first}");
    shared.start_kill().expect("SIGKILL latchkey");
}

/// An `https://` server without `--ca` is checked against the system's CAs (here the
/// test CA, named by `SSL_CERT_FILE`), not refused; a certificate from another CA is
/// refused. TLS settings on a plaintext connection, and a token that cannot be sent,
/// are refused as such. Before, an `https://` target needed `--ca`, `--tls-domain`
/// without TLS was dropped, and a non-ASCII token was called an invalid address.
#[tokio::test]
async fn https_trusts_the_system_cas_and_tls_settings_need_tls() {
    let redis = RedisServer::start();
    let pki = Pki::new("system-cas");
    let cert = pki.server("server");
    let (cert_path, key_path) = (utf8(&cert.cert), utf8(&cert.key));
    let args = ["--tls-cert", &cert_path, "--tls-key", &key_path];
    let server = Latchkey::start_secure(&redis.url(), &args, ConnectOptions::new().ca_pem(pki.ca_pem())).await;
    let target = server.endpoint().to_owned();
    assert!(target.starts_with("https://"), "{target}");
    let describe = |trusted: &Path| {
        let mut command = Command::new(cli_binary());
        command
            .env_remove("LATCHKEY_SERVER")
            .env_remove("LATCHKEY_CA")
            .env("SSL_CERT_FILE", trusted)
            .env_remove("SSL_CERT_DIR")
            .args(["--server", &target, "describe", "system-cas"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        command
    };
    let trusted = output(describe(&pki.ca())).await;
    assert!(trusted.status.success(), "{trusted:?}");
    assert!(stdout(&trusted).contains("system-cas"), "{trusted:?}");
    let other = Pki::new("other-ca");
    let untrusted = output(describe(&other.ca())).await;
    // A certificate that does not verify is no outage: trying again never helps.
    assert_eq!(
        untrusted.status.code(),
        Some(1),
        "a certificate of another CA: {untrusted:?}"
    );

    let plaintext = RedisServer::start();
    let plain = LatchkeyProcess::start(&plaintext.url());
    let named = output(cli(&plain, &["--tls-domain", "latchkey.internal", "describe", "x"])).await;
    let said = String::from_utf8_lossy(&named.stderr).into_owned();
    assert!(
        !named.status.success() && said.contains("server name needs TLS"),
        "{named:?}"
    );

    let token = ConnectOptions::new().token("t\u{f6}k\u{e9}n");
    let refused = Client::connect_with(&plain.endpoint(), &token)
        .await
        .expect_err("a non-ASCII token");
    assert!(
        matches!(&refused, latchkey_client::Error::InvalidOptions(why) if why.contains("token")),
        "{refused}"
    );
    server.stop().await;
}

fn utf8(p: &Path) -> String {
    p.to_str().expect("UTF-8 path").to_owned()
}

/// Breaks the lock `name` under a `latchkey run` whose command printed its background
/// job's pid first: latchkey's output once it ended, and whether the job ended too
/// ([`job_stopped`]).
async fn broken_under(client: &Client, name: &str, run: (tokio::process::Child, String)) -> (Output, bool) {
    let (latchkey, first) = run;
    let started: i32 = first.parse().expect("the background job's pid");
    assert!(client.force_release(name).await.expect("force release"));
    let out = tokio::time::timeout(TIMEOUT, latchkey.wait_with_output())
        .await
        .expect("stopped in time")
        .expect("latchkey output");
    (out, job_stopped(started).await)
}

/// Whether the job `pid` ends within 3 s; one that does not is killed, so that a
/// failing test leaves nothing running.
async fn job_stopped(pid: i32) -> bool {
    let stopped = latchkey_tests::poll_until(Duration::from_secs(3), || !running(pid)).await;
    if !stopped {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), Signal::SIGKILL);
    }
    stopped
}

/// Whether process `pid` runs (a zombie has ended).
fn running(pid: i32) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The state follows the command's name, which is in parentheses.
    let state = stat
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().next());
    matches!(state, Some(s) if s != "Z" && s != "X")
}

/// `latchkey` killed outright (SIGKILL, the OOM killer) cannot release or stop the
/// command; its connection closes, so the server frees the lock for the next holder.
/// The command must not run on without the lock: it is killed with `latchkey`.
#[tokio::test]
async fn a_killed_latchkey_takes_its_command_with_it() {
    let (_redis, server, client) = start().await;
    let args = ["run", "orphaned", "--", "sh", "-c", "echo $$; exec sleep 60"];
    let mut latchkey = cli(&server, &args).spawn().expect("spawn latchkey");
    let mut lines = tokio::io::BufReader::new(latchkey.stdout.take().expect("stdout")).lines();
    let line = tokio::time::timeout(TIMEOUT, lines.next_line())
        .await
        .expect("started in time");
    let command: i32 = line.expect("read").expect("a line").parse().expect("the command's pid");
    latchkey.start_kill().expect("SIGKILL latchkey");
    latchkey.wait().await.expect("reaped");
    let next = tokio::time::timeout(TIMEOUT, client.lock("orphaned").acquire()).await;
    let lease = next.expect("the lock is freed in time").expect("acquired");
    let stopped = latchkey_tests::poll_until(Duration::from_secs(3), || !running(command)).await;
    if !stopped {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(command), nix::sys::signal::Signal::SIGKILL);
    }
    assert!(stopped, "the command runs on while another client holds its lock");
    lease.release().await.expect("released");
}

/// The state letter of process `pid` (`T` stopped, `S` sleeping, ...), if it exists.
fn state(pid: i32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?.1.split_whitespace().next()?.chars().next()
}

async fn wait_state(pid: i32, what: &str, check: impl Fn(Option<char>) -> bool) {
    let reached = latchkey_tests::poll_until(TIMEOUT, || check(state(pid))).await;
    assert!(reached, "process {pid} never {what} (state {:?})", state(pid));
}

/// The states of the processes in process group `group`.
fn group_states(group: i32) -> Vec<char> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let stat = |pid: &str| std::fs::read_to_string(format!("/proc/{pid}/stat")).ok();
    entries
        .filter_map(|entry| stat(entry.ok()?.file_name().to_str()?))
        .filter_map(|stat| {
            let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
            (fields.get(2)?.parse::<i32>().ok()? == group).then_some(fields[0].chars().next()?)
        })
        .collect()
}

/// Whether no process of `group` runs: each is stopped (`T`), a shell waiting in
/// `vfork` for a child stopped before it could exec (`D`), or a child that ended and
/// that its stopped shell has not reaped (`Z`).
fn group_stopped(group: i32) -> bool {
    let states = group_states(group);
    states.contains(&'T') && states.iter().all(|s| matches!(s, 'T' | 'D' | 'Z'))
}

/// `latchkey run` in a group of its own; the command writes the time to `beat`, prints
/// its pid, then writes the time to `beat` again until the file `done` exists.
async fn run_beating(endpoint: &str, name: &str, extra: &[&str], dir: &Path) -> (tokio::process::Child, i32) {
    let script = format!(
        "date +%s%N > {beat}; echo $$; while [ ! -e {done} ]; do date +%s%N > {beat}; sleep 0.05; done",
        done = dir.join("done").display(),
        beat = dir.join("beat").display(),
    );
    let (latchkey, first) = run_printing(endpoint, name, extra, &script).await;
    (latchkey, first.parse().expect("the command's pid"))
}

/// Sends Ctrl-Z (SIGTSTP) to `latchkey` and waits until it and the command's group are
/// stopped; killed (and the test failed) if the group runs on.
async fn ctrl_z(latchkey: i32, command: i32) {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(latchkey), Signal::SIGTSTP).expect("SIGTSTP");
    wait_state(latchkey, "stopped", |s| s == Some('T')).await;
    let stopped = latchkey_tests::poll_until(Duration::from_secs(3), || group_stopped(command)).await;
    if !stopped {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(latchkey), Signal::SIGKILL);
    }
    assert!(
        stopped,
        "the command runs on while latchkey is stopped: {:?}",
        group_states(command)
    );
}

/// Resumes a stopped `latchkey` whose lease was lost meanwhile (`fg`): it must exit 75
/// saying so, the command stopped without having run again.
async fn fg_after_a_lost_lease(latchkey: tokio::process::Child, command: i32, dir: &Path) -> String {
    let pid = latchkey.id().expect("latchkey runs") as i32;
    let beat = std::fs::read_to_string(dir.join("beat")).expect("the beat");
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), Signal::SIGCONT).expect("SIGCONT");
    let out = tokio::time::timeout(TIMEOUT, latchkey.wait_with_output())
        .await
        .expect("ended in time")
        .expect("latchkey output");
    assert_eq!(out.status.code(), Some(75), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(stderr.contains("lost lock"), "{out:?}");
    assert!(
        latchkey_tests::poll_until(TIMEOUT, || !running(command)).await,
        "the command ended"
    );
    let after = std::fs::read_to_string(dir.join("beat")).expect("the beat");
    assert_eq!(beat, after, "the command ran again after the lease was lost");
    stderr
}

/// A server that gives up on a client answering no ping within 2 s.
fn with_a_short_keepalive() -> (RedisServer, LatchkeyProcess) {
    let redis = RedisServer::start();
    let flags = ["--keepalive-interval", "1s", "--keepalive-timeout", "1s"];
    let mut args = vec!["--redis-url".to_owned(), redis.url()];
    args.extend(flags.iter().map(|f| f.to_string()));
    let server = LatchkeyProcess::spawn(&args);
    (redis, server)
}

/// Ctrl-Z (SIGTSTP) reaches `latchkey` alone, the command being out of the terminal's
/// foreground group. It stopped `latchkey` and left the command running; stopped,
/// `latchkey` answered no keepalive, the server released the lock, and the command ran
/// on while another client held it. Now the command's group is stopped with `latchkey`,
/// and on SIGCONT a lease lost meanwhile stops it (75) without letting it run again.
#[tokio::test]
async fn ctrl_z_stops_the_command_and_a_lease_lost_meanwhile_ends_it() {
    let (_redis, server) = with_a_short_keepalive();
    let client = Client::connect(&server.endpoint()).await.expect("connect");
    let dir = tempfile::tempdir().unwrap();
    let (latchkey, command) = run_beating(&server.endpoint(), "suspended", &[], dir.path()).await;
    ctrl_z(latchkey.id().expect("latchkey runs") as i32, command).await;
    // The server's keepalive gives up on the stopped latchkey; the lock goes to another.
    let lease = tokio::time::timeout(TIMEOUT, client.lock("suspended").acquire())
        .await
        .expect("the lock is freed in time")
        .expect("acquired");
    assert!(
        group_stopped(command),
        "the command stays stopped: {:?}",
        group_states(command)
    );
    fg_after_a_lost_lease(latchkey, command, dir.path()).await;
    lease.release().await.expect("released");
}

/// Ctrl-Z, then the server out of reach without a word (a host gone, a network dropping
/// every packet): the server's keepalive gives the lock to another, and on `fg` the
/// Describe that would tell gets no answer, nor has the lease's stream heard of an end.
/// `latchkey` took the silence for "held" and resumed the command beside the new holder
/// until its keepalive found the connection dead. Now the command stays stopped until
/// the keepalive has had its say, and a dead connection ends it unresumed.
#[tokio::test]
async fn fg_with_the_server_out_of_reach_waits_for_the_keepalive_unresumed() {
    let (_redis, server) = with_a_short_keepalive();
    let proxy = Proxy::start(&format!("127.0.0.1:{}", server.port())).await;
    let client = Client::connect(&server.endpoint()).await.expect("connect");
    let dir = tempfile::tempdir().unwrap();
    let (latchkey, command) = run_beating(&proxy.endpoint(), "unreachable", &[], dir.path()).await;
    ctrl_z(latchkey.id().expect("latchkey runs") as i32, command).await;
    proxy.freeze();
    let lease = tokio::time::timeout(TIMEOUT, client.lock("unreachable").acquire())
        .await
        .expect("the lock is freed in time")
        .expect("acquired");
    let stderr = fg_after_a_lost_lease(latchkey, command, dir.path()).await;
    assert!(stderr.contains("connection to the server broke"), "{stderr}");
    lease.release().await.expect("released");
}

/// Ctrl-Z while `latchkey run` is still queued stops it the default way (its handler
/// comes with the command). The grant made meanwhile waited in its socket; the lock was
/// then lost (deleted in Redis, as a failover that lost it would) and taken by another.
/// On `fg` latchkey read the old grant and started the command beside the new holder.
/// Now a resume during the wait has the server asked first: the command never starts.
#[tokio::test]
async fn fg_after_a_grant_lost_while_stopped_in_the_queue_starts_no_command() {
    use tokio::io::AsyncReadExt;
    let (redis, server, client) = start().await;
    let dir = tempfile::tempdir().unwrap();
    let ran = dir.path().join("ran");
    let holder = client.lock("stopped-in-line").acquire().await.expect("held");
    let script = format!("touch {}", ran.display());
    let mut latchkey = cli(&server, &["run", "stopped-in-line", "--", "sh", "-c", &script])
        .spawn()
        .expect("spawn latchkey");
    let pid = latchkey.id().expect("latchkey runs") as i32;
    let mut stderr = tokio::io::BufReader::new(latchkey.stderr.take().expect("stderr"));
    let mut first = String::new();
    tokio::time::timeout(TIMEOUT, stderr.read_line(&mut first))
        .await
        .expect("queued in time")
        .expect("read stderr");
    assert!(first.contains("waiting for lock"), "{first}");
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), Signal::SIGTSTP).expect("SIGTSTP");
    wait_state(pid, "stopped", |s| s == Some('T')).await;
    let holder_owner = holder.owner().to_owned();
    holder.release().await.expect("released");
    // Granted to the stopped latchkey, then lost in Redis and taken by another.
    let granted = latchkey_tests::poll_until(TIMEOUT, || {
        let hash = redis.cli(&["HKEYS", "stopped-in-line"]);
        !hash.trim().is_empty() && !hash.contains(&holder_owner)
    })
    .await;
    assert!(granted, "the stopped latchkey is granted the lock");
    assert_eq!(redis.cli(&["DEL", "stopped-in-line"]).trim(), "1");
    let lease = client
        .lock("stopped-in-line")
        .wait(Duration::ZERO)
        .acquire()
        .await
        .expect("the deleted lock is free");
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), Signal::SIGCONT).expect("SIGCONT");
    let status = tokio::time::timeout(TIMEOUT, latchkey.wait())
        .await
        .expect("ended in time")
        .expect("latchkey's status");
    let mut rest = String::new();
    stderr.read_to_string(&mut rest).await.expect("read stderr");
    assert_eq!(status.code(), Some(75), "{status:?}: {rest}");
    assert!(rest.contains("was not started"), "{rest}");
    assert!(!ran.exists(), "the command ran beside the new holder");
    lease.release().await.expect("released");
}

/// A `latchkey run` of a beating command on `name` (with `extra` flags), stopped by
/// Ctrl-Z, whose lock is then deleted in Redis, as a failover that lost it would: the
/// stopped `latchkey` and its command, for a test to take the lock and `fg`.
async fn stopped_and_lost(
    redis: &RedisServer,
    server: &LatchkeyProcess,
    name: &str,
    extra: &[&str],
    dir: &Path,
) -> (tokio::process::Child, i32) {
    let (latchkey, command) = run_beating(&server.endpoint(), name, extra, dir).await;
    ctrl_z(latchkey.id().expect("latchkey runs") as i32, command).await;
    assert_eq!(redis.cli(&["DEL", name]).trim(), "1");
    (latchkey, command)
}

/// A lock lost in Redis while `latchkey` was stopped, its connection alive (the key
/// deleted, as a failover that lost it would, and taken by another): on `fg` the lease's
/// stream has heard nothing yet (the watchdog finds out at its next renewal), and
/// `latchkey` resumed the command beside the new holder. Now the server's answer on
/// resuming decides: the lock's holders do not include the lease, the command is
/// stopped. (The same check closes a race with the keepalive's end: a Describe answered
/// on a new connection before the lease's stream read the old one's end.)
#[tokio::test]
async fn fg_after_the_lock_was_lost_in_redis_stops_the_command() {
    let (redis, server, client) = start().await;
    let dir = tempfile::tempdir().unwrap();
    let (latchkey, command) = stopped_and_lost(&redis, &server, "failed-over", &[], dir.path()).await;
    let lease = tokio::time::timeout(TIMEOUT, client.lock("failed-over").wait(Duration::ZERO).acquire())
        .await
        .expect("acquired in time")
        .expect("the deleted lock is free");
    let stderr = fg_after_a_lost_lease(latchkey, command, dir.path()).await;
    assert!(stderr.contains("no longer held"), "{stderr}");
    let state = client.describe("failed-over").await.expect("describe");
    assert_eq!(state.holders.len(), 1, "the new holder keeps the lock: {state:?}");
    assert_eq!(state.holders[0].owner, lease.owner());
    lease.release().await.expect("released");
}

/// The same, the lock then taken by an owner whose name ends as the lease's does
/// (`team/w1` beside `--owner w1`, auth off, where owners are not scoped): it read as
/// the lease's own owner under an identity, and `latchkey` resumed the command beside
/// it until the next renewal told the lease lost.
#[tokio::test]
async fn fg_after_the_lock_went_to_an_owner_named_alike_stops_the_command() {
    let (redis, server, client) = start().await;
    let dir = tempfile::tempdir().unwrap();
    let owner = ["--owner", "w1"];
    let (latchkey, command) = stopped_and_lost(&redis, &server, "named-alike", &owner, dir.path()).await;
    let alike = client.lock("named-alike").owner("team/w1").wait(Duration::ZERO);
    let lease = tokio::time::timeout(TIMEOUT, alike.acquire())
        .await
        .expect("acquired in time")
        .expect("the deleted lock is free");
    let stderr = fg_after_a_lost_lease(latchkey, command, dir.path()).await;
    assert!(stderr.contains("no longer held"), "{stderr}");
    lease.release().await.expect("released");
}

/// A write lock lost in Redis while `latchkey` was stopped, then read by the same named
/// owner from elsewhere: the lock lists the owner among its readers, which read as
/// "held", and `latchkey` resumed the command as the only writer beside other readers.
/// Now a write lease is held only while the lock is in write mode.
#[tokio::test]
async fn fg_after_a_write_lost_while_its_owner_reads_elsewhere_stops_the_command() {
    let (redis, server, client) = start().await;
    let dir = tempfile::tempdir().unwrap();
    let writer = ["--kind", "write", "--owner", "w1"];
    let (latchkey, command) = stopped_and_lost(&redis, &server, "rewritten", &writer, dir.path()).await;
    let read = client.lock("rewritten").kind(LockKind::Read).owner("w1");
    let reader = tokio::time::timeout(TIMEOUT, read.wait(Duration::ZERO).acquire())
        .await
        .expect("acquired in time")
        .expect("the deleted lock is free to read");
    let stderr = fg_after_a_lost_lease(latchkey, command, dir.path()).await;
    assert!(stderr.contains("no longer held"), "{stderr}");
    reader.release().await.expect("released");
}

/// Ctrl-Z then `fg` while the lease holds: the command is stopped and resumed with
/// `latchkey`, and runs to its end under the lock, whatever the kind (the server's
/// answer on resuming names the lease's owner among every kind's holders).
#[tokio::test]
async fn ctrl_z_and_fg_stop_and_resume_the_command_under_the_lock() {
    let (_redis, server, client) = start().await;
    let kinds: [&[&str]; 4] = [
        &[],
        &["--kind", "fair"],
        &["--kind", "read"],
        &["--kind", "semaphore", "--limit", "2"],
    ];
    for extra in kinds {
        let name = format!("paused{}", extra.join(""));
        let dir = tempfile::tempdir().unwrap();
        let (latchkey, command) = run_beating(&server.endpoint(), &name, extra, dir.path()).await;
        let pid = nix::unistd::Pid::from_raw(latchkey.id().expect("latchkey runs") as i32);
        ctrl_z(pid.as_raw(), command).await;
        nix::sys::signal::kill(pid, Signal::SIGCONT).expect("SIGCONT");
        let resumed = latchkey_tests::poll_until(TIMEOUT, || !group_states(command).contains(&'T')).await;
        assert!(resumed, "{extra:?}: not resumed: {:?}", group_states(command));
        let beat = std::fs::read_to_string(dir.path().join("beat")).expect("the beat");
        let beating = latchkey_tests::poll_until(TIMEOUT, || {
            std::fs::read_to_string(dir.path().join("beat")).is_ok_and(|now| now != beat)
        })
        .await;
        assert!(beating, "{extra:?}: the command runs again");
        assert!(client.describe(name.as_str()).await.expect("describe").locked);
        std::fs::write(dir.path().join("done"), b"").unwrap();
        let out = tokio::time::timeout(TIMEOUT, latchkey.wait_with_output())
            .await
            .expect("ended in time")
            .expect("latchkey output");
        assert_eq!(out.status.code(), Some(0), "{extra:?}: {out:?}");
        let state = client.describe(name.as_str()).await.expect("describe");
        assert!(!state.locked, "{extra:?}: released");
    }
}

/// Under auth, Ctrl-Z then `fg` after another stream of the lease's owner reentered
/// the lock (as a nested `latchkey run --owner "$LATCHKEY_OWNER"` does) resumes the
/// command under the lock. The server lists the owner scoped by the caller's identity
/// (`alice/w1`), and the reentry drew a later token: the lease, held still, read as
/// lost, and the command was stopped (75).
#[tokio::test]
async fn ctrl_z_and_fg_resume_a_lease_its_owner_reentered_under_auth() {
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let auth = dir.path().join("auth.toml");
    let identity = "[[identity]]\nname = \"alice\"\ntokens = [\"alice-token\"]\nprefixes = [\"\"]\n";
    std::fs::write(&auth, identity).unwrap();
    let args = ["--redis-url", &redis.url(), "--auth-file", auth.to_str().unwrap()].map(String::from);
    let server = LatchkeyProcess::spawn(&args);
    let metrics = server.metrics_port().expect("metrics");
    let options = ConnectOptions::new().token("alice-token");
    let client = Client::connect_with(&server.endpoint(), &options)
        .await
        .expect("connect");
    let extra = ["--token", "alice-token", "--owner", "w1"];
    let (latchkey, command) = run_beating(&server.endpoint(), "nested", &extra, dir.path()).await;
    // latchkey has heard how the server lists its holder (one Describe answered).
    let described = || {
        let scrape = latchkey_tests::scrape_metrics(metrics);
        scrape.lines().any(|l| {
            l.starts_with("latchkey_rpc_handled_total{") && l.contains("method=\"Describe\"") && !l.ends_with(" 0")
        })
    };
    assert!(latchkey_tests::poll_until(TIMEOUT, described).await, "latchkey asked");
    let nested = client.lock("nested").owner("w1").acquire().await.expect("reentered");
    assert_eq!(nested.hold_count(), 2);
    nested.release().await.expect("released");
    let pid = nix::unistd::Pid::from_raw(latchkey.id().expect("latchkey runs") as i32);
    ctrl_z(pid.as_raw(), command).await;
    nix::sys::signal::kill(pid, Signal::SIGCONT).expect("SIGCONT");
    let resumed = latchkey_tests::poll_until(TIMEOUT, || !group_states(command).contains(&'T')).await;
    assert!(resumed, "not resumed: {:?}", group_states(command));
    std::fs::write(dir.path().join("done"), b"").unwrap();
    let out = tokio::time::timeout(TIMEOUT, latchkey.wait_with_output())
        .await
        .expect("ended in time")
        .expect("latchkey output");
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    assert!(!client.describe("nested").await.expect("describe").locked, "released");
}

/// A stderr whose reader has gone (`latchkey run ... 2>&1 | logger`, the logger dead).
fn broken_stderr() -> Stdio {
    let (reader, writer) = std::io::pipe().expect("a pipe");
    drop(reader);
    Stdio::from(writer)
}

/// A lease lost while stderr's reader has gone: the report panicked (EPIPE) before the
/// command was stopped, so `latchkey` exited 101 and what the command started ran on
/// without the lock. Now the group is stopped first and a failed report is ignored.
#[tokio::test]
async fn a_lost_lease_stops_the_command_though_stderr_is_gone() {
    let (_redis, server, client) = start().await;
    let script = "sleep 60 & echo $!; wait";
    let mut command = cli(&server, &["run", "epipe", "--grace", "1s", "--", "sh", "-c", script]);
    command.stderr(broken_stderr());
    let mut latchkey = command.spawn().expect("spawn latchkey");
    let mut lines = tokio::io::BufReader::new(latchkey.stdout.take().expect("stdout")).lines();
    let line = tokio::time::timeout(TIMEOUT, lines.next_line())
        .await
        .expect("started in time");
    let started: i32 = line.expect("read").expect("a line").parse().expect("a pid");
    assert!(client.force_release("epipe").await.expect("force release"));
    let status = tokio::time::timeout(TIMEOUT, latchkey.wait())
        .await
        .expect("ended in time")
        .expect("waited");
    let stopped = job_stopped(started).await;
    assert_eq!(status.code(), Some(75), "{status:?}");
    assert!(stopped, "the command's background job runs on without the lock");
}

/// A queued `run` reports that it waits on stderr; with stderr's reader gone that
/// panicked and `latchkey` exited 101 instead of waiting and running the command.
#[tokio::test]
async fn a_queued_run_with_stderr_gone_still_waits_and_runs() {
    let (_redis, server, client) = start().await;
    // A fair lock, whose queue Describe shows.
    let held = client.lock("queued").kind(latchkey_client::LockKind::Fair).acquire();
    let held = held.await.expect("acquired");
    let args = ["run", "queued", "--kind", "fair", "--", "sh", "-c", "exit 5"];
    let mut command = cli(&server, &args);
    command.stderr(broken_stderr());
    let mut latchkey = command.spawn().expect("spawn latchkey");
    let waiting = tokio::time::timeout(TIMEOUT, async {
        loop {
            if let Some(status) = latchkey.try_wait().expect("latchkey's status") {
                panic!("latchkey ended before its turn: {status:?}");
            }
            if !client.describe("queued").await.expect("describe").waiters.is_empty() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    waiting.expect("latchkey queued in time");
    held.release().await.expect("released");
    let status = tokio::time::timeout(TIMEOUT, latchkey.wait())
        .await
        .expect("ended in time")
        .expect("waited");
    assert_eq!(status.code(), Some(5), "{status:?}");
}

/// A server that dies under a wait or a stream: the call fails as `UNAVAILABLE`, as
/// when the server cannot be reached (tonic reports the broken connection as
/// `UNKNOWN`), and the CLI exits 69, not 1.
#[tokio::test]
async fn a_server_that_dies_under_a_call_is_unavailable() {
    let (_redis, mut server, client) = start().await;
    let _held = client.lock("dying").acquire().await.expect("acquired");
    let (queued, is_queued) = tokio::sync::oneshot::channel();
    let mut queued = Some(queued);
    let waiter = client.lock("dying").on_queued(move |_| {
        if let Some(queued) = queued.take() {
            let _ = queued.send(());
        }
    });
    let waiting = tokio::spawn(waiter.acquire());
    let mut watch = client.watch("dying").await.expect("watch");
    watch.next().await.expect("the first state").expect("a state");
    let mut run = cli(&server, &["run", "dying", "--", "true"])
        .spawn()
        .expect("spawn latchkey run");
    let mut said = tokio::io::BufReader::new(run.stderr.take().expect("stderr")).lines();
    let mut watching = cli(&server, &["watch", "dying"]).spawn().expect("spawn latchkey watch");
    let mut printed = tokio::io::BufReader::new(watching.stdout.take().expect("stdout")).lines();
    let line = tokio::time::timeout(TIMEOUT, said.next_line())
        .await
        .expect("run queued in time");
    assert!(line.expect("read").is_some_and(|l| l.contains("waiting")));
    let line = tokio::time::timeout(TIMEOUT, printed.next_line())
        .await
        .expect("watch printed");
    assert!(line.expect("read").is_some());
    tokio::time::timeout(TIMEOUT, is_queued)
        .await
        .expect("queued in time")
        .expect("queued");

    server.kill();
    let waited = tokio::time::timeout(TIMEOUT, waiting)
        .await
        .expect("the wait ended in time");
    let err = waited.expect("joined").expect_err("the server died");
    assert!(err.is_unavailable(), "a wait: {err} ({:?}): {err:?}", err.code());
    let err = tokio::time::timeout(TIMEOUT, watch.next())
        .await
        .expect("the watch ended in time")
        .expect_err("the server died");
    assert!(err.is_unavailable(), "a watch: {err} ({:?})", err.code());
    for (what, child) in [("run", &mut run), ("watch", &mut watching)] {
        let status = tokio::time::timeout(TIMEOUT, child.wait())
            .await
            .expect("latchkey ended in time")
            .expect("waited");
        assert_eq!(status.code(), Some(69), "latchkey {what}");
    }
}

/// A release the server does not answer (frozen) fails after `RELEASE_TIMEOUT`, and
/// not as a lock wait that ran out: `is_timeout()` was true for it.
#[tokio::test]
async fn a_release_with_no_answer_is_not_a_wait_timeout() {
    let redis = RedisServer::start();
    let mut server = LatchkeyProcess::start(&redis.url());
    // No keepalive verdict before the release gives up.
    let options = ConnectOptions::new().keepalive(Duration::from_secs(60), Duration::from_secs(60));
    let client = Client::connect_with(&server.endpoint(), &options)
        .await
        .expect("connect");
    let lease = client.lock("unanswered").acquire().await.expect("acquired");
    server.freeze();
    let released = tokio::time::timeout(TIMEOUT, lease.release()).await;
    server.resume();
    let err = released.expect("the release gave up in time").expect_err("no answer");
    assert!(
        !err.is_timeout(),
        "an unconfirmed release read as a wait that ran out: {err}"
    );
    assert!(
        matches!(err, latchkey_client::Error::ReleaseUnconfirmed { .. }),
        "{err:?}"
    );
    assert_eq!(err.code(), tonic::Code::DeadlineExceeded, "{err}");
}

/// The CLI's bearer token comes from `--token`, `--token-file` or their environment
/// variables; one given on the command line wins over the other's variable (an
/// exported `LATCHKEY_TOKEN` with `--token-file` was a usage error, and `latchkey run`
/// ran nothing), and two given in one place are a usage error (exit 2).
#[tokio::test]
async fn the_token_on_the_command_line_wins_over_the_other_variable() {
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let auth = dir.path().join("auth.toml");
    std::fs::write(
        &auth,
        "[[identity]]\nname = \"alice\"\ntokens = [\"alice-token\"]\nprefixes = [\"alice/\"]\n",
    )
    .unwrap();
    let args = ["--auth-file", auth.to_str().unwrap()];
    let server = Latchkey::start_secure(&redis.url(), &args, ConnectOptions::new().token("alice-token")).await;
    let (good, stale) = (dir.path().join("good"), dir.path().join("stale"));
    std::fs::write(&good, "alice-token\n").unwrap();
    std::fs::write(&stale, "stale-token\n").unwrap();
    let (good, stale) = (good.to_str().unwrap(), stale.to_str().unwrap());
    let describe = |env: &[(&str, &str)], flags: &[&str]| {
        let mut command = Command::new(cli_binary());
        command
            .env_remove("LATCHKEY_SERVER")
            .env_remove("LATCHKEY_TOKEN")
            .env_remove("LATCHKEY_TOKEN_FILE")
            .envs(env.iter().copied())
            .args(["--server", server.endpoint()])
            .args(flags)
            .args(["describe", "alice/a"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        output(command)
    };
    /// Environment, flags, and the exit code.
    type Case<'a> = (&'a [(&'a str, &'a str)], &'a [&'a str], i32);
    let cases: [Case; 6] = [
        (&[], &["--token", "alice-token"], 0),
        (&[("LATCHKEY_TOKEN_FILE", good)], &[], 0),
        (&[("LATCHKEY_TOKEN", "stale-token")], &["--token-file", good], 0),
        (&[("LATCHKEY_TOKEN_FILE", stale)], &["--token", "alice-token"], 0),
        (&[], &["--token", "alice-token", "--token-file", good], 2),
        (
            &[("LATCHKEY_TOKEN", "alice-token"), ("LATCHKEY_TOKEN_FILE", good)],
            &[],
            2,
        ),
    ];
    for (env, flags, code) in cases {
        let out = describe(env, flags).await;
        assert_eq!(
            out.status.code(),
            Some(code),
            "{env:?} {flags:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let refused = describe(&[("LATCHKEY_TOKEN", "alice-token")], &["--token", "stale-token"]).await;
    assert!(!refused.status.success(), "the flag's stale token is sent");
    assert!(String::from_utf8_lossy(&refused.stderr).contains("not valid"));
}
