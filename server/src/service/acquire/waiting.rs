//! Opening and waiting: the first message, then tries until the lock is granted,
//! woken by the hub (an unlock message) or by a release of this server that handed the
//! lock over.

use super::holding::Held;
use super::{Ended, Session};
use crate::auth;
use crate::error::Error;
use crate::hub::{Hub, Waiter, Want};
use crate::lock::{Attempt, Grant, Handed, Kind, Locks, Place, Request, Unlined, JOIN_WAIT, NO_TTL_RECHECK};
use crate::service::{convert, validate};
use latchkey_proto::v1::{acquire_request::Action, acquire_response::Event, AcquireRequest, Queued};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tonic::Status;

/// How long a client may take to send `open` after opening the stream.
pub const OPEN_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a new waiter waits for its channel subscription before its second try.
const SUBSCRIBE_WAIT: Duration = Duration::from_secs(1);
/// How long past its deadline a waiter's last try may take: a Redis that answers at
/// all answers within it, and a wait ends this close to its `wait_timeout`.
const LAST_TRY_GRACE: Duration = Duration::from_millis(100);

/// Reads `open`, checks it and waits for the grant: the held lease, or `None` once the
/// stream is over. (One function that owns the session: every async function a stream's
/// session passes through by value keeps a copy of it in the waiter's state.)
///
/// Not an `async fn`: that would keep the session twice in its state (the argument and
/// its binding), and this state is every waiting stream's; the block uses the session
/// it captured in place.
#[allow(clippy::manual_async_fn)]
pub(super) fn start(mut session: Session) -> impl Future<Output = Option<Box<Held>>> + Send {
    async move {
        match session.grant().await {
            Ok((req, grant, lease_from)) => Some(Held::start(session, req, grant, lease_from)),
            Err(ended) => {
                session.end(Err(ended));
                None
            }
        }
    }
}

/// When a grant's lease counts from: `from`, the try (or wake, or handoff) that
/// granted it, which came after `open` was read at `opened`.
pub(super) struct LeaseFrom {
    pub opened: Instant,
    pub from: Instant,
}

/// One acquisition's outcome and wait, recorded when dropped: `cancelled` unless told
/// otherwise, as when the client resets a waiting stream and its session is dropped
/// in the middle of the wait.
struct Acquisition {
    kind: &'static str,
    started: Instant,
    outcome: &'static str,
}

impl Acquisition {
    fn new(kind: &'static str) -> Self {
        Self {
            kind,
            started: Instant::now(),
            outcome: "cancelled",
        }
    }
}

impl Drop for Acquisition {
    fn drop(&mut self) {
        crate::metrics::acquisition(self.kind, self.outcome, self.started.elapsed());
    }
}

impl Session {
    /// The request, its grant and when its lease counts from.
    async fn grant(&mut self) -> Result<(Arc<Request>, Grant, LeaseFrom), Ended> {
        let open = self.read_open().await?;
        let opened = Instant::now();
        let req = self.request(open)?;
        if let Some(standing) = self.standing.as_mut() {
            standing.list(auth::Action::Acquire, req.all_keys().iter().map(|k| k.name()));
        }
        let mut acquisition = Acquisition::new(req.kind.as_str());
        // A reload that takes the caller's right to the lock away ends the wait (the
        // waiter's guards give back whatever its try in flight may be granted). Polled
        // first: its first poll checks the policy in force now, which a reload may have
        // changed since the call was authenticated, before any try or `queued`.
        let mut standing = self.standing.take();
        let waited = tokio::select! {
            biased;
            e = auth::revoked(standing.as_deref_mut(), auth::Action::Acquire, req.all_keys().iter().map(|k| k.name())) => Err(e.into()),
            waited = self.wait_for_grant(&req) => waited,
        };
        self.standing = standing;
        let grant = waited
            .and_then(|(grant, from)| self.in_time(&req, grant, from))
            .and_then(|granted| self.still_serving(&req, granted));
        acquisition.outcome = match &grant {
            Ok(_) => "acquired",
            Err(Ended::Status(s)) if s.code() == tonic::Code::DeadlineExceeded => "timeout",
            // A client that withdraws its wait with `release` gives up as one that
            // cancels its call does: nothing went wrong.
            Err(Ended::Gone | Ended::Withdrawn) => "cancelled",
            Err(_) => "error",
        };
        drop(acquisition);
        let (grant, from) = grant?;
        self.wake_fellow_owners(&req);
        Ok((req, grant, LeaseFrom { opened, from }))
    }

    /// The request `open` asks for, checked against the caller. (Not inline in `grant`:
    /// the request under construction would stay in every waiter's state.)
    fn request(&self, open: latchkey_proto::v1::Open) -> Result<Arc<Request>, Ended> {
        let backend = self.shared.locks.backend();
        // Before the fields' checks: the RedLock lease bounds are of deployments this
        // server may not have, and no RedLock request is served without them.
        if open.redlock {
            crate::lock::redlock::configured(backend)?;
        }
        let mut req = validate::open(
            open,
            backend.keys(),
            backend.longest_redlock_lease(),
            self.shared.fresh_id(),
        )?;
        for keys in req.all_keys() {
            self.caller.check(auth::Action::Acquire, keys.name())?;
        }
        // A stream's own owner id is the server's, which no client may present (see
        // `validate`): it stays as it is, so scripts know the server's own streams (a
        // fair queue entry that its server refreshes, a queue of this server's waiters).
        if !req.own_owner {
            req.owner = self.caller.scope_owner(std::mem::take(&mut req.owner));
        }
        // The call's gRPC deadline bounds the wait as `wait_timeout` does (a fair
        // waiter's place in line included); a lease granted in time is the client's to
        // end, as its gRPC library does at the deadline.
        if let Some(deadline) = self.deadline {
            let left = deadline.saturating_duration_since(Instant::now());
            req.wait = Some(req.wait.map_or(left, |wait| wait.min(left)));
        }
        Ok(Arc::new(req))
    }

    /// The grant, unless it was heard so late that its lease could have run out in
    /// Redis meanwhile (Watchdog::lapsed): that one is given back, and the client told
    /// to try again. Telling it `acquired` would have it hold a lock another client may
    /// have taken.
    fn in_time(&self, req: &Arc<Request>, grant: Grant, from: Instant) -> Result<(Grant, Instant), Ended> {
        if !self.shared.watchdog.lapsed(req, from.into_std()) {
            return Ok((grant, from));
        }
        tracing::warn!(lock = req.name(), waited = ?from.elapsed(), "a grant came back after its lease could have run out; given back");
        self.give_back(req);
        let bound = match req.fixed_lease {
            Some(_) => "the fixed lease",
            None => "--watchdog-timeout",
        };
        Err(Error::GrantLate { bound }.into())
    }

    /// The grant, unless the server started to shut down while it came (a try under
    /// way, a handoff): the stream ends with the server, so the grant is given back and
    /// the client told `UNAVAILABLE`, as every waiter is, not `acquired` and then
    /// `lost{SHUTDOWN}`.
    fn still_serving(&self, req: &Arc<Request>, granted: (Grant, Instant)) -> Result<(Grant, Instant), Ended> {
        let serving = self.serving();
        if serving.is_err() {
            self.give_back(req);
        }
        serving.map(|()| granted)
    }

    /// `UNAVAILABLE` once the server began to shut down.
    fn serving(&self) -> Result<(), Ended> {
        match self.shared.shutdown.is_cancelled() {
            false => Ok(()),
            true => Err(Error::ShuttingDown.into()),
        }
    }

    /// Gives back a grant the client is not told of, in the background. Nor is it passed
    /// on in memory: a handoff that granted it started passing from when its reply came,
    /// and the stream is not to hold it. The release names the next waiter here in
    /// Redis, which hears how that went.
    fn give_back(&self, req: &Arc<Request>) {
        self.shared.locks.break_run(req);
        self.shared.locks.release_later(req.clone(), false);
    }

    /// After a grant to a stream whose client named its owner, the waiters here of that
    /// owner on the lock reenter it: they may be waiting for a holder's TTL, or behind a
    /// release that wakes one waiter.
    fn wake_fellow_owners(&self, req: &Request) {
        let Some(owner) = named_owner(req) else { return };
        let hub = self.shared.hub_for(req);
        for on in 0..req.all_keys().len() {
            hub.wake_owner(&req.wake_channel(on), owner);
        }
    }

    /// After a wake whose try found a read/write lock busy: should another stream have
    /// taken its write meanwhile (here or on another server), the waiters here of that
    /// writer's owner, when its client named it, reenter. The unlock message woke one
    /// writer here, or the readers, and the grant on another server tells this one
    /// nothing. Looked up only while a waiter of a named owner waits here.
    fn wake_writers_fellows(&self, req: &Arc<Request>) {
        let hub = self.shared.hub_for(req).clone();
        let channel = req.wake_channel(0);
        if !hub.has_named_owners(&channel) {
            return;
        }
        let (shared, keys) = (self.shared.clone(), req.keys.clone());
        tokio::spawn(async move {
            let Ok(state) = shared.locks.describe(&keys).await else {
                return;
            };
            if state.kind == Some(Kind::Write) {
                for (owner, ..) in &state.holders {
                    hub.wake_owner(&channel, owner);
                }
            }
        });
    }

    /// Reads the first message, which must be `open`.
    async fn read_open(&mut self) -> Result<latchkey_proto::v1::Open, Ended> {
        let first = tokio::select! {
            _ = self.shared.shutdown.cancelled() => return Err(Error::ShuttingDown.into()),
            _ = tokio::time::sleep(OPEN_TIMEOUT) => {
                return Err(Error::invalid("open", format!("must arrive within {OPEN_TIMEOUT:?}")).into())
            }
            msg = self.inbound.message() => msg,
        };
        match first {
            Ok(Some(AcquireRequest {
                action: Some(Action::Open(open)),
            })) => Ok(open),
            Ok(Some(_)) => Err(Error::invalid("open", "the first message must be open").into()),
            // A client that closed its side without asking for anything is told so.
            Ok(None) => Err(Error::invalid("open", "the stream was closed before open was sent").into()),
            Err(status) => Err(Ended::from_read(status)),
        }
    }

    /// Tries, then waits for wake-ups until granted. Returns the grant and the instant
    /// its lease counts from: before the grant was asked (or, for a grant heard on the
    /// channel, when it was heard), so the server's clock never runs behind Redis' and
    /// no notice comes after Redis expired the lock.
    async fn wait_for_grant(&mut self, req: &Arc<Request>) -> Result<(Grant, Instant), Ended> {
        if req.kind == Kind::Fair && req.wait != Some(Duration::ZERO) {
            if let Some(full) = self.shared.limits.no_waiter_room(&req.waited(0)) {
                return self.try_without_room(req, full).await;
            }
        }
        // A wait too long to represent is no deadline at all.
        let deadline = req.wait.and_then(|w| Instant::now().checked_add(w));
        // A fair waiter that gives up leaves the queue at once (dropping this does it).
        let mut queued = QueuePlace::new(self.shared.locks.clone(), req);
        // A waiter that leaves in doubt (a try whose outcome is unknown) gives back
        // whatever that try may have granted (dropping this does it). Declared before
        // the place in line, so dropped after it: a give-back while the waiter is still
        // in line could meet a release reserving it.
        let mut doubt = Doubt::new(self.shared.locks.clone(), req);
        // The waiter, and which of the request's names it waits on.
        let mut waiter: Option<(Waiter, usize)> = None;
        // Its place in this server's line, for a release to hand the lock to it.
        let mut place: Option<Place> = None;
        // A multi-lock, which no line holds, counted on the lock it waits for: that lock
        // then goes by Redis, which it hears of.
        let mut _unlined: Option<Unlined> = None;
        let mut told_queued = false;
        // When an unlock message last woke this waiter, for the handoff histogram.
        let mut woken_at: Option<Instant> = None;
        // The next try follows a wake.
        let mut after_wake = false;
        // Counted against the waiter bounds from the first busy answer to the end.
        let mut counted = None;
        let shared = self.shared.clone();
        let hub = shared.hub_for(req);
        // The hold id a claim's grant names, for a waiter that may leave a claim.
        let hold = self.shared.locks.claims(req).then_some(req.hold_id.as_str());
        // A claim's grant, heard on the channel: the next answer, without a try.
        let mut claim_grant: Option<Grant> = None;
        // When this waiter's last try was asked: a claim's grant heard since came after
        // that try (which would have found it), so its lease counts from no later.
        let mut tried_at: Option<Instant> = None;
        // Whether this waiter's last try left a claim (in Redis still, unless granted).
        let mut claimed = false;
        // When this waiter first asked to leave a claim. A try that leaves none does not
        // take an earlier one back (it stays in Redis, grantable, until it runs out), so
        // a claim may be out from then on.
        let mut claimed_since: Option<Instant> = None;
        // Whether the last try came long after a claim out was left: a claim's grant
        // heard since may be that claim's, made before the try and lapsed by it (this
        // server stalled past the grant's lease, its waiter's try at its resumption
        // answered before the message was read), so it is confirmed by a try. (A try
        // soon after, as on a hot lock, found any grant made before it still live.)
        let mut tried_past_claim = false;
        // Told when the run of passes in memory that was to queue this fair waiter ended
        // (`None` once a try of its own ran).
        let mut joining: Option<CancellationToken> = None;
        // A fair waiter lined up behind others here subscribes before its first try.
        let mut subscribes_first = false;
        // A lock others here wait for too (a hot lock): join them before the first try.
        // A try-once tries and leaves: in line, a release could hand it the lock while
        // its try is in flight, for it to give back once the try answers busy.
        if req.multi.is_empty() && req.wait != Some(Duration::ZERO) {
            if let Some(w) = hub.join(
                &req.wake_channel(0),
                req.wake_lock(0),
                want(req),
                hold,
                named_owner(req),
            ) {
                waiter = Some((present(w, hub, req, hold), 0));
                place = self.shared.locks.line_up(req);
            } else if let Some(fair) = self.hot_fair_place(req) {
                // Behind a chain passed in memory, the next recording queues it
                // (relay.rs): no try, and no subscription until it tries for itself.
                joining = self.shared.locks.join_in_memory(req);
                subscribes_first = true;
                place = Some(fair);
            }
        }
        let mut skip_try = waits_in_line(req, place.as_ref().is_some_and(Place::behind_its_kind)) || joining.is_some();
        loop {
            // Every turn of the loop counts against the task's budget: a turn that finds
            // something ready at once never keeps the runtime's thread from the other
            // tasks (among them the release whose answer this waiter may wait for).
            tokio::task::consume_budget().await;
            // Joined in memory and queued by a recording: no try, nor a subscription for
            // one, until its place needs refreshing.
            let refresh_wait = joining.as_ref().and_then(|_| self.shared.locks.refresh_wait(req));
            // Nor once a release named it (the release that ended the run hands it the
            // lock): that release's answer comes first, and a subscription would only
            // hold it up. Should the release not grant it, it subscribes then. (Asked
            // last: it takes the place's lock.)
            let named = || req.is_queued() && place.as_ref().is_some_and(Place::named_by_release);
            if subscribes_first && !skip_try && refresh_wait.is_none() && waiter.is_none() && !named() {
                // A fair waiter's channel is its own: it subscribes before its try, so
                // that one try both joins the queue and is the last before the wait
                // (and before the try is counted, which would stop passes to it).
                waiter = Some((subscribed(hub, req, 0, deadline, None, &self.shared.shutdown).await, 0));
            }
            // A server shutting down makes no more tries: the stream ends `UNAVAILABLE`,
            // as at the wait below (one whose try was out when the shutdown began, once
            // that try answered). A claim's grant heard is confirmed first: the lock is
            // this waiter's in Redis, and its grant is given back (`still_serving`).
            if claim_grant.is_none() {
                self.serving()?;
            }
            // A claim's grant counts from the last try, which came before it: the wake
            // that brought it may come late (this server starved or stopped, its
            // subscriber connection slow), after Redis let the lease run out. Heard when
            // that try is no longer recent, or may have come after the grant
            // (`tried_past_claim`), the grant is confirmed by a try (which finds it,
            // unless it lapsed) whose lease counts from its own asking.
            let claim_from = tried_at.filter(|at| self.shared.watchdog.fresh(req, at.into_std()));
            let confirm = claim_grant.is_some() && (claim_from.is_none() || tried_past_claim);
            if confirm {
                claim_grant = None;
            }
            let asked = claim_from
                .filter(|_| claim_grant.is_some())
                .unwrap_or_else(Instant::now);
            // A try leaves a claim only once the waiter listens on the channel and its
            // presence (Waiter::may_claim). Nor while a claimant stands ahead of it in
            // line: the first waiter's claim is this server's, and the next claims once
            // it was granted (`claim_next`).
            let claim = hold.is_some()
                && waiter.as_ref().is_some_and(|(w, _)| w.may_claim())
                && !place.as_ref().is_some_and(Place::claimant_ahead)
                && self.shared.locks.may_claim(req);
            // The name whose channel the waiter listened on before the try: one confirmed
            // while the try was on its way may have missed a release in between.
            let listened = waiter.as_ref().filter(|(w, _)| w.is_subscribed()).map(|(_, on)| *on);
            // A queued fair waiter that a release reserved meanwhile does not try again:
            // its grant comes (see Place::start_try).
            let trying = place.as_ref().filter(|_| req.kind == Kind::Fair).map(Place::start_try);
            let reserved = matches!(trying, Some(None)) && req.is_queued();
            // (A grant to confirm is tried whatever else would skip the try: the lock is
            // this waiter's in Redis.)
            let skip = (std::mem::take(&mut skip_try) || reserved || refresh_wait.is_some()) && !confirm;
            if !skip && joining.take().is_some() {
                self.shared.locks.tries_for_itself(req);
            }
            // Redis refused the try for now (a transient error): a wake it followed stays
            // in use, to be handed on should this waiter leave before it tries again.
            let mut refused = false;
            if claim_grant.is_none() && !skip {
                tried_at = Some(asked);
                tried_past_claim = claimed_since.is_some_and(|at| !self.shared.watchdog.fresh(req, at.into_std()));
            }
            let answer = match (claim_grant.take(), skip) {
                (Some(grant), _) => Attempt::Acquired(grant),
                // Joined in memory: it tries for itself after JOIN_WAIT, unless a
                // recording queued it by then.
                (None, true) if joining.is_some() => Attempt::Busy {
                    recheck: Some(refresh_wait.unwrap_or(JOIN_WAIT)),
                    position: place.as_ref().map_or(0, Place::position),
                    blocked: 0,
                    holder_ttl: None,
                },
                // Behind others of its kind in line: it looks again when they were told
                // the holder's lease ends.
                (None, true) => {
                    let holder_ttl = place
                        .as_ref()
                        .and_then(Place::line_holder_until)
                        .map(|until| until.saturating_duration_since(Instant::now()))
                        .filter(|left| !left.is_zero());
                    Attempt::Busy {
                        recheck: holder_ttl,
                        position: 0,
                        blocked: 0,
                        holder_ttl,
                    }
                }
                (None, false) => match self
                    .bounded_try(req, claim, try_bound(deadline, told_queued), waiter.as_ref())
                    .await
                {
                    Ok(answer) => answer,
                    // A waiter already in line keeps its place while Redis is away or
                    // slow, or its replicas behind (the grant was given back, or the
                    // stream is in doubt), and tries again; its next tries find a grant
                    // the failed one made. A multi-lock's failed try gave back the groups
                    // it took; the one whose call failed may be granted late, held while
                    // the waiter waits on another name only until its next try: in doubt,
                    // it tries every second and gives every name back while one is busy
                    // (multi.rs). A RedLock's try ends it, and so does a give-back between
                    // its tries that failed: it may still run after a later try took the
                    // record it gives back for its grant.
                    Err(e) if told_queued && passing(&e) && !req.redlock && req.may_try_again() => {
                        tracing::debug!(lock = req.name(), error = %e, "a waiter's try failed; it tries again");
                        refused = true;
                        Attempt::Busy {
                            recheck: Some(NO_TTL_RECHECK),
                            position: 0,
                            blocked: waiter.as_ref().map_or(0, |(_, on)| *on),
                            holder_ttl: None,
                        }
                    }
                    Err(e) => return Err(e.into()),
                },
            };
            drop(trying);
            if let Some((w, _)) = waiter.as_ref().filter(|_| !refused) {
                w.answered();
            }
            let (recheck, position, blocked, holder_ttl) = match answer {
                Attempt::Acquired(grant) => {
                    granted(&mut queued, &mut doubt, waiter.as_ref().map(|(w, _)| w));
                    if let Some(place) = &place {
                        place.taken();
                    }
                    if let Some(woken) = woken_at {
                        // A handoff when this try followed the wake: one that found the
                        // lock taken left the grant to a later recheck.
                        if after_wake {
                            crate::metrics::handoff(woken.elapsed());
                        }
                        claim_next(req, place.as_ref(), waiter.take());
                    }
                    return Ok((grant, asked));
                }
                Attempt::Busy {
                    recheck,
                    position,
                    blocked,
                    holder_ttl,
                } => {
                    let holder_until = recheck.map(|ttl| Instant::now() + ttl);
                    if let (Some(place), Some(until), false) = (&place, holder_until, skip) {
                        place.told_holder_until(until);
                    }
                    if let Some((w, _)) = waiter.as_ref().filter(|_| !skip && !refused && single_mutex(req)) {
                        w.learned_end(holder_until);
                    }
                    if !skip {
                        claimed = claim && !refused;
                        // (A refused try may have left its claim before its answer was lost.)
                        if claim {
                            claimed_since.get_or_insert(asked);
                        }
                    }
                    if std::mem::take(&mut after_wake) {
                        if let Some((w, _)) = &waiter {
                            woken_in_vain(w, req.kind, recheck.filter(|_| !refused && !skip));
                        }
                        if matches!(req.kind, Kind::Read | Kind::Write) {
                            self.wake_writers_fellows(req);
                        }
                    }
                    (recheck, position, blocked, holder_ttl)
                }
            };
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(Error::WaitTimeout {
                    name: req.blocked_name(blocked).to_owned(),
                }
                .into());
            }
            // Not told queued (nor counted) by a server that began to shut down.
            self.serving()?;
            match counted.as_mut() {
                // A multi-lock counts against the name that blocks it.
                None => counted = Some(self.shared.limits.waiter(req.waited(blocked))?),
                // Only a multi-lock's blocking name changes.
                Some(permit) if !req.multi.is_empty() => self.shared.limits.move_waiter(permit, &req.waited(blocked)),
                Some(_) => {}
            }
            if !told_queued {
                self.send(Event::Queued(Queued {
                    position,
                    holder_ttl: holder_ttl.map(convert::to_duration),
                }));
                told_queued = true;
            }
            let w = match waiter.as_ref().filter(|(_, on)| *on == blocked) {
                Some((w, _)) => Some(w),
                // Queued in memory, or named by a release: it listens once it tries
                // for itself.
                None if joining.is_some() || reserved => None,
                None => {
                    // Subscribe, then try again at once: an unlock between the first try and
                    // the subscription would otherwise be missed (Redisson's order). A
                    // multi-lock waits on whichever name blocked it last.
                    if let Some((old, _)) = waiter.take() {
                        old.pass_on();
                    }
                    if !req.multi.is_empty() {
                        _unlined = Some(self.shared.locks.wait_unlined(req.wake_lock(blocked)));
                    }
                    if place.is_none() {
                        place = self.shared.locks.line_up(req);
                        // What the try before told of the holder's lease, for the waiters
                        // that line up behind it without a try of their own.
                        if let (Some(place), Some(ttl)) = (&place, recheck) {
                            place.told_holder_until(Instant::now() + ttl);
                        }
                    }
                    waiter = Some((
                        subscribed(hub, req, blocked, deadline, hold, &self.shared.shutdown).await,
                        blocked,
                    ));
                    continue;
                }
            };
            let mut recheck = recheck.unwrap_or(NO_TTL_RECHECK);
            // A waiter a failed try or handoff may have granted looks again soon, and so
            // does one whose subscription was not in place before its try (the hub held
            // up by a Redis that does not answer): an unlock meanwhile reached nobody here.
            let deaf = w.is_some_and(|w| !w.is_subscribed() || listened != Some(blocked));
            if req.is_doubted() || place.as_ref().is_some_and(Place::doubted) || deaf {
                recheck = recheck.min(NO_TTL_RECHECK);
            }
            let recheck = Instant::now() + recheck;
            let until = deadline.map_or(recheck, |d| d.min(recheck));
            let msg = tokio::select! {
                biased;
                _ = self.shared.shutdown.cancelled() => return Err(Error::ShuttingDown.into()),
                msg = self.inbound.message(), if !self.half_closed => msg,
                // A claimant with no claim (it waited in line without a try) tries when
                // a release passed it over for another server: its try leaves the claim
                // the next release of that server grants, and nobody races for it.
                handed = handed(&place, reserved || (hold.is_some() && !claimed)) => match handed {
                    Handed::Granted(grant, at) => {
                        granted(&mut queued, &mut doubt, w);
                        crate::metrics::handoff(at.elapsed());
                        return Ok((grant, at));
                    }
                    // A release failed, or gave the lock to another after this waiter let
                    // a wake-up pass for its grant, or passed over a claimant without a
                    // claim: it tries.
                    Handed::Unsure | Handed::Declined => continue,
                },
                _ = woken_after(w, req.retry_pause()) => {
                    woken_at = Some(Instant::now());
                    after_wake = true;
                    claim_grant = w.and_then(Waiter::claim_granted).map(Grant::handed);
                    continue;
                }
                // Passing ended before its turn: it tries, which queues it if no
                // recording did (or, reserved by a release meanwhile, it listens and
                // waits for that release's answer: the ended run is told once).
                _ = cancelled(joining.clone()) => {
                    joining = None;
                    self.shared.locks.tries_for_itself(req);
                    continue;
                }
                _ = recheck_at(w, until) => continue,
            };
            match msg {
                // Half-close while waiting: keep waiting, then release right after the
                // grant (so `grpcurl -d '{…}'` acquires once and lets go).
                Ok(None) => self.half_closed = true,
                other => return Err(withdrawn(other)),
            }
        }
    }

    /// A try, cut off at `bound` (see [`try_bound`]) with `WAIT_TIMEOUT` naming the name
    /// the waiter waits on. Cut off, the try runs to its answer in the background and
    /// gives back what it granted (see [`Attempting`]).
    async fn bounded_try(
        &self,
        req: &Arc<Request>,
        claim: bool,
        bound: Option<Instant>,
        waiter: Option<&(Waiter, usize)>,
    ) -> Result<Attempt, Error> {
        let attempt = Attempting::new(&self.shared.locks, req, claim);
        let Some(bound) = bound else { return attempt.await };
        tokio::time::timeout_at(bound, attempt).await.unwrap_or_else(|_| {
            Err(Error::WaitTimeout {
                name: req.blocked_name(waiter.map_or(0, |(_, on)| *on)).to_owned(),
            })
        })
    }

    /// A fair newcomer when this server holds its maximum of waiters, or the lock its
    /// maximum here (`full` says which): it tries as a try-once does, refused with
    /// `full` should the lock be busy (its try would otherwise queue it in Redis for it
    /// to leave again once refused, two scripts for a refusal). The place it takes in no
    /// queue is not counted as one (`QueuePlace`). With waiters of the lock here, which
    /// stand ahead of it in the queue, it is refused at once: the lock is not its (a
    /// client-named owner's stream may hold it or lead the line, and tries).
    async fn try_without_room(&self, req: &Arc<Request>, full: Error) -> Result<(Grant, Instant), Ended> {
        if req.own_owner && self.shared.limits.waiting_on(&req.waited(0)) > 0 {
            return Err(full.into());
        }
        // A try in doubt gives back what it may have granted (see `wait_for_grant`).
        let mut doubt = Doubt::new(self.shared.locks.clone(), req);
        let asked = Instant::now();
        match Attempting::without_queueing(&self.shared.locks, req).await? {
            Attempt::Acquired(grant) => {
                doubt.settled();
                Ok((grant, asked))
            }
            Attempt::Busy { .. } => Err(full.into()),
        }
    }

    /// A place in this server's line for a fair waiter that will wait behind fair
    /// waiters already in it (a hot fair lock), taken before its first try.
    fn hot_fair_place(&self, req: &Arc<Request>) -> Option<Place> {
        if req.kind != Kind::Fair || req.wait == Some(Duration::ZERO) {
            return None;
        }
        self.shared.locks.line_up(req).filter(Place::behind_its_kind)
    }
}

/// Passes on what the wake of `waiter`, whose try then found the lock taken (held for
/// `held_for`, as Redis answered), spent: a writer's wake the readers behind it who may
/// share a lock held for reading now, and the end it learned to the other writers (see
/// [`Waiter::writers_look_again_by`]); a semaphore waiter's the waiters wanting fewer
/// permits.
fn woken_in_vain(waiter: &Waiter, kind: Kind, held_for: Option<Duration>) {
    match kind {
        Kind::Write => {
            waiter.wake_readers();
            if let Some(ttl) = held_for {
                waiter.writers_look_again_by(Instant::now() + ttl);
            }
        }
        Kind::Semaphore => waiter.wake_fewer(),
        _ => {}
    }
}

/// Whether `req` is a mutex on one name of the main Redis: a waiter's try learns its
/// holder's end there (see [`Waiter::learned_end`]).
fn single_mutex(req: &Request) -> bool {
    req.kind == Kind::Mutex && req.multi.is_empty() && !req.redlock
}

/// When a try of a waiter is cut off: [`LAST_TRY_GRACE`] past the wait's deadline,
/// once the waiter was told `queued` (the lock was busy). A Redis that does not answer
/// would otherwise hold the wait's end back by `--redis-timeout`. A first try runs to
/// its answer: a waiter that never heard the lock was busy is told why it failed.
fn try_bound(deadline: Option<Instant>, told_queued: bool) -> Option<Instant> {
    deadline
        .filter(|_| told_queued)
        .and_then(|d| d.checked_add(LAST_TRY_GRACE))
}

/// Until `token` is cancelled; never without one.
async fn cancelled(token: Option<CancellationToken>) {
    match token {
        Some(token) => token.cancelled_owned().await,
        None => std::future::pending().await,
    }
}

/// Whether a mutex waiter that lined up behind other mutex waiters of this server may
/// skip its first try and wait its turn: the lock is busy but for a moment between a
/// release and its wake-up (which then goes to a waiter here), an owner of the
/// stream's own reenters no hold, and the line, the unlock message and the recheck
/// take it from there. A hot lock's newcomer then costs no script at all. One that
/// only a Watch or waiters of another kind would stand before still tries (a try-once
/// takes no place in line).
fn waits_in_line(req: &Request, behind_its_kind: bool) -> bool {
    behind_its_kind && req.kind == Kind::Mutex && req.own_owner
}

/// A mutex waiter that took the lock after an unlock message (a claim's grant, or a
/// race won) wakes the next waiter here: others listen for this lock, so releases grant
/// claims and never hand over locally. That waiter's try leaves its claim now, or the
/// next release would find this server without one and leave everyone to a race.
fn claim_next(req: &Request, place: Option<&Place>, waiter: Option<(Waiter, usize)>) {
    if req.kind == Kind::Mutex && place.is_some() {
        if let Some((w, _)) = waiter {
            w.pass_on();
        }
    }
}

/// A waiter on the channel of name `on`, once its subscription is in place (or the
/// wait for it is over, or the server began to shut down: its hub subscribes no more).
async fn subscribed(
    hub: &Hub,
    req: &Request,
    on: usize,
    deadline: Option<Instant>,
    hold: Option<&str>,
    shutdown: &CancellationToken,
) -> Waiter {
    let waiter = hub.register(
        &req.wake_channel(on),
        req.wake_lock(on),
        want(req),
        hold,
        named_owner(req),
    );
    let waiter = present(waiter, hub, req, hold);
    tokio::select! {
        _ = waiter.subscribed(subscribe_wait(deadline)) => {}
        _ = shutdown.cancelled() => {}
    }
    waiter
}

/// `waiter`, kept present on its lock (Waiter::present_on) when it may leave a claim
/// (`hold`, the hold id a claim's grant names).
fn present(waiter: Waiter, hub: &Hub, req: &Request, hold: Option<&str>) -> Waiter {
    match hold {
        Some(_) => waiter.present_on(&req.keys.presence(hub.server_id())),
        None => waiter,
    }
}

/// How long to wait for a subscription before the next try: never past the wait's
/// deadline, so a slow subscription does not stretch a short `wait_timeout`.
fn subscribe_wait(deadline: Option<Instant>) -> Duration {
    deadline.map_or(SUBSCRIBE_WAIT, |d| {
        SUBSCRIBE_WAIT.min(d.saturating_duration_since(Instant::now()))
    })
}

/// At `until`, or sooner when a claim's grant to another waiter tells the waiter to
/// look again by the granted lease's end ([`Waiter::sleep_until`]).
async fn recheck_at(waiter: Option<&Waiter>, until: Instant) {
    match waiter {
        Some(w) => w.sleep_until(until).await,
        None => tokio::time::sleep_until(until).await,
    }
}

/// A wake-up of the waiter's channel; never, without a waiter.
async fn woken(waiter: Option<&Waiter>) {
    match waiter {
        Some(w) => w.woken().await,
        None => std::future::pending().await,
    }
}

/// A wake, taken after `pause` (see [`Request::retry_pause`]): one that comes meanwhile
/// is kept, not lost.
async fn woken_after(waiter: Option<&Waiter>, pause: Duration) {
    if !pause.is_zero() {
        tokio::time::sleep(pause).await;
    }
    woken(waiter).await
}

/// What a release that named this waiter said; never, without a place. (`reserved`: see
/// [`Place::handed`].)
async fn handed(place: &Option<Place>, reserved: bool) -> Handed {
    match place {
        Some(place) => place.handed(reserved).await,
        None => std::future::pending().await,
    }
}

/// What a client message while waiting means.
fn withdrawn(msg: Result<Option<AcquireRequest>, Status>) -> Ended {
    match msg {
        Ok(Some(AcquireRequest {
            action: Some(Action::Release(_)),
        })) => Ended::Withdrawn,
        Ok(Some(AcquireRequest {
            action: Some(Action::Open(_)),
        })) => Error::invalid("open", "sent twice").into(),
        Ok(Some(AcquireRequest { action: None })) => Error::invalid("action", "must be open or release").into(),
        Err(status) => Ended::from_read(status),
        Ok(None) => Ended::Gone,
    }
}

/// The owner a client named for `req`, by which streams share a lock (none for a
/// stream's own owner id, which no other stream has).
fn named_owner(req: &Request) -> Option<&str> {
    (!req.own_owner && req.kind != Kind::Semaphore).then_some(req.owner.as_str())
}

/// What a request needs from a wake-up.
fn want(req: &Request) -> Want {
    match req.kind {
        Kind::Read => Want::Shared,
        Kind::Semaphore => Want::Permits(req.permits),
        Kind::Mutex | Kind::Fair | Kind::Write => Want::Exclusive,
    }
}

/// A fair waiter's place in the queue: unless granted, it is given up when the wait
/// ends in any way, so the next in line does not wait for its deadline. Not a try-once's
/// (its try never queues), nor one that no try of the stream queued, nor one that
/// another waiting stream of the same client-named owner shares.
struct QueuePlace {
    locks: Locks,
    req: Option<Arc<Request>>,
}

impl QueuePlace {
    fn new(locks: Locks, req: &Arc<Request>) -> Self {
        let req = (req.kind == Kind::Fair && req.wait != Some(Duration::ZERO)).then(|| req.clone());
        if let Some(req) = &req {
            locks.start_waiting_in_queue(req);
        }
        Self { locks, req }
    }

    fn granted(&mut self) {
        if let Some(req) = self.req.take() {
            self.locks.stop_waiting_in_queue(&req);
        }
    }
}

impl Drop for QueuePlace {
    fn drop(&mut self) {
        let Some(req) = self.req.take() else { return };
        // A try in doubt may have queued it.
        if self.locks.stop_waiting_in_queue(&req) && (req.is_queued() || req.is_doubted()) {
            self.locks.leave_later(req);
        }
    }
}

/// What a grant settles for a waiting stream, by a try or a handoff: its count in the
/// fair queue's waiters, its doubt, and the holder's end its waiter learned (a granted
/// waiter tells the others nothing as it leaves).
fn granted(queued: &mut QueuePlace, doubt: &mut Doubt, waiter: Option<&Waiter>) {
    queued.granted();
    doubt.settled();
    if let Some(w) = waiter {
        w.learned_end(None);
    }
}

/// What a waiter in doubt leaves behind. A try of it that failed in Redis
/// ([`Request::doubt`]) may have granted a hold nobody knows of. A later try of the
/// same stream finds such a grant (its hold record); a waiter that leaves without one
/// gives it back in the background, and revokes it in case the try is still on its way
/// (both safe when nothing was granted). Once granted, its release revokes too, for a
/// failed try that may come after it.
struct Doubt {
    locks: Locks,
    req: Arc<Request>,
    granted: bool,
}

impl Doubt {
    fn new(locks: Locks, req: &Arc<Request>) -> Self {
        Self {
            locks,
            req: req.clone(),
            granted: false,
        }
    }

    /// Granted: whatever the failed try did, the stream now holds it.
    fn settled(&mut self) {
        self.granted = true;
    }
}

impl Drop for Doubt {
    fn drop(&mut self) {
        if !self.granted && self.req.may_hold_unknown() {
            self.locks.release_later(self.req.clone(), true);
        }
    }
}

/// A try in flight. It is never abandoned half-way: dropped with its stream before
/// Redis answered, it runs to its answer in the background, which then gives back what
/// it granted (a release sent at once could reach Redis before the try).
struct Attempting {
    locks: Locks,
    req: Arc<Request>,
    call: Option<Call>,
    /// Whether the try may queue a fair waiter (whose undoing then leaves the queue).
    queues: bool,
}

/// A try's script call.
type Call = Pin<Box<dyn Future<Output = Result<Attempt, Error>> + Send>>;

impl Attempting {
    fn new(locks: &Locks, req: &Arc<Request>, claim: bool) -> Self {
        let (call_locks, call_req) = (locks.clone(), req.clone());
        let call = Box::pin(async move { call_locks.try_acquire(&call_req, claim).await });
        Self::of(locks, req, call, req.wait != Some(Duration::ZERO))
    }

    /// A try that leaves a busy fair lock's queue alone (see
    /// [`Locks::try_without_queueing`]).
    fn without_queueing(locks: &Locks, req: &Arc<Request>) -> Self {
        let (call_locks, call_req) = (locks.clone(), req.clone());
        let call = Box::pin(async move { call_locks.try_without_queueing(&call_req).await });
        Self::of(locks, req, call, false)
    }

    fn of(locks: &Locks, req: &Arc<Request>, call: Call, queues: bool) -> Self {
        Self {
            locks: locks.clone(),
            req: req.clone(),
            call: Some(call),
            queues,
        }
    }
}

impl Future for Attempting {
    type Output = Result<Attempt, Error>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let Some(call) = self.call.as_mut() else {
            return Poll::Ready(Err(Error::Protocol("an attempt polled after its answer".into())));
        };
        let answer = ready!(call.as_mut().poll(cx));
        self.call = None;
        Poll::Ready(answer)
    }
}

impl Drop for Attempting {
    fn drop(&mut self) {
        if let Some(call) = self.call.take() {
            self.locks.undo_later(call, self.req.clone(), self.queues);
        }
    }
}

/// Whether a failed try leaves a waiter in line waiting: Redis away, slow or not ready
/// (`redis::transient`), or a grant its replicas did not acknowledge in time.
fn passing(e: &Error) -> bool {
    match e {
        Error::Redis(e) => crate::redis::transient(e),
        Error::NotReplicated { .. } => true,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_subscription_wait_ends_by_the_wait_deadline() {
        assert_eq!(subscribe_wait(None), SUBSCRIBE_WAIT);
        let soon = Instant::now() + Duration::from_millis(100);
        assert!(subscribe_wait(Some(soon)) <= Duration::from_millis(100));
        let far = Instant::now() + Duration::from_secs(60);
        assert_eq!(subscribe_wait(Some(far)), SUBSCRIBE_WAIT);
        assert_eq!(subscribe_wait(Some(Instant::now())), Duration::ZERO);
    }

    #[test]
    fn only_a_queued_waiters_try_is_cut_off_a_grace_past_its_deadline() {
        let deadline = Instant::now() + Duration::from_secs(1);
        assert_eq!(try_bound(Some(deadline), true), Some(deadline + LAST_TRY_GRACE));
        assert_eq!(try_bound(Some(deadline), false), None, "a first try runs to its answer");
        assert_eq!(try_bound(None, true), None, "no deadline, no bound");
    }
}
