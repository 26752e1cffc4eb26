//! A held lock: `Acquired` has arrived on an `Acquire` stream and the stream is
//! still open. The rest of the stream (`Lost`, `Released`, its end) is read when the
//! holder asks: [`Lease::lost`] and [`Lease::is_lost`] read what has come,
//! [`Lease::release`] reads up to the end, and a dropped lease leaves a task that
//! does. No task runs per held lease: a lease costs its stream and no more. A fixed
//! lease is also told lost at its end by the client's own clock, so a holder the
//! server's notice cannot reach (a silent partition) still learns it in time. A
//! [`LostSignal`] reads the stream too, for a task of its own, without keeping the lease.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError, Weak};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use latchkey_proto::v1::{
    acquire_request::Action, acquire_response::Event, lost::Reason, AcquireRequest, AcquireResponse, Acquired, Release,
};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_stream::Stream;
use tonic::{Status, Streaming};

use crate::Error;

/// How long a released or dropped lease waits for the server to confirm and end
/// the stream before cancelling it (a cancel releases the lock too).
pub const RELEASE_TIMEOUT: Duration = Duration::from_secs(5);

/// Why a lease ended without the holder asking.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum LostReason {
    /// The fixed lease ran out.
    LeaseExpired,
    /// The server's watchdog found the lock gone or held by someone else.
    NotHeld,
    /// An operator called `ForceRelease`.
    ForceReleased,
    /// The server is shutting down; it releases the lock right after telling so.
    Shutdown,
    /// The stream broke (network loss, server crash, keepalive timeout) or ended
    /// without a reason; the server releases on its side when it notices.
    Disconnected,
    /// A reload of the server's auth file took the caller's right to the lock away
    /// (its credential revoked, or its identity's prefixes or actions narrowed): the
    /// stream ended `UNAUTHENTICATED` or `PERMISSION_DENIED`, and the server released.
    Revoked,
    /// The server sent a reason this client does not know.
    Unknown(i32),
}

impl LostReason {
    /// Maps the proto `Lost.reason` value.
    pub fn from_proto(reason: i32) -> Self {
        match Reason::try_from(reason) {
            Ok(Reason::LeaseExpired) => LostReason::LeaseExpired,
            Ok(Reason::NotHeld) => LostReason::NotHeld,
            Ok(Reason::ForceReleased) => LostReason::ForceReleased,
            Ok(Reason::Shutdown) => LostReason::Shutdown,
            Ok(Reason::Unspecified) | Err(_) => LostReason::Unknown(reason),
        }
    }
}

impl fmt::Display for LostReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LostReason::LeaseExpired => f.write_str("the fixed lease expired"),
            LostReason::NotHeld => f.write_str("the lock is no longer held"),
            LostReason::ForceReleased => f.write_str("the lock was force-released"),
            LostReason::Shutdown => f.write_str("the server is shutting down"),
            LostReason::Disconnected => f.write_str("the connection to the server broke"),
            LostReason::Revoked => f.write_str("the caller's right to the lock was revoked"),
            LostReason::Unknown(code) => write!(f, "unknown reason {code}"),
        }
    }
}

/// Where the lease stands, as last read from its stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Held,
    Released,
    Lost(LostReason),
}

impl Phase {
    /// The phase after `event`. Only a held lease changes: a lease's end, once told
    /// (its fixed lease over on the client's clock, say), stays what was told, though a
    /// notice sent before it arrives after.
    fn after(self, event: Option<Event>) -> Phase {
        match (self, event) {
            (Phase::Held, Some(Event::Lost(lost))) => Phase::Lost(LostReason::from_proto(lost.reason)),
            (Phase::Held, Some(Event::Released(_))) => Phase::Released,
            (phase, _) => phase,
        }
    }

    /// The phase once the stream has ended (with `status`, if it ended with one): one
    /// that ends while the lease is still held has lost it.
    fn ended(self, status: Option<&Status>) -> Phase {
        match self {
            Phase::Held => Phase::Lost(match status.map(Status::code) {
                Some(tonic::Code::Unauthenticated | tonic::Code::PermissionDenied) => LostReason::Revoked,
                _ => LostReason::Disconnected,
            }),
            other => other,
        }
    }
}

/// The response side of the stream and what has been read of it.
#[derive(Debug)]
struct Events {
    responses: Streaming<AcquireResponse>,
    /// How the stream ended, once it has.
    end: Option<Result<(), Status>>,
}

impl Events {
    /// Reads the next event (or the end) into `phase`; ready at once with `false` once
    /// the stream has ended.
    fn poll_next(&mut self, cx: &mut Context<'_>, phase: &Mutex<Phase>) -> Poll<bool> {
        if self.end.is_some() {
            return Poll::Ready(false);
        }
        let read = match Pin::new(&mut self.responses).poll_next(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(read) => read,
        };
        let mut phase = lock(phase);
        match read {
            Some(Ok(response)) => *phase = phase.after(response.event),
            Some(Err(status)) => self.end = Some(Err(status)),
            None => self.end = Some(Ok(())),
        }
        if let Some(end) = &self.end {
            *phase = phase.ended(end.as_ref().err());
        }
        Poll::Ready(self.end.is_none())
    }

    /// Reads everything that has already come, without waiting; `waker` is woken when
    /// more comes.
    fn read_arrived(&mut self, phase: &Mutex<Phase>, waker: &Waker) {
        let mut cx = Context::from_waker(waker);
        while let Poll::Ready(true) = self.poll_next(&mut cx, phase) {}
    }

    /// Reads what has come up to the end of the stream: how it ended, once it has.
    fn poll_end(&mut self, cx: &mut Context<'_>, phase: &Mutex<Phase>) -> Poll<Result<(), Status>> {
        loop {
            match self.poll_next(cx, phase) {
                Poll::Ready(true) => continue,
                Poll::Ready(false) => return Poll::Ready(self.end.clone().unwrap_or(Ok(()))),
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

/// Locks `value`; a poisoned lock still holds a phase or a stream worth reading.
fn lock<T>(value: &Mutex<T>) -> MutexGuard<'_, T> {
    value.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The tasks waiting in [`Lease::lost`]. The stream is read with one waker that wakes
/// them all, so any of the lease's users may read it at any time (`is_lost()` while a
/// `lost()` waits, two `lost()` in two tasks), and no reader is left unwoken. Each
/// `lost()` keeps one entry while it waits, taken out when it is dropped: an idle lease's
/// stream wakes nobody for hours, and a `lost()` in every request's `select!` would
/// otherwise keep every finished task's waker.
#[derive(Debug, Default)]
struct Waiters {
    list: Mutex<WaiterList>,
    /// Set when the holder let go (released or dropped the lease): the reason it had
    /// been lost by then, if it had. Kept here, which every waiting signal holds, so a
    /// signal answers it after the stream is gone.
    let_go: OnceLock<Option<LostReason>>,
}

#[derive(Debug, Default)]
struct WaiterList {
    next_id: u64,
    wakers: Vec<(u64, Waker)>,
}

impl Waiters {
    /// An entry for one waiting `lost()`, taken out when the entry is dropped.
    fn enter(self: &Arc<Self>) -> Waiting {
        let mut list = lock(&self.list);
        list.next_id += 1;
        Waiting {
            waiters: self.clone(),
            id: list.next_id,
        }
    }
}

/// One waiting `lost()`'s entry in [`Waiters`].
struct Waiting {
    waiters: Arc<Waiters>,
    id: u64,
}

impl Waiting {
    /// Wake `waker` when the stream has news.
    fn wake(&self, waker: &Waker) {
        let mut list = lock(&self.waiters.list);
        match list.wakers.iter_mut().find(|(id, _)| *id == self.id) {
            Some((_, known)) => known.clone_from(waker),
            None => list.wakers.push((self.id, waker.clone())),
        }
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        lock(&self.waiters.list).wakers.retain(|(id, _)| *id != self.id);
    }
}

impl Wake for Waiters {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        // Taken out first: the list stays unlocked while the wakers run, since a waker
        // that polls at once would enter `Waiting::wake` and lock it again.
        let wakers = std::mem::take(&mut lock(&self.list).wakers);
        for (_, waker) in wakers {
            waker.wake();
        }
    }
}

/// The open stream of a lease, and where it stands: the lease's own, shared with its
/// [`LostSignal`]s, which hold it weakly (a signal never keeps the stream, and the lock,
/// once the lease is gone).
#[derive(Debug)]
struct Open {
    /// Dropping this half-closes the request side of the stream: taken once the holder
    /// lets go.
    requests: Mutex<Option<mpsc::Sender<AcquireRequest>>>,
    /// Locked only while reading what has come, never across a wait.
    events: Mutex<Events>,
    waiters: Arc<Waiters>,
    /// Wakes every waiter: the waker the stream is read with.
    wake_all: Waker,
    phase: Mutex<Phase>,
    /// When a fixed lease has ended in Redis at the latest, told as `LeaseExpired` then
    /// whether or not the server's `lost` arrives.
    ends: Option<Instant>,
}

impl Open {
    /// Reads everything that has already come into the phase.
    fn read_arrived(&self) {
        lock(&self.events).read_arrived(&self.phase, &self.wake_all);
    }

    /// The phase at `now`, a held one turned lost if a fixed lease has ended by then.
    fn phase_at(&self, now: Instant) -> Phase {
        let mut phase = lock(&self.phase);
        if *phase == Phase::Held && self.ends.is_some_and(|end| now >= end) {
            *phase = Phase::Lost(LostReason::LeaseExpired);
        }
        *phase
    }

    /// What has come says of the lease now: why it was lost, if it was. A release
    /// confirmed though nobody asked is a lease over, as `lost` says.
    fn lost_now(&self) -> Option<LostReason> {
        self.read_arrived();
        match self.phase_at(Instant::now()) {
            Phase::Lost(reason) => Some(reason),
            Phase::Released => Some(LostReason::Disconnected),
            Phase::Held => None,
        }
    }

    /// The holder lets go: the request side goes (half-closing the stream), and every
    /// waiting signal hears it, with the reason the lease had been lost by then.
    fn let_go(&self) -> Option<mpsc::Sender<AcquireRequest>> {
        let lost = self.lost_now();
        let _ = self.waiters.let_go.set(lost);
        let requests = lock(&self.requests).take();
        self.wake_all.wake_by_ref();
        requests
    }

    /// Reads up to the end: how the stream ended, or `None` when it had not after
    /// [`RELEASE_TIMEOUT`] (then dropping the stream cancels the call, which releases
    /// the lock too).
    async fn wait_end(&self) -> Option<Result<(), Status>> {
        // Read with the one waker that wakes every waiter, as every reader reads it: a
        // signal reading meanwhile would otherwise take the stream's wake-ups away.
        let waiting = self.waiters.enter();
        let end = std::future::poll_fn(|cx| {
            waiting.wake(cx.waker());
            let mut all = Context::from_waker(&self.wake_all);
            lock(&self.events).poll_end(&mut all, &self.phase)
        });
        match tokio::time::timeout(RELEASE_TIMEOUT, end).await {
            Ok(outcome) => Some(outcome),
            Err(_) => {
                let mut phase = lock(&self.phase);
                *phase = phase.ended(None);
                None
            }
        }
    }
}

/// A held lock. Keep it alive for as long as the work needs the lock.
///
/// Dropping it half-closes the `Acquire` stream, which makes the server release
/// the lock; [`Lease::release`] does the same and waits for the confirmation.
#[derive(Debug)]
pub struct Lease {
    names: Vec<String>,
    acquired: Acquired,
    lease: Option<Duration>,
    /// `None` once let go (released, dropped).
    open: Option<Arc<Open>>,
}

impl Lease {
    /// Wraps a stream that has just delivered `acquired`.
    pub(crate) fn start(
        names: Vec<String>,
        acquired: Acquired,
        requests: mpsc::Sender<AcquireRequest>,
        responses: Streaming<AcquireResponse>,
        ends: Option<Instant>,
    ) -> Self {
        let lease = acquired.lease.as_ref().and_then(crate::acquire::duration_from_proto);
        let events = Mutex::new(Events { responses, end: None });
        let waiters = Arc::new(Waiters::default());
        let wake_all = Waker::from(waiters.clone());
        let open = Open {
            requests: Mutex::new(Some(requests)),
            events,
            waiters,
            wake_all,
            phase: Mutex::new(Phase::Held),
            ends,
        };
        Lease {
            names,
            acquired,
            lease,
            open: Some(Arc::new(open)),
        }
    }

    /// The lock's name (the first name of a multi-lock).
    pub fn name(&self) -> &str {
        self.names.first().map_or("", String::as_str)
    }

    /// Every name held by this lease: one, or all the names of a multi-lock.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// The fencing token of this grant: strictly greater than every earlier
    /// grant's token for this name. Pass it to the resources the lock protects.
    /// For a multi-lock, the first name's token.
    pub fn fencing_token(&self) -> u64 {
        match self.acquired.fencing_tokens.first() {
            Some(token) if self.acquired.fencing_token == 0 => *token,
            _ => self.acquired.fencing_token,
        }
    }

    /// One fencing token per name of a multi-lock (from `lock_all`, one name
    /// included), in the order of the names; empty for a lock from `lock`.
    pub fn fencing_tokens(&self) -> &[u64] {
        &self.acquired.fencing_tokens
    }

    /// The owner's number of holds on the lock, this one included.
    pub fn hold_count(&self) -> u32 {
        self.acquired.hold_count
    }

    /// The owner id in force: the requested one, or the one the server made.
    pub fn owner(&self) -> &str {
        &self.acquired.owner
    }

    /// The lease in force as the server reported it: how long a fixed lease lasts (a
    /// little less than asked for: the server gives it back a tenth early, at most
    /// 100 ms and a thousandth of the lease, a RedLock grant at least its clock drift, 1%
    /// plus 2 ms, early), or the watchdog
    /// timeout the server keeps renewing. `None` if the server sent none.
    pub fn lease(&self) -> Option<Duration> {
        self.lease
    }

    /// True once the lease has ended without the holder asking.
    pub fn is_lost(&self) -> bool {
        self.lost_reason().is_some()
    }

    /// Why the lease was lost, or `None` while it is held. Reads what the server
    /// has sent so far, without waiting.
    pub fn lost_reason(&self) -> Option<LostReason> {
        // (A lease let go is consumed: `open` is there while anyone can ask.)
        self.open
            .as_ref()
            .map_or(Some(LostReason::Disconnected), |open| open.lost_now())
    }

    /// Resolves when the lease ends without the holder asking, with the reason.
    /// Pending for as long as the lock is held; resolves at once if already lost, and
    /// at a fixed lease's end at the latest. Cancel-safe, so it can sit in a
    /// `tokio::select!` beside the work.
    pub async fn lost(&self) -> LostReason {
        let Some(open) = self.open.as_ref() else {
            return LostReason::Disconnected;
        };
        let mut watch = Watch::new(open);
        std::future::poll_fn(|cx| watch.poll(open, cx)).await
    }

    /// A future of its own that resolves when this lease is lost, with the reason, or
    /// with `None` once its holder released or dropped it: for a task of its own (one
    /// that stops the work the lock guards). Unlike [`Lease::lost`] it does not borrow
    /// the lease, nor keep it: a lease shared through an `Arc` with a task waiting in
    /// `lost()` is held for as long as that task waits, which, while the lease is
    /// held, is for good.
    pub fn lost_signal(&self) -> LostSignal {
        let Some(open) = self.open.as_ref() else {
            return LostSignal::done(Some(LostReason::Disconnected));
        };
        LostSignal {
            open: Arc::downgrade(open),
            watch: Some(Watch::new(open)),
            done: None,
        }
    }

    /// Gives the lock back: sends `Release`, half-closes and waits (at most
    /// [`RELEASE_TIMEOUT`]) for `Released` and the stream's OK end.
    ///
    /// Fails with [`Error::Lost`] if the lease had already been lost, with the status
    /// if the stream ended with an error (`UNAVAILABLE` when the connection broke), and
    /// with [`Error::ReleaseUnconfirmed`] if no answer came in time (not a wait's
    /// timeout: [`Error::is_timeout`] is false). In the last two cases whether the
    /// server released is unknown; it gives the lock back when it can.
    pub async fn release(mut self) -> Result<(), Error> {
        if let Some(reason) = self.lost_reason() {
            return Err(Error::Lost(reason));
        }
        let Some(open) = self.open.take() else {
            return Err(Error::Protocol("the lease was released already".into()));
        };
        let release = AcquireRequest {
            action: Some(Action::Release(Release {})),
        };
        // A failed send means the stream has ended; its outcome below says how.
        if let Some(requests) = open.let_go() {
            let _ = requests.send(release).await;
        }
        let outcome = open.wait_end().await;
        let last = *lock(&open.phase);
        release_outcome(last, outcome)
    }
}

impl Drop for Lease {
    /// Half-closes the stream, and leaves a task that reads it to its end (at most
    /// [`RELEASE_TIMEOUT`]; none when it has ended), so the server ends the call as it
    /// releases. Outside a runtime the stream is dropped at once, which cancels the
    /// call: the server releases all the same.
    fn drop(&mut self) {
        let Some(open) = self.open.take() else {
            return;
        };
        drop(open.let_go());
        if lock(&open.events).end.is_some() {
            return;
        }
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let _ = open.wait_end().await;
            });
        }
    }
}

/// One wait for a lease's loss: its entry among the stream's waiters, and the end of a
/// fixed lease on the client's clock (its timer made at the first poll, in the runtime
/// that polls it: a signal may be made outside one).
struct Watch {
    waiting: Waiting,
    expiry: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl Watch {
    fn new(open: &Open) -> Self {
        Self {
            waiting: open.waiters.enter(),
            expiry: None,
        }
    }

    /// Why the lease was lost, once it was.
    fn poll(&mut self, open: &Open, cx: &mut Context<'_>) -> Poll<LostReason> {
        self.waiting.wake(cx.waker());
        // What has come first: a notice that arrived before a fixed lease's end says why
        // it ended, though read after it.
        open.read_arrived();
        if let (None, Some(end)) = (&self.expiry, open.ends) {
            self.expiry = Some(Box::pin(tokio::time::sleep_until(end)));
        }
        let expired = self.expiry.as_mut().is_some_and(|e| e.as_mut().poll(cx).is_ready());
        let end = open.ends.filter(|_| expired).unwrap_or_else(Instant::now);
        match open.phase_at(end) {
            Phase::Lost(reason) => Poll::Ready(reason),
            // The server confirmed a release nobody asked for: the lease is over.
            Phase::Released => Poll::Ready(LostReason::Disconnected),
            Phase::Held => Poll::Pending,
        }
    }
}

/// Resolves when a lease is lost, with the reason, or with `None` once its holder
/// released or dropped it (see [`Lease::lost_signal`]). It holds the lease's stream
/// weakly, and reads it as [`Lease::lost`] does while the lease is held.
pub struct LostSignal {
    open: Weak<Open>,
    watch: Option<Watch>,
    /// The answer, once there is one.
    done: Option<Option<LostReason>>,
}

impl LostSignal {
    fn done(answer: Option<LostReason>) -> Self {
        Self {
            open: Weak::new(),
            watch: None,
            done: Some(answer),
        }
    }
}

impl fmt::Debug for LostSignal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LostSignal")
            .field("done", &self.done)
            .finish_non_exhaustive()
    }
}

impl Future for LostSignal {
    type Output = Option<LostReason>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        if let Some(answer) = this.done {
            return Poll::Ready(answer);
        }
        let Some(watch) = this.watch.as_mut() else {
            return Poll::Ready(None);
        };
        // Woken first, then the let-go read: a let-go in between wakes this poll.
        watch.waiting.wake(cx.waker());
        let let_go = watch.waiting.waiters.let_go.get().copied();
        let answer = match (let_go, this.open.upgrade()) {
            (Some(answer), _) => answer,
            // (Never: a holder lets go before its stream goes.)
            (None, None) => None,
            (None, Some(open)) => match watch.poll(&open, cx) {
                Poll::Ready(reason) => Some(reason),
                Poll::Pending => return Poll::Pending,
            },
        };
        this.done = Some(answer);
        this.watch = None;
        Poll::Ready(answer)
    }
}

/// What a release returns, given the last phase and how the stream ended (`None`: it
/// had not in [`RELEASE_TIMEOUT`]).
fn release_outcome(phase: Phase, outcome: Option<Result<(), Status>>) -> Result<(), Error> {
    match (phase, outcome) {
        // The server confirmed; how the stream ended after that does not matter.
        (Phase::Released, _) => Ok(()),
        // The stream ended while the release was under way (the server could not reach
        // Redis, the connection broke) or no answer came: its status, or the silence,
        // says that the release's outcome is unknown, better than a lease lost to a
        // disconnect.
        (Phase::Held | Phase::Lost(LostReason::Disconnected), Some(Err(status))) => Err(Error::from(status)),
        (Phase::Held | Phase::Lost(LostReason::Disconnected), Some(Ok(()))) => {
            Err(Error::Protocol("stream ended without confirming the release".into()))
        }
        (Phase::Held | Phase::Lost(LostReason::Disconnected), None) => Err(Error::ReleaseUnconfirmed {
            waited: RELEASE_TIMEOUT,
        }),
        (Phase::Lost(reason), _) => Err(Error::Lost(reason)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_proto_reasons() {
        assert_eq!(
            LostReason::from_proto(Reason::LeaseExpired as i32),
            LostReason::LeaseExpired
        );
        assert_eq!(
            LostReason::from_proto(Reason::ForceReleased as i32),
            LostReason::ForceReleased
        );
        assert_eq!(LostReason::from_proto(0), LostReason::Unknown(0));
        assert_eq!(LostReason::from_proto(99), LostReason::Unknown(99));
    }

    #[test]
    fn a_held_stream_that_ends_is_disconnected() {
        assert_eq!(Phase::Held.ended(None), Phase::Lost(LostReason::Disconnected));
        let broken = Status::unavailable("connection reset");
        assert_eq!(Phase::Held.ended(Some(&broken)), Phase::Lost(LostReason::Disconnected));
        assert_eq!(Phase::Released.ended(None), Phase::Released);
        let lost = Phase::Lost(LostReason::NotHeld);
        assert_eq!(lost.ended(None), lost);
    }

    /// A held stream the server ends for the caller's rights (an auth file reload) is
    /// told as such, not as a broken connection.
    #[test]
    fn a_held_stream_ended_for_its_rights_is_revoked() {
        for status in [Status::permission_denied("x"), Status::unauthenticated("x")] {
            assert_eq!(Phase::Held.ended(Some(&status)), Phase::Lost(LostReason::Revoked));
        }
        let lost = Phase::Lost(LostReason::Shutdown);
        assert_eq!(lost.ended(Some(&Status::permission_denied("x"))), lost);
    }

    #[test]
    fn a_lease_can_be_shared_between_tasks() {
        fn shared<T: Send + Sync + 'static>() {}
        shared::<Lease>();
        shared::<LostSignal>();
    }

    /// A `lost()` given up (a `select!` another branch won) leaves no waker behind:
    /// each stayed until the stream's next event, which an idle lease never has.
    #[test]
    fn a_lost_wait_given_up_leaves_no_waker() {
        let waiters = Arc::new(Waiters::default());
        let (first, second) = (waiters.enter(), waiters.enter());
        first.wake(Waker::noop());
        first.wake(Waker::noop());
        second.wake(Waker::noop());
        assert_eq!(lock(&waiters.list).wakers.len(), 2, "one entry per waiting lost()");
        drop(first);
        assert_eq!(lock(&waiters.list).wakers.len(), 1);
        Waker::from(waiters.clone()).wake_by_ref();
        assert!(
            lock(&waiters.list).wakers.is_empty(),
            "the stream's news wakes every waiter"
        );
        drop(second);
        assert!(lock(&waiters.list).wakers.is_empty());
    }

    #[test]
    fn events_move_the_phase() {
        let released = Some(Event::Released(Default::default()));
        assert_eq!(Phase::Held.after(released), Phase::Released);
        let lost = Some(Event::Lost(latchkey_proto::v1::Lost {
            reason: Reason::ForceReleased as i32,
        }));
        assert_eq!(Phase::Held.after(lost.clone()), Phase::Lost(LostReason::ForceReleased));
        assert_eq!(Phase::Held.after(None), Phase::Held);
        // An end once told stays: a notice read after it changes nothing.
        let expired = Phase::Lost(LostReason::LeaseExpired);
        assert_eq!(expired.after(lost), expired);
    }

    #[test]
    fn release_outcomes() {
        assert!(release_outcome(Phase::Released, Some(Ok(()))).is_ok());
        let lost = release_outcome(Phase::Lost(LostReason::NotHeld), Some(Ok(())));
        assert!(matches!(lost, Err(Error::Lost(LostReason::NotHeld))));
        assert!(release_outcome(Phase::Released, Some(Err(Status::cancelled("x")))).is_ok());
        let failed = release_outcome(Phase::Held, Some(Err(Status::unavailable("x"))));
        assert!(matches!(failed, Err(Error::Status(_))));
        assert!(release_outcome(Phase::Held, Some(Ok(()))).is_err());
        // A stream that ended under the release has ended its held phase too.
        let ended = Phase::Held.ended(None);
        let unavailable = release_outcome(ended, Some(Err(Status::unavailable("redis away"))));
        assert!(unavailable.is_err_and(|e| e.is_unavailable()));
        // No answer in time: the release's outcome is unknown, and no wait ran out.
        let silent = release_outcome(Phase::Held.ended(None), None);
        assert!(matches!(silent, Err(Error::ReleaseUnconfirmed { .. })), "{silent:?}");
        assert!(silent.is_err_and(|e| !e.is_timeout()));
        assert!(release_outcome(Phase::Released, None).is_ok());
    }
}
