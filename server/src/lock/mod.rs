//! The domain core: lock requests, grants and the Redis operations of each lock kind.
//! Nothing here knows about gRPC.

mod describe;
mod fair;
mod handoff;
mod multi;
mod mutex;
mod read_write;
pub mod redlock;
mod redo;
mod relay;
mod semaphore;

pub use describe::State;
pub use fair::acquire_keys as fair_acquire_keys;
pub use handoff::{Handed, Place, Unlined};
pub use mutex::{acquire_keys as mutex_acquire_keys, release_args, release_keys, GiveBack};
pub use relay::JOIN_WAIT;

use crate::error::Error;
use crate::hub::Hub;
use crate::keys::LockKeys;
use crate::redis::Backend;
use fred::prelude::{Key, Value};
use redo::{Redo, Reply};
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// How long hold records and the fencing counter outlive the lease, so a release at
/// the very end of a fixed lease still finds its record.
pub const RECORD_GRACE: Duration = Duration::from_secs(5);
/// How long a revoking release keeps a revoked hold record in place of whatever it
/// found: a grant whose reply timed out can reach Redis after its release (queued on a
/// connection, resent after a reconnect, or written to a connection the server then
/// gave up, which the kernel goes on sending for about 100 s under Linux's defaults,
/// and a partition that heals delivers), and must then grant nothing. A minute was
/// too short for that last case.
pub const REVOKED_FOR: Duration = Duration::from_secs(5 * 60);
/// How often a waiter re-checks a lock whose holder has no TTL, and the longest a
/// waiter that may have been granted without hearing of it waits before it looks: the
/// fallback for a wake-up that went astray.
pub const NO_TTL_RECHECK: Duration = Duration::from_secs(1);
/// The most a fixed lease on the main Redis ends early for its holder, besides a
/// thousandth of the lease (see [`Request::fixed_lease_valid`]).
pub const FIXED_END_EARLY: Duration = Duration::from_millis(100);

/// The kind of lock a request asks for (and a lock is held as).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Reentrant, non-fair (Redisson `RLock`).
    Mutex,
    /// Reentrant, granted in arrival order (Redisson `RFairLock`).
    Fair,
    /// The shared half of a read/write lock (Redisson `RReadLock`).
    Read,
    /// The exclusive half of a read/write lock (Redisson `RWriteLock`).
    Write,
    /// A counting semaphore of `limit` permits.
    Semaphore,
}

impl Kind {
    /// The kind's name in metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Mutex => "mutex",
            Kind::Fair => "fair",
            Kind::Read => "read",
            Kind::Write => "write",
            Kind::Semaphore => "semaphore",
        }
    }
}

/// A checked request for one hold of one lock.
#[derive(Debug)]
pub struct Request {
    /// Keys of the lock.
    pub keys: LockKeys,
    /// The kind asked for.
    pub kind: Kind,
    /// Unset: wait forever; zero: try once.
    pub wait: Option<Duration>,
    /// Fixed lease; unset: the watchdog's lease for the stream's lifetime.
    pub fixed_lease: Option<Duration>,
    /// The reentrancy identity.
    pub owner: String,
    /// The client gave no owner: the owner is this stream's own, so it can reenter no
    /// other stream's hold.
    pub own_owner: bool,
    /// Unique per stream: names the hold record that makes scripts safe to retry.
    pub hold_id: String,
    /// Semaphore permits to take (1 for the other kinds).
    pub permits: u32,
    /// The semaphore's limit (0 for the other kinds).
    pub limit: u32,
    /// A multi-lock's names in the order they are taken (sorted); `keys` is the first.
    /// Empty for a single lock.
    pub multi: Vec<LockKeys>,
    /// For each name of the request, in the client's order, its index in `multi`.
    pub order: Vec<usize>,
    /// Taken on the RedLock deployments instead of the main Redis.
    pub redlock: bool,
    /// Set once a try of this stream failed in Redis: it may have granted a hold, and
    /// it may still be on its way (a command resent after a reconnect). Every release
    /// of the stream then leaves a `revoked` record, so such a try grants nothing when
    /// it comes after the release.
    pub doubted: AtomicBool,
    /// Set once a give-back between two tries of the stream (what a busy multi-lock try
    /// took, a grant its replicas did not acknowledge) had an unknown outcome: it may
    /// still run after a later try of the stream found the hold record it gives back
    /// and took it for its grant, and free that name under the holder. The stream then
    /// tries no more: its wait ends, and its end gives back what it may hold.
    pub gave_back_unknown: AtomicBool,
    /// Set once a try of this stream left a claim in Redis (see `grant_claim` in
    /// `lib.lua`): a release of another server may grant the lock to the stream while it
    /// waits. Its releases forget the claim, and a waiter that leaves gives back what a
    /// claim may have been granted. Registered with [`Locks`] while the stream lives.
    pub claimed: OnceLock<handoff::Claimant>,
    /// Set when the stream was passed the lock in memory (`relay.rs`): the token it was
    /// told, and the signal should Redis not record that pass (the lease is then lost).
    /// A grant of the stream's own try, with another token, does not depend on it.
    pub unconfirmed: OnceLock<(u64, Unrecorded)>,
    /// Set once Redis recorded that pass: the stream's hold record is there from then
    /// on, and the watchdog renews the lease (a renewal before it would find no record).
    pub pass_recorded: AtomicBool,
    /// Set once this stream's release passed its lock on in memory: its hold in Redis
    /// is the relay's from then on (the recording moves it to the next holder, or the
    /// relay gives it back), so the stream's end must not give it back again.
    pub passed_on: AtomicBool,
    /// Set when the stream, passed the lock in memory, took a grant of its own try (or
    /// claim) instead: Redis let it take the lock, so the chain's hold was gone. The
    /// relay gives back nothing for it then: what Redis holds for it is its own grant,
    /// which its stream releases.
    pub own_grant: AtomicBool,
    /// A multi-lock's name (its index in `multi`) that its last try found busy: the
    /// next try takes that name's group first (`multi.rs`).
    pub multi_blocked: AtomicUsize,
    /// How many more tries of a multi-lock go in the sorted order: set when a try out
    /// of order met another holder after taking its first group (`multi.rs`).
    pub multi_sorted_tries: AtomicU8,
    /// A fair waiter's try answered with its place in the queue.
    pub queued: AtomicBool,
    /// When the recording that queued this fair waiter in Redis was sent (`relay.rs`):
    /// it joined behind a chain passed in memory without a try, and its place lasts a
    /// `--fair-wait-timeout` from then.
    pub queued_by_recording: OnceLock<tokio::time::Instant>,
    /// A fair waiter's tries in flight (see [`Place::start_try`]).
    pub trying: AtomicU32,
    /// RedLock tries in a row that took some nodes and gave them back (see
    /// [`Request::retry_pause`]).
    pub gave_back: AtomicU32,
}

impl Request {
    /// The lock's name.
    pub fn name(&self) -> &str {
        self.keys.name()
    }

    /// Records that a try of this stream failed in Redis (see `doubted`).
    pub fn doubt(&self) {
        self.doubted.store(true, Ordering::Release);
    }

    /// Whether a try of this stream failed in Redis.
    pub fn is_doubted(&self) -> bool {
        self.doubted.load(Ordering::Acquire)
    }

    /// Records that a give-back between two tries of this stream had an unknown
    /// outcome (see `gave_back_unknown`).
    pub fn give_back_unknown(&self) {
        self.gave_back_unknown.store(true, Ordering::Release);
    }

    /// Whether the stream may try again after a failed try: not once a give-back
    /// between its tries had an unknown outcome.
    pub fn may_try_again(&self) -> bool {
        !self.gave_back_unknown.load(Ordering::Acquire)
    }

    /// How long a waiter lets a wake wait before its next try: nothing, unless its last
    /// RedLock tries took some nodes and had to give them back. Those give-backs publish
    /// unlock messages that wake it and the other waiters though a majority still holds
    /// the lock; a random pause, doubling from 10 ms to about a second, keeps them from
    /// waking one another in a loop and parts waiters that split the nodes between them
    /// (the Redlock paper's random retry delay).
    pub fn retry_pause(&self) -> Duration {
        let tries = self.gave_back.load(Ordering::Relaxed);
        if tries == 0 {
            return Duration::ZERO;
        }
        let base = Duration::from_millis(10) * (1 << (tries - 1).min(6));
        // Half the base to one and a half times it.
        let random = (uuid::Uuid::new_v4().as_u128() % 1024) as u32;
        base / 2 + base * random / 1024
    }

    /// How long a fixed lease lasts for its holder, counted from the try that granted
    /// it: what `acquired.lease` tells the client, so that the end a client keeps to
    /// without the server's word (a silent partition) is never past the moment the
    /// server frees the lock. A fixed lease ends a tenth of its lease early, at most
    /// [`FIXED_END_EARLY`] and a thousandth of the lease: the release that ends it must
    /// find its hold record live (more than its grace left), or it gives back nothing,
    /// and a hold the owner's other holds keep alive (a write under its own read, one of
    /// a read count, a reentrant hold) outlives the lease. The thousandth: the server
    /// counts the lease on its clock and Redis on its own, and two machines' clocks may
    /// run apart that fast (NTP slews one by up to 500 ppm), which a long lease's 100 ms
    /// would not cover. A RedLock grant ends at least the clock drift allowed early
    /// (Redlock's validity): its holder is told it expired before any node's clock could
    /// free it.
    pub fn fixed_lease_valid(&self) -> Option<Duration> {
        let lease = self.fixed_lease?;
        let mut early = (lease / 10).min(FIXED_END_EARLY + lease / 1000);
        if self.redlock {
            early = early.max(redlock::drift(lease));
        }
        Some(lease.saturating_sub(early))
    }

    /// When a fixed lease granted by a try that started at `from` ends for its holder.
    pub fn fixed_lease_end(&self, from: tokio::time::Instant) -> Option<tokio::time::Instant> {
        from.checked_add(self.fixed_lease_valid()?)
    }

    /// Whether the stream holds a pass in memory (the one told `token`) that Redis has
    /// not recorded yet.
    pub fn awaits_record(&self, token: u64) -> bool {
        self.unconfirmed.get().is_some_and(|(told, _)| *told == token) && !self.pass_recorded.load(Ordering::Acquire)
    }

    /// Whether a try of this fair waiter answered with its place in the queue.
    pub fn is_queued(&self) -> bool {
        self.queued.load(Ordering::Acquire)
    }

    /// Whether a fair waiter is in the queue, with no try of it in flight.
    pub fn is_queued_idle(&self) -> bool {
        self.is_queued() && self.trying.load(Ordering::Acquire) == 0
    }

    /// Whether a try of this stream left a claim.
    pub fn is_claimed(&self) -> bool {
        self.claimed.get().is_some()
    }

    /// A waiter that leaves without a grant gives back what a failed try or a claim may
    /// have granted it.
    pub fn may_hold_unknown(&self) -> bool {
        self.is_doubted() || self.is_claimed()
    }

    /// This stream's claim: `<hold id>\n<lease ms>\n<grace ms>\n<owner>`, what a release
    /// needs to grant it (the hold id names the server: `<server id>:<n>`).
    pub fn claim(&self, lease: Duration) -> String {
        format!(
            "{}\n{}\n{}\n{}",
            self.hold_id,
            millis(lease),
            millis(RECORD_GRACE),
            self.owner
        )
    }

    /// The claim a release of this stream forgets, or "" when it made none.
    pub(crate) fn claim_to_forget(&self, lease: Duration) -> String {
        if self.is_claimed() {
            self.claim(lease)
        } else {
            String::new()
        }
    }

    /// The hash field this request holds: the owner, or `<owner>:write` for a writer.
    pub fn field(&self) -> String {
        match self.kind {
            Kind::Write => format!("{}:write", self.owner),
            _ => self.owner.clone(),
        }
    }

    /// Every lock this request holds: the multi-lock's names, or the one lock.
    pub fn all_keys(&self) -> &[LockKeys] {
        if self.multi.is_empty() {
            std::slice::from_ref(&self.keys)
        } else {
            &self.multi
        }
    }

    /// The keys of name `part` (its index in [`Request::all_keys`]); the first name's
    /// for an index past them.
    pub fn keys_of(&self, part: usize) -> &LockKeys {
        self.all_keys().get(part).unwrap_or(&self.keys)
    }

    /// A grant's fencing tokens in the order of [`Request::all_keys`] (a multi-lock's
    /// tokens come in the client's order); empty for a single name.
    pub fn tokens_by_key(&self, grant: &Grant) -> Vec<u64> {
        if self.multi.is_empty() {
            return Vec::new();
        }
        let mut tokens = vec![0; grant.fencing_tokens.len()];
        for (token, at) in grant.fencing_tokens.iter().zip(&self.order) {
            if let Some(slot) = tokens.get_mut(*at) {
                *slot = *token;
            }
        }
        tokens
    }

    /// The name a busy attempt was blocked on (`Attempt::Busy::blocked`).
    pub fn blocked_name(&self, blocked: usize) -> &str {
        self.all_keys().get(blocked).map_or(self.name(), |k| k.name())
    }

    /// The lock a busy attempt blocked on (`Attempt::Busy::blocked`), as its waiters are
    /// counted ([`crate::limits::Limits::waiter`]).
    pub fn waited(&self, blocked: usize) -> crate::limits::Waited {
        crate::limits::Waited {
            name: self.blocked_name(blocked).to_owned(),
            redlock: self.redlock,
        }
    }

    /// The channel whose messages may let this request proceed, when it was blocked on
    /// its `blocked`-th name.
    pub fn wake_channel(&self, blocked: usize) -> String {
        match self.kind {
            Kind::Mutex => self.keys_of(blocked).channel(),
            Kind::Fair => self.keys.owner_channel(&self.owner),
            Kind::Read | Kind::Write => self.keys.rw_channel(),
            Kind::Semaphore => self.keys.semaphore_channel(),
        }
    }

    /// The lock key of the name `wake_channel(blocked)` is the channel of: channels of
    /// different locks may be one string (a fair lock's owner channel and another
    /// lock's unlock channel, as Redisson names them), and the hub tells them apart.
    pub fn wake_lock(&self, blocked: usize) -> &str {
        match self.kind {
            Kind::Mutex => &self.keys_of(blocked).lock,
            _ => &self.keys.lock,
        }
    }

    /// What the watchdog renews for this hold on its name `part` (its index in
    /// [`Request::all_keys`]; see `renew.lua`). Built as its batch of a round is sent,
    /// and dropped with the call: a round's renewals kept whole would cost the
    /// server some hundreds of bytes more per lease at every round.
    pub fn renewal(&self, part: usize) -> Renewal {
        let keys = self.keys_of(part);
        let (tag, hold, extra) = match self.kind {
            Kind::Mutex | Kind::Fair => ("h", keys.hold(&self.hold_id), String::new()),
            Kind::Write | Kind::Read => {
                let tag = if self.kind == Kind::Write { "w" } else { "r" };
                (tag, keys.hold(&self.hold_id), keys.hold_timeouts(&self.field()))
            }
            Kind::Semaphore => ("s", self.hold_id.clone(), keys.semaphore()),
        };
        Renewal {
            tag,
            lock: keys.lock.clone(),
            hold,
            fence: keys.fence(),
            field: self.field(),
            extra,
        }
    }
}

/// One lease as `renew.lua` takes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Renewal {
    /// `h` (mutex, fair), `w` (write), `r` (read) or `s` (semaphore).
    pub tag: &'static str,
    /// The lock key.
    pub lock: String,
    /// The hold record (the hold id for a semaphore).
    pub hold: String,
    /// The fencing counter.
    pub fence: String,
    /// The owner's hash field.
    pub field: String,
    /// The reader's timeout prefix, or the semaphore hash.
    pub extra: String,
}

/// A granted hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    /// Strictly increasing per lock name (a multi-lock: its first name's, in the
    /// client's order).
    pub fencing_token: u64,
    /// The owner's holds, this one included (a semaphore: the permits taken).
    pub hold_count: u32,
    /// A multi-lock's tokens, one per name in the client's order; empty otherwise.
    pub fencing_tokens: Vec<u64>,
    /// The owner's holds of each name of one script call, in the call's order (a
    /// multi-lock's names of one cluster slot); empty when not read so.
    pub hold_counts: Vec<u32>,
}

impl Grant {
    /// A first hold of one name, granted by a release in its own script (a handoff, or a
    /// claim granted on another server).
    pub fn handed(token: u64) -> Self {
        Self {
            fencing_token: token,
            hold_count: 1,
            fencing_tokens: vec![token],
            hold_counts: vec![1],
        }
    }
}

/// The outcome of one try.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Attempt {
    /// The hold is granted.
    Acquired(Grant),
    /// The lock is busy.
    Busy {
        /// When to check again at the latest (the holder's remaining TTL, or for a
        /// queued fair waiter when it must refresh its place).
        recheck: Option<Duration>,
        /// The fair queue position, counted from 1; 0 when not queued.
        position: u32,
        /// Which of the request's names (in taken order) is busy; 0 for a single lock.
        blocked: usize,
        /// The holder's remaining TTL as the try read it, told a waiter when it is
        /// queued; `None` when unknown (a free lock a fair waiter ahead is to take, a
        /// lock held without a TTL, a waiter lined up in memory).
        holder_ttl: Option<Duration>,
    },
}

/// How a holder passed a lock in memory learns that Redis did not record the pass
/// (`relay.rs`): `broken` is cancelled then, `forced` set first when the recording found
/// the chain's hold broken by a ForceRelease, so that the holder is told
/// `FORCE_RELEASED` as a holder Redis granted would be.
#[derive(Debug, Clone, Default)]
pub struct Unrecorded {
    /// Cancelled when the pass was not recorded.
    pub broken: CancellationToken,
    /// Set before `broken` is cancelled when a ForceRelease broke the pass.
    pub forced: Arc<AtomicBool>,
}

impl Unrecorded {
    /// Tells the holders that Redis did not record their pass, `forced` when a
    /// ForceRelease broke it.
    pub fn break_off(&self, forced: bool) {
        if forced {
            self.forced.store(true, Ordering::Release);
        }
        self.broken.cancel();
    }

    /// Whether a ForceRelease broke the pass, once `broken` is cancelled.
    pub fn forced(&self) -> bool {
        self.forced.load(Ordering::Acquire)
    }
}

/// The lock operations, dispatched by kind.
#[derive(Debug, Clone)]
pub struct Locks {
    backend: Arc<Backend>,
    watchdog_lease: Duration,
    fair_wait: Duration,
    /// Releases and queue departures run off a session's path; shutdown waits for them.
    background: TaskTracker,
    /// Cancelled when the server starts to shut down: RedLock's background releases
    /// make one last call, and the handing on of grants ends.
    stop: CancellationToken,
    /// Local mutex and fair waiters, for releases to hand their lock to.
    lines: Arc<handoff::Lines>,
    /// The main deployment's hub: whether this server still listens on a lock's channel
    /// with nobody waiting (see `grant_claim` in `lib.lua`).
    hub: Hub,
    /// This server's streams with a claim, whose grants it must not give back.
    claimants: Arc<handoff::Claimants>,
    /// Hot locks passed between this server's waiters in memory.
    relay: Arc<relay::Relay>,
    /// Fair waiters of client-named owners, which share a place in the queue.
    shared_places: Arc<fair::SharedPlaces>,
    /// Background calls Redis did not answer, retried by one task.
    unanswered: Arc<Mutex<redo::Unanswered>>,
}

impl Locks {
    /// Lock operations on `backend`, whose waiters listen through `hub`; stream-scoped
    /// leases last `watchdog_lease`, a queued fair waiter stays queued `fair_wait`
    /// without polling; `stop` is the server's shutdown.
    pub fn new(
        backend: Arc<Backend>,
        hub: Hub,
        watchdog_lease: Duration,
        fair_wait: Duration,
        stop: CancellationToken,
    ) -> Self {
        Self {
            backend,
            watchdog_lease,
            fair_wait,
            background: TaskTracker::new(),
            stop,
            lines: Arc::default(),
            hub,
            claimants: Arc::default(),
            relay: Arc::default(),
            shared_places: Arc::default(),
            unanswered: Arc::default(),
        }
    }

    /// The cleanups still running in the background.
    pub fn background(&self) -> &TaskTracker {
        &self.background
    }

    /// Releases `req` in the background, trying again (every Redis timeout, for as
    /// long as the lease could last) until Redis answers: a release that never ran
    /// would leave the hold until its lease ends. (A RedLock release answers once its
    /// nodes did; it retries the nodes that did not itself.) With `unknown` (a grant whose outcome
    /// is unknown: its reply was lost), the release revokes the hold, so the grant
    /// grants nothing if it reaches Redis later.
    /// The first try may hand the lock to a local waiter; the retries never do, so a
    /// long outage does not name (and fail) one waiter after another.
    pub fn release_later(&self, req: Arc<Request>, unknown: bool) {
        self.give_back_later(req, unknown.then_some(GiveBack::Revoke), true);
    }

    /// Gives back, in the background, what a failed recording of the pass in memory to
    /// `req` may have left it in Redis (its hold record with the pass's token), and
    /// nothing should the record hold the stream's own grant: a try of it may have
    /// taken the lock the broken run let go, and Redis alone can tell which came.
    pub fn give_back_pass_later(&self, req: Arc<Request>) {
        self.give_back_later(req, Some(GiveBack::Passed), false);
    }

    /// Retries a release that failed, in the background, as [`Locks::release_later`]
    /// does but without a handoff: the failed release has named a waiter already.
    pub fn retry_release(&self, req: Arc<Request>) {
        self.give_back_later(req, None, false);
    }

    /// Gives back what `giving` says (none: a release, revoking should the stream be in
    /// doubt by then) until Redis answers, for at most a lease of `req`: past it nothing
    /// is held. A revoking one, for at most [`REVOKED_FOR`]: a try of the stream may
    /// still be on its way, as late as its record would stand against it, and take the
    /// lock for a whole lease with nobody holding it (unless thousands of calls wait
    /// already, see [`redo::LONG_GIVE_BACKS_ROOM`]). Only the first call may hand the
    /// lock off. One that fails joins the
    /// other unanswered calls, which one task retries (see [`Locks::redo_later`]): a
    /// standing refusal (an ACL on the lock's keys) or an outage grows no task per
    /// give-back, each calling Redis every Redis timeout for a lease.
    fn give_back_later(&self, req: Arc<Request>, giving: Option<GiveBack>, hand_off: bool) {
        let locks = self.clone();
        self.background.spawn(async move {
            let revokes = matches!(
                giving.unwrap_or_else(|| GiveBack::revoking(req.is_doubted())),
                GiveBack::Revoke | GiveBack::Passed
            );
            let lasts = match revokes && locks.unanswered_len() < redo::LONG_GIVE_BACKS_ROOM {
                true => locks.lease_of(&req).max(REVOKED_FOR),
                false => locks.lease_of(&req),
            };
            let give_up = tokio::time::Instant::now() + lasts;
            if locks.gave_back(&req, giving, hand_off).await != Reply::Done {
                locks.redo_later(Redo::GiveBack { req, giving, give_up });
            }
        });
    }

    /// Gives back once what `giving` says (see [`Locks::give_back_later`]).
    async fn gave_back(&self, req: &Request, giving: Option<GiveBack>, hand_off: bool) -> Reply {
        let giving = giving.unwrap_or_else(|| GiveBack::revoking(req.is_doubted()));
        match self.give_back_as(req, giving, hand_off).await {
            Err(e) if e.retried_by_its_nodes() => Reply::Done,
            given => Reply::of(&given),
        }
    }

    /// Lets a try whose stream went away run to its answer in the background, then
    /// undoes it: a grant is released as [`Locks::release_later`] does (tried again
    /// until Redis answers: nobody renews it, but it would hold the lock for a whole
    /// lease), a fair waiter it queued leaves the queue, and a stream in doubt (this
    /// try or an earlier one failed in Redis, or a RedLock node failed it) gives back
    /// as [`Locks::release_later`] does.
    pub fn undo_later(
        &self,
        call: impl Future<Output = Result<Attempt, Error>> + Send + 'static,
        req: Arc<Request>,
        queued: bool,
    ) {
        let locks = self.clone();
        self.background.spawn(async move {
            match call.await {
                // Revoking, as the stream is gone: never passed on in memory (a replayed
                // handoff grant may hold a run), which its other give-backs could undo.
                Ok(Attempt::Acquired(_)) => {
                    locks.release_later(req, true);
                    return;
                }
                // A failed try may have queued a fair waiter all the same (one that may
                // queue, `queued`): it leaves, if the place is the stream's own to give up
                // (see `QueuePlace`).
                Ok(Attempt::Busy { .. }) | Err(_) if queued && locks.owns_its_place(&req) => {
                    locks.leave_until_answered(req.clone()).await
                }
                Ok(Attempt::Busy { .. }) | Err(_) => {}
            }
            if req.may_hold_unknown() {
                locks.release_later(req, true);
            }
        });
    }

    /// A fair stream that may queue starts waiting (see [`fair::SharedPlaces`]).
    pub fn start_waiting_in_queue(&self, req: &Arc<Request>) {
        if !req.own_owner {
            self.shared_places.enter(req);
        }
    }

    /// A fair stream stops waiting, granted or not: true when its place in the queue is
    /// its own to give up, no other stream of its owner waiting here.
    pub fn stop_waiting_in_queue(&self, req: &Request) -> bool {
        req.own_owner || self.shared_places.leave(req)
    }

    /// Whether another stream of `req`'s client-named owner waits here for its fair lock,
    /// queued. The owner's streams share one place in the queue, which a grant to one of
    /// them took: given back (that one ended before it took the grant, or released it
    /// before the other's try reentered it), the place goes back to the head of the
    /// queue, as it stood, and the lock to the stream still waiting in it. Given back
    /// plainly, it went to the next owner in line, and the waiting stream queued again
    /// at the end. Only for a stream queued (a stream whose first try is under way joins
    /// at the end, as any newcomer), and not while the server stops: its waiters end,
    /// and the place at the head would hold the lock from the others until its deadline.
    fn fellow_waits(&self, req: &Request) -> bool {
        req.kind == Kind::Fair && !req.own_owner && !self.stop.is_cancelled() && self.shared_places.queued_besides(req)
    }

    /// Whether a fair stream that ended may give up its owner's place in the queue: not a
    /// try-once (its try never queues, and the place is another stream's), nor one whose
    /// owner another stream here still waits for.
    fn owns_its_place(&self, req: &Request) -> bool {
        req.wait != Some(Duration::ZERO) && (req.own_owner || !self.shared_places.waiting(&req.keys.lock, &req.owner))
    }

    /// A fair waiter leaves its queue in the background.
    pub fn leave_later(&self, req: Arc<Request>) {
        if self.leaves_with_run(&req) {
            return;
        }
        let locks = self.clone();
        self.background
            .spawn(async move { locks.leave_until_answered(req).await });
    }

    /// Leaves the queue, tried again until Redis answers: a place left behind would
    /// hold up everyone behind it until its deadline, which behind a Redisson waiter
    /// (or a stream of a client-named owner) is minutes away. A leave Redis does not
    /// answer joins the other unanswered calls (see [`Locks::redo_later`]).
    async fn leave_until_answered(&self, req: Arc<Request>) {
        if req.kind != Kind::Fair || self.left(&req).await != Reply::Away {
            return;
        }
        self.redo_later(Redo::Leave(req));
    }

    /// Leaves the queue once: done when Redis answered (or refused: trying again would
    /// not help), or when another stream of its client-named owner waits here again
    /// (the place is that one's now).
    async fn left(&self, req: &Request) -> Reply {
        if !req.own_owner && self.shared_places.waiting(&req.keys.lock, &req.owner) {
            return Reply::Done;
        }
        match Reply::of(&fair::leave(&self.backend, req, self.fair_wait).await) {
            Reply::Away => Reply::Away,
            Reply::Done | Reply::Refused => Reply::Done,
        }
    }

    /// The backend the locks live on.
    pub fn backend(&self) -> &Arc<Backend> {
        &self.backend
    }

    /// The lease a grant of `req` starts with.
    pub fn lease_of(&self, req: &Request) -> Duration {
        req.fixed_lease.unwrap_or(self.watchdog_lease)
    }

    /// Tries once to take the lock. A Redis failure may hide a grant that did happen:
    /// the request is then in doubt ([`Request::doubt`]). (The rare kinds' calls, and
    /// the give-back, are boxed: a future holds its largest branch, and each try's
    /// future is moved once.)
    ///
    /// With `claim` (a waiter whose subscription is in place), a busy single mutex of a
    /// stream-scoped lease leaves a claim, so a release on any server may grant it
    /// directly.
    pub async fn try_acquire(&self, req: &Request, claim: bool) -> Result<Attempt, Error> {
        self.try_as(req, claim, req.wait != Some(Duration::ZERO)).await
    }

    /// Tries once as a try-once does, whether or not `req` may wait: a fair request
    /// does not join the queue when the lock is busy (see [`Locks::try_acquire`]).
    pub async fn try_without_queueing(&self, req: &Request) -> Result<Attempt, Error> {
        self.try_as(req, false, false).await
    }

    /// [`Locks::try_acquire`], a busy fair lock queueing `req` when `queue`.
    async fn try_as(&self, req: &Request, claim: bool, queue: bool) -> Result<Attempt, Error> {
        let lease = self.lease_of(req);
        let attempt = match req.kind {
            Kind::Mutex if req.redlock => Box::pin(redlock::try_acquire(&self.backend, req, lease)).await,
            Kind::Mutex if !req.multi.is_empty() => Box::pin(multi::try_acquire(&self.backend, req, lease)).await,
            Kind::Mutex => {
                let claim = if claim && self.claims(req) {
                    req.claimed.get_or_init(|| self.claimants.enter(&req.hold_id));
                    req.claim(lease)
                } else {
                    String::new()
                };
                mutex::try_acquire(&self.backend, std::slice::from_ref(&req.keys), req, lease, &claim).await
            }
            Kind::Fair => {
                let attempt = fair::try_acquire(&self.backend, req, lease, self.fair_wait, queue).await;
                if matches!(attempt, Ok(Attempt::Busy { position, .. }) if position > 0) {
                    req.queued.store(true, Ordering::Release);
                }
                attempt
            }
            Kind::Read | Kind::Write => read_write::try_acquire(&self.backend, req, lease).await,
            Kind::Semaphore => semaphore::try_acquire(&self.backend, req, lease).await,
        };
        let attempt = match attempt {
            Err(Error::Redis(e)) if foreign_key(&e) => Err(Error::WrongKind {
                name: req.name().to_owned(),
            }),
            other => other,
        };
        // The grant may not survive a failover: give it back rather than hand out a
        // lock that could be granted twice, and to Redis, not to a waiter here (whose
        // grant would go unreplicated alike). As a try that answered, its stream trying
        // again (GiveBack::Retry), though the stream may be in doubt: a waiter in line
        // tries on, and a revoked record (or one that lapsed or was broken while the
        // grant waited for its replicas, left revoked) would answer each of its tries
        // busy; a try of it still on its way that grants later is found by its next
        // try, and its end revokes. A give-back that fails leaves the stream in doubt,
        // so its end gives back again until Redis answers, and ends its wait (see
        // `Request::gave_back_unknown`).
        let unreplicated = matches!(attempt, Err(Error::NotReplicated { .. }));
        let given_back = !unreplicated || Box::pin(self.give_back_as(req, GiveBack::Retry, false)).await.is_ok();
        if !given_back {
            req.give_back_unknown();
        }
        if !given_back || ran_unknown(req, &attempt) {
            req.doubt();
        }
        attempt
    }

    /// Which name of the hold granted `tokens` (both in the order of
    /// [`Request::all_keys`]) a ForceRelease broke, if one did: a token at or below its
    /// lock's break floor. A release that found its hold gone says so whether or not
    /// the break's notice reached this server. RedLock holds, whose nodes keep no floor
    /// of the main Redis, read as not broken.
    pub async fn broken(&self, req: &Request, tokens: &[u64]) -> Option<usize> {
        if req.redlock {
            return None;
        }
        for (part, (keys, token)) in req.all_keys().iter().zip(tokens).enumerate() {
            if self
                .backend
                .break_floor(&keys.broken())
                .await
                .is_some_and(|floor| *token <= floor)
            {
                return Some(part);
            }
        }
        None
    }

    /// Gives back this request's hold; `Ok(false)` when it was no longer held.
    pub async fn release(&self, req: &Request) -> Result<bool, Error> {
        self.give_back(req, false, true).await
    }

    /// Gives back this request's hold; with `revoke` (a grant whose outcome is
    /// unknown, its stream ending), the hold is revoked, so the grant grants nothing if
    /// it reaches Redis later. With `hand_off`, a freed mutex or fair lock may go
    /// straight to a local waiter. (The rare kinds' calls are boxed, as in
    /// [`Locks::try_acquire`].)
    async fn give_back(&self, req: &Request, revoke: bool, hand_off: bool) -> Result<bool, Error> {
        self.give_back_as(req, GiveBack::revoking(revoke || req.is_doubted()), hand_off)
            .await
    }

    /// [`Locks::give_back`], leaving what `giving` says whether or not the stream is in
    /// doubt.
    async fn give_back_as(&self, req: &Request, giving: GiveBack, hand_off: bool) -> Result<bool, Error> {
        let revoke = giving == GiveBack::Revoke;
        match req.kind {
            Kind::Mutex if req.redlock => {
                let retry = redlock::Retry {
                    background: &self.background,
                    stop: &self.stop,
                    lease: self.lease_of(req),
                };
                Box::pin(redlock::release(&self.backend, req, revoke, Some(retry))).await
            }
            Kind::Mutex if !req.multi.is_empty() => Box::pin(multi::release(&self.backend, req, giving)).await,
            Kind::Mutex | Kind::Fair
                if hand_off && giving == GiveBack::Release && self.hands_off(req) && !self.fellow_waits(req) =>
            {
                self.release_handing_off(req).await
            }
            Kind::Mutex | Kind::Fair => {
                self.end_run(req).await;
                self.release_plain(req, giving).await
            }
            Kind::Read | Kind::Write => read_write::release(&self.backend, req, giving).await,
            Kind::Semaphore => semaphore::release(&self.backend, req, revoke).await,
        }
    }

    /// Gives back a single mutex or fair hold without a handoff. The script may grant
    /// a freed mutex to a claim; it learns whether this server's own subscription to the
    /// lock's channel is one with nobody waiting (`Locks::passes_own_over`), and puts a
    /// fair waiter trying again (GiveBack::Retry) back at the head of the queue.
    async fn release_plain(&self, req: &Request, giving: GiveBack) -> Result<bool, Error> {
        let claim = req.claim_to_forget(self.lease_of(req));
        let idle = req.kind == Kind::Mutex && self.passes_own_over(&req.keys.channel());
        let names = std::slice::from_ref(&req.keys);
        let mut holder = mutex::Holder::from(req);
        if giving == GiveBack::Passed {
            holder.passed = req.unconfirmed.get().map(|(token, _)| *token);
        }
        // A queued fair waiter's grant that its replicas did not acknowledge: the waiter
        // goes back to the head of the queue, where the grant took it from. So does the
        // owner of a grant another stream of it waits for here (see `fellow_waits`).
        let retrying = giving == GiveBack::Retry && req.kind == Kind::Fair && req.is_queued();
        if retrying || self.fellow_waits(req) {
            holder.keeps_place = Some(self.fair_wait);
        }
        mutex::release(&self.backend, names, holder, giving, &claim, idle).await
    }

    /// Whether a release of a mutex here tells `release.lua` that this server listens
    /// on the lock's `channel` with nobody waiting (its ARGV[4]), so that the script
    /// passes this server over and grants no claim of its own: its subscription has
    /// nobody but observers on it, or shutdown began and its waiters are ending (a
    /// claim of theirs granted would be given back at once).
    fn passes_own_over(&self, channel: &str) -> bool {
        self.hub.listens_idle(channel) || (self.stop.is_cancelled() && self.hub.listens(channel))
    }

    /// Reads one lock. A key that is not a lock reads as free.
    pub async fn describe(&self, keys: &LockKeys) -> Result<State, Error> {
        describe::describe(&self.backend, keys).await
    }
}

/// Runs an acquire script and reads its reply (`{1, token, count, …}` granted,
/// `{0, ms, position[, i]}` busy on name i, `{2[, i]}` name i is another kind, `{3, limit}`
/// another semaphore limit). `names` are the names the script was given. A foreign key
/// under a name ([`foreign_key`]) refuses the call's first name, so a multi-lock's
/// status names the slot's call that failed, not the request's first name.
async fn acquire(
    backend: &Backend,
    script: &crate::scripts::Script,
    keys: Vec<Key>,
    args: Vec<Value>,
    names: &[LockKeys],
) -> Result<Attempt, Error> {
    let name_at = |i: Option<&i64>| {
        let index = i.and_then(|i| usize::try_from(*i - 1).ok()).unwrap_or(0);
        names.get(index).map_or_else(String::new, |k| k.name().to_owned())
    };
    let reply: Vec<i64> = match backend
        .eval_grant(script, keys, args, |r: &Vec<i64>| r.first() == Some(&1))
        .await
    {
        Err(Error::Redis(e)) if foreign_key(&e) => return Err(Error::WrongKind { name: name_at(None) }),
        reply => reply?,
    };
    match reply.as_slice() {
        [1, token, count, rest @ ..] => Ok(Attempt::Acquired(Grant {
            fencing_token: *token as u64,
            hold_count: *count as u32,
            fencing_tokens: std::iter::once(*token)
                .chain(rest.iter().step_by(2).copied())
                .map(|t| t as u64)
                .collect(),
            hold_counts: std::iter::once(*count)
                .chain(rest.iter().skip(1).step_by(2).copied())
                .map(|c| c as u32)
                .collect(),
        })),
        // The holder's TTL follows the blocking name where the check may come before it
        // (a fair waiter behind another); elsewhere the check is at the holder's end.
        [0, ms, position, rest @ ..] => Ok(Attempt::Busy {
            recheck: ttl_of(*ms),
            position: u32::try_from(*position).unwrap_or(0),
            blocked: rest.first().and_then(|i| usize::try_from(*i - 1).ok()).unwrap_or(0),
            holder_ttl: ttl_of(*rest.get(1).unwrap_or(ms)),
        }),
        [2, rest @ ..] => Err(Error::WrongKind {
            name: name_at(rest.first()),
        }),
        [3, limit] => Err(Error::LimitMismatch {
            name: name_at(None),
            limit: *limit,
        }),
        other => Err(Error::Protocol(format!("{} returned {other:?}", script.name()))),
    }
}

/// A PTTL-like reply as a duration; negative replies (no key, no expiry) have none.
pub(crate) fn ttl_of(pttl: i64) -> Option<Duration> {
    u64::try_from(pttl).ok().map(Duration::from_millis)
}

/// A duration in whole milliseconds, at least 1 (Redis refuses a zero expiry).
pub fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX).max(1)
}

/// The script arguments shared by every acquire: lease, field, grace.
pub fn lease_args(lease: Duration, field: String) -> Vec<Value> {
    vec![
        Value::from(millis(lease)),
        Value::from(field),
        Value::from(millis(RECORD_GRACE)),
    ]
}

/// Whether Redis refused a script over a key of the name's that holds no lock's data: a
/// foreign key under one of latchkey's names, such as a fencing counter holding a list.
/// The scripts meet such a key before their first write, so nothing is left to undo,
/// and no retry does better: the stream ends as on a name held as another kind.
pub(crate) fn foreign_key(e: &fred::error::Error) -> bool {
    let details = e.details().trim_start();
    details.starts_with("WRONGTYPE") || details.contains("value is not an integer")
}

/// Whether a try that came back `attempt` may have taken the lock unseen: it failed in
/// Redis, or its reply could not be read. A try refused before it was sent (its
/// connection's queue full) ran nothing, where its try is a single call: a multi-lock's
/// or RedLock's may have run others before the one refused. (In doubt for nothing, its
/// stream's end queued a revoking give-back: one per stream of clients retrying hard
/// through an outage.)
fn ran_unknown(req: &Request, attempt: &Result<Attempt, Error>) -> bool {
    match attempt {
        Err(Error::Redis(e)) if crate::redis::unsent(e) => req.redlock || !req.multi.is_empty(),
        Err(Error::Redis(_) | Error::Protocol(_)) => true,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use crate::keys::Keys;
    use crate::service::validate;
    use latchkey_proto::v1::Open;
    use std::time::Duration;
    use tokio::time::Instant;

    fn fixed(redlock: bool, lease_ms: i32) -> super::Request {
        let open = Open {
            name: "a".into(),
            redlock,
            lease: Some(prost_types::Duration {
                seconds: (lease_ms / 1000).into(),
                nanos: lease_ms % 1000 * 1_000_000,
            }),
            ..Open::default()
        };
        validate::open(open, &Keys::default(), None, "s:1".into()).unwrap()
    }

    #[test]
    fn a_fixed_lease_ends_for_its_holder_a_little_early() {
        let from = Instant::now();
        let end = |req: super::Request| req.fixed_lease_end(from).unwrap() - from;
        // A tenth early, at most 100 ms and a thousandth.
        assert_eq!(end(fixed(false, 500)), Duration::from_millis(450));
        assert_eq!(end(fixed(false, 5000)), Duration::from_millis(4895));
        assert_eq!(end(fixed(false, 600_000)), Duration::from_millis(599_300));
        // RedLock: as much, or its drift (1% plus 2 ms) when that is more.
        assert_eq!(end(fixed(true, 500)), Duration::from_millis(450));
        assert_eq!(end(fixed(true, 20)), Duration::from_micros(17_800));
        assert_eq!(end(fixed(true, 100_000)), Duration::from_millis(98_998));
    }
}
