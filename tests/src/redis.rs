//! `RedisServer`: one real `redis-server` process on a free loopback port, in its own
//! temporary directory, killed on Drop.

use crate::process::{self, WaitError, ADDRESS_IN_USE, DEFAULT_START_TIMEOUT};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use tempfile::TempDir;

/// The variable that names another `redis-server` for every Redis the tests start
/// (`tests/run` runs part of the suite again on Redis 6.2 so); `redis-server` on the
/// `PATH` without it.
pub const REDIS_SERVER_ENV: &str = "LATCHKEY_TEST_REDIS_SERVER";

/// `args` as the `redis-server` the tests start takes them: Redis 6.2 has no
/// `--enable-debug-command` (`DEBUG` is always allowed there), and refuses to start
/// with it.
fn understood(args: &[String]) -> Vec<&String> {
    static REDIS_6: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let redis_6 = *REDIS_6.get_or_init(|| {
        let version = Command::new(redis_server())
            .arg("--version")
            .output()
            .expect("redis-server --version");
        String::from_utf8_lossy(&version.stdout).contains(" v=6.")
    });
    let mut kept = Vec::with_capacity(args.len());
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--enable-debug-command" if redis_6 => drop(args.next()),
            _ => kept.push(arg),
        }
    }
    kept
}

/// The `redis-server` the tests start (Debian's `redis-server` package, or the one
/// [`REDIS_SERVER_ENV`] names).
pub fn redis_server() -> std::ffi::OsString {
    std::env::var_os(REDIS_SERVER_ENV).unwrap_or_else(|| "redis-server".into())
}

/// The `redis-cli` binary the harness runs.
pub const REDIS_CLI: &str = "redis-cli";

/// TLS for Redis servers (standalone, sentinel, cluster): each serves this
/// certificate on a TLS port of its own, next to its plain port (which the harness
/// keeps using for its own checks).
#[derive(Debug, Clone)]
pub struct RedisTls {
    /// Server certificate (PEM) for 127.0.0.1.
    pub cert: PathBuf,
    /// Its key (PEM).
    pub key: PathBuf,
    /// The CA that signed it (PEM).
    pub ca: PathBuf,
}

impl RedisTls {
    /// The `redis-server` flags that serve this certificate (clients need none).
    pub fn args(&self) -> Vec<String> {
        let path = |p: &PathBuf| p.to_str().expect("UTF-8 path").to_owned();
        vec![
            "--tls-cert-file".into(),
            path(&self.cert),
            "--tls-key-file".into(),
            path(&self.key),
            "--tls-ca-cert-file".into(),
            path(&self.ca),
            "--tls-auth-clients".into(),
            "no".into(),
        ]
    }

    /// The sentinel configuration lines that serve TLS on `tls_port` and watch the
    /// master over TLS.
    pub(crate) fn conf(&self, tls_port: u16) -> String {
        format!(
            "tls-port {tls_port}\ntls-cert-file {}\ntls-key-file {}\ntls-ca-cert-file {}\n\
             tls-auth-clients no\ntls-replication yes\n",
            self.cert.display(),
            self.key.display(),
            self.ca.display()
        )
    }
}

/// A running `redis-server` on 127.0.0.1 with no persistence (`--save ""`,
/// `--appendonly no`), so a restart comes back empty. Drop kills it.
#[derive(Debug)]
pub struct RedisServer {
    port: u16,
    extra_args: Vec<String>,
    password: Option<String>,
    log: PathBuf,
    /// Where the running process's lines begin in `log` (it is appended to on restart).
    log_start: u64,
    child: Option<Child>,
    // Dropped last so the process is gone before its directory is removed.
    dir: TempDir,
}

/// What `redis-server` logs once it listens; the harness waits for its own process's.
const READY_LINE: &str = "Ready to accept connections";

impl RedisServer {
    /// Starts a standalone `redis-server` and waits until it answers `PING`.
    pub fn start() -> RedisServer {
        RedisServer::start_with(&[])
    }

    /// Starts a `redis-server` with extra configuration appended to the command line,
    /// one argument per element (e.g. `&["--requirepass", "secret"]` or
    /// `&["--replicaof", "127.0.0.1", "6379"]`), and waits until its log says it listens
    /// and it answers (on another port when another process took this one meanwhile).
    pub fn start_with(args: &[&str]) -> RedisServer {
        let mut server = RedisServer::unstarted(args);
        let started = process::on_free_ports(
            &mut server,
            |s| s.start_on(process::free_port()),
            |s| s.log_contains(ADDRESS_IN_USE),
        );
        if let Err(err) = started {
            server.fail(err, "start");
        }
        server
    }

    /// Like [`RedisServer::start_with`], with the arguments made afresh for each
    /// attempt, so that ports of their own (a cluster bus port, a TLS port) are picked
    /// again along with the main one when another process took one of them meanwhile.
    /// [`RedisServer::arg`] reads back what the started process was given.
    pub fn start_with_fresh(mut args: impl FnMut() -> Vec<String>) -> RedisServer {
        let mut server = RedisServer::unstarted(&[]);
        let started = process::on_free_ports(
            &mut server,
            |s| {
                s.set_args(&args());
                s.start_on(process::free_port())
            },
            |s| s.log_contains(ADDRESS_IN_USE),
        );
        if let Err(err) = started {
            server.fail(err, "start");
        }
        server
    }

    /// The value that follows `flag` on its command line (e.g. its `--tls-port`).
    pub fn arg(&self, flag: &str) -> Option<&str> {
        let at = self.extra_args.iter().position(|a| a == flag)?;
        self.extra_args.get(at + 1).map(String::as_str)
    }

    /// The TLS port it was started with (`--tls-port`), if any.
    pub fn tls_port(&self) -> Option<u16> {
        self.arg("--tls-port")
            .map(|p| p.parse().expect("a TLS port is a number"))
    }

    /// Starts a `redis-server` with `args` on `port` and no other, for tests of the
    /// harness itself: `Err(Exited)` when it could not listen there, whoever answers on
    /// that port.
    pub fn try_start_on(port: u16, args: &[&str]) -> Result<RedisServer, WaitError> {
        let mut server = RedisServer::unstarted(args);
        server.start_on(port).map(|()| server)
    }

    fn unstarted(args: &[&str]) -> RedisServer {
        let dir = tempfile::Builder::new()
            .prefix("latchkey-redis-")
            .tempdir()
            .expect("create a temp dir for redis-server");
        let mut server = RedisServer {
            port: 0,
            extra_args: Vec::new(),
            password: None,
            log: dir.path().join("redis.log"),
            log_start: 0,
            child: None,
            dir,
        };
        server.set_args(&args.iter().map(|a| (*a).to_owned()).collect::<Vec<_>>());
        server
    }

    /// Takes `args` for its next start, and the `--requirepass` among them.
    fn set_args(&mut self, args: &[String]) {
        self.extra_args = args.to_vec();
        self.password = self.arg("--requirepass").map(str::to_owned);
    }

    /// Starts it on `port`, after reaping a process that exited.
    fn start_on(&mut self, port: u16) -> Result<(), WaitError> {
        self.stop();
        self.port = port;
        self.spawn();
        self.wait_ready()
    }

    /// `redis://127.0.0.1:PORT` (no credentials; see [`RedisServer::password`]).
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// `redis://:PASSWORD@127.0.0.1:PORT` when started with `--requirepass`, else
    /// the same as [`RedisServer::url`].
    pub fn url_with_password(&self) -> String {
        match &self.password {
            Some(password) => format!("redis://:{password}@127.0.0.1:{}", self.port),
            None => self.url(),
        }
    }

    /// The TCP port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The `--requirepass` value it was started with, if any.
    pub fn password(&self) -> Option<&str> {
        self.password.as_deref()
    }

    /// The process id, or `None` while stopped.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Freezes the process (SIGSTOP): it neither answers nor acts, its connections
    /// open, until [`RedisServer::resume`]. Returns once it is stopped.
    pub fn freeze(&self) {
        crate::process::stop_process(self.pid().expect("redis-server is running"));
    }

    /// Lets a frozen process run again (SIGCONT).
    pub fn resume(&self) {
        self.signal(nix::sys::signal::Signal::SIGCONT);
    }

    fn signal(&self, signal: nix::sys::signal::Signal) {
        let pid = self.pid().expect("redis-server is running");
        let pid = nix::unistd::Pid::from_raw(i32::try_from(pid).expect("pid fits i32"));
        nix::sys::signal::kill(pid, signal).unwrap_or_else(|err| panic!("send {signal} to redis-server {pid}: {err}"));
    }

    /// True while the process runs.
    pub fn is_running(&mut self) -> bool {
        self.child.as_mut().is_some_and(process::is_running)
    }

    /// The temporary working directory (`--dir`).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The file that receives the server's stdout and stderr.
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// The last lines of the server's log.
    pub fn log_tail(&self) -> String {
        process::log_tail(&self.log)
    }

    /// Kills the server with SIGKILL and reaps it; does nothing when already stopped.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            process::kill_and_reap(&mut child);
        }
    }

    /// Starts the server again on the same port and configuration (empty, as nothing is
    /// persisted) and waits until it answers; stops it first if it is running.
    pub fn restart(&mut self) {
        if let Err(err) = self.start_on(self.port) {
            self.fail(err, "restart");
        }
    }

    /// Runs `redis-cli` against this server with `args` and returns its output.
    pub fn cli(&self, args: &[&str]) -> String {
        process::redis_cli(self.port, self.password.as_deref(), args)
    }

    /// How many clients this server counts on `channel` (`PUBSUB NUMSUB`).
    pub fn subscribers(&self, channel: &str) -> u32 {
        self.counted("NUMSUB", channel)
    }

    /// How many clients this node counts on the sharded `channel` (`PUBSUB
    /// SHARDNUMSUB`; 0 on a node that does not serve its slot).
    pub fn shard_subscribers(&self, channel: &str) -> u32 {
        self.counted("SHARDNUMSUB", channel)
    }

    fn counted(&self, numsub: &str, channel: &str) -> u32 {
        let out = self.cli(&["PUBSUB", numsub, channel]);
        out.lines().nth(1).and_then(|l| l.trim().parse().ok()).unwrap_or(0)
    }

    /// This server's clock (`TIME`) in ms, the clock its scripts' deadlines follow.
    pub fn now_ms(&self) -> i64 {
        let out = self.cli(&["TIME"]);
        let mut parts = out
            .split_whitespace()
            .map(|p| p.parse::<i64>().expect("TIME answers numbers"));
        let (secs, micros) = (parts.next().expect("seconds"), parts.next().expect("microseconds"));
        secs * 1000 + micros / 1000
    }

    /// A standalone server and a replica of it, once the replica is online (bounded by
    /// 10 s).
    pub async fn with_replica() -> (RedisServer, RedisServer) {
        let primary = RedisServer::start();
        let port = primary.port().to_string();
        let replica = RedisServer::start_with(&["--replicaof", "127.0.0.1", &port]);
        let online = process::poll_until(std::time::Duration::from_secs(10), || {
            primary.cli(&["INFO", "replication"]).contains("state=online")
        })
        .await;
        assert!(online, "the replica never connected");
        (primary, replica)
    }

    /// The entries of the list `key`, in order.
    pub fn list(&self, key: &str) -> Vec<String> {
        self.cli(&["LRANGE", key, "0", "-1"])
            .split_whitespace()
            .map(str::to_owned)
            .collect()
    }

    /// The score of `member` in the sorted set `key` (a fair waiter's deadline in ms);
    /// panics when it has none.
    pub fn score(&self, key: &str, member: &str) -> i64 {
        self.cli(&["ZSCORE", key, member])
            .trim()
            .parse::<f64>()
            .unwrap_or_else(|_| panic!("{member} has a score in {key}")) as i64
    }

    /// EVALSHA commands this server has run so far: scripts, batches counting once.
    pub fn evalsha_calls(&self) -> usize {
        self.command_calls("evalsha")
    }

    /// Calls of `command` (lower case) this server was sent so far, run or refused
    /// (`INFO commandstats`).
    pub fn command_calls_sent(&self, command: &str) -> usize {
        self.command_stat(command).map_or(0, |s| (s.calls + s.refused) as usize)
    }

    /// Calls of `command` (lower case) this server has run so far (`INFO commandstats`).
    pub fn command_calls(&self, command: &str) -> usize {
        self.command_stat(command).map_or(0, |s| s.calls as usize)
    }

    fn command_stat(&self, command: &str) -> Option<CommandStat> {
        self.command_stats().into_iter().find(|s| s.command == command)
    }

    /// Every command this server has run since its counters were reset (`INFO
    /// commandstats`; the scripts' own calls counted under their commands).
    pub fn command_stats(&self) -> Vec<CommandStat> {
        parse_command_stats(&self.cli(&["INFO", "commandstats"]))
    }

    fn spawn(&mut self) {
        let port = self.port.to_string();
        let dir = self.dir.path().to_str().expect("temp dir path is UTF-8").to_owned();
        let mut command = Command::new(redis_server());
        command
            .args(["--port", &port, "--bind", "127.0.0.1", "--daemonize", "no"])
            .args(["--save", "", "--appendonly", "no", "--dir", &dir, "--logfile", ""])
            .args(understood(&self.extra_args))
            .current_dir(self.dir.path());
        self.log_start = process::log_len(&self.log);
        self.child = Some(process::spawn_logged(&mut command, &self.log));
    }

    /// Waits until this process says it listens and the port answers: another test's
    /// Redis may answer on a port this one failed to bind.
    fn wait_ready(&mut self) -> Result<(), WaitError> {
        let (port, log, start) = (self.port, &self.log, self.log_start);
        let child = self.child.as_mut().expect("spawned before waiting");
        process::wait_until(
            DEFAULT_START_TIMEOUT,
            || process::is_running(child),
            || process::log_has_since(log, start, READY_LINE) && process::redis_answers(port),
        )
    }

    /// Whether the running process (the last spawned) logged `needle`.
    fn log_contains(&self, needle: &str) -> bool {
        process::log_has_since(&self.log, self.log_start, needle)
    }

    fn fail(&mut self, err: WaitError, what: &str) -> ! {
        self.stop();
        panic!(
            "redis-server {what} on 127.0.0.1:{} failed ({err:?} within {:?}); log {}:\n{}",
            self.port,
            DEFAULT_START_TIMEOUT,
            self.log.display(),
            self.log_tail()
        );
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// One line of `INFO commandstats`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommandStat {
    /// The command, lower case (`config|resetstat` for a subcommand).
    pub command: String,
    /// Times it ran.
    pub calls: u64,
    /// Microseconds it took in all.
    pub usec: u64,
    /// Times it was refused before it ran (`NOREPLICAS`, `OOM`, an ACL), or failed
    /// while it ran (`rejected_calls` and `failed_calls`, 0 before Redis 6.2).
    pub refused: u64,
}

/// The commands of an `INFO commandstats` reply.
pub fn parse_command_stats(info: &str) -> Vec<CommandStat> {
    info.lines()
        .filter_map(|l| l.strip_prefix("cmdstat_"))
        .filter_map(|l| {
            let (command, rest) = l.split_once(':')?;
            let field = |key: &str| rest.split(',').find_map(|f| f.strip_prefix(key))?.trim().parse().ok();
            Some(CommandStat {
                command: command.to_owned(),
                calls: field("calls=")?,
                usec: field("usec=")?,
                refused: field("rejected_calls=").unwrap_or(0) + field("failed_calls=").unwrap_or(0),
            })
        })
        .collect()
}

/// The value of `name:` in an INFO-style reply.
pub fn info_field<'a>(info: &'a str, name: &str) -> Option<&'a str> {
    info.lines()
        .find_map(|line| line.trim().strip_prefix(name)?.strip_prefix(':'))
        .map(str::trim)
}
