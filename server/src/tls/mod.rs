//! TLS material: the server's certificate and client CA (reloaded when their files
//! change) and the CA bundle trusted for `rediss://` connections.
//!
//! - `server`: [`ServerTls`], the rustls configuration of the gRPC listeners.
//! - `incoming`: TLS handshakes on accepted connections, off the accept loop.
//! - `validity`: warnings and a gauge for certificates that expired or run out soon.

mod incoming;
mod server;
mod validity;

pub use incoming::tls_incoming;
pub use server::{ServerTls, TlsFiles};

use crate::error::Error;
use fred::rustls::pki_types::{pem::PemObject, CertificateDer};
use fred::types::config::{TlsConfig, TlsConnector};
use std::path::Path;

/// A TLS configuration for Redis that trusts only the CA certificates in `ca` (PEM).
pub fn redis_tls(ca: &Path) -> Result<TlsConfig, Error> {
    let fail = |e: &dyn std::fmt::Display| Error::Startup(format!("--redis-tls-ca {}: {e}", ca.display()));
    let roots = roots(&std::fs::read(ca).map_err(|e| fail(&e))?).map_err(|e| fail(&e))?;
    let client = fred::rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| fail(&e))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(TlsConnector::from(client).into())
}

/// The crypto provider of every TLS configuration here: ring, as tonic's and fred's.
pub fn provider() -> std::sync::Arc<rustls::crypto::CryptoProvider> {
    std::sync::Arc::new(rustls::crypto::ring::default_provider())
}

/// A root store of every certificate in a PEM bundle; an empty bundle is an error.
pub fn roots(pem: &[u8]) -> Result<rustls::RootCertStore, String> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(pem) {
        roots
            .add(cert.map_err(|e| format!("not a PEM certificate: {e}"))?)
            .map_err(|e| e.to_string())?;
    }
    if roots.is_empty() {
        return Err("holds no PEM certificate".into());
    }
    Ok(roots)
}

/// Whether a certificate carries name constraints, or cannot be read to tell (counted
/// as constrained). Such a CA binds its certificates' alternative names only: a
/// certificate it issued with none may carry any common name, which must then identify
/// nobody (see `auth::peer_names`).
pub fn has_name_constraints(der: &[u8]) -> bool {
    x509_parser::parse_x509_certificate(der).map_or(true, |(_, cert)| !matches!(cert.name_constraints(), Ok(None)))
}

/// Whether any certificate in a PEM bundle carries name constraints.
fn any_name_constraints(pem: &[u8]) -> bool {
    CertificateDer::pem_slice_iter(pem).any(|cert| cert.map_or(true, |c| has_name_constraints(&c)))
}
