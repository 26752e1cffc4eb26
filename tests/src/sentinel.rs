//! `RedisSentinel`: a master plus one `redis-server --sentinel` monitoring it as
//! `mymaster`, for the `redis-sentinel://` deployment.

use crate::process::{self, redis_cli, WaitError, DEFAULT_START_TIMEOUT};
use crate::redis::{redis_server, RedisServer, RedisTls};
use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::Duration;
use tempfile::TempDir;

/// The service name the sentinel monitors the master under.
pub const SENTINEL_SERVICE_NAME: &str = "mymaster";

/// A standalone master watched by one sentinel (quorum 1). Drop kills both.
#[derive(Debug)]
pub struct RedisSentinel {
    sentinel_port: u16,
    /// The sentinel's TLS port, when started with [`RedisSentinel::start_secure`].
    tls_port: Option<u16>,
    log: PathBuf,
    child: Option<Child>,
    master: RedisServer,
    // Dropped last so the process is gone before its directory is removed.
    dir: TempDir,
}

impl RedisSentinel {
    /// Starts a master and a sentinel monitoring it, and waits until the sentinel
    /// reports the master's address for `mymaster`.
    pub fn start() -> RedisSentinel {
        Self::start_secure(None, None)
    }

    /// Like [`RedisSentinel::start`], with the master behind `password` (the sentinel
    /// gets it as `auth-pass`; the sentinel itself has none) and, with `tls`, TLS
    /// ports on both that the sentinel uses to watch the master.
    pub fn start_secure(tls: Option<&RedisTls>, password: Option<&str>) -> RedisSentinel {
        let master = RedisServer::start_with_fresh(|| {
            let mut args: Vec<String> = Vec::new();
            if let Some(tls) = tls {
                args.extend(["--tls-port".to_owned(), process::free_port().to_string()]);
                args.extend(tls.args());
            }
            if let Some(password) = password {
                args.extend(["--requirepass".to_owned(), password.to_owned()]);
            }
            args
        });
        let master_tls_port = master.tls_port();
        let monitored_port = master_tls_port.unwrap_or(master.port());
        let mut extra = String::new();
        let tls_port = tls.map(|tls| {
            let port = process::free_port();
            extra.push_str(&tls.conf(port));
            port
        });
        if let Some(password) = password {
            extra.push_str(&format!("sentinel auth-pass {SENTINEL_SERVICE_NAME} {password}\n"));
        }
        let timing = (Duration::from_secs(2), Duration::from_secs(10));
        Self::monitoring(master, monitored_port, tls_port, timing, &extra)
    }

    /// A sentinel watching `master` (already started, with its replicas if any), that
    /// holds it down after `down_after` without an answer and gives a failover
    /// `failover_timeout`.
    pub fn watching(master: RedisServer, down_after: Duration, failover_timeout: Duration) -> RedisSentinel {
        let port = master.port();
        Self::monitoring(master, port, None, (down_after, failover_timeout), "")
    }

    /// Starts the sentinel of `master` (reached on `monitored_port`) with `extra`
    /// settings, and waits until it reports the master's address.
    fn monitoring(
        master: RedisServer,
        monitored_port: u16,
        tls_port: Option<u16>,
        (down_after, failover_timeout): (Duration, Duration),
        extra: &str,
    ) -> RedisSentinel {
        let dir = tempfile::Builder::new()
            .prefix("latchkey-sentinel-")
            .tempdir()
            .expect("create a temp dir for redis-sentinel");
        let config = dir.path().join("sentinel.conf");
        let sentinel_port = process::free_port();
        let conf = format!(
            "port {sentinel_port}\nbind 127.0.0.1\ndir {}\n\
             sentinel monitor {SENTINEL_SERVICE_NAME} 127.0.0.1 {} 1\n\
             sentinel down-after-milliseconds {SENTINEL_SERVICE_NAME} {}\n\
             sentinel failover-timeout {SENTINEL_SERVICE_NAME} {}\n{extra}",
            dir.path().display(),
            monitored_port,
            down_after.as_millis(),
            failover_timeout.as_millis(),
        );
        // The sentinel rewrites its config file, so it must be a writable file of its own.
        std::fs::write(&config, conf).expect("write sentinel.conf");
        let log = dir.path().join("sentinel.log");
        let mut command = Command::new(redis_server());
        command.arg(&config).arg("--sentinel").current_dir(dir.path());
        let child = process::spawn_logged(&mut command, &log);
        let mut sentinel = RedisSentinel {
            sentinel_port,
            tls_port,
            log,
            child: Some(child),
            master,
            dir,
        };
        let expected_port = monitored_port.to_string();
        let child = sentinel.child.as_mut().expect("just spawned");
        let ready = process::wait_until(
            DEFAULT_START_TIMEOUT,
            || process::is_running(child),
            || {
                process::redis_answers(sentinel_port)
                    && redis_cli(
                        sentinel_port,
                        None,
                        &["SENTINEL", "get-master-addr-by-name", SENTINEL_SERVICE_NAME],
                    )
                    .lines()
                    .any(|line| line.trim() == expected_port)
            },
        );
        if let Err(err) = ready {
            sentinel.fail(err);
        }
        sentinel
    }

    /// `redis-sentinel://127.0.0.1:SPORT?sentinelServiceName=mymaster`.
    pub fn url(&self) -> String {
        format!(
            "redis-sentinel://127.0.0.1:{}?sentinelServiceName={SENTINEL_SERVICE_NAME}",
            self.sentinel_port
        )
    }

    /// `rediss-sentinel://[:PASSWORD@]127.0.0.1:TLSPORT?sentinelServiceName=mymaster`
    /// when started with TLS.
    pub fn tls_url(&self, password: Option<&str>) -> Option<String> {
        let auth = password.map(|p| format!(":{p}@")).unwrap_or_default();
        self.tls_port
            .map(|port| format!("rediss-sentinel://{auth}127.0.0.1:{port}?sentinelServiceName={SENTINEL_SERVICE_NAME}"))
    }

    /// The port of the master the sentinel names now.
    pub fn master_port(&self) -> Option<u16> {
        let args = ["SENTINEL", "get-master-addr-by-name", SENTINEL_SERVICE_NAME];
        let out = redis_cli(self.sentinel_port, None, &args);
        out.lines().nth(1).and_then(|l| l.trim().parse().ok())
    }

    /// The sentinel's port.
    pub fn sentinel_port(&self) -> u16 {
        self.sentinel_port
    }

    /// The monitored master.
    pub fn master(&mut self) -> &mut RedisServer {
        &mut self.master
    }

    /// The sentinel's process id, or `None` once killed.
    pub fn sentinel_pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The sentinel's temporary directory (config file and log).
    pub fn dir(&self) -> &std::path::Path {
        self.dir.path()
    }

    /// The last lines of the sentinel's log.
    pub fn log_tail(&self) -> String {
        process::log_tail(&self.log)
    }

    /// Kills the sentinel (SIGKILL); the master keeps running.
    pub fn kill_sentinel(&mut self) {
        if let Some(mut child) = self.child.take() {
            process::kill_and_reap(&mut child);
        }
    }

    fn fail(&mut self, err: WaitError) -> ! {
        self.kill_sentinel();
        panic!(
            "redis sentinel on 127.0.0.1:{} failed to start ({err:?} within {DEFAULT_START_TIMEOUT:?}); \
             log {}:\n{}",
            self.sentinel_port,
            self.log.display(),
            self.log_tail()
        );
    }
}

impl Drop for RedisSentinel {
    fn drop(&mut self) {
        self.kill_sentinel();
    }
}
