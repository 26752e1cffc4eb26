//! The gRPC listeners' rustls configuration. The certificate and the client CA sit
//! behind a resolver and a verifier whose contents [`ServerTls::reload`] swaps, so
//! new connections use changed files without a restart; open connections keep the
//! certificate they were made with. Under mTLS sessions are not resumed, so every
//! new connection's client certificate meets the verifier in force.

use super::{provider, roots, validity, Anchors};
use crate::error::Error;
use rustls::client::danger::HandshakeSignatureValid;
use rustls::pki_types::{pem::PemObject, CertificateDer, PrivateKeyDer, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls::{DigitallySignedStruct, DistinguishedName, SignatureScheme};
use std::path::PathBuf;
use std::sync::{Arc, RwLock};

/// The files behind the server's TLS, as given on the command line.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    /// `--tls-cert`: the certificate chain (PEM).
    pub cert: PathBuf,
    /// `--tls-key`: its private key (PEM).
    pub key: PathBuf,
    /// `--tls-client-ca`: the CA client certificates must chain to (mTLS).
    pub client_ca: Option<PathBuf>,
}

impl TlsFiles {
    /// Every file, in the order [`ServerTls::reload`] expects their contents.
    pub fn paths(&self) -> Vec<PathBuf> {
        let mut paths = vec![self.cert.clone(), self.key.clone()];
        paths.extend(self.client_ca.clone());
        paths
    }

    /// A file's flag and path, as errors name it: the flag is what an operator fixes.
    fn named(&self, file: TlsFile) -> String {
        let (flag, path) = match file {
            TlsFile::Cert => ("--tls-cert", Some(&self.cert)),
            TlsFile::Key => ("--tls-key", Some(&self.key)),
            TlsFile::ClientCa => ("--tls-client-ca", self.client_ca.as_ref()),
        };
        match path {
            Some(path) => format!("{flag} {}", path.display()),
            None => flag.to_owned(),
        }
    }
}

/// The files of [`TlsFiles::paths`], in that order.
#[derive(Debug, Clone, Copy)]
enum TlsFile {
    Cert,
    Key,
    ClientCa,
}

impl TlsFile {
    const ALL: [TlsFile; 3] = [TlsFile::Cert, TlsFile::Key, TlsFile::ClientCa];
}

/// The server's TLS: a rustls configuration whose certificate and client CA reload.
#[derive(Debug)]
pub struct ServerTls {
    files: TlsFiles,
    resolver: Arc<Swapped<CertifiedKey>>,
    verifier: Option<Arc<Swapped<dyn ClientCertVerifier>>>,
    config: Arc<rustls::ServerConfig>,
    /// When the files' certificates run out, as loaded at start.
    expiry: Vec<validity::Expiry>,
    /// The name bindings of the CAs of the client CA files loaded since start.
    anchors: Anchors,
}

impl ServerTls {
    /// Loads the files once they settle (see [`crate::reload::read_settled`]); an
    /// unreadable or inconsistent file stops the start. Their contents, as parsed, come
    /// back too (in [`TlsFiles::paths`] order): the reload watcher compares the files
    /// with them, so a change made since is applied.
    pub async fn load(files: TlsFiles) -> Result<(Self, Vec<Vec<u8>>), Error> {
        let contents = crate::reload::read_settled(&files.paths()).await;
        let contents = contents.map_err(|(i, e)| startup(&files, TlsFile::ALL[i])(e))?;
        let key = certified_key(&contents[0], &contents[1]).map_err(|(file, e)| startup(&files, file)(e))?;
        let mut expiry = vec![validity::check("cert", &files.cert, &key.cert)];
        let resolver = Arc::new(Swapped::new(key));
        let verifier = match &files.client_ca {
            Some(ca) => {
                let verifier = client_verifier(&contents[2]).map_err(startup(&files, TlsFile::ClientCa))?;
                expiry.push(check_ca(ca, &contents[2]));
                Some(Arc::new(Swapped::new(verifier)))
            }
            None => None,
        };
        let builder = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| Error::Startup(format!("tls: {e}")))?;
        let builder = match &verifier {
            Some(v) => builder.with_client_cert_verifier(v.clone()),
            None => builder.with_no_client_auth(),
        };
        let mut config = builder.with_cert_resolver(resolver.clone());
        // gRPC runs on HTTP/2; clients such as grpc-go insist on ALPN saying so.
        config.alpn_protocols = vec![b"h2".to_vec()];
        if verifier.is_some() {
            // A resumed handshake takes the client certificate from the session and
            // never asks the verifier: a client whose CA was replaced (or whose
            // certificate expired) would keep its identity on every new connection.
            // Each connection verifies its certificate in full instead.
            config.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
            config.send_tls13_tickets = 0;
        }
        let anchors = Anchors::default();
        if files.client_ca.is_some() {
            anchors.add(&contents[2]);
        }
        let tls = Self {
            files,
            resolver,
            verifier,
            config: Arc::new(config),
            expiry,
            anchors,
        };
        Ok((tls, contents))
    }

    /// Publishes when the certificates loaded at start run out, once the metrics
    /// recorder is installed (reloads publish their own).
    pub fn publish_expiry(&self) {
        self.expiry.iter().copied().for_each(validity::publish);
    }

    /// The rustls configuration of the listeners.
    pub fn config(&self) -> Arc<rustls::ServerConfig> {
        self.config.clone()
    }

    /// The files to watch.
    pub fn files(&self) -> &TlsFiles {
        &self.files
    }

    /// The CAs client certificates chain to, or did in a client CA file loaded since
    /// start: which names of a client's chain identify it (see `auth::peer_names`).
    pub fn anchors(&self) -> &Anchors {
        &self.anchors
    }

    /// Swaps in changed files (`contents` in [`TlsFiles::paths`] order). A broken
    /// certificate, key or CA is logged and the previous one stays in force.
    pub fn reload(&self, contents: &[Vec<u8>]) {
        match certified_key(&contents[0], &contents[1]) {
            Ok(key) => {
                validity::publish(validity::check("cert", &self.files.cert, &key.cert));
                self.resolver.set(key);
                tracing::info!(cert = %self.files.cert.display(), "tls certificate reloaded");
            }
            Err((file, e)) => {
                tracing::error!(file = %self.files.named(file), error = %e, "tls certificate not reloaded; the previous one stays in force")
            }
        }
        let (Some(verifier), Some(ca)) = (&self.verifier, &self.files.client_ca) else {
            return;
        };
        match client_verifier(&contents[2]) {
            Ok(v) => {
                validity::publish(check_ca(ca, &contents[2]));
                // Before the swap, so no handshake the new CA verifies finds it unknown.
                self.anchors.add(&contents[2]);
                verifier.set(v);
                tracing::info!(ca = %ca.display(), "tls client CA reloaded");
            }
            Err(e) => {
                tracing::error!(ca = %ca.display(), error = %e, "tls client CA not reloaded; the previous one stays in force")
            }
        }
    }
}

fn startup(files: &TlsFiles, file: TlsFile) -> impl Fn(String) -> Error + '_ {
    move |e| Error::Startup(format!("{}: {e}", files.named(file)))
}

/// A certificate chain and its key, checked to belong together; an error names the
/// file at fault (the key's when the two do not match).
fn certified_key(cert_pem: &[u8], key_pem: &[u8]) -> Result<Arc<CertifiedKey>, (TlsFile, String)> {
    let chain = CertificateDer::pem_slice_iter(cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| (TlsFile::Cert, format!("not a PEM certificate chain: {e}")))?;
    if chain.is_empty() {
        return Err((TlsFile::Cert, "holds no PEM certificate".into()));
    }
    // The key's own parse error may quote key material: say only that it failed.
    let key = PrivateKeyDer::from_pem_slice(key_pem)
        .map_err(|_| (TlsFile::Key, "holds no usable PEM private key".to_owned()))?;
    CertifiedKey::from_der(chain, key, &provider())
        .map(Arc::new)
        .map_err(|e| {
            (
                TlsFile::Key,
                format!("does not form a usable pair with --tls-cert: {e}"),
            )
        })
}

/// Checks the validity of the client CA's certificates (`ca_pem`, read from `path`).
fn check_ca(path: &std::path::Path, ca_pem: &[u8]) -> validity::Expiry {
    let certs: Vec<_> = CertificateDer::pem_slice_iter(ca_pem).filter_map(Result::ok).collect();
    validity::check("client-ca", path, &certs)
}

/// A verifier requiring client certificates that chain to the CAs in `ca_pem`.
fn client_verifier(ca_pem: &[u8]) -> Result<Arc<dyn ClientCertVerifier>, String> {
    WebPkiClientVerifier::builder_with_provider(Arc::new(roots(ca_pem)?), provider())
        .build()
        .map_err(|e| e.to_string())
}

/// A value read by every handshake and swapped by reloads.
#[derive(Debug)]
struct Swapped<T: ?Sized>(RwLock<Arc<T>>);

impl<T: ?Sized> Swapped<T> {
    fn new(value: Arc<T>) -> Self {
        Self(RwLock::new(value))
    }

    fn get(&self) -> Arc<T> {
        // Writers only swap the Arc, so a poisoned lock still holds a whole value.
        self.0.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn set(&self, value: Arc<T>) {
        *self.0.write().unwrap_or_else(|e| e.into_inner()) = value;
    }
}

impl ResolvesServerCert for Swapped<CertifiedKey> {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.get())
    }
}

impl ClientCertVerifier for Swapped<dyn ClientCertVerifier> {
    fn client_auth_mandatory(&self) -> bool {
        self.get().client_auth_mandatory()
    }

    /// No hints: the CA may change under a borrowed list. An empty list lets the
    /// client send whichever certificate it has.
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.get().verify_client_cert(end_entity, intermediates, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.get().verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.get().verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.get().supported_verify_schemes()
    }
}
