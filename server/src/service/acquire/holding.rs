//! Holding and releasing. A held lease is a small record polled for whatever ends it
//! first: the client's `release` or half-close, the watchdog's notice (lock gone,
//! force-released, server shutting down) or a fixed lease running out. Then the
//! release runs as one more step and the stream ends.

use super::waiting::LeaseFrom;
use super::{Ended, Session};
use crate::error::Error;
use crate::lock::{Grant, Request, Unrecorded};
use crate::service::convert;
use crate::watchdog::{Lease, LostReason};
use latchkey_proto::v1::{acquire_request::Action, acquire_response::Event, lost::Reason};
use latchkey_proto::v1::{AcquireRequest, Released};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll};
use tokio::time::Sleep;
use tokio_stream::Stream;
use tokio_util::sync::WaitForCancellationFutureOwned;
use tonic::Status;

/// The log target of lease events. A grant and a release log at debug: at info, two
/// lines per lock cycle cost a busy server about a tenth of its throughput. Lost
/// leases log at info. `RUST_LOG=info,latchkey::lease=debug` logs every event.
const LEASE_LOG: &str = "latchkey::lease";

/// What ended a held lease.
pub(super) enum HoldEnd {
    /// The client asked (release message or half-close).
    Released,
    /// The stream ends with this status: the client broke the protocol (or sent a
    /// message that does not decode or is over `--max-message-size`), or a reload of
    /// the auth file took the caller's right to the lock away.
    Refused(Status),
    /// The client cancelled or disconnected.
    Gone,
    /// The lease ended without the client asking.
    Lost(Reason),
}

/// A held lease. Its hold is released exactly once: by [`finish`], or in the
/// background when the stream is dropped first (reset by the client).
pub(super) struct Held {
    session: Session,
    req: Arc<Request>,
    token: u64,
    /// A multi-lock's tokens, in the order of `Request::all_keys`; empty otherwise.
    tokens: Box<[u64]>,
    /// The watchdog's registration; dropped before the release, so a renewal never
    /// outlives it.
    lease: Option<Lease>,
    /// The end of a fixed lease.
    expiry: Option<Pin<Box<Sleep>>>,
    /// For a lock passed in memory: Redis did not record the pass (`lock/relay.rs`),
    /// and whether a ForceRelease broke it.
    unrecorded: Option<(Pin<Box<WaitForCancellationFutureOwned>>, Unrecorded)>,
    released: bool,
    /// Which of a multi-lock's names the status that ends the stream names (its index
    /// in `Request::all_keys`): the one the watchdog found lost, or the request's first
    /// when its fixed lease ran out.
    lost_part: usize,
}

impl Held {
    /// Registers a grant, whose lease counts from `from`, with the watchdog and tells
    /// the client.
    pub(super) fn start(session: Session, req: Arc<Request>, grant: Grant, lease_from: LeaseFrom) -> Box<Self> {
        let from = lease_from.from;
        let shared = &session.shared;
        let lease_end = req.fixed_lease_end(from);
        let lease = shared
            .watchdog
            .register(&req, lease_end.is_none(), &grant, from.into_std(), &session.caller);
        tracing::debug!(target: LEASE_LOG, lock = req.name(), owner = %req.owner, token = grant.fencing_token, kind = req.kind.as_str(), "acquired");
        // Passed the lock in memory: that grant, or one of its own that came first.
        let unrecorded = shared.locks.holds_grant(&req, grant.fencing_token);
        let lease_told = req.fixed_lease_valid().unwrap_or_else(|| shared.locks.lease_of(&req));
        session.send(convert::to_acquired(
            &grant,
            session.caller.unscope(&req.owner),
            lease_told,
            from.saturating_duration_since(lease_from.opened),
            !req.multi.is_empty(),
        ));
        Box::new(Self {
            session,
            token: grant.fencing_token,
            tokens: req.tokens_by_key(&grant).into_boxed_slice(),
            unrecorded: unrecorded
                .map(|unrecorded| (Box::pin(unrecorded.broken.clone().cancelled_owned()), unrecorded)),
            req,
            lease: Some(lease),
            expiry: lease_end.map(|end| Box::pin(tokio::time::sleep_until(end))),
            released: false,
            lost_part: 0,
        })
    }

    /// The hold's fencing tokens in the order of `Request::all_keys`: a multi-lock's,
    /// or the one token.
    fn tokens(&self) -> &[u64] {
        if self.tokens.is_empty() {
            std::slice::from_ref(&self.token)
        } else {
            &self.tokens
        }
    }

    /// Whatever ended the lease, once something did.
    pub(super) fn poll_end(&mut self, cx: &mut Context<'_>) -> Poll<HoldEnd> {
        if self.session.half_closed {
            return Poll::Ready(HoldEnd::Released);
        }
        // First: a fixed lease that has ended is told so, even when a check round found
        // its lock gone (expired in Redis) at the same moment.
        if let Some(expiry) = self.expiry.as_mut() {
            if expiry.as_mut().poll(cx).is_ready() {
                // The whole lease ran out: a multi-lock's is named by the request's
                // first name, whose token `acquired` carried.
                self.lost_part = first_part(&self.req);
                return Poll::Ready(HoldEnd::Lost(Reason::LeaseExpired));
            }
        }
        if let Some(standing) = self.session.standing.as_mut() {
            let names = self.req.all_keys().iter().map(|k| k.name());
            if let Poll::Ready(e) = standing.poll_revoked(cx, crate::auth::Action::Acquire, names) {
                let (req, token) = (&self.req, self.token);
                tracing::info!(target: LEASE_LOG, lock = req.name(), owner = %req.owner, token, error = %e, "lease ended by an auth file reload");
                return Poll::Ready(HoldEnd::Refused(e.into()));
            }
        }
        if let Some(lease) = self.lease.as_mut() {
            if let Poll::Ready(lost) = lease.poll_lost(cx) {
                self.lost_part = lost.part;
                return Poll::Ready(match lost.reason {
                    LostReason::NotHeld => HoldEnd::Lost(Reason::NotHeld),
                    LostReason::ForceReleased => HoldEnd::Lost(Reason::ForceReleased),
                    LostReason::Shutdown => HoldEnd::Lost(Reason::Shutdown),
                    // The stream's own check (above) names the refusal; one that saw a
                    // later reload give the right back ends all the same, unrenewed.
                    LostReason::Revoked => HoldEnd::Refused(
                        Error::Unauthenticated(
                            "the caller's right to the lock was revoked (the auth file changed)".into(),
                        )
                        .into(),
                    ),
                });
            }
        }
        if let Some((broken, unrecorded)) = self.unrecorded.as_mut() {
            if broken.as_mut().poll(cx).is_ready() {
                let reason = if unrecorded.forced() {
                    Reason::ForceReleased
                } else {
                    Reason::NotHeld
                };
                return Poll::Ready(HoldEnd::Lost(reason));
            }
        }
        Pin::new(&mut self.session.inbound).poll_next(cx).map(|msg| match msg {
            Some(Ok(AcquireRequest {
                action: Some(Action::Release(_)),
            }))
            | None => HoldEnd::Released,
            Some(Ok(AcquireRequest {
                action: Some(Action::Open(_)),
            })) => HoldEnd::Refused(Error::invalid("open", "sent twice").into()),
            Some(Ok(AcquireRequest { action: None })) => {
                HoldEnd::Refused(Error::invalid("action", "must be open or release").into())
            }
            Some(Err(status)) => super::refused_read(status).map_or(HoldEnd::Gone, HoldEnd::Refused),
        })
    }
}

impl Drop for Held {
    /// A stream that ends with its hold gives it back, unless its release passed the
    /// lock on in memory and awaits only the recording (the relay owns the hold then:
    /// giving it back again would free the lock under the next holder).
    fn drop(&mut self) {
        if !self.released && !self.req.passed_on.load(Ordering::Acquire) {
            self.session.shared.locks.release_later(self.req.clone(), false);
        }
    }
}

/// Releases the hold and ends the stream as `end` says.
pub(super) async fn finish(mut held: Box<Held>, end: HoldEnd) -> Option<Box<Held>> {
    held.lease = None;
    // Its end under way, the stream has no reload left to hear: a release that a slow
    // Redis holds past a reload is not taken for a stream that did not hear it (whose
    // connection a reload cuts, see `auth::Standing`).
    held.session.standing = None;
    let outcome = match end {
        HoldEnd::Lost(reason) => return lose(held, reason),
        HoldEnd::Released => match give_back(&mut held).await {
            Ok(true) => {
                let (req, token) = (&held.req, held.token);
                tracing::debug!(target: LEASE_LOG, lock = req.name(), owner = %req.owner, token, "released");
                held.session.send(Event::Released(Released {}));
                Ok(())
            }
            // The hold was gone before the release came (deleted, lost in a failover,
            // broken by a ForceRelease whose notice is on its way): the section it
            // guarded may have overlapped another holder's, which the client must hear.
            // (A release sent again after a reconnect whose first run gave the hold back
            // reads the same: told `lost`, the client errs on the safe side.) A break
            // whose notice has not come (or never will) is told as one.
            Ok(false) => {
                // Boxed: its Redis call is most of a release's state, and rare; inline
                // it would size every release in flight to it.
                let req = held.req.clone();
                let broken = Box::pin(held.session.shared.locks.broken(&req, held.tokens()));
                let (reason, part) = match broken.await {
                    Some(part) => (Reason::ForceReleased, part),
                    // Which name was gone the release cannot tell: the first.
                    None => (Reason::NotHeld, first_part(&req)),
                };
                tell_lost(&held, reason);
                Err(Ended::Status(lost_status(name_of(&req, part), reason)))
            }
            Err(e) => Err(e.into()),
        },
        HoldEnd::Refused(status) => {
            let _ = give_back(&mut held).await;
            Err(Ended::Status(status))
        }
        HoldEnd::Gone => {
            let _ = give_back(&mut held).await;
            Err(Ended::Gone)
        }
    };
    held.session.end(outcome);
    None
}

/// Releases the hold: whether it was still there, or the error of a release whose
/// outcome is unknown, which is then given back in the background until Redis answers
/// (a release is safe to repeat), not left to a lease that may be long.
async fn give_back(held: &mut Held) -> Result<bool, Error> {
    let released = Box::pin(held.session.shared.locks.release(&held.req)).await;
    // Not before: a stream dropped half-way releases again in the background (a
    // release is safe to repeat; it only touches this stream's hold), unless it passed
    // its lock on in memory (see `Drop for Held`).
    held.released = true;
    match &released {
        Err(e) if e.retried_by_its_nodes() => unconfirmed_release(held, e, "release unconfirmed; its nodes retry it"),
        Err(e) => {
            unconfirmed_release(held, e, "release failed; retrying in the background");
            held.session.shared.locks.retry_release(held.req.clone());
        }
        Ok(_) => {}
    }
    released
}

/// Release failures written to the log: at most one line in 10 s, saying how many were
/// left out, since a Redis outage fails every release of a busy server at once.
static RELEASE_FAILED: crate::repeated::Repeated = crate::repeated::Repeated::new();

/// Logs a release whose outcome is unknown, `what` saying who takes it up.
fn unconfirmed_release(held: &Held, e: &Error, what: &str) {
    if let Some(left_out) = RELEASE_FAILED.due() {
        let (req, token) = (&held.req, held.token);
        tracing::warn!(lock = req.name(), owner = %req.owner, token, error = %e, left_out, "{what}");
    }
}

/// Ends the stream of a lost lease at once and gives its hold back in the background
/// (which a shutdown's drain waits for): the `lost` event may wait on HTTP/2 flow
/// control (a client that stopped reading its connection), and HTTP/2 polls the
/// stream no further meanwhile, so a release awaited here would hold the session, and
/// a shutdown's drain, for as long. What the client is told does not depend on the
/// release's answer.
fn lose(mut held: Box<Held>, reason: Reason) -> Option<Box<Held>> {
    held.session.shared.locks.break_run(&held.req);
    tell_lost(&held, reason);
    held.session.shared.locks.release_later(held.req.clone(), false);
    held.released = true;
    let status = lost_status(name_of(&held.req, held.lost_part), reason);
    held.session.end(Err(Ended::Status(status)));
    None
}

/// Tells the client its lease is lost, before the release: a release on a Redis that
/// does not answer takes the Redis timeout, and the watchdog reports a lease it could
/// not renew only that margin ahead of its expiry, when others may take the lock.
fn tell_lost(held: &Held, reason: Reason) {
    let (req, token) = (&held.req, held.token);
    let reason_name = reason.as_str_name();
    crate::metrics::lost(reason_name);
    // A fixed lease that ran out, or a shutdown's end of every lease (which says so
    // once), is no news: at `debug`, so a shutdown of 100 000 leases writes no 100 000 lines.
    if matches!(reason, Reason::LeaseExpired | Reason::Shutdown) {
        tracing::debug!(target: LEASE_LOG, lock = req.name(), owner = %req.owner, token, reason = reason_name, "lease lost");
    } else {
        tracing::info!(target: LEASE_LOG, lock = req.name(), owner = %req.owner, token, reason = reason_name, "lease lost");
    }
    held.session.send(convert::to_lost(reason));
}

/// The request's first name (its index in `Request::all_keys`), whose token `acquired`
/// carried: a multi-lock's loss of no name in particular is named by it.
fn first_part(req: &Request) -> usize {
    req.order.first().copied().unwrap_or(0)
}

/// The name `part` of `req` (its index in `Request::all_keys`): a multi-lock's lost
/// name, for the status that ends its stream.
fn name_of(req: &Request, part: usize) -> &str {
    req.all_keys().get(part).map_or(req.name(), |k| k.name())
}

/// The status that ends a stream after `lost`.
fn lost_status(name: &str, reason: Reason) -> Status {
    match reason {
        Reason::Shutdown => Error::ShuttingDown.into(),
        _ => Error::LeaseLost {
            name: name.to_owned(),
            reason: reason.as_str_name(),
        }
        .into(),
    }
}
