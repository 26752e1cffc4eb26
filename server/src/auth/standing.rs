//! A stream's caller, checked again at each reload of the auth file. A call is
//! authenticated once, when it opens, and a held lease or a Watch may last for days: a
//! reload that drops the stream's credential, gives it to another identity, or takes
//! from its identity the action on the stream's names ends the stream with the status
//! a new call would get (an Acquire stream's hold is released as it ends).
//!
//! A stream runs that check when HTTP/2 polls it, and HTTP/2 polls no stream whose
//! client gives it no flow-control credit (a client that stopped reading). An Acquire
//! stream so left would keep what it holds, a fixed lease to its end, or its place in
//! line, where it could be handed a lock that nobody renews. Such streams are listed
//! ([`Unheard`]) with their connection: one still listed a while after a reload that
//! refuses it did not hear it, and its connection is cut, which drops the stream and
//! gives back what it held or waited for.

use super::{Action, Caller, Policy};
use crate::error::Error;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::sync::watch;
use tokio_stream::wrappers::WatchStream;
use tokio_stream::Stream;
use tokio_util::sync::CancellationToken;

/// How long a listed stream a reload refuses has to hear it before its connection is
/// cut. A polled stream hears it at once; this only leaves room for a busy server.
pub const HEAR_WITHIN: Duration = Duration::from_secs(2);

/// An authenticated stream's caller and the policies put in force while it runs.
pub struct Standing {
    caller: Caller,
    policies: WatchStream<Arc<Policy>>,
    /// Where the stream is listed once its names are known, when its connection can be
    /// cut (an Acquire stream's).
    listing: Option<Listing>,
}

impl std::fmt::Debug for Standing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Standing").field("caller", &self.caller.name()).finish()
    }
}

impl Standing {
    /// The standing of `caller` under the policies of `auth`; `None` when auth is off.
    /// The policy in force now is the first checked: a reload between the call's
    /// authentication and its stream's start is not missed. With `cut` (the stream's
    /// connection), [`Standing::list`] lists the stream for the reloads it may not hear.
    pub fn new(auth: Option<&super::Auth>, caller: &Caller, cut: Option<&CancellationToken>) -> Option<Box<Self>> {
        match (auth, caller) {
            (Some(auth), Caller::Identity(..)) => Some(Box::new(Self {
                caller: caller.clone(),
                policies: WatchStream::new(auth.policies()),
                listing: cut.map(|cut| Listing {
                    unheard: auth.unheard.clone(),
                    cut: cut.clone(),
                    id: None,
                }),
            })),
            _ => None,
        }
    }

    /// Lists the stream, now that it does `action` to `names`, so that a reload it does
    /// not hear cuts its connection (see [`Unheard`]).
    pub fn list<'a>(&mut self, action: Action, names: impl IntoIterator<Item = &'a str>) {
        if let Some(listing) = self.listing.as_mut() {
            let stream = Listed {
                caller: self.caller.clone(),
                action,
                names: names.into_iter().map(str::to_owned).collect(),
                cut: listing.cut.clone(),
                since: Instant::now(),
            };
            listing.id = Some(listing.unheard.add(stream));
        }
    }

    /// Ready with the refusal once a policy put in force no longer lets the caller do
    /// `action` to each of `names`; the stream, which heard it, is no longer listed.
    pub fn poll_revoked<'a, I>(&mut self, cx: &mut Context<'_>, action: Action, names: I) -> Poll<Error>
    where
        I: IntoIterator<Item = &'a str> + Clone,
    {
        // After the policy's sender is gone (the server is stopping) nothing changes.
        while let Poll::Ready(Some(policy)) = std::pin::Pin::new(&mut self.policies).poll_next(cx) {
            match still_allowed(&self.caller, &policy, action, names.clone()) {
                Ok(caller) => self.caller = caller,
                Err(e) => {
                    self.listing = None;
                    return Poll::Ready(e);
                }
            }
        }
        Poll::Pending
    }
}

/// A stream's place in [`Unheard`], removed when dropped.
struct Listing {
    unheard: Arc<Unheard>,
    /// The stream's connection.
    cut: CancellationToken,
    id: Option<u64>,
}

impl Drop for Listing {
    fn drop(&mut self) {
        if let Some(id) = self.id {
            self.unheard.remove(id);
        }
    }
}

/// One listed stream: who does what to which names, its connection, and since when.
struct Listed {
    caller: Caller,
    action: Action,
    names: Box<[String]>,
    cut: CancellationToken,
    since: Instant,
}

/// The authenticated Acquire streams that hold or wait for a lock, until they end or
/// hear a reload that refuses them (see the module's doc).
#[derive(Default)]
pub struct Unheard {
    streams: Mutex<HashMap<u64, Arc<Listed>>>,
    next_id: AtomicU64,
}

impl std::fmt::Debug for Unheard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Unheard").field("streams", &self.lock().len()).finish()
    }
}

impl Unheard {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<Listed>>> {
        self.streams.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn add(&self, stream: Listed) -> u64 {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.lock().insert(id, Arc::new(stream));
        id
    }

    /// Unlists a stream; the map gives back most of its room once a burst of streams
    /// has ended (a map keeps its largest size otherwise).
    fn remove(&self, id: u64) {
        let mut streams = self.lock();
        streams.remove(&id);
        if streams.capacity() > 64 && streams.len() < streams.capacity() / 4 {
            let keep = streams.len() * 2;
            streams.shrink_to(keep);
        }
    }

    /// Cuts the connection of each stream listed before `reload` that `policy`, put in
    /// force by that reload [`HEAR_WITHIN`] ago, refuses: such a stream did not hear it
    /// (one that heard it is no longer listed, and one listed after it checked it at its
    /// first poll). Every stream on that connection ends with it, the client's others
    /// too. Returns how many listed streams were found deaf. (Run off the async
    /// threads: each check looks the credential up among all the policy's tokens.)
    pub fn cut_refused(&self, policy: &Policy, reload: Instant) -> usize {
        let listed: Vec<_> = self.lock().values().filter(|s| s.since < reload).cloned().collect();
        let mut deaf = 0;
        for stream in listed {
            let names = stream.names.iter().map(String::as_str);
            if let Err(e) = still_allowed(&stream.caller, policy, stream.action, names) {
                let name = stream.names.first().map_or("", String::as_str);
                tracing::warn!(identity = stream.caller.name(), lock = name, error = %e, "a revoked stream did not hear the reload (its client reads nothing); its connection is cut");
                // Counted first, so the count is in before the client sees its end.
                crate::metrics::unheard_cut(1);
                stream.cut.cancel();
                deaf += 1;
            }
        }
        deaf
    }

    /// [`HEAR_WITHIN`] after each reload of `policies`, cuts off the streams that did
    /// not hear it ([`Unheard::cut_refused`]); until the server stops. Each reload is
    /// checked on its own: reloads that keep coming put no check off.
    pub async fn follow(self: Arc<Self>, mut policies: watch::Receiver<Arc<Policy>>, stop: CancellationToken) {
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                changed = policies.changed() => if changed.is_err() { return },
            }
            let (policy, reload) = (policies.borrow_and_update().clone(), Instant::now());
            let (unheard, stop) = (self.clone(), stop.clone());
            tokio::spawn(async move {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(HEAR_WITHIN) => {}
                }
                let check = tokio::task::spawn_blocking(move || unheard.cut_refused(&policy, reload));
                let _ = check.await;
            });
        }
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

    /// A reload cuts off the listed streams it refuses, and no other: not one still
    /// allowed, not one that heard it (no longer listed), not one that ended, not one
    /// listed after it.
    #[tokio::test]
    async fn a_reload_cuts_off_only_the_listed_streams_it_refuses() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("auth.toml");
        std::fs::write(&path, BEFORE).unwrap();
        let (auth, _) = crate::auth::Auth::load(&path).await.unwrap();
        let before = auth.policy();
        let stream = |token: &str, name: &'static str| {
            let cut = CancellationToken::new();
            let mut standing = Standing::new(Some(&auth), &caller(&before, token), Some(&cut)).unwrap();
            standing.list(Action::Acquire, [name]);
            (standing, cut)
        };
        let (_deaf, deaf_cut) = stream("t1", "shared/b");
        let (_allowed, allowed_cut) = stream("t1", "billing/a");
        let (mut heard, heard_cut) = stream("t1", "shared/c");
        let (ended, ended_cut) = stream("t1", "shared/d");
        drop(ended);
        // A Watch's standing is never listed.
        let mut watch = Standing::new(Some(&auth), &caller(&before, "t1"), None).unwrap();
        watch.list(Action::Inspect, ["shared/e"]);
        assert_eq!(auth.unheard.lock().len(), 3);

        auth.reload(BEFORE.replace(r#", "shared/""#, "").as_bytes());
        let reload = Instant::now();
        // Listed after the reload: its first poll checks the policy in force.
        let (_late, late_cut) = stream("t1", "shared/f");
        let heard_it = std::future::poll_fn(|cx| heard.poll_revoked(cx, Action::Acquire, ["shared/c"]));
        let revoked = tokio::time::timeout(Duration::from_secs(1), heard_it).await.unwrap();
        assert!(matches!(revoked, Error::PermissionDenied { .. }), "{revoked}");
        assert_eq!(auth.unheard.cut_refused(&auth.policy(), reload), 1);
        assert!(deaf_cut.is_cancelled());
        for (cut, what) in [
            (allowed_cut, "allowed"),
            (heard_cut, "heard"),
            (ended_cut, "ended"),
            (late_cut, "late"),
        ] {
            assert!(!cut.is_cancelled(), "{what}");
        }
    }

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
