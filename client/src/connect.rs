//! How to reach a server: [`ConnectOptions`] (TLS, mTLS identity, bearer token), the
//! [`Credentials`] interceptor that adds the token to every call, and the connector
//! whose connections coalesce their writes.

use crate::Error;
use hyper_util::rt::TokioIo;
use latchkey_proto::coalesce::Coalesced;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::net::{TcpStream, UnixStream};
use tonic::codegen::http::Uri;
use tonic::codegen::Service;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};
use tonic::{Request, Status};

/// The longest keepalive interval or timeout a connection takes.
const MAX_KEEPALIVE: Duration = Duration::from_secs(24 * 60 * 60);
/// TLS and credentials for [`crate::Client::connect_with`]. The default is what
/// [`crate::Client::connect`] uses: plaintext, no token.
///
/// ```no_run
/// # async fn demo() -> Result<(), latchkey_client::Error> {
/// use latchkey_client::{Client, ConnectOptions};
/// let options = ConnectOptions::new()
///     .ca_pem(std::fs::read("ca.pem").unwrap())
///     .token("s3cret");
/// let client = Client::connect_with("https://latchkey.internal:50051", &options).await?;
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Default)]
pub struct ConnectOptions {
    ca: Option<Vec<u8>>,
    identity: Option<(Vec<u8>, Vec<u8>)>,
    domain: Option<String>,
    token: Option<String>,
    /// HTTP/2 keepalive interval and timeout; `None`: the defaults.
    keepalive: Option<(Duration, Duration)>,
    /// The bound of a call answered once; `None`: [`crate::CALL_TIMEOUT`].
    call_timeout: Option<Duration>,
}

impl std::fmt::Debug for ConnectOptions {
    /// Never prints the token or the private key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnectOptions")
            .field("tls", &self.ca.is_some())
            .field("client_certificate", &self.identity.is_some())
            .field("domain", &self.domain)
            .field("token", &self.token.as_ref().map(|_| "***"))
            .field("keepalive", &self.keepalive)
            .field("call_timeout", &self.call_timeout)
            .finish()
    }
}

impl ConnectOptions {
    /// No TLS, no token.
    pub fn new() -> Self {
        Self::default()
    }

    /// Trust the server certificates signed by these CA certificates (PEM) instead of
    /// the system's; turns TLS on. An `https://` target without it trusts the system's
    /// CAs (`SSL_CERT_FILE` and `SSL_CERT_DIR` name others). A `unix://` target whose
    /// server has TLS (it serves TLS on its Unix socket too) needs it.
    pub fn ca_pem(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.ca = Some(pem.into());
        self
    }

    /// Present this client certificate and key (PEM) to a server that requires
    /// mTLS. Only over TLS.
    pub fn identity_pem(mut self, cert: impl Into<Vec<u8>>, key: impl Into<Vec<u8>>) -> Self {
        self.identity = Some((cert.into(), key.into()));
        self
    }

    /// Verify the server certificate for this name instead of the target's host
    /// (e.g. when connecting by IP address); over a Unix socket the default name is
    /// `localhost`. Only over TLS.
    pub fn domain_name(mut self, name: impl Into<String>) -> Self {
        self.domain = Some(name.into());
        self
    }

    /// Send `authorization: Bearer <token>` with every call.
    pub fn token(mut self, token: impl Into<String>) -> Self {
        self.token = Some(token.into());
        self
    }

    /// Ping the connection every `interval` (also while idle) and count it dead,
    /// every lease on it lost, when a ping goes unanswered for `timeout`. Default:
    /// [`crate::KEEPALIVE_INTERVAL`] and [`crate::KEEPALIVE_TIMEOUT`]. Keep their sum
    /// below the server's `--keepalive-timeout`, so that a holder behind a silent
    /// partition is told `lost` before the server releases its lock to the next one.
    /// Both must be above zero and at most a day ([`Error::InvalidOptions`] otherwise):
    /// a zero timeout would count the connection dead at its first ping, every lease on
    /// it lost, and the HTTP/2 stack adds them to the clock, which no time too far away
    /// fits.
    pub fn keepalive(mut self, interval: Duration, timeout: Duration) -> Self {
        self.keepalive = Some((interval, timeout));
        self
    }

    /// How long Describe, List, ForceRelease and the opening of a Watch wait for the
    /// server's answer (default [`crate::CALL_TIMEOUT`]); past it they fail with
    /// [`Error::NoAnswer`]. It must be above zero ([`Error::InvalidOptions`] otherwise).
    /// An acquire is not bounded by it: its first answer comes after the server's first
    /// try, which a busy server or a slow Redis may hold up.
    pub fn call_timeout(mut self, timeout: Duration) -> Self {
        self.call_timeout = Some(timeout);
        self
    }

    /// The call timeout to use, checked.
    pub(crate) fn checked_call_timeout(&self) -> Result<Duration, Error> {
        match self.call_timeout {
            Some(timeout) if timeout.is_zero() => Err(invalid_options("call_timeout must be above zero")),
            Some(timeout) => Ok(timeout),
            None => Ok(crate::CALL_TIMEOUT),
        }
    }

    /// True when a CA was given: the connection uses TLS.
    pub fn uses_tls(&self) -> bool {
        self.ca.is_some()
    }

    /// True when the connection to `target` uses TLS: a CA was given or the target is
    /// `https://`.
    fn tls_for(&self, target: &str) -> bool {
        self.uses_tls() || target.starts_with("https://")
    }

    /// The endpoint for `target` with latchkey's timeouts and these TLS settings,
    /// for callers that build their own channel (health checks, other services). For a
    /// `unix://` target with TLS its URI is [`crate::UNIX_TLS_URI`], so connect it with a
    /// connector that dials the socket (`Endpoint::connect_with_connector`).
    pub fn endpoint(&self, target: &str) -> Result<Endpoint, Error> {
        let mut endpoint = crate::endpoint_for(target, self.tls_for(target))?;
        if let Some((interval, timeout)) = self.keepalive {
            if interval.is_zero() || timeout.is_zero() {
                return Err(invalid_options(
                    "keepalive: the interval and the timeout must be above zero",
                ));
            }
            if interval.max(timeout) > MAX_KEEPALIVE {
                return Err(invalid_options(
                    "keepalive: the interval and the timeout must be at most a day",
                ));
            }
            endpoint = endpoint.http2_keep_alive_interval(interval).keep_alive_timeout(timeout);
        }
        self.apply(target, endpoint)
    }

    /// Applies the TLS settings to `endpoint`. Settings that only TLS uses are refused
    /// on a plaintext connection rather than dropped: a client certificate or server
    /// name given for nothing means the caller expected TLS.
    fn apply(&self, target: &str, endpoint: Endpoint) -> Result<Endpoint, Error> {
        if !self.tls_for(target) {
            return match (&self.identity, &self.domain) {
                (Some(_), _) => Err(invalid_options(
                    "a client certificate needs TLS: an https:// target or a CA",
                )),
                (_, Some(_)) => Err(invalid_options(
                    "a TLS server name needs TLS: an https:// target or a CA",
                )),
                (None, None) => Ok(endpoint),
            };
        }
        let mut tls = match &self.ca {
            Some(ca) => ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca)),
            None => ClientTlsConfig::new().with_native_roots(),
        };
        if let Some((cert, key)) = &self.identity {
            tls = tls.identity(Identity::from_pem(cert, key));
        }
        if let Some(domain) = &self.domain {
            tls = tls.domain_name(domain.clone());
        }
        endpoint
            .tls_config(tls)
            .map_err(|e| invalid_options(&format!("TLS settings: {}", causes(&e))))
    }

    /// The interceptor that carries the token.
    pub(crate) fn credentials(&self) -> Result<Credentials, Error> {
        let header = match &self.token {
            None => None,
            // HTTP lets bytes above ASCII through a header; gRPC's ASCII metadata and
            // the server's comparison do not, so such a token is refused here.
            Some(token) if !token.bytes().all(|b| b == b' ' || b.is_ascii_graphic()) => {
                return Err(invalid_options("the token must be printable ASCII"));
            }
            Some(token) => Some(Arc::new(
                format!("Bearer {token}")
                    .parse()
                    .map_err(|_| invalid_options("the token must be printable ASCII"))?,
            )),
        };
        Ok(Credentials { header })
    }
}

/// Adds the bearer token (if any) to every request.
#[derive(Clone, Default)]
pub struct Credentials {
    // Boxed behind an Arc: every Client clone carries it, and it should stay small.
    header: Option<Arc<MetadataValue<Ascii>>>,
}

impl std::fmt::Debug for Credentials {
    /// Never prints the token.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("token", &self.header.as_ref().map(|_| "***"))
            .finish()
    }
}

impl Interceptor for Credentials {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        if let Some(header) = &self.header {
            req.metadata_mut().insert("authorization", MetadataValue::clone(header));
        }
        Ok(req)
    }
}

/// Opens the TCP or Unix socket of a target, with writes gathered: the frames written
/// before a flush leave in one write, and a flush goes out at once, not after the
/// process's other ready tasks ([`Coalesced::eager`]): a release of a hot lock is on
/// its next holder's path. tonic adds TLS on top when the endpoint's URI is `https://`:
/// for `https://` targets, and for `unix://` targets with TLS, whose endpoint has the
/// stand-in URI [`crate::UNIX_TLS_URI`] (the server name, `localhost` unless
/// [`ConnectOptions::domain_name`] says otherwise) while this connector dials the socket.
#[derive(Debug, Clone)]
pub(crate) enum Connector {
    /// `host:port`, resolved at each connect.
    Tcp(String),
    /// A Unix socket's path.
    Unix(String),
}

/// A connected socket, as tonic takes it.
pub(crate) type Io = TokioIo<Coalesced<Socket>>;

impl Connector {
    /// The connector for a target that `check_target` accepted.
    pub(crate) fn for_target(target: &str) -> Self {
        if let Some(path) = crate::unix_path(target) {
            return Connector::Unix(path.to_owned());
        }
        let uri: Option<Uri> = target.parse().ok();
        let host = uri.as_ref().and_then(Uri::host).unwrap_or("localhost");
        let default_port = if target.starts_with("https://") { 443 } else { 80 };
        let port = uri.as_ref().and_then(Uri::port_u16).unwrap_or(default_port);
        Connector::Tcp(format!("{host}:{port}"))
    }

    /// A channel over this connector, connected now or at the first call.
    pub(crate) async fn channel(self, endpoint: &Endpoint) -> Result<Channel, tonic::transport::Error> {
        endpoint.connect_with_connector(self).await
    }

    /// A channel that connects at its first call.
    pub(crate) fn lazy_channel(self, endpoint: &Endpoint) -> Channel {
        endpoint.connect_with_connector_lazy(self)
    }
}

impl Service<Uri> for Connector {
    type Response = Io;
    type Error = std::io::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Io, std::io::Error>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: Uri) -> Self::Future {
        let target = self.clone();
        Box::pin(async move {
            let socket = match target {
                Connector::Tcp(addr) => {
                    let addrs: Vec<SocketAddr> = tokio::net::lookup_host(addr).await?.collect();
                    let stream = connect_first(addrs).await?;
                    stream.set_nodelay(true)?;
                    Socket::Tcp(stream)
                }
                Connector::Unix(path) => Socket::Unix(UnixStream::connect(path).await?),
            };
            Ok(TokioIo::new(Coalesced::eager(socket)))
        })
    }
}

/// A TCP or Unix socket.
#[derive(Debug)]
pub(crate) enum Socket {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl tokio::io::AsyncRead for Socket {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Socket::Tcp(s) => Pin::new(s).poll_read(cx, buf),
            Socket::Unix(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl tokio::io::AsyncWrite for Socket {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            Socket::Tcp(s) => Pin::new(s).poll_write(cx, buf),
            Socket::Unix(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Socket::Tcp(s) => Pin::new(s).poll_flush(cx),
            Socket::Unix(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Socket::Tcp(s) => Pin::new(s).poll_shutdown(cx),
            Socket::Unix(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

/// How long an address's connection goes on alone before the next address is tried
/// beside it (RFC 8305's connection attempt delay).
const ATTEMPT_DELAY: Duration = Duration::from_millis(250);

/// Connects to the first of `addrs` to answer. Each address is tried [`ATTEMPT_DELAY`]
/// after the one before it, or as soon as that one failed, while the earlier attempts
/// go on: tried one after the other, an address that drops the handshake (a host that
/// is away) would take the whole connect timeout before the next was tried.
async fn connect_first(addrs: Vec<SocketAddr>) -> std::io::Result<TcpStream> {
    let mut untried = interleaved(addrs).into_iter();
    let mut attempts = tokio::task::JoinSet::new();
    let mut last_error = None;
    loop {
        if let Some(addr) = untried.next() {
            attempts.spawn(TcpStream::connect(addr));
        }
        let more = untried.len() > 0;
        let next = tokio::select! {
            next = attempts.join_next() => next,
            () = tokio::time::sleep(ATTEMPT_DELAY), if more => continue,
        };
        match next {
            Some(Ok(Ok(stream))) => return Ok(stream),
            Some(Ok(Err(e))) => last_error = Some(e),
            Some(Err(e)) => last_error = Some(std::io::Error::other(e)),
            None if more => {}
            None => {
                let none = || std::io::Error::new(std::io::ErrorKind::NotFound, "the host has no address");
                return Err(last_error.unwrap_or_else(none));
            }
        }
    }
}

/// `addrs` with their families taking turns, the first address's family first (RFC
/// 8305's interleaving): behind many IPv6 addresses that do not answer, an IPv4 one
/// is still tried within a moment.
fn interleaved(addrs: Vec<SocketAddr>) -> Vec<SocketAddr> {
    let first_v6 = addrs.first().is_some_and(SocketAddr::is_ipv6);
    let (first, second): (Vec<_>, Vec<_>) = addrs.into_iter().partition(|a| a.is_ipv6() == first_v6);
    let mut second = second.into_iter();
    let mut out = Vec::with_capacity(first.len() + second.len());
    for addr in first {
        out.push(addr);
        out.extend(second.next());
    }
    out.extend(second);
    out
}

fn invalid_options(reason: &str) -> Error {
    Error::InvalidOptions(reason.to_owned())
}

/// The innermost causes of `e` (tonic's own text is only "transport error").
fn causes(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        text = format!("{text}: {cause}");
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An address that takes no connection (a listener whose backlog is full drops the
    /// handshake, as a host that is away does) keeps the next address from no more than
    /// a moment: each is tried in turn without waiting for the one before to fail, and
    /// the first to answer is used. Tried one after the other, the first address took
    /// the whole connect timeout.
    #[tokio::test]
    async fn an_address_that_does_not_answer_leaves_the_next_one_tried() {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let silent = socket.listen(0).unwrap();
        let silent_addr = silent.local_addr().unwrap();
        let mut filling = Vec::new();
        // Fill the backlog until a connection is no longer answered at once.
        loop {
            match tokio::time::timeout(Duration::from_millis(300), TcpStream::connect(silent_addr)).await {
                Ok(Ok(stream)) => filling.push(stream),
                Ok(Err(e)) => panic!("{e}"),
                Err(_) => break,
            }
            assert!(filling.len() < 100, "the backlog never filled");
        }
        let answering = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addrs = vec![silent_addr, answering.local_addr().unwrap()];
        let connected = tokio::time::timeout(Duration::from_secs(2), connect_first(addrs)).await;
        let stream = connected.expect("connected within 2 s").unwrap();
        assert_eq!(stream.peer_addr().unwrap(), answering.local_addr().unwrap());
        drop((silent, filling));
    }

    #[test]
    fn address_families_take_turns() {
        let a = |s: &str| s.parse::<SocketAddr>().unwrap();
        let addrs = vec![
            a("[::1]:1"),
            a("[::2]:1"),
            a("[::3]:1"),
            a("10.0.0.1:1"),
            a("10.0.0.2:1"),
        ];
        let order = vec![
            a("[::1]:1"),
            a("10.0.0.1:1"),
            a("[::2]:1"),
            a("10.0.0.2:1"),
            a("[::3]:1"),
        ];
        assert_eq!(interleaved(addrs), order);
        assert_eq!(interleaved(vec![a("10.0.0.1:1")]), vec![a("10.0.0.1:1")]);
        assert!(interleaved(Vec::new()).is_empty());
    }

    #[tokio::test]
    async fn every_address_refused_is_an_error() {
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = closed.local_addr().unwrap();
        drop(closed);
        let err = connect_first(vec![addr, addr]).await.unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::ConnectionRefused, "{err}");
        let err = connect_first(Vec::new()).await.unwrap_err();
        assert!(err.to_string().contains("no address"), "{err}");
    }

    #[test]
    fn debug_output_hides_secrets() {
        let options = ConnectOptions::new()
            .ca_pem("CA")
            .identity_pem("CERT", "PRIVATE-KEY-BYTES")
            .token("s3cret-token");
        let shown = format!("{options:?} {:?}", options.credentials().unwrap());
        assert!(!shown.contains("s3cret") && !shown.contains("PRIVATE-KEY"), "{shown}");
    }

    #[test]
    fn a_zero_or_endless_keepalive_is_refused() {
        let second = Duration::from_secs(1);
        let cases = [
            (Duration::ZERO, second),
            (second, Duration::ZERO),
            (Duration::MAX, second),
            (second, Duration::MAX),
        ];
        for (interval, timeout) in cases {
            let options = ConnectOptions::new().keepalive(interval, timeout);
            let err = options.endpoint("http://127.0.0.1:1").unwrap_err();
            assert!(
                matches!(err, Error::InvalidOptions(ref r) if r.contains("keepalive")),
                "{err}"
            );
        }
        assert!(ConnectOptions::new()
            .keepalive(second, second)
            .endpoint("http://127.0.0.1:1")
            .is_ok());
    }
}
