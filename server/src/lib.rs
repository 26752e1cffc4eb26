//! latchkey-server: a lock coordinator whose leases are gRPC streams, on Redis in
//! Redisson's data layout.
//!
//! # Layout
//!
//! ```text
//! Acquire ─▶ service/acquire.rs ─▶ lock/<kind>.rs ─▶ scripts/<kind>_<op>.lua ─▶ redis.rs
//! Redis PUBLISH ─▶ redis.rs subscriber ─▶ hub.rs ─▶ wakes waiting service/acquire.rs
//! watchdog.rs ─▶ scripts/renew.lua ─▶ not held ─▶ service/acquire.rs sends lost{NOT_HELD}
//! ```
//!
//! - `config`: flags and their `LATCHKEY_*` twins.
//! - `serve`: the tonic server (TCP, Unix socket, TLS, keepalive, health, reflection).
//! - `service`: the gRPC edge — `acquire` (one stream's state machine), `admin`
//!   (Describe, List, ForceRelease), `validate` (proto → request), `convert`.
//! - `lock`: the domain core — requests, grants, one file per lock kind.
//! - `scripts`: the Lua catalogue, run by SHA.
//! - `redis`: the connections (pool, subscriber, replica sync).
//! - `keys`: every key and channel name.
//! - `hub`: one subscription per lock channel; wakes local waiters.
//! - `watchdog`: renews every stream-scoped lease in batches; reports lost leases.
//! - `auth`: the auth file (identities, tokens, subjects, prefixes, actions), the
//!   interceptor that authenticates and the check each RPC makes.
//! - `tls`: the listeners' TLS (certificate and client CA reload) and Redis's CA.
//! - `reload`: polls files and hands changed contents to `auth` and `tls`.
//! - `limits`: streams per connection and waiters per lock and per server.
//! - `health`: readiness (gRPC health, `/ready`, `latchkey_serving`), from a Redis ping.
//! - `shutdown`, `metrics`, `error`.

pub mod auth;
pub mod config;
pub mod error;
pub mod health;
pub mod hub;
pub mod keys;
pub mod limits;
pub mod lock;
pub mod metrics;
pub mod redis;
pub mod reload;
pub mod repeated;
pub mod scripts;
pub mod serve;
pub mod service;
pub mod shutdown;
pub mod sparse;
pub mod tls;
pub mod watchdog;

use auth::Auth;
use config::Config;
use error::Error;
use hub::{Feed, Hub};
use lock::Locks;
use redis::Backend;
use service::{LockService, Shared};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tls::{ServerTls, TlsFiles};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use watchdog::Watchdog;

/// How long shutdown waits for streams to release their locks, background releases
/// included: one deadline for both, so the drain never takes longer than this.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);
/// How long connections get to close once every lock stream has ended: their last
/// frames go out at once. About once in 25 shutdowns under load (`--test shutdown`
/// run in a loop) a client's connection did not close after all its lock streams had
/// ended, and held up the exit for the whole drain; the cause is not known.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(2);
/// Within how long the clients' HTTP/2 keepalive tells a holder its server stopped
/// answering (the Rust client's 3 s and 4 s, the Node client's 2 s and 6 s, with room).
const CLIENTS_LEARN_WITHIN: Duration = Duration::from_secs(10);
/// How long shutdown waits for the streams to end before it cuts the connections of
/// those that did not (see `Server::stop`): a stream that heard of the shutdown ends
/// within a Redis call's time, and the drain's rest is left for the give-backs.
const CUT_AFTER: Duration = Duration::from_secs(3);

/// Runs the server until `shutdown` resolves, then drains it. A shutdown while it
/// starts stops it there: it holds no lock yet, and what start spawned ends with the
/// runtime.
pub async fn run(config: Config, shutdown: impl Future<Output = ()>) -> Result<(), Error> {
    tokio::pin!(shutdown);
    let mut server = tokio::select! {
        server = Server::start(config) => server?,
        () = &mut shutdown => return Ok(()),
    };
    // Fail-stop: a server whose listeners, renewals or pub/sub readers stopped (an
    // error, a bug that panicked) would keep leases that Redis lets lapse under their
    // holders. Its streams release their locks and it exits, to be restarted.
    let failed = tokio::select! {
        _ = shutdown => None,
        served = &mut server.serving => {
            server.served = true;
            Some(match served {
                Ok(Ok(())) => "the gRPC server ended".to_owned(),
                Ok(Err(e)) => e.to_string(),
                Err(e) => format!("the gRPC server's task: {e}"),
            })
        }
        ended = first_to_end(&mut server.background) => Some(match ended {
            Ok(()) => "a background task ended".to_owned(),
            Err(e) => format!("a background task stopped: {e}"),
        }),
    };
    let Some(why) = failed else {
        return server.stop().await;
    };
    tracing::error!(error = %why, "stopped serving; shutting down");
    server.stop().await?;
    Err(Error::Stopped(why))
}

/// Waits for the first of `tasks` to end; pending for good when there are none. The
/// server's background tasks end only once it stops, so one that ends before has failed.
async fn first_to_end(tasks: &mut [JoinHandle<()>]) -> Result<(), tokio::task::JoinError> {
    if tasks.is_empty() {
        return std::future::pending().await;
    }
    futures::future::select_all(tasks.iter_mut()).await.0
}

/// A running server.
#[derive(Debug)]
pub struct Server {
    addr: SocketAddr,
    shared: Arc<Shared>,
    backend: Arc<Backend>,
    stop: CancellationToken,
    serving: JoinHandle<Result<(), Error>>,
    /// The serving task has ended already (see [`run`]): `stop` does not wait for it.
    served: bool,
    /// Keeps readiness in line with Redis; gives it back at shutdown.
    health: JoinHandle<health::Readiness>,
    background: Vec<JoinHandle<()>>,
}

/// Where Prometheus scrapes, for the start's log line.
fn metrics_address(config: &Config) -> String {
    match config.no_metrics {
        true => "off".to_owned(),
        false => config.metrics_listen.to_string(),
    }
}

impl Server {
    /// Binds the listeners, starts connecting to Redis and serves. The server reports
    /// NOT_SERVING on health until Redis answers.
    pub async fn start(config: Config) -> Result<Self, Error> {
        config.validate().map_err(Error::Startup)?;
        // One crypto provider for tonic and fred; an error means one is installed already.
        let _ = rustls::crypto::ring::default_provider().install_default();
        // With what each file held when parsed: the reload watchers' baselines.
        let (auth, auth_loaded) = load_auth(&config).await?.unzip();
        let (tls, tls_loaded) = load_tls(&config).await?.unzip();
        // The listeners before the metrics: the sidecar's kubelet probes take the
        // metrics listener's /health for "clients can connect".
        let (listeners, addr) = serve::bind(&config).await?;
        let (ready, ready_read) = tokio::sync::watch::channel(false);
        if !config.no_metrics {
            metrics::install(config.metrics_listen, ready_read).map_err(Error::Startup)?;
            #[cfg(not(target_env = "msvc"))]
            tokio::spawn(metrics::sample_heap());
            if let Some(tls) = &tls {
                tls.publish_expiry();
            }
        }
        let backend = Arc::new(Backend::connect(&config)?);
        backend.start().await?;
        let stop = CancellationToken::new();
        // Every hold id of this server starts with its id.
        let server_id = service::new_server_id();
        let hub = Hub::new(backend.keys().force_release_channel(), &server_id);
        if config.watchdog_timeout < CLIENTS_LEARN_WITHIN {
            tracing::warn!(
                watchdog_timeout = ?config.watchdog_timeout,
                "a frozen server's leases end in Redis before their clients' keepalive tells them (README: Keepalive)"
            );
        }
        if config.keepalive_timeout < CLIENTS_LEARN_WITHIN {
            tracing::warn!(
                keepalive_timeout = ?config.keepalive_timeout,
                "a silent holder's connection may be dropped, and its lock granted, before its client's keepalive tells it (README: Keepalive)"
            );
        }
        let watchdog = Watchdog::new(backend.clone(), config.watchdog_timeout, config.redis_timeout);
        let locks = Locks::new(
            backend.clone(),
            hub.clone(),
            config.watchdog_timeout,
            config.fair_wait_timeout,
            stop.clone(),
        );
        // RedLock waiters listen on every RedLock deployment, through a hub of their own.
        let redlock =
            Feed::redlock(&backend).map(|feed| (Hub::new(backend.keys().force_release_channel(), &server_id), feed));
        let shared = Arc::new(Shared::new(
            locks,
            hub.clone(),
            redlock.as_ref().map(|(hub, _)| hub.clone()),
            watchdog.clone(),
            stop.clone(),
            auth.clone(),
            limits::Limits::new(limits::Bounds {
                streams: config.max_streams,
                streams_per_connection: config.max_streams_per_connection as usize,
                waiters: config.max_waiters,
                waiters_per_lock: config.max_waiters_per_lock,
            }),
        ));
        let (reporter, health_service) = tonic_health::server::health_reporter();
        let readiness = health::Readiness::new(reporter, ready).await;
        let mut background = vec![
            tokio::spawn(hub.clone().run(Feed::main(&backend), stop.clone())),
            tokio::spawn(watchdog.clone().run(hub.force_released(), stop.clone())),
            tokio::spawn(shared.locks.clone().give_back_unclaimed(hub.unclaimed())),
        ];
        if let Some(auth) = &auth {
            background.push(tokio::spawn(
                watchdog.clone().follow_policies(auth.policies(), stop.clone()),
            ));
            background.push(tokio::spawn(auth.unheard().follow(auth.policies(), stop.clone())));
        }
        let health_task = tokio::spawn(health::follow(backend.clone(), readiness, stop.clone()));
        if let Some((redlock_hub, feed)) = redlock {
            background.push(tokio::spawn(redlock_hub.run(feed, stop.clone())));
            let probe = redis::probe_redlock_subscribers(backend.clone(), health::INTERVAL, stop.clone());
            background.push(tokio::spawn(probe));
        }
        background.extend(watch_files(
            auth.clone().zip(auth_loaded),
            tls.clone().zip(tls_loaded),
            &stop,
        ));
        let routes = serve::routes(
            LockService::new(shared.clone()),
            auth.clone(),
            tls.clone(),
            health_service,
            config.max_message_size,
            &stop,
        )?;
        let signal = stop.clone();
        let serve_tls = tls.clone();
        let (redis, redlock_nodes, metrics) = (
            config.redis_url.to_string(),
            config.redlock_urls.len(),
            metrics_address(&config),
        );
        let serving = tokio::spawn(async move { serve::serve(&config, listeners, routes, serve_tls, signal).await });
        let workers = tokio::runtime::Handle::current().metrics().num_workers();
        tracing::info!(
            %addr,
            redis,
            redlock_nodes,
            metrics,
            tls = tls.is_some(),
            auth = auth.is_some(),
            workers,
            version = env!("CARGO_PKG_VERSION"),
            "latchkey serving"
        );
        Ok(Self {
            addr,
            shared,
            backend,
            stop,
            serving,
            served: false,
            health: health_task,
            background,
        })
    }

    /// The TCP address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Graceful shutdown: streams release their locks and end with `lost{SHUTDOWN}`,
    /// the listeners close, the Redis connections close.
    pub async fn stop(self) -> Result<(), Error> {
        tracing::info!("shutting down: releasing every lease");
        self.stop.cancel();
        self.shared.sessions.close();
        let started = tokio::time::Instant::now();
        let drained_by = started + DRAIN_TIMEOUT;
        // A stream whose last event waits for its client's flow-control credit is not
        // polled, and never hears of the shutdown: its connection is cut, which drops
        // it, and its lock or place in line is given back in the background.
        if tokio::time::timeout_at(started + CUT_AFTER, self.shared.sessions.wait())
            .await
            .is_err()
        {
            tracing::warn!("streams did not end in time; cutting their connections");
            self.shared.limits.cut_connections_with_streams();
            if tokio::time::timeout_at(drained_by, self.shared.sessions.wait())
                .await
                .is_err()
            {
                tracing::warn!("streams did not finish releasing in time");
            }
        }
        let background = self.shared.locks.background();
        background.close();
        if tokio::time::timeout_at(drained_by, background.wait()).await.is_err() {
            tracing::warn!("background releases did not finish in time");
        }
        if let Ok(readiness) = self.health.await {
            readiness.clear().await;
        }
        let mut serving = self.serving;
        // A serving task that ended already was heard from in `run`.
        if !self.served {
            match tokio::time::timeout(CLOSE_TIMEOUT, &mut serving).await {
                Ok(Ok(result)) => result?,
                Ok(Err(e)) => tracing::warn!(error = %e, "server task failed"),
                Err(_) => {
                    tracing::warn!("connections did not close in time");
                    // Its connections' tasks stay till the runtime's end (the process's
                    // exit): what their streams had sent still reaches their clients,
                    // which a cut would lose.
                    serving.abort();
                }
            }
        }
        for task in self.background {
            task.abort();
        }
        // Redis may be away: saying goodbye to it must not hold up the exit.
        if tokio::time::timeout(CLOSE_TIMEOUT, self.backend.quit()).await.is_err() {
            tracing::warn!("Redis connections did not close in time");
        }
        tracing::info!("stopped");
        Ok(())
    }
}

/// The auth file and the bytes parsed, or None when auth is off, which is said at
/// start: loudly when the server listens beyond loopback (validation made sure
/// `--no-auth` asked for it).
async fn load_auth(config: &Config) -> Result<Option<Loaded<Auth>>, Error> {
    if let Some(path) = &config.auth_file {
        let (mut auth, loaded) = Auth::load(path).await?;
        let identities = auth.policy().len();
        tracing::info!(path = %path.display(), identities, "auth on: LockService calls need a token or a client certificate");
        if config.tls_client_ca.is_none() {
            auth.without_client_certificates();
        }
        if config.sends_tokens_in_clear() {
            tracing::warn!(listen = %config.listen, "bearer tokens cross the network in plaintext: anyone on the path may take one; give --tls-cert and --tls-key unless the network encrypts");
        }
        return Ok(Some((Arc::new(auth), vec![loaded])));
    }
    if config.listen.ip().is_loopback() {
        tracing::info!("auth off: every caller may take, inspect and break every lock (loopback only)");
    } else {
        tracing::warn!(listen = %config.listen, "AUTH OFF (--no-auth): anyone who reaches this address may take, inspect and break every lock");
    }
    Ok(None)
}

/// The listeners' TLS from `--tls-cert`, `--tls-key` and `--tls-client-ca`, with the
/// files' contents as parsed.
async fn load_tls(config: &Config) -> Result<Option<Loaded<ServerTls>>, Error> {
    let (Some(cert), Some(key)) = (&config.tls_cert, &config.tls_key) else {
        return Ok(None);
    };
    let files = TlsFiles {
        cert: cert.clone(),
        key: key.clone(),
        client_ca: config.tls_client_ca.clone(),
    };
    let (tls, loaded) = ServerTls::load(files).await?;
    Ok(Some((Arc::new(tls), loaded)))
}

/// Something loaded from files, with the files' contents as parsed.
type Loaded<T> = (Arc<T>, Vec<Vec<u8>>);

/// Tasks that reload the auth file and the TLS files when they differ from what was
/// loaded.
fn watch_files(
    auth: Option<Loaded<Auth>>,
    tls: Option<Loaded<ServerTls>>,
    stop: &CancellationToken,
) -> Vec<JoinHandle<()>> {
    let mut tasks = Vec::new();
    if let Some((auth, loaded)) = auth {
        let paths = vec![auth.path().to_owned()];
        tasks.push(tokio::spawn(reload::watch(paths, loaded, stop.clone(), move |c| {
            auth.reload(&c[0])
        })));
    }
    if let Some((tls, loaded)) = tls {
        let paths = tls.files().paths();
        tasks.push(tokio::spawn(reload::watch(paths, loaded, stop.clone(), move |c| {
            tls.reload(c)
        })));
    }
    tasks
}

#[cfg(test)]
mod tests {
    use super::first_to_end;
    use std::time::Duration;

    #[tokio::test]
    async fn a_background_task_that_panics_is_seen_at_once_beside_one_still_running() {
        let mut tasks = vec![
            tokio::spawn(std::future::pending::<()>()),
            tokio::spawn(async { panic!("a bug") }),
        ];
        let ended = tokio::time::timeout(Duration::from_secs(5), first_to_end(&mut tasks))
            .await
            .expect("the panic is seen");
        assert!(ended.expect_err("a panic is an error").is_panic());
        assert!(!tasks[0].is_finished());
    }

    #[tokio::test]
    async fn no_background_task_never_ends() {
        let waited = tokio::time::timeout(Duration::from_millis(50), first_to_end(&mut [])).await;
        assert!(waited.is_err());
    }
}
