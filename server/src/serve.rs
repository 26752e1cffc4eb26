//! The tonic server: TCP (and optionally a Unix socket) with HTTP/2 keepalive, TLS,
//! health and reflection (v1 and v1alpha: grpcurl 1.8 speaks only v1alpha).
//!
//! TLS is done here rather than by tonic's `ServerTlsConfig`, whose certificate is
//! fixed at start: the handshakes use [`ServerTls`], whose certificate and client CA
//! reload. Authentication guards `LockService` only; health and reflection stay
//! open so probes and grpcurl's `list` work without credentials.
//!
//! Every connection holds a descriptor: the binary raises its open-file limit at start
//! ([`raise_fd_limit`]), a connection that says nothing is closed, and accepting
//! pauses while descriptors run out instead of failing in a loop.

use crate::auth::{Auth, Authenticator};
use crate::config::Config;
use crate::error::Error;
use crate::service::edge::Oversized;
use crate::service::LockService;
use crate::shutdown::EndsAtShutdown;
use crate::tls::{tls_incoming, ServerTls};
use futures::{Stream, StreamExt};
use latchkey_proto::coalesce::Coalesced;
use latchkey_proto::v1::lock_service_server::LockServiceServer;
use rustls::pki_types::CertificateDer;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, UnixListener};
use tokio_stream::wrappers::UnixListenerStream;
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};
use tonic::service::Routes;
use tonic::transport::server::{Connected, TcpConnectInfo, TcpIncoming, TlsConnectInfo, UdsConnectInfo};
use tonic::transport::Server;

/// HTTP/2 streams a connection may open beyond its Acquire and Watch bound (unary calls).
const STREAM_HEADROOM: u32 = 64;
/// How long accepting pauses after a failed accept. With the descriptors used up
/// (EMFILE) every accept fails at once until a connection closes: trying again at
/// once would spin a core.
const ACCEPT_PAUSE: Duration = Duration::from_millis(100);
/// At most one warning about failed accepts this often; it counts the failures
/// since the last one.
const ACCEPT_WARN_EVERY: Duration = Duration::from_secs(10);
/// How long a connection may stay silent before its first bytes (the HTTP/2 preface,
/// sent at once by every gRPC client; after the TLS handshake, if any). Until then
/// HTTP/2 keepalive does not run, and a socket that never speaks would hold its
/// descriptor for good.
pub const FIRST_BYTES_TIMEOUT: Duration = Duration::from_secs(10);

/// The routes every listener serves; with `auth`, `LockService` authenticates (client
/// certificates against the client CA of `tls`).
pub fn routes(
    service: LockService,
    auth: Option<Arc<Auth>>,
    tls: Option<Arc<ServerTls>>,
    health: tonic_health::pb::health_server::HealthServer<impl tonic_health::pb::health_server::Health>,
    max_message_size: usize,
    stop: &CancellationToken,
) -> Result<Routes, Error> {
    let reflection = |b: tonic_reflection::server::Builder<'static>| {
        b.register_encoded_file_descriptor_set(latchkey_proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            // So grpcurl can show the google.rpc.ErrorInfo attached to errors.
            .register_encoded_file_descriptor_set(tonic_types::pb::FILE_DESCRIPTOR_SET)
    };
    let startup = |e: tonic_reflection::server::Error| Error::Startup(format!("reflection: {e}"));
    let v1 = reflection(tonic_reflection::server::Builder::configure())
        .build_v1()
        .map_err(startup)?;
    let v1alpha = reflection(tonic_reflection::server::Builder::configure())
        .build_v1alpha()
        .map_err(startup)?;
    let mut builder = Routes::builder();
    let service = Oversized(LockServiceServer::new(service).max_decoding_message_size(max_message_size));
    match auth {
        Some(auth) => builder.add_service(crate::auth::Named(
            tonic::service::interceptor::InterceptedService::new(service, Authenticator::new(auth, tls)),
        )),
        None => builder.add_service(service),
    };
    // Health and reflection need no token and count against no stream bound: their
    // messages are bounded too (tonic's own default is 4 MiB).
    builder
        .add_service(Oversized(health.max_decoding_message_size(max_message_size)))
        .add_service(Oversized(EndsAtShutdown::new(
            v1.max_decoding_message_size(max_message_size),
            stop.clone(),
        )))
        .add_service(Oversized(EndsAtShutdown::new(
            v1alpha.max_decoding_message_size(max_message_size),
            stop.clone(),
        )));
    Ok(builder.routes())
}

/// The bound gRPC listeners: TCP, and the Unix socket with `--unix-socket`.
#[derive(Debug)]
pub struct Listeners {
    tcp: TcpListener,
    /// The Unix socket and the file it made.
    unix: Option<(UnixListener, OwnSocket)>,
}

/// The socket file this server made (its path, device and inode), removed when
/// shutdown begins or serving ends otherwise, only if it is still the one at its path:
/// another server may have taken the path since.
#[derive(Debug)]
struct OwnSocket {
    path: std::path::PathBuf,
    made: (u64, u64),
}

impl Drop for OwnSocket {
    fn drop(&mut self) {
        use std::os::unix::fs::MetadataExt;
        let still_ours = std::fs::symlink_metadata(&self.path).is_ok_and(|m| (m.dev(), m.ino()) == self.made);
        if still_ours {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Binds the listeners now, so the caller learns the TCP address (port 0 picks one)
/// and clients can connect (they wait in the backlog until [`serve`] runs).
pub async fn bind(config: &Config) -> Result<(Listeners, SocketAddr), Error> {
    let tcp = TcpListener::bind(config.listen)
        .await
        .map_err(|e| Error::Startup(format!("--listen {}: {e}", config.listen)))?;
    let addr = tcp.local_addr().map_err(|e| Error::Startup(e.to_string()))?;
    let unix = match &config.unix_socket {
        Some(path) => Some(bind_unix(path, config.unix_socket_mode)?),
        None => None,
    };
    Ok((Listeners { tcp, unix }, addr))
}

/// Binds the Unix socket at `path`. A socket left by a run that did not stop cleanly
/// (a connection to it is refused) would make bind fail and is replaced; one that a
/// live server answers on, or that cannot be checked, is not taken from it; anything
/// else at the path (a file named by a typo) is left alone, and bind says so. With `mode` (`--unix-socket-mode`), the socket is made with it:
/// set after the bind alone, a client could connect in between (the umask's
/// permissions), and be served once accepted.
fn bind_unix(path: &std::path::Path, mode: Option<u32>) -> Result<(UnixListener, OwnSocket), Error> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
    let fail = |e: &dyn std::fmt::Display| Error::Startup(format!("--unix-socket {}: {e}", path.display()));
    let socket = std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket());
    if socket {
        // Only a refused connection tells a stale socket: one we may not connect to
        // (another user's) may well be live.
        match std::os::unix::net::UnixStream::connect(path) {
            Ok(_) => return Err(fail(&"another process listens on this socket")),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                let _ = std::fs::remove_file(path);
            }
            Err(e) => return Err(fail(&format!("an existing socket that cannot be checked: {e}"))),
        }
    }
    let listener = match mode {
        Some(mode) => with_umask_for(mode, || UnixListener::bind(path)),
        None => UnixListener::bind(path),
    }
    .map_err(|e| fail(&e))?;
    // And set again: a default ACL of the directory narrows what the umask lets through.
    if let Some(mode) = mode {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).map_err(|e| fail(&e))?;
    }
    let made = std::fs::symlink_metadata(path).map_err(|e| fail(&e))?;
    let own = OwnSocket {
        path: path.to_owned(),
        made: (made.dev(), made.ino()),
    };
    Ok((listener, own))
}

/// Runs `make` with the umask that leaves a new socket `mode` (a socket is made with
/// every permission the umask lets through), then puts the umask back. The umask is
/// the process's: this runs at start, before any task that makes files.
fn with_umask_for<T>(mode: u32, make: impl FnOnce() -> T) -> T {
    use nix::sys::stat::{umask, Mode};
    let before = umask(Mode::from_bits_truncate(!mode & 0o777));
    let made = make();
    umask(before);
    made
}

/// Serves `routes` on the TCP listener and the Unix socket until `stop` is cancelled,
/// both over TLS when `tls` is set.
pub async fn serve(
    config: &Config,
    listeners: Listeners,
    routes: Routes,
    tls: Option<Arc<ServerTls>>,
    stop: CancellationToken,
) -> Result<(), Error> {
    // TCP keepalive counts whole seconds, from 1 to 32 767 on Linux, which refuses any
    // other (and tonic warns on every connection). HTTP/2 keepalive, which finds dead
    // clients, keeps the flag.
    let tcp_keepalive = config
        .keepalive_interval
        .clamp(Duration::from_secs(1), Duration::from_secs(32_767));
    let incoming = TcpIncoming::from(listeners.tcp)
        .with_nodelay(Some(true))
        .with_keepalive(Some(tcp_keepalive));
    let tcp = serve_on(config, routes.clone(), incoming, tls.clone(), stop.clone());
    let Some((unix, own)) = listeners.unix else {
        return tcp.await;
    };
    let uds = serve_on(config, routes, UnixListenerStream::new(unix), tls, stop.clone());
    // The socket goes as shutdown begins (it takes no connection after): a server
    // started on the path during the drain replaces the file, and the filesystem may
    // give its socket the same inode, which a later check would take for this one's.
    let unlink = async move {
        stop.cancelled().await;
        drop(own);
        Ok(())
    };
    tokio::try_join!(tcp, uds, unlink).map(|_| ())
}

/// Serves `routes` on one listener's connections, through TLS when `tls` is set.
async fn serve_on<S, IO, E>(
    config: &Config,
    routes: Routes,
    incoming: S,
    tls: Option<Arc<ServerTls>>,
    stop: CancellationToken,
) -> Result<(), Error>
where
    S: Stream<Item = Result<IO, E>> + Send + 'static,
    IO: AsyncRead + AsyncWrite + Connected<ConnectInfo: ConnectInfoPeer> + Unpin + Send + 'static,
    E: std::fmt::Display + Send + 'static,
{
    let server = builder(config).add_routes(routes);
    let incoming = accepted(incoming);
    let result = match tls {
        Some(tls) => {
            let incoming = tls_incoming(incoming, tls.config());
            server
                .serve_with_incoming_shutdown(connections(incoming), stop.cancelled_owned())
                .await
        }
        None => {
            server
                .serve_with_incoming_shutdown(connections(incoming), stop.cancelled_owned())
                .await
        }
    };
    result.map_err(|e| Error::Startup(format!("grpc server: {e}")))
}

/// The connections a listener accepts. A failed accept pauses accepting for
/// [`ACCEPT_PAUSE`] and is logged as a warning, at most every [`ACCEPT_WARN_EVERY`]:
/// tonic (and a listener's stream) would try again at once and log at trace level.
pub(crate) fn accepted<S, IO, E>(incoming: S) -> impl Stream<Item = IO> + Send + 'static
where
    S: Stream<Item = Result<IO, E>> + Send + 'static,
    IO: Send + 'static,
    E: std::fmt::Display + Send + 'static,
{
    let start = (Box::pin(incoming), None::<Instant>, 0u64);
    futures::stream::unfold(start, |(mut incoming, mut warned, mut failed)| async move {
        loop {
            match incoming.next().await? {
                Ok(io) => return Some((io, (incoming, warned, failed))),
                Err(e) => {
                    failed += 1;
                    if warned.is_none_or(|at| at.elapsed() >= ACCEPT_WARN_EVERY) {
                        tracing::warn!(error = %e, failed, pause = ?ACCEPT_PAUSE, "accepting a connection failed; pausing after each failure");
                        warned = Some(Instant::now());
                        failed = 0;
                    }
                }
            }
            tokio::time::sleep(ACCEPT_PAUSE).await;
        }
    })
}

/// Accepted connections as the server takes them: numbered, coalescing writes, closed
/// when silent for [`FIRST_BYTES_TIMEOUT`], and failed once cut ([`Peer::cut`]).
fn connections<IO>(
    incoming: impl Stream<Item = IO>,
) -> impl Stream<Item = Result<Coalesced<Connection<IO>>, std::io::Error>> {
    incoming.map(|io| Ok(Coalesced::new(Connection::new(io))))
}

/// What the service knows of the connection a request came on, the same for every
/// listener. tonic's own connect info differs by listener and tells a Unix socket's
/// connections apart by nothing (their peers are all unnamed), so per-connection
/// bounds count by `id`.
#[derive(Debug, Clone)]
pub struct Peer {
    /// Unique to the connection in this process.
    pub id: u64,
    /// The client's address; none on a Unix socket.
    pub addr: Option<SocketAddr>,
    /// The client's verified certificate chain (mTLS).
    pub certs: Option<Arc<Vec<CertificateDer<'static>>>>,
    /// Cancelled to close the connection, every stream on it with it: the one way to
    /// end a stream HTTP/2 no longer polls (see [`crate::auth::Standing`]).
    pub cut: CancellationToken,
}

impl Peer {
    /// The connection `req` came on; none for a request served without a listener.
    pub fn of<T>(req: &tonic::Request<T>) -> Option<&Peer> {
        req.extensions().get()
    }
}

/// What tonic's connect info of each transport tells of the client.
pub(crate) trait ConnectInfoPeer {
    fn addr(&self) -> Option<SocketAddr>;
    fn certs(&self) -> Option<Arc<Vec<CertificateDer<'static>>>>;
}

impl ConnectInfoPeer for TcpConnectInfo {
    fn addr(&self) -> Option<SocketAddr> {
        self.remote_addr()
    }
    fn certs(&self) -> Option<Arc<Vec<CertificateDer<'static>>>> {
        None
    }
}

impl ConnectInfoPeer for UdsConnectInfo {
    fn addr(&self) -> Option<SocketAddr> {
        None
    }
    fn certs(&self) -> Option<Arc<Vec<CertificateDer<'static>>>> {
        None
    }
}

impl<T: ConnectInfoPeer> ConnectInfoPeer for TlsConnectInfo<T> {
    fn addr(&self) -> Option<SocketAddr> {
        self.get_ref().addr()
    }
    fn certs(&self) -> Option<Arc<Vec<CertificateDer<'static>>>> {
        self.peer_certs()
    }
}

/// Raises the soft limit on open descriptors to the hard limit. The usual soft
/// default (1024) runs out after about a thousand connections; the hard limit is what
/// the operator allowed. Failing (macOS refuses an unlimited hard limit) keeps it.
pub fn raise_fd_limit() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) else {
        return;
    };
    if soft >= hard {
        return;
    }
    match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
        Ok(()) => tracing::debug!(from = soft, to = hard, "open-file limit raised"),
        Err(e) => tracing::debug!(soft, hard, error = %e, "open-file limit not raised"),
    }
}

fn builder(config: &Config) -> Server {
    Server::builder()
        .http2_keepalive_interval(Some(config.keepalive_interval))
        .http2_keepalive_timeout(Some(config.keepalive_timeout))
        // Above the per-connection Acquire bound, so going over it gets a clear
        // RESOURCE_EXHAUSTED instead of a stream silently queued by HTTP/2.
        .max_concurrent_streams(config.max_streams_per_connection.saturating_add(STREAM_HEADROOM))
        .initial_connection_window_size(connection_window(config.max_streams_per_connection))
        .http2_max_pending_accept_reset_streams(Some(pending_resets(config.max_streams_per_connection)))
}

/// Streams a client may open and cancel before the server took them, per connection.
/// Past it h2 closes the connection (GOAWAY, "too_many_resets"), every lease on it
/// with it; its default, 20, is one batch of cancelled calls (a shared timeout, a
/// `select!` that went the other way) on a client that keeps all its locks on one
/// connection. As many as the streams a connection may have open keeps the bound
/// against a flood of opened-and-reset streams.
fn pending_resets(streams_per_connection: u32) -> usize {
    streams_per_connection.saturating_add(STREAM_HEADROOM) as usize
}

/// Bytes of DATA one connection may have in flight to the server. h2 closes a
/// connection (GOAWAY `ENHANCE_YOUR_CALM`, "too_many_data_frames") once its small DATA
/// frames buffered ahead of the application cost more than half this window, counting
/// up to 256 B each. Every Acquire stream's first message is such a frame: a client
/// opening thousands of streams at once (a sidecar after a restart, a batch job) would
/// lose its connection and every lease on it with the 1 MiB default. 512 B per allowed
/// stream keeps that budget above one buffered frame per stream.
fn connection_window(streams_per_connection: u32) -> u32 {
    const PER_STREAM: u32 = 512;
    const MIN: u32 = 1 << 20;
    streams_per_connection
        .saturating_mul(PER_STREAM)
        .clamp(MIN, i32::MAX as u32)
}

/// The HTTP/2 client preface (`PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n`), in bytes: HTTP/2
/// keepalive starts only once it is read.
const PREFACE_LEN: usize = 24;

/// An accepted connection: numbered for its [`Peer`], and failing its reads once it
/// has not sent the HTTP/2 preface within [`FIRST_BYTES_TIMEOUT`], so the server
/// closes it.
struct Connection<IO> {
    io: IO,
    id: u64,
    /// Until the preface has arrived.
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
    /// Bytes read so far, up to [`PREFACE_LEN`].
    read: usize,
    /// Ready once a shutdown whose streams on it could not end cuts the connection, or
    /// a reload revoked a stream on it that did not hear it: HTTP/2 polls no stream whose
    /// earlier event waits for the client's flow-control credit, so such a stream never
    /// hears of the shutdown or the reload, and only its connection's end drops it (its
    /// lock then given back).
    cut: Pin<Box<WaitForCancellationFutureOwned>>,
    /// Cancels `cut` ([`Peer::cut`]).
    own_cut: CancellationToken,
}

impl<IO> Connection<IO> {
    fn new(io: IO) -> Self {
        static NEXT_ID: AtomicU64 = AtomicU64::new(0);
        let own_cut = CancellationToken::new();
        Self {
            io,
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            deadline: Some(Box::pin(tokio::time::sleep(FIRST_BYTES_TIMEOUT))),
            read: 0,
            cut: Box::pin(own_cut.clone().cancelled_owned()),
            own_cut,
        }
    }

    /// The error every read and write answers once the connection was cut.
    fn cut(&mut self, cx: &mut Context<'_>) -> Option<std::io::Error> {
        self.cut
            .as_mut()
            .poll(cx)
            .is_ready()
            .then(|| std::io::Error::new(std::io::ErrorKind::ConnectionAborted, "the connection was cut"))
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for Connection<IO> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let this = &mut *self;
        if let Some(e) = this.cut(cx) {
            return Poll::Ready(Err(e));
        }
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.io).poll_read(cx, buf);
        if this.deadline.is_some() {
            // One byte is no preface: a connection stuck in its middle holds on for good.
            this.read += buf.filled().len() - before;
            if this.read >= PREFACE_LEN {
                this.deadline = None;
            }
        }
        let expired = polled.is_pending() && this.deadline.as_mut().is_some_and(|d| d.as_mut().poll(cx).is_ready());
        if expired {
            return Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "the connection sent nothing in time",
            )));
        }
        polled
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Connection<IO> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        if let Some(e) = self.cut(cx) {
            return Poll::Ready(Err(e));
        }
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        if let Some(e) = self.cut(cx) {
            return Poll::Ready(Err(e));
        }
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        if let Some(e) = self.cut(cx) {
            return Poll::Ready(Err(e));
        }
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

impl<IO: Connected<ConnectInfo: ConnectInfoPeer>> Connected for Connection<IO> {
    type ConnectInfo = Peer;

    fn connect_info(&self) -> Peer {
        let info = self.io.connect_info();
        Peer {
            id: self.id,
            addr: info.addr(),
            certs: info.certs(),
            cut: self.own_cut.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::with_umask_for;
    use nix::sys::stat::{umask, Mode};
    use std::os::unix::fs::PermissionsExt;

    /// The socket is made with its mode, whatever the umask lets through (a mode the
    /// umask would take bits from included), and the umask is put back.
    #[test]
    fn a_socket_is_made_with_its_mode_and_the_umask_put_back() {
        let dir = tempfile::tempdir().unwrap();
        let before = umask(Mode::from_bits_truncate(0o077));
        for (name, mode) in [("a.sock", 0o660), ("b.sock", 0o600), ("c.sock", 0o666)] {
            let path = dir.path().join(name);
            let listener = with_umask_for(mode, || std::os::unix::net::UnixListener::bind(&path)).unwrap();
            let made = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
            assert_eq!(made, mode, "{name}");
            drop(listener);
        }
        let after = umask(before);
        assert_eq!(after.bits(), 0o077, "the umask put back");
    }
}
