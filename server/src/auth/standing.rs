//! A stream's caller, checked again at each reload of the auth file. A call is
//! authenticated once, when it opens, and a held lease or a Watch may last for days: a
//! reload that drops the stream's credential, gives it to another identity, or takes
//! from its identity the action on the stream's names ends the stream with the status
//! a new call would get (an Acquire stream's hold is released as it ends).

use super::{Action, Caller, Policy};
use crate::error::Error;
use std::sync::Arc;
use std::task::{Context, Poll};
use tokio_stream::wrappers::WatchStream;
use tokio_stream::Stream;

/// An authenticated stream's caller and the policies put in force while it runs.
pub struct Standing {
    caller: Caller,
    policies: WatchStream<Arc<Policy>>,
}

impl std::fmt::Debug for Standing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Standing").field("caller", &self.caller.name()).finish()
    }
}

impl Standing {
    /// The standing of `caller` under the policies of `auth`; `None` when auth is off.
    /// The policy in force now is the first checked: a reload between the call's
    /// authentication and its stream's start is not missed.
    pub fn new(auth: Option<&super::Auth>, caller: &Caller) -> Option<Box<Self>> {
        match (auth, caller) {
            (Some(auth), Caller::Identity(..)) => Some(Box::new(Self {
                caller: caller.clone(),
                policies: WatchStream::new(auth.policies()),
            })),
            _ => None,
        }
    }

    /// Ready with the refusal once a policy put in force no longer lets the caller do
    /// `action` to each of `names`.
    pub fn poll_revoked<'a, I>(&mut self, cx: &mut Context<'_>, action: Action, names: I) -> Poll<Error>
    where
        I: IntoIterator<Item = &'a str> + Clone,
    {
        // After the policy's sender is gone (the server is stopping) nothing changes.
        while let Poll::Ready(Some(policy)) = std::pin::Pin::new(&mut self.policies).poll_next(cx) {
            match still_allowed(&self.caller, &policy, action, names.clone()) {
                Ok(caller) => self.caller = caller,
                Err(e) => return Poll::Ready(e),
            }
        }
        Poll::Pending
    }
}

/// The refusal, once a reload takes the caller's `action` on `names` away; never
/// without a standing (auth off).
pub async fn revoked<'a, I>(standing: Option<&mut Standing>, action: Action, names: I) -> Error
where
    I: IntoIterator<Item = &'a str> + Clone,
{
    match standing {
        Some(standing) => std::future::poll_fn(|cx| standing.poll_revoked(cx, action, names.clone())).await,
        None => std::future::pending().await,
    }
}

/// The caller as `policy` has it, if that policy still gives its credential the same
/// identity and lets it do `action` to each of `names`; else the status a new call
/// would get. (Anyone, with auth off, is allowed everything.)
pub fn still_allowed<'a>(
    caller: &Caller,
    policy: &Policy,
    action: Action,
    names: impl IntoIterator<Item = &'a str>,
) -> Result<Caller, Error> {
    let Caller::Identity(was, credential) = caller else {
        return Ok(Caller::Anyone);
    };
    let now = policy.identify(credential).ok_or_else(|| {
        Error::Unauthenticated(format!(
            "the credential of identity {:?} was revoked (the auth file changed)",
            was.name
        ))
    })?;
    if now.name != was.name {
        return Err(Error::Unauthenticated(format!(
            "the credential of identity {:?} now names identity {:?} (the auth file changed)",
            was.name, now.name
        )));
    }
    let caller = Caller::Identity(now, credential.clone());
    for name in names {
        caller.check(action, name)?;
    }
    Ok(caller)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::{parse, Credential};

    fn caller(policy: &Policy, token: &str) -> Caller {
        let credential = Credential::token(token);
        Caller::Identity(policy.identify(&credential).unwrap(), credential)
    }

    const BEFORE: &str = r#"
[[identity]]
name = "billing"
tokens = ["t1", "t2"]
prefixes = ["billing/", "shared/"]
"#;

    #[test]
    fn a_reload_that_keeps_the_callers_rights_keeps_it() {
        let before = parse(BEFORE).unwrap();
        let c = caller(&before, "t1");
        let names = ["billing/a", "shared/b"];
        assert!(still_allowed(&c, &before, Action::Acquire, names).is_ok());
        let widened = parse(&BEFORE.replace(r#""shared/"]"#, r#""shared/", "other/"]"#)).unwrap();
        assert!(still_allowed(&c, &widened, Action::Acquire, names).is_ok());
    }

    #[test]
    fn a_revoked_token_a_renamed_identity_and_a_dropped_prefix_are_refused() {
        let before = parse(BEFORE).unwrap();
        let c = caller(&before, "t1");
        let names = ["billing/a", "shared/b"];
        let revoked = parse(&BEFORE.replace(r#""t1", "#, "")).unwrap();
        let e = still_allowed(&c, &revoked, Action::Acquire, names).unwrap_err();
        assert!(matches!(&e, Error::Unauthenticated(m) if m.contains("revoked")), "{e}");
        let renamed = parse(&BEFORE.replace(r#""billing""#, r#""finance""#)).unwrap();
        let e = still_allowed(&c, &renamed, Action::Acquire, names).unwrap_err();
        assert!(
            matches!(&e, Error::Unauthenticated(m) if m.contains("\"finance\"")),
            "{e}"
        );
        let narrowed = parse(&BEFORE.replace(r#", "shared/""#, "")).unwrap();
        let e = still_allowed(&c, &narrowed, Action::Acquire, names).unwrap_err();
        assert!(
            matches!(&e, Error::PermissionDenied { name, action: "acquire", .. } if name == "shared/b"),
            "{e}"
        );
        // Another token of the identity is still good.
        assert!(still_allowed(&caller(&before, "t2"), &revoked, Action::Acquire, names).is_ok());
    }
}
