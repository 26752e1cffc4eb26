//! Throwaway certificates for TLS tests: a CA that issues server and client
//! certificates (valid, expired), written as PEM files into a temp dir.

use rcgen::{
    date_time_ymd, BasicConstraints, CertificateParams, CertifiedIssuer, DnType, GeneralSubtree, IsCa, KeyPair,
    NameConstraints, SanType,
};
use std::path::{Path, PathBuf};
use tempfile::TempDir;

/// A certificate and its key, as PEM files.
#[derive(Debug, Clone)]
pub struct CertFiles {
    /// The certificate (PEM).
    pub cert: PathBuf,
    /// Its private key (PEM).
    pub key: PathBuf,
}

impl CertFiles {
    /// The certificate's PEM text.
    pub fn cert_pem(&self) -> Vec<u8> {
        std::fs::read(&self.cert).expect("read cert")
    }

    /// The key's PEM text.
    pub fn key_pem(&self) -> Vec<u8> {
        std::fs::read(&self.key).expect("read key")
    }
}

/// A certificate authority whose files live in a temp dir (removed on Drop).
pub struct Pki {
    name: String,
    issuer: CertifiedIssuer<'static, KeyPair>,
    dir: TempDir,
}

impl std::fmt::Debug for Pki {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pki").field("name", &self.name).finish()
    }
}

impl Pki {
    /// A new CA named `name`, its certificate written to `<dir>/<name>-ca.pem`.
    pub fn new(name: &str) -> Pki {
        Self::with_params(name, ca_params(&format!("{name} test CA"), None))
    }

    /// A new CA named `name` whose name constraints permit only the DNS names under
    /// `permitted`.
    pub fn constrained(name: &str, permitted: &str) -> Pki {
        Self::with_params(name, ca_params(&format!("{name} test CA"), Some(permitted)))
    }

    fn with_params(name: &str, params: CertificateParams) -> Pki {
        let key = KeyPair::generate().expect("CA key");
        let issuer = CertifiedIssuer::self_signed(params, key).expect("CA certificate");
        let dir = tempfile::Builder::new()
            .prefix("latchkey-pki-")
            .tempdir()
            .expect("temp dir");
        std::fs::write(dir.path().join(format!("{name}-ca.pem")), issuer.pem()).expect("write CA");
        Pki {
            name: name.to_owned(),
            issuer,
            dir,
        }
    }

    /// The CA certificate file.
    pub fn ca(&self) -> PathBuf {
        self.dir.path().join(format!("{}-ca.pem", self.name))
    }

    /// The CA certificate's PEM text.
    pub fn ca_pem(&self) -> Vec<u8> {
        std::fs::read(self.ca()).expect("read CA")
    }

    /// The directory the files are written to.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// A server certificate for `localhost` and 127.0.0.1.
    pub fn server(&self, stem: &str) -> CertFiles {
        self.issue(stem, "latchkey server", &["localhost", "127.0.0.1"], false)
    }

    /// A server certificate for `localhost` and 127.0.0.1 that expired in 2021.
    pub fn expired_server(&self, stem: &str) -> CertFiles {
        self.issue(stem, "latchkey server", &["localhost", "127.0.0.1"], true)
    }

    /// A server certificate from this CA for redis-server's TLS port.
    pub fn redis_tls(&self) -> crate::redis::RedisTls {
        let cert = self.server("redis");
        crate::redis::RedisTls {
            cert: cert.cert,
            key: cert.key,
            ca: self.ca(),
        }
    }

    /// A client certificate whose subject common name is `cn`.
    pub fn client(&self, stem: &str, cn: &str) -> CertFiles {
        self.issue(stem, cn, &[], false)
    }

    /// A client certificate whose subject common name is `cn`, with `names` as subject
    /// alternative names: DNS names, or URI and e-mail names written `uri:…` and
    /// `email:…`.
    pub fn client_with_names(&self, stem: &str, cn: &str, names: &[&str]) -> CertFiles {
        self.issue(stem, cn, names, false)
    }

    /// A client certificate for `cn` that expired in 2021.
    pub fn expired_client(&self, stem: &str, cn: &str) -> CertFiles {
        self.issue(stem, cn, &[], true)
    }

    /// A client certificate whose subject common name is `cn`, with `names` as
    /// alternative names (as in [`Pki::client_with_names`]), issued by a sub-CA of this
    /// CA whose name constraints permit only the DNS names under `permitted`. The file
    /// holds the certificate, then the sub-CA's: the chain the client presents.
    pub fn client_of_constrained_sub_ca(&self, stem: &str, cn: &str, names: &[&str], permitted: &str) -> CertFiles {
        let params = ca_params(&format!("{stem} sub-CA"), Some(permitted));
        let key = KeyPair::generate().expect("sub-CA key");
        let sub_ca = CertifiedIssuer::signed_by(params, key, &self.issuer).expect("sub-CA certificate");
        let files = self.issue_by(&sub_ca, stem, cn, names, false);
        let chain = [files.cert_pem(), sub_ca.pem().into_bytes()].concat();
        std::fs::write(&files.cert, chain).expect("write chain");
        files
    }

    fn issue(&self, stem: &str, cn: &str, names: &[&str], expired: bool) -> CertFiles {
        self.issue_by(&self.issuer, stem, cn, names, expired)
    }

    fn issue_by(
        &self,
        issuer: &CertifiedIssuer<'static, KeyPair>,
        stem: &str,
        cn: &str,
        names: &[&str],
        expired: bool,
    ) -> CertFiles {
        let (typed, dns): (Vec<&str>, Vec<&str>) = names.iter().partition(|n| n.contains(':'));
        let dns: Vec<String> = dns.into_iter().map(str::to_owned).collect();
        let mut params = CertificateParams::new(dns).expect("leaf params");
        params.subject_alt_names.extend(typed.into_iter().map(|name| {
            let ia5 = |s: &str| s.try_into().expect("an IA5 name");
            match name.split_once(':') {
                Some(("uri", uri)) => SanType::URI(ia5(uri)),
                Some(("email", email)) => SanType::Rfc822Name(ia5(email)),
                _ => panic!("a name is DNS, uri:… or email:…: {name}"),
            }
        }));
        params.distinguished_name.push(DnType::CommonName, cn);
        if expired {
            params.not_before = date_time_ymd(2020, 1, 1);
            params.not_after = date_time_ymd(2021, 1, 1);
        }
        let key = KeyPair::generate().expect("leaf key");
        let cert = params.signed_by(&key, issuer).expect("leaf certificate");
        let files = CertFiles {
            cert: self.dir.path().join(format!("{stem}.pem")),
            key: self.dir.path().join(format!("{stem}-key.pem")),
        };
        std::fs::write(&files.cert, cert.pem()).expect("write cert");
        std::fs::write(&files.key, key.serialize_pem()).expect("write key");
        files
    }
}

/// A CA certificate's parameters: common name `cn`, and name constraints permitting
/// only the DNS names under `permitted`, if given.
fn ca_params(cn: &str, permitted: Option<&str>) -> CertificateParams {
    let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, cn);
    params.name_constraints = permitted.map(|dns| NameConstraints {
        permitted_subtrees: vec![GeneralSubtree::DnsName(dns.to_owned())],
        excluded_subtrees: Vec::new(),
    });
    params
}
