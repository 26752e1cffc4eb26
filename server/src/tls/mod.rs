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

/// Which names of the certificates under a CA its name constraints bind, as the TLS
/// library enforces them: it checks DNS names against DNS subtrees only, and URI and
/// e-mail names against nothing. A name the CA's constraints do not bind is whatever
/// the CA chose to write, so it must identify nobody (see `auth::peer_names`). Ordered
/// from the loosest: a chain binds what its strictest CA binds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum NameBinding {
    /// No name constraints: every name is the CA's word.
    Free = 0,
    /// Constraints with a permitted DNS subtree: DNS alternative names only.
    Dns = 1,
    /// Constraints of other kinds, or a certificate that cannot be read: no name.
    Nothing = 2,
}

impl NameBinding {
    /// The binding of one CA certificate.
    pub fn of(der: &[u8]) -> Self {
        let Ok((_, cert)) = x509_parser::parse_x509_certificate(der) else {
            return Self::Nothing;
        };
        match cert.name_constraints() {
            Ok(None) => Self::Free,
            Ok(Some(nc))
                if nc.value.permitted_subtrees.as_ref().is_some_and(|subtrees| {
                    subtrees
                        .iter()
                        .any(|s| matches!(s.base, x509_parser::extensions::GeneralName::DNSName(_)))
                }) =>
            {
                Self::Dns
            }
            _ => Self::Nothing,
        }
    }

    /// The strictest binding of the certificates in a PEM bundle.
    fn of_bundle(pem: &[u8]) -> Self {
        CertificateDer::pem_slice_iter(pem)
            .map(|cert| cert.map_or(Self::Nothing, |c| Self::of(&c)))
            .max()
            .unwrap_or(Self::Free)
    }

    fn from_u8(v: u8) -> Self {
        match v {
            0 => Self::Free,
            1 => Self::Dns,
            _ => Self::Nothing,
        }
    }
}
