//! Who may do what. The auth file (`--auth-file`) maps bearer tokens and client
//! certificate subjects to identities; each identity may touch lock names under its
//! prefixes with its actions. [`Authenticator`] puts the caller's [`Caller`] in the
//! request; each RPC asks it with [`Caller::check`] before touching Redis.
//!
//! - `file`: parses the TOML into a [`Policy`].
//! - `interceptor`: [`Authenticator`], the tonic interceptor that authenticates.
//! - `standing`: [`Standing`], a stream's caller checked again at each reload.

mod file;
mod interceptor;
mod standing;

pub use file::{parse, DEFAULT_ACTIONS};
pub use interceptor::{peer_names, Authenticator, Named};
pub use standing::{revoked, still_allowed, Standing, Unheard};

use crate::error::Error;
use sha2::{Digest, Sha256};
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use subtle::ConstantTimeEq;
use tokio::sync::watch;

/// What a caller does to a lock name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// `Acquire`: take the lock (every name of a multi-lock).
    Acquire,
    /// `Describe`, `List`, `Watch`.
    Inspect,
    /// `ForceRelease`.
    ForceRelease,
}

impl Action {
    /// The name used in the auth file and in denials.
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Acquire => "acquire",
            Action::Inspect => "inspect",
            Action::ForceRelease => "force_release",
        }
    }
}

/// One identity of the auth file.
#[derive(Debug)]
pub struct Identity {
    /// The identity's name; it scopes the owner ids it presents.
    pub name: String,
    /// May do everything to every name, List across all names included.
    pub admin: bool,
    /// The lock-name prefixes it may touch (`""` is every name).
    pub prefixes: Vec<String>,
    /// What it may do under those prefixes.
    pub actions: BTreeSet<Action>,
}

impl Identity {
    /// True when this identity may do `action` to the lock `name`.
    pub fn may(&self, action: Action, name: &str) -> bool {
        self.admin || (self.actions.contains(&action) && self.prefixes.iter().any(|p| name.starts_with(p.as_str())))
    }
}

/// A parsed auth file: the identities and how credentials find them.
#[derive(Debug, Default)]
pub struct Policy {
    identities: Vec<Arc<Identity>>,
    /// SHA-256 of each token, with the index of its identity.
    tokens: Vec<([u8; 32], usize)>,
    /// Certificate subject → index of its identity.
    subjects: HashMap<String, usize>,
}

/// What a caller presented: kept with its [`Caller`], so that a stream can be checked
/// again when the auth file changes.
#[derive(Debug, Clone)]
pub enum Credential {
    /// The SHA-256 of a bearer token (the token itself is not kept).
    Token([u8; 32]),
    /// The names of a verified client certificate ([`peer_names`]).
    Subjects(Arc<[String]>),
}

impl Credential {
    /// A bearer token's credential.
    pub fn token(token: &str) -> Self {
        Credential::Token(Sha256::digest(token.as_bytes()).into())
    }
}

impl Policy {
    /// The identity of a credential: of the token whose digest it is, or of the first
    /// of a certificate's names that the file lists. Every stored digest is compared,
    /// in constant time, so the answer's timing says nothing about how close a guess
    /// came.
    pub fn identify(&self, credential: &Credential) -> Option<Arc<Identity>> {
        let found = match credential {
            Credential::Token(digest) => {
                let mut found = None;
                for (stored, index) in &self.tokens {
                    if bool::from(stored.ct_eq(digest)) {
                        found = Some(*index);
                    }
                }
                found
            }
            Credential::Subjects(names) => names.iter().find_map(|n| self.subjects.get(n)).copied(),
        };
        found.map(|i| self.identities[i].clone())
    }

    /// The identities that client certificates name (their `subjects`), in file order.
    pub fn certificate_identities(&self) -> Vec<&str> {
        let mut named: Vec<usize> = self.subjects.values().copied().collect();
        named.sort_unstable();
        named.dedup();
        named.into_iter().map(|i| self.identities[i].name.as_str()).collect()
    }

    /// How many identities the file defines.
    pub fn len(&self) -> usize {
        self.identities.len()
    }

    /// True when the file defines no identity (every call is refused).
    pub fn is_empty(&self) -> bool {
        self.identities.is_empty()
    }
}

/// The auth file in force; [`Auth::reload`] swaps in a changed file, and tells the
/// streams open (each [`Standing`]).
#[derive(Debug)]
pub struct Auth {
    path: PathBuf,
    policy: watch::Sender<Arc<Policy>>,
    /// The streams a reload may have to cut off ([`Unheard`]).
    unheard: Arc<Unheard>,
    /// The listeners ask for no client certificate (no `--tls-client-ca`).
    no_certificates: bool,
}

impl Auth {
    /// Reads the auth file at `path`, once it settles (see [`crate::reload::read_settled`]),
    /// and parses it. The bytes parsed come back too: the reload watcher compares the
    /// file with them, so a change made since is applied.
    pub async fn load(path: &Path) -> Result<(Self, Vec<u8>), Error> {
        let fail = |e: &dyn std::fmt::Display| Error::Startup(format!("--auth-file {}: {e}", path.display()));
        let read = crate::reload::read_settled(&[path.to_owned()]).await;
        let mut read = read.map_err(|(_, e)| fail(&e))?;
        let bytes = read.remove(0);
        let text = std::str::from_utf8(&bytes).map_err(|_| fail(&"is not UTF-8"))?;
        let policy = parse(text).map_err(|e| fail(&e))?;
        let auth = Self {
            path: path.to_owned(),
            policy: watch::Sender::new(Arc::new(policy)),
            unheard: Arc::default(),
            no_certificates: false,
        };
        Ok((auth, bytes))
    }

    /// Takes note that the listeners ask for no client certificate (no
    /// `--tls-client-ca`): identities the file names certificates for can use their
    /// tokens alone, which is said now and at each reload. Not refused: one auth file may
    /// serve servers with other TLS settings.
    pub fn without_client_certificates(&mut self) {
        self.no_certificates = true;
        self.warn_of_certificates(&self.policy());
    }

    fn warn_of_certificates(&self, policy: &Policy) {
        let named = policy.certificate_identities();
        if self.no_certificates && !named.is_empty() {
            tracing::warn!(
                path = %self.path.display(),
                identities = ?named,
                "the auth file names client certificates (subjects), which this server never asks for without \
                 --tls-client-ca: those identities authenticate by their tokens alone"
            );
        }
    }

    /// The file this policy comes from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The policy in force.
    pub fn policy(&self) -> Arc<Policy> {
        self.policy.borrow().clone()
    }

    /// The policy in force and each one a reload puts in force after it.
    pub fn policies(&self) -> watch::Receiver<Arc<Policy>> {
        self.policy.subscribe()
    }

    /// The streams a reload may have to cut off.
    pub fn unheard(&self) -> Arc<Unheard> {
        self.unheard.clone()
    }

    /// Parses a new version of the file; a broken one leaves the old policy in force
    /// and is reported without quoting the file.
    pub fn reload(&self, text: &[u8]) {
        let parsed = std::str::from_utf8(text)
            .map_err(|_| "is not UTF-8".to_owned())
            .and_then(parse);
        match parsed {
            Ok(policy) => {
                tracing::info!(path = %self.path.display(), identities = policy.len(), "auth file reloaded");
                self.warn_of_certificates(&policy);
                self.policy.send_replace(Arc::new(policy));
            }
            Err(e) => {
                tracing::error!(path = %self.path.display(), error = %e, "auth file not reloaded; the previous one stays in force")
            }
        }
    }
}

/// Who is calling, as the handlers see it.
#[derive(Debug, Clone)]
pub enum Caller {
    /// Auth is off: every caller may do everything, owner ids are not scoped.
    Anyone,
    /// An authenticated identity, and the credential that named it.
    Identity(Arc<Identity>, Credential),
}

impl Caller {
    /// The caller of a request: the identity the interceptor found, or
    /// [`Caller::Anyone`] when auth is off.
    pub fn of<T>(req: &tonic::Request<T>, auth_on: bool) -> Result<Caller, Error> {
        match req.extensions().get::<Caller>() {
            Some(caller) => Ok(caller.clone()),
            None if auth_on => Err(Error::Unauthenticated("no credentials".into())),
            None => Ok(Caller::Anyone),
        }
    }

    /// Ok when the caller may do `action` to the lock `name`; PERMISSION_DENIED naming
    /// both otherwise.
    pub fn check(&self, action: Action, name: &str) -> Result<(), Error> {
        match self {
            Caller::Identity(id, _) if !id.may(action, name) => Err(Error::PermissionDenied {
                identity: id.name.clone(),
                action: action.as_str(),
                name: name.to_owned(),
            }),
            _ => Ok(()),
        }
    }

    /// Ok when the caller may list under `prefix`: inspect on a prefix at least as
    /// narrow as one of its own. An empty prefix is every name: admins (or an
    /// identity granted the prefix `""`) only.
    pub fn check_list(&self, prefix: &str) -> Result<(), Error> {
        self.check(Action::Inspect, prefix).map_err(|e| match e {
            Error::PermissionDenied { identity, .. } => Error::PermissionDenied {
                identity,
                action: "list",
                name: format!("{prefix}*"),
            },
            e => e,
        })
    }

    /// The owner id written to Redis: `<identity>/<owner>` under auth, so one
    /// identity can never present another's owner id and reenter its holds.
    pub fn scope_owner(&self, owner: String) -> String {
        match self {
            Caller::Anyone => owner,
            Caller::Identity(id, _) => format!("{}/{owner}", id.name),
        }
    }

    /// The owner id as the caller knows it: [`Caller::scope_owner`] undone, so a
    /// client can present it again to reenter.
    pub fn unscope<'a>(&self, owner: &'a str) -> &'a str {
        match self {
            Caller::Anyone => owner,
            Caller::Identity(id, _) => owner
                .strip_prefix(id.name.as_str())
                .and_then(|o| o.strip_prefix('/'))
                .unwrap_or(owner),
        }
    }

    /// The caller's name for logs.
    pub fn name(&self) -> &str {
        match self {
            Caller::Anyone => "-",
            Caller::Identity(id, _) => &id.name,
        }
    }
}
