//! The tonic server: TCP (and optionally a Unix socket) with HTTP/2 keepalive, TLS,
//! health and reflection (v1 and v1alpha: grpcurl 1.8 speaks only v1alpha).

use crate::config::Config;
use crate::error::Error;
use crate::service::LockService;
use latchkey_proto::v1::lock_service_server::LockServiceServer;
use std::net::SocketAddr;
use tokio::net::{TcpListener, UnixListener};
use tokio_stream::wrappers::UnixListenerStream;
use tokio_util::sync::CancellationToken;
use tonic::service::Routes;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Certificate, Identity, Server, ServerTlsConfig};

/// HTTP/2 streams a connection may open beyond its Acquire bound (unary calls, Watch).
const STREAM_HEADROOM: u32 = 64;

/// The routes every listener serves.
pub fn routes(
    service: LockService,
    health: tonic_health::pb::health_server::HealthServer<impl tonic_health::pb::health_server::Health>,
    max_message_size: usize,
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
    builder
        .add_service(LockServiceServer::new(service).max_decoding_message_size(max_message_size))
        .add_service(health)
        .add_service(v1)
        .add_service(v1alpha);
    Ok(builder.routes())
}

/// Binds the TCP listener now, so the caller learns the address (port 0 picks one).
pub async fn bind(config: &Config) -> Result<(TcpListener, SocketAddr), Error> {
    let listener = TcpListener::bind(config.listen)
        .await
        .map_err(|e| Error::Startup(format!("--listen {}: {e}", config.listen)))?;
    let addr = listener.local_addr().map_err(|e| Error::Startup(e.to_string()))?;
    Ok((listener, addr))
}

/// Serves `routes` on the TCP listener and the Unix socket until `stop` is cancelled.
pub async fn serve(
    config: &Config,
    listener: TcpListener,
    routes: Routes,
    stop: CancellationToken,
) -> Result<(), Error> {
    let incoming = TcpIncoming::from(listener)
        .with_nodelay(Some(true))
        .with_keepalive(Some(config.keepalive_interval));
    let tcp = builder(config)?
        .add_routes(routes.clone())
        .serve_with_incoming_shutdown(incoming, stop.clone().cancelled_owned());
    let Some(path) = &config.unix_socket else {
        return tcp.await.map_err(|e| Error::Startup(format!("grpc server: {e}")));
    };
    // A socket left by a previous run would make bind fail.
    let _ = std::fs::remove_file(path);
    let unix =
        UnixListener::bind(path).map_err(|e| Error::Startup(format!("--unix-socket {}: {e}", path.display())))?;
    let uds = builder(config)?
        .add_routes(routes)
        .serve_with_incoming_shutdown(UnixListenerStream::new(unix), stop.cancelled_owned());
    let result = tokio::try_join!(tcp, uds).map(|_| ());
    let _ = std::fs::remove_file(path);
    result.map_err(|e| Error::Startup(format!("grpc server: {e}")))
}

fn builder(config: &Config) -> Result<Server, Error> {
    let server = Server::builder()
        .http2_keepalive_interval(Some(config.keepalive_interval))
        .http2_keepalive_timeout(Some(config.keepalive_timeout))
        // Above the per-connection Acquire bound, so going over it gets a clear
        // RESOURCE_EXHAUSTED instead of a stream silently queued by HTTP/2.
        .max_concurrent_streams(config.max_streams_per_connection.saturating_add(STREAM_HEADROOM));
    match tls(config)? {
        Some(tls) => server.tls_config(tls).map_err(|e| Error::Startup(format!("tls: {e}"))),
        None => Ok(server),
    }
}

/// The server's TLS settings from `--tls-cert`, `--tls-key` and `--tls-client-ca`.
fn tls(config: &Config) -> Result<Option<ServerTlsConfig>, Error> {
    let (Some(cert), Some(key)) = (&config.tls_cert, &config.tls_key) else {
        return Ok(None);
    };
    let read = |p: &std::path::PathBuf| std::fs::read(p).map_err(|e| Error::Startup(format!("{}: {e}", p.display())));
    let mut tls = ServerTlsConfig::new().identity(Identity::from_pem(read(cert)?, read(key)?));
    if let Some(ca) = &config.tls_client_ca {
        tls = tls.client_ca_root(Certificate::from_pem(read(ca)?));
    }
    Ok(Some(tls))
}
