//! Shared plumbing for the child processes of the harness: free loopback ports, log
//! files, bounded waits and raw-socket readiness probes.

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use std::fs::File;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// How long a freshly spawned process may take to answer before the harness gives up.
pub const DEFAULT_START_TIMEOUT: Duration = Duration::from_secs(10);

/// Interval between readiness probes.
pub const POLL_INTERVAL: Duration = Duration::from_millis(25);

/// Attempts at free ports before the harness gives up on starting a server: another
/// process may take a port between [`free_port`] and the server binding it.
const PORT_ATTEMPTS: usize = 3;

/// What a server whose port was taken meanwhile logs (Redis and latchkey alike).
pub const ADDRESS_IN_USE: &str = "Address already in use";

/// Lines of a process log quoted in a panic message.
const LOG_TAIL_LINES: usize = 40;

/// The lowest port handed out by [`free_port`].
const PORTS_FROM: u16 = 10_000;

/// Returns a port on 127.0.0.1 that was free a moment ago, picked at random below the
/// kernel's ephemeral range (the ports outgoing connections take as their own): a
/// Redis stopped and restarted on its port would otherwise, now and then, find it
/// taken by a connection some process opened meanwhile. Binds port 0 when that range
/// leaves no room below it.
pub fn free_port() -> u16 {
    let below = ephemeral_start();
    if below > PORTS_FROM + 1_000 {
        for _ in 0..100 {
            let port = fastrand::u16(PORTS_FROM..below);
            if TcpListener::bind(("127.0.0.1", port)).is_ok() {
                return port;
            }
        }
    }
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0 to find a free port");
    listener.local_addr().expect("local_addr of a bound listener").port()
}

/// The first port of the kernel's ephemeral range (Linux's default when unreadable).
fn ephemeral_start() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768)
}

/// The last lines of a log file, or a note saying why it could not be read.
pub fn log_tail(path: &Path) -> String {
    match std::fs::read(path) {
        Ok(bytes) => {
            let text = String::from_utf8_lossy(&bytes);
            let lines: Vec<&str> = text.lines().collect();
            let start = lines.len().saturating_sub(LOG_TAIL_LINES);
            lines[start..].join("\n")
        }
        Err(err) => format!("<cannot read {}: {err}>", path.display()),
    }
}

/// The length of a log file now (0 before it exists): where the lines of a process
/// spawned next begin, for [`log_has_since`].
pub fn log_len(path: &Path) -> u64 {
    std::fs::metadata(path).map_or(0, |m| m.len())
}

/// Whether the log holds `needle` after its first `offset` bytes. A readiness check
/// reads its own process's word this way: a port free a moment ago may have been
/// taken by another test's server, which would answer in its place.
pub fn log_has_since(path: &Path, offset: u64, needle: &str) -> bool {
    std::fs::read(path).is_ok_and(|bytes| {
        let new = bytes.get(offset as usize..).unwrap_or_default();
        String::from_utf8_lossy(new).contains(needle)
    })
}

/// Spawns `command` with stdin closed and stdout and stderr both appended to `log`.
pub fn spawn_logged(command: &mut Command, log: &Path) -> Child {
    let out = File::options()
        .create(true)
        .append(true)
        .open(log)
        .unwrap_or_else(|err| panic!("open log file {}: {err}", log.display()));
    let err = out.try_clone().expect("clone log file handle");
    command
        .stdin(Stdio::null())
        .stdout(Stdio::from(out))
        .stderr(Stdio::from(err))
        .spawn()
        .unwrap_or_else(|err| panic!("spawn {:?}: {err}", command.get_program()))
}

/// Polls `ready` every [`POLL_INTERVAL`] until it returns true or `timeout` passes;
/// returns whether it became ready. `alive` is checked first on each round so a process
/// that died is reported at once instead of after the whole timeout.
pub fn wait_until(
    timeout: Duration,
    mut alive: impl FnMut() -> bool,
    mut ready: impl FnMut() -> bool,
) -> Result<(), WaitError> {
    let deadline = Instant::now() + timeout;
    loop {
        if !alive() {
            return Err(WaitError::Exited);
        }
        if ready() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(WaitError::TimedOut);
        }
        std::thread::sleep(POLL_INTERVAL);
    }
}

/// Polls `ready` every [`POLL_INTERVAL`], without blocking the runtime, until it
/// returns true or `timeout` passes; returns whether it became ready.
pub async fn poll_until(timeout: Duration, mut ready: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if ready() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}

/// Awaits `future` for at most `limit`; panics naming `what` when the time ran out, so
/// a step that never ends fails the test instead of hanging it.
pub async fn bounded<F: std::future::Future>(limit: Duration, what: &str, future: F) -> F::Output {
    tokio::time::timeout(limit, future)
        .await
        .unwrap_or_else(|_| panic!("{what}: no answer within {limit:?}"))
}

/// Starts `server` with `start`, which picks its ports with [`free_port`], until it
/// starts or fails otherwise than by losing a port to another process between the
/// pick and its bind (`lost_port`), at most [`PORT_ATTEMPTS`] times.
pub fn on_free_ports<S>(
    server: &mut S,
    mut start: impl FnMut(&mut S) -> Result<(), WaitError>,
    lost_port: impl Fn(&S) -> bool,
) -> Result<(), WaitError> {
    let mut attempt = 1;
    loop {
        match start(server) {
            Err(WaitError::Exited) if attempt < PORT_ATTEMPTS && lost_port(server) => attempt += 1,
            result => return result,
        }
    }
}

/// Why [`wait_until`] gave up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitError {
    /// The process exited before it became ready.
    Exited,
    /// The time ran out.
    TimedOut,
}

/// Stops process `pid` (SIGSTOP) and returns once every thread of it is stopped: the
/// signal only asks, and a thread running on another core goes on for a moment (long
/// enough, on a busy machine, to read a message the test meant it to miss).
pub fn stop_process(pid: u32) {
    let raw = Pid::from_raw(i32::try_from(pid).expect("pid fits i32"));
    kill(raw, Signal::SIGSTOP).unwrap_or_else(|err| panic!("send SIGSTOP to {pid}: {err}"));
    let stopped = wait_until(Duration::from_secs(5), || true, || all_threads_stopped(pid));
    assert!(stopped.is_ok(), "process {pid} did not stop");
}

/// Whether every thread of `pid` is stopped (state `T` in `/proc/<pid>/task/*/stat`,
/// the field after the parenthesised command name).
fn all_threads_stopped(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks.flatten().all(|task| {
        let stat = std::fs::read_to_string(task.path().join("stat")).unwrap_or_default();
        let state = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.trim_start().chars().next());
        matches!(state, Some('T' | 't'))
    })
}

/// True when `child` is still running (not yet reaped).
pub fn is_running(child: &mut Child) -> bool {
    matches!(child.try_wait(), Ok(None))
}

/// SIGKILLs `child` and reaps it; a child that already exited is only reaped.
pub fn kill_and_reap(child: &mut Child) {
    if is_running(child) {
        // An error here means it exited between the check and the kill: nothing to do.
        let _ = child.kill();
    }
    let _ = child.wait();
}

/// True when something accepts TCP connections on 127.0.0.1:`port`.
pub fn tcp_accepts(port: u16) -> bool {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok()
}

/// Sends one inline command to a Redis on 127.0.0.1:`port` over a raw socket and
/// returns the first reply line (e.g. `+PONG`, `-NOAUTH ...`), or `None` when nothing
/// answered.
pub fn raw_command(port: u16, command: &str) -> Option<String> {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_millis(200)).ok()?;
    stream.set_read_timeout(Some(Duration::from_millis(500))).ok()?;
    stream.write_all(format!("{command}\r\n").as_bytes()).ok()?;
    let mut reply = Vec::new();
    let mut buf = [0u8; 256];
    while !reply.contains(&b'\n') {
        let n = stream.read(&mut buf).ok()?;
        if n == 0 {
            break;
        }
        reply.extend_from_slice(&buf[..n]);
    }
    let text = String::from_utf8_lossy(&reply);
    let line = text.lines().next()?.trim().to_owned();
    (!line.is_empty()).then_some(line)
}

/// True when a Redis on `port` answers commands: `PING` gets `+PONG`, or an
/// authentication error, which proves it is up but wants a password.
pub fn redis_answers(port: u16) -> bool {
    match raw_command(port, "PING") {
        Some(line) => line == "+PONG" || line.starts_with("-NOAUTH") || line.starts_with("-ERR AUTH"),
        None => false,
    }
}

/// How long a command the harness runs (`redis-cli`) may take: one that waits on a
/// frozen or confused server fails the test instead of hanging it.
pub const COMMAND_TIMEOUT: Duration = Duration::from_secs(30);

/// Runs `command` with stdin closed and returns its output, like
/// [`Command::output`]; kills it and panics with what it printed when it is still
/// running after `limit`.
pub fn output_within(command: &mut Command, limit: Duration) -> Output {
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|err| panic!("spawn {:?}: {err}", command.get_program()));
    // Read both pipes meanwhile, so a chatty command never blocks on a full one.
    let read = |mut pipe: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            let _ = pipe.read_to_end(&mut bytes);
            bytes
        })
    };
    let stdout = read(Box::new(child.stdout.take().expect("piped stdout")));
    let stderr = read(Box::new(child.stderr.take().expect("piped stderr")));
    let pid = Pid::from_raw(child.id() as i32);
    let (done, exited) = std::sync::mpsc::channel();
    std::thread::spawn(move || done.send(child.wait()));
    let status = exited.recv_timeout(limit).ok();
    if status.is_none() {
        // Not reaped yet (its waiter still waits), so the pid is still this child's.
        let _ = kill(pid, Signal::SIGKILL);
    }
    let (stdout, stderr) = (
        stdout.join().expect("stdout reader"),
        stderr.join().expect("stderr reader"),
    );
    match status {
        Some(status) => Output {
            status: status.unwrap_or_else(|err| panic!("wait for {:?}: {err}", command.get_program())),
            stdout,
            stderr,
        },
        None => panic!(
            "{command:?} still ran after {limit:?}; it printed:\n{}{}",
            String::from_utf8_lossy(&stdout),
            String::from_utf8_lossy(&stderr)
        ),
    }
}

/// Runs `commands` (each a command's arguments) through one `redis-cli -p port` and
/// returns its replies, one per command: one process for thousands of keys, where
/// [`redis_cli`] costs a process each. For replies of one line (integers, strings
/// without a line break, nil as an empty line).
pub fn redis_cli_each(port: u16, commands: &[Vec<&str>]) -> Vec<String> {
    let mut child = Command::new(crate::redis::REDIS_CLI)
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|err| panic!("spawn redis-cli: {err}"));
    let mut input = String::new();
    for command in commands {
        // Quoted, so a key with a space or a quote stays one argument.
        let quoted: Vec<String> = command.iter().map(|a| format!("{a:?}")).collect();
        input.push_str(&quoted.join(" "));
        input.push('\n');
    }
    let mut stdin = child.stdin.take().expect("piped stdin");
    let writer = std::thread::spawn(move || stdin.write_all(input.as_bytes()));
    let pid = Pid::from_raw(child.id() as i32);
    let (done, finished) = std::sync::mpsc::channel();
    std::thread::spawn(move || done.send(child.wait_with_output()));
    let limit = COMMAND_TIMEOUT + Duration::from_millis(commands.len() as u64);
    let Ok(output) = finished.recv_timeout(limit) else {
        let _ = kill(pid, Signal::SIGKILL);
        panic!(
            "redis-cli -p {port}: {} commands still ran after {limit:?}",
            commands.len()
        );
    };
    let output = output.unwrap_or_else(|err| panic!("redis-cli -p {port}: {err}"));
    let _ = writer.join();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let replies: Vec<String> = stdout.lines().map(str::to_owned).collect();
    assert!(
        output.status.success() && replies.len() == commands.len(),
        "redis-cli -p {port}: {} replies to {} commands ({}): {}",
        replies.len(),
        commands.len(),
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    replies
}

/// The channels subscribed on the Redis at `port`, sharded ones too (Redis 7; Redis 6.2
/// has none, and answers `PUBSUB SHARDCHANNELS` with an error).
pub fn subscribed_channels(port: u16) -> Vec<String> {
    let mut channels = Vec::new();
    for command in ["CHANNELS", "SHARDCHANNELS"] {
        let reply = redis_cli(port, None, &["PUBSUB", command]);
        if !reply.starts_with("ERR Unknown subcommand") {
            channels.extend(reply.lines().filter(|l| !l.is_empty()).map(str::to_owned));
        }
    }
    channels
}

/// Runs `redis-cli -h 127.0.0.1 -p port [-a password] args...` and returns its stdout;
/// panics with stderr when it fails to run or exits non-zero.
pub fn redis_cli(port: u16, password: Option<&str>, args: &[&str]) -> String {
    let mut command = Command::new(crate::redis::REDIS_CLI);
    command.args(["-h", "127.0.0.1", "-p", &port.to_string()]);
    if let Some(password) = password {
        command.args(["-a", password, "--no-auth-warning"]);
    }
    let output = output_within(command.args(args), COMMAND_TIMEOUT);
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "redis-cli -p {port} {args:?} failed ({}): {}{}",
        output.status,
        stdout,
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}
