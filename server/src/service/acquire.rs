//! One `Acquire` stream, as an explicit state machine:
//! Open → (Queued) → Acquired → Released | Lost, or an error status.
//!
//! The stream is the lease: every way the stream ends releases the hold. The session
//! runs inside the response stream ([`SessionStream`]): HTTP/2 polls it for the next
//! event, so an event leaves without a task switch or a channel, and a stream the
//! client reset is dropped together with its session, whose guards give back in the
//! background whatever it held or might have been granted.

use super::{convert, validate, Shared};
use crate::auth::{self, Caller};
use crate::error::Error;
use crate::hub::Waiter;
use crate::hub::Want;
use crate::lock::Kind;
use crate::lock::{Attempt, Grant, Handed, Locks, Place, Request};
use crate::watchdog::{Lease, LostReason};
use latchkey_proto::v1::{acquire_request::Action, acquire_response::Event, lost::Reason};
use latchkey_proto::v1::{AcquireRequest, AcquireResponse, Queued, Released};
use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;
use tokio_stream::Stream;
use tokio_util::task::task_tracker::TaskTrackerToken;
use tonic::{Status, Streaming};

/// How long a client may take to send `open` after opening the stream.
pub const OPEN_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a new waiter waits for its channel subscription before its second try.
const SUBSCRIBE_WAIT: Duration = Duration::from_secs(1);
/// How often a waiter re-checks a lock whose holder has no TTL.
const NO_TTL_RECHECK: Duration = Duration::from_secs(1);

/// What ended a held lease.
enum HoldEnd {
    /// The client asked (release message or half-close).
    Released,
    /// The client broke the protocol.
    Invalid(Error),
    /// The client cancelled or disconnected.
    Gone,
    /// The lease ended without the client asking.
    Lost(Reason),
}

/// Events the session has produced and HTTP/2 has not yet taken: at most a few per
/// stream (queued, acquired, released or lost, the status).
#[derive(Default)]
struct Outbox(Mutex<VecDeque<Result<AcquireResponse, Status>>>);

impl Outbox {
    fn push(&self, item: Result<AcquireResponse, Status>) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).push_back(item);
    }

    fn pop(&self) -> Option<Result<AcquireResponse, Status>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).pop_front()
    }

    fn is_empty(&self) -> bool {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).is_empty()
    }

    /// The status, when it is the first item.
    fn take_refusal(&self) -> Option<Status> {
        let mut items = self.0.lock().unwrap_or_else(|e| e.into_inner());
        match items.front() {
            Some(Err(_)) => items.pop_front().and_then(Result::err),
            _ => None,
        }
    }
}

/// The response stream of one `Acquire`: it runs the session and yields its events.
pub struct SessionStream {
    session: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
    outbox: Arc<Outbox>,
}

impl std::fmt::Debug for SessionStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionStream")
            .field("running", &self.session.is_some())
            .finish()
    }
}

impl SessionStream {
    /// Starts the session of one stream; nothing runs until it is polled.
    pub(super) fn new(
        shared: Arc<Shared>,
        caller: Caller,
        inbound: Streaming<AcquireRequest>,
        permit: OwnedSemaphorePermit,
        connection: impl Send + 'static,
    ) -> Self {
        let outbox = Arc::new(Outbox::default());
        let tracked = shared.sessions.token();
        let session = run(
            shared,
            caller,
            inbound,
            outbox.clone(),
            Accounting::new(tracked, permit, connection),
        );
        Self {
            session: Some(Box::pin(session)),
            outbox,
        }
    }

    /// Runs the session until its first event, which is then the stream's first item;
    /// a stream refused before any event ends with that status alone.
    pub(super) async fn first_event(&mut self) -> Result<(), Status> {
        std::future::poll_fn(|cx| {
            self.drive(cx);
            match self.session.is_none() || !self.outbox.is_empty() {
                true => Poll::Ready(()),
                false => Poll::Pending,
            }
        })
        .await;
        self.outbox.take_refusal().map_or(Ok(()), Err)
    }

    /// Polls the session once if it is still running.
    fn drive(&mut self, cx: &mut Context<'_>) {
        if let Some(session) = self.session.as_mut() {
            if session.as_mut().poll(cx).is_ready() {
                self.session = None;
            }
        }
    }
}

impl Stream for SessionStream {
    type Item = Result<AcquireResponse, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if let Some(item) = self.outbox.pop() {
            return Poll::Ready(Some(item));
        }
        self.drive(cx);
        match self.outbox.pop() {
            Some(item) => Poll::Ready(Some(item)),
            None if self.session.is_none() => Poll::Ready(None),
            None => Poll::Pending,
        }
    }
}

/// What a session holds for its whole life, given back however it ends: the stream
/// bounds, the shutdown drain's count, the gauges.
struct Accounting {
    _tracked: TaskTrackerToken,
    _permit: OwnedSemaphorePermit,
    _connection: Box<dyn Send>,
    /// The status the stream ended with; unset when the client reset it.
    code: Option<tonic::Code>,
}

impl Accounting {
    fn new(tracked: TaskTrackerToken, permit: OwnedSemaphorePermit, connection: impl Send + 'static) -> Self {
        crate::metrics::streams(1);
        Self {
            _tracked: tracked,
            _permit: permit,
            _connection: Box::new(connection),
            code: None,
        }
    }
}

impl Drop for Accounting {
    fn drop(&mut self) {
        crate::metrics::rpc_handled("Acquire", self.code.unwrap_or(tonic::Code::Cancelled));
        crate::metrics::streams(-1);
    }
}

/// Why waiting or holding ended early.
enum Ended {
    /// The client cancelled or disconnected: nothing more to send.
    Gone,
    /// The client sent `release` while waiting: it is answered `released`.
    Withdrawn,
    /// The stream ends with this status.
    Status(Status),
}

impl From<Error> for Ended {
    fn from(e: Error) -> Self {
        Ended::Status(e.into())
    }
}

/// Runs one stream to its end.
async fn run(
    shared: Arc<Shared>,
    caller: Caller,
    inbound: Streaming<AcquireRequest>,
    outbox: Arc<Outbox>,
    mut accounting: Accounting,
) {
    let mut session = Session {
        shared,
        caller,
        inbound,
        outbox,
        half_closed: false,
    };
    let status = match session.run().await {
        Ok(()) | Err(Ended::Gone) => None,
        Err(Ended::Withdrawn) => {
            session.send(Event::Released(Released {}));
            None
        }
        Err(Ended::Status(status)) => Some(status),
    };
    accounting.code = Some(status.as_ref().map_or(tonic::Code::Ok, Status::code));
    if let Some(status) = status {
        session.outbox.push(Err(status));
    }
}

struct Session {
    shared: Arc<Shared>,
    /// Who opened the stream; every name of the request is checked against it.
    caller: Caller,
    inbound: Streaming<AcquireRequest>,
    outbox: Arc<Outbox>,
    /// The client half-closed while waiting: release as soon as granted.
    half_closed: bool,
}

impl Session {
    async fn run(&mut self) -> Result<(), Ended> {
        let open = self.read_open().await?;
        let mut req = validate::open(open, self.shared.locks.backend().keys(), self.shared.fresh_id())?;
        for keys in req.all_keys() {
            self.caller.check(auth::Action::Acquire, &keys.name)?;
        }
        req.owner = self.caller.scope_owner(std::mem::take(&mut req.owner));
        let req = Arc::new(req);
        let started = Instant::now();
        // Boxed, like every Redis call below: a session lives as long as its lease, and
        // an inline future is as large as its largest state (the script calls).
        let grant = Box::pin(self.wait_for_grant(&req)).await;
        let outcome = match &grant {
            Ok(_) => "acquired",
            Err(Ended::Status(s)) if s.code() == tonic::Code::DeadlineExceeded => "timeout",
            Err(Ended::Gone) => "cancelled",
            Err(_) => "error",
        };
        crate::metrics::acquisition(req.kind.as_str(), outcome, started.elapsed());
        let (grant, lease_end) = grant?;
        let hold = Hold::new(self.shared.locks.clone(), req);
        self.hold(hold, grant, lease_end).await
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
            Err(status) if status.code() == tonic::Code::OutOfRange => {
                Err(Error::ResourceExhausted(format!("{} (--max-message-size)", status.message())).into())
            }
            Ok(None) | Err(_) => Err(Ended::Gone),
        }
    }

    /// Tries, then waits for wake-ups until granted. Returns the grant and, for a
    /// fixed lease, the instant it ends (measured from before the grant was asked,
    /// so the notice never comes after Redis expired the lock).
    async fn wait_for_grant(&mut self, req: &Arc<Request>) -> Result<(Grant, Option<Instant>), Ended> {
        // A wait too long to represent is no deadline at all.
        let deadline = req.wait.and_then(|w| Instant::now().checked_add(w));
        // The waiter, and which of the request's names it waits on.
        let mut waiter: Option<(Waiter, usize)> = None;
        // Its place in this server's line, for a release to hand the lock to it.
        let mut place: Option<Place> = None;
        let mut told_queued = false;
        // When an unlock message last woke this waiter, for the handoff histogram.
        let mut woken_at: Option<Instant> = None;
        // A fair waiter that gives up leaves the queue at once (dropping this does it).
        let mut queued = QueuePlace::new(self.shared.locks.clone(), req);
        // Counted against the waiter bounds from the first busy answer to the end.
        let mut counted = None;
        loop {
            let asked = Instant::now();
            let (recheck, position, blocked) = match self.attempt(req).await? {
                Attempt::Acquired(grant) => {
                    queued.granted();
                    if let Some(place) = &place {
                        place.taken();
                    }
                    if let Some(woken) = woken_at {
                        crate::metrics::handoff(woken.elapsed());
                    }
                    return Ok((grant, req.fixed_lease.and_then(|l| asked.checked_add(l))));
                }
                Attempt::Busy {
                    recheck,
                    position,
                    blocked,
                } => (recheck, position, blocked),
            };
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(Error::WaitTimeout {
                    name: req.blocked_name(blocked).to_owned(),
                }
                .into());
            }
            if counted.is_none() {
                counted = Some(self.shared.limits.waiter(req.name())?);
            }
            if !told_queued {
                let holder_ttl = if req.kind == Kind::Fair { None } else { recheck };
                self.send(Event::Queued(Queued {
                    position,
                    holder_ttl: holder_ttl.map(convert::to_duration),
                }));
                told_queued = true;
            }
            let Some((w, _)) = waiter.as_ref().filter(|(_, on)| *on == blocked) else {
                // Subscribe, then try again at once: an unlock between the first try and
                // the subscription would otherwise be missed (Redisson's order). A
                // multi-lock waits on whichever name blocked it last.
                let hub = match &self.shared.redlock_hub {
                    Some(hub) if req.redlock => hub,
                    _ => &self.shared.hub,
                };
                if let Some((old, _)) = waiter.take() {
                    old.pass_on();
                }
                let mut w = hub.register(&req.wake_channel(blocked), want(req));
                if place.is_none() {
                    place = self.shared.locks.line_up(req);
                }
                w.subscribed(SUBSCRIBE_WAIT).await;
                waiter = Some((w, blocked));
                continue;
            };
            let recheck = Instant::now() + recheck.unwrap_or(NO_TTL_RECHECK);
            let until = deadline.map_or(recheck, |d| d.min(recheck));
            let msg = tokio::select! {
                biased;
                _ = self.shared.shutdown.cancelled() => return Err(Error::ShuttingDown.into()),
                msg = self.inbound.message(), if !self.half_closed => msg,
                handed = handed(&place) => match handed {
                    Handed::Granted(grant, at) => {
                        queued.granted();
                        crate::metrics::handoff(at.elapsed());
                        return Ok((grant, req.fixed_lease.and_then(|l| at.checked_add(l))));
                    }
                    Handed::Unsure => continue,
                },
                _ = w.woken() => {
                    woken_at = Some(Instant::now());
                    continue;
                }
                _ = tokio::time::sleep_until(until) => continue,
            };
            match msg {
                // Half-close while waiting: keep waiting, then release right after the
                // grant (so `grpcurl -d '{…}'` acquires once and lets go).
                Ok(None) => self.half_closed = true,
                other => return Err(withdrawn(other)),
            }
        }
    }

    /// One try. A Redis failure may hide a grant that did happen, and so may a
    /// stream dropped while the script runs: then the hold is released in the
    /// background (the release is safe to run for a hold that was never granted).
    async fn attempt(&self, req: &Arc<Request>) -> Result<Attempt, Ended> {
        let in_flight = InFlight {
            locks: &self.shared.locks,
            req,
            settled: false,
        };
        let result = self.shared.locks.try_acquire(req).await;
        match result {
            Err(e @ (Error::Redis(_) | Error::Protocol(_))) => Err(e.into()),
            other => {
                in_flight.settle();
                other.map_err(Ended::from)
            }
        }
    }

    /// Holds the lock until the stream or the lease ends, then releases it.
    async fn hold(&mut self, mut hold: Hold, grant: Grant, lease_end: Option<Instant>) -> Result<(), Ended> {
        let mut lease = self.shared.watchdog.register(&hold.req, lease_end.is_none());
        let lease_len = self.shared.locks.lease_of(&hold.req);
        tracing::info!(lock = hold.req.name(), owner = %hold.req.owner, token = grant.fencing_token, kind = hold.req.kind.as_str(), "acquired");
        self.send(convert::to_acquired(
            &grant,
            self.caller.unscope(&hold.req.owner),
            lease_len,
        ));
        let end = match self.half_closed {
            true => HoldEnd::Released,
            false => self.held_until(&mut lease, lease_end).await,
        };
        // Stop renewing before releasing, so a renewal never outlives the release.
        drop(lease);
        let released = hold.release().await;
        if let Err(e) = &released {
            tracing::warn!(lock = hold.req.name(), error = %e, "release failed; the lock will expire");
        }
        match end {
            HoldEnd::Released => {
                released?;
                tracing::info!(lock = hold.req.name(), owner = %hold.req.owner, token = grant.fencing_token, "released");
                self.send(Event::Released(Released {}));
                Ok(())
            }
            HoldEnd::Invalid(e) => Err(e.into()),
            HoldEnd::Gone => Err(Ended::Gone),
            HoldEnd::Lost(reason) => {
                crate::metrics::lost(reason.as_str_name());
                tracing::info!(lock = hold.req.name(), owner = %hold.req.owner, token = grant.fencing_token, reason = reason.as_str_name(), "lease lost");
                self.send(convert::to_lost(reason));
                Err(Ended::Status(lost_status(hold.req.name(), reason)))
            }
        }
    }

    /// Waits for whatever ends a held lease first.
    async fn held_until(&mut self, lease: &mut Lease, lease_end: Option<Instant>) -> HoldEnd {
        let expiry = lease_end.unwrap_or_else(far_future);
        tokio::select! {
            biased;
            _ = self.shared.shutdown.cancelled() => HoldEnd::Lost(Reason::Shutdown),
            reason = lease.lost() => HoldEnd::Lost(match reason {
                LostReason::NotHeld => Reason::NotHeld,
                LostReason::ForceReleased => Reason::ForceReleased,
            }),
            _ = tokio::time::sleep_until(expiry), if lease_end.is_some() => HoldEnd::Lost(Reason::LeaseExpired),
            msg = self.inbound.message() => match msg {
                Ok(Some(AcquireRequest { action: Some(Action::Release(_)) })) | Ok(None) => HoldEnd::Released,
                Ok(Some(AcquireRequest { action: Some(Action::Open(_)) })) => {
                    HoldEnd::Invalid(Error::invalid("open", "sent twice"))
                }
                Ok(Some(AcquireRequest { action: None })) => {
                    HoldEnd::Invalid(Error::invalid("action", "must be open or release"))
                }
                Err(_) => HoldEnd::Gone,
            },
        }
    }

    fn send(&self, event: Event) {
        self.outbox.push(Ok(AcquireResponse { event: Some(event) }));
    }
}

/// What a release that handed this waiter the lock said; never, without a place.
async fn handed(place: &Option<Place>) -> Handed {
    match place {
        Some(place) => place.handed().await,
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
        Ok(None) | Err(_) => Ended::Gone,
    }
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

fn far_future() -> Instant {
    Instant::now() + Duration::from_secs(86_400 * 365)
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
/// ends in any way, so the next in line does not wait for its deadline.
struct QueuePlace {
    locks: Locks,
    req: Option<Arc<Request>>,
}

impl QueuePlace {
    fn new(locks: Locks, req: &Arc<Request>) -> Self {
        let req = (req.kind == Kind::Fair).then(|| req.clone());
        Self { locks, req }
    }

    fn granted(&mut self) {
        self.req = None;
    }
}

impl Drop for QueuePlace {
    fn drop(&mut self) {
        if let Some(req) = self.req.take() {
            self.locks.leave_later(req);
        }
    }
}

/// A script call that may grant a hold: dropped before it settled (the stream went
/// away meanwhile, or Redis failed), it gives back whatever the call may have granted,
/// now and once more after the Redis timeout in case the call applies late.
struct InFlight<'a> {
    locks: &'a Locks,
    req: &'a Arc<Request>,
    settled: bool,
}

impl InFlight<'_> {
    /// The call answered: its outcome is known.
    fn settle(mut self) {
        self.settled = true;
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if !self.settled {
            self.locks.release_later(self.req.clone(), true);
        }
    }
}

/// A granted hold that is released exactly once: explicitly, or in the background if
/// the session ends some other way (the stream was reset, a panic).
struct Hold {
    locks: Locks,
    req: Arc<Request>,
    released: bool,
}

impl Hold {
    fn new(locks: Locks, req: Arc<Request>) -> Self {
        Self {
            locks,
            req,
            released: false,
        }
    }

    async fn release(&mut self) -> Result<(), Error> {
        let released = Box::pin(self.locks.release(&self.req)).await.map(|_| ());
        // Not before: a stream dropped half-way releases again in the background (a
        // release is safe to repeat; it only touches this stream's hold).
        self.released = true;
        released
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        if !self.released {
            self.locks.release_later(self.req.clone(), false);
        }
    }
}
