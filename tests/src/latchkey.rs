//! `LatchkeyProcess`: the real `latchkey-server` binary on free loopback ports, its
//! output captured to a file, killed on Drop.

use crate::process::{self, WaitError, ADDRESS_IN_USE};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus};
use std::time::Duration;
use tempfile::TempDir;

/// The server binary's name in the target directory.
pub const SERVER_BINARY: &str = "latchkey-server";

/// Environment variable that overrides where the server binary is looked for.
pub const SERVER_BINARY_ENV: &str = "LATCHKEY_SERVER_BIN";

/// What the server logs once it listens; the harness waits for its own process's.
const SERVING_LINE: &str = "latchkey serving";

/// Whether `args` hold `flag`, alone or as `flag=value`.
fn has_flag(args: &[String], flag: &str) -> bool {
    args.iter().any(|a| a == flag || a.starts_with(&format!("{flag}=")))
}

/// How long the server may take to accept gRPC connections.
pub const SERVER_START_TIMEOUT: Duration = Duration::from_secs(20);

/// A running `latchkey-server` listening on 127.0.0.1. Drop kills it (SIGKILL).
#[derive(Debug)]
pub struct LatchkeyProcess {
    port: u16,
    metrics_port: Option<u16>,
    args: Vec<String>,
    /// Environment variables set for the server on top of the test's.
    env: Vec<(String, String)>,
    log: PathBuf,
    /// Where the running process's lines begin in `log` (it is appended to on restart).
    log_start: u64,
    child: Option<Child>,
    // Dropped last so the process is gone before its directory is removed.
    dir: TempDir,
}

impl LatchkeyProcess {
    /// Spawns the server against one Redis URL (`--redis-url`).
    pub fn start(redis_url: &str) -> LatchkeyProcess {
        LatchkeyProcess::spawn(&["--redis-url".to_owned(), redis_url.to_owned()])
    }

    /// A server to kill (its leases left in Redis to run out) against `redis_url`, on a
    /// 1.5 s watchdog lease and without metrics, and a client of it once it serves.
    pub async fn to_crash(redis_url: &str) -> (LatchkeyProcess, latchkey_client::Client) {
        let args = [
            "--redis-url".to_owned(),
            redis_url.to_owned(),
            "--no-metrics".to_owned(),
            "--watchdog-timeout".to_owned(),
            "1500ms".to_owned(),
        ];
        let process = LatchkeyProcess::spawn(&args);
        let client = process.serving_client().await;
        (process, client)
    }

    /// Spawns the server with `args` plus `--listen 127.0.0.1:<free port>` and, unless
    /// `args` has `--no-metrics` or `--metrics-listen`, `--metrics-listen
    /// 127.0.0.1:<free port>`; waits until its log says it serves and the gRPC port
    /// accepts TCP connections (on other ports when another process took one meanwhile).
    /// `LATCHKEY_*` variables of the test's environment are not passed on, and
    /// `NO_COLOR=1` is set.
    pub fn spawn(args: &[String]) -> LatchkeyProcess {
        Self::spawn_with_env(args, &[])
    }

    /// [`LatchkeyProcess::spawn`] with extra environment variables (`RUST_LOG`, ...).
    pub fn spawn_with_env(args: &[String], env: &[(&str, &str)]) -> LatchkeyProcess {
        let with_metrics = !has_flag(args, "--no-metrics") && !has_flag(args, "--metrics-listen");
        let mut server = LatchkeyProcess::unstarted(args, env);
        let started = process::on_free_ports(
            &mut server,
            |s| {
                s.port = process::free_port();
                s.metrics_port = with_metrics.then(process::free_port);
                s.try_launch()
            },
            |s| process::log_has_since(&s.log, s.log_start, ADDRESS_IN_USE),
        );
        server.started(started);
        server
    }

    /// Spawns the server with `args` listening on `port` and no other (`args` say
    /// where metrics go, if anywhere), for tests of the harness itself: `Err(Exited)`
    /// when it could not listen there, whoever accepts on that port.
    pub fn try_spawn_on(port: u16, args: &[String]) -> Result<LatchkeyProcess, WaitError> {
        let mut server = LatchkeyProcess::unstarted(args, &[]);
        server.port = port;
        server.try_launch().map(|()| server)
    }

    fn unstarted(args: &[String], env: &[(&str, &str)]) -> LatchkeyProcess {
        let dir = tempfile::Builder::new()
            .prefix("latchkey-server-")
            .tempdir()
            .expect("create a temp dir for latchkey-server");
        LatchkeyProcess {
            port: 0,
            metrics_port: None,
            args: args.to_vec(),
            env: env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            log: dir.path().join("server.log"),
            log_start: 0,
            child: None,
            dir,
        }
    }

    /// Starts the server again with the same flags on the same ports (after a kill or
    /// a SIGTERM; a running one is killed first), appending to the same log.
    pub fn restart(&mut self) {
        let result = self.try_launch();
        self.started(result);
    }

    /// Spawns the server on its ports (a running one is killed first) and waits until
    /// it says it serves and its port accepts connections (another test's server may
    /// accept on a port this one failed to bind).
    fn try_launch(&mut self) -> Result<(), WaitError> {
        self.kill();
        let binary = server_binary();
        let mut command = Command::new(&binary);
        command.arg("--listen").arg(format!("127.0.0.1:{}", self.port));
        if let Some(metrics) = self.metrics_port {
            command.arg("--metrics-listen").arg(format!("127.0.0.1:{metrics}"));
        }
        // Plain log lines, so panic messages quoting the log stay readable.
        command
            .args(&self.args)
            .current_dir(self.dir.path())
            .env("NO_COLOR", "1");
        for (key, _) in std::env::vars_os() {
            if key.to_string_lossy().starts_with("LATCHKEY_") {
                command.env_remove(key);
            }
        }
        command.envs(self.env.iter().map(|(k, v)| (k, v)));
        if let Some(filter) = self.log_filter() {
            command.env("RUST_LOG", filter);
        }
        self.log_start = process::log_len(&self.log);
        let (port, log, start) = (self.port, &self.log, self.log_start);
        let child = self.child.insert(process::spawn_logged(&mut command, log));
        process::wait_until(
            SERVER_START_TIMEOUT,
            || process::is_running(child),
            || process::log_has_since(log, start, SERVING_LINE) && process::tcp_accepts(port),
        )
    }

    /// The server's `RUST_LOG` (the test's own, or the one given), with the line the
    /// harness waits for let through however quiet it is; `None` to keep the server's
    /// default.
    fn log_filter(&self) -> Option<String> {
        let given = self.env.iter().find(|(k, _)| k == "RUST_LOG").map(|(_, v)| v.clone());
        let filter = given.or_else(|| std::env::var("RUST_LOG").ok())?;
        Some(match filter.contains("latchkey_server") {
            true => filter,
            false => format!("{filter},latchkey_server=info"),
        })
    }

    /// Returns once launched; panics with the log's tail when the launch failed.
    fn started(&mut self, result: Result<(), WaitError>) {
        if let Err(err) = result {
            self.kill();
            let why = match err {
                WaitError::Exited => "exited before accepting connections".to_owned(),
                WaitError::TimedOut => {
                    format!("did not accept connections within {SERVER_START_TIMEOUT:?}")
                }
            };
            panic!(
                "{} {:?} on 127.0.0.1:{} {why}; log {}:\n{}",
                server_binary().display(),
                self.args,
                self.port,
                self.log.display(),
                self.log_tail()
            );
        }
    }

    /// The gRPC endpoint, `http://127.0.0.1:PORT`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The gRPC port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// A metric's value now, 0 while it has none; the server must serve metrics.
    pub fn metric(&self, name: &str) -> f64 {
        let port = self.metrics_port.expect("metrics on");
        metric(&scrape_metrics(port), name).unwrap_or(0.0)
    }

    /// The metrics port, unless metrics were turned off or given in the args.
    pub fn metrics_port(&self) -> Option<u16> {
        self.metrics_port
    }

    /// The process id, or `None` once killed or reaped.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The process's resident memory in KiB (`VmRSS`), 0 once it is gone.
    pub fn rss_kib(&self) -> u64 {
        self.status_kib("VmRSS:")
    }

    /// The most resident memory the process has had since it started, in KiB
    /// (`VmHWM`), 0 once it is gone.
    pub fn peak_rss_kib(&self) -> u64 {
        self.status_kib("VmHWM:")
    }

    /// A figure in KiB of the process's `/proc/<pid>/status`.
    fn status_kib(&self, field: &str) -> u64 {
        let Some(pid) = self.pid() else { return 0 };
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        status
            .lines()
            .find_map(|l| l.strip_prefix(field))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    }

    /// Returns once the server has renewed `n` more leases than it had at the call
    /// (`latchkey_watchdog_renewals_total`); panics with the log's tail after `within`.
    pub async fn renewals_reach(&self, n: usize, within: Duration) {
        let renewed = || self.metric("latchkey_watchdog_renewals_total");
        let target = renewed() + n as f64;
        let reached = process::poll_until(within, || renewed() >= target).await;
        assert!(reached, "{n} more renewals within {within:?}:\n{}", self.log_tail());
    }

    /// The temporary working directory of the server.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The file holding the server's stdout and stderr.
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// The whole log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The last lines of the log.
    pub fn log_tail(&self) -> String {
        process::log_tail(&self.log)
    }

    /// A client, once the server grants locks (a probe lock taken and released);
    /// panics with the log's tail after 15 s.
    pub async fn serving_client(&self) -> latchkey_client::Client {
        let deadline = std::time::Instant::now() + Duration::from_secs(15);
        loop {
            if let Ok(c) = latchkey_client::Client::connect(&self.endpoint()).await {
                if let Ok(lease) = c.lock("probe").try_once().acquire().await {
                    lease.release().await.expect("release the probe lock");
                    return c;
                }
            }
            assert!(
                std::time::Instant::now() < deadline,
                "server never served:\n{}",
                self.log_tail()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Kills the server with SIGKILL and reaps it.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            process::kill_and_reap(&mut child);
        }
    }

    /// Sends SIGTERM (graceful shutdown); see [`LatchkeyProcess::wait_exit`].
    pub fn terminate(&mut self) {
        self.signal(Signal::SIGTERM);
    }

    /// Sends SIGINT.
    pub fn interrupt(&mut self) {
        self.signal(Signal::SIGINT);
    }

    /// Sends SIGHUP, as a closed terminal does.
    pub fn hang_up(&mut self) {
        self.signal(Signal::SIGHUP);
    }

    /// Freezes the process (SIGSTOP): it neither answers nor acts until
    /// [`LatchkeyProcess::resume`]. Returns once it is stopped.
    pub fn freeze(&mut self) {
        crate::process::stop_process(self.pid().expect("latchkey-server is running"));
    }

    /// Lets a frozen process run again (SIGCONT).
    pub fn resume(&mut self) {
        self.signal(Signal::SIGCONT);
    }

    /// Waits up to `timeout` for the process to exit and reaps it; `None` when it is
    /// still running (it is left running).
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let child = self.child.as_mut()?;
        let exited = process::wait_until(timeout, || true, || !process::is_running(child));
        if exited.is_err() {
            return None;
        }
        let status = child.wait().expect("reap latchkey-server");
        self.child = None;
        Some(status)
    }

    fn signal(&mut self, signal: Signal) {
        let Some(child) = self.child.as_mut() else {
            panic!("latchkey-server was already killed or reaped");
        };
        if process::is_running(child) {
            let pid = i32::try_from(child.id()).expect("pid fits i32");
            kill(Pid::from_raw(pid), signal)
                .unwrap_or_else(|err| panic!("send {signal} to latchkey-server {pid}: {err}"));
        }
    }
}

impl Drop for LatchkeyProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Where the server binary is: `$LATCHKEY_SERVER_BIN`, else beside the running
/// executable or its `deps/` directory (`target/<profile>/latchkey-server`); panics with
/// the build command when it is missing.
pub fn server_binary() -> PathBuf {
    if let Some(path) = std::env::var_os(SERVER_BINARY_ENV) {
        return PathBuf::from(path);
    }
    let exe = std::env::current_exe().expect("path of the test executable");
    // A binary of this crate lives in target/<profile>/ itself; a test executable in
    // target/<profile>/deps/.
    let beside = exe.parent().map(|dir| dir.join(SERVER_BINARY));
    if let Some(binary) = beside.filter(|b| b.is_file()) {
        return binary;
    }
    // target/<profile>/deps/<test>-<hash> → target/<profile>/latchkey-server
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("test executable lives in target/<profile>/deps");
    let binary = profile_dir.join(SERVER_BINARY);
    assert!(
        binary.is_file(),
        "{} not found; build it first with `cargo build -p latchkey-server` \
         (or set {SERVER_BINARY_ENV})",
        binary.display()
    );
    binary
}

/// The value of the unlabelled metric `name` in a Prometheus scrape.
pub fn metric(scrape: &str, name: &str) -> Option<f64> {
    scrape
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// A server's stream gauges, (streams, leases, waiters, subscriptions), in one scrape
/// (-1 for one it does not show).
pub fn gauges(port: u16) -> [f64; 4] {
    let scrape = scrape_metrics(port);
    let value = |name: &str| metric(&scrape, name).unwrap_or(-1.0);
    [
        value("latchkey_streams_open"),
        value("latchkey_leases_held"),
        value("latchkey_waiters"),
        value("latchkey_pubsub_subscriptions"),
    ]
}

/// The Prometheus text a server serves on `127.0.0.1:port` (`--metrics-listen`); empty
/// when it does not answer within five seconds.
pub fn scrape_metrics(port: u16) -> String {
    http_get(port, "/metrics")
}

/// The whole HTTP/1.1 response (status line, headers, body) to a GET of `path` on
/// `127.0.0.1:port`; empty when nothing answers within five seconds.
pub fn http_get(port: u16, path: &str) -> String {
    use std::io::{Read, Write};
    let Ok(mut stream) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return String::new();
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
    let request = format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
    let mut body = String::new();
    if stream.write_all(request.as_bytes()).is_ok() {
        let _ = stream.read_to_string(&mut body);
    }
    body
}
