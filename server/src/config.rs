//! Configuration: every flag of the server, each with a `LATCHKEY_*` environment
//! twin and a documented default.

use clap::Parser;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// Default gRPC listen address: loopback only, so nothing is exposed by accident.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:50051";
/// Default Redis: a local standalone server.
pub const DEFAULT_REDIS_URL: &str = "redis://127.0.0.1:6379";
/// Default stream-scoped lease, Redisson's `lockWatchdogTimeout`; renewed every third.
pub const DEFAULT_WATCHDOG_TIMEOUT: &str = "30s";
/// Default Prometheus listen address.
pub const DEFAULT_METRICS_LISTEN: &str = "127.0.0.1:9464";
/// Default bound on one Redis command, so no stream hangs on a dead Redis.
pub const DEFAULT_REDIS_TIMEOUT: &str = "2s";
/// Default HTTP/2 keepalive ping interval; with the timeout below a vanished client is
/// noticed within about 20 s.
pub const DEFAULT_KEEPALIVE_INTERVAL: &str = "10s";
/// Default time a keepalive ping may go unanswered.
pub const DEFAULT_KEEPALIVE_TIMEOUT: &str = "10s";
/// Default time a replica acknowledgement may take when `--sync-replicas` is set.
pub const DEFAULT_SYNC_TIMEOUT: &str = "1s";
/// Default time a queued fair waiter stays in the queue without its server refreshing
/// it: a crashed server's waiters block the queue no longer (behind a Redisson waiter,
/// see the README's fair lock).
pub const DEFAULT_FAIR_WAIT_TIMEOUT: &str = "5s";
/// Default bound on concurrent `Acquire` and `Watch` streams per server.
pub const DEFAULT_MAX_STREAMS: usize = 100_000;
/// Default bound on concurrent streams per HTTP/2 connection.
pub const DEFAULT_MAX_STREAMS_PER_CONNECTION: u32 = 10_000;
/// Default bound on waiting Acquire streams per server.
pub const DEFAULT_MAX_WAITERS: usize = 50_000;
/// Default bound on waiting Acquire streams per lock name per server.
pub const DEFAULT_MAX_WAITERS_PER_LOCK: usize = 10_000;
/// Default bound on one decoded gRPC message: far above the largest valid `open`
/// (64 names of 1 KiB), far below what would hurt.
pub const DEFAULT_MAX_MESSAGE_SIZE: usize = 256 * 1024;

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// Command-line and environment configuration of `latchkey-server`.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "latchkey-server",
    version,
    about = "The latchkey lock-coordinator gRPC server"
)]
pub struct Config {
    /// gRPC over TCP on this address (port 0 picks a free one).
    #[arg(long, env = "LATCHKEY_LISTEN", default_value = DEFAULT_LISTEN)]
    pub listen: SocketAddr,

    /// Also serve gRPC on this Unix socket (for sidecars).
    #[arg(long, env = "LATCHKEY_UNIX_SOCKET")]
    pub unix_socket: Option<PathBuf>,

    /// Permissions of the Unix socket, in octal (660: its owner and group may connect;
    /// connecting takes write permission). Without it the umask decides.
    #[arg(long, env = "LATCHKEY_UNIX_SOCKET_MODE", requires = "unix_socket", value_parser = parse_mode)]
    pub unix_socket_mode: Option<u32>,

    /// Main Redis: redis://, rediss://, redis-cluster://host:port?node=h:p, or
    /// redis-sentinel://host:port?sentinelServiceName=NAME.
    #[arg(long, env = "LATCHKEY_REDIS_URL", default_value = DEFAULT_REDIS_URL, hide_env_values = true)]
    pub redis_url: RedisUrl,

    /// File holding the Redis password, to keep it out of URLs and process listings.
    #[arg(long, env = "LATCHKEY_REDIS_PASSWORD_FILE")]
    pub redis_password_file: Option<PathBuf>,

    /// Independent Redis deployments for RedLock, at least three, none of them the main
    /// Redis (repeat the flag; the variable is comma-separated). Each is one Redis
    /// (redis://, rediss://) or one Sentinel-managed master (redis-sentinel://); a
    /// cluster URL is refused at start.
    #[arg(
        long = "redlock-url",
        env = "LATCHKEY_REDLOCK_URLS",
        value_delimiter = ',',
        hide_env_values = true
    )]
    pub redlock_urls: Vec<RedisUrl>,

    /// How long a RedLock node that restarted (up for less than this, or answering
    /// with a new `run_id`: a restart or a failover) counts for no majority: it may
    /// have forgotten grants still held, and with the other nodes' free votes it would
    /// grant the lock again. The longest RedLock lease: a fixed one longer is refused.
    /// Default: `--watchdog-timeout`. 0 when the nodes never forget a grant
    /// (`appendfsync always`).
    #[arg(long, env = "LATCHKEY_REDLOCK_RESTART_DELAY", value_parser = parse_duration)]
    pub redlock_restart_delay: Option<Duration>,

    /// Namespace for every key and channel, for shared Redis deployments.
    #[arg(long, env = "LATCHKEY_KEY_PREFIX", default_value = "")]
    pub key_prefix: String,

    /// Lease of a stream-scoped lock; the watchdog renews it every third of this. From
    /// 300ms to 365d.
    #[arg(long, env = "LATCHKEY_WATCHDOG_TIMEOUT", default_value = DEFAULT_WATCHDOG_TIMEOUT, value_parser = parse_duration)]
    pub watchdog_timeout: Duration,

    /// How long a queued fair waiter stays in the queue without its server refreshing
    /// it; a crashed server's fair waiters block the queue no longer than this (behind a
    /// Redisson waiter, no longer than Redisson's own: 5 min after it). From 300ms to
    /// 365d.
    #[arg(long, env = "LATCHKEY_FAIR_WAIT_TIMEOUT", default_value = DEFAULT_FAIR_WAIT_TIMEOUT, value_parser = parse_duration)]
    pub fair_wait_timeout: Duration,

    /// Bound on one Redis command; a slower Redis answers UNAVAILABLE. More than zero, at most 24h.
    #[arg(long, env = "LATCHKEY_REDIS_TIMEOUT", default_value = DEFAULT_REDIS_TIMEOUT, value_parser = parse_duration)]
    pub redis_timeout: Duration,

    /// Replicas that must acknowledge a grant (Redis WAIT) before `acquired` is sent,
    /// and a renewal before it keeps a lease; 0 sends it at once.
    #[arg(long, env = "LATCHKEY_SYNC_REPLICAS", default_value_t = 0)]
    pub sync_replicas: u32,

    /// How long a grant (a renewal round: 1.2s more) may wait for `--sync-replicas`
    /// acknowledgements. At least 1ms (Redis WAIT takes 0 as forever).
    #[arg(long, env = "LATCHKEY_SYNC_TIMEOUT", default_value = DEFAULT_SYNC_TIMEOUT, value_parser = parse_duration)]
    pub sync_timeout: Duration,

    /// Prometheus `/metrics` on this address.
    #[arg(long, env = "LATCHKEY_METRICS_LISTEN", default_value = DEFAULT_METRICS_LISTEN)]
    pub metrics_listen: SocketAddr,

    /// Turn the metrics endpoint off.
    #[arg(long, env = "LATCHKEY_NO_METRICS")]
    pub no_metrics: bool,

    /// Log format.
    #[arg(long, env = "LATCHKEY_LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,

    /// Serve gRPC over TLS with this certificate chain (PEM).
    #[arg(long, env = "LATCHKEY_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,

    /// Private key of `--tls-cert` (PEM).
    #[arg(long, env = "LATCHKEY_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,

    /// Require client certificates signed by this CA (mTLS).
    #[arg(long, env = "LATCHKEY_TLS_CLIENT_CA", requires = "tls_cert")]
    pub tls_client_ca: Option<PathBuf>,

    // Not a clap conflict with `--no-auth`: clap counts `LATCHKEY_NO_AUTH=false` as
    // given; `Config::validate` refuses the two only when `--no-auth` is on.
    /// Identities and what each may do (TOML); reloaded when it changes. Every
    /// LockService call then needs a bearer token or a client certificate. Not together
    /// with --no-auth.
    #[arg(long, env = "LATCHKEY_AUTH_FILE")]
    pub auth_file: Option<PathBuf>,

    /// Serve without authentication: every caller may do everything. Required to
    /// listen beyond loopback without --auth-file.
    #[arg(long, env = "LATCHKEY_NO_AUTH")]
    pub no_auth: bool,

    /// Redis ACL user name, for URLs that carry none (the password comes from the
    /// URL or --redis-password-file).
    #[arg(long, env = "LATCHKEY_REDIS_USERNAME")]
    pub redis_username: Option<String>,

    /// CA bundle (PEM) trusted for Redis instead of the system roots; turns TLS on for
    /// every Redis URL.
    #[arg(long, env = "LATCHKEY_REDIS_TLS_CA")]
    pub redis_tls_ca: Option<PathBuf>,

    /// HTTP/2 keepalive ping interval towards clients; more than zero, at most 24h.
    #[arg(long, env = "LATCHKEY_KEEPALIVE_INTERVAL", default_value = DEFAULT_KEEPALIVE_INTERVAL, value_parser = parse_duration)]
    pub keepalive_interval: Duration,

    /// How long a keepalive ping may go unanswered before the connection is dropped;
    /// more than zero, at most 24h.
    #[arg(long, env = "LATCHKEY_KEEPALIVE_TIMEOUT", default_value = DEFAULT_KEEPALIVE_TIMEOUT, value_parser = parse_duration)]
    pub keepalive_timeout: Duration,

    /// Bound on concurrent Acquire and Watch streams on this server (the metric
    /// latchkey_streams_open counts the Acquire ones only); at least 1.
    #[arg(long, env = "LATCHKEY_MAX_STREAMS", default_value_t = DEFAULT_MAX_STREAMS)]
    pub max_streams: usize,

    /// Bound on concurrent Acquire and Watch streams on one HTTP/2 connection; at least 1.
    #[arg(long, env = "LATCHKEY_MAX_STREAMS_PER_CONNECTION", default_value_t = DEFAULT_MAX_STREAMS_PER_CONNECTION)]
    pub max_streams_per_connection: u32,

    /// Bound on Acquire streams waiting for a lock on this server; 0 for tries only.
    #[arg(long, env = "LATCHKEY_MAX_WAITERS", default_value_t = DEFAULT_MAX_WAITERS)]
    pub max_waiters: usize,

    /// Bound on Acquire streams waiting for one lock name on this server; 0 for tries
    /// only.
    #[arg(long, env = "LATCHKEY_MAX_WAITERS_PER_LOCK", default_value_t = DEFAULT_MAX_WAITERS_PER_LOCK)]
    pub max_waiters_per_lock: usize,

    /// Bound on one decoded gRPC message, in bytes; at least 4096.
    #[arg(long, env = "LATCHKEY_MAX_MESSAGE_SIZE", default_value_t = DEFAULT_MAX_MESSAGE_SIZE)]
    pub max_message_size: usize,

    /// Threads that run the server's tasks; 0 for one per CPU the process may use
    /// (cgroup limits included); at most 1024. Fewer than the machine's cores when the
    /// server shares a small machine with Redis or its clients: every thread more is a
    /// cross-thread wake-up more per request. Bounded when parsed: the runtime is built
    /// before the rest is checked, and tokio panics on a count it cannot hold.
    #[arg(long, env = "LATCHKEY_WORKER_THREADS", default_value_t = 0, value_parser = parse_worker_threads)]
    pub worker_threads: usize,
}

impl Config {
    /// Builds a configuration from arguments as on the command line (without the
    /// program name), ignoring the environment's defaults only where flags are given.
    pub fn from_args<I, S>(args: I) -> Result<Self, clap::Error>
    where
        I: IntoIterator<Item = S>,
        S: Into<std::ffi::OsString> + Clone,
    {
        let argv = std::iter::once(std::ffi::OsString::from("latchkey-server")).chain(args.into_iter().map(Into::into));
        Self::try_parse_from(argv)
    }

    /// Whether bearer tokens would cross a network in the clear: auth on, no TLS, and
    /// a TCP listener beyond loopback. Allowed (a mesh's sidecar may encrypt), but said
    /// at start: anyone on the path could take a token and act as its identity.
    pub fn sends_tokens_in_clear(&self) -> bool {
        self.auth_file.is_some() && self.tls_cert.is_none() && !self.listen.ip().is_loopback()
    }

    /// How long a restarted RedLock node sits out (`--redlock-restart-delay`): the
    /// watchdog's lease unless set.
    pub fn redlock_restart_delay(&self) -> Duration {
        self.redlock_restart_delay.unwrap_or(self.watchdog_timeout)
    }

    /// Checks the rules that involve more than one field.
    pub fn validate(&self) -> Result<(), String> {
        if self.watchdog_timeout < Duration::from_millis(300) {
            return Err("--watchdog-timeout must be at least 300ms".into());
        }
        // Redis keeps a lease in milliseconds, which Lua reads as a double: one far
        // beyond a year stops being exact, and every grant failed as if the lock were
        // another kind.
        let longest = crate::service::validate::MAX_LEASE;
        if self.watchdog_timeout > longest || self.fair_wait_timeout > longest {
            return Err("--watchdog-timeout and --fair-wait-timeout must be at most 365d".into());
        }
        let delay = self.redlock_restart_delay();
        // A node's watcher adds it to the clock; one past any lease only kept every
        // node out (and, past the clock's reach, panicked those watchers).
        if delay > longest {
            return Err("--redlock-restart-delay must be at most 365d".into());
        }
        if !delay.is_zero() && delay < self.watchdog_timeout {
            return Err(
                "--redlock-restart-delay must be 0 or at least --watchdog-timeout: a node back sooner could forget a lease still held"
                    .into(),
            );
        }
        if self.fair_wait_timeout < Duration::from_millis(300) {
            return Err("--fair-wait-timeout must be at least 300ms".into());
        }
        if self.redis_timeout.is_zero() {
            return Err("--redis-timeout must be positive".into());
        }
        // The server adds it to the clock for every call and notice; a time no clock
        // reaches would panic those sums instead of bounding anything.
        if self.redis_timeout > Duration::from_secs(24 * 60 * 60) {
            return Err("--redis-timeout must be at most 24h".into());
        }
        // hyper takes zero literally: a ping without pause, or a connection dropped at
        // its first ping (every lease on it lost).
        if self.keepalive_interval.is_zero() {
            return Err("--keepalive-interval must be positive".into());
        }
        if self.keepalive_timeout.is_zero() {
            return Err("--keepalive-timeout must be positive".into());
        }
        // hyper adds them to the clock per connection, which no time too far away fits.
        if self.keepalive_interval.max(self.keepalive_timeout) > Duration::from_secs(24 * 60 * 60) {
            return Err("--keepalive-interval and --keepalive-timeout must be at most 24h".into());
        }
        // Redis' WAIT takes 0 ms as no timeout at all: every grant would wait for good
        // on a replica that does not acknowledge.
        if self.sync_timeout < Duration::from_millis(1) {
            return Err("--sync-timeout must be at least 1ms (WAIT takes 0 as forever)".into());
        }
        // Added to the Redis timeout for every replicated grant, as that is to the clock.
        if self.sync_timeout > Duration::from_secs(24 * 60 * 60) {
            return Err("--sync-timeout must be at most 24h".into());
        }
        // A renewal round confirms its leases once the replicas acknowledge, up to
        // --sync-timeout and the time a replica takes to acknowledge unasked after it:
        // a round and one retry must fit before a lease's notice, or a healthy
        // deployment would tell its holders they lost their locks.
        let replica_wait = crate::redis::replica_wait(self.sync_timeout);
        if self.sync_replicas > 0
            && !crate::watchdog::replica_wait_fits(self.watchdog_timeout, self.redis_timeout, replica_wait)
        {
            return Err("with --sync-replicas, --watchdog-timeout must leave its renewal rounds (every third of it) time to wait for the replicas (--sync-timeout and 1.2s), twice, before a lease's notice: raise --watchdog-timeout or lower --sync-timeout".into());
        }
        // Lock keys carry no control characters (force-release notices rely on it).
        if self.key_prefix.chars().any(char::is_control) {
            return Err("--key-prefix must not contain control characters".into());
        }
        // A stray brace would split every lock's keys across cluster slots, and every
        // name would be refused as if the client's braces did.
        if !crate::service::validate::braces_pair_up(&self.key_prefix) {
            return Err(
                "--key-prefix braces must pair up into non-empty hash tags such as {app}: (no {}, no unclosed or nested {, no stray })"
                    .into(),
            );
        }
        // A prefix that starts like a record key makes every lock key read as a record,
        // and every name would be refused as if the client had asked for one.
        if let Some(record) = crate::keys::Keys::new(self.key_prefix.clone())
            .lock("x")
            .record_prefix()
        {
            return Err(format!(
                "--key-prefix must not start with \"{record}:\": latchkey keeps its own records under that prefix"
            ));
        }
        if self.auth_file.is_some() && self.no_auth {
            return Err("--auth-file and --no-auth contradict each other: give one".into());
        }
        if self.auth_file.is_none() && !self.no_auth && !self.listen.ip().is_loopback() {
            return Err(format!(
                "--listen {} is beyond loopback: give --auth-file, or --no-auth to serve every caller without authentication",
                self.listen
            ));
        }
        // 0 means "off" or "automatic" in other flags; here it refused every stream of a
        // server that read SERVING. (A waiter bound of 0 is a server of tries only.)
        let bounds = [
            ("--max-streams", self.max_streams),
            ("--max-streams-per-connection", self.max_streams_per_connection as usize),
        ];
        if let Some((flag, _)) = bounds.iter().find(|(_, bound)| *bound == 0) {
            return Err(format!("{flag} must be at least 1"));
        }
        if self.max_message_size < 4096 {
            return Err("--max-message-size must be at least 4096 bytes".into());
        }
        // The streams' semaphore holds no more permits (a larger "unlimited" panicked).
        if self.max_streams > tokio::sync::Semaphore::MAX_PERMITS {
            return Err(format!(
                "--max-streams must be at most {}",
                tokio::sync::Semaphore::MAX_PERMITS
            ));
        }
        if !self.redlock_urls.is_empty() && self.redlock_urls.len() < 3 {
            return Err("--redlock-url needs at least three independent deployments".into());
        }
        // Each node renews its leases in one script call for many names: a cluster
        // refuses the names of other slots, and every lease would be told lost.
        if let Some(url) = self.redlock_urls.iter().find(|u| crate::redis::is_cluster_url(u)) {
            return Err(format!(
                "--redlock-url {url}: a RedLock deployment is one Redis (redis://, rediss://) \
                 or one Sentinel-managed master (redis-sentinel://), not a cluster"
            ));
        }
        // One deployment named twice would count twice toward a majority; the main Redis
        // among them would share its keys with RedLock's (ForceRelease of a main lock
        // would break a RedLock hold). What URLs cannot tell (a host name and its
        // address), the nodes' run ids do once connected.
        let main = crate::redis::url_endpoints(&self.redis_url);
        let mut seen = std::collections::HashSet::new();
        for endpoint in self.redlock_urls.iter().flat_map(|u| crate::redis::url_endpoints(u)) {
            if main.contains(&endpoint) {
                return Err(format!(
                    "--redlock-url names {endpoint}, the main Redis (--redis-url): RedLock deployments must be independent of it"
                ));
            }
            if !seen.insert(endpoint.clone()) {
                return Err(format!(
                    "--redlock-url names {endpoint} twice: a majority must be of independent deployments"
                ));
            }
        }
        Ok(())
    }
}

/// A Redis URL, which may carry a password: `Debug` and `Display` show it without
/// credentials (see [`crate::redis::redact_url`]); `Deref` gives the URL to connect.
#[derive(Clone, PartialEq, Eq)]
pub struct RedisUrl(String);

impl std::str::FromStr for RedisUrl {
    type Err = std::convert::Infallible;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Self(s.to_owned()))
    }
}

impl std::ops::Deref for RedisUrl {
    type Target = str;

    fn deref(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for RedisUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&crate::redis::redact_url(&self.0))
    }
}

impl std::fmt::Debug for RedisUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", crate::redis::redact_url(&self.0))
    }
}

/// Parses permission bits written in octal, like `660` or `0600`. Connecting to a
/// socket takes write permission: a mode that grants it to nobody (`444`) would leave
/// a server that reports itself serving and takes no client.
fn parse_mode(s: &str) -> Result<u32, String> {
    let mode = u32::from_str_radix(s, 8)
        .ok()
        .filter(|mode| *mode <= 0o777)
        .ok_or_else(|| "must be permission bits in octal, 0 to 777 (660: owner and group)".to_owned())?;
    match mode & 0o222 {
        0 => Err(format!(
            "{s} lets nobody write to the socket, which connecting to it takes (660: owner and group)"
        )),
        _ => Ok(mode),
    }
}

/// Parses durations written like `30s`, `500ms`, `2m`.
fn parse_duration(s: &str) -> Result<Duration, humantime::DurationError> {
    humantime::parse_duration(s)
}

/// The most `--worker-threads` takes.
const MAX_WORKER_THREADS: usize = 1024;

fn parse_worker_threads(s: &str) -> Result<usize, String> {
    let n: usize = s.parse().map_err(|e| format!("{e}"))?;
    if n > MAX_WORKER_THREADS {
        return Err(format!("at most {MAX_WORKER_THREADS}"));
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A count of threads tokio cannot hold (`usize::MAX`) panicked inside the runtime's
    /// builder, before logging started, naming no flag.
    #[test]
    fn a_worker_thread_count_out_of_reason_is_refused_naming_the_flag() {
        for bad in [usize::MAX.to_string(), "1025".to_owned(), "two".to_owned()] {
            let e = Config::from_args(["--worker-threads", bad.as_str()]).unwrap_err();
            assert!(e.to_string().contains("--worker-threads"), "{e}");
        }
        assert_eq!(
            Config::from_args(["--worker-threads", "1024"]).unwrap().worker_threads,
            1024
        );
    }

    /// A stream bound of 0 started a server that reads SERVING and refuses every
    /// stream: 0 reads as "off" or "automatic" in other flags, never here. A waiter
    /// bound of 0 is a server of tries only.
    #[test]
    fn a_zero_bound_on_streams_is_refused_at_start() {
        for flag in ["--max-streams", "--max-streams-per-connection"] {
            let c = Config::from_args([flag, "0"]).unwrap();
            assert!(c.validate().unwrap_err().contains(flag), "{flag}");
            Config::from_args([flag, "1"]).unwrap().validate().unwrap();
        }
        for flag in ["--max-waiters", "--max-waiters-per-lock"] {
            Config::from_args([flag, "0"]).unwrap().validate().unwrap();
        }
    }

    #[test]
    fn defaults_parse_and_validate() {
        let c = Config::from_args(Vec::<String>::new()).unwrap();
        assert_eq!(c.watchdog_timeout, Duration::from_secs(30));
        assert_eq!(c.listen.to_string(), DEFAULT_LISTEN);
        c.validate().unwrap();
    }

    #[test]
    fn socket_modes_are_octal_and_need_a_socket() {
        let c = Config::from_args(["--unix-socket", "/run/l.sock", "--unix-socket-mode", "0660"]).unwrap();
        assert_eq!(c.unix_socket_mode, Some(0o660));
        for bad in ["688", "1777", "rw", "", "0", "444", "555"] {
            let e = Config::from_args(["--unix-socket", "/run/l.sock", "--unix-socket-mode", bad]).unwrap_err();
            assert!(e.to_string().contains("--unix-socket-mode"), "{e}");
        }
        assert!(
            Config::from_args(["--unix-socket-mode", "600"]).is_err(),
            "no socket to apply it to"
        );
    }

    /// A watchdog lease of 1e14 s started, and then every grant failed, its lease in
    /// milliseconds beyond what Lua reads exactly.
    #[test]
    fn a_lease_beyond_a_year_is_refused_at_start() {
        for flag in ["--watchdog-timeout", "--fair-wait-timeout"] {
            let c = Config::from_args([flag, "366d"]).unwrap();
            assert!(c.validate().unwrap_err().contains(flag), "{flag}");
            Config::from_args([flag, "365d"]).unwrap().validate().unwrap();
        }
    }

    /// A prefix with a stray brace started, and then every name was refused as if the
    /// client's braces split the lock's slots.
    #[test]
    fn a_key_prefix_with_stray_braces_is_refused_at_start() {
        for bad in ["app}", "{app", "{}:", "{a{b}}:"] {
            let c = Config::from_args(["--key-prefix", bad]).unwrap();
            assert!(c.validate().unwrap_err().contains("--key-prefix"), "{bad}");
        }
        for good in ["", "app:", "{app}:", "{a}:{b}:"] {
            Config::from_args(["--key-prefix", good]).unwrap().validate().unwrap();
        }
    }

    /// A prefix that starts like a record key started a server that refused every name
    /// as a record's.
    #[test]
    fn a_key_prefix_like_a_record_key_is_refused_at_start() {
        for record in crate::keys::RECORD_PREFIXES {
            let c = Config::from_args(["--key-prefix", &format!("{record}:app:")]).unwrap();
            assert!(c.validate().unwrap_err().contains("--key-prefix"), "{record}");
        }
        Config::from_args(["--key-prefix", "latchkey_holdings:"])
            .unwrap()
            .validate()
            .unwrap();
    }

    #[test]
    fn durations_use_human_units() {
        let c = Config::from_args(["--watchdog-timeout", "1500ms"]).unwrap();
        assert_eq!(c.watchdog_timeout, Duration::from_millis(1500));
    }

    #[test]
    fn auth_off_beyond_loopback_is_explicit() {
        let c = Config::from_args(["--listen", "0.0.0.0:50051"]).unwrap();
        assert!(c.validate().unwrap_err().contains("--no-auth"));
        let c = Config::from_args(["--listen", "0.0.0.0:50051", "--no-auth"]).unwrap();
        c.validate().unwrap();
        let c = Config::from_args(["--listen", "0.0.0.0:50051", "--auth-file", "a.toml"]).unwrap();
        c.validate().unwrap();
        assert!(c.sends_tokens_in_clear(), "tokens over plaintext beyond loopback");
        let c = Config::from_args(["--auth-file", "a.toml"]).unwrap();
        assert!(!c.sends_tokens_in_clear(), "loopback");
        let tls = ["--tls-cert", "c.pem", "--tls-key", "k.pem"];
        let c =
            Config::from_args([&["--listen", "0.0.0.0:50051", "--auth-file", "a.toml"][..], &tls].concat()).unwrap();
        assert!(!c.sends_tokens_in_clear(), "over TLS");
        let both = Config::from_args(["--no-auth", "--auth-file", "a.toml"]).unwrap();
        assert!(both.validate().unwrap_err().contains("--no-auth"));
    }

    #[test]
    fn debug_output_hides_redis_passwords() {
        let c = Config::from_args([
            "--redis-url",
            "redis://u:hunter2@h:1",
            "--redlock-url",
            "redis://:hunter3@a",
        ])
        .unwrap();
        let shown = format!("{c:?}");
        assert!(!shown.contains("hunter"), "{shown}");
        assert_eq!(&*c.redis_url, "redis://u:hunter2@h:1");
    }

    #[test]
    fn limits_have_env_twins() {
        let c = Config::from_args(["--max-waiters-per-lock", "3", "--max-message-size", "8192"]).unwrap();
        assert_eq!((c.max_waiters_per_lock, c.max_message_size), (3, 8192));
        assert_eq!(c.max_waiters, DEFAULT_MAX_WAITERS);
        c.validate().unwrap();
        let tiny = Config::from_args(["--max-message-size", "10"]).unwrap();
        assert!(tiny.validate().is_err());
    }

    #[test]
    fn keepalive_durations_are_positive_and_at_most_a_day() {
        for flag in ["--keepalive-interval", "--keepalive-timeout"] {
            for value in ["0s", "25h", "10000000000000000000s"] {
                let c = Config::from_args([flag, value]).unwrap();
                assert!(c.validate().unwrap_err().contains(flag), "{flag} {value}");
            }
            assert!(Config::from_args([flag, "24h"]).unwrap().validate().is_ok());
        }
    }

    /// A Redis timeout past the clock's reach started a server whose every grant
    /// panicked adding to it (and whose watchdog task ended so), health SERVING.
    #[test]
    fn the_redis_timeout_is_positive_and_at_most_a_day() {
        for value in ["0s", "25h", "18446744073709551615s"] {
            let c = Config::from_args(["--redis-timeout", value]).unwrap();
            assert!(c.validate().unwrap_err().contains("--redis-timeout"), "{value}");
        }
        assert!(Config::from_args(["--redis-timeout", "24h"])
            .unwrap()
            .validate()
            .is_ok());
    }

    /// One past the clock's reach started a server whose every replicated grant
    /// panicked adding the Redis timeout to it, health SERVING.
    #[test]
    fn sync_timeout_is_never_wait_forever_and_at_most_a_day() {
        for value in ["0s", "500us", "25h", "18446744073709551615s"] {
            let c = Config::from_args(["--sync-timeout", value]).unwrap();
            assert!(c.validate().unwrap_err().contains("--sync-timeout"), "{value}");
        }
        for value in ["1ms", "24h"] {
            assert!(Config::from_args(["--sync-timeout", value]).unwrap().validate().is_ok());
        }
    }

    /// With `--sync-replicas` a renewal round waits for the replicas (up to
    /// `--sync-timeout` and 1.2 s): a watchdog timeout whose rounds could not wait so,
    /// and retry once, before a lease's notice would tell healthy leases lost.
    #[test]
    fn replicated_renewals_need_a_watchdog_timeout_that_outlasts_their_wait() {
        let synced = |watchdog: &str, sync: &str| {
            let args = [
                "--sync-replicas",
                "1",
                "--watchdog-timeout",
                watchdog,
                "--sync-timeout",
                sync,
            ];
            Config::from_args(args).unwrap().validate()
        };
        for (watchdog, sync) in [("3s", "1s"), ("30s", "10s"), ("6s", "300ms")] {
            let e = synced(watchdog, sync).unwrap_err();
            assert!(
                e.contains("--watchdog-timeout") && e.contains("--sync-timeout"),
                "{watchdog} {sync}: {e}"
            );
        }
        for (watchdog, sync) in [("30s", "1s"), ("30s", "5s"), ("12s", "300ms"), ("60s", "10s")] {
            assert!(synced(watchdog, sync).is_ok(), "{watchdog} {sync}");
        }
        let unsynced = ["--watchdog-timeout", "3s", "--sync-timeout", "1s"];
        assert!(
            Config::from_args(unsynced).unwrap().validate().is_ok(),
            "only with --sync-replicas"
        );
    }

    #[test]
    fn a_redlock_restart_delay_covers_the_watchdogs_lease() {
        let c = Config::from_args(["--watchdog-timeout", "10s"]).unwrap();
        assert_eq!(
            c.redlock_restart_delay(),
            Duration::from_secs(10),
            "the lease by default"
        );
        // (One past the clock's reach panicked every node's watcher: RedLock never served.)
        let delays = [("0s", true), ("10s", true), ("1m", true), ("365d", true)];
        let refused = [("9s", false), ("366d", false), ("18446744073709551615s", false)];
        for (delay, ok) in delays.into_iter().chain(refused) {
            let c = Config::from_args(["--watchdog-timeout", "10s", "--redlock-restart-delay", delay]).unwrap();
            let err = c.validate().err().unwrap_or_default();
            assert_eq!(err.is_empty(), ok, "{delay}: {err}");
            assert!(ok || err.contains("--redlock-restart-delay"), "{err}");
        }
    }

    #[test]
    fn redlock_needs_three() {
        let c = Config::from_args(["--redlock-url", "redis://a", "--redlock-url", "redis://b"]).unwrap();
        assert!(c.validate().is_err());
    }

    #[test]
    fn a_stream_bound_beyond_what_a_semaphore_holds_is_refused() {
        let c = Config::from_args(["--max-streams", &usize::MAX.to_string()]).unwrap();
        assert!(c.validate().unwrap_err().contains("--max-streams"));
        let c = Config::from_args(["--max-streams", "1000000"]).unwrap();
        assert!(c.validate().is_ok());
    }

    #[test]
    fn redlock_refuses_a_cluster() {
        for cluster in ["redis-cluster://u:secret@c:7000?node=c:7001", "REDISS-CLUSTER://c:7000"] {
            let urls = ["redis://a", "redis://b", cluster];
            let c = Config::from_args(urls.iter().flat_map(|u| ["--redlock-url", u])).unwrap();
            let err = c.validate().unwrap_err();
            assert!(err.contains("--redlock-url") && err.contains("not a cluster"), "{err}");
            assert!(!err.contains("secret"), "{err}");
        }
    }

    /// One Redis named three times (here with another password and database) would be a
    /// "majority" of one deployment: refused, without showing the password.
    #[test]
    fn redlock_refuses_one_deployment_named_twice() {
        let urls = ["redis://a:1", "redis://u:secret@A:1/2", "redis://b:1"];
        let c = Config::from_args(urls.iter().flat_map(|u| ["--redlock-url", u])).unwrap();
        let err = c.validate().unwrap_err();
        assert!(err.contains("--redlock-url names a:1 twice"), "{err}");
        assert!(!err.contains("secret"), "{err}");
        let urls = ["redis://a:1", "redis://a:2", "redis://b:1"];
        let c = Config::from_args(urls.iter().flat_map(|u| ["--redlock-url", u])).unwrap();
        assert!(c.validate().is_ok());
    }

    fn redlock(urls: &[&str], main: &str) -> Result<(), String> {
        let mut args = vec!["--redis-url", main];
        args.extend(urls.iter().flat_map(|u| ["--redlock-url", *u]));
        Config::from_args(args).unwrap().validate()
    }

    /// The default port counts: `redis://a` and `redis://a:6379` are one Redis. The main
    /// Redis is none of the nodes. One Sentinel group watching three masters is three
    /// deployments.
    #[test]
    fn redlock_deployments_are_told_apart_by_port_service_and_the_main_redis() {
        let err = redlock(&["redis://a", "rediss://A:6379", "redis://b"], "redis://m").unwrap_err();
        assert!(err.contains("--redlock-url names a:6379 twice"), "{err}");
        let err = redlock(&["redis://a", "redis://b", "redis://127.0.0.1"], DEFAULT_REDIS_URL).unwrap_err();
        assert!(err.contains("127.0.0.1:6379, the main Redis"), "{err}");
        let err = redlock(
            &["redis://a", "redis://b", "redis://m:7000/1"],
            "redis-cluster://n:7000?node=m:7000",
        );
        assert!(err.unwrap_err().contains("the main Redis"));
        let sentinels = ["m1", "m2", "m3"].map(|m| format!("redis-sentinel://s:26379?sentinelServiceName={m}"));
        let sentinels = sentinels.each_ref().map(String::as_str);
        redlock(&sentinels, "redis://m").unwrap();
        let err = redlock(&sentinels, "redis-sentinel://s?sentinelServiceName=m2").unwrap_err();
        assert!(err.contains("the main Redis"), "{err}");
        let twice = [
            sentinels[0],
            sentinels[1],
            "redis-sentinel://t?sentinelServiceName=m1&node=s:26379",
        ];
        let err = redlock(&twice, "redis://m").unwrap_err();
        assert!(err.contains("s:26379 (sentinelServiceName=m1) twice"), "{err}");
    }
}
