//! TLS on accepted connections. Each handshake runs in its own task with a time
//! bound, so a slow or silent client never holds up the accept loop; failed
//! handshakes (wrong CA, expired or missing client certificate) are counted, logged
//! sparingly (a misconfigured client retries every second or so) and dropped.

use futures::{Stream, StreamExt};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::mpsc;
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::Connected;

use crate::serve::ConnectInfoPeer;

/// How long a client may take to complete the TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Completed handshakes waiting for the server to take them.
const READY_BUFFER: usize = 64;
/// Refused handshakes: a client with the wrong certificate retries on every backoff,
/// each one a refusal.
static REFUSED: crate::repeated::Repeated = crate::repeated::Repeated::new();

/// The TLS connections of `incoming` (accepted connections: failed accepts are dealt
/// with before), handshaken with `config`.
pub(crate) fn tls_incoming<S, IO>(incoming: S, config: Arc<rustls::ServerConfig>) -> impl Stream<Item = TlsStream<IO>>
where
    S: Stream<Item = IO> + Send + 'static,
    IO: AsyncRead + AsyncWrite + Connected<ConnectInfo: ConnectInfoPeer> + Unpin + Send + 'static,
{
    let acceptor = TlsAcceptor::from(config);
    let (tx, rx) = mpsc::channel(READY_BUFFER);
    tokio::spawn(async move {
        let mut incoming = std::pin::pin!(incoming);
        loop {
            // Stop (and close the listener) as soon as the server stops taking connections.
            let conn = tokio::select! {
                _ = tx.closed() => return,
                conn = incoming.next() => conn,
            };
            let Some(io) = conn else {
                return;
            };
            let (acceptor, tx) = (acceptor.clone(), tx.clone());
            let peer = io.connect_info().addr();
            tokio::spawn(async move {
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(io)).await {
                    Ok(Ok(tls)) => {
                        let _ = tx.send(tls).await;
                    }
                    // A probe that connects and closes is routine; a refused
                    // certificate (wrong CA, expired, missing) is worth seeing.
                    Ok(Err(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                        tracing::debug!(error = %e, "tls handshake ended early")
                    }
                    Ok(Err(e)) => refused(&e, peer),
                    Err(_) => tracing::debug!("tls handshake timed out"),
                }
            });
        }
    });
    ReceiverStream::new(rx)
}

/// Counts a refused handshake and logs it unless one was logged lately, with the
/// client's address (none on the Unix socket), so the client with the wrong
/// certificate can be found.
fn refused(e: &std::io::Error, peer: Option<std::net::SocketAddr>) {
    crate::metrics::tls_handshake_failed(1);
    if let Some(left_out) = REFUSED.due() {
        let peer = peer.map_or_else(|| "the unix socket".to_owned(), |a| a.to_string());
        tracing::info!(error = %e, %peer, left_out, "tls handshake failed");
    }
}
