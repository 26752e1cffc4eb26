//! TLS material: the CA bundle trusted for `rediss://` connections.

use crate::error::Error;
use fred::rustls::pki_types::{pem::PemObject, CertificateDer};
use fred::types::config::{TlsConfig, TlsConnector};
use std::path::Path;

/// A TLS configuration for Redis that trusts only the CA certificates in `ca` (PEM).
pub fn redis_tls(ca: &Path) -> Result<TlsConfig, Error> {
    let fail = |e: &dyn std::fmt::Display| Error::Startup(format!("--redis-tls-ca {}: {e}", ca.display()));
    let mut roots = fred::rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(ca).map_err(|e| fail(&e))? {
        roots.add(cert.map_err(|e| fail(&e))?).map_err(|e| fail(&e))?;
    }
    let client = fred::rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(TlsConnector::from(client).into())
}
