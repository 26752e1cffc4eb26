//! The Rust client of latchkey, the lock-coordinator gRPC service.
//!
//! A lock is held for as long as its `Acquire` stream is open, so a [`Lease`] is
//! a live stream: keep it while the work needs the lock, watch [`Lease::lost`],
//! and [`Lease::release`] it (or drop it) when done.
//!
//! ```no_run
//! # async fn demo() -> Result<(), latchkey_client::Error> {
//! use std::time::Duration;
//! let client = latchkey_client::Client::connect("http://127.0.0.1:50051").await?;
//! let lease = client.lock("orders").wait(Duration::from_secs(10)).acquire().await?;
//! println!("fencing token {}", lease.fencing_token());
//! lease.release().await?;
//! # Ok(())
//! # }
//! ```
//!
//! # Layout
//! - `lib.rs`: [`Client`]: connect, inspection, administration.
//! - `acquire.rs`: [`LockBuilder`], the options of one request; it opens the
//!   `Acquire` stream and waits for `Acquired`.
//! - `lease.rs`: [`Lease`], the held lock, and [`LostReason`].
//! - `connect.rs`: [`ConnectOptions`] (TLS, mTLS, bearer token).
//! - `error.rs`: [`Error`].
//! - `watch.rs`: [`LockWatch`], the states a `Watch` stream sends.
//! - `bin/latchkey/`: the `latchkey` CLI (`main.rs`, `run.rs`, `format.rs`),
//!   built only on this library.

mod acquire;
mod connect;
mod error;
mod lease;
mod watch;

use std::future::Future;
use std::time::Duration;

use latchkey_proto::v1::{
    lock_service_client::LockServiceClient, DescribeRequest, ForceReleaseRequest, ListRequest, WatchRequest,
};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};
use tonic::Status;

pub use acquire::{duration_from_proto, LockBuilder};
use connect::Connector;
pub use connect::{ConnectOptions, Credentials};
pub use error::Error;
pub use latchkey_proto::v1::{Holder, ListResponse, LockKind, LockState, Queued, Waiter};
pub use lease::{Lease, LostReason, LostSignal, RELEASE_TIMEOUT};
pub use watch::LockWatch;

/// The server address used when none is given.
pub const DEFAULT_SERVER: &str = "http://127.0.0.1:50051";
/// How long [`Client::connect`] tries to reach the server.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long [`Client::describe`], [`Client::list`], [`Client::force_release`] and the
/// opening of [`Client::watch`] wait for the server's answer unless
/// [`ConnectOptions::call_timeout`] says otherwise; past it they fail with
/// [`Error::NoAnswer`]. Without a bound such a call could wait for good: on a
/// connection whose server refused this client's certificate (TLS 1.3 tells the client
/// after it took the handshake for done), the transport may never answer the call. As
/// the Python client's: the server's own calls to Redis may take its `--redis-timeout`
/// each (an operator may set 8 s), and a bound that cut an answer on its way would
/// leave a ForceRelease's outcome unknown.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// How often an HTTP/2 ping checks the connection, even while idle.
///
/// With [`KEEPALIVE_TIMEOUT`] a silent connection is found dead within 7 s. The
/// server's keepalive (10 s, and 10 s to answer by default) finds it no sooner than
/// 10 s after it went silent, and only then releases its locks: a holder behind a
/// partition is told `lost` before the next one can be granted its lock.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(3);
/// How long a ping may go unanswered before the connection counts as dead
/// (and every lease on it as lost with [`LostReason::Disconnected`]).
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(4);

/// A connection to a latchkey server. Cheap to clone; clones share the
/// connection.
#[derive(Debug, Clone)]
pub struct Client {
    inner: Inner,
    /// The bound of a call answered once (see [`CALL_TIMEOUT`]).
    call_timeout: Duration,
}

/// The generated client, with the bearer token added to every call.
pub(crate) type Inner = LockServiceClient<InterceptedService<Channel, Credentials>>;

impl Client {
    /// Connects to `target`: `http://host:port` (TCP) or `unix:///path/to.sock`
    /// (a Unix socket, e.g. a sidecar's). Fails if the server cannot be reached
    /// within [`CONNECT_TIMEOUT`].
    pub async fn connect(target: &str) -> Result<Self, Error> {
        Self::connect_with(target, &ConnectOptions::default()).await
    }

    /// Connects to `target` with TLS and credentials: `https://host:port` trusts the
    /// system's CAs unless [`ConnectOptions::ca_pem`] gives others, which also turns
    /// TLS on for a `unix:///path` target (a server with TLS serves it on its Unix
    /// socket too); a token goes with every call.
    pub async fn connect_with(target: &str, options: &ConnectOptions) -> Result<Self, Error> {
        let credentials = options.credentials()?;
        let call_timeout = options.checked_call_timeout()?;
        let endpoint = options.endpoint(target)?;
        let channel = Connector::for_target(target)
            .channel(&endpoint)
            .await
            .map_err(|source| Error::Transport {
                target: target.to_owned(),
                source,
            })?;
        Ok(Self::with_credentials(channel, credentials, call_timeout))
    }

    /// Like [`Client::connect`], but connects on the first call instead of now. The
    /// channel's connection task runs on the Tokio runtime this is called in (and the
    /// client is tied to it): outside one, [`Error::InvalidOptions`].
    pub fn connect_lazy(target: &str) -> Result<Self, Error> {
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(Error::InvalidOptions(
                "connect_lazy must be called within a Tokio runtime".to_owned(),
            ));
        }
        let channel = Connector::for_target(target).lazy_channel(&ConnectOptions::default().endpoint(target)?);
        Ok(Self::from_channel(channel))
    }

    /// Uses a channel built elsewhere (custom TLS, interceptors, tests).
    ///
    /// The channel needs HTTP/2 keepalive, as [`Client::connect`] sets it: without
    /// pings, a lease behind a silent partition (no packet lost, none answered) is not
    /// told lost until the connection is found dead, which may be never, while the
    /// server's own keepalive gives its lock to another client after about 20 s. Build
    /// the channel on [`endpoint`] or [`ConnectOptions::endpoint`], which set it (every
    /// [`KEEPALIVE_INTERVAL`], [`KEEPALIVE_TIMEOUT`] to answer, also while idle).
    pub fn from_channel(channel: Channel) -> Self {
        Self::with_credentials(channel, Credentials::default(), CALL_TIMEOUT)
    }

    /// Uses a channel built elsewhere, sending the token of `options` with every call
    /// (build the channel on [`ConnectOptions::endpoint`] for its TLS and keepalive).
    pub fn from_channel_with(channel: Channel, options: &ConnectOptions) -> Result<Self, Error> {
        Ok(Self::with_credentials(
            channel,
            options.credentials()?,
            options.checked_call_timeout()?,
        ))
    }

    /// Takes messages of any size: a lock's state grows with its holders and waiters (a
    /// read lock or semaphore of thousands, long owner ids) past gRPC's default 4 MiB,
    /// and the server sends it whole.
    fn with_credentials(channel: Channel, credentials: Credentials, call_timeout: Duration) -> Self {
        Client {
            inner: LockServiceClient::with_interceptor(channel, credentials).max_decoding_message_size(usize::MAX),
            call_timeout,
        }
    }

    /// The answer of a call answered once, or `DEADLINE_EXCEEDED` past the call timeout.
    async fn answer<T>(&self, call: impl Future<Output = Result<tonic::Response<T>, Status>>) -> Result<T, Error> {
        match tokio::time::timeout(self.call_timeout, call).await {
            Ok(answer) => Ok(answer?.into_inner()),
            Err(_) => Err(Error::NoAnswer {
                waited: self.call_timeout,
            }),
        }
    }

    /// Starts a request for the lock `name`; set options on the builder, then
    /// call [`LockBuilder::acquire`].
    pub fn lock(&self, name: impl Into<String>) -> LockBuilder {
        LockBuilder::new(self.inner.clone(), vec![name.into()], false)
    }

    /// Starts a multi-lock request: all of `names` are taken, or none. Two or more names
    /// are mutexes (the server refuses other kinds and RedLock for them); a list of one
    /// name is that lock alone, of any kind, and its lease has one fencing token.
    pub fn lock_all<I, S>(&self, names: I) -> LockBuilder
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        LockBuilder::new(self.inner.clone(), names.into_iter().map(Into::into).collect(), true)
    }

    /// Returns the current state of the lock `name` (unlocked if nobody holds it).
    pub async fn describe(&self, name: impl Into<String>) -> Result<LockState, Error> {
        let request = DescribeRequest { name: name.into() };
        self.answer(self.inner.clone().describe(request)).await
    }

    /// Returns one page of the locks whose names start with `prefix`.
    /// `page_size` 0 lets the server choose; `page_token` is empty for the first
    /// page, then the previous page's `next_page_token`.
    pub async fn list(
        &self,
        prefix: impl Into<String>,
        page_size: u32,
        page_token: impl Into<String>,
    ) -> Result<ListResponse, Error> {
        let request = ListRequest {
            prefix: prefix.into(),
            page_size,
            page_token: page_token.into(),
        };
        self.answer(self.inner.clone().list(request)).await
    }

    /// Returns every lock whose name starts with `prefix`, following the pages (and
    /// stopping at a page token seen before, should a server send one again).
    pub async fn list_all(&self, prefix: impl Into<String>) -> Result<Vec<LockState>, Error> {
        let prefix = prefix.into();
        let mut locks = Vec::new();
        let mut token = String::new();
        let mut seen = std::collections::HashSet::new();
        loop {
            let page = self.list(prefix.clone(), 0, token.clone()).await?;
            locks.extend(page.locks);
            if page.next_page_token.is_empty() || !seen.insert(page.next_page_token.clone()) {
                return Ok(locks);
            }
            token = page.next_page_token;
        }
    }

    /// Breaks the lock `name` whatever its holders (their leases end with
    /// [`LostReason::ForceReleased`]). True when the lock was held.
    pub async fn force_release(&self, name: impl Into<String>) -> Result<bool, Error> {
        let request = ForceReleaseRequest { name: name.into() };
        Ok(self.answer(self.inner.clone().force_release(request)).await?.released)
    }

    /// Watches the lock `name`: its state now, then its state after each change (a
    /// reader slower than the changes gets the latest; an unread watch holds back no
    /// other call on the connection: see [`LockWatch`]).
    pub async fn watch(&self, name: impl Into<String>) -> Result<LockWatch, Error> {
        let request = WatchRequest { name: name.into() };
        let stream = self.answer(self.inner.clone().watch(request)).await?;
        Ok(LockWatch::new(stream))
    }
}

/// Builds the endpoint for `target` (`http://host:port`, `https://host:port` with the
/// system's CAs, or `unix:///path`) with latchkey's connect timeout and HTTP/2
/// keepalive, for callers that want to adjust it before [`Client::from_channel`].
pub fn endpoint(target: &str) -> Result<Endpoint, Error> {
    ConnectOptions::default().endpoint(target)
}

/// The endpoint URI of a Unix socket reached over TLS. tonic puts TLS on a connection
/// only when its endpoint's URI is `https://` (and refuses TLS settings for a `unix://`
/// one), while the client's connector dials the target's socket whatever the URI; so
/// such a target gets this stand-in. Its host is the name the server's certificate is
/// verified for unless [`ConnectOptions::domain_name`] gives another, and the
/// `:authority` the calls carry.
pub const UNIX_TLS_URI: &str = "https://localhost";

pub(crate) fn endpoint_for(target: &str, tls: bool) -> Result<Endpoint, Error> {
    check_target(target, tls)?;
    let uri = match unix_path(target) {
        Some(_) if tls => UNIX_TLS_URI.to_owned(),
        _ => target.to_owned(),
    };
    let endpoint = Endpoint::from_shared(uri).map_err(|e| invalid_target(target, &e.to_string()))?;
    Ok(endpoint
        .connect_timeout(CONNECT_TIMEOUT)
        .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
        .keep_alive_timeout(KEEPALIVE_TIMEOUT)
        .keep_alive_while_idle(true)
        .tcp_nodelay(true))
}

/// The socket path of a `unix://` (or `unix:`) target.
pub(crate) fn unix_path(target: &str) -> Option<&str> {
    target.strip_prefix("unix://").or_else(|| target.strip_prefix("unix:"))
}

fn check_target(target: &str, tls: bool) -> Result<(), Error> {
    if let Some(path) = unix_path(target) {
        if path.is_empty() {
            return Err(invalid_target(target, "the socket path is empty"));
        }
        // gRPC's naming: `unix://` takes an absolute path, `unix:` a relative one too.
        // `unix://tmp/x.sock` read as the relative `tmp/x.sock` failed later, as a
        // server that could not be reached.
        if target.starts_with("unix://") && !path.starts_with('/') {
            return Err(invalid_target(
                target,
                &format!("unix:// takes an absolute path (unix:///{path}, or unix:{path} for a relative one)"),
            ));
        }
        return Ok(());
    }
    let rest = match (target.strip_prefix("http://"), target.strip_prefix("https://")) {
        (Some(rest), _) if tls => return Err(invalid_target(target, &format!("TLS needs https://{rest}"))),
        (Some(rest), _) => rest,
        (None, Some(rest)) => rest,
        (None, None) => {
            return Err(invalid_target(
                target,
                "expected http://host:port, https://host:port or unix:///path/to.sock",
            ))
        }
    };
    // The URI parser reads a port that is no port (`:500510`, `:5005l`) as none, and the
    // connection would go to port 80 or 443: a typo that reads as a server away.
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    let (host, port) = split_port(authority.rsplit_once('@').map_or(authority, |(_, h)| h));
    if host.is_empty() {
        return Err(invalid_target(target, "the host is missing"));
    }
    match port.map(str::parse::<u16>) {
        Some(Ok(0) | Err(_)) => Err(invalid_target(target, "the port must be 1 to 65535")),
        _ => Ok(()),
    }
}

/// Splits `host:port` (or `[v6 address]:port`) at the port's colon, if there is one.
fn split_port(authority: &str) -> (&str, Option<&str>) {
    let after_host = authority.rfind(']').map_or(0, |end| end + 1);
    match authority[after_host..].rfind(':') {
        Some(i) => (&authority[..after_host + i], Some(&authority[after_host + i + 1..])),
        None => (authority, None),
    }
}

fn invalid_target(target: &str, reason: &str) -> Error {
    Error::InvalidTarget {
        target: target.to_owned(),
        reason: reason.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_tcp_and_unix_targets() {
        assert!(endpoint("http://127.0.0.1:50051").is_ok());
        assert!(endpoint("http://localhost:1").is_ok());
        assert!(endpoint("http://[::1]:50051").is_ok());
        assert!(endpoint("https://user@host").is_ok());
        assert!(endpoint("unix:///tmp/latchkey.sock").is_ok());
        assert!(endpoint("unix:/tmp/latchkey.sock").is_ok());
        assert!(endpoint("unix:run/latchkey.sock").is_ok());
    }

    #[test]
    fn a_unix_url_with_a_relative_path_is_refused_naming_both_forms() {
        let Err(err) = endpoint("unix://tmp/latchkey.sock") else {
            panic!("unix://tmp/latchkey.sock was taken as a relative path")
        };
        let said = err.to_string();
        assert!(
            said.contains("unix:///tmp/latchkey.sock") && said.contains("unix:tmp/latchkey.sock"),
            "{said}"
        );
    }

    #[test]
    fn a_unix_target_with_tls_gets_an_https_endpoint_and_keeps_its_socket() {
        let endpoint = endpoint_for("unix:///tmp/latchkey.sock", true).expect("unix target with TLS");
        assert_eq!(endpoint.uri().to_string(), "https://localhost/");
        assert!(matches!(
            Connector::for_target("unix:///tmp/latchkey.sock"),
            Connector::Unix(path) if path == "/tmp/latchkey.sock"
        ));
        let plain = endpoint_for("unix:///tmp/latchkey.sock", false).expect("unix target");
        assert_ne!(plain.uri().scheme_str(), Some("https"));
    }

    /// A server that takes the connection and never answers (here a listener that
    /// reads nothing) fails a call answered once by the call timeout, where it used to
    /// wait for the keepalive, or for good on a connection whose transport never answers
    /// (a client certificate the server refused after the handshake).
    #[test]
    fn a_call_without_an_answer_ends_at_the_call_timeout() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let target = format!("http://{}", silent.local_addr().unwrap());
            let held = tokio::spawn(async move {
                let mut taken = Vec::new();
                while let Ok((socket, _)) = silent.accept().await {
                    taken.push(socket);
                }
            });
            let options = ConnectOptions::new().call_timeout(Duration::from_millis(300));
            let client = Client::connect_with(&target, &options).await.expect("connected");
            let asked = std::time::Instant::now();
            let err = client.describe("a").await.expect_err("no answer");
            assert!(matches!(err, Error::NoAnswer { .. }), "{err}");
            assert_eq!(err.code(), tonic::Code::DeadlineExceeded);
            assert!(!err.is_timeout(), "no wait for a lock: {err}");
            let Err(err) = client.watch("a").await else {
                panic!("a watch opened without an answer")
            };
            assert!(matches!(err, Error::NoAnswer { .. }), "{err}");
            assert!(asked.elapsed() < Duration::from_secs(2), "{:?}", asked.elapsed());
            held.abort();
        });
        let zero = ConnectOptions::new().call_timeout(Duration::ZERO);
        assert!(matches!(zero.checked_call_timeout(), Err(Error::InvalidOptions(_))));
    }

    #[test]
    fn connect_lazy_outside_a_runtime_is_an_error_not_a_panic() {
        let Err(err) = Client::connect_lazy("http://127.0.0.1:1") else {
            panic!("connect_lazy outside a runtime was not refused")
        };
        assert!(
            matches!(err, Error::InvalidOptions(ref r) if r.contains("Tokio runtime")),
            "{err}"
        );
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async { assert!(Client::connect_lazy("http://127.0.0.1:1").is_ok()) });
    }

    #[test]
    fn rejects_bad_targets() {
        let bad_ports = [
            "http://127.0.0.1:99999",
            "http://h:5005l",
            "http://h:",
            "http://h:0",
            "https://[::1]:x",
        ];
        for bad in [
            "127.0.0.1:50051",
            "https://",
            "http://",
            "unix://",
            "",
            "redis://x",
            "http://:50051",
        ]
        .into_iter()
        .chain(bad_ports)
        {
            let err = endpoint(bad).expect_err(bad);
            assert!(matches!(err, Error::InvalidTarget { .. }), "{bad}: {err}");
        }
    }
}
