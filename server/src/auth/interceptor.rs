//! Authentication, once per RPC on its headers: a bearer token in `authorization`,
//! else the client certificate's subject (mTLS). The identity found goes into the
//! request's extensions as a [`Caller`]; no credential, or one the file does not
//! know, ends the call with UNAUTHENTICATED, counted in the RPC metrics under the
//! method [`Named`] put in the extensions (the interceptor sees no path).

use super::{Auth, Caller, Credential};
use crate::error::Error;
use crate::serve::Peer;
use crate::tls::{Anchors, NameBinding, ServerTls};
use std::sync::Arc;
use std::task::{Context, Poll};
use tonic::codegen::{http, Service};
use tonic::server::NamedService;
use tonic::service::Interceptor;
use tonic::{Request, Status};
use x509_parser::extensions::GeneralName;

/// The tonic interceptor in front of `LockService` when auth is on.
#[derive(Debug, Clone)]
pub struct Authenticator {
    auth: Arc<Auth>,
    tls: Option<Arc<ServerTls>>,
}

/// Refused calls, logged sparingly: anyone who reaches the port, or a fleet with a
/// stale token, is refused on every call (the metrics count each).
static UNAUTHENTICATED: crate::repeated::Repeated = crate::repeated::Repeated::new();

impl Authenticator {
    /// Authenticates against the policy `auth` holds at each call, client certificates
    /// against the client CA of `tls`.
    pub fn new(auth: Arc<Auth>, tls: Option<Arc<ServerTls>>) -> Self {
        Self { auth, tls }
    }

    fn identify(&self, req: &Request<()>) -> Result<Caller, Error> {
        let (credential, unknown) = if let Some(token) = bearer(req)? {
            (Credential::token(token), "the bearer token is not valid")
        } else if let Some(names) = peer_names(req, self.tls.as_deref().map(ServerTls::anchors)) {
            (
                Credential::Subjects(names.into()),
                "the client certificate maps to no identity",
            )
        } else {
            return Err(Error::Unauthenticated(
                "send a bearer token (authorization: Bearer <token>) or a client certificate".into(),
            ));
        };
        match self.auth.policy().identify(&credential) {
            Some(identity) => Ok(Caller::Identity(identity, credential)),
            None => Err(Error::Unauthenticated(unknown.into())),
        }
    }
}

impl Interceptor for Authenticator {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        match self.identify(&req) {
            Ok(caller) => {
                req.extensions_mut().insert(caller);
                Ok(req)
            }
            Err(e) => {
                let peer = Peer::of(&req)
                    .and_then(|p| p.addr)
                    .map(|a| a.to_string())
                    .unwrap_or_default();
                if let Some(left_out) = UNAUTHENTICATED.due() {
                    tracing::info!(%peer, reason = %e, left_out, "unauthenticated call refused");
                }
                if let Some(RpcMethod(method)) = req.extensions().get::<RpcMethod>() {
                    crate::metrics::rpc_started(method);
                    crate::metrics::rpc_handled(method, tonic::Code::Unauthenticated);
                }
                Err(e.into())
            }
        }
    }
}

/// The method an RPC calls, as the metrics name it.
#[derive(Debug, Clone, Copy)]
struct RpcMethod(&'static str);

/// The service with the RPC's method put in each request's extensions, for the
/// interceptor inside it to count the calls it refuses.
#[derive(Debug, Clone)]
pub struct Named<S>(pub S);

impl<S: NamedService> NamedService for Named<S> {
    const NAME: &'static str = S::NAME;
}

impl<S, B> Service<http::Request<B>> for Named<S>
where
    S: Service<http::Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<B>) -> Self::Future {
        if let Some(method) = crate::service::edge::rpc_method(&req) {
            req.extensions_mut().insert(RpcMethod(method));
        }
        self.0.call(req)
    }
}

/// The bearer token of `authorization`, if the header is there.
fn bearer(req: &Request<()>) -> Result<Option<&str>, Error> {
    let Some(value) = req.metadata().get("authorization") else {
        return Ok(None);
    };
    let malformed = || Error::Unauthenticated("authorization must be \"Bearer <token>\"".into());
    let value = value.to_str().map_err(|_| malformed())?;
    let (scheme, token) = value.split_once(' ').ok_or_else(malformed)?;
    if !scheme.eq_ignore_ascii_case("bearer") || token.trim().is_empty() {
        return Err(malformed());
    }
    Ok(Some(token.trim()))
}

/// The names a verified client certificate presents: its DNS, URI and e-mail subject
/// alternative names, or, for a certificate with none, its subject's common names (as
/// RFC 6125 and browsers read them). Under a CA with name constraints (one in the chain
/// the client presented, or the one of `anchors` it chains to) only the names the
/// constraints bind count: the TLS library checks DNS names against DNS subtrees and no
/// other kind of name against anything, so a CA limited to its own domain could
/// otherwise write itself any URI, e-mail or common name (see [`NameBinding`]). An
/// alternative names extension that cannot be read leaves no name. None without a
/// certificate (plain TCP, TLS without mTLS).
pub fn peer_names<T>(req: &Request<T>, anchors: Option<&Anchors>) -> Option<Vec<String>> {
    let certs = Peer::of(req)?.certs.as_ref()?;
    let (_, cert) = x509_parser::parse_x509_certificate(certs.first()?.as_ref()).ok()?;
    let binding = anchors.map_or(NameBinding::Nothing, |a| a.binding(certs));
    let mut names = Vec::new();
    let Ok(san) = cert.subject_alternative_name() else {
        return Some(names);
    };
    if let Some(san) = san {
        names.extend(san.value.general_names.iter().filter_map(|n| match (n, binding) {
            (GeneralName::DNSName(s), NameBinding::Free | NameBinding::Dns)
            | (GeneralName::URI(s) | GeneralName::RFC822Name(s), NameBinding::Free) => Some((*s).to_owned()),
            _ => None,
        }));
    }
    if names.is_empty() && binding == NameBinding::Free {
        names.extend(
            cert.subject()
                .iter_common_name()
                .filter_map(|cn| cn.as_str().ok().map(str::to_owned)),
        );
    }
    Some(names)
}
