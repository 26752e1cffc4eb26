//! TLS material: the server's certificate and client CA (reloaded when their files
//! change) and the CA bundle trusted for `rediss://` connections.
//!
//! - `server`: [`ServerTls`], the rustls configuration of the gRPC listeners.
//! - `incoming`: TLS handshakes on accepted connections, off the accept loop.
//! - `validity`: warnings and a gauge for certificates that expired or run out soon.

mod incoming;
mod server;
mod validity;

pub(crate) use incoming::tls_incoming;
pub use server::{ServerTls, TlsFiles};

use crate::error::Error;
use fred::rustls::pki_types::{pem::PemObject, CertificateDer};
use fred::types::config::{TlsConfig, TlsConnector};
use std::collections::HashMap;
use std::path::Path;
use std::sync::RwLock;
use x509_parser::certificate::X509Certificate;

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
    fn of(cert: &X509Certificate<'_>) -> Self {
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
}

/// The [`NameBinding`] of each CA a client CA file held since start, by its subject
/// (DER): a client's chain binds what the CA it was verified against binds, and not
/// what the file's other CAs bind. CAs of earlier files stay, as connections they
/// verified may still be open.
#[derive(Debug, Default)]
pub struct Anchors(RwLock<HashMap<Vec<u8>, NameBinding>>);

impl Anchors {
    /// Adds the CAs of a PEM bundle; a subject met more than once binds its strictest.
    /// A certificate that cannot be read anchors nothing: a chain that ends at it
    /// identifies nobody by its names ([`NameBinding::Nothing`]).
    pub fn add(&self, pem: &[u8]) {
        let mut anchors = self.0.write().unwrap_or_else(|e| e.into_inner());
        for der in CertificateDer::pem_slice_iter(pem).filter_map(Result::ok) {
            if let Ok((_, cert)) = x509_parser::parse_x509_certificate(&der) {
                let binding = anchors
                    .entry(cert.subject().as_raw().to_vec())
                    .or_insert(NameBinding::Free);
                *binding = (*binding).max(NameBinding::of(&cert));
            }
        }
    }

    /// The binding of a verified chain (`chain`, as the client presented it, its own
    /// certificate first): the strictest of the CAs it presented and of the trusted CAs
    /// that any of its certificates names as its issuer (the CA it was verified
    /// against is one of them). `Nothing` when a certificate cannot be read or no
    /// trusted CA is named.
    pub fn binding(&self, chain: &[CertificateDer<'_>]) -> NameBinding {
        let anchors = self.0.read().unwrap_or_else(|e| e.into_inner());
        let mut binding = None::<NameBinding>;
        let mut presented = NameBinding::Free;
        for (i, der) in chain.iter().enumerate() {
            let Ok((_, cert)) = x509_parser::parse_x509_certificate(der) else {
                return NameBinding::Nothing;
            };
            if i > 0 {
                presented = presented.max(NameBinding::of(&cert));
            }
            if let Some(anchor) = anchors.get(cert.issuer().as_raw()) {
                binding = Some(binding.map_or(*anchor, |b| b.max(*anchor)));
            }
        }
        binding.map_or(NameBinding::Nothing, |b| b.max(presented))
    }
}
